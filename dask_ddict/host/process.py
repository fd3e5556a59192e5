"""The host process: serves managers outside any Dask worker.

Started by a :class:`~dask_ddict.host.supervisor.HostSupervisor` (in the
worker's nanny, or in the worker itself when it has none) as
``python -m dask_ddict.host UDS_FD TCP_FD``, in a session of its own: it is the
worker's sibling, so the nanny's memory monitor, pause and restart never see
its shard pages, and a worker restart leaves it serving.

The main thread reads control messages from the supervisor's pipe (stdin);
the :class:`~dask_ddict.host.server.HostServer` threads serve clients.  EOF on
the pipe means the supervisor is gone: the host shuts down cleanly (readers
see the shards marked closed, shards and socket directory are removed) rather
than lingering as an orphan.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import socket
import sys
import threading
from typing import Any, BinaryIO

import dask.config

from .. import config
from ..errors import DDictError, DDictManagerUnavailableError
from ..kernels import GenerationBump
from ..shard.direct import set_owner
from ..shard.generations import Generations, path_for
from ..shard.lease_word import LeaseWord
from ..shard.lease_word import path_for as lease_word_path
from ..shard.manager import Manager
from ..shard.pinboard import BoardReader, remove_boards
from ..shard.reader_marks import CLOSED_DESTROYED, CLOSED_HOST_GONE
from ..transport.tls_settings import set_default_security
from . import control, forward, hygiene, moves, replicas
from .hosted import HostedDict
from .lease import LeaseKeeper
from .opening import open_manager
from .server import HostServer, ServingLimits

logger = logging.getLogger(__name__)


class Host:
    """The managers of one host process and the server in front of them.

    ``notices``: the pipe on which it tells its supervisor what it decided alone (a
    primary deposed by the orchestrator's answer to its lease, a shard it discarded),
    so that a new incarnation is not handed those managers again."""

    def __init__(
        self,
        init: control.Init,
        uds: socket.socket,
        tcp: socket.socket,
        notices: BinaryIO | None = None,
    ) -> None:
        self.init = init
        self.dicts: dict[bytes, HostedDict] = {}
        self.closed: set[bytes] = {bytes.fromhex(u) for u in init.closed}
        self.locks: dict[tuple[str, int], int] = {}
        self.aside: dict[tuple[str, int], str] = {(u, m): p for u, m, p in init.aside}
        self._notices = notices
        self._noting = threading.Lock()
        self.keeper = LeaseKeeper(
            init.scheduler,
            init.supervisor,
            init.security,
            self,
            LeaseWord(lease_word_path(init.socket_dir), create=True),
        )
        ssl_context = None
        if init.tls:
            ssl_context = init.security.get_listen_args("worker").get("ssl_context")
            if ssl_context is None:
                raise RuntimeError("the cluster requires TLS but this host has no certificate")
        if init.security is not None:
            set_default_security(init.security)  # (clones, moves, replicas reach peers over TLS)
        self.server = HostServer(
            uds,
            tcp,
            self.dicts,
            self.closed,
            ssl_context=ssl_context,
            page_bytes=config.get_bytes("iteration.page-bytes"),
            scratch_keep=config.get_bytes("store.scratch-bytes"),
            limits=ServingLimits.from_config(),
            event_loop=bool(config.get("host.event-loop")),
        )

    def __repr__(self) -> str:
        return f"<Host pid={os.getpid()} dicts={len(self.dicts)}>"

    def handle(self, msg: Any) -> Any:
        if isinstance(msg, control.OpenManagers):
            return self.open(msg)
        if isinstance(msg, control.CloseManagers):
            return self.close_dict(msg.uid, msg.allow_restart)
        if isinstance(msg, control.Serve):
            self.server.start()
            self.keeper.start()
            return None
        if isinstance(msg, control.Ping):
            return os.getpid()
        if isinstance(msg, control.MoveOut):
            return moves.move_out(self, msg.uid, msg.manager_id, msg.copy)
        if isinstance(msg, control.MoveIn):
            return self.move_in(msg)
        if isinstance(msg, control.MovePrepare):
            return moves.prepare(msg.name, msg.manager_id, msg.capacity, msg.nbytes)
        if isinstance(msg, control.MoveDone):
            return moves.move_done(self, msg.uid, msg.manager_id, msg.where, msg.park)
        if isinstance(msg, control.ShardBytes):
            hosted = self.dicts.get(bytes.fromhex(msg.uid))
            return (
                {}
                if hosted is None
                else {
                    m: hosted.find(m).used_bytes()  # type: ignore[union-attr]
                    for m in [*hosted.managers, *hosted.fenced]
                }
            )
        if isinstance(msg, control.MoveAbort):
            return moves.move_abort(self, msg.uid, msg.manager_id)
        return self._replicas(msg)

    def _replicas(self, msg: Any) -> Any:
        """The control messages of replicas (see :mod:`.replicas`)."""
        if isinstance(msg, control.ReplicaHold):
            return moves.served_manager(self, msg.uid, msg.manager_id).hold()
        if isinstance(msg, control.ReplicaSeed):
            return replicas.seed(
                self, msg.spec, msg.manager_id, msg.source, msg.used, msg.map_size, self.init.tls
            )
        if isinstance(msg, control.ReplicaTargets):
            manager = moves.served_manager(self, msg.spec.uid, msg.manager_id)
            return replicas.targets(
                manager,
                msg.spec,
                self.init.tls,
                msg.add,
                list(msg.remove),
                msg.release,
                functools.partial(self.depose, msg.spec.uid, manager),
                self.keeper,
                self.dicts.get(bytes.fromhex(msg.spec.uid)),
            )
        if isinstance(msg, control.ReplicaDrop):
            return replicas.drop(self, msg.uid, msg.manager_id)
        if isinstance(msg, control.ReplicaPromote):
            mid = msg.manager_id
            path, lock = replicas.take_replica(self, msg.spec.uid, mid, msg.old_path)
            try:  # (the replica's owner lock, held until the manager claimed its shard)
                infos = self.open(
                    control.OpenManagers(msg.spec, (mid,), {mid: path}, msg.worker, msg.term)
                )
            except BaseException:
                replicas.give_back(self, msg.spec, mid, path, lock)
                raise
            hygiene.release(lock)
            return infos
        raise DDictError(f"unknown control message {msg!r}", "INVALID_ARGUMENT")

    def hosted(self, spec: control.DictSpec) -> HostedDict:
        """The dictionary ``spec`` as this host serves it (new: not served yet)."""
        hosted = self.dicts.get(bytes.fromhex(spec.uid))
        if hosted is None:
            hosted = HostedDict(
                spec.uid,
                spec.name,
                spec.secret,
                Generations(
                    path_for(self.init.socket_dir, spec.uid), spec.num_managers, create=True
                ),
                BoardReader(self.init.socket_dir, spec.uid, spec.num_managers),
                self.keeper,
            )
            hosted.leased = bool(spec.options.replicas) and self.keeper.required
        return hosted

    def open(self, msg: control.OpenManagers) -> list[dict[str, Any]]:
        spec = msg.spec
        key = bytes.fromhex(spec.uid)
        hosted = self.hosted(spec)
        gens = hosted.generations
        infos = []
        opened: list[int] = []
        try:
            for mid in msg.manager_ids:
                manager, restarted, lock = open_manager(
                    spec, mid, msg.restart_paths.get(mid), msg.worker, msg.term
                )
                if gens is not None:  # every commit, then a new word (see shard.generations)
                    manager.generations = gens
                    manager.store.on_commit = GenerationBump(gens, mid)
                    gens.bump(mid)
                set_owner(manager.store, self.init.socket_dir)  # (direct writers check it)
                if hosted.pins is not None:
                    manager.pins = hosted.pins
                manager.served = hosted.served.of
                manager.host_restarts = self.init.restarts
                if hosted.leased and self.keeper.required:  # (it serves once the
                    # orchestrator confirmed it: see .lease)
                    hosted.fence(
                        manager,
                        "the orchestrator has not confirmed yet that it "
                        f"serves it here (term {manager.term})",
                    )
                else:
                    hosted.managers[mid] = manager
                self.locks[(spec.uid, mid)] = lock
                opened.append(mid)
                infos.append(
                    {"manager_id": mid, "store_path": manager.store.path, "restarted": restarted}
                )
        except BaseException:
            for mid in opened:
                undone = hosted.find(mid)
                hosted.managers.pop(mid, None)
                hosted.fenced.pop(mid, None)
                if undone is not None:
                    undone.close(destroy=not msg.restart_paths)
                hygiene.release(self.locks.pop((spec.uid, mid), None))
            if key not in self.dicts and gens is not None:  # (a new dictionary here)
                gens.remove()
            raise
        self.closed.discard(key)
        for mid in msg.manager_ids:
            hosted.moved.pop(mid, None)  # (moved away once, back now)
        self.dicts[key] = hosted
        if hosted.fenced:
            self.keeper.renew_soon()
        logger.info(
            "ddict host %d: serving managers %s of %s",
            os.getpid(),
            list(msg.manager_ids),
            spec.name,
        )
        return infos

    def move_in(self, msg: control.MoveIn) -> list[dict[str, Any]]:
        """Serve a manager that moves here (see :mod:`.moves`)."""
        path = msg.path
        if path and msg.source is None:
            moves.let_go(path)  # (it left this process a moment ago: closed here first)
            if not os.path.isfile(os.path.join(path, "data.mdb")):
                raise DDictManagerUnavailableError(
                    f"manager {msg.manager_id}'s shard {path} is not on this machine any more "
                    "(its shared memory was emptied)"
                )
        received = None  # (the copy's owner lock, held until the manager claimed it)
        if msg.source is not None:
            path, received = moves.receive(
                msg.spec,
                msg.manager_id,
                msg.source,
                msg.used,
                msg.map_size,
                self.init.tls,
                prepared=path,
            )
        try:
            return self.open(
                control.OpenManagers(
                    msg.spec, (msg.manager_id,), {msg.manager_id: path}, msg.worker, msg.term
                )
            )
        except BaseException:
            if msg.source is not None:  # (a copy of ours; the same machine's shard is not)
                shutil.rmtree(path, ignore_errors=True)
            raise
        finally:
            hygiene.release(received)

    def close_dict(self, uid: str, allow_restart: bool, why: int = CLOSED_DESTROYED) -> int:
        key = bytes.fromhex(uid)
        moves.let_go_of(uid)  # (shards of managers that moved away: their space comes back)
        forward.forget(uid)  # (its tree broadcasts' links to other hosts)
        hosted = self.dicts.pop(key, None)
        if why == CLOSED_DESTROYED:
            self.closed.add(key)
        if hosted is None:
            return 0
        for manager in [*hosted.managers.values(), *(m for m, _ in hosted.fenced.values())]:
            self._close_manager(manager, allow_restart, why)
            hygiene.release(self.locks.pop((uid, manager.manager_id), None))
        n = len(hosted.managers) + len(hosted.fenced)
        hosted.managers.clear()
        hosted.fenced.clear()
        for u, mid in [k for k in self.aside if k[0] == uid]:  # (nobody needs them now)
            self.discard(u, mid)
        for replica in hosted.replicas.values():
            replica.close()  # (a replica is kept for a live primary only)
        hosted.replicas.clear()
        hosted.answers.clear()
        if hosted.generations is not None:
            hosted.generations.remove()
        remove_boards(self.init.socket_dir, uid)
        return n

    @staticmethod
    def _close_manager(manager: Manager, keep: bool, why: int) -> None:
        if manager.shipper is not None:
            manager.shipper.close()
        try:
            if keep:
                hygiene.mark_kept(manager.store.path)
            manager.close(destroy=not keep, why=why)
        except Exception:
            logger.exception("ddict host: closing manager %d failed", manager.manager_id)

    # -- what the lease decides (see .lease) ---------------------------------------------

    def depose(self, uid: str, manager: Manager, where: str) -> None:
        """The orchestrator serves ``manager`` at ``where`` now (a replica took over): its
        requests here are answered ``MOVED`` from now on, and its shard is kept aside,
        closed, until the orchestrator says to discard it (:meth:`discard`)."""
        path = manager.store.path
        if moves.depose(self, uid, manager, where):
            self.aside[(uid, manager.manager_id)] = path
            self.notify(control.Deposed(uid, manager.manager_id, path))

    def discard(self, uid: str, mid: int, path: str | None = None) -> None:
        """Delete the shard kept aside for deposed manager ``mid`` of ``uid`` (``path``: only
        if that is the one kept, the one the orchestrator judged).  A process that claims
        it keeps it (see :func:`.hygiene.remove_aside`)."""
        kept = self.aside.get((uid, mid))
        if kept is None or (path is not None and path != kept):
            return
        del self.aside[(uid, mid)]
        moves.let_go(kept)  # (if it is still open here)
        removed = hygiene.remove_aside(kept)
        self.notify(control.Discarded(uid, mid))
        logger.info(
            "ddict host %d: discarded the shard of deposed manager %d (%s)%s",
            os.getpid(),
            mid,
            kept,
            "" if removed else " (no: a process claims it, or it is kept for another reason)",
        )

    def notify(self, notice: Any) -> None:
        """Tell the supervisor what this host decided alone (see :class:`Host`)."""
        if self._notices is None:
            return
        try:
            with self._noting:
                control.send(self._notices, notice)
        except OSError as e:  # (its supervisor is gone: it shuts this host down)
            logger.info(
                "ddict host %d: could not tell its supervisor %r: %r", os.getpid(), notice, e
            )

    def shutdown(self, supervisor_lost: bool) -> None:
        """Close everything.  Shards are deleted: nothing could serve them any more.

        Each shard is marked closed because its host is gone, never "destroyed": the
        dictionaries live on without these managers (their same-host readers say so).
        """
        self.keeper.close()
        self.server.close()
        for uid, mid in list(self.aside):  # (nothing can report them any more)
            self.discard(uid, mid)
        for hosted in list(self.dicts.values()):
            self.close_dict(hosted.uid, False, CLOSED_HOST_GONE)
        if supervisor_lost:
            shutil.rmtree(self.init.socket_dir, ignore_errors=True)


def main(argv: list[str]) -> int:
    """Entry point: ``python -m dask_ddict.host UDS_FD TCP_FD [NOTICE_FD]``."""
    uds_fd, tcp_fd = int(argv[0]), int(argv[1])
    notices = os.fdopen(int(argv[2]), "wb") if len(argv) > 2 else None
    ctl_in: BinaryIO = sys.stdin.buffer
    ctl_out: BinaryIO = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints never corrupt the pipe
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s - ddict-host %(process)d - %(levelname)s - %(message)s",
    )
    init = control.recv(ctl_in)
    if not isinstance(init, control.Init):
        return 2
    dask.config.update(dask.config.config, {"ddict": init.config}, priority="new")
    uds = socket.socket(fileno=uds_fd)
    tcp = socket.socket(fileno=tcp_fd)
    host = Host(init, uds, tcp, notices)
    control.send(ctl_out, (True, os.getpid()))
    while True:
        msg = control.recv(ctl_in)
        if msg is None or isinstance(msg, control.Shutdown):
            host.shutdown(supervisor_lost=msg is None)
            if msg is not None:
                control.send(ctl_out, (True, None))
            return 0
        try:
            reply: Any = (True, host.handle(msg))
        except Exception as e:  # typed errors travel back to the supervisor
            reply = (False, e)
        try:
            control.send(ctl_out, reply)
        except Exception as e:  # e.g. an exception that does not pickle
            control.send(ctl_out, (False, DDictError(f"{type(e).__name__}: {e}")))
