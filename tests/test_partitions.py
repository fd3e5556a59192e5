"""Partitions: nothing acknowledged is lost, and no two hosts answer for one manager.

Four machines on this one (``tests/support/machines.py``): ``s`` runs the scheduler and a worker,
``a`` and ``b`` a worker each, ``c`` the clients.  A dictionary with ``replicas=1``;
two writer processes on ``c`` put keys on every manager and ``fetch_add`` one counter
of the manager ``M`` whose primary is on ``b`` and whose replica is on ``a`` (or the
other way round, as the placement fell: ``P`` and ``R`` below),
recording every acknowledgement.  Then a partition, healed after the failover it
causes (or, for a replica cut from its primary, after the replica was dropped) and,
in the same test, once more before one: Jepsen's scenarios for Redis, Kafka and etcd.

Every acknowledged put must read back; the counter's acknowledged old values must
all differ (two primaries answering at once would hand out the same values); and a
deposed primary, once healed, answers ``MOVED``, never serving again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from distributed import Client

from dask_ddict import DDict
from dask_ddict._hashing import key_digest
from dask_ddict._keys import encode_key
from dask_ddict.errors import DDictLeaseError, DDictManagerMovedError
from dask_ddict.layout import Layout, ManagerInfo
from dask_ddict.transport.ops import Get
from dask_ddict.transport.socket_client import HostLink
from tests.support import twohost
from tests.support.machines import Machines, S
from tests.support.partitioned import (
    Writers,
    check,
    hosts_ready,
    hot_manager,
    primary_of,
    settled,
    wait,
    where,
)
from tests.support.polling import poll_for

pytestmark = pytest.mark.skipif(
    twohost.unavailable() is not None, reason=f"machines fixture: {twohost.unavailable()}"
)

#: The orchestrator's and hosts' settings: short leases; a failover comes about
#: ``duration * 1.01 + margin`` plus a probe after a host's last renewal (about 7 s), so
#: that a partition healed after 3.5 s heals before one (the lease lapsed meanwhile).
SETTINGS = {
    "DASK_DDICT__LEASE__DURATION": "2s",
    "DASK_DDICT__LEASE__MARGIN": "3s",
    "DASK_DDICT__HOST__PROBE_TIMEOUT": "2s",
    "DASK_DDICT__REPLICA__TIMEOUT": "2s",
    "DASK_DDICT__FAILOVER_TIMEOUT": "40s",
}
BEFORE = 3.5  # seconds a partition lasts when it heals before a failover


@pytest.fixture(scope="module")
def machines():
    with Machines(env=SETTINGS) as ms:
        with Client(ms.scheduler_address, timeout=60) as c:
            hosts_ready(c, 3)
            yield ms, c


@pytest.fixture()
def dictionary(machines):
    """A replicated dictionary on ``s``, ``a`` and ``b`` (two managers each), ``M`` (a
    manager whose primary is on ``b`` and whose replica is on ``a``, or the other way
    round), and the machines of its primary and its replica."""
    ms, c = machines
    for m in (S, "a", "b"):  # (a worker of an earlier test's partition may have closed)
        if f"worker-{m}" not in ms.procs or ms.procs[f"worker-{m}"].poll() is not None:
            ms.start_worker(m)
    hosts_ready(c, 3)
    d = DDict(
        managers_per_worker=2,
        total_mem="96 MiB",
        client=c,
        replicas=1,
        timeout=30,
        lifetime="cluster",
    )
    try:
        settled(c, d)
        yield d, *hot_manager(c, d)
    finally:
        ms.heal()
        d.destroy()


def _answers_moved(layout: Layout, old: ManagerInfo, mid: int, bound: float = 20.0) -> None:
    """The deposed primary's host at ``old`` (reached from here, after the heal) answers
    its manager's requests ``MOVED`` within ``bound``: never served there again."""
    link = HostLink(old, layout.uid, layout.secret, layout.name, use_uds=False)
    digest = key_digest(encode_key("hot"))

    def moved() -> bool:
        try:
            link.call(Get(digest, 0, timeout=5.0), mid)
        except DDictManagerMovedError:
            return True
        except DDictLeaseError:  # (not renewed yet: it learns it at its next renewal)
            return False
        raise AssertionError("the deposed primary served its old manager")

    try:
        poll_for(moved, bound, "the old primary to learn it was deposed", 0.2)
    finally:
        link.close()


def _run(
    ms: Machines,
    d: DDict,
    hot: int,
    cut: list[tuple[str, str]],
    run: str,
    heal: float | Callable[[], bool] = BEFORE,
) -> None:
    """Writers, then the partition ``cut``, healed after ``heal`` seconds, or once
    ``heal()`` (within a minute, and a second more); writers go on for a lease and more;
    every check."""
    writers = Writers(ms, d, hot, run)
    time.sleep(2.0)
    for one, other in cut:
        ms.cut(one, other)
    if callable(heal):
        wait("the change the partition makes", heal)
        time.sleep(1.0)  # (writes go to the new place meanwhile)
    else:
        time.sleep(heal)
    ms.heal()
    healed = time.time()
    # a request sent into the partition goes out again at its connection's next
    # retransmission, which TCP's backoff puts up to about as long after the heal as the
    # partition lasted: the first write after the heal is waited for, not timed
    wait("a write after the heal", lambda: writers.acknowledged("add", healed))
    time.sleep(5.0)
    records = writers.join()
    check(d, hot, run, records, healed + 3.0)  # (converged a lease after the heal)


def _revoked(dask_scheduler: Any) -> list[str]:
    return sorted(dask_scheduler.plugins["ddict"].leases.revoked)


def _suspected(c: Client) -> list[str]:
    """The supervisors whose hosts the orchestrator suspects now (no lease granted)."""
    return c.run_on_scheduler(_revoked)


def _failed_over(d: DDict, mid: int) -> Callable[[], bool]:
    """Whether manager ``mid`` failed over since this was called."""
    before = {m["at"] for m in d.moves}
    return lambda: any(
        m["why"].startswith("failover") and m["manager_id"] == mid and m["at"] not in before
        for m in d.moves
    )


def test_a_primary_cut_from_the_scheduler_and_its_replica_but_not_its_clients(machines, dictionary):
    """The scenario of the issue: ``b`` is cut from ``s`` and ``a``; the clients on ``c``
    still reach it.  It acknowledges nothing without its replica: its writes wait.
    Healed before a failover, it serves on (its lease lapsed meanwhile, and is granted
    again).  Healed after one (a's replica took over once b's lease was surely over,
    and the clients followed), b answers ``MOVED`` and never serves it again."""
    ms, c = machines
    d, hot, p, r = dictionary
    old = primary_of(d, hot)
    _run(ms, d, hot, [(p, S), (p, r)], "x")
    assert primary_of(d, hot) == old and not d.moves
    _run(ms, d, hot, [(p, S), (p, r)], "y", _failed_over(d, hot))
    now = primary_of(d, hot)
    assert now.term == old.term + 1 and now.supervisor != old.supervisor
    _answers_moved(d._core.layout, old, hot)


def test_a_primary_cut_from_the_scheduler_only(machines, dictionary):
    """``b`` is cut from ``s`` alone: it still reaches its replica on ``a`` and its clients,
    but without a lease it acknowledges nothing; the orchestrator promotes a's replica
    (which it reaches) once b's lease is surely over."""
    ms, c = machines
    d, hot, p, r = dictionary
    old = primary_of(d, hot)
    _run(ms, d, hot, [(p, S)], "x")
    assert primary_of(d, hot) == old and not d.moves
    _run(ms, d, hot, [(p, S)], "y", _failed_over(d, hot))
    assert primary_of(d, hot).term == old.term + 1
    _answers_moved(d._core.layout, old, hot)


def test_a_replica_cut_from_its_primary_only(machines, dictionary):
    """``a`` (``M``'s replica) is cut from ``b`` (its primary) alone.  Healed within the
    replica's timeout, nothing changes.  After it, the primary asks the orchestrator to
    take the replica out of the set (never promoted now), acknowledges again, and a new
    replica is made; the primary stays."""
    ms, c = machines
    d, hot, p, r = dictionary
    old = primary_of(d, hot)
    replica = where(c, d)[1][hot]
    _run(ms, d, hot, [(r, p)], "x", 1.0)  # (within ddict.replica.timeout: 2 s)
    assert where(c, d)[1][hot] == replica
    _run(ms, d, hot, [(r, p)], "y", lambda: where(c, d)[1][hot] != replica)
    assert primary_of(d, hot) == old and not d.moves


def test_the_scheduler_cut_from_everyone(machines, dictionary):
    """``s`` (the scheduler, and one worker) is cut from every other machine.  No host
    but ``s``'s renews its lease: the others' primaries stop answering.  Healed before
    the orchestrator suspects them, they serve on.  Healed after it suspected them (and
    the primaries with a replica on ``s``, if any, failed over to it): ``M``, whose
    replica is on ``a`` (as cut off as ``b``), waited, never lost, and stays at ``b`` if
    ``b`` renews first."""
    ms, c = machines
    d, hot, p, r = dictionary
    old = primary_of(d, hot)
    cut = [(S, "a"), (S, "b"), (S, "c")]
    _run(ms, d, hot, cut, "x")
    assert primary_of(d, hot) == old and not d.moves
    machine_of, reps = where(c, d)
    onto_s = [
        m.manager_id
        for m in d._core.layout.managers
        if machine_of[m.worker] != S and machine_of[reps[m.manager_id][0]] == S
    ]
    failed_over = _failed_over(d, onto_s[0]) if onto_s else lambda: True
    _run(ms, d, hot, cut, "y", lambda: old.supervisor in _suspected(c) and failed_over())
    # b renewed before a's replica answered (reinstated), or a's answered first (a
    # promotion that was under way when the partition healed): one primary either way
    now = primary_of(d, hot)
    assert not now.lost
    if now.term != old.term:
        assert now.term == old.term + 1 and now.supervisor != old.supervisor
        _answers_moved(d._core.layout, old, hot)
