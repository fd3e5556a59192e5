"""Replicas: a host killed suddenly loses nothing acknowledged.

Real clusters whose workers are ``dask worker`` processes (each with its own nanny,
so that every process of a worker's host can be SIGKILLed: nanny, worker, host
process and its supervisor); writers (client threads and tasks) put and
``fetch_add`` throughout, and afterwards every acknowledged write reads back and
counters are exact.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import psutil
import pytest
from distributed import Client

from dask_ddict import DDict
from dask_ddict.client.workers import scheduler_workers
from dask_ddict.cluster.moves import Candidate
from dask_ddict.cluster.replicas import Replica, replica_targets
from dask_ddict.errors import DDictManagerUnavailableError, raise_from_wire
from dask_ddict.layout import ManagerInfo
from tests.support.cluster import local_cluster
from tests.support.polling import poll_for
from tests.support.workers import Workers
from tests.support.writers import check_writes, with_writers

# -- pure placement ----------------------------------------------------------------------


def _primary(supervisor: str, host: str) -> ManagerInfo:
    return ManagerInfo(
        0, "w-" + supervisor, "h", host, 1, "/s", "127.0.0.1", 1, "/d", supervisor=supervisor
    )


def test_replicas_go_to_other_machines_then_the_least_loaded_host_processes():
    c = [
        Candidate("wa", "a", "m1", 0, 3),
        Candidate("wb", "b", "m1", 0, 0),
        Candidate("wc", "c", "m2", 0, 9),
        Candidate("wd", "d", "m3", 0, 1),
    ]
    # never the primary's own host process; another machine first, the least loaded
    got = replica_targets(c, _primary("a", "m1"), [], {"d": 2})
    assert [t.supervisor for t in got] == ["c", "d", "b"]
    # a second replica avoids the machine of the first too
    first = Replica(0, "wc", "c", "m2", {})
    assert [t.supervisor for t in replica_targets(c, _primary("a", "m1"), [first], {})] == [
        "d",
        "b",
    ]
    # one machine: other host processes, the least loaded first
    one = [Candidate(f"w{i}", f"s{i}", "m", 0, 0) for i in range(3)]
    assert [t.supervisor for t in replica_targets(one, _primary("s0", "m"), [], {"s1": 4})] == [
        "s2",
        "s1",
    ]


class _Supervisors:
    """The scheduler's RPC to host supervisors, faked: every call is noted; one to a
    supervisor in ``dead`` fails as a dead host's does (after the connect timeout)."""

    def __init__(self, dead: set[str]) -> None:
        self.dead, self.calls = dead, []
        self.during: dict[tuple[str, str], Any] = {}  # (address, op): run as it is called

    def __call__(self, address: str) -> Any:
        fake = self

        class Remote:
            def __getattr__(self, op: str) -> Any:
                async def call(**kw: Any) -> Any:
                    fake.calls.append((address, op))
                    fake.during.pop((address, op), lambda: None)()
                    if address in fake.dead:
                        raise OSError(f"Timed out trying to connect to {address} after 30 s")
                    return {
                        "ddict_replica_hold": {"spec": {}, "used_bytes": 0, "map_size": 0},
                        "ddict_replica_seed": {"tcp_port": 1},  # (what its primary
                        "ddict_replica_targets": [[None, None, 1]],  # ships to)
                    }.get(op, [])

                return call

        return Remote()


def test_placement_and_failover_never_call_a_lost_host():
    """A placement that began before hosts were lost (a worker joined as another died)
    skips the managers whose primary was there and never seeds onto one; a failover's
    clean-up does not call a lost primary; a replica whose host is lost while it is
    seeded is not kept. Each call to a dead host waits out the connect timeout (30 s),
    while the dictionary's other placements wait behind it."""
    import asyncio

    from dask_ddict.cluster.failover import Failover
    from dask_ddict.cluster.moves import Moves
    from dask_ddict.cluster.replicas import Replicas
    from dask_ddict.layout import Layout
    from dask_ddict.options import DDictOptions

    def info(mid: int, sup: str) -> ManagerInfo:
        return ManagerInfo(mid, "w-" + sup, "h", "m", 1, "/s", "127.0.0.1", 1, "/d", supervisor=sup)

    rpc = _Supervisors({"b", "c"})
    layouts = {
        "d": Layout(
            "d", "u", "x", False, DDictOptions(replicas=1), (info(0, "a"), info(1, "b")), 1 << 20
        )
    }
    spawned: list[Any] = []
    moves = Moves(rpc, layouts)

    async def candidates(name: str, leaving: str) -> list[Candidate]:
        return [Candidate("w-" + s, s, "m", 0, 0) for s in "bcd"]  # (not told yet)

    failing: dict[tuple[str, int], str] = {}
    reps = Replicas(rpc, layouts, moves, candidates, spawned.append, failing=failing)
    failover = Failover(reps, None, failing)
    reps.of("d")[1] = [Replica(1, "w-c", "c", "m", {})]  # (manager 1's replica: host c)

    async def main() -> None:
        failover.host_lost("c", "killed")  # (a host with a replica alone)
        failing = failover.host_lost("b", "killed")  # (then manager 1's primary's)
        assert failing == {}  # (its replica went with c: nothing to fail over to)
        assert await reps.place("d") == 1  # manager 0's replica, on d
        assert reps.of("d")[0][0].supervisor == "d"
        await asyncio.gather(*spawned)
        # a host lost while a replica was seeded onto it: that one is not kept (its
        # primary is told to stop shipping to it), and the next target takes it
        layouts["e"] = Layout(
            "e", "v", "x", False, DDictOptions(replicas=1), (info(0, "a"),), 1 << 20
        )
        reps.joined("b", "w-b2")  # (a worker's host at b joined again)
        rpc.dead.discard("b")
        rpc.during[("b", "ddict_replica_seed")] = lambda: failover.host_lost("b", "killed")
        calls = len(rpc.calls)
        assert await reps.place("e") == 1
        assert [r.supervisor for r in reps.of("e")[0]] == ["d"]
        assert ("b", "ddict_replica_seed") in rpc.calls[calls:]
        assert rpc.calls[calls:].count(("a", "ddict_replica_targets")) == 3  # (2 seeds, 1 detach)

    asyncio.run(main())
    assert not [call for call in rpc.calls if call[0] == "c"], rpc.calls
    assert [call for call in rpc.calls if call[0] == "b"] == [("b", "ddict_replica_seed")]
    # a nanny restarted its worker at a new address: its replicas are checked with that one
    assert reps.supervisors_for("w-d") == {"d"}
    reps.joined("d", "w-d2")
    assert reps.supervisors_for("w-d") == set() and reps.supervisors_for("w-d2") == {"d"}
    assert {r.worker for per in reps.placed.values() for rs in per.values() for r in rs} == {"w-d2"}


# -- a cluster of dask worker processes ----------------------------------------------------


@pytest.fixture
def workers3():
    with local_cluster(0) as cl, Client(cl) as c:
        w = Workers(cl.scheduler_address)
        try:
            w.start(3)
            c.wait_for_workers(3, timeout=120)
            yield c, w
        finally:
            w.close()


def _failed_over(d: DDict, worker: str, bound: float = 60.0) -> None:
    """Wait until no manager is served for ``worker`` and every manager has a replica."""

    def repaired() -> bool:
        layout = d._core.fresh(force=True)
        assert not any(m.lost for m in layout.managers), layout.managers
        return worker not in layout.manager_workers and all(s.replicas >= 1 for s in d.stats)

    def how() -> str:
        layout = d._core.fresh(force=True)
        stats = [(s.manager_id, s.worker, s.replicas) for s in d.stats]
        return f"failover and repair from {worker}: {layout.manager_workers}, stats {stats}"

    poll_for(repaired, bound, how, 0.2)


def test_a_host_killed_under_writers_loses_nothing_acknowledged(workers3):
    c, w = workers3
    d = DDict(managers_per_worker=2, total_mem="96 MiB", client=c, timeout=60, replicas=1)
    try:
        assert all(s.replicas == 1 for s in d.stats)
        d.update({i: i for i in range(300)})
        rng = random.Random()
        first = rng.choice(sorted(set(d.manager_workers)))
        stay = sorted(set(scheduler_workers(c)) - {first})
        proc = w.of(c, first)

        def kill() -> None:
            time.sleep(rng.uniform(0.0, 1.0))  # (at a random moment of the writes)
            began = time.monotonic()
            w.kill(proc)
            _failed_over(d, first)
            assert time.monotonic() - began < 30  # (ddict.failover-timeout)

        with_writers(c, d, stay, kill)
        assert all(d[i] == i for i in range(300))
        assert [m for m in d.moves if m["why"].startswith("failover")]
        # after the repair, a second host's loss is survived too
        second = d.manager_workers[0]
        w.kill(w.of(c, second))
        _failed_over_to_one(d, second)
        assert all(d[i] == i for i in range(300))
        check_writes(d, [], [])  # every manager takes new puts
    finally:
        d.destroy()


def _failed_over_to_one(d: DDict, worker: str, bound: float = 60.0) -> None:
    """The last worker serves every manager (no other can keep a replica)."""
    poll_for(
        lambda: worker not in d._core.fresh(force=True).manager_workers,
        bound,
        f"failover from {worker}",
        0.2,
    )
    assert not any(m.lost for m in d._core.layout.managers)


@pytest.mark.slow
def test_without_replicas_a_killed_host_loses_its_managers(workers3):
    """The baseline the replicas remove: the same kill, and the managers are lost."""
    c, w = workers3
    d = DDict(managers_per_worker=1, total_mem="48 MiB", client=c, timeout=30)
    try:
        d.update({i: i for i in range(60)})
        victim = d.manager_workers[0]
        w.kill(w.of(c, victim))
        poll_for(lambda: d._core.fresh(force=True).managers[0].lost, 60, "manager 0 lost", 0.2)
        with pytest.raises(DDictManagerUnavailableError):
            d.manager(0)["x"] = 1
    finally:
        d.destroy()


def test_replicas_are_checked_against_the_cluster(workers3):
    c, _ = workers3
    with pytest.raises(ValueError, match="replicas=3 needs at least 4 workers"):
        DDict(total_mem="48 MiB", client=c, replicas=3)
    for bad, err in [(-1, ValueError), (9, ValueError), ("1", TypeError), (True, TypeError)]:
        with pytest.raises(err, match="replicas"):
            DDict(total_mem="48 MiB", client=c, replicas=bad)


def _key_on(d: DDict, mid: int, prefix: str) -> str:
    """A key that manager ``mid`` holds."""
    for i in range(10_000):
        if d.which_manager(f"{prefix}{i}") == mid:
            return f"{prefix}{i}"
    raise AssertionError(f"no key of manager {mid}")


def test_failover_during_a_wait_a_batch_and_a_persist(workers3, tmp_path):
    """A reader waiting at the lost primary (``wait_for_keys``) is answered by the new
    one; a batch whose records went to the lost host is completed; persisted checkpoints
    and pending persists survive."""
    c, w = workers3
    d = DDict(
        managers_per_worker=1,
        total_mem="96 MiB",
        client=c,
        timeout=60,
        replicas=1,
        working_set_size=2,
        wait_for_keys=True,
        persist_path=str(tmp_path / "store"),
        persist_count=-1,
    )
    try:
        victim = d.manager_workers[0]
        late = _key_on(d, 0, "late")
        d.pput("const", "kept")
        d.update({("before", i): i for i in range(200)})
        d.persist()
        d.sync()
        waiting = c.submit(lambda h, k: h[k], d, late, pure=False, workers=[d.manager_workers[1]])
        probe = DDict.attach(d.serialize(), timeout=60)  # reads the shard here directly
        assert late not in probe and ("before", 3) in probe
        d.start_batch_put()
        for i in range(300):
            d[("batch", i)] = i
            if i == 150:
                time.sleep(0.3)
                assert not waiting.done()
                w.kill(w.of(c, victim))
        d.end_batch_put()
        d[late] = "written after the failover"
        assert waiting.result(timeout=60) == "written after the failover"
        assert late in probe and probe[late] == "written after the failover"  # (followed)
        probe.detach()
        assert all(d[("batch", i)] == i for i in range(300))
        assert all(d[("before", i)] == i for i in range(200)) and d["const"] == "kept"
        assert victim not in d.manager_workers
        d.sync()
        assert d.persisted_ids() == [0]
        d.restore(0)  # the new primary reads the checkpoint its predecessor persisted
        assert d[("before", 7)] == 7 and ("batch", 7) not in d
    finally:
        d.destroy()


def test_a_batch_across_a_failover_lands_whole_and_in_order(workers3):
    """A batch whose manager's host is lost in its middle, each key written again on
    both sides of the loss: the records its old host never stored and every later one
    are sent where the manager went, in their order (held until the end, not sent ahead
    of the older ones), so the batch ends without an error and each key reads its last
    value."""
    c, w = workers3
    d = DDict(managers_per_worker=1, total_mem="96 MiB", client=c, timeout=60, replicas=1)
    try:
        victim = d.manager_workers[0]
        keys = [_key_on(d, 0, f"k{j}-") for j in range(50)]
        d.start_batch_put()
        for rnd in range(40):
            for k in keys:
                d[k] = (rnd, "x" * 200)  # (about 13 KB a round: many messages)
            if rnd == 20:
                time.sleep(0.3)
                w.kill(w.of(c, victim))
        d.end_batch_put()
        assert {k: d[k][0] for k in keys} == dict.fromkeys(keys, 39)
        assert victim not in d.manager_workers
    finally:
        d.destroy()


@pytest.mark.slow
def test_a_restarted_host_process_gets_its_replicas_again(workers3):
    """The host process alone dies (its supervisor restarts it over its shards): the
    replicas it kept, and those of its managers (which may lack its last write), are made
    again, so a later loss of the whole host still loses nothing."""
    c, w = workers3
    d = DDict(managers_per_worker=1, total_mem="96 MiB", client=c, timeout=60, replicas=1)
    try:
        d.update({i: i for i in range(200)})
        victim = d.manager_workers[0]
        old = d.stats[0].pid
        psutil.Process(old).kill()
        stats: list[Any] = []

        def restarted() -> bool:  # a new incarnation, and every manager with its replica again
            try:
                stats[:] = d.stats
            except Exception:  # noqa: BLE001 - (restarting)
                stats[:] = []
            return bool(stats) and stats[0].pid != old and all(s.replicas == 1 for s in stats)

        poll_for(restarted, 60, lambda: [(s.pid, s.replicas) for s in stats], 0.3)
        d.update({i: -i for i in range(200)})
        w.kill(w.of(c, victim))
        _failed_over(d, victim)
        assert all(d[i] == -i for i in range(200))
    finally:
        d.destroy()


def test_retirement_keeps_primaries_and_replicas_on_different_hosts(workers3):
    c, w = workers3
    d = DDict(managers_per_worker=2, total_mem="96 MiB", client=c, timeout=60, replicas=1)
    try:
        d.update({i: i for i in range(300)})
        leaving = d.manager_workers[0]
        stay = sorted(set(scheduler_workers(c)) - {leaving})

        def retire() -> None:
            c.retire_workers([leaving])
            poll_for(
                lambda: (
                    leaving not in scheduler_workers(c)
                    and not any(leaving in ws for ws in _replica_workers(c, d).values())
                ),
                60,
                f"{leaving} gone, with its replicas",
                0.2,
            )

        with_writers(c, d, stay, retire)
        assert all(d[i] == i for i in range(300))
        _apart(c, d)
        w.start(1)  # a new worker: the managers spread again, still apart
        c.wait_for_workers(3, timeout=120)
        d.rebalance()
        _apart(c, d)
        assert len(set(d.manager_workers)) == 3
        assert all(d[i] == i for i in range(300))
    finally:
        d.destroy()


def _replica_workers(c: Client, d: DDict) -> dict[int, tuple[str, ...]]:
    return {
        int(k): tuple(v) for k, v in c.sync(c.scheduler.ddict_replicas, name=d.get_name()).items()
    }


def _apart(c: Client, d: DDict, bound: float = 60.0) -> None:
    """Every manager has its replica, on another worker than its primary."""
    seen: list[Any] = []

    def apart() -> bool:
        reps = _replica_workers(c, d)
        primaries = d._core.fresh(force=True).manager_workers
        seen[:] = [primaries, reps]
        return all(
            len(reps.get(m, ())) == 1 and primaries[m] not in reps[m] for m in range(d.num_managers)
        ) and all(s.replicas == 1 for s in d.stats)

    poll_for(apart, bound, lambda: f"replicas apart from primaries: {seen}", 0.2)


def test_a_host_with_replicas_alone_killed_gets_them_made_again(workers3):
    """A host that keeps replicas but no primary (its worker restarted by its nanny first,
    at a new address) is SIGKILLed: the orchestrator forgets its replicas and makes them
    again elsewhere (it took only hosts of primaries as lost, so the primary went on
    without a replica, and the loss of its own host then lost the manager); then the
    primary's host is killed too, and it fails over with nothing acknowledged lost."""
    c, w = workers3
    d = DDict(
        managers_per_worker=1, n_workers=1, total_mem="48 MiB", client=c, timeout=60, replicas=1
    )
    try:
        d.update({i: i for i in range(200)})
        _apart(c, d)
        primary = d.manager_workers[0]
        (keeper,) = _replica_workers(c, d)[0]
        nanny = scheduler_workers(c)[keeper]["nanny"]
        c.restart_workers([keeper])  # (the host process, and the replica, live on)
        (keeper,) = [a for a, i in scheduler_workers(c).items() if i["nanny"] == nanny]
        assert _replica_workers(c, d)[0] == (keeper,)  # (kept for its new address)
        w.kill(w.of(c, keeper))  # (a host with the replica alone)
        poll_for(  # a new replica, on the third worker
            lambda: (
                len(reps := _replica_workers(c, d).get(0, ())) == 1
                and reps[0] not in (keeper, primary)
                and d.stats[0].replicas == 1
            ),
            60,
            lambda: (_replica_workers(c, d).get(0, ()), d.stats[0].replicas),
            0.2,
        )
        d.update({i: -i for i in range(100)})  # (shipped to the new replica)
        w.start(1)  # (where the promoted replica's own replica can go)
        c.wait_for_workers(3, timeout=120)
        w.kill(w.of(c, primary))
        _failed_over(d, primary)
        assert [d[i] for i in range(200)] == [-i for i in range(100)] + list(range(100, 200))
    finally:
        d.destroy()


@pytest.mark.slow
def test_a_replica_its_primary_dropped_is_made_again_at_the_next_join(workers3):
    """A primary that stopped shipping to a replica (here: told to, as a timeout or a full
    replica would make it) reports one replica fewer; the orchestrator, which still
    counts it, finds out at its next placement (a worker joins) and makes a new one."""
    from distributed.core import rpc

    c, w = workers3
    d = DDict(managers_per_worker=1, total_mem="96 MiB", client=c, timeout=60, replicas=1)
    try:
        d.update({i: i for i in range(100)})
        (old,) = _replica_workers(c, d)[0]
        layout = d._core.layout
        primary = layout.managers[0]
        info = scheduler_workers(c)[old]
        nanny = info["nanny"]

        async def drop() -> None:
            async with rpc(primary.supervisor) as r:
                # the replica's host address, as the primary names it
                infos = await rpc(nanny).ddict_host_info()
                await r.ddict_replica_targets(
                    uid=layout.uid,
                    manager_id=0,
                    remove=[[infos["uds_path"], infos["tcp_host"], infos["tcp_port"]]],
                )

        c.sync(drop)
        assert d.stats[0].replicas == 0
        w.start(1)
        c.wait_for_workers(4, timeout=120)
        poll_for(
            lambda: d.stats[0].replicas == 1 and len(_replica_workers(c, d)[0]) == 1,
            60,
            lambda: (d.stats[0].replicas, _replica_workers(c, d)),
            0.3,
        )
        assert all(d[i] == i for i in range(100))
    finally:
        d.destroy()


def test_moves_on_one_machine_that_a_lease_renewal_meets_keep_the_shard_they_hand_over(caplog):
    """A manager that moves to another host process of the same machine is not copied:
    the new host serves the very shard the old one paused.  A lease renewal of the old
    host that lands between the orchestrator's new layout and its word to the old host
    (frequent with leases renewed every 20 ms) ends the move there: the old host keeps
    nothing aside (it once kept the served shard "aside", and deleted it when it closed,
    leaving the new primary on a file no longer in ``/dev/shm``: no replica could be
    seeded from it, and a kill of its host lost what it acknowledged)."""
    import dask

    from dask_ddict.host import hygiene

    caplog.set_level("WARNING", logger="dask_ddict.cluster.moves")
    settings = {"ddict.lease.duration": "40 ms", "ddict.lease.margin": "0.5 s"}
    with dask.config.set(settings), local_cluster(3) as cl, Client(cl) as c:
        d = DDict(managers_per_worker=1, total_mem="48 MiB", client=c, timeout=60, replicas=1)
        try:
            d.update({i: i for i in range(200)})
            workers = sorted(scheduler_workers(c))
            for step in range(40):
                for mid in range(d.num_managers):
                    reply = c.sync(
                        c.scheduler.ddict_move,
                        name=d.get_name(),
                        manager_id=mid,
                        worker=workers[step % 3],
                    )
                    raise_from_wire(reply)
                for m in d._core.fresh(force=True).managers:  # (served: never kept)
                    assert hygiene.kept_record(m.store_path) is None, (step, m)
            assert "did not let it go" not in caplog.text
            c.retire_workers([workers[0]], close_workers=True)  # (its host closes)
            _apart(c, d)  # (replicas seeded anew, from the shards that serve)
            for m in d._core.fresh(force=True).managers:
                assert os.path.isfile(os.path.join(m.store_path, "data.mdb")), m
            assert all(d[i] == i for i in range(200))
        finally:
            d.destroy()


def test_a_replica_whose_promotion_fails_to_open_is_kept_and_tried_again(
    workers3, tmp_path, caplog
):
    """A promotion opens the replica's shard as the manager's; an opening that fails (here
    the persist directory of the manager is a file, as on a broken mount) leaves the
    shard kept there as a replica, and the orchestrator tries it again until it opens:
    the replica may hold the last copy of what its lost primary acknowledged (it was
    once let go, unclaimed, for a sweep to take, and the manager was lost)."""
    import shutil

    c, w = workers3
    caplog.set_level("WARNING", logger="dask_ddict.cluster.failover")
    store = tmp_path / "persisted"
    d = DDict(
        managers_per_worker=1,
        total_mem="48 MiB",
        client=c,
        timeout=60,
        replicas=1,
        persist_path=str(store),
        persister_class="directory",
    )
    try:
        d.update({i: i for i in range(300)})
        victim = d.manager_workers[0]
        mine = store / d.get_name() / "manager_0"
        assert mine.is_dir()
        shutil.rmtree(mine)
        mine.write_bytes(b"not a directory")  # (the promotion's persister cannot open)
        w.kill(w.of(c, victim))
        poll_for(
            lambda: (
                "replica of manager 0 on" in caplog.text and "could not take over" in caplog.text
            ),
            60,
            "a promotion of manager 0 that failed to open",
            0.2,
        )
        time.sleep(2)  # (tried again meanwhile, and kept: not lost)
        assert not d._core.fresh(force=True).managers[0].lost
        mine.unlink()
        _failed_over(d, victim)
        assert all(d[i] == i for i in range(300))
    finally:
        d.destroy()


def test_a_promoted_primarys_host_process_killed_comes_back_under_its_term(workers3):
    """A replica promoted serves under the next term; its host process SIGKILLed alone, the
    supervisor re-opens its shard under that term (the one in the shard), and the lease
    confirms it (re-stamped with term 0, it was deposed by its own lease at once: served
    by nobody, no replica could be seeded, and its keys went with its host)."""
    c, w = workers3
    d = DDict(managers_per_worker=1, total_mem="96 MiB", client=c, timeout=60, replicas=1)
    try:
        d.update({i: i for i in range(200)})
        victim = d.manager_workers[0]
        w.kill(w.of(c, victim))
        _failed_over(d, victim)
        assert d._core.fresh(force=True).managers[0].term == 1  # (promoted)
        old = d.stats[0].pid
        psutil.Process(old).kill()
        stats: list[Any] = []

        def restarted() -> bool:
            try:
                stats[:] = d.stats
            except Exception as e:  # noqa: BLE001 - (restarting; deposed: never back)
                stats[:] = [e]
                return False
            return stats[0].pid != old and all(s.replicas == 1 for s in stats)

        poll_for(restarted, 60, lambda: stats, 0.3)
        assert all(d[i] == i for i in range(200))
        d.update({i: -i for i in range(200)})
        assert all(d[i] == -i for i in range(200))
    finally:
        d.destroy()
