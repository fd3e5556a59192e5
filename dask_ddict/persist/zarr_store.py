"""The zarr v3 store of one manager's persisted checkpoints (the I/O, no policy).

Layout (documented for users in ``docs/persistence.md``; plain
``zarr.open_group(persist_path)`` reads it)::

    <persist_path>/                     zarr group
      <dict name>/                      group
        manager_<i>/                    group, attrs {"format", "num_managers", "manager_id"}
          chkpt_<k>.g<gen>/             group: generation <gen> of checkpoint k, attrs
                                        #   {"checkpoint", "generation", "version",
                                        #    "num_keys", ..., "crc32c": {...},
                                        #    "committed": true}  <- last
            keys            uint8[...]  serialized keys, concatenated
            key_offsets     uint64[n+1] key i is keys[key_offsets[i]:key_offsets[i+1]]
            values          uint8[...]  value frames (dask_ddict framing), concatenated
            value_offsets   uint64[n+1]
            flags           uint8[n]    bit 1: persistent (matters under wait_for_keys)
        committed/                      group: the dictionary's commit record
          chkpt_<k>.manager_<i>.g<gen>.v<version>.n<N>/
                                        empty group: manager i of N has committed
                                        #   generation <gen> of checkpoint k, its part of
                                        #   that version (hex)

**One version on every manager.**  Each persist of a checkpoint is a *version*
of it, named by a number that every manager of the persist shares: the one
``persist()`` sends to all of them, or, for a checkpoint persisted as it
retires, the dictionary's *history* (set at creation and at each restore, the
same on every manager, so the one retirement of checkpoint k in it is one
version).  Each manager writes its part as a new generation.  A checkpoint is
persisted once some version of it is recorded by *every* manager, and it reads
as the newest such version (:meth:`CheckpointStore.versions`): where a
re-persist reached only some managers (a host killed during it), the previous
version is still the checkpoint, on all of them, never a mix.

**Crash safety.**  A persist writes a *new* generation, commits it (its
``committed`` attribute, written after every array), and records the commit in
``committed/``.  Older generations of that id are removed only once a newer
version is complete on every manager (:meth:`CheckpointStore.prune`, after each
persist and at ``sync()``).  Removing a checkpoint goes the other way round: its
records first, then its generations' commit (their ``zarr.json``), then their
data.  So at every instant, whatever is killed and wherever, the newest version
complete on every manager is there, a partly removed one is never listed, and a
record in ``committed/`` always names a complete copy: :meth:`CheckpointStore.complete_ids`
(the ids with a version that *every* manager has recorded) is what
``persist_count`` rotation trusts before it removes anything (see
:mod:`dask_ddict.persist.persister`).

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
import functools
import itertools
import os
import re
import socket
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
_MANAGER = re.compile(r"^manager_(\d+)$")
#: A record; one without generation and version was written by an older dask_ddict
#: (its version is :data:`LEGACY`, older than any other).
_RECORD = re.compile(r"^chkpt_(\d+)\.manager_(\d+)(?:\.g(\d+)\.v([0-9a-f]+)\.n(\d+))?$")
#: The version of generations and records that older dask_ddict versions wrote.
LEGACY = -1
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
    version: int = LEGACY

    @property
    def name(self) -> str:
        return f"chkpt_{self.chkpt}.g{self.gen}"


@dataclass(frozen=True)
class Version:
    """A version of a checkpoint recorded by every manager: which, and its generations."""

    version: int
    managers: int  # how many managers wrote it (its shape: keys are placed among them)
    gens: dict[int, int]  # manager -> its generation of this version

    @property
    def order(self) -> tuple[int, int]:
        """Newer versions sort higher.  Every version, whatever its shape, has a part of
        manager 0, which writes its generations in ascending numbers: the newest version
        has its highest there; the same for every manager, which must all choose the
        same one."""
        return self.gens[0], self.version


@dataclass(frozen=True)
class Record:
    """One record in ``committed/``: manager ``manager`` committed generation ``gen`` of
    checkpoint ``chkpt``, its part of ``version``."""

    chkpt: int
    manager: int
    gen: int
    version: int
    managers: int  # of the dictionary that wrote it
    name: str


def _part_of(g: Generation, version: Version | None, gen: int | None) -> bool:
    """Whether ``g`` is a manager's part ``gen`` of ``version``: that generation, or, for
    an older dask_ddict's records (which name no generation), its newest committed
    generation without a version (the caller takes the last)."""
    if version is not None and version.version == LEGACY and gen == -1:
        return g.version == LEGACY
    return g.gen == gen


def _owned(key_bytes: bytes, part: int, n: int, m: int, me: int) -> bool:
    """Whether manager ``me`` of ``m`` owns a key of old manager ``part`` of ``n``."""
    from .reshard import owner

    return owner(key_bytes, part, n, m) == me


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
                self.dict_group = _require_group(self._local_root, [name], storage_options)
            else:
                root = zarr.open_group(self._local_root, mode="r",
                                       storage_options=storage_options or None)  # fmt: skip
                self.record_group = root[f"{name}/{COMMITTED}"]
                self.dict_group = root[name]
                mine = f"manager_{manager_id}"  # (none: a manager that a restore onto more
                self.group = root[f"{name}/{mine}"] if mine in {  # managers adds)
                    n for n, _ in self.dict_group.groups()} else None  # fmt: skip
            attrs = {} if self.group is None else dict(self.group.attrs)
        except DDictError:
            raise
        except OSError as e:  # (a path that cannot be made: /proc, read-only, not ours)
            if not writable or isinstance(e, FileNotFoundError) and local is None:
                raise DDictPersistCheckpointError(f"{where}: cannot be read ({e})") from None
            reason = f"{e.strerror} [errno {e.errno}]" if e.strerror else str(e)
            raise DDictPersistCheckpointError(
                f"persist_path {path!r} cannot be written from {socket.gethostname()} "
                f"({where}): {reason}") from None  # fmt: skip
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
        #: how many managers wrote the dictionary's first checkpoints (their records, when
        #: an older dask_ddict wrote them, do not say: see ``_all_records``), as manager 0's
        #: group says (every dictionary has one; this manager's may be new)
        self.first_managers = int(found) if found is not None else self._first(num_managers)
        self.storage_options = storage_options
        if found is None and writable:
            self.group.attrs.update({"format": FORMAT, "num_managers": num_managers,
                                     "manager_id": manager_id})  # fmt: skip
        elif writable and fmt != FORMAT:  # an older readable store: what we add may hold
            self.group.attrs.update({"format": FORMAT})  # frames its writer would misread

    def __repr__(self) -> str:
        return f"<CheckpointStore {self.path!r} {self.name!r} manager={self.manager_id}>"

    def _first(self, default: int) -> int:
        """Manager 0's group's ``num_managers`` (``default`` where there is none)."""
        try:
            return int(self.dict_group["manager_0"].attrs.get("num_managers", default))
        except Exception:  # noqa: BLE001 - no manager 0 yet: this is the first writer
            return default

    def _where(self, chkpt: int) -> str:
        return f"checkpoint {chkpt} of manager {self.manager_id} of {self.name!r} in {self.path}"

    # -- generations ----------------------------------------------------------

    def generations(self) -> list[Generation]:
        """Every generation in the store, committed or not, readable or not."""
        out = []
        for n in [] if self.group is None else _list_dir(self.group):
            m = _GEN.match(n)
            if m is None:
                continue
            chkpt, gen = int(m.group(1)), int(m.group(2))
            try:
                attrs = self.group[n].attrs
                out.append(Generation(chkpt, gen, attrs.get("committed") is True,
                                      version=int(attrs.get("version", LEGACY))))  # fmt: skip
            except Exception as e:  # a torn or damaged zarr.json
                out.append(Generation(chkpt, gen, False, f"{type(e).__name__}: {e}"))
        return sorted(out, key=lambda g: (g.chkpt, g.gen))

    def _newest(self, chkpt: int, version: Version | None) -> Generation:
        """This manager's generation of ``version``, the newest version of ``chkpt`` that
        every manager has recorded (:meth:`versions`; ``None``: there is none)."""
        found = [g for g in self.generations() if g.chkpt == chkpt]
        mine = None if version is None else version.gens.get(self.manager_id)
        ok = [g for g in found if g.committed and _part_of(g, version, mine)]
        if ok:
            return ok[-1]
        broken = [f"{g.name}: {g.problem}" for g in found if g.problem]
        detail = f" (unreadable: {'; '.join(broken)})" if broken else ""
        if any(g.committed for g in found) and version is None:
            detail += (" (this manager committed it, but no version of it is recorded by "
                       f"all {self.num_managers} managers)")  # fmt: skip
        raise DDictPersistCheckpointError(
            f"{self._where(chkpt)} is not persisted{detail} (persisted on every manager: "
            f"{self.complete_ids()})"
        )

    def ids(self) -> list[int]:
        """This manager's persisted checkpoint ids, ascending: committed and recorded
        (half-written ones are not listed, nor ones killed before their record)."""
        return sorted({c for c, _ in self.recorded()})

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
        """Remove every generation of ``chkpt``, its commit records first."""
        self.unrecord(chkpt)
        self.step("unrecorded")
        for g in self.generations():
            if g.chkpt == chkpt:
                self._remove(g)

    def orphans(self) -> list[CheckpointStore]:
        """The groups of managers beyond this dictionary's (a restore onto fewer managers
        left them) that this manager tends: manager ``i`` by manager ``i % num_managers``,
        so that their persisted checkpoints are removed as this dictionary's are."""
        if self.manager_id >= self.num_managers:
            return []
        out = []
        for n in _list_dir(self.dict_group):
            m = _MANAGER.match(n)
            i = -1 if m is None else int(m.group(1))
            if i >= self.num_managers and i % self.num_managers == self.manager_id:
                shape = int(self.dict_group[n].attrs.get("num_managers", i + 1))
                out.append(CheckpointStore(self.path, self.name, i, max(shape, i + 1),
                                           storage_options=self.storage_options, step=self.step))
        return out

    def prune(self, chkpt: int | None = None) -> None:
        """Remove this manager's generations of ``chkpt`` (else of every checkpoint) that
        are replaced, their records first: older than its part of a newer version
        complete on every manager; older than its newer part of the same version (written
        again, e.g. by a restarted host process); never committed and older than a
        generation it recorded since (a persist cut short).  Newer generations stay,
        committed or being written: other managers may still complete their version (a
        host that died during a persist writes it again)."""
        records = self._all_records()
        versions = self.versions(records)
        mine = [r for r in records if r.manager == self.manager_id]
        for g in self.generations():
            if chkpt not in (None, g.chkpt):
                continue
            complete = versions.get(g.chkpt)
            newest = None if complete is None else complete.gens.get(self.manager_id)
            later = [r for r in mine if r.chkpt == g.chkpt and r.gen > g.gen]
            if (newest is not None and g.gen < newest) or \
                    any(r.version == g.version for r in later) or \
                    (later and not g.committed):  # fmt: skip
                for r in mine:
                    if (r.chkpt, r.gen) == (g.chkpt, g.gen):
                        self._unrecord(r.name)
                self._remove(g)
                self.step("pruned")

    # -- the dictionary's commit record ------------------------------------------

    def _record_name(self, chkpt: int, gen: int, version: int) -> str:
        return (f"chkpt_{chkpt}.manager_{self.manager_id}.g{gen}.v{version:x}"
                f".n{self.num_managers}")  # fmt: skip

    def record(self, chkpt: int, gen: int, version: int) -> None:
        """Record in ``committed/`` that this manager has committed generation ``gen`` of
        ``chkpt``, its part of ``version``.

        Written after the commit and removed before any removal, so a record
        always names a complete copy (a crash between the two leaves a commit
        without a record: never counted, never a loss).
        """
        self.record_group.create_group(self._record_name(chkpt, gen, version), overwrite=True)

    def _all_records(self) -> list[Record]:
        """Every manager's records, from one listing of ``committed/`` (an older
        dask_ddict's, named by checkpoint and manager only, as :data:`LEGACY`)."""
        out = []
        for n in _list_dir(self.record_group):
            m = _RECORD.match(n)
            if m is None:
                continue
            if m.group(3) is None:  # (its dictionary's shape: the one that began the store)
                gen, version, managers = -1, LEGACY, self.first_managers
            else:
                gen, version, managers = int(m.group(3)), int(m.group(4), 16), int(m.group(5))
            if int(m.group(2)) < managers:
                out.append(Record(int(m.group(1)), int(m.group(2)), gen, version, managers, n))
        return out

    def recorded(self) -> set[tuple[int, int]]:
        """``(chkpt, version)`` of each of this manager's recorded generations: the
        persists it finished (a generation committed and not recorded does not count)."""
        return {(r.chkpt, r.version) for r in self._all_records() if r.manager == self.manager_id}

    def _unrecord(self, name: str) -> None:
        _sync(self.record_group.store_path.store.delete_dir(_child(self.record_group, name)))

    def unrecord(self, chkpt: int) -> None:
        """Remove this manager's records of ``chkpt`` (before removing its data)."""
        for r in self._all_records():
            if (r.chkpt, r.manager) == (chkpt, self.manager_id):
                self._unrecord(r.name)

    def versions(self, records: list[Record] | None = None) -> dict[int, Version]:
        """Each checkpoint's newest version that *every* manager has recorded (from
        ``records``, else one listing of ``committed/``, whatever the number of managers).
        Every manager of its writer, that is: a version written by another number of
        managers than this dictionary's is a whole checkpoint too (:meth:`read`
        re-shards it).
        """
        seen: dict[tuple[int, int, int], dict[int, int]] = {}
        for r in self._all_records() if records is None else records:
            gens = seen.setdefault((r.chkpt, r.version, r.managers), {})
            gens[r.manager] = max(gens.get(r.manager, -1), r.gen)
        out: dict[int, Version] = {}
        for (chkpt, version, managers), gens in seen.items():
            v = Version(version, managers, gens)
            if len(gens) == managers and (chkpt not in out or v.order > out[chkpt].order):
                out[chkpt] = v
        return out

    def complete_ids(self) -> list[int]:
        """Checkpoint ids with a version that *every* manager of the dictionary has
        recorded, ascending (:meth:`versions`).

        Each of these ids is committed on every manager, as one version, so a
        restore of any of them finds all its keys: rotation removes an older id
        only once a newer one is in this list.
        """
        return sorted(self.versions())

    # -- writing --------------------------------------------------------------

    def write(self, chkpt: int, entries: Callable[[], Iterable[tuple[Any, Any, int]]],
              version: int = 0) -> int:  # fmt: skip
        """Write this manager's part of ``version`` of checkpoint ``chkpt`` from
        ``entries()`` (called twice: sizes, then data); persists that name no version
        (0) are all one version, the newest generation of it the checkpoint.

        ``entries`` yields ``(key bytes, value frame, flags)``; frames may be
        views that are valid only during iteration.  The new generation is
        committed and recorded before older ones of ``chkpt`` are removed, and
        those only once its version is complete on every manager (:meth:`prune`).
        Returns the value bytes written.
        """
        version = int(version)
        n = key_bytes = value_bytes = 0
        for k, v, _ in entries():
            n += 1
            key_bytes += len(k)
            value_bytes += memoryview(v).nbytes
        older = [g for g in self.generations() if g.chkpt == chkpt]
        gen = Generation(chkpt, max((g.gen for g in older), default=-1) + 1, False)
        attrs = {"format": FORMAT, "checkpoint": chkpt, "generation": gen.gen, "version": version,
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
        self.record(chkpt, gen.gen, version)
        self.step("recorded")
        self.prune(chkpt)  # only now, and only what a version complete everywhere replaced
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
        """``(key bytes, value frame, flags)`` of this manager's keys in the newest
        version of ``chkpt`` that every manager recorded, verified.

        A version written by another number of managers is *re-sharded*: the
        parts of all its managers are read, and only this manager's keys (as they
        are placed among this dictionary's managers, :func:`.reshard.owner`) are
        yielded, their values' chunks read only where they hold one.

        Everything is checked before it is yielded, except the values, whose
        chunks are checked as they are read: a consumer that must be
        all-or-nothing (a restore: one LMDB transaction) aborts on the error.

        Raises
        ------
        DDictPersistCheckpointError
            The checkpoint is missing, or its data does not match its commit.
        """
        version = self.versions().get(chkpt)
        if version is None or version.managers == self.num_managers:
            return self.read_generation(self._newest(chkpt, version))
        return self._resharded(chkpt, version)

    def _resharded(self, chkpt: int, version: Version) -> Iterator[tuple[bytes, memoryview, int]]:
        """:meth:`read` of a version written by ``version.managers`` managers."""
        n, me, m = version.managers, self.manager_id, self.num_managers
        parts = []
        for i in range(n):  # (every part opened and checked before anything is yielded)
            part = CheckpointStore(self.path, self.name, i, n, writable=False,
                                   storage_options=self.storage_options)  # fmt: skip
            gen = [g for g in part.generations() if g.chkpt == chkpt and g.committed
                   and _part_of(g, version, version.gens[i])][-1:]  # fmt: skip
            if not gen:
                raise DDictPersistCheckpointError(
                    f"{part._where(chkpt)}: its recorded generation {version.gens[i]} is gone")
            wanted = functools.partial(_owned, part=i, n=n, m=m, me=me)
            parts.append(part.read_generation(gen[0], wanted))
        return itertools.chain.from_iterable(parts)

    def read_generation(self, gen: Generation, wanted: Callable[[bytes], bool] | None = None
              ) -> Iterator[tuple[bytes, memoryview, int]]:  # fmt: skip
        """The entries of this manager's generation ``gen`` (``wanted``: only the keys it
        says), checked as :meth:`read` says."""
        chkpt = gen.chkpt
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
        return self._entries(values, chunk, crcs["values"], keys, koff, voff, flags, bad, wanted)

    @staticmethod
    def _entries(values: Any, chunk: int, crcs: list[int], keys: np.ndarray, koff: np.ndarray,
                 voff: np.ndarray, flags: np.ndarray, bad: Callable[[str], Exception],
                 wanted: Callable[[bytes], bool] | None = None,
                 ) -> Iterator[tuple[bytes, memoryview, int]]:  # fmt: skip
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
            key = bytes(keys[int(koff[t]) : int(koff[t + 1])])
            if wanted is not None and not wanted(key):
                continue
            a, b = int(voff[t]), int(voff[t + 1])
            if a < lo or b > hi:  # load the chunks that hold [a, b)
                first, last = a // chunk, max(a, b - 1) // chunk
                parts = [load(i) for i in range(first, last + 1)] if b > a else []
                block = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else block
                lo, hi = (first * chunk, first * chunk + block.size) if parts else (a, a)
            mv = block.data[a - lo : b - lo]
            yield key, mv, int(flags[t])
