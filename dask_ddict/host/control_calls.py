"""ControlCalls: the orchestrator's calls to a host supervisor, answered for its host.

The orchestrator (:mod:`dask_ddict.cluster.scheduler_plugin`) never speaks to a host
process: it calls handlers on the worker's nanny (or the worker itself), which the
plugin (:mod:`dask_ddict.cluster.worker_plugin`) installs from :meth:`ControlCalls.handlers`:
``ddict_create_managers``, ``ddict_destroy_managers``, ``ddict_remove_paths``,
``ddict_host_info``, the ``ddict_move_*`` steps of a move, the ``ddict_replica_*`` steps
of a replica's life, ``ddict_shard_bytes`` and ``ddict_probe``.

Most of them send one control message down the host's pipe (:mod:`.control`) and, under
the same lock, record in the supervisor's registry (:class:`~.registry.HostRegistry`)
what the host now serves, so that a new incarnation gets it.  Control calls block on
the pipe, so the async handlers run them in a thread (:func:`~.off_loop.off_loop`), off
the event loop.
"""

from __future__ import annotations

import logging
import shutil
from typing import Any

from ..errors import DDictError, DDictManagerUnavailableError, error_to_wire
from ..options import DDictOptions
from . import control, hygiene, machine
from .control import DictSpec
from .off_loop import off_loop
from .pipe import HostDiedError
from .supervisor import HostSupervisor

logger = logging.getLogger(__name__)


class ControlCalls:
    """The control calls of one supervisor's host (see the module's docstring)."""

    def __init__(self, supervisor: HostSupervisor) -> None:
        self.supervisor = supervisor
        self.registry = supervisor.registry

    def __repr__(self) -> str:
        return f"<ControlCalls {self.supervisor.label!r}>"

    def handlers(self) -> dict[str, Any]:
        """Async handlers for the nanny's or worker's server (blocking work in a thread)."""

        def wrap(fn: Any) -> Any:
            async def handler(**kwargs: Any) -> Any:
                try:
                    return await off_loop(fn, **kwargs)
                except Exception as e:
                    wire = error_to_wire(e)
                    if wire is None:
                        raise
                    return wire

            return handler

        return {
            "ddict_create_managers": wrap(self.create_managers),
            "ddict_destroy_managers": wrap(self.destroy_managers),
            "ddict_remove_paths": wrap(self.remove_paths),
            "ddict_host_info": wrap(self.supervisor.info),
            "ddict_move_out": wrap(self.move_out),
            "ddict_move_prepare": wrap(self.move_prepare),
            "ddict_move_in": wrap(self.move_in),
            "ddict_move_done": wrap(self.move_done),
            "ddict_move_abort": wrap(self.move_abort),
            "ddict_shard_bytes": wrap(self.shard_bytes),
            "ddict_probe": wrap(machine.probe),
            **{
                f"ddict_replica_{n}": wrap(getattr(self, f"replica_{n}"))
                for n in ("hold", "seed", "targets", "drop", "promote")
            },
        }

    def _described(self, infos: list[dict[str, Any]], worker: str) -> list[dict[str, Any]]:
        """The host's answer for managers it opened, with how to reach them (layout
        fields) and the machine's memory, measured after the shards opened (and were
        reserved): what the orchestrator's sizing check reads."""
        sup = self.supervisor
        where = sup.info()
        with sup.lock:
            shards = self.registry.shards()
        memory = machine.memory(shards)
        return [
            {
                **i,
                **memory,
                "worker": worker,
                "pid": where["supervisor_pid"],
                "uds_path": sup.uds_path,
                "tcp_host": sup.tcp_host,
                "tcp_port": sup.tcp_port,
                "host_id": where["host_id"],
                "hostname": where["hostname"],
            }
            for i in infos
        ]

    # -- a dictionary's managers ------------------------------------------------------

    def create_managers(
        self,
        name: str,
        uid: str,
        secret: str,
        options: dict[str, Any],
        capacity: int,
        manager_ids: list[int],
        num_managers: int,
        restart_paths: dict[int, str] | None = None,
        worker: str = "",
        storage_options: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Serve managers ``manager_ids`` of a new dictionary (or re-attach kept shards)."""
        spec = _spec(name, uid, secret, options, capacity, num_managers, storage_options)
        paths = {int(k): v for k, v in (restart_paths or {}).items()}
        with self.supervisor.lock:
            infos = self.supervisor.call(
                control.OpenManagers(spec, tuple(int(m) for m in manager_ids), paths, worker)
            )
            self.registry.register(spec, worker, infos)
        return self._described(infos, worker)

    def destroy_managers(self, uid: str, allow_restart: bool = False) -> int:
        """Stop serving dictionary ``uid``: its shards are deleted, or kept for a
        ``restart=True`` (``allow_restart``).  How many managers closed."""
        registry = self.registry
        with self.supervisor.lock:
            served = registry.forget(uid)
            try:
                closed = int(self.supervisor.call(control.CloseManagers(uid, allow_restart)))
            except HostDiedError:
                # The next incarnation will not serve it: its shards go now, or are kept.
                if served is not None and allow_restart:
                    registry.keep_for_restart(served)
                elif served is not None:
                    for path in served.paths.values():
                        shutil.rmtree(path, ignore_errors=True)
                raise
            else:
                if allow_restart and served is not None:  # (the host marked them: say
                    registry.keep_for_restart(served)  # whose, before the owner locks go)
                return closed
            finally:
                registry.release(uid)

    @staticmethod
    def remove_paths(paths: list[str], kept: bool = False) -> int:
        """Delete shard and socket directories whose owners are provably dead (``kept``:
        also shards kept for a restart or parked, which nothing will re-attach now)."""
        return hygiene.remove(paths, kept)

    def shard_bytes(self, uid: str) -> dict[int, int]:
        """The used bytes of each of ``uid``'s managers here (rebalance moves the fewest)."""
        with self.supervisor.lock:
            if uid not in self.registry.dicts:
                return {}
            return dict(self.supervisor.call(control.ShardBytes(uid)))

    # -- moves (see dask_ddict.host.moves) --------------------------------------------

    def move_out(self, uid: str, manager_id: int, copy: bool) -> dict[str, Any]:
        """Pause a manager that leaves this host.  It is no longer replayed into a new
        incarnation from now on (the new host may serve its shard already)."""
        mid = int(manager_id)
        with self.supervisor.lock:
            served = self.registry.served(uid, mid)
            reply = self.supervisor.call(control.MoveOut(uid, mid, bool(copy)))
            self.registry.moving_out(uid, mid)
        return {**reply, "storage_options": served.spec.storage_options}

    def move_in(
        self,
        name: str,
        uid: str,
        secret: str,
        options: dict[str, Any],
        capacity: int,
        num_managers: int,
        manager_id: int,
        worker: str = "",
        path: str = "",
        source: dict[str, Any] | None = None,
        used: int = 0,
        map_size: int = 0,
        storage_options: dict[str, Any] | None = None,
        term: int = 0,
    ) -> list[dict[str, Any]]:
        """Serve a manager that moves here (its shard at ``path``, or copied from ``source``),
        under ``term``."""
        spec = _spec(name, uid, secret, options, capacity, num_managers, storage_options)
        mid = int(manager_id)
        with self.supervisor.lock:
            infos = self.supervisor.call(
                control.MoveIn(spec, mid, worker, path, source, int(used), int(map_size), int(term))
            )
            self.registry.register(spec, worker, infos)
        return self._described(infos, worker)

    def move_prepare(self, name: str, manager_id: int, capacity: int, nbytes: int) -> str:
        """Make the file of a manager's copy ready before its move pauses it (its path)."""
        msg = control.MovePrepare(name, int(manager_id), int(capacity), int(nbytes))
        return str(self.supervisor.call(msg))

    def move_done(self, uid: str, manager_id: int, where: str, park: bool = False) -> None:
        """The manager serves at ``where`` now (``park``: nowhere, its shard kept here):
        this host stops serving it."""
        mid = int(manager_id)
        with self.supervisor.lock:
            self.registry.moved(uid, mid, bool(park))
            try:
                self.supervisor.call(control.MoveDone(uid, mid, where, bool(park)))
            except HostDiedError:  # (its next incarnation does not serve it)
                logger.info("ddict: the host of %s ended during a move", self.supervisor.label)

    def move_abort(self, uid: str, manager_id: int) -> None:
        """The move failed: the manager serves on here (re-opened if the host restarted)."""
        mid = int(manager_id)
        with self.supervisor.lock:
            served = self.registry.move_aborted(uid, mid)
            if served is None:
                return
            try:
                self.supervisor.call(control.MoveAbort(uid, mid))
            except HostDiedError:  # (ended or killed meanwhile: its next one re-opens it)
                return
            except DDictError:  # a new incarnation, which did not open it: open it now
                paths = {mid: served.paths[mid]}
                self.supervisor.call(  # (under the term in its shard)
                    control.OpenManagers(served.spec, (mid,), paths, served.worker, term=None)
                )

    # -- replicas (see dask_ddict.host.replicas) --------------------------------------

    def replica_hold(self, uid: str, manager_id: int) -> dict[str, Any]:
        """Pause a manager here while a new replica copies its shard (what that needs)."""
        with self.supervisor.lock:
            served = self.registry.served(uid)
            reply = self.supervisor.call(control.ReplicaHold(uid, int(manager_id)))
        return {**reply, "spec": served.spec.to_wire()}

    def replica_seed(
        self,
        spec: dict[str, Any],
        manager_id: int,
        source: dict[str, Any],
        used: int,
        map_size: int,
        worker: str = "",
    ) -> dict[str, Any]:
        """Keep a new replica of a manager (held at ``source``); how to reach it."""
        mid, dspec = int(manager_id), DictSpec.from_wire(spec)
        with self.supervisor.lock:
            path = self.supervisor.call(
                control.ReplicaSeed(dspec, mid, source, int(used), int(map_size))
            )
            self.registry.replica_kept(dspec, mid, path)
        return self._described([{"manager_id": mid, "store_path": path}], worker)[0]

    def replica_targets(
        self,
        uid: str,
        manager_id: int,
        add: dict[str, Any] | None = None,
        remove: list[Any] | None = None,
        release: bool = False,
    ) -> list[Any]:
        """Change the replicas of a manager here (``add`` one, ``remove`` some, end a hold):
        the addresses of those it ships to now."""
        with self.supervisor.lock:
            spec = self.registry.served(uid).spec
            msg = control.ReplicaTargets(
                spec, int(manager_id), add, tuple(remove or ()), bool(release)
            )
            return list(self.supervisor.call(msg))

    def replica_drop(self, uid: str, manager_id: int) -> bool:
        """Stop keeping a replica here."""
        with self.supervisor.lock:
            self.registry.replica_dropped(uid, int(manager_id))
            return bool(self.supervisor.call(control.ReplicaDrop(uid, int(manager_id))))

    def replica_promote(
        self, uid: str, manager_id: int, worker: str = "", old_path: str = "", term: int = 0
    ) -> list[dict[str, Any]]:
        """Serve a manager whose primary is lost over the replica kept here, under ``term``
        (once the orchestrator confirms it: see :mod:`.lease`)."""
        mid = int(manager_id)
        registry = self.registry
        with self.supervisor.lock:
            kept = registry.replica_taken(uid, mid)
            served = registry.dicts.get(uid)
            if kept is None and served is not None and mid in served.paths:
                # (promoted by a call whose answer the orchestrator did not get: the same)
                again = {"manager_id": mid, "store_path": served.paths[mid], "restarted": True}
                return self._described([again], worker)
            if kept is None:
                raise DDictError(
                    f"no replica of manager {mid} of {uid} is kept here", "MANAGER_UNAVAILABLE"
                )
            spec, path = kept
            try:
                infos = self.supervisor.call(
                    control.ReplicaPromote(spec, mid, worker, old_path, int(term))
                )
            except Exception as e:
                if _kept_again(e):
                    registry.replica_kept(spec, mid, path)
                raise
            registry.register(spec, worker, infos)
        return self._described(infos, worker)


def _kept_again(e: BaseException) -> bool:
    """Whether a promotion that raised ``e`` left its replica kept by the host (its opening
    failed: see ``replicas.give_back``), rather than refused it (none kept, or stale) or
    ended with the host process (which was killed if it did not answer in time)."""
    if isinstance(e, DDictManagerUnavailableError):
        return False
    return not (isinstance(e, DDictError) and e.code == "TIMEOUT")


def _spec(
    name: str,
    uid: str,
    secret: str,
    options: dict[str, Any],
    capacity: int,
    num_managers: int,
    storage_options: dict[str, Any] | None,
) -> DictSpec:
    """A dictionary's spec from a control call's plain arguments."""
    return DictSpec(
        name,
        uid,
        secret,
        DDictOptions.from_dict(options),
        int(capacity),
        int(num_managers),
        storage_options,
    )
