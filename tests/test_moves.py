"""Managers move when the cluster changes shape: retirement, scaling, SIGTERM, rebalance.

Real clusters with worker processes; writers (client threads and tasks) put and
``fetch_add`` throughout, and afterwards every acknowledged write reads back,
counters are exact, and every manager takes new puts.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest
from distributed import Client, wait

from dask_ddict import DDict, DDictError, DDictManagerUnavailableError
from dask_ddict.client.workers import scheduler_workers
from dask_ddict.cluster.moves import Candidate, rebalance_plan, targets
from dask_ddict.errors import raise_from_wire
from dask_ddict.layout import Layout, ManagerInfo
from dask_ddict.options import DDictOptions
from tests.support.cluster import local_cluster
from tests.support.polling import poll_for
from tests.support.writers import check_writes, wait_gone, with_writers, write_until

# -- pure placement ----------------------------------------------------------------------


def _layout(workers: list[str]) -> Layout:
    managers = tuple(
        ManagerInfo(i, w, "h", "h:1", 1, f"/s/{i}", "127.0.0.1", 1, f"/d/{i}")
        for i, w in enumerate(workers)
    )
    return Layout("n", "00" * 16, "s", False, DDictOptions(), managers, 64 << 20)


def test_rebalance_plan_evens_counts_with_the_fewest_moves():
    lay = _layout(["a"] * 6)
    plan = rebalance_plan(lay, ["a", "b", "c"])
    assert len(plan) == 4  # a keeps 2, b and c take 2 each
    got = Counter(w for _, w in plan)
    assert got == {"b": 2, "c": 2}
    assert rebalance_plan(_layout(["a", "b", "c"]), ["a", "b", "c"]) == []
    # 7 over 3: counts 3, 2, 2; the busiest keeps the extra one
    start = ["a"] * 5 + ["b"] * 2
    plan = rebalance_plan(_layout(start), ["a", "b", "c"])
    after = Counter(start)
    for mid, w in plan:
        after[start[mid]] -= 1
        after[w] += 1
    assert sorted(after.values()) == [2, 2, 3] and len(plan) == 2


def test_rebalance_plan_moves_the_smallest_managers_and_places_orphans():
    lay = _layout(["a", "a", "a", "gone"])
    plan = rebalance_plan(lay, ["a", "b"], used={0: 10, 1: 1, 2: 5, 3: 7})
    moved = dict(plan)
    assert moved[3] in ("a", "b")  # a manager whose worker is gone is placed
    assert 1 in moved and 0 not in moved  # a gives up its smallest one


def test_targets_prefer_the_least_loaded_then_the_same_machine():
    c = [
        Candidate("w1", "s1", "other", 1, 1),
        Candidate("w2", "s2", "here", 1, 1),
        Candidate("w3", "s3", "other", 0, 5),
    ]
    assert [t.worker for t in targets(c, "here")] == ["w3", "w2", "w1"]


@pytest.fixture
def cluster3():
    with (
        local_cluster(3, threads_per_worker=2, memory_limit="1GiB") as cl,
        Client(cl) as c,
    ):
        yield cl, c


def test_retire_workers_moves_managers_first_with_writers_running(cluster3):
    cl, c = cluster3
    d = DDict(managers_per_worker=2, total_mem="96 MiB", client=c, timeout=60)
    try:
        d.update({i: i for i in range(600)})
        leaving = d.manager_workers[0]
        stay = sorted(set(d.manager_workers) - {leaving})
        with_writers(c, d, stay, lambda: (c.retire_workers([leaving]), wait_gone(d, leaving)))
        assert leaving not in d.manager_workers
        assert all(d[i] == i for i in range(600))
        moves = d.moves
        assert {m["manager_id"] for m in moves} == {0, 1}
        assert all(
            m["source"] == leaving
            and m["target"] in stay
            and not m["copied"]
            and "retired" in m["why"]
            for m in moves
        ), moves
        assert Counter(d.manager_workers) == Counter({stay[0]: 3, stay[1]: 3})
    finally:
        d.destroy()


def test_scale_down_and_up_then_rebalance(cluster3):
    cl, c = cluster3
    d = DDict(managers_per_worker=2, total_mem="96 MiB", client=c, timeout=60)
    try:
        d.update({i: i for i in range(300)})
        leaving = cl.workers[max(cl.workers)].worker_address  # (scale closes the newest)
        stay = sorted(set(d.manager_workers) - {leaving})

        def scale_down() -> None:
            cl.scale(2)
            poll_for(
                lambda: (
                    len(scheduler_workers(c)) == 2
                    and len(set(d._core.fresh(force=True).manager_workers)) == 2
                ),
                60,
                "two workers, serving every manager",
                0.2,
            )

        with_writers(c, d, stay, scale_down)
        assert leaving not in d.manager_workers
        assert all(d[i] == i for i in range(300))
        cl.scale(3)
        c.wait_for_workers(3, timeout=60)
        moves = d.rebalance()
        assert len(moves) == 2
        assert sorted(Counter(d.manager_workers).values()) == [2, 2, 2]
        assert all(d[i] == i for i in range(300))
        new = set(scheduler_workers(c)) - {m["source"] for m in moves}
        assert {m["target"] for m in moves} <= new | set(d.manager_workers)
        for m in range(d.num_managers):
            d.manager(m)["new"] = m
            assert d.manager(m)["new"] == m
    finally:
        d.destroy()


def _waiting_reader(d: DDict, key: str) -> Any:
    d.checkpoint()  # a key of checkpoint 1 that is not written yet: waits (wait_for_keys)
    return d[key]


def test_a_move_under_a_waiting_reader_a_view_and_a_batch(cluster3):
    cl, c = cluster3
    d = DDict(
        managers_per_worker=1,
        total_mem="96 MiB",
        client=c,
        timeout=60,
        wait_for_keys=True,
        working_set_size=2,
    )
    try:
        m = d.which_manager("later")
        leaving = d.manager_workers[m]
        stay = sorted(set(d.manager_workers) - {leaving})
        # a reader waits for a key that is not there yet (wait_for_keys)
        reader = c.submit(_waiting_reader, d, "later", workers=stay, pure=False)
        arr = np.arange(1 << 16, dtype=np.float64)
        d[("arr", m)] = arr
        view = (
            d.get(("arr", m), copy=False)
            if d.which_manager(("arr", m)) in d.local_managers
            else None
        )
        time.sleep(0.5)
        d.start_batch_put()
        for i in range(50):
            d[("batch", i)] = i
        c.retire_workers([leaving])
        wait_gone(d, leaving)
        for i in range(50, 100):
            d[("batch", i)] = i
        d.end_batch_put()
        assert leaving not in d.manager_workers
        assert all(d[("batch", i)] == i for i in range(100))
        if view is not None:
            assert np.array_equal(view, arr)  # a zero-copy view taken before stays valid
        assert np.array_equal(d[("arr", m)], arr)
        d.checkpoint()
        d["later"] = "here"
        assert reader.result(timeout=60) == "here"
    finally:
        d.destroy()


def test_sigterm_of_a_dask_worker_moves_its_managers(cluster3):
    """A ``dask worker`` process (its nanny) that gets SIGTERM closes gracefully: its
    managers move to the other workers before its host process ends."""
    cl, c = cluster3
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dask",
            "worker",
            cl.scheduler_address,
            "--nthreads",
            "1",
            "--memory-limit",
            "1GiB",
            "--no-dashboard",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        c.wait_for_workers(4, timeout=60)
        mine = [
            w
            for w, info in scheduler_workers(c).items()
            if info.get("nanny")
            and "127.0.0.1" in w
            and w not in {ws.worker_address for ws in cl.workers.values()}
        ]
        assert len(mine) == 1, mine
        d = DDict(managers_per_worker=1, total_mem="96 MiB", client=c, timeout=60)
        try:
            d.update({i: i for i in range(400)})
            assert mine[0] in d.manager_workers
            stay = sorted(set(d.manager_workers) - {mine[0]})
            with_writers(
                c, d, stay, lambda: (os.killpg(proc.pid, signal.SIGTERM), wait_gone(d, mine[0]))
            )
            proc.wait(60)
            assert mine[0] not in d.manager_workers
            assert all(d[i] == i for i in range(400))
        finally:
            d.destroy()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _slow(x: int) -> int:
    time.sleep(0.2)
    return x


def test_adaptive_scale_down_moves_managers(cluster3):
    cl, c = cluster3
    d = DDict(managers_per_worker=1, total_mem="96 MiB", client=c, timeout=60)
    try:
        d.update({i: i for i in range(300)})
        wait(c.map(_slow, range(12)))  # a real workload, then idle: adapt scales down
        adaptive = cl.adapt(minimum=1, maximum=3, interval="200ms", wait_count=2)
        stop = threading.Event()
        results: list[Any] = [None] * 4  # 4 client threads (tasks would keep workers busy)
        threads = [
            threading.Thread(
                target=lambda j=j: results.__setitem__(j, write_until(d, f"a{j}", stop.is_set))
            )
            for j in range(4)
        ]
        for t in threads:
            t.start()
        poll_for(lambda: len(scheduler_workers(c)) <= 1, 90, "adapt to scale down", 0.3)
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(60)
        adaptive.stop()
        assert len(set(d.manager_workers)) == 1
        check_writes(d, results, [f"a{j}" for j in range(4)])
        assert all(d[i] == i for i in range(300))
    finally:
        d.destroy()


class _Gate:
    """Counts the threads that reach ``core``'s explain() lock (each has read the number
    of answers by then); :meth:`wait` returns once ``n`` have, or after 10 s."""

    def __init__(self, core: Any, n: int) -> None:
        lock = core._asking
        self._lock, self._count, self._n = getattr(lock, "_lock", lock), 0, n  # (unwrapped)
        self._all_in, self._counting = threading.Event(), threading.Lock()
        core._asking = self

    def __enter__(self) -> None:
        with self._counting:
            self._count += 1
            if self._count >= self._n:
                self._all_in.set()
        self._lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    def wait(self) -> None:
        self._all_in.wait(10)


def test_threads_that_meet_a_closed_host_together_all_follow_its_manager(cluster3, monkeypatch):
    """Threads of one handle whose requests find a retired host's listener closed at the
    same moment each learn where its manager went.  One of them asks the orchestrator
    (slowed here, as on a loaded machine); the others used to be within the question's
    rate limit and raised the bare "refuses connections" (a writer's failure, 1 run in ~15
    of the adaptive scale-down test under CPU load): they now wait for its answer."""
    import dask

    from dask_ddict.client import core

    cl, c = cluster3
    d = DDict(managers_per_worker=1, total_mem="96 MiB", client=c, timeout=30)
    try:
        with dask.config.set({"ddict.local-transport": False}):  # (sockets, never the shard)
            stale = DDict.attach(d.serialize())  # the layout as it is now, never asked again
        leaving = d.manager_workers[0]
        _, host, port = stale._core.layout.managers[0].address
        c.retire_workers([leaving])
        wait_gone(d, leaving)

        def closed() -> bool:  # the leaving host's listener
            try:
                socket.create_connection((host, port), timeout=1).close()
            except OSError:
                return True
            return False

        poll_for(closed, 60, "the retired host to stop listening", 0.1)
        real = core.current_layout
        gate = _Gate(stale._core, 4)  # (its question waits until all 4 threads are in)
        monkeypatch.setattr(
            core, "current_layout", lambda *a, **k: (gate.wait(), time.sleep(0.5), real(*a, **k))[2]
        )
        barrier, errors = threading.Barrier(4), []

        def put(j: int) -> None:
            barrier.wait()
            try:
                stale.manager(0)[("after", j)] = j
            except Exception as e:  # noqa: BLE001 - the test's failure, reported below
                errors.append(e)

        threads = [threading.Thread(target=put, args=(j,)) for j in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        assert not errors, errors
        assert [d.manager(0)[("after", j)] for j in range(4)] == [0, 1, 2, 3]
        # an orchestrator that cannot answer (None, slower than the rate limit) is asked
        # once for all 4, not once by each in turn
        asked: list[int] = []
        slow = core.ASK_EVERY + 0.3
        gate = _Gate(stale._core, 4)
        monkeypatch.setattr(
            core,
            "current_layout",
            lambda *a, **k: (asked.append(1), gate.wait(), time.sleep(slow), None)[3],
        )
        stale._core._asked = 0.0
        bare = DDictManagerUnavailableError("manager 1 is unreachable (as seen here)")
        place = stale._core.layout.managers[1].address
        said: list[Any] = []

        def explain() -> None:
            barrier.wait()
            said.append(stale._core.explain(1, bare, place))

        threads = [threading.Thread(target=explain) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        assert len(asked) == 1 and said == [bare] * 4, (asked, said)
        stale.detach()
    finally:
        d.destroy()


def test_a_stale_handle_follows_with_a_large_put_and_a_manager_moves_straight_back(cluster3):
    """A handle that has not seen a move sends a large value to the old place first: it is
    answered MOVED (its body read, the connection kept) and followed.  A manager moves
    back to the host process it left a moment ago (which held its shard open)."""
    cl, c = cluster3
    d = DDict(managers_per_worker=1, total_mem="96 MiB", client=c, timeout=30)
    try:
        stale = DDict.attach(d.serialize())  # the layout as it is now, never asked again
        d[("small", 0)] = 0
        home = d.manager_workers[0]
        away = next(w for w in d.manager_workers if w != home)
        name = d.get_name()
        there = c.sync(c.scheduler.ddict_move, name=name, manager_id=0, worker=away)
        assert there["target"] == away and not there["copied"]
        big = np.arange(1 << 18, dtype=np.float64)  # 2 MiB: over the host's small-body size
        stale.manager(0)["big"] = big
        assert np.array_equal(d.manager(0)["big"], big)
        back = c.sync(c.scheduler.ddict_move, name=name, manager_id=0, worker=home)
        assert back["target"] == home  # (within LET_GO_AFTER of leaving it)
        assert np.array_equal(stale.manager(0)["big"], big) and d[("small", 0)] == 0
        stale.manager(0)["big2"] = big + 1
        assert np.array_equal(d.manager(0)["big2"], big + 1)
        for wrong in (-1, d.num_managers):  # a typed refusal that names the argument
            with pytest.raises(DDictError, match=f"manager_id {wrong} of .* is not one"):
                raise_from_wire(
                    c.sync(c.scheduler.ddict_move, name=name, manager_id=wrong, worker=away)
                )
        assert d.manager_workers[0] == home
        stale.detach()
    finally:
        d.destroy()


def _read_back_once_taken(d: DDict, n: int) -> None:
    """Keys ``0 .. n-1`` (each its own value) read back, once workers have taken the
    parked managers (within 60 s)."""

    def taken() -> bool:
        try:
            assert [d[i] for i in range(n)] == list(range(n))
            return True
        except DDictManagerUnavailableError:
            return False

    poll_for(taken, 60, "parked managers taken", 0.2)


def test_a_manager_no_worker_can_take_is_parked_then_taken_by_a_joining_worker():
    """The last worker leaves: its managers are parked (their shards kept in this
    machine's shared memory), said in the errors, moves and CLI; a worker that joins
    takes them with every key; destroy() removes a parked shard with no worker left."""
    from click.testing import CliRunner

    from dask_ddict.cli import ddict as cli
    from dask_ddict.errors import DDictManagerUnavailableError

    with (
        local_cluster(1, memory_limit="1GiB") as cl,
        Client(cl) as c,
    ):
        d = DDict(managers_per_worker=2, total_mem="64 MiB", client=c, timeout=30)
        e = DDict(managers_per_worker=1, total_mem="32 MiB", client=c, timeout=30)
        try:
            d.update({i: i for i in range(300)})
            d.fetch_add("count", 7)
            e["x"] = 1
            paths = [m.store_path for m in d._core.layout.managers]
            e_path = e._core.layout.managers[0].store_path
            cl.scale(0)
            poll_for(
                lambda: (
                    not scheduler_workers(c)
                    and all(m.parked for m in d._core.fresh(force=True).managers)
                ),
                60,
                "no worker, every manager parked",
                0.2,
            )
            assert all(os.path.exists(p) for p in paths + [e_path])  # kept, not deleted
            with pytest.raises(DDictManagerUnavailableError, match="parked") as info:
                d[0]
            assert "shared memory" in str(info.value) and "joins" in str(info.value)
            assert [m["target"] for m in d.moves] == ["", ""]
            assert all("no worker could take it" in m["why"] for m in d.moves)
            out = CliRunner().invoke(
                cli, ["stats", d.get_name(), "--scheduler", cl.scheduler_address]
            )
            assert out.exit_code == 0, out.output
            assert out.output.count("parked:") == 2 and "nowhere (parked" in out.output
            e.destroy()  # no worker there: the orchestrator (this machine) removes it
            assert not os.path.exists(e_path)
            stale = DDict.attach(d.serialize())  # a handle that knows them parked
            cl.scale(1)
            c.wait_for_workers(1, timeout=60)
            _read_back_once_taken(d, 300)  # (the handles ask again, at most twice a second)
            time.sleep(0.6)
            assert all(stale[i] == i for i in range(300))
            stale.detach()
            assert d.fetch_add("count", 1) == 7 and d["count"] == 8
            for m in range(d.num_managers):
                d.manager(m)[("new", m)] = m
                assert d.manager(m)[("new", m)] == m
            assert [m["target"] for m in d.moves][2:] == list(d.manager_workers)
        finally:
            d.destroy()
            e.destroy()
        assert not any(os.path.exists(p) for p in paths)


def test_scaling_to_zero_parks_every_manager_and_scaling_up_serves_them():
    """Every worker closes at once (``scale(0)``): each host's evacuation moved its
    managers to the other closing host, whose own evacuation had already looked, and
    those were dropped with it ("lost with their host").  A closing host takes no manager
    now, and looks again for any that arrived: all are parked, and served with every key
    once workers join."""
    with (
        local_cluster(2, memory_limit="1GiB") as cl,
        Client(cl) as c,
    ):
        d = DDict(managers_per_worker=2, total_mem="64 MiB", client=c, timeout=30)
        try:
            d.update({i: i for i in range(400)})
            assert len(set(d.manager_workers)) == 2
            cl.scale(0)
            poll_for(
                lambda: (
                    not scheduler_workers(c)
                    and not any(m.lost and not m.parked for m in d._core.fresh(force=True).managers)
                ),
                60,
                "every worker closed, no manager lost unparked",
                0.2,
            )
            layout = d._core.fresh(force=True)
            assert all(m.parked for m in layout.managers), [
                (m.manager_id, m.lost_why) for m in layout.managers
            ]
            cl.scale(2)
            c.wait_for_workers(2, timeout=60)
            _read_back_once_taken(d, 400)
            assert len(d) == 400
        finally:
            d.destroy()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_stale_handles_batch_across_a_move_is_completed_where_the_manager_went(
    cluster3, transport
):
    """A handle that has not seen a move sends batch records to the old place: they are
    not stored there (the connection stays up), and the batch's end sends them again
    where the manager went, so it ends without an error and with every put."""
    import dask.config

    cl, c = cluster3
    local = {"ddict.local-transport": transport == "shm", "ddict.batch.flush-bytes": "1 KiB"}
    with dask.config.set(local):
        d = DDict(managers_per_worker=1, total_mem="96 MiB", client=c, timeout=30)
        stale = DDict.attach(d.serialize())  # the layout as it is now, never asked again
        try:
            stale.start_batch_put()
            for i in range(300):
                stale[("b", i)] = i
            for mid in range(d.num_managers):  # every manager moves, to the next worker
                to = d.manager_workers[(mid + 1) % d.num_managers]
                raise_from_wire(
                    c.sync(c.scheduler.ddict_move, name=d.get_name(), manager_id=mid, worker=to)
                )
            for i in range(300, 600):
                stale[("b", i)] = i
            stale.end_batch_put()
            assert len(d.moves) == d.num_managers
            assert all(d[("b", i)] == i for i in range(600))
            assert len(d) == 600
        finally:
            stale.detach()
            d.destroy()


def _slow_keys(dd: DDict, out: Any) -> None:  # a filter's mgr_code, beside its shard
    for k in dd.keys():
        out.put(k)
        time.sleep(0.001)


def test_a_move_during_a_filter_and_while_checkpoints_persist(cluster3, tmp_path):
    """Every manager moves while a filter streams its keys and while checkpoints
    persist (retiring ones, and one asked with ``persist()``): the filter yields every
    key, and every checkpoint asked to persist before the moves is restorable."""
    cl, c = cluster3
    d = DDict(
        managers_per_worker=1,
        total_mem="96 MiB",
        client=c,
        timeout=60,
        working_set_size=2,
        persist_freq=1,
        persist_count=-1,
        persist_path=str(tmp_path / "store"),
    )
    try:
        for chkpt in range(4):  # 0 and 1 retire (and persist) as 2 and 3 are written
            d.checkpoint_id = chkpt
            d.update({("k", chkpt, i): i for i in range(300)})
        expected = sorted(d.keys())
        d.persist()  # checkpoint 3, in the background: the moves drain it or carry it
        got: list[Any] = []
        errors: list[BaseException] = []

        def run_filter() -> None:
            try:
                with d.filter(_slow_keys) as results:
                    got.extend(results)
            except BaseException as e:  # noqa: BLE001 - asserted below
                errors.append(e)

        t = threading.Thread(target=run_filter)
        t.start()
        time.sleep(0.3)
        for mid in range(d.num_managers):  # every manager moves to the next worker
            to = d.manager_workers[(mid + 1) % d.num_managers]
            raise_from_wire(
                c.sync(c.scheduler.ddict_move, name=d.get_name(), manager_id=mid, worker=to)
            )
        t.join(120)
        assert not errors, errors
        assert sorted(got) == expected
        assert len(d.moves) == d.num_managers
        d.sync()
        assert d.persisted_ids() == [0, 1, 3]
        d.restore(3)
        assert sorted(d.keys()) == expected
    finally:
        d.destroy()
