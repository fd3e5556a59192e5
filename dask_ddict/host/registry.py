"""HostRegistry: what one worker's host process serves, as its supervisor remembers it.

The host process keeps its own account (:class:`~dask_ddict.host.process.Host`), but it
may die; its supervisor outlives every incarnation and hands the next one each
dictionary it served, over the same shards.  So the supervisor keeps this registry:

* the dictionaries served, each manager's shard path, and the worker each dictionary
  is hosted for (the layout's locality): replayed into every new incarnation;
* the managers paused for a move out: no longer replayed (the new host may serve their
  shards already), until the move is done or aborted;
* the replicas kept here of other hosts' managers: never replayed (an incarnation's
  replicas die with it, and the orchestrator makes them again);
* the shards of deposed primaries that the host keeps aside, and the dictionaries
  destroyed here (a bounded memory): both handed to every new incarnation
  (:class:`~dask_ddict.host.control.Init`);
* an owner lock on each served shard (:mod:`.hygiene`), so that a shard stays claimed
  while its host process restarts, and the kept marks that say which orchestrator
  keeps a shard that nobody serves.

Every change is made under the supervisor's lock, together with the control exchange
that decided it (the registry follows what the host process answered); it takes no
lock of its own.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import DDictError
from . import control, hygiene
from .control import DictSpec

logger = logging.getLogger(__name__)

#: How many destroyed dictionaries a registry remembers (their clients get ``CLOSED``).
MOST_CLOSED = 1024


@dataclass
class ServedDict:
    """One dictionary served here: its spec, its managers' shard paths (by manager id)
    and the worker it is hosted for."""

    spec: DictSpec
    paths: dict[int, str]
    worker: str


class HostRegistry:
    """What one host process serves, kept by its supervisor across incarnations.

    ``keeper``: the orchestrator (the scheduler's address) recorded in the kept marks of
    shards that nobody serves now (parked, kept for a restart, kept aside), so that a
    sweeper can ask it whether it still keeps them.
    """

    def __init__(self, keeper: str = "") -> None:
        self.keeper = keeper
        self.dicts: dict[str, ServedDict] = {}
        #: Uids destroyed here, oldest first (at most :data:`MOST_CLOSED`).
        self.closed: list[str] = []
        #: Managers paused for a move out: their shard paths, until done or aborted.
        self.moving: dict[tuple[str, int], str] = {}
        #: Dictionaries whose last manager here is moving out (their spec, for its end).
        self._leaving: dict[str, ServedDict] = {}
        #: The replicas kept here: the dictionary each belongs to (for a promotion), and
        #: its path.
        self.replicas: dict[tuple[str, int], tuple[DictSpec, str]] = {}
        #: Deposed primaries' shards that the host keeps aside (its notices say which).
        self.aside: dict[tuple[str, int], str] = {}
        self._locks: dict[tuple[str, int], int] = {}  # owner locks of served shards

    def __repr__(self) -> str:
        return (
            f"<HostRegistry dicts={len(self.dicts)} moving={len(self.moving)} "
            f"replicas={len(self.replicas)} aside={len(self.aside)}>"
        )

    @property
    def serving(self) -> bool:
        """Whether the host serves managers of any dictionary (that its going would lose)."""
        return bool(self.dicts or self.moving)

    def spec(self, uid: str) -> DictSpec | None:
        """The spec of dictionary ``uid``, served here or moving out."""
        served = self.dicts.get(uid) or self._leaving.get(uid)
        return None if served is None else served.spec

    def served(self, uid: str, mid: int | None = None) -> ServedDict:
        """Dictionary ``uid`` as served here (with manager ``mid``, if given); an
        ``INVALID_ARGUMENT`` error if it is not."""
        served = self.dicts.get(uid)
        if mid is not None and (served is None or mid not in served.paths):
            raise DDictError(f"manager {mid} of {uid} is not hosted here", "INVALID_ARGUMENT")
        if served is None:
            raise DDictError(f"no manager of {uid} is hosted here", "INVALID_ARGUMENT")
        return served

    def replay(self) -> list[ServedDict]:
        """What a new incarnation is handed (its answers update the paths in place)."""
        return list(self.dicts.values())

    def shards(self) -> list[tuple[int, str]]:
        """``(capacity, path)`` of every shard served here."""
        return [(s.spec.capacity, p) for s in self.dicts.values() for p in s.paths.values()]

    def init_fields(self) -> dict[str, Any]:
        """What a new incarnation's :class:`~dask_ddict.host.control.Init` carries of this
        registry: the destroyed dictionaries, and the shards kept aside."""
        return {
            "closed": tuple(self.closed),
            "aside": tuple((u, m, p) for (u, m), p in self.aside.items()),
        }

    # -- serving ----------------------------------------------------------------------

    def register(self, spec: DictSpec, worker: str, infos: Iterable[dict[str, Any]]) -> None:
        """The host process serves the managers of ``infos`` (its answer to opening them:
        each one's ``manager_id`` and ``store_path``) of ``spec`` for ``worker``: created
        here, moved in, or promoted over a replica kept here.  Each shard's owner lock is
        taken, and the dictionary is not remembered as destroyed any more."""
        served = self.dicts.setdefault(spec.uid, ServedDict(spec, {}, worker))
        for info in infos:
            mid, path = int(info["manager_id"]), info["store_path"]
            served.paths[mid] = path
            held = self._locks.get((spec.uid, mid))  # (one it still held: let go, once
            self._locks[(spec.uid, mid)] = hygiene.claim(path)  # the new one is claimed)
            hygiene.release(held)
        self.revive(spec.uid)

    def revive(self, uid: str) -> None:
        """Dictionary ``uid`` (destroyed here once) has managers or replicas here again."""
        if uid in self.closed:
            self.closed.remove(uid)

    def forget(self, uid: str) -> ServedDict | None:
        """Dictionary ``uid`` is destroyed: nothing of it is served, kept, moved or set
        aside here from now on (the host deletes those), and its clients get ``CLOSED``.
        What was served of it; the owner locks stay until :meth:`release`."""
        served = self.dicts.pop(uid, None)
        self._leaving.pop(uid, None)  # (a move under way is not resumed here)
        for kept in (self.aside, self.replicas, self.moving):
            for key in [k for k in kept if k[0] == uid]:
                del kept[key]
        if uid not in self.closed:
            self.closed.append(uid)
            del self.closed[:-MOST_CLOSED]
        return served

    def release(self, uid: str) -> None:
        """Let go of the owner locks of dictionary ``uid``'s shards."""
        for key in [k for k in self._locks if k[0] == uid]:
            hygiene.release(self._locks.pop(key))

    def release_all(self) -> None:
        """Let go of every owner lock (the supervisor closes)."""
        for fd in self._locks.values():
            hygiene.release(fd)
        self._locks.clear()

    def keep(self, path: str, why: str, uid: str, mid: int, spec: DictSpec | None) -> None:
        """Mark the shard at ``path`` kept (``why``: see :mod:`.hygiene`), recording the
        orchestrator that keeps it: this host's, while it keeps the shard."""
        name = spec.name if spec is not None else ""
        try:
            hygiene.mark_kept(path, record=hygiene.keeper(self.keeper, why, name, uid, mid))
        except OSError as e:  # (gone meanwhile: nothing to keep)
            logger.info("ddict: marking %s kept failed: %r", path, e)

    def keep_for_restart(self, served: ServedDict) -> None:
        """Mark every shard of ``served`` kept for a ``restart=True`` (before its owner
        locks go: no sweep takes them meanwhile)."""
        for mid, path in served.paths.items():
            self.keep(path, hygiene.RESTART, served.spec.uid, mid, served.spec)

    # -- moves (see dask_ddict.host.moves) --------------------------------------------

    def moving_out(self, uid: str, mid: int) -> ServedDict:
        """Manager ``mid`` of ``uid`` is paused for a move out: not replayed from now on."""
        served = self.dicts[uid]
        self.moving[(uid, mid)] = served.paths.pop(mid)
        if not served.paths:
            del self.dicts[uid]
            self._leaving[uid] = served
        return served

    def moved(self, uid: str, mid: int, park: bool) -> None:
        """Manager ``mid`` of ``uid`` serves elsewhere now (``park``: nowhere, its shard
        kept here, marked so before its owner lock goes: no sweep takes it)."""
        path = self.moving.pop((uid, mid), None)
        spec = self.spec(uid)
        self._leaving.pop(uid, None)
        if park and path:
            self.keep(path, hygiene.PARKED, uid, mid, spec)
        hygiene.release(self._locks.pop((uid, mid), None))

    def move_aborted(self, uid: str, mid: int) -> ServedDict | None:
        """Manager ``mid`` of ``uid`` serves on here (its move failed): served again, and
        replayed; ``None`` if it was not moving out (or its dictionary is gone)."""
        path = self.moving.pop((uid, mid), None)
        if path is None:
            return None
        served = self.dicts.get(uid) or self._leaving.pop(uid, None)
        if served is None:
            return None
        self.dicts.setdefault(uid, served).paths[mid] = path
        return served

    # -- replicas (see dask_ddict.host.replicas) --------------------------------------

    def replica_kept(self, spec: DictSpec, mid: int, path: str) -> None:
        """The host keeps a replica of manager ``mid`` of ``spec`` at ``path``."""
        self.replicas[(spec.uid, mid)] = (spec, path)
        self.revive(spec.uid)

    def replica_dropped(self, uid: str, mid: int) -> None:
        self.replicas.pop((uid, mid), None)

    def replica_taken(self, uid: str, mid: int) -> tuple[DictSpec, str] | None:
        """The replica of manager ``mid`` of ``uid`` is to serve as the manager (a
        promotion): its dictionary's spec and its path, or ``None`` if none is kept
        here (:meth:`replica_kept` again if the promotion fails)."""
        return self.replicas.pop((uid, mid), None)

    @property
    def replicated(self) -> bool:
        """Whether the host keeps replicas, or serves managers that have some."""
        return bool(self.replicas) or any(s.spec.options.replicas for s in self.dicts.values())

    def drop_replicas(self) -> None:
        """The host process died, and the replicas it kept with it: delete their files."""
        for _, path in self.replicas.values():
            shutil.rmtree(path, ignore_errors=True)
        self.replicas.clear()

    # -- what the host decided alone (its notices) ------------------------------------

    def note(self, notice: Any) -> None:
        """Follow the host's notice (:mod:`.control`): a primary it deposed is served no
        more, its shard kept aside (and marked so); a shard it discarded is gone."""
        key = (notice.uid, notice.manager_id)
        if isinstance(notice, control.Deposed):
            self.keep(
                notice.path, hygiene.ASIDE, notice.uid, notice.manager_id, self.spec(notice.uid)
            )
            served = self.dicts.get(notice.uid)
            if served is not None:
                served.paths.pop(notice.manager_id, None)
                if not served.paths:
                    del self.dicts[notice.uid]
            hygiene.release(self._locks.pop(key, None))
            self.aside[key] = notice.path
        elif isinstance(notice, control.Discarded):
            self.aside.pop(key, None)
