"""A zero-copy view costs its own bytes, not its shard's room.

LMDB reuses no page that an open read snapshot can see, and a zero-copy view
holds one: a 32 MiB view used to pin every page freed after it was taken,
until the shard refused writes.  Now a manager refused room asks the processes
that hold views of its shard to copy them out (``shard/making_room.py``,
``shard/pinboard.py``, ``transport/lending.py``).  These tests hold real views in
the user's process, in a task and in a separate process, rewrite the shard
many times over, stop and kill the holders, and check that the views never
change and that writers get the whole shard.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import threading
import time
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
from distributed import Client, Event
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dask_ddict import DDict, DDictFullError, _memory
from dask_ddict._hashing import key_digest
from dask_ddict._keys import dumps_key
from dask_ddict._serialize import dumps_value
from dask_ddict.shard import pinboard
from dask_ddict.shard.manager import Manager
from dask_ddict.shard.store import ShardStore
from dask_ddict.shard.working_set import WorkingSet
from dask_ddict.transport import lending
from tests.support.lent import in_shard
from tests.support.piped import PipeProcess

one_host = pytest.mark.one_host

MiB = 1 << 20


def _rewrite(m: DDict, rounds: int, keys: int, nbytes: int) -> int:
    """Overwrite ``keys`` keys of ``nbytes`` each, ``rounds`` times; the puts made."""
    puts = 0
    for r in range(rounds):
        for k in range(keys):
            m[f"k{k}"] = np.full(nbytes // 8, r * 1000 + k, dtype="i8")
            puts += 1
    for k in range(keys):  # nothing acknowledged was lost
        assert int(m[f"k{k}"][-1]) == (rounds - 1) * 1000 + k
    return puts


# -- the scenario ----------------------------------------------------------------------


@one_host
def test_a_view_held_while_its_shard_is_rewritten_costs_only_its_bytes(client):
    """One manager of 512 MiB: a 32 MiB view, its key overwritten and popped, then 40 keys
    of 8 MiB overwritten six times (320 MiB live at most).  The 55th put used to fail."""
    with DDict(1, 1, total_mem="512 MiB", client=client) as d:
        m = d.manager(0)
        w = np.arange(4 * MiB, dtype="i8")  # 32 MiB
        m["weights"] = w
        view = m.get("weights", copy=False)
        assert in_shard(d, "weights", view) and not view.flags.writeable
        m["weights"] = np.zeros(8)
        m.pop("weights")
        assert _rewrite(m, 6, 40, 8 * MiB) == 240
        assert np.array_equal(view, w)  # the view never changed...
        assert not in_shard(d, "weights", view)  # ...and it was copied out when the room was needed
        gc.collect()
        s = d.stats[0]
        assert s.pinned_bytes == 0 and s.pinned_views == 0  # it no longer holds the shard
        assert s.num_keys == 40 and s.total_used_bytes <= 40 * 8 * MiB + 8 * MiB
        assert int(m["k39"][0]) == 5039


@one_host
def test_a_view_held_by_a_task_is_copied_out_in_its_process(client):
    with DDict(1, 1, total_mem="512 MiB", client=client) as d:
        m = d.manager(0)
        m["weights"] = np.arange(4 * MiB, dtype="i8")
        taken, done = Event(), Event()

        def hold(d: DDict) -> tuple[bool, bool, int]:
            v = d.manager(0).get("weights", copy=False)
            span = _memory.file_span(v.__array_interface__["data"][0])
            was_shared = span is not None and span[3].endswith("/data.mdb")
            taken.set()
            done.wait(120)
            return was_shared, bool(np.array_equal(v, np.arange(4 * MiB))), os.getpid()

        fut = client.submit(hold, d, pure=False)
        assert taken.wait(60)
        m.pop("weights")
        _rewrite(m, 6, 40, 8 * MiB)
        done.set()
        was_shared, intact, pid = fut.result(60)
        assert was_shared and intact and pid != os.getpid()
        gc.collect()
        assert d.stats[0].pinned_bytes == 0


# -- holders that cannot answer, or die -----------------------------------------------------------

_READER = """
import os
import numpy as np
from dask_ddict import DDict
views = []
def handle(arg):
    global d
    cmd, x = arg
    if cmd == "attach":
        d = DDict.attach(x)
        return os.getpid()
    if cmd == "view":
        views.append(d.manager(0).get(x, copy=False))
        return int(views[-1].sum())
    if cmd == "sums":
        return [int(v.sum()) for v in views]
"""


@contextlib.contextmanager
def _held_by_another_process(client: Client) -> Iterator[tuple[DDict, DDict, PipeProcess, int]]:
    """A dictionary of one 96 MiB manager whose 8 MiB value another process holds as a
    zero-copy view, then popped: ``(dictionary, its manager's handle, the process, its
    pid)``; the process is closed or reaped afterwards."""
    with DDict(1, 1, total_mem="96 MiB", client=client) as d:
        m = d.manager(0)
        m["v"] = np.arange(MiB, dtype="i8")
        reader = PipeProcess(_READER)
        try:
            pid = reader.call(("attach", d.serialize()))
            assert reader.call(("view", "v")) == sum(range(MiB))
            m.pop("v")
            yield d, m, reader, pid
        finally:
            if reader.proc.poll() is None:
                assert reader.close() == 0
            reader.proc.wait(30)


@one_host
def test_a_holder_that_does_not_answer_is_named_then_gives_the_room_back(client):
    with _held_by_another_process(client) as (_, m, reader, pid):
        os.kill(pid, signal.SIGSTOP)  # it cannot answer the manager now
        try:
            with pytest.raises(DDictFullError) as e:
                _rewrite(m, 12, 8, 4 * MiB)  # needs the room that the view holds
            assert str(pid) in str(e.value) and "release-timeout" in str(e.value)
        finally:
            os.kill(pid, signal.SIGCONT)
        _rewrite(m, 12, 8, 4 * MiB)  # it answers now: the room comes back
        assert reader.call(("sums", None)) == [sum(range(MiB))]  # and its view is intact


@one_host
def test_a_holder_killed_holds_nothing_and_leaves_nothing(client):
    with _held_by_another_process(client) as (d, m, reader, pid):
        socket_dir = os.path.dirname(d._core.layout.managers[0].uds_path)
        assert os.path.exists(pinboard.request_path(socket_dir, pid))
        assert d.stats[0].pinned_bytes >= 8 * MiB
        os.kill(pid, signal.SIGKILL)
        reader.proc.wait(30)
        assert _rewrite(m, 12, 8, 4 * MiB) == 96  # its snapshot went with it
        assert d.stats[0].pinned_bytes == 0
        left = [n for n in os.listdir(socket_dir) if n.endswith((f".{pid}", f"-{pid}"))]
        assert left == []  # its board and its request socket are gone


@one_host
def test_a_holder_killed_while_it_is_asked_gives_the_room_back(client):
    with _held_by_another_process(client) as (d, m, _, pid):
        os.kill(pid, signal.SIGSTOP)  # it cannot answer; then it dies while the manager waits
        killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
        killer.start()
        try:
            assert _rewrite(m, 12, 8, 4 * MiB) == 96  # the writes get the room all the same
        finally:
            killer.join()
        assert d.stats[0].pinned_bytes == 0


def test_a_holder_that_ends_its_snapshot_just_after_a_refusal_gives_the_room(tmp_path, monkeypatch):
    """A holder asked earlier (a stopped process, continued) may end its snapshot between
    a write's refusal and the manager's look at the boards: they show nothing pinned by
    then, yet the write is tried again and gets the room (it used to be refused)."""
    store = ShardStore(str(tmp_path / "shard"), 16 * MiB)
    m = Manager(0, store, WorkingSet(store, 2))
    m.pins = pinboard.BoardReader(str(tmp_path), "u", 1)
    board = pinboard.PinBoard(str(tmp_path), "u", 1)  # (this process holds the view)
    try:
        value = dumps_value(np.zeros(MiB // 2)).join()  # 4 MiB
        digest, kb = key_digest(dumps_key("a")), dumps_key("a")
        m.put(digest, kb, value, 0, 1)
        unknown = store.env.begin(buffers=True)  # a snapshot on no board: a final refusal
        with pytest.raises(DDictFullError, match="pages reach"):
            for _ in range(8):
                m.put(digest, kb, value, 0, 1)
        unknown.abort()
        held = [store.env.begin(buffers=True)]  # the view's snapshot
        board.add(0, len(value), 1)
        put = store._put

        def refused_then_released(*args: object) -> None:
            try:
                put(*args)
            except DDictFullError:
                if held:  # the holder answers the earlier request only now
                    held.pop().abort()
                    board.add(0, -len(value), -1)
                raise

        monkeypatch.setattr(store, "_put", refused_then_released)
        for _ in range(8):  # (the snapshot keeps every page freed: the 3rd or so is refused)
            m.put(digest, kb, value, 0, 1)
        assert not held  # a write was refused while the view was held, and got the room
    finally:
        m.close()
        pinboard.remove_boards(str(tmp_path), "u")


# -- interleavings ---------------------------------------------------------------------------------

_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 4), st.sampled_from([1 << 16, 4 * MiB, 8 * MiB])),
        st.tuples(st.just("pop"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("view"), st.integers(0, 5), st.just(0)),
        st.tuples(st.just("drop"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("clear"), st.just(0), st.just(0)),
        st.tuples(st.just("checkpoint"), st.just(0), st.just(0)),
        st.tuples(st.just("frozen"), st.integers(0, 5), st.just(0)),
    ),
    min_size=1,
    max_size=14,
)


@one_host
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(steps=_STEPS)
@example(
    steps=[
        ("put", 0, 8 * MiB),
        ("view", 0, 0),
        ("put", 0, 8 * MiB),
        ("put", 1, 8 * MiB),
        ("put", 0, 4 * MiB),
        ("pop", 1, 0),
        ("frozen", 0, 0),
        ("put", 0, 8 * MiB),
    ]
)
def test_views_stay_intact_and_writers_get_the_shard_whatever_happens(client, steps):
    """Views taken and dropped among puts, overwrites, pops, clears, checkpoint retirements
    and freeze/unfreeze: after every step every live view holds what it was taken with,
    and at the end writers can fill the shard up to its room less what is live."""
    capacity, thresh = 64 * MiB, 0.9
    with DDict(1, 1, total_mem=capacity, client=client) as d:
        m = d.manager(0)
        truth: dict[int, np.ndarray] = {}
        views: list[tuple[np.ndarray, np.ndarray]] = []
        n = 0
        for op, k, size in steps:
            n += 1
            if op == "put":
                truth[k] = np.full(size // 8, n, dtype="i8")
                m[k] = truth[k]
            elif op == "pop":
                assert (m.pop(k, None) is None) == (k not in truth)
                truth.pop(k, None)
            elif op == "view" and k in truth:
                views.append((m.get(k, copy=False), truth[k]))
            elif op == "frozen" and k in truth:
                d.freeze()
                views.append((m[k], truth[k]))  # (a frozen dictionary reads zero-copy)
                d.unfreeze()
            elif op == "drop" and views:
                views.pop(k % len(views))
            elif op == "clear":
                m.clear()
                truth.clear()
            elif op == "checkpoint":
                d.checkpoint()  # (window of one: the old checkpoint retires)
            for v, want in views:
                assert np.array_equal(v, want)
        live = sum(a.nbytes for a in truth.values())
        filled = 0
        with pytest.raises(DDictFullError):
            for i in range(128):
                m[f"fill{i}"] = np.zeros(MiB // 8, dtype="i8")
                filled += MiB
        overhead = 3 * MiB  # (B-tree pages, page rounding, the key counts' records)
        assert filled + live >= thresh * capacity - overhead, (filled, live)
        for v, want in views:
            assert np.array_equal(v, want)


# -- the pieces, alone ------------------------------------------------------------------------------


def test_a_privatized_mapping_keeps_its_bytes_when_the_file_changes(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 64)  # 16 KiB
    fd = os.open(path, os.O_RDWR)
    try:
        lent = _memory.Lent(fd, 0, 16384)
        view = np.asarray(lent)[100:200]
        assert not view.flags.writeable
        os.pwrite(fd, b"\xff" * 16384, 0)
        assert (view == 0xFF).all()  # shared: the file's pages
        os.pwrite(fd, bytes(range(256)) * 64, 0)
        addr = view.__array_interface__["data"][0]
        lent.privatize()
        assert view.__array_interface__["data"][0] == addr  # same addresses
        os.pwrite(fd, b"\xff" * 16384, 0)
        assert list(view[:3]) == [100, 101, 102]  # private now: the file's change is not seen
        span = _memory.file_span(addr)
        assert span is None  # (an anonymous mapping now)
    finally:
        os.close(fd)
    del view, lent
    gc.collect()


def test_a_lent_mapping_says_once_when_its_last_view_is_gone_and_if_it_was_copied(tmp_path):
    """``Lent.on_gone`` is the lender's count of what it lends: called once, when the last
    array made from the mapping is gone, with whether it had been privatized (then counted
    off already), and marked ``gone`` first, so that a release that still finds it through
    a weak reference while it is unmapped leaves it alone (``privatize`` says it did
    nothing, so the release does not count it off a second time)."""
    path = tmp_path / "f"
    path.write_bytes(bytes(16384))
    fd = os.open(path, os.O_RDONLY)
    said: list[tuple[bool, bool]] = []
    try:
        for privatize in (False, True):
            lent = _memory.Lent(fd, 0, 16384)
            ref = weakref.ref(lent)

            def gone(private: bool, r: weakref.ref[_memory.Lent] = ref) -> None:
                m = r()  # (as a release finds it while it is unmapped)
                assert m is not None and not m.privatize() and m.private == private  # (as is)
                said.append((private, m.gone))

            lent.on_gone = gone
            view = np.asarray(lent)[10:20]
            part = view[2:5]
            if privatize:
                lent.privatize()
            del lent, view
            assert not said  # (a view is left)
            del part
            gc.collect()
            assert said == [(privatize, True)] and ref() is None
            said.clear()
    finally:
        os.close(fd)


def test_release_requests_are_answered_and_silent_holders_named(tmp_path):
    socket_dir = str(tmp_path)
    lending.listen(socket_dir)  # this process answers (it holds no view: 0 bytes)
    assert pinboard.ask_release(socket_dir, "u", 0, [os.getpid()], 5.0) == (0, [])
    # a holder that listens but does not answer is named after the timeout
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    silent.bind(pinboard.request_path(socket_dir, 999_999))
    try:
        t0 = time.monotonic()
        assert pinboard.ask_release(socket_dir, "u", 0, [999_999], 0.2) == (0, [999_999])
        assert time.monotonic() - t0 < 5
        assert silent.recv(64) == pinboard.encode_request("u", 0)
    finally:
        silent.close()
    # a process that does not listen (it ended) is not waited for
    assert pinboard.ask_release(socket_dir, "u", 0, [999_998], 5.0) == (0, [])
    asks = [n for n in os.listdir(socket_dir) if "ask" in n]
    assert asks == []  # the asker's socket is removed
