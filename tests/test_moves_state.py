"""A hypothesis state machine of the dictionary whose steps include moving managers.

Puts, pops, deletes, ``fetch_add`` and ``update`` from the client and from a stale
handle (one that never asks where managers are, so it meets every move at the old
place and follows it), interleaved with moves of a random manager to a random
worker, evacuations of a worker's host (what its retirement does before it
leaves), moves of every manager at once and batches that span a move; and, in a second
machine, the cluster scaling down (a real retirement) and back up.  After every step the dictionary equals a plain dict.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from distributed import Client, LocalCluster
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dask_ddict import DDict
from dask_ddict.errors import raise_from_wire

keys = st.one_of(st.integers(-50, 50), st.text(max_size=4))
values = st.one_of(st.integers(), st.binary(max_size=64), st.text(max_size=8))


def _cluster() -> LocalCluster:
    return LocalCluster(
        n_workers=3, threads_per_worker=1, dashboard_address=":0", memory_limit="1GiB"
    )


@pytest.fixture(scope="module")
def cluster():
    with _cluster() as cl, Client(cl) as c:
        yield cl, c


class MovingDict(RuleBasedStateMachine):
    client: Client

    @initialize()
    def start(self) -> None:
        self.d = DDict(managers_per_worker=1, total_mem="48 MiB", client=self.client, timeout=30)
        self.stale = DDict.attach(self.d.serialize())  # never asks where managers are
        self.model: dict[Any, Any] = {}
        self.client.wait_for_workers(3, timeout=60)  # (a scaling step may have just run)
        self.workers = sorted(self.client.scheduler_info()["workers"])

    def teardown(self) -> None:
        if hasattr(self, "d"):
            self.stale.detach()
            self.d.destroy()

    def _handle(self, stale: bool) -> DDict:
        return self.stale if stale else self.d

    @rule(k=keys, v=values, stale=st.booleans())
    def put(self, k: Any, v: Any, stale: bool) -> None:
        self._handle(stale)[k] = v
        self.model[k] = v

    @rule(k=keys, stale=st.booleans())
    def pop(self, k: Any, stale: bool) -> None:
        assert self._handle(stale).pop(k, None) == self.model.pop(k, None)

    @rule(k=keys, n=st.integers(-5, 5), stale=st.booleans())
    def fetch_add(self, k: Any, n: int, stale: bool) -> None:
        key = ("counter", k)
        assert self._handle(stale).fetch_add(key, n) == self.model.get(key, 0)
        self.model[key] = self.model.get(key, 0) + n

    @rule(items=st.dictionaries(keys, values, max_size=20), stale=st.booleans())
    def batch_across_a_move(self, items: dict[Any, Any], stale: bool) -> None:
        h = self._handle(stale)
        h.start_batch_put()
        half = len(items) // 2
        for i, (k, v) in enumerate(items.items()):
            if i == half:
                self.move(0, 1)
            h[k] = v
        h.end_batch_put()
        self.model.update(items)

    @rule(mid=st.integers(0, 2), to=st.integers(0, 2))
    def move(self, mid: int, to: int) -> None:
        worker = self.workers[to]
        reply = self.client.sync(
            self.client.scheduler.ddict_move, name=self.d.get_name(), manager_id=mid, worker=worker
        )
        raise_from_wire(reply)
        assert reply is None or reply["target"] == worker

    @rule(w=st.integers(0, 2))
    def evacuate(self, w: int) -> None:
        """A retirement's part here: every manager of worker ``w``'s host moves off it
        (the worker stays, to take managers again later)."""
        nanny = self.client.scheduler_info()["workers"][self.workers[w]]["nanny"]
        said = self.client.sync(
            self.client.scheduler.ddict_evacuate,
            supervisor=nanny,
            why="a step of the state machine",
        )
        assert said["parked"] == 0
        assert self.workers[w] not in self.d._core.fresh(force=True).manager_workers

    @rule()
    def rotate_every_manager(self) -> None:
        for mid in range(self.d.num_managers):
            self.move(
                mid,
                (self.workers.index(self.d._core.fresh(force=True).managers[mid].worker) + 1)
                % len(self.workers),
            )

    @invariant()
    def equals_the_model(self) -> None:
        if hasattr(self, "d"):
            assert dict(self.stale.items()) == self.model
            assert len(self.d) == len(self.model)


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
        deadline = time.monotonic() + 60
        while (
            len(c.scheduler_info()["workers"]) != 2
            or len(set(self.d._core.fresh(force=True).manager_workers)) != 2
        ):
            assert time.monotonic() < deadline, "did not scale down"
            time.sleep(0.1)
        self.cluster.scale(3)
        c.wait_for_workers(3, timeout=60)
        self.workers = sorted(c.scheduler_info()["workers"])
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
