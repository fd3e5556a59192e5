"""Persisted checkpoints as one version on every manager, crash-safe, over any medium.

The protocol that both built-in persisters share (:class:`VersionedPersister`);
each implements the *medium*: where a generation's arrays, its commit and the
dictionary's records live (a zarr store, a directory of files).  The layout, in
the medium's terms (``docs/design/checkpoint-stores.md`` shows each one's files)::

    <dict name>/
      manager_<i>/                 attrs {"format", "num_managers", "manager_id"}
        chkpt_<k>.g<gen>/          generation <gen> of checkpoint k, attrs
                                   #   {"checkpoint", "generation", "version",
                                   #    "num_keys", ..., "crc32c": {...},
                                   #    "committed": true}  <- last
          keys            uint8[...]  serialized keys, concatenated
          key_offsets     uint64[n+1] key i is keys[key_offsets[i]:key_offsets[i+1]]
          values          uint8[...]  value frames (dask_ddict framing), in chunks
          value_offsets   uint64[n+1]
          flags           uint8[n]    bit 1: persistent (matters under wait_for_keys)
      committed/                   the dictionary's commit record
        chkpt_<k>.manager_<i>.g<gen>.v<version>.n<N>
                                   manager i of N has committed generation <gen>
                                   #   of checkpoint k, its part of that version (hex)

**One version on every manager.**  Each persist of a checkpoint is a *version*
of it, named by a number that every manager of the persist shares: the one
``persist()`` sends to all of them, or, for a checkpoint persisted as it
retires, the dictionary's *history* (set at creation and at each restore, the
same on every manager, so the one retirement of checkpoint k in it is one
version).  Each manager writes its part as a new generation.  A checkpoint is
persisted once some version of it is recorded by *every* manager, and it reads
as the newest such version (:meth:`VersionedPersister.versions`): where a
re-persist reached only some managers (a host killed during it), the previous
version is still the checkpoint, on all of them, never a mix.

**Crash safety.**  A persist writes a *new* generation, commits it (its
``committed`` attribute, written after every array), and records the commit in
``committed/``.  Older generations of that id are removed only once a newer
version is complete on every manager (:meth:`VersionedPersister.prune`, after
each persist and at ``sync()``).  Removing a checkpoint goes the other way round:
its records first, then its generations' commit, then their data.  So at every
instant, whatever is killed and wherever, the newest version complete on every
manager is there, a partly removed one is never listed, and a record always
names a complete copy: :meth:`~.interface.CheckpointPersister.complete_ids` is
what ``persist_count`` rotation trusts before it removes anything.

**Integrity.**  The commit records the CRC32C of every array and of every chunk
of the values.  A chunk whose checksum does not match is refused, as are offsets
that do not fit the arrays; either raises
:class:`~dask_ddict.errors.DDictPersistCheckpointError` naming the store,
manager, checkpoint and what is wrong: never a wrong value.
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import google_crc32c
import numpy as np

from ..arguments import local_store
from ..errors import DDictError, DDictPersistCheckpointError
from .interface import LEGACY, CheckpointPersister, Entry, Step, Version, no_step

logger = logging.getLogger(__name__)

_GEN = re.compile(r"^chkpt_(\d+)\.g(\d+)$")
_MANAGER = re.compile(r"^manager_(\d+)$")
#: A record; one without generation and version was written by an older dask_ddict
#: (its version is :data:`LEGACY`, older than any other).
_RECORD = re.compile(r"^chkpt_(\d+)\.manager_(\d+)(?:\.g(\d+)\.v([0-9a-f]+)\.n(\d+))?$")
#: The place beside the managers' where each manager records its commits.
COMMITTED = "committed"
#: A generation's arrays besides its values, read whole, and their types.
SMALL: dict[str, np.dtype[Any]] = {
    "keys": np.dtype("u1"),
    "key_offsets": np.dtype("<u8"),
    "value_offsets": np.dtype("<u8"),
    "flags": np.dtype("u1"),
}


def crc32c(data: Any) -> int:
    """CRC32C of a contiguous buffer (the library takes bytes and arrays, not memoryviews)."""
    if not isinstance(data, (bytes, np.ndarray)):
        data = np.frombuffer(data, dtype=np.uint8)
    return int(google_crc32c.value(data))


def manager_index(name: str) -> int:
    """``i`` of a ``manager_<i>`` place, else -1."""
    m = _MANAGER.match(name)
    return -1 if m is None else int(m.group(1))


@dataclass(frozen=True)
class Generation:
    """One written copy of a checkpoint, as found in the medium."""

    chkpt: int
    gen: int
    committed: bool
    problem: str = ""  # why its metadata could not be read
    version: int = LEGACY

    @property
    def name(self) -> str:
        return f"chkpt_{self.chkpt}.g{self.gen}"


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


class ChunkSink(ABC):
    """Where a generation's values go, a chunk at a time, overlapping copy and I/O.

    The writer fills :attr:`buffer` and hands it over with :meth:`put`; two buffers
    are in flight (4 spare bytes each: a medium may append the checksum in place).
    :attr:`crcs` collects every chunk's checksum for the commit.  A medium
    implements :meth:`store`.
    """

    def __init__(self, chunk: int, step: Step) -> None:
        self.chunk = chunk
        self.step = step
        self.buffers = [np.empty(chunk + 4, dtype=np.uint8) for _ in range(2)]
        self.pending: list[Any] = [None, None]
        self.turn = 0
        self.crcs: list[int] = []

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
        self.pending[self.turn] = self.store(i, buf, nbytes, crc)
        self.step("chunk")
        self.turn ^= 1

    @abstractmethod
    def store(self, i: int, buf: np.ndarray, nbytes: int, crc: int) -> Any:
        """Write chunk ``i`` (``buf[:nbytes]``, checksum ``crc``); a future of it, or
        ``None`` once written."""

    def finish(self) -> None:
        for t, fut in enumerate(self.pending):
            if fut is not None:
                fut.result()
                self.pending[t] = None


@dataclass(frozen=True)
class Values:
    """A generation's values as the medium reads them: chunk ``i`` is ``read(i)``."""

    nbytes: int
    chunk: int
    read: Callable[[int], np.ndarray]


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


class VersionedPersister(CheckpointPersister):
    """The crash-safe, versioned protocol (see the module), over a medium that a
    subclass implements (the methods below the protocol's).  Parameters: those of
    :class:`~.interface.CheckpointPersister`."""

    #: The store format this class writes; changes with the layout, the key bytes or
    #: the value frames: an older version refuses what it would misread.
    FORMAT: ClassVar[str] = ""
    #: The formats it reads.
    READABLE: ClassVar[frozenset[str]] = frozenset()

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
        step: Step = no_step,
        writable: bool = True,
    ) -> None:
        super().__init__(
            path,
            name,
            manager_id,
            num_managers,
            chunk_bytes=chunk_bytes,
            storage_options=storage_options,
            fsync=fsync,
            step=step,
            writable=writable,
        )
        local = local_store(path)
        #: The local directory (``file://`` URLs included), or the URL itself.
        self.root = path if local is None else local
        self.local = local is not None
        self.fsync = fsync and self.local  # (an fsspec store has guarantees of its own)
        where = f"manager {manager_id} of {name!r} in {path}"
        try:
            attrs = self._open()
        except DDictError:
            raise
        except OSError as e:  # (a path that cannot be made: /proc, read-only, not ours)
            if not writable or isinstance(e, FileNotFoundError) and local is None:
                raise DDictPersistCheckpointError(f"{where}: cannot be read ({e})") from None
            reason = f"{e.strerror} [errno {e.errno}]" if e.strerror else str(e)
            raise DDictPersistCheckpointError(
                f"persist_path {path!r} cannot be written from {socket.gethostname()} "
                f"({where}): {reason}"
            ) from None
        except Exception as e:  # JSONDecodeError, a node of the wrong kind, ...
            raise DDictPersistCheckpointError(
                f"{where}: unreadable metadata ({type(e).__name__}: {e})"
            ) from None
        attrs = attrs or {}
        found = attrs.get("num_managers")
        fmt = attrs.get("format")
        if fmt is not None and fmt not in self.READABLE:
            raise DDictPersistCheckpointError(
                f"{where} has format {fmt!r}; this dask_ddict reads {self.FORMAT!r} with "
                f"{type(self).__name__} (its key bytes or layout differ): restore it with "
                "the version and persister_class that wrote it"
            )
        #: how many managers wrote the dictionary's first checkpoints (their records, when
        #: an older dask_ddict wrote them, do not say: see ``_all_records``), as manager 0's
        #: attributes say (every dictionary has them; this manager's may be new)
        self.first_managers = int(found) if found is not None else self._first(num_managers)
        if found is None and writable:
            self._stamp(
                {"format": self.FORMAT, "num_managers": num_managers, "manager_id": manager_id}
            )
        elif writable and fmt != self.FORMAT:  # an older readable store: what we add may
            self._stamp({**attrs, "format": self.FORMAT})  # hold frames its writer misreads

    def _first(self, default: int) -> int:
        """Manager 0's ``num_managers`` (``default`` where there is none)."""
        try:
            attrs = self._manager_attrs(0)
        except Exception:  # noqa: BLE001 - unreadable: as if this were the first writer
            return default
        return default if attrs is None else int(attrs.get("num_managers", default))

    def _where(self, chkpt: int) -> str:
        return f"checkpoint {chkpt} of manager {self.manager_id} of {self.name!r} in {self.path}"

    def shapes(self) -> dict[int, int]:
        """Each manager with a place in the dictionary, and how many managers its
        dictionary had when it first wrote there."""
        out = {}
        for i in self._manager_ids():
            attrs = self._manager_attrs(i) or {}
            out[i] = int(attrs.get("num_managers", i + 1))
        return out

    def _other(self, manager_id: int, num_managers: int, writable: bool) -> VersionedPersister:
        """Another manager's persister of the same store and kind."""
        return type(self)(
            self.path,
            self.name,
            manager_id,
            num_managers,
            chunk_bytes=self.chunk_bytes,
            storage_options=self.storage_options,
            step=self.step,
            writable=writable,
        )

    # -- generations ----------------------------------------------------------

    def generations(self) -> list[Generation]:
        """Every generation in the store, committed or not, readable or not."""
        out = []
        for n in self._generation_names():
            m = _GEN.match(n)
            if m is None:
                continue
            chkpt, gen = int(m.group(1)), int(m.group(2))
            try:
                attrs = self._generation_attrs(n)
                out.append(
                    Generation(
                        chkpt,
                        gen,
                        attrs.get("committed") is True,
                        version=int(attrs.get("version", LEGACY)),
                    )
                )
            except Exception as e:  # a torn or damaged commit
                out.append(Generation(chkpt, gen, False, f"{type(e).__name__}: {e}"))
        return sorted(out, key=lambda g: (g.chkpt, g.gen))

    def stored_ids(self) -> list[int]:
        return sorted({g.chkpt for g in self.generations()})

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
            detail += (
                " (this manager committed it, but no version of it is recorded by "
                f"all {self.num_managers} managers)"
            )
        raise DDictPersistCheckpointError(
            f"{self._where(chkpt)} is not persisted{detail} (persisted on every manager: "
            f"{self.complete_ids()})"
        )

    def _remove(self, gen: Generation) -> None:
        """Remove one generation: its commit first, so that a removal cut short by a
        crash (a store cannot delete a directory atomically) never leaves a
        committed generation with missing data."""
        self._uncommit(gen.name)
        self.step("uncommitted")
        self._remove_data(gen.name)
        self.step("removed")

    def delete(self, chkpt: int) -> None:
        """Remove every generation of ``chkpt``, its commit records first."""
        self.unrecord(chkpt)
        self.step("unrecorded")
        for g in self.generations():
            if g.chkpt == chkpt:
                self._remove(g)

    def orphans(self) -> list[CheckpointPersister]:
        """The managers beyond this dictionary's (a restore onto fewer managers left
        them) that this manager tends: manager ``i`` by manager ``i % num_managers``, so
        that their persisted checkpoints are removed as this dictionary's are."""
        if self.manager_id >= self.num_managers:
            return []
        out: list[CheckpointPersister] = []
        for i, shape in self.shapes().items():
            if i >= self.num_managers and i % self.num_managers == self.manager_id:
                out.append(self._other(i, max(shape, i + 1), writable=True))
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
            if (
                (newest is not None and g.gen < newest)
                or any(r.version == g.version for r in later)
                or (later and not g.committed)
            ):
                self._discard(g, mine)

    def settle(self, chkpt: int) -> None:
        records = self._all_records()
        version = self.versions(records).get(chkpt)
        if version is None or version.managers != self.num_managers:
            return  # (nothing restored from here, or re-sharded: this manager's are not it)
        part = version.gens.get(self.manager_id)
        mine = [r for r in records if r.manager == self.manager_id]
        for g in self.generations():
            if g.chkpt == chkpt and not _part_of(g, version, part):
                self._discard(g, mine)

    def _discard(self, g: Generation, mine: list[Record]) -> None:
        """Remove generation ``g``, its records (among this manager's, ``mine``) first."""
        for r in mine:
            if (r.chkpt, r.gen) == (g.chkpt, g.gen):
                self._drop_record(r.name)
        self._remove(g)
        self.step("pruned")

    # -- the dictionary's commit record ------------------------------------------

    def _record_name(self, chkpt: int, gen: int, version: int) -> str:
        return f"chkpt_{chkpt}.manager_{self.manager_id}.g{gen}.v{version:x}.n{self.num_managers}"

    def record(self, chkpt: int, gen: int, version: int) -> None:
        """Record in ``committed/`` that this manager has committed generation ``gen`` of
        ``chkpt``, its part of ``version``.

        Written after the commit and removed before any removal, so a record
        always names a complete copy (a crash between the two leaves a commit
        without a record: never counted, never a loss).
        """
        self._add_record(self._record_name(chkpt, gen, version))

    def _all_records(self) -> list[Record]:
        """Every manager's records, from one listing of ``committed/`` (an older
        dask_ddict's, named by checkpoint and manager only, as :data:`LEGACY`)."""
        out = []
        for n in self._record_names():
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

    def unrecord(self, chkpt: int) -> None:
        """Remove this manager's records of ``chkpt`` (before removing its data)."""
        for r in self._all_records():
            if (r.chkpt, r.manager) == (chkpt, self.manager_id):
                self._drop_record(r.name)

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

    # -- writing --------------------------------------------------------------

    def write(self, chkpt: int, entries: Callable[[], Iterable[Entry]], version: int = 0) -> int:
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
        chunk = max(1, min(self.chunk_bytes, value_bytes))
        attrs = {
            "format": self.FORMAT,
            "checkpoint": chkpt,
            "generation": gen.gen,
            "version": version,
            "manager_id": self.manager_id,
            "num_managers": self.num_managers,
            "num_keys": n,
            "key_bytes": key_bytes,
            "value_bytes": value_bytes,
            "value_chunk": chunk,
        }
        self._begin(gen.name, {**attrs, "committed": False})
        try:
            self._write_generation(gen, attrs, entries, n, key_bytes, chunk)
        except BaseException:
            # (never committed nor recorded: removed at once, so that what it wrote does
            # not hold the room that the next persist needs, on a disk that filled)
            try:
                self._remove(gen)
            except Exception:  # noqa: BLE001 - the next persist's prune tries again
                logger.debug("%r: removing the generation a failed write left", self, exc_info=True)
            raise
        self.step("committed")
        self.record(chkpt, gen.gen, version)
        self.step("recorded")
        self.prune(chkpt)  # only now, and only what a version complete everywhere replaced
        self.step("cleanup")
        return value_bytes

    def _write_generation(
        self,
        gen: Generation,
        attrs: dict[str, Any],
        entries: Callable[[], Iterable[Entry]],
        n: int,
        key_bytes: int,
        chunk: int,
    ) -> None:
        """Write generation ``gen``'s arrays, then its commit (``attrs``, ``committed``)."""
        value_bytes = attrs["value_bytes"]
        writer = self._values_sink(gen.name, value_bytes, chunk)
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
        for aname, arr in zip(SMALL, small):
            self._write_array(gen.name, aname, arr)
            crcs[aname] = crc32c(arr)
        self.step("arrays")
        if self.fsync:
            self._flush(gen.name)
        self.step("commit")
        self._commit(gen.name, {**attrs, "crc32c": crcs, "committed": True})  # the marker, last
        if self.fsync:
            self._flush(gen.name)

    # -- reading --------------------------------------------------------------

    def read(self, chkpt: int) -> Iterator[Entry]:
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

    def _resharded(self, chkpt: int, version: Version) -> Iterator[Entry]:
        """:meth:`read` of a version written by ``version.managers`` managers."""
        n, me, m = version.managers, self.manager_id, self.num_managers
        parts = []
        for i in range(n):  # (every part opened and checked before anything is yielded)
            part = self._other(i, n, writable=False)
            gen = [
                g
                for g in part.generations()
                if g.chkpt == chkpt and g.committed and _part_of(g, version, version.gens[i])
            ][-1:]
            if not gen:
                raise DDictPersistCheckpointError(
                    f"{part._where(chkpt)}: its recorded generation {version.gens[i]} is gone"
                )
            wanted = functools.partial(_owned, part=i, n=n, m=m, me=me)
            parts.append(part.read_generation(gen[0], wanted))
        return itertools.chain.from_iterable(parts)

    def read_generation(
        self, gen: Generation, wanted: Callable[[bytes], bool] | None = None
    ) -> Iterator[Entry]:
        """The entries of this manager's generation ``gen`` (``wanted``: only the keys it
        says), checked as :meth:`read` says."""
        chkpt = gen.chkpt
        where = f"{self._where(chkpt)} ({gen.name})"

        def bad(what: str) -> DDictPersistCheckpointError:
            return DDictPersistCheckpointError(f"{where}: {what}")

        try:
            attrs = self._generation_attrs(gen.name)
            crcs = attrs["crc32c"]
            n, value_bytes = int(attrs["num_keys"]), int(attrs["value_bytes"])
            small = {a: self._read_array(gen.name, a) for a in SMALL}
            values = self._values(gen.name)
        except DDictError:
            raise
        except Exception as e:  # codec checksum, missing array, garbage metadata
            raise bad(f"cannot read it ({type(e).__name__}: {e})") from None
        if (attrs.get("manager_id"), attrs.get("num_managers")) != (
            self.manager_id,
            self.num_managers,
        ):
            raise bad(
                f"it was written by manager {attrs.get('manager_id')} of "
                f"{attrs.get('num_managers')}, not {self.manager_id} of {self.num_managers}"
            )
        for a in SMALL:
            if crc32c(small[a]) != crcs.get(a):
                raise bad(f"array {a!r} does not match its committed checksum (missing chunk?)")
        keys, koff, voff, flags = (small[a] for a in SMALL)
        for aname, off, total in (
            ("key_offsets", koff, keys.size),
            ("value_offsets", voff, value_bytes),
        ):
            if (
                off.shape != (n + 1,)
                or off[0] != 0
                or off[-1] != total
                or np.any(np.diff(off.astype(np.int64)) < 0)
            ):
                raise bad(f"{aname} do not fit the data ({n} keys, {total} bytes)")
        if flags.shape != (n,) or values.nbytes != value_bytes:
            raise bad(f"array shapes do not match the commit ({n} keys, {value_bytes} bytes)")
        chunk = values.chunk
        if len(crcs["values"]) != -(-value_bytes // chunk):
            raise bad(
                f"the commit lists {len(crcs['values'])} value chunks, the array has "
                f"{-(-value_bytes // chunk)}"
            )
        return _entries(values, crcs["values"], keys, koff, voff, flags, bad, wanted)

    # -- the medium: what an implementation provides ---------------------------------

    @abstractmethod
    def _open(self) -> dict[str, Any] | None:
        """Open the dictionary's place, this manager's and the records' (creating them
        when writable); this manager's attributes (``None``: it has no place, read
        only: a manager that a restore onto more managers adds)."""

    @abstractmethod
    def _stamp(self, attrs: dict[str, Any]) -> None:
        """Set this manager's attributes."""

    @abstractmethod
    def _manager_attrs(self, manager_id: int) -> dict[str, Any] | None:
        """Manager ``manager_id``'s attributes (``None``: it has no place)."""

    @abstractmethod
    def _manager_ids(self) -> list[int]:
        """The managers with a place in the dictionary."""

    @abstractmethod
    def _generation_names(self) -> list[str]:
        """The names of this manager's generations, as the medium has them now."""

    @abstractmethod
    def _generation_attrs(self, name: str) -> dict[str, Any]:
        """A generation's attributes (raises if they cannot be read)."""

    @abstractmethod
    def _record_names(self) -> list[str]:
        """Every record in ``committed/``, as the medium has them now."""

    @abstractmethod
    def _add_record(self, name: str) -> None: ...

    @abstractmethod
    def _drop_record(self, name: str) -> None: ...

    @abstractmethod
    def _begin(self, name: str, attrs: dict[str, Any]) -> None:
        """Create generation ``name``, not committed (its ``attrs`` say so)."""

    @abstractmethod
    def _values_sink(self, name: str, nbytes: int, chunk: int) -> ChunkSink:
        """Where the ``nbytes`` of values of generation ``name`` go, in chunks."""

    @abstractmethod
    def _write_array(self, name: str, aname: str, arr: np.ndarray) -> None:
        """Write one of :data:`SMALL` whole."""

    @abstractmethod
    def _commit(self, name: str, attrs: dict[str, Any]) -> None:
        """Replace generation ``name``'s attributes by ``attrs`` (committed) at once: a
        crash leaves the old ones, or ones that cannot be read."""

    @abstractmethod
    def _flush(self, name: str) -> None:
        """Flush generation ``name`` to the disk (``fsync``)."""

    @abstractmethod
    def _uncommit(self, name: str) -> None:
        """Remove generation ``name``'s commit (its attributes), first of all of it."""

    @abstractmethod
    def _remove_data(self, name: str) -> None:
        """Remove what is left of generation ``name``."""

    @abstractmethod
    def _read_array(self, name: str, aname: str) -> np.ndarray:
        """One of :data:`SMALL`, whole (its dtype as written)."""

    @abstractmethod
    def _values(self, name: str) -> Values:
        """Generation ``name``'s values, a chunk at a time."""


def _entries(
    values: Values,
    crcs: list[int],
    keys: np.ndarray,
    koff: np.ndarray,
    voff: np.ndarray,
    flags: np.ndarray,
    bad: Callable[[str], Exception],
    wanted: Callable[[bytes], bool] | None = None,
) -> Iterator[Entry]:
    chunk = values.chunk
    cache: dict[int, np.ndarray] = {}

    def load(i: int) -> np.ndarray:
        if i not in cache:
            cache.clear()  # keep one: consecutive values share at most a boundary chunk
            try:
                data = values.read(i)
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
