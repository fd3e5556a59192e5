"""A hypothesis state machine of the dictionary whose steps include moving managers.

Puts, pops, deletes, ``fetch_add`` and ``update`` from the client and from a stale
handle (one that never asks where managers are, so it meets every move at the old
place and follows it), interleaved with moves of a random manager to a random
worker, evacuations of a worker's host (what its retirement does before it
leaves), moves of every manager at once and batches that span a move; and, in a second
machine, the cluster scaling down (a real retirement) and back up.  After every step the dictionary equals a plain dict.
"""

from __future__ import annotations

import pytest
from distributed import Client, LocalCluster
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from dask_ddict.client.workers import scheduler_workers
from tests.support.cluster import local_cluster
from tests.support.moving_dict import MovingDict
from tests.support.polling import poll_for


def _cluster() -> LocalCluster:
    return local_cluster(3, memory_limit="1GiB")


@pytest.fixture(scope="module")
def cluster():
    with _cluster() as cl, Client(cl) as c:
        yield cl, c


def test_the_dictionary_with_moves_as_steps(cluster):
    cl, c = cluster
    MovingDict.client = c
    MovingDict.TestCase.settings = settings(
        max_examples=6,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    MovingDict.TestCase().runTest()


class ScalingDict(MovingDict):
    """:class:`MovingDict`, and the cluster scales down (a worker retires: its managers
    move first) and back up (the new worker gets managers with ``rebalance()``)."""

    cluster: LocalCluster

    scalings = 0

    @precondition(lambda self: self.scalings < 1)  # (one a run, at a random step: ~2-3 s each)
    @rule(rebalance=st.booleans())
    def scale_down_and_up(self, rebalance: bool) -> None:
        self.scalings += 1
        c = self.client
        self.cluster.scale(2)
        poll_for(
            lambda: (
                len(scheduler_workers(c)) == 2
                and len(set(self.d._core.fresh(force=True).manager_workers)) == 2
            ),
            60,
            "the scale down to two workers, serving every manager",
            0.1,
        )
        self.cluster.scale(3)
        c.wait_for_workers(3, timeout=60)
        self.workers = sorted(scheduler_workers(c))
        if rebalance:
            self.d.rebalance()
            assert len(set(self.d.manager_workers)) == 3


def test_the_dictionary_with_scaling_as_steps():
    with _cluster() as cl, Client(cl) as c:
        ScalingDict.client, ScalingDict.cluster = c, cl
        ScalingDict.TestCase.settings = settings(
            max_examples=5,
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        ScalingDict.TestCase().runTest()
