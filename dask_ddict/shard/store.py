"""ShardStore: one manager's shard, an LMDB environment in shared memory.

Why LMDB (``docs/design/storage.md``): a crash-consistent copy-on-write B+tree
in a memory-mapped file.  Placed on ``/dev/shm`` (tmpfs) its pages are shared
memory: a committed transaction survives the death of the writing process (so
a shard can be re-attached after a worker restart), same-host processes can
open the environment and read with no IPC, and a full map raises
``MapFullError`` without corrupting anything.

Layout (named sub-databases)::

    data   digest(16) + be64(MAX - chkpt)  ->  entry
    index  be64(chkpt) + digest(16)        ->  b""       (keys written at chkpt)
    meta   name                            ->  bytes     (working-set state, ...)

Each version of a key is its own ``data`` entry.  The checkpoint id is stored
inverted so that versions of one key sort newest first, and "the newest
version at or below checkpoint c" is one ``set_range`` seek.  An entry is::

    [u8 flags][3 pad][u32 key_len][u64 frame_len] [value frame] [key bytes]

The 16-byte header puts the value frame at 32 modulo 64 inside LMDB's
overflow pages (which start 16 bytes into a page), the alignment that
:mod:`dask_ddict._serialize` plans buffers for.  This module knows nothing
about checkpoint rules; :mod:`dask_ddict.shard.working_set` does.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import lmdb

from .. import config, kernels
from .._entry import BE as _BE
from .._entry import DIGEST, ENTRY, ENTRY_HEADER, TOMBSTONE, Entry, data_key
from .._entry import MAXQ as _MAXQ
from .._entry import PERSISTENT as PERSISTENT  # (re-exported: the shard's modules take it here)
from .._entry import decode_entry as _decode
from .._entry import split_data_key as _split_data_key
from .._keys import KEY_ENCODING
from .._serialize import HUGE_BYTES, VALUE_FRAMES, Scratch, frame_parts, gather, loads_value
from ..errors import DDictError, DDictFullError
from . import changes
from .capacity import FULL_REMEDY as FULL_REMEDY  # (re-exported)
from .capacity import Capacity

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Written into every shard's ``meta``; changes with the layout or the key bytes.
FORMAT = f"dask_ddict.shard/{KEY_ENCODING}.{VALUE_FRAMES}".encode()
#: Older stamps this version re-attaches (same key bytes, older frames: restamped).
_READABLE = frozenset({FORMAT, f"dask_ddict.shard/{KEY_ENCODING}".encode()})


_THREAD = threading.local()


def _client_scratch() -> Scratch:
    """The calling thread's scratch for large puts into shards this process does not own
    (``ddict.store.client-scratch-bytes``): warm memory, so assembling an entry is a
    plain copy, not a page-faulting one, and one buffer per thread whatever the shards."""
    scratch = getattr(_THREAD, "scratch", None)
    if scratch is None:
        scratch = _THREAD.scratch = Scratch(config.get_bytes("store.client-scratch-bytes"))
    return scratch


class ShardStore(Capacity, kernels.StoreState):
    """An LMDB environment holding one shard.

    Parameters
    ----------
    path
        Directory of the environment (created with mode 0700 if missing).
    capacity
        Bytes of data the shard may hold (the manager's share of ``total_mem``).
        The map is a little larger so that deletes still find free pages when
        the shard is at capacity.
    full_thresh
        Fraction of ``capacity`` above which :meth:`check_room` refuses puts.
    indexed
        Keep the ``index`` database (which keys were written at which
        checkpoint).  Only ``wait_for_keys`` retirement needs it; without it a
        put costs one B-tree insert instead of two.
    create
        Create the shard if missing (its manager).  ``False``: open an existing
        shard, as same-host clients do (they never create one by accident, e.g.
        for a dictionary destroyed meanwhile, and keep no buffer for large puts,
        which they leave to the manager).
    """

    path: str
    capacity: int
    full_thresh: float
    env: lmdb.Environment

    def __init__(
        self,
        path: str,
        capacity: int,
        full_thresh: float = 0.9,
        *,
        indexed: bool = False,
        create: bool = True,
    ) -> None:
        self.path = path
        self.indexed = indexed
        self._used_estimate = 0  # bytes; only ever over-estimates between exact checks
        self.capacity = int(capacity)
        self.full_thresh = float(full_thresh)
        if create:
            os.makedirs(path, mode=0o700, exist_ok=True)
        self.map_size = self.map_size_for(self.capacity)
        self.env = lmdb.open(
            path,
            map_size=self.map_size,
            max_dbs=4,
            max_readers=1024,
            writemap=True,
            sync=False,
            metasync=False,
            create=create,
            mode=0o600,  # data.mdb and lock.mdb: the cluster's user only
            readahead=False,
            meminit=False,
            # a read snapshot ended is kept (reset: it holds no pages) and renewed by the
            # next one, not begun: no lock and scan of the reader table per read (the
            # key lane's same-host read takes the same one)
            max_spare_txns=1,
        )
        self.env.reader_check()  # free reader slots of processes that died
        self._data = self.env.open_db(b"data", create=create)
        self._index = self.env.open_db(b"index", create=create)
        self._meta = self.env.open_db(b"meta", create=create)
        self._psize = self.env.stat()["psize"]
        self.on_commit: Callable[[], None] | None = None  # (its manager's generation, see write)
        #: A replicated shard's: ships each commit's changes to the replicas (see changes).
        self.replicate: Callable[[list[Any], bool], None] | None = None
        self.shipping = threading.Lock()  # (held from a replicated write's start to its ship)
        #: Why a replicated write may not begin now ("": it may): a replica failed a write,
        #: and the orchestrator has not taken it out of the replica set yet (see
        #: ``host.replicas.Shipper``): the writes that waited for the shipping lock fail.
        self.fenced = ""
        #: Set by a replicated write whose writer answers nobody now (a batch's records,
        #: answered at its end): its changes are sent without waiting (see changes.ship).
        self.later = False
        self._next_own = 0  # the id of the next write transaction if no other process commits
        #: Set when a put is refused for room (its manager resets it per write: a write
        #: that keeps the refusal as a batch's error still shows it).
        self.refused = False
        # LMDB has one writer at a time, so one scratch buffer serves every large put
        # (a client's: its writing thread's, see _client_scratch).
        self._scratch = Scratch(config.get_bytes("store.scratch-bytes")) if create else None

    def __repr__(self) -> str:
        return f"<ShardStore {self.path!r} capacity={self.capacity}>"

    @staticmethod
    def map_size_for(capacity: int) -> int:
        """Bytes of the map for ``capacity`` bytes of data: a little more, so that
        deletes still find free pages when the shard is at capacity."""
        return int(capacity) + max(1 << 20, int(capacity) // 16)

    # -- transactions --------------------------------------------------------

    def read(self) -> lmdb.Transaction:
        """A read-only snapshot; values are zero-copy views valid inside it."""
        return self.env.begin(buffers=True)

    def write(self) -> Any:
        """A write transaction (``with store.write() as txn``): all of one operation
        commits or nothing does; with an :attr:`on_commit` hook, it runs after
        each commit (the shard's :mod:`~dask_ddict.shard.generations` word)."""
        if self.replicate is not None:
            return changes.Shipped(self)
        if self.on_commit is None:
            return self.env.begin(write=True, buffers=True)
        return changes.Hooked(self.env.begin(write=True, buffers=True), self.on_commit)

    def transact(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """``fn(txn)`` in a write transaction, committed (then :attr:`on_commit`) if it
        returns, aborted if it raises: :meth:`write` for one call, with less around it."""
        if self.replicate is not None:
            return changes.transact(self, fn, self._transact)
        return self._transact(fn)

    def _transact(self, fn: Callable[[lmdb.Transaction], T], hook: bool = True) -> T:
        txn = self.env.begin(write=True, buffers=True)
        tid = txn.id()
        try:
            result = fn(txn)
            txn.commit()
        except lmdb.MapFullError as e:  # (a commit writes the free list: it can fill the map)
            txn.abort()
            self.refused = True
            raise DDictFullError(
                f"shard is full: its map of {self.capacity} bytes has no room "
                f"left for this write's pages.  {FULL_REMEDY}"
            ) from e
        except BaseException:
            txn.abort()
            raise
        self._next_own = tid + 1
        if hook and self.on_commit is not None:
            self.on_commit()
        return result

    def attempt(self, fn: Callable[[lmdb.Transaction], object]) -> bool:
        """:meth:`transact` of ``fn`` where the shard is not replicated: whether it was
        committed.  If ``fn`` or the commit raises an error, nothing of it stays and the
        answer is ``False``: for a writer's common case, whose caller then writes the
        full way (and what a refusal asks of it; the error, if it fails again, says
        why).  An interrupt is raised, not answered (rolled back as well)."""
        if self.replicate is not None:
            return False
        try:
            self._transact(fn)
        except Exception:  # noqa: BLE001 - done again the full way, which raises it
            return False
        return True

    # -- versions -------------------------------------------------------------

    def lookup(
        self, txn: lmdb.Transaction, digest: bytes, chkpt: int, whole: bool = True
    ) -> Entry | None:
        """The newest version of a key at or below ``chkpt`` (``whole``: to be read whole,
        see :func:`~dask_ddict.kernels.lookup_entry`)."""
        return kernels.lookup_entry(txn, self._data, digest, chkpt, whole)

    def lookup_many(
        self,
        txn: lmdb.Transaction,
        digests: list[bytes],
        chkpt: int,
        frames: bool = False,
        small: int = 0,
    ) -> list[Any]:
        """:meth:`lookup` of each digest (an ``Entry`` or ``None``), with one cursor;
        ``frames``: the frames of live versions, ``None`` for the others (no ``Entry``
        made: ``get_many``'s path where every live version is seen), those under
        ``small`` bytes copied (see :func:`~dask_ddict.kernels.lookup_frames`)."""
        tail = _BE.pack(_MAXQ - chkpt)
        if frames:  # (the compiled kernel, where it was built)
            return kernels.lookup_frames(txn, self._data, digests, tail, small)
        cur = txn.cursor(self._data)
        seek, key, value = cur.set_range, cur.key, cur.value
        out: list[Any] = []
        for digest in digests:
            if not seek(digest + tail) or key()[:DIGEST] != digest:
                out.append(None)
            else:
                out.append(_decode(_MAXQ - _BE.unpack_from(key(), DIGEST)[0], value()))
        return out

    def lookup_values(
        self,
        txn: lmdb.Transaction,
        digests: list[bytes],
        chkpt: int,
        small: int,
        absent: Any,
        take: Callable[[Any], Any],
    ) -> tuple[kernels.Decoded, int, int]:
        """The values of the newest versions of ``digests`` at ``chkpt``, decoded in
        ``txn`` by the value frames' own decoder (``absent`` where there is none; frames
        of ``small`` bytes or more through ``take`` first): what a same-host ``get_many``
        reads, and the bytes and number of the frames copied on the way
        (:func:`~dask_ddict.kernels.lookup_values`).  Every live version must be visible
        (no ``wait_for_keys``)."""
        tail = _BE.pack(_MAXQ - chkpt)
        return kernels.lookup_values(
            txn, self._data, digests, tail, small, absent, take, loads_value
        )

    def place_values(
        self,
        txn: lmdb.Transaction,
        digests: list[bytes],
        positions: bytes,
        out: list[Any],
        chkpt: int,
        small: int,
        absent: Any,
        take: Callable[[Any], Any],
    ) -> tuple[int, int]:
        """:meth:`lookup_values` written into ``out`` at ``positions``
        (:func:`~dask_ddict.kernels.place_values`): the bytes and number of the frames
        copied."""
        tail = _BE.pack(_MAXQ - chkpt)
        return kernels.place_values(
            txn, self._data, digests, positions, out, tail, small, absent, take, loads_value
        )

    def exact(self, txn: lmdb.Transaction, digest: bytes, chkpt: int) -> Entry | None:
        """The version written at exactly ``chkpt``."""
        raw = txn.get(data_key(digest, chkpt), db=self._data)
        return None if raw is None else _decode(chkpt, raw)

    def put(
        self,
        txn: lmdb.Transaction,
        digest: bytes,
        chkpt: int,
        key: bytes,
        frame: Any,
        flags: int = 0,
    ) -> None:
        """Store a version (replacing one at the same checkpoint).

        ``frame`` is a buffer, a :class:`~dask_ddict._serialize.Framed` (its
        parts are copied once, straight into the entry) or ``None`` (empty).
        """
        self._put(txn, digest + _BE.pack(_MAXQ - chkpt), digest, chkpt, key, frame, flags)

    def _put(
        self,
        txn: lmdb.Transaction,
        dk: bytes,
        digest: bytes,
        chkpt: int,
        key: bytes,
        frame: Any,
        flags: int,
    ) -> None:
        """:meth:`put` under its data key ``dk`` (``data_key(digest, chkpt)``)."""
        t = type(frame)  # (bytes, or a batch record's byte view: joined as they are)
        nbytes = len(frame) if t is bytes else frame.nbytes if t is memoryview else -1
        if 0 <= nbytes < HUGE_BYTES - ENTRY_HEADER - len(key):  # (gather, for one buffer)
            buf: Any = b"".join((ENTRY.pack(flags, len(key), nbytes), frame, key))
        else:
            parts, nbytes = frame_parts(frame)
            buf = gather(
                parts,
                nbytes,
                ENTRY.pack(flags, len(key), nbytes),
                key,
                self._scratch or _client_scratch(),
            )
        try:
            txn.put(dk, buf, db=self._data)
            if self.indexed:
                txn.put(_BE.pack(chkpt) + digest, b"", db=self._index)
        except lmdb.MapFullError as e:
            raise self._map_full(nbytes + len(key)) from e

    def delete(self, txn: lmdb.Transaction, digest: bytes, chkpt: int) -> None:
        """Remove the version at ``chkpt`` (no-op if absent)."""
        txn.delete(data_key(digest, chkpt), db=self._data)
        if self.indexed:
            txn.delete(_BE.pack(chkpt) + digest, db=self._index)

    def delete_below(self, txn: lmdb.Transaction, digest: bytes, chkpt: int) -> None:
        """Remove every version strictly older than ``chkpt``."""
        if chkpt <= 0:
            return
        cur = txn.cursor(self._data)
        if not cur.set_range(data_key(digest, chkpt - 1)):
            return
        while True:
            k = cur.key()
            if bytes(k[:DIGEST]) != digest:
                return
            if self.indexed:
                _, c = _split_data_key(k)
                txn.delete(_BE.pack(c) + digest, db=self._index)
            if not cur.delete():  # moves to the next item
                return

    def collect(self, txn: lmdb.Transaction, digest: bytes, oldest: int) -> None:
        """Drop versions of a key that no reader at ``>= oldest`` can see.

        Readers at ``r >= oldest`` see the newest version ``<= r``, so every
        version older than the newest one at or below ``oldest`` is dead.
        Called on each write of the key, it keeps at most one version below
        the window without any work at retirement time.
        """
        cur = txn.cursor(self._data)
        if not cur.set_range(data_key(digest, oldest)):
            return
        if bytes(cur.key()[:DIGEST]) != digest or not cur.next():
            return
        while bytes(cur.key()[:DIGEST]) == digest:
            if self.indexed:
                _, c = _split_data_key(cur.key())
                txn.delete(_BE.pack(c) + digest, db=self._index)
            if not cur.delete():
                return

    def collect_all(self, txn: lmdb.Transaction, oldest: int) -> int:
        """:meth:`collect` for every key; the number of versions dropped.  A scan of the
        shard: its manager runs it only when a put is refused room (``shard/making_room.py``)."""
        before = self.entries(txn)
        digests = {bytes(k[:DIGEST]) for k in txn.cursor(self._data).iternext(values=False)}
        for digest in sorted(digests):
            self.collect(txn, digest, oldest)
        return before - self.entries(txn)

    def put_over(
        self, txn: lmdb.Transaction, digest: bytes, chkpt: int, key: bytes, frame: Any, flags: int
    ) -> bool:
        """:meth:`put` at ``chkpt`` and drop every older version: the key then has one.

        For a window of one checkpoint (``chkpt`` is its oldest and newest): there
        no reader sees an older version, and every write leaves its key with
        one version, so a key that has a version at ``chkpt`` has no other
        (one lookup, the common overwrite).  Returns whether the version it
        shadows was a live one: what the key counts need, from the same lookup.
        """
        dk = digest + _BE.pack(_MAXQ - chkpt)
        raw = txn.get(dk, db=self._data)
        if raw is not None:
            live = not raw[0] & TOMBSTONE
        else:  # an older version (the window moved since the key was written), or none
            e = self.lookup(txn, digest, chkpt, whole=False)  # (its flags alone)
            live = e is not None and not e.tombstone
            if e is not None:
                self.delete_below(txn, digest, chkpt)
        self._put(txn, dk, digest, chkpt, key, frame, flags)
        return live

    def put_over_many(
        self, txn: lmdb.Transaction, records: list[kernels.Record], chkpt: int, flags: int
    ) -> tuple[int, int, DDictFullError | None]:
        """:meth:`put_over` of each record in order, the small ones in a compiled loop
        (:func:`~dask_ddict.kernels.put_entries`): ``(how many were put, the change in keys
        seen, the error that refused the next one)``; a full map leaves nothing to commit."""
        tail = _BE.pack(_MAXQ - chkpt)
        most = 0 if self.indexed else HUGE_BYTES  # (an index entry each: put_over writes it)
        done = delta = 0
        dead = bool(flags & TOMBSTONE)
        while done < len(records):
            done, more, full = kernels.put_entries(
                txn, self._data, records, done, tail, flags, most, lmdb.MapFullError
            )
            delta += more
            if done == len(records):
                break
            _, key, frame = records[done]
            if full is not None:
                error = self._map_full(frame_parts(frame)[1] + len(key))
                error.__cause__ = full  # (as _put raises it: the transaction is lost)
                return done, delta, error
            try:  # (a large value: gathered in the scratch buffer, see _put)
                live = self.put_over(txn, records[done][0], chkpt, key, frame, flags)
            except DDictFullError as e:
                return done, delta, e
            if live == dead:
                delta += -1 if live else 1
            done += 1
        return done, delta, None

    def digests_at(self, txn: lmdb.Transaction, chkpt: int) -> list[bytes]:
        """Digests of the keys that have a version at ``chkpt``."""
        prefix = _BE.pack(chkpt)
        cur = txn.cursor(self._index)
        out = []
        if cur.set_range(prefix):
            for k in cur.iternext(keys=True, values=False):
                k = bytes(k)
                if k[:8] != prefix:
                    break
                out.append(k[8:])
        return out

    def scan(
        self, txn: lmdb.Transaction, after: bytes | None = None
    ) -> Iterator[tuple[bytes, Entry]]:
        """Every version in key order (digest ascending, newest first)."""
        cur = txn.cursor(self._data)
        start = (after + b"\xff" * 8) if after is not None else b""
        if not cur.set_range(start):
            return
        for k, v in cur.iternext():
            digest, chkpt = _split_data_key(k)
            if after is not None and digest == after:
                continue
            yield digest, _decode(chkpt, v)

    def versions(
        self, txn: lmdb.Transaction, digest: bytes, hi: int, lo: int
    ) -> list[tuple[int, int]]:
        """``(checkpoint, flags)`` of a key's versions at or below ``hi``, newest first,
        down to the first one at or below ``lo`` (what a reader in ``[lo, hi]`` may see)."""
        cur = txn.cursor(self._data)
        out: list[tuple[int, int]] = []
        if not cur.set_range(digest + _BE.pack(_MAXQ - hi)):
            return out
        for k, v in cur.iternext():
            if k[:DIGEST] != digest:
                break
            c = _MAXQ - _BE.unpack_from(k, DIGEST)[0]
            out.append((c, v[0]))
            if c <= lo:
                break
        return out

    def version_flags(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, int, int]]:
        """``(digest, checkpoint, flags)`` of every version, in key order (no decoding)."""
        cur = txn.cursor(self._data)
        if not cur.first():
            return
        for k, v in cur.iternext():
            yield bytes(k[:DIGEST]), _MAXQ - _BE.unpack_from(k, DIGEST)[0], v[0]

    def raw_page(
        self, txn: lmdb.Transaction, after: bytes | None, max_bytes: int
    ) -> tuple[list[tuple[bytes, bytes]], bool]:
        """Raw ``data`` records after key ``after`` (replication), about ``max_bytes`` of them."""
        cur = txn.cursor(self._data)
        if after is None:
            ok = cur.first()
        else:
            ok = cur.set_range(after) and (bytes(cur.key()) != after or cur.next())
        out: list[tuple[bytes, bytes]] = []
        size = 0
        while ok:
            if out and size >= max_bytes:
                return out, True
            k, v = bytes(cur.key()), bytes(cur.value())
            out.append((k, v))
            size += len(k) + len(v)
            ok = cur.next()
        return out, False

    def put_raw(self, txn: lmdb.Transaction, records: list[tuple[bytes, bytes]]) -> None:
        """Store records from :meth:`raw_page` of another shard."""
        try:
            for k, v in records:
                txn.put(k, v, db=self._data)
                if self.indexed:
                    digest, chkpt = _split_data_key(k)
                    txn.put(_BE.pack(chkpt) + digest, b"", db=self._index)
        except lmdb.MapFullError as e:
            raise DDictFullError(f"shard {self.path} is full while copying another shard") from e

    def drop_all(self, txn: lmdb.Transaction) -> None:
        """Remove every version of every key (metadata stays)."""
        txn.drop(self._data, delete=False)
        txn.drop(self._index, delete=False)

    # -- metadata -------------------------------------------------------------

    @property
    def meta_db(self) -> Any:
        return self._meta

    def get_meta(self, txn: lmdb.Transaction, name: bytes) -> bytes | None:
        raw = txn.get(name, db=self._meta)
        return None if raw is None else bytes(raw)

    def put_meta(self, txn: lmdb.Transaction, name: bytes, value: bytes) -> None:
        try:
            txn.put(name, value, db=self._meta)
        except lmdb.MapFullError as e:
            raise DDictFullError(f"shard {self.path} is full (metadata)") from e

    def stamp(self, manager_id: int, term: int | None = None) -> None:
        """Record this shard's format and manager (a new shard, before any use), and the
        term its manager is served under here (``None``: the one it has)."""
        with self.write() as txn:
            self.put_meta(txn, b"format", FORMAT)
            self.put_meta(txn, b"manager", str(manager_id).encode())
            if term is not None:
                self.put_meta(txn, b"term", str(int(term)).encode())

    def term(self) -> int:
        """The term its manager was last served under (see ``ManagerInfo.term``; 0: none)."""
        with self.read() as txn:
            raw = self.get_meta(txn, b"term")
        return 0 if raw is None else int(raw)

    def check_stamp(self, manager_id: int) -> None:
        """Refuse a shard of another format or manager (re-attach, same-host reads).

        Raises
        ------
        DDictError
            Naming the shard, what it holds and what was expected.
        """
        with self.read() as txn:
            found = self.get_meta(txn, b"format")
            owner = self.get_meta(txn, b"manager")
        if found not in _READABLE:
            was = found.decode(errors="replace") if found else "dask_ddict.shard/1 (unstamped)"
            raise DDictError(
                f"shard {self.path} has format {was}; this dask_ddict reads "
                f"{FORMAT.decode()} (its key bytes differ): persist it with the version that "
                "wrote it and restore it here",
                "INVALID_OPERATION",
            )
        if owner != str(manager_id).encode():
            raise DDictError(
                f"shard {self.path} belongs to manager {owner!r}, not {manager_id}",
                "INVALID_ARGUMENT",
            )

    def entries(self, txn: lmdb.Transaction) -> int:
        return txn.stat(self._data)["entries"]

    # -- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        self.env.close()

    def destroy(self) -> None:
        """Close and delete the environment's files."""
        try:
            self.close()
        finally:
            shutil.rmtree(self.path, ignore_errors=True)
