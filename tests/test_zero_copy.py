"""Zero-copy reads on the manager's host: views of the shard that never change.

Every test takes real views of real shards (LMDB in /dev/shm) and then does
what could reuse their pages: overwrites, pops, clears, window moves,
unfreeze, a SIGKILL of the host process, destroy.
"""

from __future__ import annotations

import gc
import os
import signal
import time

import dask
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dask_ddict import DDict, _memory, kernels
from dask_ddict.shard.store import ShardStore
from dask_ddict.transport import lending, mapped, shared
from dask_ddict.transport.many_key_ops import GetMany
from tests.support.lent import in_shard, resident_kib
from tests.support.polling import poll_for
from tests.support.shards import snapshots

#: Views of the shard need the shard on this host (the TCP test below does not).
one_host = pytest.mark.one_host


def _settled(d: DDict) -> None:
    """Drop the test's garbage and let the host's pin boards be read afresh."""
    gc.collect()
    time.sleep(0.01)


def test_an_interrupted_end_of_a_lending_read_still_ends_it(tmp_path, monkeypatch):
    """A lending read ends by closing the shard's file, then counting itself off its
    snapshot; an interrupt in between left the snapshot open, its reader slot held, for
    the process's life.  (The interrupt is raised where a signal's handler would: as
    the file's close returns.)"""
    store = ShardStore(str(tmp_path / "shard"), 1 << 20)
    idle: list[int] = []
    lender = lending.Lender(store, 0, (str(tmp_path), "uid", 1), lambda: idle.append(1))
    try:
        s = lender.begin(0)
        assert s is not None and s.txn is not None
        s.file = (os.devnull, os.open(os.devnull, os.O_RDONLY))
        close = os.close

        def interrupted(fd: int) -> None:
            close(fd)
            raise KeyboardInterrupt

        monkeypatch.setattr(lending.os, "close", interrupted)
        with pytest.raises(KeyboardInterrupt):
            lender.end(s)
        monkeypatch.undo()
        assert (s.uses, s.txn, s.file, lender.open, idle) == (0, None, None, 0, [1])
        assert snapshots(store.env) == []  # (the spare's slot, if any, holds none)
    finally:
        store.close()
        listener = lending._LISTENERS.pop(str(tmp_path), None)  # (its thread ends with it)
        if listener is not None:
            listener.close()


@one_host
def test_a_zero_copy_get_is_a_read_only_view_of_the_shard(client):
    with DDict(total_mem="64 MiB", client=client) as d:
        a = np.arange(1 << 20, dtype="f8")  # 8 MiB
        d["a"] = a
        v = d.get("a", copy=False)
        assert not v.flags.writeable and in_shard(d, "a", v)
        assert (v == a).all()
        with pytest.raises(ValueError, match="read-only"):
            v[0] = 1.0
        c = d.get("a")  # a copy by default (the dictionary is not frozen)
        assert c.flags.writeable and not in_shard(d, "a", c)
        c2 = d.get_many(["a"])[0]
        assert c2.flags.writeable and not in_shard(d, "a", c2)
        (v2,) = d.get_many(["a"], copy=False)
        assert not v2.flags.writeable and in_shard(d, "a", v2)
        assert d.get("missing", "dflt", copy=False) == "dflt"
        assert d.get("small", copy=False) is None
        d["small"] = {"x": 1}  # no out-of-band buffer: nothing to lend, plain object
        assert d.get("small", copy=False) == {"x": 1}
        m = d.which_manager("a")
        _settled(d)
        st_ = d.stats[m]
        assert st_.pinned_views == 2 and st_.pinned_bytes >= 2 * a.nbytes
        del v, v2
        _settled(d)
        assert d.stats[m].pinned_views == 0 and d.stats[m].pinned_bytes == 0


@one_host
def test_values_under_a_page_are_copied_read_only_and_larger_ones_lent(client, monkeypatch):
    """A value under ``LEND_MIN`` bytes read to be lent (``copy=False``, or from a frozen
    dictionary) is copied instead (a mapping of its own would cost several times the
    copy and pin a page for it): its arrays are read-only, as lent ones are, and nothing
    is pinned for it; larger ones are lent.  A same-host ``get_many`` with ``copy=False``
    reads them in its walk of each shard (no ``GetMany`` of its own), as it copies."""
    small, big = np.arange(12), np.arange(4096)  # a frame of ~250 B; one of 32 KiB
    assert lending.LEND_MIN > 1000 and big.nbytes > lending.LEND_MIN
    want: dict[str, object] = {f"s{i}": small + i for i in range(20)}
    want |= {f"b{i}": big + i for i in range(20)}
    want |= {"raw": b"x" * 100, "obj": {"x": 1}}
    keys = list(want)
    own_walks: list[object] = []
    walk = shared._LOCAL[GetMany]
    monkeypatch.setitem(shared._LOCAL, GetMany, lambda ch, o: own_walks.append(o) or walk(ch, o))

    def check(got: list[object]) -> None:
        for k, v in zip(keys, got, strict=True):
            if isinstance(v, np.ndarray):
                assert (v == want[k]).all() and not v.flags.writeable, k
                assert in_shard(d, k, v) == k.startswith("b"), k
            else:
                assert v == want[k]
        _settled(d)
        assert sum(s.pinned_views for s in d.stats) == 20
        assert lending.lent_bytes() >= 20 * big.nbytes

    with DDict(total_mem="64 MiB", client=client) as d:
        d.update(want)
        check(d.get_many(keys, copy=False))
        assert not own_walks  # (every shard read in place)
        check([d.get(k, copy=False) for k in keys])
        d.freeze()
        check([d[k] for k in keys])
        check(d.get_many(keys, copy=None))
        _settled(d)
        assert sum(s.pinned_views for s in d.stats) == 0 and lending.lent_bytes() == 0


def _shard_files() -> int:
    """How many descriptors of shard files (``data.mdb``) this process holds."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").endswith("data.mdb")
        except OSError:  # (the listing's own descriptor, closed since)
            pass
    return n


@one_host
def test_a_get_many_that_lends_opens_each_shard_once(client, monkeypatch):
    """A lent value is a mapping of the shard's file of its own, which needs the file open
    only while it is made: a ``get_many(copy=False)`` opens each shard's file once for
    all the values it lends there (a single get once for its one), and closes it when
    its read ends."""
    opened: list[str] = []
    real_open = os.open

    def counting(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if str(path).endswith("data.mdb"):
            opened.append(str(path))
        return real_open(path, *args, **kwargs)

    with DDict(total_mem="64 MiB", client=client) as d:
        keys = [f"k{i}" for i in range(40)]
        d.update({k: np.full(1 << 12, i) for i, k in enumerate(keys)})  # 32 KiB: lent
        d.get_many(keys[:1], copy=False)  # (every channel and map made)
        held = _shard_files()  # (LMDB's own: its environments keep theirs open)
        monkeypatch.setattr(os, "open", counting)
        views = d.get_many(keys, copy=False)
        assert all(in_shard(d, k, v) and v[0] == i for i, (k, v) in enumerate(zip(keys, views)))
        shards = {d.which_manager(k) for k in keys}
        assert len(opened) == len(set(opened)) == len(shards), opened
        opened.clear()
        one = d.get(keys[0], copy=False)
        assert in_shard(d, keys[0], one) and len(opened) == 1
        monkeypatch.undo()
        assert _shard_files() == held  # (each closed when its read ended)
        del views, one
        _settled(d)


@one_host
def test_a_lent_value_is_not_touched_in_the_readers_map_of_the_shard(client, monkeypatch):
    """A zero-copy read maps the value's pages apart for its view and touches none of them
    in this process's map of the shard, where a copying read has them all touched first
    (py-lmdb's preload, with the interpreter lock released): a 32 MiB get with
    ``copy=False`` grows the map's resident pages by a few, a copying one by the value,
    and ``in`` by a few (the pure kernels preload every value they hand out)."""
    from dask_ddict.kernels import COMPILED

    monkeypatch.setattr(mapped, "_unreleased", 0)  # (no release of every map meanwhile)
    with DDict(total_mem="256 MiB", client=client) as d:
        d["big"] = np.ones(4 << 20)  # 32 MiB
        d.get("big", copy=False)  # (the channel and its map made)
        path = d._core.layout.managers[d.which_manager("big")].store_path + "/data.mdb"
        span = _memory.mapping_of(path)
        assert span is not None
        for copy in (False, True, None):
            _memory.release(span[0], span[1] - span[0])
            before = resident_kib(*span)
            v = d.get("big", copy=copy)
            grew = resident_kib(*span) - before
            assert (v == 1).all() and in_shard(d, "big", v) == (copy is False)
            assert (grew >= 16 << 10) == (copy is not False or not COMPILED), (copy, grew)
            del v
            _settled(d)
        _memory.release(span[0], span[1] - span[0])
        before = resident_kib(*span)
        assert "big" in d  # (and a membership test reads its flags alone)
        assert (resident_kib(*span) - before >= 16 << 10) == (not COMPILED)
        d["obj"] = list(range(50_000))  # (a large pickle without buffers: never lent)
        for _ in range(2):  # (copied: its pages touched before the copy)
            assert d.get("obj", copy=False) == list(range(50_000))
            d.freeze()
        d.unfreeze()


@one_host
def test_a_copied_value_is_touched_first_unless_this_process_mapped_it(client, monkeypatch):
    """A same-host copying read seeks a large value untouched and has
    ``kernels.touch_pages`` fault its pages in (the interpreter lock released) before the
    copy: at its first read and after its pages were given back, not when it is read
    again meanwhile (its pages are mapped: a second walk would fault nothing); a value
    under ``PRELOADED`` is copied as it is."""

    touched: list[int] = []
    real = kernels.touch_pages

    def counting(frame: memoryview) -> None:
        touched.append(frame.nbytes)
        real(frame)

    monkeypatch.setattr(kernels, "touch_pages", counting)
    monkeypatch.setattr(mapped, "_unreleased", 0)  # (no release of every map meanwhile)
    with DDict(total_mem="64 MiB", client=client) as d:
        d["big"], d["mid"] = np.ones(1 << 18), np.ones(1 << 14)  # 2 MiB, 128 KiB
        d["low"], d["small"] = np.ones(1 << 12), b"x" * 100  # 32 KiB, 100 B
        for copy in (True, None, True):  # (not frozen: copy=None copies too)
            assert (d.get("big", copy=copy) == 1).all()
        assert len(touched) == 1 and touched[0] >= 2 << 20, touched
        path = d._core.layout.managers[d.which_manager("big")].store_path + "/data.mdb"
        span = _memory.mapping_of(path)
        assert span is not None
        _memory.release(span[0], span[1] - span[0])  # (its pages given back, and forgotten)
        assert (d["big"] == 1).all() and len(touched) == 2
        for _ in range(2):
            assert (d["mid"] == 1).all() and (d["low"] == 1).all()
        assert d["small"] == b"x" * 100
        assert len(touched) == 3 and 128 << 10 <= touched[-1] < 1 << 20, touched


@one_host
def test_a_frozen_dict_reads_zero_copy_and_views_outlive_unfreeze(client):
    with DDict(total_mem="64 MiB", client=client) as d:
        d.update({i: np.full(50_000, i, dtype="i8") for i in range(4)})
        d.freeze()
        views = [d[i] for i in range(4)] + d.get_many(range(4), copy=None)
        assert all(not v.flags.writeable and in_shard(d, i % 4, v) for i, v in enumerate(views))
        assert d.get(0, copy=True).flags.writeable  # copy=True copies, frozen or not
        d.unfreeze()
        for i in range(4):
            d[i] = np.full(50_000, -1, dtype="i8")
        d.clear()
        assert all((v == i % 4).all() for i, v in enumerate(views))


Step = st.one_of(
    st.tuples(st.just("read"), st.integers(0, 5)),
    st.tuples(st.just("put"), st.integers(0, 5)),
    st.tuples(st.just("pop"), st.integers(0, 5)),
    st.tuples(st.just("clear"), st.none()),
    st.tuples(st.just("advance"), st.none()),  # the window moves: a checkpoint retires
    st.tuples(st.just("freeze"), st.none()),
    st.tuples(st.just("drop"), st.integers(0, 50)),
)


@one_host
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(steps=st.lists(Step, min_size=5, max_size=40))
def test_live_views_never_change_whatever_happens_to_the_keys(client, steps):
    d = DDict(total_mem="32 MiB", client=client, working_set_size=2)
    live: list[tuple[np.ndarray, np.ndarray]] = []  # (view, what it showed when taken)
    frozen = False
    try:
        for n, (what, arg) in enumerate(steps):
            if what == "read":
                v = d.get(arg, copy=False)
                if v is not None:
                    live.append((v, v.copy()))
            elif what == "put" and not frozen:
                d[arg] = np.full(16_384, n, dtype="i8")  # 128 KiB: LMDB overflow pages
            elif what == "pop" and not frozen:
                d.pop(arg, None)
            elif what == "clear" and not frozen:
                d.clear()
            elif what == "advance" and not frozen:
                d.checkpoint()
                d["moved"] = np.zeros(10)  # the manager moves its window here
            elif what == "freeze":
                (d.unfreeze if frozen else d.freeze)()
                frozen = not frozen
            elif what == "drop" and live:
                live.pop(arg % len(live))
            for v, seen in live:
                assert np.array_equal(v, seen), f"a view changed after step {n}: {what}"
    finally:
        d.destroy()
    for v, seen in live:  # the shard is gone: the views are not
        assert np.array_equal(v, seen)


@one_host
def test_ten_thousand_views_taken_and_dropped_leave_nothing_pinned(client):
    with DDict(total_mem="64 MiB", client=client) as d:
        m = d.manager(0)
        for i in range(10):
            m[i] = np.full(1000, i)
        views = []
        for n in range(10_000):
            views.append(m.get(n % 10, copy=False))
            if n % 2000 == 0:
                m[n % 10] = np.full(1000, n % 10)  # the shard changes: a new snapshot
        assert all(not v.flags.writeable for v in views)
        lender = d._core.channel(0)._view.lender
        assert 1 <= lender.open <= int(dask.config.get("ddict.zero-copy.max-snapshots"))
        _settled(d)
        s = d.stats[0]
        assert s.pinned_views == 10_000 and s.pinned_bytes >= 10_000 * 8000
        assert all((v == i % 10).all() for i, v in enumerate(views))
        del views
        _settled(d)
        assert lender.open == 0 and lending.lent_bytes() == 0
        s = d.stats[0]
        assert s.pinned_views == 0 and s.pinned_bytes == 0
        held = snapshots(d._core.channel(0)._view.store.env)
        assert all(pid != os.getpid() for pid, _ in held)  # no snapshot of this process


@one_host
def test_views_dropped_while_another_thread_releases_them_are_counted_off_once(client):
    """One thread takes and drops zero-copy views while another releases every view of the
    shard (as the host asks when a write needs the room), over and over: each value is
    counted off once, by its release or by its last view's going (never both, never
    neither), so that nothing stays pinned, nothing goes below zero, and every value
    read is the one written."""
    import threading

    with DDict(total_mem="64 MiB", client=client) as d:
        m = d.manager(0)
        m["a"] = np.arange(1 << 14)  # 128 KiB: lent
        first = m.get("a", copy=False)
        lender = d._core.channel(0)._view.lender
        stop, released = threading.Event(), []

        def release() -> None:
            while not stop.is_set() and len(released) < 20_000:
                released.append(lender.release())

        t = threading.Thread(target=release)
        t.start()
        try:
            deadline = time.monotonic() + 3
            views = 0
            while time.monotonic() < deadline and views < 5_000:
                v = m.get("a", copy=False)
                assert v[-1] == (1 << 14) - 1 and not v.flags.writeable
                del v
                views += 1
        finally:
            stop.set()
            t.join(30)
        assert not t.is_alive() and views > 100 and any(released)
        del first
        _settled(d)
        assert lending.lent_bytes() == 0 and lender.open == 0
        s = d.stats[0]
        assert s.pinned_views == 0 and s.pinned_bytes == 0


@one_host
def test_pinned_memory_is_bounded_past_it_reads_copy(client):
    with (
        dask.config.set({"ddict.zero-copy.max-pinned": "1 MiB"}),
        DDict(total_mem="64 MiB", client=client) as d,
    ):
        m = d.manager(0)
        m["a"], m["b"] = np.ones(96 * 1024), np.zeros(96 * 1024)  # 768 KiB each
        first = m.get("a", copy=False)
        second = m.get("b", copy=False)
        assert not first.flags.writeable and second.flags.writeable  # past the bound: a copy
        del first
        gc.collect()
        third = m.get("b", copy=False)
        assert not third.flags.writeable  # room again once the first was dropped
    with (
        dask.config.set({"ddict.zero-copy.max-snapshots": 1}),
        DDict(total_mem="64 MiB", client=client) as d,
    ):
        m = d.manager(0)
        m["a"] = np.ones(1000)
        x = m.get("a", copy=False)
        m["a"] = np.zeros(1000)  # changed: a second snapshot would be needed
        y = m.get("a", copy=False)
        assert not x.flags.writeable and y.flags.writeable and (x == 1).all() and (y == 0).all()


@one_host
def test_a_view_survives_the_sigkill_of_its_host_process(client):
    with DDict(total_mem="64 MiB", client=client) as d:
        m = d.manager(0)
        m["a"] = np.arange(1 << 18)
        v = m.get("a", copy=False)
        seen = v.copy()
        pid = d.stats[0].pid
        os.kill(pid, signal.SIGKILL)
        poll_for(  # restarted by its supervisor over the same shard
            lambda: d.stats[0].pid != pid, 60, "the host process restarted", 0.1
        )
        for i in range(5):  # (pages freed under the view are not reused: room for 5)
            m["a"] = np.full(1 << 18, -i)
            m[f"more{i}"] = np.full(1 << 14, i)
        m.clear()
        assert np.array_equal(v, seen) and in_shard(m, "a", v)
        for i in range(40):  # the shard would fill under the view: the new host process
            m["a"] = np.full(1 << 18, i)  # asks for it to be copied out, and it is
        assert np.array_equal(v, seen) and not in_shard(m, "a", v)


@one_host
def test_views_outlive_destroy_then_the_memory_goes(client):
    d = DDict(total_mem="64 MiB", client=client)
    d["a"] = np.arange(1 << 20)
    v = d.get("a", copy=False)
    path = d._core.layout.managers[d.which_manager("a")].store_path
    d.destroy()
    assert not os.path.exists(path)
    assert (v == np.arange(1 << 20)).all()  # the mapping keeps the deleted shard's pages
    del v
    gc.collect()
    assert _memory.mapping_of(path + "/data.mdb") is None  # unmapped with the last view


def test_over_tcp_copy_false_uses_the_received_buffer(client):
    with DDict(total_mem="64 MiB", client=client) as d:
        d["a"] = np.arange(1 << 16)
        with dask.config.set({"ddict.local-transport": False}):
            t = DDict.attach(d.serialize(), client=client)
            v = t.get("a", copy=False)
            (w,) = t.get_many(["a"], copy=False)
        assert t._core.channel(d.which_manager("a")).kind == "tcp"
        assert (v == np.arange(1 << 16)).all() and (w == v).all()
        assert v.base is not None  # a view of the received frame, not a second copy
        t.detach()


@one_host
def test_a_closed_handles_lent_values_do_not_keep_new_handles_off_the_shard(client):
    with dask.config.set({"ddict.local-read": False}):  # (this handle maps no shard)
        d = DDict(total_mem="64 MiB", client=client)
        d["a"] = np.arange(1000)
    with d:
        h = DDict.attach(d.serialize(), client=client)
        v = h.get("a", copy=False)
        path = d._core.layout.managers[d.which_manager("a")].store_path
        h.detach()  # its mapping stays open while v lives...
        assert path in mapped._LENDING and path not in mapped._ENVS
        h2 = DDict.attach(d.serialize(), client=client)
        w = h2.get("a", copy=False)  # ...and a new handle takes it up: still zero-copy
        m = d.which_manager("a")
        assert h2._core.channel(m).kind == "shm" and not w.flags.writeable
        assert (v == w).all() and in_shard(h2, "a", w) and path in mapped._ENVS
        h2.detach()
        del v, w
        gc.collect()
        assert lending.lent_bytes() == 0


def test_a_part_read_counts_its_whole_values_pages_once_and_a_release_forgets_them(monkeypatch):
    """py-lmdb maps the whole of a value it hands out, so a copy of part of a large value
    (a zarr shard's inner chunk, ``GetRange``) counts the whole value's pages towards the
    next release, once while they stay mapped, without recording them as mapped (a
    whole read then touches them first); giving the value's own range back (a lent
    chunk's, ``Lender.lend``) forgets it, so its next read counts it again, and so does
    closing the mapping (a later map may take the same addresses)."""
    import tempfile

    from dask_ddict._hashing import key_digest
    from dask_ddict._serialize import dumps_value
    from dask_ddict.shard.store import ShardStore

    monkeypatch.setattr(mapped, "_unreleased", 0)
    monkeypatch.setattr(_memory, "MAPPED", {})
    st_ = ShardStore(tempfile.mkdtemp(prefix="ddict-test-part-", dir="/dev/shm"), 16 << 20)
    try:
        d = key_digest(b"big")
        with st_.write() as txn:
            st_.put(txn, d, 0, b"big", dumps_value(bytes(range(256)) * 8192).join())
        view = mapped._View(st_)
        with st_.read() as txn:
            frame = st_.lookup(txn, d, 0).frame
            n = frame.nbytes
            assert n >= mapped.RELEASE_LARGE
            counted = n + _memory.PAGE  # (a read counts its bytes and a page)
            assert bytes(view.copy(frame, frame[100:200])) == bytes(frame[100:200])
            assert mapped._unreleased == counted
            assert bytes(view.copy(frame, frame[:10])) == bytes(frame[:10])
            assert mapped._unreleased == counted  # (still mapped: nothing more)
            _memory.release(kernels.address_of(frame), n)
            view.copy(frame, frame[5:6])
            assert mapped._unreleased == 2 * counted
            # (counted, not known mapped: a whole read still touches it first, then
            # records it mapped, counted once more)
            assert list(_memory.MAPPED.values()) == [-n] and not view.mapped(frame)
            assert bytes(view.copy(frame)) == bytes(frame) and view.mapped(frame)
            assert mapped._unreleased == 3 * counted
            view.copy(frame, frame[:1])  # (a part of a value mapped whole: nothing more)
            assert mapped._unreleased == 3 * counted and view.mapped(frame)
            del frame
        view.close()
        assert _memory.MAPPED == {}
    finally:
        st_.destroy()


def test_reading_a_large_value_maps_its_pages_and_release_gives_them_back():
    """py-lmdb touches every page of a value it hands out (its ``preload``): a copying
    read of a large value (``_View.copy``) relies on that instead of mapping the pages
    itself, and counts them; ``_memory.release`` drops them again, and the data stays
    in the shard."""
    import tempfile

    from dask_ddict._hashing import key_digest
    from dask_ddict._serialize import dumps_value, loads_value
    from dask_ddict.shard.store import ShardStore

    def shmem() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssShmem"))

    n = 32 << 20
    st_ = ShardStore(tempfile.mkdtemp(prefix="ddict-test-preload-", dir="/dev/shm"), 2 * n)
    try:
        value, d = np.full(n // 8, 7.0), key_digest(b"big")
        with st_.write() as txn:
            st_.put(txn, d, 0, b"big", dumps_value(value).join())
        lo, hi = _memory.mapping_of(st_.path + "/data.mdb")
        _memory.release(lo, hi - lo)
        before = shmem()
        with st_.read() as txn:
            frame = st_.lookup(txn, d, 0).frame
            assert shmem() - before >= n - (1 << 20)  # every page mapped by the read
            np.testing.assert_array_equal(loads_value(bytes(frame)), value)
            del frame
        _memory.release(lo, hi - lo)
        assert shmem() - before < 1 << 20
        with st_.read() as txn:  # (the data stays in the shard)
            assert loads_value(bytes(st_.lookup(txn, d, 0).frame))[-1] == 7.0
    finally:
        st_.destroy()
