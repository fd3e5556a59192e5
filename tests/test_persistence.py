"""The zarr checkpoint store and the persister, on real zarr stores on disk (no cluster)."""

from __future__ import annotations

import json
import pickle
from typing import Any

import numpy as np
import pytest
import zarr

from dask_ddict import DDictPersistCheckpointError
from dask_ddict._serialize import dumps_value, loads_value
from dask_ddict.persist import Persister, ZarrPersister
from dask_ddict.shard.store import PERSISTENT
from tests.support.keys import Placed  # (a key placed by its own __hash__)


def entries_of(d: dict, flags: int = PERSISTENT):
    frames = {k: dumps_value(v).join() for k, v in d.items()}
    return lambda: ((k, f, flags) for k, f in frames.items())


def read_dict(store: ZarrPersister, chkpt: int) -> dict:
    return {k: loads_value(bytes(v)) for k, v, _ in store.read(chkpt)}


def test_round_trip_and_plain_zarr_layout(tmp_path):
    st = ZarrPersister(str(tmp_path), "d", 1, 4, chunk_bytes=1 << 16)
    big = np.arange(100_000, dtype="f8")  # 800 kB: spans several 64 kB chunks
    data = {b"a": 1, b"b": "two", b"big": big, b"empty": b""}
    assert st.write(3, entries_of(data)) > big.nbytes
    assert st.ids() == [3]
    with pytest.raises(DDictPersistCheckpointError, match="no version of it is recorded by all 4"):
        read_dict(st, 3)  # (the other managers' parts are missing: it is not persisted)
    for m in (0, 2, 3):
        ZarrPersister(str(tmp_path), "d", m, 4).write(3, entries_of({}))
    got = read_dict(st, 3)
    assert got[b"a"] == 1 and got[b"b"] == "two" and got[b"empty"] == b""
    np.testing.assert_array_equal(got[b"big"], big)

    # A user can open it with plain zarr and find what docs/design/checkpoint-stores.md describes.
    g = zarr.open_group(str(tmp_path), mode="r")["d/manager_1/chkpt_3.g0"]
    assert g.attrs["committed"] is True and g.attrs["num_keys"] == 4
    for name in ("keys", "key_offsets", "values", "value_offsets", "flags"):  # zarr's own codec
        assert [type(c).__name__ for c in g[name].metadata.codecs][-1] == "Crc32cCodec"
    assert len(g.attrs["crc32c"]["values"]) == -(-g["values"].shape[0] // (1 << 16))
    koff = g["key_offsets"][...]
    keys = g["keys"][...].tobytes()
    assert sorted(keys[koff[i] : koff[i + 1]] for i in range(4)) == sorted(data)
    assert g["values"].shape == (int(g["value_offsets"][-1]),)
    assert zarr.open_group(str(tmp_path), mode="r")["d/manager_1"].attrs["num_managers"] == 4


def test_empty_checkpoint(tmp_path):
    st = ZarrPersister(str(tmp_path), "d", 0, 1)
    st.write(0, entries_of({}))
    assert st.ids() == [0] and read_dict(st, 0) == {}


def test_uncommitted_checkpoint_is_ignored_and_replaced(tmp_path):
    st = ZarrPersister(str(tmp_path), "d", 0, 1)
    st.write(1, entries_of({b"k": 1}))

    def crash():
        yield b"k", dumps_value(2).join(), PERSISTENT
        raise OSError("disk gone")

    calls = iter([lambda: iter([(b"k", dumps_value(2).join(), PERSISTENT)]), crash])
    with pytest.raises(OSError):
        st.write(2, lambda: next(calls)())  # sizes pass fine, data pass dies
    # the half-written generation is removed at once (a full disk: it would hold the room
    # the next persist needs); one left by a process killed mid-write: test_persist_integrity
    assert "chkpt_2.g0" not in st.group and st.ids() == [1]
    with pytest.raises(DDictPersistCheckpointError, match="not persisted"):
        list(st.read(2))
    st.write(2, entries_of({b"k": 3}))
    assert st.ids() == [1, 2] and read_dict(st, 2) == {b"k": 3}
    assert [g.name for g in st.generations()] == ["chkpt_1.g0", "chkpt_2.g0"]


def _placed_by_client(key, n: int) -> int:
    from dask_ddict._hashing import custom_placement, key_digest, manager_for_digest
    from dask_ddict._keys import encode_key

    mid = custom_placement(key, n)
    return manager_for_digest(key_digest(encode_key(key)), n) if mid is None else mid


@pytest.mark.parametrize("n,m", [(2, 3), (3, 2), (2, 1), (1, 4)])
def test_a_checkpoint_restores_onto_another_number_of_managers(tmp_path, n, m):
    """Written by n managers, read by m: each key once, by the manager that owns it among
    m (as a client places it: by digest, or by its own ``__hash__``), with its value."""
    from dask_ddict._keys import encode_key

    keys = (
        [f"k{i}" for i in range(60)]
        + [(i, "t") for i in range(20)]
        + [Placed(i) for i in range(20)]
    )
    parts: dict[int, dict[bytes, Any]] = {i: {} for i in range(n)}
    for j, k in enumerate(keys):
        parts[_placed_by_client(k, n)][encode_key(k)] = j
    for i in range(n):
        ZarrPersister(str(tmp_path), "d", i, n).write(0, entries_of(parts[i]), version=5)
    got = {}
    for j in range(m):
        mine = read_dict(ZarrPersister(str(tmp_path), "d", j, m), 0)
        for kb, v in mine.items():
            assert kb not in got
            key = pickle.loads(kb)
            assert _placed_by_client(key, m) == j, (key, j)
            got[kb] = v
    assert got == {encode_key(k): j for j, k in enumerate(keys)}
    ZarrPersister(str(tmp_path), "other", 0, 3)  # another dictionary: its own shape


@pytest.mark.parametrize(
    "freq,count,retiring,expected",
    [
        (1, -1, range(6), [0, 1, 2, 3, 4, 5]),
        (2, -1, range(6), [0, 2, 4]),
        (1, 2, range(6), [4, 5]),
        (3, 1, range(7), [6]),
        (1, 0, range(3), []),  # persist_count=0 keeps nothing
        (0, -1, range(3), []),  # persist_freq=0 persists nothing
    ],
)
def test_persister_policy_and_eviction(tmp_path, freq, count, retiring, expected):
    p = Persister(ZarrPersister(str(tmp_path), "d", 0, 1), freq, count)
    released = []
    for c in retiring:
        if p.wants(c):
            p.submit(lambda c=c: released.append(c), [(c, 0, entries_of({b"c": c}))])
    p.sync()
    assert p.ids() == expected == p.store.ids()
    assert released == [c for c in retiring if p.wants(c)]
    for c in expected:
        assert read_dict(p.store, c) == {b"c": c}
    p.close()


def test_persister_reports_failures_at_sync(tmp_path):
    p = Persister(ZarrPersister(str(tmp_path), "d", 0, 1), 1, -1)
    p.write_now(0, entries_of({b"c": 0}))
    calls = iter([entries_of({b"c": 1}), None])

    def bad():  # the sizes pass works, the data pass dies half-way
        fn = next(calls)
        if fn is None:
            raise ValueError("boom")
        return fn()

    released = []
    p.submit(lambda: released.append(1), [(0, 0, bad)])
    with pytest.raises(Exception, match="boom"):
        p.sync()
    assert released == [1]  # the snapshot is released even on failure
    assert p.ids() == [0] == p.store.ids()  # a failed re-persist of 0 keeps the old copy
    assert read_dict(p.store, 0) == {b"c": 0}
    p.sync()  # reported once
    p.close()


def test_discard_above(tmp_path):
    p = Persister(ZarrPersister(str(tmp_path), "d", 0, 1), 1, -1)
    for c in range(4):
        p.write_now(c, entries_of({b"c": c}))
    p.discard_above(1)
    assert p.ids() == [0, 1] == p.store.ids()
    # A new Persister (a restarted manager) finds the same ids on disk.
    assert Persister(ZarrPersister(str(tmp_path), "d", 0, 1), 1, -1).ids() == [0, 1]


def test_file_url_and_fsync(tmp_path):
    st = ZarrPersister(f"file://{tmp_path}", "d", 0, 1, fsync=True)
    assert st.fsync
    st.write(0, entries_of({b"k": np.ones(10)}))
    assert st.ids() == [0]
    np.testing.assert_array_equal(read_dict(st, 0)[b"k"], np.ones(10))
    assert (tmp_path / "d" / "manager_0" / "chkpt_0.g0" / "zarr.json").exists()


def test_fsspec_url_store():
    """An fsspec URL (here the in-memory filesystem) works through zarr's FsspecStore."""
    st = ZarrPersister("memory://ddict-test-store", "d", 0, 1, chunk_bytes=1 << 10)
    big = np.arange(1000, dtype="f8")  # several 1 KiB chunks
    st.write(2, entries_of({b"big": big, b"s": "x"}))
    assert st.ids() == [2] and not st.fsync
    got = read_dict(st, 2)
    np.testing.assert_array_equal(got[b"big"], big)
    assert got[b"s"] == "x"


def test_a_store_of_an_older_version_restores_onto_another_number_of_managers(tmp_path):
    """Records without generation, version and shape (an older dask_ddict's) count as one
    version written by as many managers as manager 0's group says, also for a manager
    that the store has no group of yet."""
    from dask_ddict._keys import encode_key

    parts: dict[int, dict[bytes, Any]] = {0: {}, 1: {}}
    for j in range(40):
        parts[_placed_by_client(f"k{j}", 2)][encode_key(f"k{j}")] = j
    for i in range(2):
        ZarrPersister(str(tmp_path), "d", i, 2).write(0, entries_of(parts[i]))
    committed = tmp_path / "d" / "committed"
    for record in list(committed.iterdir()):  # as an older dask_ddict named them
        record.rename(committed / record.name.split(".g")[0])
    for meta in tmp_path.glob("d/manager_*/chkpt_0.g0/zarr.json"):  # ... and wrote them
        doc = json.loads(meta.read_text())
        del doc["attributes"]["version"]
        meta.write_text(json.dumps(doc))
    assert read_dict(ZarrPersister(str(tmp_path), "d", 1, 2), 0) == {
        k: v for k, v in parts[1].items()
    }  # (onto as many managers: as before)
    got = {}
    for j in range(3):
        store = ZarrPersister(str(tmp_path), "d", j, 3, writable=False)
        assert store.versions()[0].managers == 2
        got.update(read_dict(store, 0))
    assert got == {encode_key(f"k{j}"): j for j in range(40)}
