"""The compiled kernels call LMDB's C API: the engine the installed lmdb package carries,
on the environments lmdb opened (``dask_ddict/kernels/lmdb_engine.pxi``).

Here, where the kernels are compiled, they must find that engine and use it; anything
they do not know (another lmdb release, a closed transaction, objects of lmdb's other
flavour) must be refused, and the walk then done by lmdb's Python API, with the same
answers."""

from __future__ import annotations

import struct
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

import lmdb
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from dask_ddict import kernels
from dask_ddict._entry import ENTRY, TOMBSTONE
from dask_ddict.kernels import pure
from dask_ddict.shard.store import ShardStore
from tests.support.lent import resident_kib

compiled = pytest.mark.skipif(not kernels.COMPILED, reason="the kernels are not compiled here")


def _env(path: str) -> tuple[lmdb.Environment, object]:
    env = lmdb.open(path, map_size=1 << 24, max_dbs=2)
    db = env.open_db(b"data")
    with env.begin(write=True, db=db) as txn:
        for i in range(50):
            k = bytes([i]) * 16 + struct.pack(">Q", (1 << 64) - 1 - 3)
            txn.put(k, ENTRY.pack(0, 0, 4) + b"v%03d" % i, db=db)
    return env, db


TAIL = struct.pack(">Q", (1 << 64) - 1 - 5)


@compiled
def test_the_compiled_kernels_use_the_engine_of_the_installed_lmdb():
    from dask_ddict.kernels import _compiled  # type: ignore[attr-defined]

    assert _compiled.engine_refusal() is None
    assert lmdb.__version__.startswith(_compiled.KNOWN_LMDB)


@compiled
def test_a_walk_over_many_keys_reads_views_of_the_pages_in_a_buffers_transaction(tmp_path):
    from dask_ddict.kernels import _compiled  # type: ignore[attr-defined]

    env, db = _env(str(tmp_path / "s"))
    try:
        asked = [bytes([i]) * 16 for i in range(60)]
        with env.begin(db=db, buffers=True) as txn:
            got = _compiled.lookup_frames(txn, db, asked, TAIL, 0)
            want = pure.lookup_frames(txn, db, asked, TAIL, 0)
            assert [None if f is None else bytes(f) for f in got] == [
                None if f is None else bytes(f) for f in want
            ]
            assert {type(f) for f in got if f is not None} == {memoryview}
            assert got[7].readonly and bytes(got[7]) == b"v007" and got[55] is None
        with env.begin(db=db) as txn:  # (no buffers: copies that outlive the transaction)
            got = _compiled.lookup_frames(txn, db, asked, TAIL, 0)
        assert {type(f) for f in got if f is not None} == {bytes}
    finally:
        env.close()


@compiled
@pytest.mark.parametrize("asked_n", [1_000, 6_000])
def test_a_walk_seeks_in_the_trees_order_and_answers_in_the_callers(tmp_path, asked_n):
    """Seeks go left to right through the B-tree (by the digests' first two bytes), and
    the frames come back in the order asked, duplicates and absent keys included,
    exactly as the pure walk answers them."""
    import hashlib
    import random

    from dask_ddict.kernels import _compiled  # type: ignore[attr-defined]

    env = lmdb.open(str(tmp_path / "s"), map_size=1 << 26, max_dbs=2)
    db = env.open_db(b"data")
    stored = [hashlib.blake2b(b"%d" % i, digest_size=16).digest() for i in range(3_000)]
    try:
        with env.begin(write=True, db=db) as txn:
            for i, d in enumerate(stored):
                for c in (1, 3, 5):  # (three versions: the newest at or before 5 is seen)
                    value = ENTRY.pack(0, 0, 6) + b"%03dv%02d" % (i % 1000, c)
                    txn.put(d + struct.pack(">Q", (1 << 64) - 1 - c), value, db=db)
        rng = random.Random(asked_n)
        absent = [hashlib.blake2b(b"no%d" % i, digest_size=16).digest() for i in range(50)]
        asked = [rng.choice(stored + absent) for _ in range(asked_n)]
        with env.begin(db=db) as txn:
            got = _compiled.lookup_frames(txn, db, asked, TAIL, 0)
            want = pure.lookup_frames(txn, db, asked, TAIL, 0)
        assert got == want and len(got) == asked_n
        assert all((f is None) == (d in absent) for d, f in zip(asked, got))
        assert all(f.endswith(b"v05") for f in got if f is not None)
    finally:
        env.close()


@compiled
@pytest.mark.parametrize("asked_n", [0, 1, 257, 1_000, 5_000])
def test_a_walk_seeks_by_the_digests_first_two_bytes_stably(tmp_path, asked_n):
    """The order the compiled walk seeks in (each found value is decoded as it is
    reached): by the digests' first two bytes, keys of one prefix in the order asked
    (many share a first byte, or both), for any number of keys; the values still
    answer in the order asked."""
    import random

    from dask_ddict.kernels import _compiled  # type: ignore[attr-defined]

    rng = random.Random(asked_n)
    stored = list(
        dict.fromkeys(
            bytes([rng.randrange(3), rng.randrange(3)]) + rng.randbytes(14)
            if i % 3 == 0
            else rng.randbytes(16)
            for i in range(3_000)
        )
    )
    index = {d: i for i, d in enumerate(stored)}
    absent = [rng.randbytes(16) for _ in range(20)]
    asked = [rng.choice(stored + absent) for _ in range(asked_n)]
    env = lmdb.open(str(tmp_path / "s"), map_size=1 << 26, max_dbs=2)
    db = env.open_db(b"data")
    try:
        with env.begin(write=True, db=db) as txn:
            for i, d in enumerate(stored):
                v = b"%08d" % i
                txn.put(d + struct.pack(">Q", (1 << 64) - 1 - 3), ENTRY.pack(0, 0, 8) + v, db=db)
        walked: list[int] = []

        def decode(frame: Any) -> int:
            walked.append(int(bytes(frame)))
            return walked[-1]

        with env.begin(db=db) as txn:
            values, *_ = _compiled.lookup_values(txn, db, asked, TAIL, 0, None, bytes, decode)
        order = sorted(range(asked_n), key=lambda i: asked[i][:2])  # (stable)
        assert walked == [index[asked[i]] for i in order if asked[i] in index]
        assert list(values) == [index.get(d) for d in asked]
    finally:
        env.close()


@compiled
def test_a_large_value_sought_for_a_part_is_not_touched_whole(tmp_path):
    """``lookup_entry(..., whole=False)`` (a byte range's seek on the manager's host): the
    compiled seek hands out views of a large value's pages without touching them, where
    py-lmdb's preload, which ``whole`` keeps, maps every page of it into the reader's
    resident set; reading a part then maps the part's pages alone."""
    from dask_ddict import _memory
    from dask_ddict.kernels import _compiled  # type: ignore[attr-defined]

    env = lmdb.open(str(tmp_path / "s"), map_size=1 << 26, max_dbs=2)
    db = env.open_db(b"data")
    digest, n = b"\x07" * 16, 8 << 20
    with env.begin(write=True, db=db) as txn:
        txn.put(digest + struct.pack(">Q", (1 << 64) - 1 - 3), ENTRY.pack(0, 0, n) + b"x" * n)
    try:
        grew = {}
        for whole in (False, True):
            with env.begin(db=db, buffers=True) as txn:
                e = _compiled.lookup_entry(txn, db, digest, 3, whole)
                addr = kernels.address_of(e.frame)
                _memory.release(addr, n)  # (this process's pages of it given back)
                before = resident_kib(addr, addr + n)
                e = _compiled.lookup_entry(txn, db, digest, 3, whole)
                assert bytes(e.frame[1000:1010]) == b"x" * 10 and e.frame.nbytes == n
                grew[whole] = resident_kib(addr, addr + n) - before
        assert grew[False] < 256 and grew[True] >= n >> 10, grew
    finally:
        env.close()


@compiled
def test_touch_pages_maps_every_page_of_a_value_sought_untouched(tmp_path):
    """A copying same-host read seeks a large value without touching it, then has
    ``touch_pages`` map its pages with the interpreter lock released (py-lmdb's preload,
    done apart): every page the value spans is then in the reader's resident set, and its
    bytes are what was written."""
    from dask_ddict import _memory
    from dask_ddict.kernels import _compiled  # type: ignore[attr-defined]

    env = lmdb.open(str(tmp_path / "s"), map_size=1 << 26, max_dbs=2)
    db = env.open_db(b"data")
    digest, n = b"\x07" * 16, (8 << 20) + 4090
    payload = bytes(range(256)) * (n // 256) + b"z" * (n % 256)
    with env.begin(write=True, db=db) as txn:
        txn.put(digest + struct.pack(">Q", (1 << 64) - 1 - 3), ENTRY.pack(0, 0, n) + payload)
    try:
        with env.begin(db=db, buffers=True) as txn:
            frame = _compiled.lookup_entry(txn, db, digest, 3, False).frame
            addr = kernels.address_of(frame)
            _memory.release(addr, n)
            before = resident_kib(addr, addr + n)
            _compiled.touch_pages(frame)
            spanned = ((addr + n + 4095) & ~4095) - (addr & ~4095)  # (its first to its last)
            assert resident_kib(addr, addr + n) - before >= spanned >> 10
            assert bytes(frame) == payload
            del frame
    finally:
        env.close()


@compiled
def test_a_closed_transaction_or_a_foreign_object_is_refused_as_lmdb_refuses_it(tmp_path):
    from dask_ddict.kernels import _compiled  # type: ignore[attr-defined]

    env, db = _env(str(tmp_path / "s"))
    try:
        txn = env.begin(db=db, buffers=True)
        txn.abort()
        for s in (pure, _compiled):
            with pytest.raises(lmdb.Error):
                s.lookup_frames(txn, db, [bytes(16)], TAIL, 0)
        with pytest.raises(AttributeError):  # (not a transaction: the pure walk's error)
            _compiled.lookup_frames(object(), db, [bytes(16)], TAIL, 0)
    finally:
        env.close()


@compiled
def test_another_lmdb_release_is_refused_by_name_and_reads_stay_right(tmp_path):
    """A process whose lmdb is a release the kernels do not know the layout of does not
    read that layout: it says so once, names the release, and walks with lmdb's Python
    API (the same frames)."""
    code = textwrap.dedent(
        f"""
        import logging, struct, lmdb
        lmdb.__version__ = "9.9.9"  # (what the kernels check before reading a layout)
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        from dask_ddict.kernels import _compiled
        from dask_ddict._entry import ENTRY
        env = lmdb.open({str(tmp_path / "s")!r}, map_size=1 << 24, max_dbs=2)
        db = env.open_db(b"data")
        with env.begin(write=True, db=db) as txn:
            txn.put(bytes(16) + struct.pack(">Q", 2**64 - 1), ENTRY.pack(0, 0, 2) + b"hi", db=db)
        print(_compiled.engine_refusal())
        with env.begin(db=db, buffers=True) as txn:
            for _ in range(2):
                got = _compiled.lookup_frames(txn, db, [bytes(16), b"x" * 16], bytes(8), 0)
                print([None if f is None else bytes(f) for f in got])
        env.close()
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "lmdb 9.9.9 is installed" in lines[0]
    assert lines[1:] == ["[b'hi', None]", "[b'hi', None]"]
    assert out.stderr.count("shard reads use lmdb's Python API: lmdb 9.9.9") == 1


@compiled
def test_a_lmdb_cursor_reads_what_the_engine_wrote_in_its_transaction(tmp_path):
    """Writes through the engine move what lmdb's own cursors on the same transaction
    point at: lmdb is told (its mutation count), so they read their item again."""
    from dask_ddict.kernels import _compiled  # type: ignore[attr-defined]

    env, db = _env(str(tmp_path / "s"))
    try:
        with env.begin(write=True, db=db, buffers=True) as txn:
            cursor = txn.cursor(db)
            assert cursor.first()
            before = bytes(cursor.value())
            tail = struct.pack(">Q", (1 << 64) - 1 - 3)
            records = [(bytes([i]) * 16, b"k", b"new%04d" % i) for i in range(50)]
            done, delta, error = _compiled.put_entries(
                txn, db, records, 0, tail, 0, 1 << 20, lmdb.MapFullError
            )
            assert (done, delta, error) == (50, 0, None)
            assert bytes(cursor.value()) != before
            assert bytes(cursor.value())[16:23] == b"new0000"
    finally:
        env.close()


class OneShardBothKernels(RuleBasedStateMachine):
    """One shard written and read by the compiled kernels (LMDB's C API) and the pure
    ones (lmdb's cursors) in turn, as a compiled and a pure process share a shard: every
    read answers the same through both, and as a model of the puts says."""

    def __init__(self) -> None:
        super().__init__()
        self.path = tempfile.mkdtemp(prefix="ddict-test-engine-", dir="/dev/shm")
        self.store = ShardStore(self.path, 1 << 20)
        self.model: dict[bytes, bytes | None] = {}

    @rule(
        keys=st.lists(st.integers(0, 11), min_size=1, max_size=8),
        value=st.binary(max_size=300),
        dead=st.booleans(),
        which=st.sampled_from(["compiled", "pure"]),
    )
    def put(self, keys: list[int], value: bytes, dead: bool, which: str) -> None:
        s = _compiled_set() if which == "compiled" else pure
        records = [(bytes([k]) * 16, b"k%d" % k, value) for k in keys]
        with self.store.write() as txn:
            done, _, error = s.put_entries(
                txn,
                self.store._data,
                records,
                0,
                _tail(0),
                TOMBSTONE if dead else 0,
                1 << 20,
                lmdb.MapFullError,
            )
        assert (done, error) == (len(records), None)
        for k in keys:
            self.model[bytes([k]) * 16] = None if dead else value

    @invariant()
    def both_read_the_model(self) -> None:
        digests = [bytes([k]) * 16 for k in range(12)]
        with self.store.read() as txn:
            got = [
                [
                    None if f is None else bytes(f)
                    for f in s.lookup_frames(txn, self.store._data, digests, _tail(0), 64)
                ]
                for s in (pure, _compiled_set())
            ]
            entries = [
                [
                    None if e is None or e.flags & TOMBSTONE else bytes(e.frame)
                    for e in (s.lookup_entry(txn, self.store._data, d, 0) for d in digests)
                ]
                for s in (pure, _compiled_set())
            ]
        want = [self.model.get(d) for d in digests]
        assert got[0] == got[1] == want
        assert entries[0] == entries[1] == want

    def teardown(self) -> None:
        self.store.destroy()


def _compiled_set():  # noqa: ANN202 - the compiled module, where built
    from dask_ddict.kernels import _compiled  # type: ignore[attr-defined]

    return _compiled


def _tail(chkpt: int) -> bytes:
    return struct.pack(">Q", (1 << 64) - 1 - chkpt)


OneShardBothKernels.TestCase.settings = settings(max_examples=25, stateful_step_count=12)
test_one_shard_written_and_read_by_both_kernels = compiled(OneShardBothKernels.TestCase)
