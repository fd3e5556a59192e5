"""Leases: the orchestrator's bookkeeping and its answers to renewals, without a cluster.

``cluster.leases`` is pure (its clock injected); the orchestrator's failover and its
answers to a host's renewal (``Replicas.lease``) run here against a fake RPC to the
host supervisors (a partition: calls that fail as an unreachable host's do).  The same
rules on real processes and real partitions: ``tests/test_partitions.py``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from dask_ddict.cluster.failover import Failover
from dask_ddict.cluster.leases import RATE, Leases, verdicts
from dask_ddict.cluster.moves import Candidate, Moves
from dask_ddict.cluster.replicas import Replica, Replicas
from dask_ddict.layout import Layout, ManagerInfo
from dask_ddict.options import DDictOptions
from tests.support.cluster import local_cluster
from tests.support.polling import poll_for


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_lease_is_over_only_after_its_duration_with_rate_and_margin():
    clock = Clock()
    leases = Leases(10.0, 1.0, clock)
    assert leases.ends_at("a") == clock.now  # never granted: holds nothing
    assert leases.grant("a", serving=True) == 10.0
    assert leases.ends_at("a") == pytest.approx(100.0 + 10.0 * RATE + 1.0)
    clock.now += 11.0
    assert leases.left("a") == pytest.approx(10.0 * RATE - 10.0)  # (the rate's part)
    assert leases.overdue() == []
    clock.now += 0.2
    assert leases.overdue() == ["a"]  # ran out without a renewal: a suspect
    leases.grant("a", serving=True)  # (renewed: not any more)
    assert leases.overdue() == []


def test_a_revoked_host_is_granted_nothing_until_restored_and_one_that_ended_holds_nothing():
    clock = Clock()
    leases = Leases(5.0, 0.5, clock)
    leases.grant("a", serving=True)
    leases.revoke("a")
    assert leases.grant("a", serving=True) == 0.0
    assert leases.ends_at("a") == pytest.approx(100.0 + 5.0 * RATE + 0.5)  # (the last grant)
    assert leases.overdue() == []  # (suspected already)
    leases.restore("a")
    assert leases.grant("a", serving=True) == 5.0
    leases.ended("a")  # its host process is known to have ended
    assert leases.ends_at("a") == clock.now and leases.left("a") == 0.0
    # a host that serves no leased primary is never a suspect
    leases.grant("b", serving=False)
    clock.now += 60
    assert leases.overdue() == []


def _info(mid: int, sup: str, term: int = 0, **kw: Any) -> ManagerInfo:
    return ManagerInfo(
        mid,
        "w-" + sup,
        "h-" + sup,
        "m-" + sup,
        1,
        "/s-" + sup,
        "127.0.0.1",
        len(sup),
        f"/d-{sup}-{mid}",
        supervisor=sup,
        term=term,
        **kw,
    )


def _layout(*managers: ManagerInfo, replicas: int = 1) -> Layout:
    return Layout("d", "u", "x", False, DDictOptions(replicas=replicas), managers, 1 << 20)


def test_verdicts_confirm_the_layouts_primary_and_depose_replaced_ones():
    layout = _layout(
        _info(0, "a"),
        _info(1, "b", term=3),
        _info(2, "c", term=1),
        _info(3, "a", term=2, lost=True, lost_why="gone"),
    )
    said = verdicts(
        {"u": layout},
        "a",
        [("u", 0, 0), ("u", 1, 2), ("u", 2, 2), ("u", 3, 2), ("gone", 0, 0), ("u", 9, 0)],
    )
    assert said.confirmed == [("u", 0, 0)]
    # a newer term elsewhere, and a manager given up: deposed, saying where it is
    assert said.deposed == {
        ("u", 1, 2): "h-b (worker w-b)",
        ("u", 3, 2): "nowhere (lost: gone)",
    }
    # manager 2 at term 2 here, the layout still at term 1: a promotion or move under way
    # (pending); an unknown dictionary or manager: no verdict at all
    said = verdicts({"u": layout}, "b", [("u", 1, 3), ("u", 0, 0)])
    assert said.confirmed == [("u", 1, 3)] and said.deposed == {("u", 0, 0): "h-a (worker w-a)"}


class Hosts:
    """The scheduler's RPC to host supervisors, faked: ``cut`` ones fail as unreachable
    hosts do; every call is noted with its time."""

    def __init__(self) -> None:
        self.cut: set[str] = set()
        self.calls: list[tuple[str, str, dict[str, Any], float]] = []

    def __call__(self, address: str) -> Any:
        hosts = self

        class Remote:
            def __getattr__(self, op: str) -> Any:
                async def call(**kw: Any) -> Any:
                    hosts.calls.append((address, op, kw, time.monotonic()))
                    if address in hosts.cut:
                        await asyncio.sleep(0.05)
                        raise OSError(f"Timed out trying to connect to {address}")
                    if op == "ddict_replica_promote":
                        new = _info(kw["manager_id"], address, kw["term"])
                        return [{k: v for k, v in new.__dict__.items() if k != "supervisor"}]
                    return []

                return call

        return Remote()

    def of(self, op: str) -> list[tuple[str, dict[str, Any], float]]:
        return [(a, kw, t) for a, o, kw, t in self.calls if o == op]


def _orchestrator(
    duration: float = 0.3, margin: float = 0.1
) -> tuple[Failover, Hosts, dict[str, Layout], list[Any]]:
    hosts = Hosts()
    layouts = {"d": _layout(_info(0, "a"), _info(1, "b"))}
    spawned: list[Any] = []

    async def candidates(name: str, leaving: str) -> list[Candidate]:
        return []

    def spawn(work: Any) -> None:
        spawned.append(asyncio.ensure_future(work))

    leases, failing = Leases(duration, margin), {}  # type: ignore[var-annotated]
    reps = Replicas(
        hosts,
        layouts,
        Moves(hosts, layouts),
        candidates,
        spawn,
        failing=failing,
        suspected=lambda s: s in leases.revoked,
    )
    reps.of("d")[0] = [
        Replica(0, "w-c", "c", "m-c", {"uds_path": "/s-c", "tcp_host": "127.0.0.1", "tcp_port": 1})
    ]
    reps.of("d")[1] = [Replica(1, "w-a", "a", "m-a", {})]
    return Failover(reps, leases, failing), hosts, layouts, spawned


def _serving(*managers: tuple[int, int]) -> dict[str, Any]:
    return {"serving": [["u", m, t] for m, t in managers], "doubts": [], "aside": []}


def test_a_suspected_primary_is_replaced_only_after_its_lease_and_then_learns_it():
    async def main() -> None:
        reps, hosts, layouts, spawned = _orchestrator()
        granted = reps.lease("a", _serving((0, 0)))
        assert granted["lease"] == 0.3 and granted["confirmed"] == [["u", 0, 0]]
        began = time.monotonic()
        assert reps.suspect("a", "cut off") == {"d": [0]}
        assert "a" in reps.leases.revoked  # type: ignore[union-attr]  # (no more grants)
        await asyncio.gather(*spawned)
        ((_, kw, at),) = hosts.of("ddict_replica_promote")
        assert at - began >= 0.3 * RATE + 0.1 - 0.02  # (not before its lease is surely over)
        assert kw["term"] == 1
        m = layouts["d"].managers[0]
        assert (m.supervisor, m.term, m.lost) == ("c", 1, False)
        assert not reps.failing
        # the old primary renews: deposed (it serves it nowhere now), its shard kept aside
        said = reps.lease("a", _serving((0, 0)))
        assert said["deposed"] == [["u", 0, "h-c (worker w-c)", 0]]
        # the new primary's host renews: confirmed
        assert reps.lease("c", _serving((0, 1)))["confirmed"] == [["u", 0, 1]]
        # the shard aside is discarded once the manager has its replicas again
        aside = {"serving": [], "doubts": [], "aside": [["u", 0, "/d-a-0"]]}
        assert reps.lease("a", aside)["discard"] == []
        reps.replicas.of("d")[0] = [Replica(0, "w-b", "b", "m-b", {})]
        assert reps.lease("a", aside)["discard"] == [["u", 0, "/d-a-0"]]

    asyncio.run(main())


def test_a_suspected_primary_that_renews_before_any_replica_answered_is_reinstated():
    """A partition that cuts the orchestrator from every host (the primary and its
    replica): no promotion succeeds, nothing is marked lost, and the primary serves
    again when it is back."""

    async def main() -> None:
        reps, hosts, layouts, spawned = _orchestrator(duration=0.1, margin=0.05)
        reps.lease("a", _serving((0, 0)))
        hosts.cut |= {"a", "c"}
        reps.suspect("a", "cut off")
        await asyncio.sleep(0.6)  # (the lease is over: the replica is tried, again and again)
        assert len(hosts.of("ddict_replica_promote")) >= 1
        assert not layouts["d"].managers[0].lost and reps.failing == {("d", 0): "a"}
        while ("d", 0) in reps.promoting:  # (not while a promotion's call is under way)
            await asyncio.sleep(0.01)
        said = reps.lease("a", _serving((0, 0)))  # the primary's host is back
        assert said["confirmed"] == [["u", 0, 0]] and said["lease"] == 0.1
        assert reps.failing == {}
        await asyncio.gather(*spawned)
        m = layouts["d"].managers[0]
        assert (m.supervisor, m.term, m.lost) == ("a", 0, False)
        assert [r.supervisor for r in reps.replicas.of("d")[0]] == ["c"]  # (its replica stays)

    asyncio.run(main())


def test_a_replica_that_failed_a_write_leaves_the_set_only_at_its_primarys_word():
    async def main() -> None:
        reps, hosts, layouts, spawned = _orchestrator()
        doubt = {
            "serving": [["u", 0, 0]],
            "doubts": [["u", 0, 0, [["/s-c", "127.0.0.1", 1]]]],
            "aside": [],
        }
        # a host that is not the manager's primary (at that term) cannot drop its replica
        assert reps.lease("b", {**doubt, "serving": []})["dropped"] == []
        assert (
            reps.lease("a", {**doubt, "doubts": [["u", 0, 5, [["/s-c", "127.0.0.1", 1]]]]})[
                "dropped"
            ]
            == []
        )
        assert [r.supervisor for r in reps.replicas.of("d")[0]] == ["c"]
        # nor one that is failing over (its replica may be taking over)
        reps.lease("a", _serving((0, 0)))
        reps.leases.revoke("a")  # type: ignore[union-attr]
        reps.failing[("d", 0)] = "a"
        reps.promoting.add(("d", 0))
        assert reps.lease("a", doubt)["dropped"] == []
        reps.promoting.clear()  # (the promotion's call failed: the primary is back)
        said = reps.lease("a", doubt)
        assert said["dropped"] == [["u", 0, [["/s-c", "127.0.0.1", 1]]]] and said["lease"] > 0
        assert reps.replicas.of("d")[0] == []  # (never promoted now)
        await asyncio.gather(*spawned)
        assert "c" in [a for a, _, _ in hosts.of("ddict_replica_drop")]  # (told, if it hears)
        # with no replica left, the primary's loss is the manager's
        assert reps.suspect("a", "cut off") == {}

    asyncio.run(main())


def test_without_leases_the_orchestrator_says_so():
    hosts = Hosts()
    layouts = {"d": _layout(_info(0, "a"))}

    async def candidates(name: str, leaving: str) -> list[Candidate]:
        return []

    reps = Replicas(hosts, layouts, Moves(hosts, layouts), candidates, lambda w: None)
    assert Failover(reps, None, {}).lease("a", _serving((0, 0))) == {"lease": None}


def test_the_lease_word_a_host_writes_is_what_its_same_host_readers_see(tmp_path):
    from dask_ddict.shard.lease_word import FOREVER, LeaseWord, lease_clock

    host = LeaseWord(str(tmp_path / "lease"), create=True)
    reader = LeaseWord(str(tmp_path / "lease"))
    assert not reader.valid()  # (a new host holds none)
    host.set(lease_clock() + 60)
    assert reader.valid() and reader.until() == pytest.approx(lease_clock() + 60, abs=1)
    host.set(lease_clock() - 0.001)  # (ran out)
    assert not reader.valid()
    host.set(float("inf"))  # (no orchestrator to ask: always)
    assert reader.valid() and reader.until() == pytest.approx(FOREVER)
    LeaseWord(str(tmp_path / "lease"), create=True)  # a new incarnation: none again
    assert not reader.valid()
    with pytest.raises(OSError):
        LeaseWord(str(tmp_path / "absent"))


def test_with_leases_off_a_replicated_dictionary_serves_without_them():
    """``ddict.lease.duration: null`` (read by the scheduler): hosts learn at their first
    renewal that no lease is kept, serve their replicated primaries, and stop renewing;
    a write still reaches the replica (a real cluster)."""
    import dask
    from distributed import Client

    from dask_ddict import DDict

    with (
        dask.config.set({"ddict.lease.duration": None}),
        local_cluster(2) as cl,
        Client(cl) as c,
    ):
        d = DDict(total_mem="32 MiB", client=c, replicas=1, timeout=30)
        try:
            d.update({i: i for i in range(50)})
            assert all(d[i] == i for i in range(50)) and len(d) == 50
            assert (
                c.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins["ddict"].leases)
                is None
            )
            assert all(s.replicas == 1 for s in d.stats)
            # a dictionary made later, on hosts that stopped renewing: served at once
            e = DDict(total_mem="32 MiB", client=c, replicas=1, timeout=5)
            e["k"] = 1
            assert e["k"] == 1
            e.destroy()
        finally:
            d.destroy()


def test_a_batch_put_while_its_hosts_lease_lapsed_waits_for_it_and_loses_nothing():
    """The scheduler stalls (its event loop blocked) for longer than a lease: every host's
    lease lapses.  A batch's records sent meanwhile are held at the host until its next
    renewal is answered, then stored: refused, they would have been lost from the middle
    of the batch, which would end short ("stored 0 of the 77 puts", seen on a busy CI
    machine).  A plain put sent meanwhile waits the same (on the client's side)."""
    import os

    import dask
    from distributed import Client

    from dask_ddict import DDict
    from dask_ddict.shard.lease_word import LeaseWord, path_for

    with (
        dask.config.set({"ddict.lease.duration": "1 s", "ddict.lease.margin": "0.2 s"}),
        local_cluster(2) as cl,
        Client(cl) as c,
    ):
        d = DDict(total_mem="32 MiB", client=c, replicas=1, timeout=60)
        try:
            words = [
                LeaseWord(path_for(os.path.dirname(m.uds_path)))
                for m in {m.uds_path: m for m in d._core.layout.managers}.values()
            ]
            assert len(words) == 2 and all(w.valid() for w in words)
            d.start_batch_put()
            for i in range(100):
                d[("before", i)] = i
            cl.loop.add_callback(time.sleep, 4.0)  # (the scheduler's loop: no renewals)
            poll_for(lambda: not any(w.valid() for w in words), 3.0, "the leases to lapse", 0.05)
            assert not any(w.valid() for w in words), "the leases did not lapse"
            for i in range(100):
                d[("during", i)] = i
            d.end_batch_put()  # (sends the rest now: held until the leases are back)
            assert all(w.valid() for w in words)
            d["plain"] = "after"
            assert all(d[(p, i)] == i for p in ("before", "during") for i in range(100))
            assert len(d) == 201 and d["plain"] == "after"
        finally:
            d.destroy()


def test_a_renewals_verdicts_apply_only_to_the_managers_it_reported():
    """An answer names the terms that its renewal reported: a manager that came back to
    this host under a newer term while the answer was on its way (moved away and back)
    is neither deposed nor confirmed on what was said of the one before; a shard aside
    is discarded only if it is the one the orchestrator judged."""
    from types import SimpleNamespace

    from dask_ddict.host.hosted import HostedDict
    from dask_ddict.host.lease import apply

    def manager(mid: int, term: int) -> Any:
        return SimpleNamespace(manager_id=mid, term=term, shipper=None, store=SimpleNamespace())

    hosted = HostedDict("ab" * 16, "d", "x")
    back, old, fenced = manager(0, 3), manager(1, 1), manager(2, 5)
    hosted.managers.update({0: back, 1: old})
    hosted.fence(fenced, "its move is not in the layout yet")
    deposed: list[Any] = []
    discarded: list[Any] = []
    host = SimpleNamespace(
        dicts={hosted.key: hosted},
        aside={(hosted.uid, 0): "/shm/ddict-d-0-new"},
        depose=lambda uid, m, where: deposed.append((uid, m, where)),
        discard=lambda uid, mid, path: discarded.append((uid, mid, path)),
    )
    apply(
        host,  # type: ignore[arg-type]
        {
            "deposed": [[hosted.uid, 0, "h-b (worker w-b)", 1], [hosted.uid, 1, "h-c", 1]],
            "confirmed": [[hosted.uid, 2, 4]],
            "discard": [[hosted.uid, 0, "/shm/ddict-d-0-old"]],
        },
    )
    assert deposed == [(hosted.uid, old, "h-c")]  # (not the one back under term 3)
    assert hosted.fenced[2][0] is fenced  # (confirmed under term 4: not this one)
    apply(host, {"confirmed": [[hosted.uid, 2, 5]]})  # type: ignore[arg-type]
    assert hosted.managers[2] is fenced and 2 not in hosted.fenced
    assert discarded == [(hosted.uid, 0, "/shm/ddict-d-0-old")]  # (the host compares it)
