"""The checkpoint-persister interface: what a manager asks of the place its checkpoints go.

One instance per manager (as Dragon's ``CheckpointPersister``), in its host
process.  The policy (which checkpoints, how many are kept, the background
thread) is :class:`~dask_ddict.persist.persister.Persister`'s; a persister is
the I/O: write a checkpoint as a whole, list what is persisted, read one back,
remove one.  ``persister_class=`` picks the implementation
(:mod:`dask_ddict.persist.choice`):

* :class:`~dask_ddict.persist.zarr_store.ZarrPersister` (the default): a zarr v3
  store, a local directory or any fsspec URL;
* :class:`~dask_ddict.persist.directory_store.DirectoryPersister`: plain files in
  a directory (a local or shared file system), no zarr needed to read them.

Both are :class:`~dask_ddict.persist.versioned.VersionedPersister`: the
crash-safe protocol that makes a persisted checkpoint one version on every
manager, over a *medium* that each implements.  A new medium subclasses that
(and is tested by ``tests/test_persist_integrity.py``'s crash tests); a class
that implements this interface directly keeps the guarantees itself.

A checkpoint is *complete* once every manager of the dictionary that wrote it
has persisted its part of one version (:meth:`CheckpointPersister.versions`):
rotation (``persist_count``) trusts :meth:`complete_ids`, a restore reads only
what it lists, and ``persisted_ids()`` is it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

#: A hook called at named steps of a write (tests kill the process there): "chunk",
#: "arrays", "commit", "committed", "recorded", "cleanup"; and of a removal:
#: "unrecorded", "uncommitted", "removed"; "pruned" and (the policy's) "rotate".
Step = Callable[[str], None]
#: What a manager persists and reads back: ``(key bytes, value frame, flags)``.
Entry = tuple[bytes, Any, int]
#: The version of parts that an older dask_ddict wrote (it named none): older than any.
LEGACY = -1


def no_step(step: str) -> None:
    """The default :data:`Step`: nothing."""


@dataclass(frozen=True)
class Version:
    """A version of a checkpoint that every manager of its writer persisted: which, and
    each manager's part of it (a number its persister gives it: a generation)."""

    version: int
    managers: int  # how many managers wrote it (its shape: keys are placed among them)
    gens: dict[int, int]  # manager -> its part of this version

    @property
    def order(self) -> tuple[int, int]:
        """Newer versions sort higher.  Every version, whatever its shape, has a part of
        manager 0, which numbers its parts in ascending order: the newest version has
        its highest there; the same for every manager, which must all choose the same
        one."""
        return self.gens[0], self.version


class CheckpointPersister(ABC):
    """One manager's persisted checkpoints.

    Parameters
    ----------
    path
        Where they go (``persist_path``): what it means is the implementation's.
    name
        The dictionary's name (its place in ``path``).
    manager_id, num_managers
        Which shard this is, and of how many (a checkpoint only makes sense with
        the key-to-manager mapping it was written with; a restore onto another
        number re-shards it).
    chunk_bytes
        The unit values are written and checked in (``ddict.persist.chunk-bytes``).
    storage_options
        fsspec options for a URL ``path`` (credentials, endpoint).
    fsync
        Flush a checkpoint to the disk before its commit, and the commit after
        (``ddict.persist.fsync``): it then survives a power loss.
    step
        Called with the name of each step of a write or removal (:data:`Step`).
    writable
        ``False``: read only, creating nothing (a restore's check, inspection).
    """

    #: The name ``persister_class=`` and the dictionary's options know it by.
    kind: ClassVar[str] = ""

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
        self.path = path
        self.name = name
        self.manager_id = manager_id
        self.num_managers = num_managers
        self.chunk_bytes = chunk_bytes
        self.storage_options = storage_options
        self.fsync = fsync
        self.step = step
        self.writable = writable

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.path!r} {self.name!r} manager={self.manager_id}>"

    # -- the interface ----------------------------------------------------------------

    @abstractmethod
    def write(self, chkpt: int, entries: Callable[[], Iterable[Entry]], version: int = 0) -> int:
        """Persist this manager's part of ``version`` of checkpoint ``chkpt`` as a whole
        (``entries()`` may be called more than once, each time yielding the same; its
        frames may be valid only while it iterates).  An earlier version stays the
        checkpoint until this one is persisted by every manager.  Returns the value
        bytes written."""

    @abstractmethod
    def read(self, chkpt: int) -> Iterator[Entry]:
        """This manager's entries of the newest version of ``chkpt`` that every manager
        persisted, checked (a consumer that must be all-or-nothing aborts on the
        error raised part-way).  Raises ``DDictPersistCheckpointError`` if it is not
        persisted, or its data does not match what was written."""

    @abstractmethod
    def recorded(self) -> set[tuple[int, int]]:
        """``(chkpt, version)`` of each part this manager finished persisting."""

    @abstractmethod
    def versions(self) -> dict[int, Version]:
        """Each checkpoint's newest version that every manager of its writer persisted
        (whatever their number)."""

    @abstractmethod
    def delete(self, chkpt: int) -> None:
        """Remove this manager's parts of ``chkpt``, so that a removal cut short is never
        listed as persisted."""

    @classmethod
    @abstractmethod
    def dictionaries(cls, path: str, storage_options: dict[str, Any] | None = None) -> list[str]:
        """The names of the dictionaries persisted at ``path`` (``[]``: none, or nothing
        there); raises ``DDictPersistCheckpointError`` where ``path`` cannot be read as
        this kind of store."""

    # -- derived, and what an implementation may add -----------------------------------

    def ids(self) -> list[int]:
        """This manager's persisted checkpoint ids, ascending."""
        return sorted({c for c, _ in self.recorded()})

    def complete_ids(self) -> list[int]:
        """The ids persisted, as one version, by every manager, ascending."""
        return sorted(self.versions())

    def stored_ids(self) -> list[int]:
        """Every id this manager holds anything of, persisted or cut short (rotation
        removes those below what it keeps)."""
        return self.ids()

    def prune(self, chkpt: int | None = None) -> None:
        """Remove this manager's parts of ``chkpt`` (else of any) that newer versions
        persisted everywhere replaced; nothing by default."""

    def settle(self, chkpt: int) -> None:
        """After a restore of ``chkpt`` (every persist ended first): remove this manager's
        parts of ``chkpt`` that are not of the version restored, persisted by some
        managers only, whose history the restore ended (they would hold the room of the
        next persists); nothing by default."""

    def orphans(self) -> list[CheckpointPersister]:
        """The persisters of managers beyond this dictionary's (a restore onto fewer
        managers left them) that this manager tends; none by default."""
        return []
