"""Pieces of the host side tested alone: owner locks and sweeping, the control pipe's
framing, the direct-put rule, the buffer pool (no cluster)."""

from __future__ import annotations

import asyncio
import gc
import io
import os
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dask_ddict._hashing import key_digest
from dask_ddict._keys import dumps_key
from dask_ddict._serialize import BufferPool, dumps_value
from dask_ddict.host import control, hygiene
from dask_ddict.host.control import DictSpec
from dask_ddict.options import DDictOptions
from dask_ddict.shard.direct import put_in_window
from dask_ddict.shard.reader_marks import CLOSED_DESTROYED, FROZEN, add_waiters, mark_closed
from dask_ddict.shard.working_set import WorkingSet
from tests.support.polling import poll_for


def _dirs(tmp_path):  # noqa: ANN001, ANN202
    made = {}
    for name in ("ddict-dead", "ddict-live", "ddict-kept", "ddict-nolock", "other-dead"):
        path = tmp_path / name
        path.mkdir()
        made[name] = str(path)
    return made


def test_sweep_removes_only_provably_abandoned_directories(tmp_path):
    d = _dirs(tmp_path)
    hygiene.release(hygiene.claim(d["ddict-dead"]))  # its owner is gone
    live = hygiene.claim(d["ddict-live"])  # its owner lives (this process)
    hygiene.release(hygiene.claim(d["ddict-kept"]))
    hygiene.mark_kept(d["ddict-kept"])  # kept for a restart
    hygiene.release(hygiene.claim(d["other-dead"]))  # not ours by name
    # a lock held by another live process counts too
    code = textwrap.dedent(f"""
        import sys, time
        from dask_ddict.host import hygiene
        hygiene.claim({d["ddict-nolock"]!r}); print("held", flush=True); time.sleep(60)
    """)
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "held"
        removed = hygiene.sweep(str(tmp_path))
        assert removed == [d["ddict-dead"]]
        assert all(os.path.isdir(d[n]) for n in d if n != "ddict-dead")
    finally:
        other.kill()
        other.wait()
    assert hygiene.sweep(str(tmp_path)) == [d["ddict-nolock"]]  # its owner died just now
    hygiene.release(live)
    os.unlink(os.path.join(d["ddict-kept"], hygiene.KEPT))
    assert sorted(hygiene.sweep(str(tmp_path))) == sorted([d["ddict-live"], d["ddict-kept"]])
    assert os.path.isdir(d["other-dead"])  # never another program's directory


def test_a_claim_that_meets_a_removal_waits_for_it_and_fails_naming_the_directory(tmp_path):
    """A sweeper holds an abandoned directory's owner lock exclusively while it removes
    it: a process that claims the directory meanwhile (to open the shard in it) waits,
    then learns that it is gone; it never opens a shard whose files are being removed."""
    path = str(tmp_path / "ddict-going")
    os.mkdir(path)
    hygiene.release(hygiene.claim(path))  # (its owner is gone)
    sweeper = os.open(os.path.join(path, hygiene.LOCK), os.O_RDONLY)
    import fcntl

    fcntl.flock(sweeper, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (what a sweep holds, removing it)
    got: list[BaseException | int] = []
    claimer = threading.Thread(target=lambda: _claim_into(path, got))
    claimer.start()
    inode = os.fstat(sweeper).st_ino
    poll_for(lambda: _waiting_for(inode), 30, "the claim to wait for the lock", 0.01)
    assert claimer.is_alive() and not got  # (it waits for the removal)
    import shutil

    shutil.rmtree(path)
    os.close(sweeper)
    claimer.join(30)
    assert len(got) == 1 and isinstance(got[0], FileNotFoundError), got
    assert got[0].filename == path and "removed as abandoned" in str(got[0])


def _waiting_for(inode: int) -> bool:
    """Whether a process waits for a lock on the file of ``inode`` (``/proc/locks``)."""
    with open("/proc/locks") as f:
        return any("->" in line and f":{inode} " in line for line in f)


def _claim_into(path: str, got: list[BaseException | int]) -> None:
    try:
        got.append(hygiene.claim(path))
    except BaseException as e:  # noqa: BLE001 - what the test checks
        got.append(e)


def test_a_sweep_leaves_a_directory_claimed_after_its_owner_died(tmp_path):
    """An abandoned directory that a new owner claims (a replica's or a copy's shard,
    passed on) is no longer the sweep's: the sweep's exclusive lock fails."""
    path = str(tmp_path / "ddict-passed")
    os.mkdir(path)
    hygiene.release(hygiene.claim(path))
    assert hygiene.is_abandoned(path)
    held = hygiene.claim(path)
    try:
        assert hygiene.sweep(str(tmp_path)) == [] and os.path.isdir(path)
        assert hygiene.remove([path], kept=True) == 0
    finally:
        hygiene.release(held)
    cut_short = tmp_path / f"{hygiene.REMOVING}ddict-old.12345"  # (its remover died)
    cut_short.mkdir()
    (cut_short / "data.mdb").write_bytes(b"x")
    assert hygiene.sweep(str(tmp_path)) == [path] and not os.path.exists(path)
    assert os.listdir(tmp_path) == []  # (renamed out of its name, then removed)


def test_a_kept_shard_kept_again_meanwhile_is_not_swept_on_what_its_old_keeper_said(tmp_path):
    """A sweep of kept shards asks each one's keeper (seconds, over the network), then
    removes those whose keeper is gone: one that was kept again meanwhile, by another
    keeper, stays."""
    path = str(tmp_path / "ddict-d-m0")
    os.mkdir(path)
    hygiene.release(hygiene.claim(path))
    old = hygiene.keeper("tcp://10.0.0.1:8786", hygiene.RESTART, "d", "ab" * 16, 0)
    hygiene.mark_kept(path, record=old)
    asked = hygiene.kept_record(path)
    new = hygiene.keeper("tcp://10.0.0.2:8786", hygiene.PARKED, "d", "ab" * 16, 0)
    hygiene.mark_kept(path, record=new)  # (re-attached and kept again, by a live one)
    assert not hygiene._remove_abandoned(path, True, asked) and os.path.isdir(path)
    assert hygiene._remove_abandoned(path, True, new) and not os.path.exists(path)


def test_a_shard_kept_aside_goes_only_if_nobody_claims_it_and_nothing_else_keeps_it(tmp_path):
    """A primary deposed during a move to another host process of the same machine keeps
    aside the very shard its new host serves (such a move copies nothing): discarding
    it then leaves it be, as it leaves one parked or kept for a restart since."""
    aside = hygiene.keeper("tcp://10.0.0.1:8786", hygiene.ASIDE, "d", "ab" * 16, 0)
    made = {}
    for name in ("served", "parked", "aside", "unmarked"):
        path = made[name] = str(tmp_path / f"ddict-d-{name}")
        os.mkdir(path)
        hygiene.release(hygiene.claim(path))
        hygiene.mark_kept(path, record=aside)
    os.unlink(os.path.join(made["unmarked"], hygiene.KEPT))
    parked = hygiene.keeper("tcp://10.0.0.1:8786", hygiene.PARKED, "d", "ab" * 16, 0)
    hygiene.mark_kept(made["parked"], record=parked)  # (parked by its new host since)
    held = hygiene.claim(made["served"])  # (its new host serves it)
    try:
        assert not hygiene.remove_aside(made["served"]) and os.path.isdir(made["served"])
        assert not hygiene.remove_aside(made["parked"]) and os.path.isdir(made["parked"])
        assert hygiene.remove_aside(made["aside"]) and not os.path.exists(made["aside"])
        assert hygiene.remove_aside(made["unmarked"]) and not os.path.exists(made["unmarked"])
        assert not hygiene.remove_aside(str(tmp_path / "ddict-d-gone"))
    finally:
        hygiene.release(held)
    assert sorted(os.listdir(tmp_path)) == ["ddict-d-parked", "ddict-d-served"]


def test_off_loop_runs_in_a_thread_of_its_own_once_the_pools_are_shut_down():
    """While the interpreter exits, the event loop's executor refuses work ("cannot
    schedule new futures after shutdown"): a supervisor's control call then runs in a
    thread of its own, and its result or error comes back as usual."""
    from dask_ddict.host.off_loop import off_loop

    async def main() -> None:
        assert await off_loop(threading.current_thread) is not threading.current_thread()
        pool = ThreadPoolExecutor(1)
        asyncio.get_running_loop().set_default_executor(pool)
        pool.shutdown()
        with pytest.raises(RuntimeError, match="after shutdown"):
            pool.submit(int)
        ran = await off_loop(lambda x: (x, threading.current_thread().name), 7)
        assert ran == (7, "ddict-off-loop")
        with pytest.raises(KeyError):
            await off_loop({}.__getitem__, "missing")

    asyncio.run(main())


def test_a_directory_without_a_lock_file_is_never_touched(tmp_path):
    (tmp_path / "ddict-foreign").mkdir()
    assert hygiene.sweep(str(tmp_path)) == []


def test_control_messages_round_trip_and_hide_the_secret():
    spec = DictSpec("n", "ab" * 16, "s3cr3t", DDictOptions(), 1 << 20, 2)
    buf = io.BytesIO()
    msgs = [
        control.OpenManagers(spec, (0, 1), {1: "/dev/shm/x"}, "tcp://w"),
        control.CloseManagers("ab" * 16, True),
        control.Serve(),
        control.Ping(),
    ]
    for m in msgs:
        control.send(buf, m)
    buf.seek(0)
    assert [control.recv(buf) for _ in msgs] == msgs
    assert control.recv(buf) is None  # EOF: the supervisor is gone
    assert "s3cr3t" not in repr(spec) and "s3cr3t" not in repr(msgs[0])


@pytest.fixture
def ws(tmp_store):  # noqa: ANN001, ANN201
    w = WorkingSet(tmp_store, 2)
    with tmp_store.write() as txn:
        w.save(txn)
    return w


def _key(i: int) -> tuple[bytes, bytes]:
    kb = dumps_key(i)
    return key_digest(kb), kb


def test_put_in_window_decides_like_the_manager(tmp_store, ws):
    st = tmp_store
    frame = dumps_value("v").join()
    d0, k0 = _key(0)
    with st.write() as txn:
        assert put_in_window(st, txn, 2, d0, 1, k0, frame)  # inside [0, 1]
        assert not put_in_window(st, txn, 2, d0, 2, k0, frame)  # would move the window
    with st.read() as txn:
        assert ws.get(txn, d0, 1).frame == frame and not ws.contains(txn, d0, 0)
    with st.write() as txn:
        st.put_meta(txn, FROZEN, b"\x01")
        assert not put_in_window(st, txn, 2, d0, 1, k0, frame)  # frozen: the manager says so
        st.put_meta(txn, FROZEN, b"\x00")
        add_waiters(st, txn, 1)
        assert not put_in_window(st, txn, 2, d0, 1, k0, frame)  # a waiter: the manager wakes it
        add_waiters(st, txn, -1)
        assert put_in_window(st, txn, 2, d0, 0, k0, frame)
    mark_closed(st, 1, CLOSED_DESTROYED)
    with st.write() as txn:
        assert not put_in_window(st, txn, 2, d0, 1, k0, frame)  # closed: the manager answers


def test_buffer_pool_gives_buffers_back_when_the_last_view_dies():
    pool = BufferPool(8 << 20)
    a = pool.get(1 << 20)
    addr = np.frombuffer(a, np.uint8).ctypes.data
    view = np.frombuffer(a, np.uint8)[10:20]
    del a
    gc.collect()
    assert pool.held == 0  # a view still refers to it
    del view
    gc.collect()
    assert pool.held >= 1 << 20
    b = pool.get(1 << 20)
    assert np.frombuffer(b, np.uint8).ctypes.data == addr  # the same, warm buffer
    big = pool.get(16 << 20)  # above what the pool keeps: its own buffer
    del big, b
    gc.collect()
    assert pool.held <= pool.keep
    assert pool._out == {}  # (no reference to a buffer given back is kept)


def test_buffer_pool_takes_buffers_back_from_any_thread():
    """Views dropped by other threads (a task's, a loop's) give their buffers back, each
    once: every buffer handed out is free again, and nothing stays outstanding."""
    pool = BufferPool(64 << 20)
    held = [[pool.get(100 << 10) for _ in range(16)] for _ in range(4)]
    threads = [threading.Thread(target=h.clear) for h in held]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert pool._out == {}
    free = [b for bufs in pool._free.values() for b in bufs]
    assert len(free) == 64 and len({id(b) for b in free}) == 64
    assert pool.held == sum(b.nbytes for b in free)


def test_a_prepared_copy_is_mapped_ahead_and_removed_if_no_move_takes_it(tmp_path):
    """``prepare`` makes a moving manager's copy ready before the pause (a shard file of
    the whole map, its used part mapped); unused, it goes with its expiry."""
    import dask.config

    from dask_ddict.host import moves
    from dask_ddict.shard.store import ShardStore

    with dask.config.set({"ddict.store.directory": str(tmp_path), "ddict.store.reserve": True}):
        path = moves.prepare("d", 3, 8 << 20, 1 << 20)
        assert os.path.dirname(path) == str(tmp_path) and "ddict-d-3-" in path
        data = os.path.join(path, "data.mdb")
        assert os.path.getsize(data) == ShardStore.map_size_for(8 << 20)
        assert os.stat(data).st_blocks * 512 >= ShardStore.map_size_for(8 << 20)  # reserved
        assert not hygiene.is_abandoned(path)  # (claimed while it waits)
        mm = moves._PREPARED[path][0]
        assert len(mm) == ShardStore.map_size_for(8 << 20)  # (1 MiB used + room to grow)
        moves._unprepare(path)
        assert not os.path.exists(path) and path not in moves._PREPARED
        moves._unprepare(path)  # (twice: nothing left to do)
