"""Where Dragon's own tests (``test/native/test_ddict.py``) pin a behaviour, we behave
the same: ``lib_err`` strings, a restarted dictionary's new handle at checkpoint 0,
``wait_for_keys`` reads after a delete, a waiting ``pop``, and deferred operations
applied in the order they arrived (a manager alone and through a real cluster)."""

from __future__ import annotations

import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import dask.config
import pytest

import dask_ddict
from dask_ddict import (
    DDict,
    DDictError,
    DDictKeyError,
    DDictTimeoutError,
)
from dask_ddict.errors import DRAGON_LIB_ERR, Status
from dask_ddict.shard.manager import Manager
from dask_ddict.shard.store import ShardStore
from dask_ddict.shard.working_set import WorkingSet
from tests.support.manager_calls import get, put
from tests.support.polling import poll_for

# -- lib_err ---------------------------------------------------------------------------


def test_every_code_has_dragons_lib_err_and_keeps_it_through_pickle():
    codes = {s.name for s in Status} - {"OK", "MORE"}
    assert codes <= set(DRAGON_LIB_ERR)  # every wire status, and the client-side codes
    for cls in [
        c for c in vars(dask_ddict).values() if isinstance(c, type) and issubclass(c, DDictError)
    ]:
        e = cls("x") if cls is not dask_ddict.DDictKeyError else cls("key")
        assert e.lib_err == DRAGON_LIB_ERR[e.code] and e.lib_err.startswith("DRAGON_")
        assert pickle.loads(pickle.dumps(e)).lib_err == e.lib_err


def test_lib_err_of_each_case_on_a_cluster(client, tmp_path):
    """The cases Dragon's tests compare ``ex.lib_err`` for, raised for real."""
    with DDict(
        total_mem="32 MiB",
        client=client,
        n_workers=1,
        managers_per_worker=1,
        working_set_size=2,
        wait_for_writers=True,
        persist_path=str(tmp_path / "p"),
        timeout=0.5,
    ) as d:
        other = DDict.attach(d.serialize())
        seen = set()

        def lib_err(expected, fn):  # (the names in Dragon's return_codes.h)
            with pytest.raises(DDictError) as info:
                fn()
            assert info.value.lib_err == expected, info.value
            seen.add(expected)

        lib_err("DRAGON_KEY_NOT_FOUND", lambda: d["missing"])
        other["w"] = 0  # a writer at 0: checkpoint 0 cannot retire before it moves on
        d.checkpoint_id = 3
        d.start_batch_put()
        d["b"] = 1
        lib_err("DRAGON_DDICT_FUTURE_CHECKPOINT", d.end_batch_put)  # batch puts are never deferred
        d.checkpoint_id = 3
        lib_err("DRAGON_TIMEOUT", lambda: d.__setitem__("late", 1))  # a deferred put that times out
        other.checkpoint_id = 2
        other["w"] = 2  # its writer moved on: 0 retires
        other.detach()
        d.checkpoint_id = 0
        lib_err("DRAGON_DDICT_CHECKPOINT_RETIRED", lambda: d.__setitem__("old", 1))
        lib_err("DRAGON_DDICT_PERSIST_CHECKPOINT_UNAVAILABLE", lambda: d.restore(99))
        lib_err("DRAGON_INVALID_ARGUMENT", lambda: d.manager(5))
        d.checkpoint_id = 2
        d.freeze()
        lib_err("DRAGON_INVALID_OPERATION", lambda: d.__setitem__("frozen", 1))
        d.unfreeze()
        lib_err("DRAGON_MEMORY_POOL_FULL", lambda: d.__setitem__("big", b"x" * (64 << 20)))
    assert len(seen) == 8  # every case ran


# -- restart ---------------------------------------------------------------------------


def test_a_restarted_dictionarys_new_handle_starts_at_checkpoint_0(client):
    """Dragon's ``test_restart_with_wait_keys``: read at 0 what was written at 0, then
    move on; a key deleted at 1 is gone there."""
    d = DDict(
        total_mem="32 MiB",
        client=client,
        name="dragon-restart",
        working_set_size=2,
        wait_for_keys=True,
        timeout=5,
    )
    d.pput("hello", "world")
    d["Miska"] = "dog"  # non-persistent, at 0
    d.checkpoint()
    d["dragon"] = "runtime"
    del d["hello"]
    d.destroy(allow_restart=True)
    d2 = DDict(
        total_mem="32 MiB",
        client=client,
        name="dragon-restart",
        working_set_size=2,
        wait_for_keys=True,
        timeout=5,
        restart=True,
    )
    try:
        assert d2.checkpoint_id == 0
        assert d2["hello"] == "world" and d2["Miska"] == "dog"
        d2.checkpoint()
        assert d2["dragon"] == "runtime" and "hello" not in d2
        d3 = DDict.attach(d2.serialize())
        d3.sync_to_newest_checkpoint()  # how a program continues from the newest instead
        assert d3.checkpoint_id == 1
        d3.detach()
    finally:
        d2.destroy()


# -- wait_for_keys: delete, pop --------------------------------------------------------


@pytest.fixture
def wfk(client):
    with DDict(
        total_mem="32 MiB", client=client, working_set_size=2, wait_for_keys=True, timeout=20
    ) as d:
        yield d


@pytest.mark.parametrize("persistent", [False, True])
def test_a_key_deleted_at_the_readers_checkpoint_is_absent_at_once(wfk, persistent):
    d = wfk
    (d.pput if persistent else d.__setitem__)("k", 1)
    del d["k"]
    start = time.monotonic()
    with pytest.raises(DDictKeyError) as info:
        d["k"]
    assert info.value.lib_err == "DRAGON_KEY_NOT_FOUND"
    assert "k" not in d and d.get("k", "default") == "default"
    assert d.get_many(["k"], default=None) == [None]
    assert d.pop("k", "gone") == "gone"
    with pytest.raises(DDictKeyError):
        d.manager(d.which_manager("k"))["k"]  # (the manager's own path too, not a shard read)
    assert time.monotonic() - start < 5  # never waited for a writer (timeout 20 s)
    d["k"] = 2  # written again: seen again
    assert d["k"] == 2


def test_a_key_deleted_at_an_older_checkpoint_is_waited_for(wfk):
    d = wfk
    d["k"] = 1
    del d["k"]
    d.checkpoint()  # at 1 nobody wrote "k": a reader waits for its writer
    reader = DDict.attach(d.serialize(), timeout=0.5)
    reader.checkpoint_id = 1
    try:
        with pytest.raises(DDictTimeoutError):
            reader["k"]
    finally:
        reader.detach()


def test_pop_of_a_key_not_yet_written_waits_for_its_writer(wfk):
    d = wfk
    d["k"] = "at 0"
    d.checkpoint()  # 1: "k" (non-persistent) is not written here yet
    writer = DDict.attach(d.serialize())
    writer.checkpoint_id = 1
    try:
        with ThreadPoolExecutor(1) as pool:
            popped = pool.submit(d.pop, "k")
            wait_deferred(d, d.which_manager("k"), 1)
            assert not popped.done()
            writer["k"] = "at 1"
            assert popped.result(timeout=20) == "at 1"
        assert "k" not in d
        short = DDict.attach(d.serialize(), timeout=0.3)
        short.checkpoint_id = 1
        with pytest.raises(DDictTimeoutError):
            short.pop("other")  # subject to the timeout, as a get
        short.detach()
    finally:
        writer.detach()


# -- deferred operations, in arrival order -----------------------------------------------


def wait_deferred(d: DDict, mid: int, n: int, limit: float = 20.0) -> None:
    """Until manager ``mid`` holds ``n`` deferred operations (its stats say so)."""
    poll_for(
        lambda: d.dstats[mid].deferred_ops == n,
        limit,
        lambda: f"{n} deferred operations on manager {mid}: {d.dstats[mid]}",
        0.002,
    )


@pytest.fixture
def wfk_manager(tmp_path):
    """A manager under wait_for_keys whose deferred operations are retried only by writes
    to their own checkpoint (no quiet-period retry: the tests decide every trigger)."""
    store = ShardStore(str(tmp_path / "shard"), 16 << 20, indexed=True)
    with dask.config.set({"ddict.deferred.quiet-retry": None}):
        m = Manager(0, store, WorkingSet(store, 2, wait_for_keys=True))
    yield m
    m.close()


def wait_queued(m: Manager, n: int) -> None:
    poll_for(lambda: len(m._deferred) == n, 10, f"{n} deferred operations queued", 0.0005)


def test_a_manager_applies_deferred_operations_in_arrival_order(wfk_manager):
    """200 rounds: two deferred puts to one key, a deferred get of it, then the write
    (to the checkpoint before theirs) that unblocks them, and a later put to theirs.
    As in Dragon, the write to another checkpoint does not retry them; the later put
    to theirs does, before it applies itself: the first put is applied first, the get
    sees the second, and the later put is never overwritten by a deferred one."""
    m = wfk_manager
    put(m, "j", 0, 0)  # "j" at 0 has no successor at 1: checkpoint 0 cannot retire
    for w in range(200):
        outcome = {}

        def later(name, fn):
            def run():
                outcome[name] = fn()

            t = threading.Thread(target=run)
            t.start()
            return t

        threads = [later("A", lambda: put(m, "k", ("A", w), w + 2, timeout=10))]
        wait_queued(m, 1)
        threads.append(later("B", lambda: put(m, "k", ("B", w), w + 2, timeout=10)))
        wait_queued(m, 2)
        threads.append(later("C", lambda: get(m, "k", w + 2, timeout=10)))
        wait_queued(m, 3)
        put(m, "j", w, w + 1)  # unblocks (w may retire), at another checkpoint: no retry
        assert len(m._deferred) == 3
        put(m, "k", ("D", w), w + 2)  # A, B and C first, in arrival order, then D
        assert len(m._deferred) == 0
        for t in threads:
            t.join(10)
        assert outcome["C"] == ("B", w), w
        assert get(m, "k", w + 2) == ("D", w), w


def test_deferred_puts_from_four_clients_apply_in_arrival_order(client):
    """The 4-client scenario through the cluster, 200 rounds: clients A and B put one
    key at a checkpoint that cannot be created yet, C reads it, X's write unblocks
    them and D writes it once X's put returned.  Final values checked every round."""
    with DDict(
        total_mem="32 MiB",
        client=client,
        n_workers=1,
        managers_per_worker=1,
        working_set_size=2,
        wait_for_keys=True,
        timeout=20,
    ) as x:
        a, b, c, dd = (DDict.attach(x.serialize()) for _ in range(4))
        try:
            x["j"] = 0  # blocks checkpoint 0 from retiring until "j" is written at 1
            with ThreadPoolExecutor(3) as pool:
                for w in range(200):
                    for h in (a, b, c, dd):
                        h.checkpoint_id = w + 2
                    pa = pool.submit(a.__setitem__, "k", ("A", w))
                    wait_deferred(x, 0, 1)
                    pb = pool.submit(b.__setitem__, "k", ("B", w))
                    wait_deferred(x, 0, 2)
                    gc = pool.submit(c.__getitem__, "k")
                    wait_deferred(x, 0, 3)
                    x.checkpoint_id = w + 1
                    x["j"] = w  # lets checkpoint w retire (a write to w + 1)
                    dd["k"] = ("D", w)  # to w + 2: applies A, B, C first, then itself
                    pa.result(20), pb.result(20)
                    assert gc.result(20) == ("B", w), w
                    assert dd["k"] == ("D", w), w
        finally:
            for h in (a, b, c, dd):
                h.detach()


# -- Dragon's test_wait_keys_defer_put_get_same_key, ported ------------------------------
# Its three clients, as Dragon's test/native/test_ddict.py writes them (one manager,
# wait_for_keys=True, working_set_size=2).  The comments are Dragon's: client 1's put at 2
# and client 2's read at 2 are deferred (checkpoint 0 cannot retire while
# "nonpersist_key0" is not written at 1); client 3's put at 1 makes the retirement
# possible, and its put at 2 "flushes" them: they are applied before it, so client 2 reads
# client 1's value first and client 3's value after.


def _dragon_client_1(d: DDict, ev: threading.Event) -> None:
    d.pput("persist_key0", "persist_val0")  # at 0
    d["nonpersist_key0"] = "nonpersist_val0"
    d.checkpoint()  # 1
    d.pput("persist_key0", "persist_val0_ckpt1")
    ev.set()
    d.checkpoint()  # 2
    d["nonpersist_key0"] = "nonpersist_val0_ckpt2"  # deferred 1
    d.detach()


def _dragon_client_2(d: DDict, ev: threading.Event) -> None:
    d.checkpoint()  # 1
    ev.set()
    d.checkpoint()  # 2
    x = d["nonpersist_key0"]  # deferred 2
    assert x == "nonpersist_val0_ckpt2", x
    x = d["nonpersist_key0"]
    assert x == "nonpersist_val0_ckpt2_client3", x
    d.detach()


def _dragon_client_3(d: DDict) -> None:
    d.checkpoint()  # 1
    d["nonpersist_key0"] = "nonpersist_val0_ckpt1"
    d.checkpoint()  # 2
    d["nonpersist_key0"] = "nonpersist_val0_ckpt2_client3"  # flush
    d.detach()


def _run_dragon_defer_put_get_same_key(client, start, wait_deferred_first: bool) -> None:
    """One run of Dragon's test: ``start(fn, *args)`` runs a client (a thread or a
    process) and returns something with ``join()`` and an exit code or error."""
    d = DDict(
        total_mem="16 MiB",
        client=client,
        n_workers=1,
        managers_per_worker=1,
        wait_for_keys=True,
        working_set_size=2,
        timeout=30,
    )
    try:
        s = d.serialize()
        ev = start.event()
        c1 = start(_dragon_client_1, s, ev)
        assert ev.wait(30)
        ev.clear()
        c2 = start(_dragon_client_2, s, ev)
        assert ev.wait(30)
        if wait_deferred_first:  # (a thread starts at once, a process takes a second:
            wait_deferred(d, 0, 2)  # both deferred, as Dragon's comments say they are)
        c3 = start(_dragon_client_3, s)
        for c in (c1, c2, c3):
            start.check(c)
    finally:
        d.destroy()


class _Threads:
    """Dragon's clients as threads, each with its own attached handle."""

    event = staticmethod(threading.Event)

    def __call__(self, fn, serialized: str, *args):
        out: dict[str, BaseException] = {}

        def run() -> None:
            try:
                fn(DDict.attach(serialized), *args)
            except BaseException as e:  # noqa: BLE001 - the test reports it
                out["error"] = e

        t = threading.Thread(target=run)
        t.start()
        return t, out

    @staticmethod
    def check(c) -> None:
        t, out = c
        t.join(60)
        assert not t.is_alive()
        if "error" in out:
            raise out["error"]


def test_dragons_defer_put_get_same_key_passes_every_time(client):
    """20 runs of Dragon's test, its clients as threads (each its own handle)."""
    for _ in range(20):
        _run_dragon_defer_put_get_same_key(client, _Threads(), wait_deferred_first=True)


def _in_process(fn, serialized: str, *args) -> None:
    fn(DDict.attach(serialized), *args)


class _Processes:
    """Dragon's clients as processes, as Dragon's test runs them."""

    def __init__(self) -> None:
        import multiprocessing

        self.mp = multiprocessing.get_context("spawn")
        self.manager = self.mp.Manager()
        self.event = self.manager.Event

    def __call__(self, fn, serialized: str, *args):
        p = self.mp.Process(target=_in_process, args=(fn, serialized, *args))
        p.start()
        return p

    @staticmethod
    def check(p) -> None:
        p.join(60)
        assert p.exitcode == 0, p.exitcode


@pytest.mark.slow
def test_dragons_defer_put_get_same_key_in_processes(client):
    """Dragon's test as it is, three processes, 10 runs (each process attaches)."""
    procs = _Processes()
    try:
        for _ in range(10):
            _run_dragon_defer_put_get_same_key(client, procs, wait_deferred_first=False)
    finally:
        procs.manager.shutdown()
