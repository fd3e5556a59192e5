from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from dask_ddict._hashing import key_digest
from dask_ddict._serialize import ALIGN, dumps_value, loads_value
from dask_ddict.errors import DDictFullError
from dask_ddict.shard.store import PERSISTENT, TOMBSTONE, ShardStore


def test_versions_newest_at_or_below(tmp_store):
    d = key_digest(b"k")
    with tmp_store.write() as txn:
        for c in (0, 2, 5):
            tmp_store.put(txn, d, c, b"k", dumps_value(c).join(), PERSISTENT)
    with tmp_store.read() as txn:
        got = {c: tmp_store.lookup(txn, d, c) for c in range(8)}
        assert [None if e is None else e.chkpt for e in got.values()] == [0, 0, 2, 2, 2, 5, 5, 5]
        assert loads_value(bytes(got[3].frame)) == 2
        assert tmp_store.lookup(txn, key_digest(b"other"), 9) is None


def test_long_keys_beyond_lmdb_limit(tmp_store):
    key = b"x" * 5000  # LMDB's own key limit is 511 bytes
    d = key_digest(key)
    with tmp_store.write() as txn:
        tmp_store.put(txn, d, 0, key, dumps_value("v").join())
    with tmp_store.read() as txn:
        e = tmp_store.lookup(txn, d, 0)
        assert bytes(e.key) == key and loads_value(bytes(e.frame)) == "v"


def test_stored_large_buffers_are_64_byte_aligned(tmp_store):
    arr = np.arange(100_000, dtype="f8")
    d = key_digest(b"a")
    with tmp_store.write() as txn:
        tmp_store.put(txn, d, 0, b"a", dumps_value(arr).join())
    with tmp_store.read() as txn:
        out = loads_value(tmp_store.lookup(txn, d, 0).frame)  # a view into the shard
        assert out.__array_interface__["data"][0] % ALIGN == 0
        np.testing.assert_array_equal(out, arr)
        del out


def test_full_threshold_refuses_and_keeps_data(tmp_path):
    st = ShardStore(str(tmp_path / "s"), 4 << 20, full_thresh=0.5)
    try:
        d = key_digest(b"small")
        with st.write() as txn:
            st.check_room(txn, 100)
            st.put(txn, d, 0, b"small", dumps_value(1).join())
        with pytest.raises(DDictFullError, match="full"):
            with st.write() as txn:
                st.check_room(txn, 3 << 20)
        with st.read() as txn:
            assert loads_value(bytes(st.lookup(txn, d, 0).frame)) == 1
    finally:
        st.destroy()


def test_value_bigger_than_map_raises_full_and_rolls_back(tmp_path):
    st = ShardStore(str(tmp_path / "s"), 1 << 20)
    try:
        with pytest.raises(DDictFullError):
            with st.write() as txn:
                st.put(txn, key_digest(b"a"), 0, b"a", dumps_value(1).join())
                st.put(txn, key_digest(b"b"), 0, b"b", bytes(8 << 20))
        with st.read() as txn:  # the whole transaction rolled back
            assert st.lookup(txn, key_digest(b"a"), 0) is None
    finally:
        st.destroy()


def test_attempt_commits_or_leaves_nothing(tmp_store):
    """``attempt`` (a writer's common case): committed, with its hook, and known as this
    process's own commit (no exact count of the room next); or, if anything raises or
    the shard is replicated, nothing of it and ``False`` (its caller writes the full way)."""
    hooked, counted = [], []
    tmp_store.on_commit = lambda: hooked.append(1)
    exact = tmp_store.used_bytes
    tmp_store.used_bytes = lambda txn: counted.append(1) or exact(txn)
    d, e = key_digest(b"d"), key_digest(b"e")

    def put(txn, digest, key, error):
        tmp_store.put(txn, digest, 0, key, dumps_value(key).join())
        if error is not None:
            raise error

    try:
        assert tmp_store.attempt(partial(put, digest=d, key=b"d", error=None)) is True
        assert hooked == [1]
        with tmp_store.env.begin(write=True) as txn:
            tmp_store.check_room(txn, 100)  # (the last commit was its own: no exact count)
            assert not counted
            txn.abort()
        assert tmp_store.attempt(partial(put, digest=e, key=b"e", error=ValueError("no"))) is False
        assert hooked == [1]
        with tmp_store.read() as txn:
            assert tmp_store.lookup(txn, d, 0) is not None and tmp_store.lookup(txn, e, 0) is None
        tmp_store.replicate = lambda changes, later: None
        assert tmp_store.attempt(partial(put, digest=e, key=b"e", error=None)) is False
        assert hooked == [1]
        tmp_store.replicate = None
        with pytest.raises(KeyboardInterrupt):  # (raised on, not done again: rolled back)
            tmp_store.attempt(partial(put, digest=e, key=b"e", error=KeyboardInterrupt()))
        with tmp_store.write() as txn:  # (the writer's lock is free again)
            assert tmp_store.lookup(txn, e, 0) is None
            tmp_store.put(txn, e, 0, b"e", dumps_value(2).join())
    finally:
        tmp_store.on_commit = tmp_store.replicate = None
        del tmp_store.used_bytes


def test_collect_keeps_one_version_below_window(tmp_store):
    d = key_digest(b"k")
    with tmp_store.write() as txn:
        for c in range(5):
            tmp_store.put(txn, d, c, b"k", dumps_value(c).join())
        tmp_store.collect(txn, d, 3)
    with tmp_store.read() as txn:
        assert [e.chkpt for _, e in tmp_store.scan(txn)] == [4, 3]


def test_tombstone_flag_and_drop_all(tmp_store):
    d = key_digest(b"k")
    with tmp_store.write() as txn:
        tmp_store.put(txn, d, 1, b"k", None, TOMBSTONE)
    with tmp_store.read() as txn:
        assert tmp_store.lookup(txn, d, 1).tombstone
    with tmp_store.write() as txn:
        tmp_store.drop_all(txn)
    with tmp_store.read() as txn:
        assert tmp_store.entries(txn) == 0


def test_shards_are_stamped_and_older_formats_refused(tmp_store):
    """Key bytes changed with format 2: a format-1 shard (no stamp) is refused on re-attach."""
    from dask_ddict.errors import DDictError
    from dask_ddict.shard.store import FORMAT

    with pytest.raises(DDictError, match="dask_ddict.shard/1 .*reads dask_ddict.shard/2.2"):
        tmp_store.check_stamp(0)  # what every shard written before format 2 looks like
    tmp_store.stamp(3)
    tmp_store.check_stamp(3)
    with pytest.raises(DDictError, match="belongs to manager b'3', not 1"):
        tmp_store.check_stamp(1)
    assert FORMAT == b"dask_ddict.shard/2.2"  # key bytes 2, value frames 2 (raw bytes)
    tmp_store.stamp(3)
    with tmp_store.write() as txn:  # a shard of the previous version (same key bytes)
        tmp_store.put_meta(txn, b"format", b"dask_ddict.shard/2")
    tmp_store.check_stamp(3)  # re-attached (its frames are a subset of ours)
