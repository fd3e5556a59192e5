"""The replicated dictionary as a hypothesis state machine: the moves' machine
(:mod:`tests.support.moving_dict`) on ``dask worker`` processes with ``replicas=1``, plus a step
that SIGKILLs every process of a random worker's host and starts a new worker in its
place.  After every step the dictionary equals the model: nothing acknowledged lost,
counters exact."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
from distributed import Client
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from dask_ddict import DDict
from dask_ddict.client.workers import scheduler_workers
from tests.support.cluster import local_cluster
from tests.support.moving_dict import MovingDict
from tests.support.polling import poll_for
from tests.support.workers import Workers


class ReplicatedDict(MovingDict):
    workers_: Workers
    kills = 0  # (how many hosts were killed in all examples)

    @initialize()
    def start(self) -> None:  # (MovingDict's, with a replica per manager)
        self.d = DDict(
            managers_per_worker=1, total_mem="48 MiB", client=self.client, timeout=60, replicas=1
        )
        self.stale = DDict.attach(self.d.serialize())  # never asks where managers are
        self.model = {}
        self.workers = sorted(scheduler_workers(self.client))
        self.killed = False

    def teardown(self) -> None:
        """An example whose steps killed no host kills one at its end (a short example,
        or a replayed one, would test no failover), and the model is checked after it."""
        try:
            if hasattr(self, "d") and not self.killed:
                self.kill_a_host(seed=0)
                self.equals_the_model()
        finally:
            super().teardown()

    @rule(seed=st.integers(0, 2**16))
    def kill_a_host(self, seed: int) -> None:
        """SIGKILL a whole worker host (a primary's, a replica's, or both), then start a
        new worker; wait until every manager has its replica again, and every worker can
        take managers (running, its ddict host answering: the moves' rules move there)."""
        c = self.client
        victim = random.Random(seed).choice(self.workers)
        ReplicatedDict.kills += 1
        self.killed = True
        self.workers_.kill(self.workers_.of(c, victim))
        self.workers_.start(1)
        deadline = time.monotonic() + 90
        now: list[str] = []

        def repaired() -> bool:
            now[:] = sorted(scheduler_workers(c))
            layout = self.d._core.fresh(force=True)
            if (
                len(now) == 3
                and victim not in now
                and victim not in layout.manager_workers
                and all(s.replicas == 1 for s in self.d.stats)
            ):
                return True
            assert not any(m.lost for m in layout.managers), layout.managers
            return False

        poll_for(repaired, 90, "failover and repair", 0.2)
        for w in now:  # (within the same 90 s)
            poll_for(
                lambda w=w: _ready(c, w),
                deadline - time.monotonic(),
                f"{w} to take managers",
                0.2,
            )
        self.workers = now


def _ready(c: Client, worker: str) -> bool:
    """Whether ``worker`` runs and its nanny's ddict host answers (what a move needs)."""
    from distributed.core import rpc

    info = scheduler_workers(c).get(worker)
    if info is None or info.get("status") != "running":
        return False

    async def host_info() -> Any:
        async with rpc(info["nanny"]) as r:
            return await r.ddict_host_info()

    try:
        c.sync(host_info)
    except Exception:  # noqa: BLE001 - not yet
        return False
    return True


def _run(max_examples: int, steps: int) -> None:
    with local_cluster(0) as cl, Client(cl) as c:
        w = Workers(cl.scheduler_address)
        try:
            w.start(3)
            c.wait_for_workers(3, timeout=120)
            ReplicatedDict.client, ReplicatedDict.workers_ = c, w
            ReplicatedDict.TestCase.settings = settings(
                max_examples=max_examples,
                stateful_step_count=steps,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            )
            ReplicatedDict.TestCase().runTest()
        finally:
            w.close()


def test_the_replicated_dictionary_with_host_kills_as_steps():
    _run(max_examples=2, steps=12)


@pytest.mark.slow
def test_the_replicated_dictionary_with_host_kills_as_steps_longer():
    ReplicatedDict.kills = 0
    _run(max_examples=6, steps=30)
    assert ReplicatedDict.kills > 0
