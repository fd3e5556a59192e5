"""The zarr v3 store of one manager's persisted checkpoints (the I/O, no policy).

Layout (documented for users in ``docs/persistence.md``; plain
``zarr.open_group(persist_path)`` reads it)::

    <persist_path>/                     zarr group
      <dict name>/                      group
        manager_<i>/                    group, attrs {"format", "num_managers", "manager_id"}
          chkpt_<k>.g<gen>/             group: generation <gen> of checkpoint k, attrs
                                        #   {"checkpoint", "generation", "num_keys", ...,
                                        #    "crc32c": {...}, "committed": true}  <- last
            keys            uint8[...]  serialized keys, concatenated
            key_offsets     uint64[n+1] key i is keys[key_offsets[i]:key_offsets[i+1]]
            values          uint8[...]  value frames (dask_ddict framing), concatenated
            value_offsets   uint64[n+1]
            flags           uint8[n]    bit 1: persistent (matters under wait_for_keys)
        committed/                      group: the dictionary's commit record
          chkpt_<k>.manager_<i>/        empty group: manager i has committed checkpoint k

**Crash safety.**  A checkpoint counts once one of its generations is
committed, and the newest committed generation is the checkpoint.  A persist
writes a *new* generation, commits it (its ``committed`` attribute, written
after every array), records the commit in ``committed/``, and only then
removes older generations of that id.  Removing a checkpoint goes the other
way round: its record first, then its generations' commit (their
``zarr.json``), then their data.  So at every instant, whatever is killed and
wherever, the newest completely written copy of each checkpoint is there, a
partly removed one is never listed, and a record in ``committed/`` always
names a complete copy: :meth:`CheckpointStore.complete_ids` (the ids that
*every* manager has recorded) is what ``persist_count`` rotation trusts before
it removes anything (see :mod:`dask_ddict.persist.persister`).

**Integrity.**  Every array's chunks end with a CRC32C (zarr's ``crc32c``
codec; chunks written directly as files get the same layout), and the commit
records the CRC32C of every chunk.  zarr reads a missing chunk as zeros: a
chunk whose checksum does not match the committed one is refused, as are
offsets that do not fit the arrays.  Any of these raises
:class:`~dask_ddict.errors.DDictPersistCheckpointError` naming the store,
manager, checkpoint and what is wrong: never a wrong value.

:class:`CheckpointStore` is the I/O (testable without a cluster);
:class:`~dask_ddict.persist.persister.Persister` is the policy.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np
import zarr
from zarr.codecs import Crc32cCodec
from zarr.errors import ContainsGroupError

from .._keys import KEY_ENCODING
from .._serialize import VALUE_FRAMES
from ..arguments import local_store
from ..errors import DDictError, DDictPersistCheckpointError

#: The store format; changes with the layout, the key bytes (:data:`KEY_ENCODING`) or
#: the value frames (:data:`VALUE_FRAMES`): an older version refuses what it would misread.
FORMAT = f"dask_ddict.checkpoint/{KEY_ENCODING}.{VALUE_FRAMES}"
#: The formats this version reads: its own, and the same key bytes with older frames.
READABLE = frozenset({FORMAT, f"dask_ddict.checkpoint/{KEY_ENCODING}"})
_ARRAY_CONFIG = {"write_empty_chunks": True}  # skip the per-chunk "all fill?" scan
_CRC = [Crc32cCodec()]
_GEN = re.compile(r"^chkpt_(\d+)\.g(\d+)$")
_RECORD = re.compile(r"^chkpt_(\d+)\.manager_(\d+)$")
#: The group beside the managers' groups where each manager records its commits.
COMMITTED = "committed"
_SMALL = ("keys", "key_offsets", "value_offsets", "flags")

#: A hook called at named steps of a write (tests kill the process there): "chunk",
#: "arrays", "commit", "committed", "recorded", "cleanup"; and of a removal:
#: "unrecorded", "uncommitted", "removed".
Step = Callable[[str], None]


def crc32c(data: Any) -> int:
    """CRC32C of a contiguous buffer (the library takes bytes and arrays, not memoryviews)."""
    if not isinstance(data, (bytes, np.ndarray)):
        data = np.frombuffer(data, dtype=np.uint8)
    return int(google_crc32c.value(data))


def _sync(coro: Any) -> Any:
    from zarr.core.sync import sync

    return sync(coro)


def _child(group: Any, name: str) -> str:
    """The store key of ``name`` inside ``group``."""
    sp = group.store_path
    return f"{sp.path}/{name}" if sp.path else name


def _list_dir(group: Any) -> list[str]:
    """Names directly inside ``group``, as the store has them now.

    fsspec filesystems (s3fs, gcsfs, ...) cache listings per process, so a
    record written by another manager's process would stay unseen: the
    cached listing of this prefix is dropped first.
    """
    sp = group.store_path
    fs = getattr(sp.store, "fs", None)
    if fs is not None:
        root = getattr(sp.store, "path", "")
        fs.invalidate_cache(f"{root}/{sp.path}".strip("/") if root else sp.path)

    async def names() -> list[str]:
        return [n async for n in sp.store.list_dir(sp.path)]

    return list(_sync(names()))


def _require_group(path: str, names: list[str], storage_options: dict[str, Any] | None) -> Any:
    """Open (creating as needed) ``path/names...``.

    The managers of one dictionary open the same store at the same moment
    from different processes; when two create a group at once, one finds it
    already created and simply opens it on the next try.
    """
    for attempt in range(10):
        try:
            group = zarr.open_group(path, mode="a", storage_options=storage_options or None)
            for n in names:
                group = group.require_group(n)
            return group
        except (ContainsGroupError, FileExistsError):
            if attempt == 9:
                raise
            time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")


class _ChunkWriter:
    """Stores full chunks of a 1-D uint8 array, overlapping copy and I/O.

    For the plain layout (bytes codec, then crc32c) a chunk's file is its
    bytes followed by their CRC32C, so full chunks go straight to the store
    (the checksum is written into the buffer's 4 spare bytes: no codec pass,
    no extra copy) while the caller fills the next buffer (two buffers in
    flight).  Any other layout takes zarr's ordinary path.  Either way
    :attr:`crcs` collects every chunk's checksum for the commit.
    """

    def __init__(self, values: Any, chunk: int, step: Step) -> None:
        self.values = values
        self.chunk = chunk
        self.step = step
        self.buffers = [np.empty(chunk + 4, dtype=np.uint8) for _ in range(2)]
        self.pending: list[Any] = [None, None]
        self.turn = 0
        self.crcs: list[int] = []
        meta = values.metadata
        names = [type(c).__name__ for c in getattr(meta, "codecs", ())]
        self.direct = names == ["BytesCodec", "Crc32cCodec"] and hasattr(meta, "encode_chunk_key")

    @property
    def buffer(self) -> np.ndarray:
        """The buffer to fill next (its previous write has finished)."""
        fut = self.pending[self.turn]
        if fut is not None:
            fut.result()
            self.pending[self.turn] = None
        return self.buffers[self.turn][: self.chunk]

    def put(self, i: int, nbytes: int) -> None:
        """Store the current buffer's first ``nbytes`` as chunk ``i``; switch buffers."""
        buf = self.buffers[self.turn]
        crc = crc32c(buf[:nbytes])
        self.crcs.append(crc)
        if self.direct and nbytes == self.chunk:
            from zarr.core.buffer import default_buffer_prototype
            from zarr.core.sync import _get_loop

            buf[nbytes : nbytes + 4] = np.frombuffer(np.uint32(crc).tobytes(), dtype=np.uint8)
            sp = self.values.store_path
            name = self.values.metadata.encode_chunk_key((i,))
            key = f"{sp.path}/{name}" if sp.path else name
            data = default_buffer_prototype().buffer.from_array_like(buf[: nbytes + 4])
            coro = sp.store.set(key, data)
            self.pending[self.turn] = asyncio.run_coroutine_threadsafe(coro, _get_loop())
        else:
            self.values[i * self.chunk : i * self.chunk + nbytes] = buf[:nbytes]
        self.step("chunk")
        self.turn ^= 1

    def finish(self) -> None:
        for t, fut in enumerate(self.pending):
            if fut is not None:
                fut.result()
                self.pending[t] = None


@dataclass(frozen=True)
class Generation:
    """One written copy of a checkpoint, as found in the store."""

    chkpt: int
    gen: int
    committed: bool
    problem: str = ""  # why its metadata could not be read

    @property
    def name(self) -> str:
        return f"chkpt_{self.chkpt}.g{self.gen}"


def _nothing(step: str) -> None:
    pass


class CheckpointStore:
    """One manager's persisted checkpoints in a zarr store.

    Parameters
    ----------
    path
        The zarr store: a local directory or an fsspec URL.
    name
        The dictionary's name (its group in the store).
    manager_id, num_managers
        Which shard this is, and of how many (a checkpoint only makes sense
        with the key-to-manager mapping it was written with).
    chunk_bytes
        Chunk size of the ``values`` array (no compression: persisting runs
        at disk speed).
    storage_options
        Passed to fsspec for URLs.
    fsync
        Flush a local checkpoint's files to the disk before its commit marker
        is written (and the marker after): a checkpoint then survives a power
        loss, at disk speed instead of page-cache speed.
    step
        Called with the name of each step of a write (fault-injection tests).
    writable
        ``False``: open an existing manager group read-only, creating and
        stamping nothing (inspection).
    """

    def __init__(
        self,
        path: str,
        name: str,
        manager_id: int,
        num_managers: int,
        *,
        chunk_bytes: int = 64 << 20,
        storage_options: dict[str, Any] | None = None,
        fsync: bool = False,
        step: Step = _nothing,
        writable: bool = True,
    ) -> None:
        self.path = path
        self.name = name
        self.manager_id = manager_id
        self.num_managers = num_managers
        self.chunk_bytes = chunk_bytes
        self.step = step
        # file:// URLs are local directories: zarr's LocalStore creates parents and can
        # fsync.  fsync applies to local directories (fsspec stores have their own guarantees).
        local = local_store(path)
        self._local_root = path if local is None else local
        if local is not None and os.path.exists(local) and not os.path.isdir(local):
            raise DDictPersistCheckpointError(
                f"persist_path {path!r} is a file, not a directory (a zarr store)"
            )
        self.fsync = fsync and local is not None
        where = f"manager {manager_id} of {name!r} in {path}"
        try:
            if writable:
                self.group = _require_group(
                    self._local_root, [name, f"manager_{manager_id}"], storage_options
                )
                self.record_group = _require_group(self._local_root, [name, COMMITTED],
                                                   storage_options)  # fmt: skip
            else:
                root = zarr.open_group(self._local_root, mode="r",
                                       storage_options=storage_options or None)  # fmt: skip
                self.group = root[f"{name}/manager_{manager_id}"]
            attrs = dict(self.group.attrs)
        except DDictError:
            raise
        except Exception as e:  # JSONDecodeError, a node of the wrong kind, ...
            raise DDictPersistCheckpointError(
                f"{where}: unreadable group metadata ({type(e).__name__}: {e})"
            ) from None
        found = attrs.get("num_managers")
        fmt = attrs.get("format")
        if fmt is not None and fmt not in READABLE:
            raise DDictPersistCheckpointError(
                f"{where} has format {fmt!r}; this dask_ddict reads {FORMAT!r} (its key "
                "bytes differ): restore it with the version that wrote it"
            )
        if found is not None and found != num_managers:
            raise DDictPersistCheckpointError(
                f"{where}: the checkpoints were written by {found!r} managers, this "
                f"dictionary has {num_managers}: keys would map to other managers. Restore "
                f"into {found!r} managers: managers_per_worker times the number of hosting "
                f"workers (n_workers= or workers=) must be {found!r}, e.g. "
                f"DDict(managers_per_worker={found!r}, n_workers=1, ...)"
            )
        if found is None and writable:
            self.group.attrs.update({"format": FORMAT, "num_managers": num_managers,
                                     "manager_id": manager_id})  # fmt: skip
        elif writable and fmt != FORMAT:  # an older readable store: what we add may hold
            self.group.attrs.update({"format": FORMAT})  # frames its writer would misread

    def __repr__(self) -> str:
        return f"<CheckpointStore {self.path!r} {self.name!r} manager={self.manager_id}>"

    def _where(self, chkpt: int) -> str:
        return f"checkpoint {chkpt} of manager {self.manager_id} of {self.name!r} in {self.path}"

    # -- generations ----------------------------------------------------------

    def generations(self) -> list[Generation]:
        """Every generation in the store, committed or not, readable or not."""
        out = []
        for n in _list_dir(self.group):
            m = _GEN.match(n)
            if m is None:
                continue
            chkpt, gen = int(m.group(1)), int(m.group(2))
            try:
                committed = self.group[n].attrs.get("committed") is True
                out.append(Generation(chkpt, gen, committed))
            except Exception as e:  # a torn or damaged zarr.json
                out.append(Generation(chkpt, gen, False, f"{type(e).__name__}: {e}"))
        return sorted(out, key=lambda g: (g.chkpt, g.gen))

    def _newest(self, chkpt: int) -> Generation:
        found = [g for g in self.generations() if g.chkpt == chkpt]
        ok = [g for g in found if g.committed]
        if ok:
            return ok[-1]
        broken = [f"{g.name}: {g.problem}" for g in found if g.problem]
        detail = f" (unreadable: {'; '.join(broken)})" if broken else ""
        raise DDictPersistCheckpointError(
            f"{self._where(chkpt)} is not persisted{detail} (persisted: {self.ids()})"
        )

    def ids(self) -> list[int]:
        """Committed checkpoint ids, ascending (half-written ones are not listed)."""
        return sorted({g.chkpt for g in self.generations() if g.committed})

    def _remove(self, gen: Generation) -> None:
        """Remove one generation: its commit first, so that a removal cut short by a
        crash (a store cannot delete a directory atomically) never leaves a
        committed generation with missing data."""
        path = _child(self.group, gen.name)
        _sync(self.group.store_path.store.delete(f"{path}/zarr.json"))
        self.step("uncommitted")
        _sync(self.group.store_path.store.delete_dir(path))
        self.step("removed")

    def delete(self, chkpt: int) -> None:
        """Remove every generation of ``chkpt``, its commit record first."""
        self.unrecord(chkpt)
        self.step("unrecorded")
        for g in self.generations():
            if g.chkpt == chkpt:
                self._remove(g)

    # -- the dictionary's commit record ------------------------------------------

    def _record_name(self, chkpt: int) -> str:
        return f"chkpt_{chkpt}.manager_{self.manager_id}"

    def record(self, chkpt: int) -> None:
        """Record in ``committed/`` that this manager has committed ``chkpt``.

        Written after the commit and removed before any removal, so a record
        always names a complete copy (a crash between the two leaves a commit
        without a record: never counted complete, never a loss).
        """
        self.record_group.create_group(self._record_name(chkpt), overwrite=True)

    def unrecord(self, chkpt: int) -> None:
        """Remove this manager's record of ``chkpt`` (before removing its data)."""
        _sync(self.record_group.store_path.store.delete_dir(
            _child(self.record_group, self._record_name(chkpt))))  # fmt: skip

    def complete_ids(self) -> list[int]:
        """Checkpoint ids that *every* manager of the dictionary has recorded, ascending.

        One listing of ``committed/``, whatever the number of managers.  Each
        of these ids is committed on every manager, so a restore of any of
        them finds all its keys: rotation removes an older id only once a
        newer one is in this list.
        """
        seen: dict[int, set[int]] = {}
        for n in _list_dir(self.record_group):
            m = _RECORD.match(n)
            if m is not None and int(m.group(2)) < self.num_managers:
                seen.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        return sorted(c for c, managers in seen.items() if len(managers) == self.num_managers)

    # -- writing --------------------------------------------------------------

    def write(self, chkpt: int, entries: Callable[[], Iterable[tuple[Any, Any, int]]]) -> int:
        """Write checkpoint ``chkpt`` from ``entries()`` (called twice: sizes, then data).

        ``entries`` yields ``(key bytes, value frame, flags)``; frames may be
        views that are valid only during iteration.  The new generation is
        committed before older ones of ``chkpt`` are removed.  Returns the
        value bytes written.
        """
        n = key_bytes = value_bytes = 0
        for k, v, _ in entries():
            n += 1
            key_bytes += len(k)
            value_bytes += memoryview(v).nbytes
        older = [g for g in self.generations() if g.chkpt == chkpt]
        gen = Generation(chkpt, max((g.gen for g in older), default=-1) + 1, False)
        attrs = {"format": FORMAT, "checkpoint": chkpt, "generation": gen.gen,
                 "manager_id": self.manager_id, "num_managers": self.num_managers,
                 "num_keys": n, "key_bytes": key_bytes, "value_bytes": value_bytes}  # fmt: skip
        g = self.group.create_group(gen.name, attributes={**attrs, "committed": False})
        chunk = max(1, min(self.chunk_bytes, value_bytes))
        values = g.create_array(
            "values", shape=(value_bytes,), dtype="uint8", chunks=(chunk,),
            compressors=_CRC, fill_value=0, config=_ARRAY_CONFIG,
        )  # fmt: skip
        writer = _ChunkWriter(values, chunk, self.step)
        keys = np.empty(key_bytes, dtype=np.uint8)
        koff = np.zeros(n + 1, dtype=np.uint64)
        voff = np.zeros(n + 1, dtype=np.uint64)
        flags = np.zeros(n, dtype=np.uint8)
        filled = written = kpos = vpos = 0
        buf = writer.buffer
        i = -1
        try:
            for i, (k, v, f) in enumerate(entries()):
                if i >= n:
                    raise RuntimeError("checkpoint changed while it was being persisted")
                keys[kpos : kpos + len(k)] = np.frombuffer(k, dtype=np.uint8)
                kpos += len(k)
                koff[i + 1] = kpos
                flags[i] = f
                mv = np.frombuffer(memoryview(v).cast("B"), dtype=np.uint8)
                vpos += mv.nbytes
                voff[i + 1] = vpos
                pos = 0
                while pos < mv.nbytes:  # stream through full chunks: no read-modify-write
                    take = min(chunk - filled, mv.nbytes - pos)
                    buf[filled : filled + take] = mv[pos : pos + take]
                    filled += take
                    pos += take
                    if filled == chunk:
                        writer.put(written // chunk, chunk)
                        buf = writer.buffer
                        written += chunk
                        filled = 0
            if i + 1 != n:
                raise RuntimeError("checkpoint changed while it was being persisted")
            if filled:
                writer.put(written // chunk, filled)
        finally:
            writer.finish()
        crcs: dict[str, Any] = {"values": writer.crcs}
        small: tuple[np.ndarray, ...] = (keys, koff, voff, flags)
        for aname, arr in zip(_SMALL, small):
            g.create_array(aname, data=arr, chunks=(max(1, arr.size),), compressors=_CRC,
                           config=_ARRAY_CONFIG)  # fmt: skip
            crcs[aname] = crc32c(arr)
        self.step("arrays")
        if self.fsync:
            self._fsync(gen.name)
        self.step("commit")
        g.attrs.update({"crc32c": crcs, "committed": True})  # the commit marker, last
        if self.fsync:
            self._fsync(gen.name)
        self.step("committed")
        self.record(chkpt)
        self.step("recorded")
        for old in older:  # only now: the new generation is the checkpoint
            self._remove(old)
            self.step("cleanup")
        return value_bytes

    def _fsync(self, name: str) -> None:
        """Flush a local checkpoint's files and directories to the disk."""
        root = os.path.join(self._local_root, self.name, f"manager_{self.manager_id}", name)
        for dirpath, _, files in os.walk(root):
            for f in files:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fd = os.open(dirpath, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # -- reading --------------------------------------------------------------

    def read(self, chkpt: int) -> Iterator[tuple[bytes, memoryview, int]]:
        """``(key bytes, value frame, flags)`` of a committed checkpoint, verified.

        Everything is checked before it is yielded, except the values, whose
        chunks are checked as they are read: a consumer that must be
        all-or-nothing (a restore: one LMDB transaction) aborts on the error.

        Raises
        ------
        DDictPersistCheckpointError
            The checkpoint is missing, or its data does not match its commit.
        """
        gen = self._newest(chkpt)
        where = f"{self._where(chkpt)} ({gen.name})"

        def bad(what: str) -> DDictPersistCheckpointError:
            return DDictPersistCheckpointError(f"{where}: {what}")

        try:
            g = self.group[gen.name]
            attrs = dict(g.attrs)
            crcs = attrs["crc32c"]
            n, value_bytes = int(attrs["num_keys"]), int(attrs["value_bytes"])
            small = {a: g[a][...] for a in _SMALL}
            values = g["values"]
        except DDictError:
            raise
        except Exception as e:  # codec checksum, missing array, garbage metadata
            raise bad(f"cannot read it ({type(e).__name__}: {e})") from None
        if (attrs.get("manager_id"), attrs.get("num_managers")) != (
            self.manager_id, self.num_managers,
        ):  # fmt: skip
            raise bad(
                f"it was written by manager {attrs.get('manager_id')} of "
                f"{attrs.get('num_managers')}, not {self.manager_id} of {self.num_managers}"
            )
        for a in _SMALL:
            if crc32c(small[a]) != crcs.get(a):
                raise bad(f"array {a!r} does not match its committed checksum (missing chunk?)")
        keys, koff, voff, flags = (small[a] for a in _SMALL)
        for aname, off, total in (("key_offsets", koff, keys.size), ("value_offsets", voff,
                                                                      value_bytes)):  # fmt: skip
            if off.shape != (n + 1,) or off[0] != 0 or off[-1] != total or np.any(
                np.diff(off.astype(np.int64)) < 0
            ):
                raise bad(f"{aname} do not fit the data ({n} keys, {total} bytes)")
        if flags.shape != (n,) or values.shape != (value_bytes,):
            raise bad(f"array shapes do not match the commit ({n} keys, {value_bytes} bytes)")
        chunk = values.chunks[0]
        if len(crcs["values"]) != -(-value_bytes // chunk):
            raise bad(f"the commit lists {len(crcs['values'])} value chunks, the array has "
                      f"{-(-value_bytes // chunk)}")  # fmt: skip
        return self._entries(values, chunk, crcs["values"], keys, koff, voff, flags, bad)

    @staticmethod
    def _entries(values: Any, chunk: int, crcs: list[int], keys: np.ndarray, koff: np.ndarray,
                 voff: np.ndarray, flags: np.ndarray,
                 bad: Callable[[str], Exception]) -> Iterator[tuple[bytes, memoryview, int]]:  # fmt: skip
        cache: dict[int, np.ndarray] = {}

        def load(i: int) -> np.ndarray:
            if i not in cache:
                cache.clear()  # keep one: consecutive values share at most a boundary chunk
                try:
                    data = values[i * chunk : min((i + 1) * chunk, values.shape[0])]
                except Exception as e:
                    raise bad(f"chunk {i} of values: {type(e).__name__}: {e}") from None
                if crc32c(data) != crcs[i]:
                    raise bad(f"chunk {i} of values is missing or does not match its checksum")
                cache[i] = data
            return cache[i]

        block, lo, hi = np.empty(0, np.uint8), 0, 0
        for t in range(flags.size):
            a, b = int(voff[t]), int(voff[t + 1])
            if a < lo or b > hi:  # load the chunks that hold [a, b)
                first, last = a // chunk, max(a, b - 1) // chunk
                parts = [load(i) for i in range(first, last + 1)] if b > a else []
                block = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else block
                lo, hi = (first * chunk, first * chunk + block.size) if parts else (a, a)
            mv = block.data[a - lo : b - lo]
            yield bytes(keys[int(koff[t]) : int(koff[t + 1])]), mv, int(flags[t])
