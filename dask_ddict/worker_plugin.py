"""DDictWorkerPlugin: hosts managers inside a Dask worker process.

The orchestrator installs this plugin on every worker.  On request it creates
managers (a shard in ``/dev/shm`` plus a socket server each), registers them in
:data:`LOCAL_MANAGERS` so that tasks in this process reach them by a direct
call, and tears them down on destroy or when the worker closes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import shutil
import socket
from typing import TYPE_CHECKING, Any

from distributed.comm import get_address_host
from distributed.diagnostics.plugin import WorkerPlugin

from . import config
from .errors import error_to_wire
from .layout import host_id
from .manager import Manager
from .options import DDictOptions
from .persistence import CheckpointStore, Persister
from .replication import pull_shard
from .store import ShardStore
from .transport import ManagerServer
from .transport.shared import forget
from .working_set import WorkingSet

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger(__name__)

#: Managers living in this process, by ``(dict uid, manager id)``.  Client
#: handles in this process look here first (the in-process path).
LOCAL_MANAGERS: dict[tuple[str, int], Manager] = {}


class _Hosted:
    """A manager and its server, as one worker hosts them."""

    __slots__ = ("uid", "manager", "server")

    def __init__(self, uid: str, manager: Manager, server: ManagerServer) -> None:
        self.uid = uid
        self.manager = manager
        self.server = server

    def close(self, destroy: bool = True) -> None:
        LOCAL_MANAGERS.pop((self.uid, self.manager.manager_id), None)
        self.server.close()
        self.manager.close(destroy=destroy)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]


def _open_manager(name: str, mid: int, num_managers: int, opts: DDictOptions, capacity: int,
                  worker: str, restart_path: str | None) -> tuple[Manager, bool]:  # fmt: skip
    """A manager over a new shard, or over the kept shard at ``restart_path``.

    Returns the manager and whether it re-attached a kept shard.
    """
    reattach = bool(restart_path) and os.path.isfile(os.path.join(restart_path, "data.mdb"))
    if reattach:
        forget(restart_path)  # this process may still map it read-only (a stale handle)
        path = restart_path
    else:
        path = os.path.join(
            config.get("store.directory") or "/dev/shm",
            f"ddict-{_safe(name)}-{mid}-{secrets.token_hex(8)}",
        )
    store = ShardStore(path, capacity, opts.manager_pool_full_thresh,
                       indexed=opts.wait_for_keys)  # fmt: skip
    try:
        ws = WorkingSet(store, opts.working_set_size, wait_for_keys=opts.wait_for_keys,
                        wait_for_writers=opts.wait_for_writers)  # fmt: skip
        if reattach:
            # A shard whose window never moved has no saved state: it is at the start.
            state = WorkingSet.saved_state(store)
            if state is not None:
                mismatch = [k for k in ("size", "wait_for_keys", "wait_for_writers")
                            if state[k] != getattr(ws, k)]  # fmt: skip
                if mismatch:
                    raise ValueError(
                        f"restart of {name!r}: manager {mid} was created with a different "
                        f"{', '.join(mismatch)} (working_set_size/wait_for_keys/"
                        "wait_for_writers must match the original)"
                    )
                ws.load(state)
            with store.write() as txn:  # clears the closed mark the last manager left
                ws.save(txn)
        persister = None
        if opts.persist_path:
            persister = Persister(
                CheckpointStore(opts.persist_path, name, mid, num_managers,
                                chunk_bytes=config.get_bytes("persist.chunk-bytes"),
                                fsync=bool(config.get("persist.fsync"))),
                opts.persist_freq, opts.persist_count,
            )  # fmt: skip
        manager = Manager(mid, store, ws, worker=worker, read_only=opts.read_only,
                          persister=persister, pull_shard=pull_shard)  # fmt: skip
    except BaseException:
        if reattach:
            store.close()
        else:
            store.destroy()
        raise
    if opts.restore_from is not None and not reattach:
        try:
            manager.restore(opts.restore_from, discard_newer=not opts.read_only)
        except BaseException:
            manager.close()
            raise
    return manager, reattach


class DDictWorkerPlugin(WorkerPlugin):
    """Worker side of ``dask_ddict``: creates, serves and removes managers."""

    name = "ddict"
    idempotent = True

    worker: Worker
    hosted: dict[tuple[str, int], _Hosted]

    def __init__(self) -> None:
        self.hosted = {}

    def __repr__(self) -> str:
        return f"<DDictWorkerPlugin managers={sorted(self.hosted)}>"

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        worker.handlers["ddict_create_managers"] = self.create_managers
        worker.handlers["ddict_destroy_managers"] = self.destroy_managers
        worker.handlers["ddict_remove_paths"] = self.remove_paths

    def teardown(self, worker: Worker) -> None:
        for key in list(self.hosted):
            self.hosted.pop(key).close()

    # -- Handlers (called through Dask comms by the orchestrator) ------------------

    async def create_managers(
        self,
        name: str,
        uid: str,
        secret: str,
        tls: bool,
        options: dict[str, Any],
        capacity: int,
        manager_ids: list[int],
        num_managers: int = 0,
        restart_paths: dict[int, str] | None = None,
    ) -> list[dict[str, Any]] | dict[str, Any]:
        """Create managers ``manager_ids`` of dictionary ``uid``; return their infos.

        ``restart_paths`` maps manager ids to shards kept by
        ``destroy(allow_restart=True)``: those are re-attached (an info says
        ``"restarted": False`` when the shard is gone and the manager starts
        empty).  Opening zarr stores and restoring checkpoints is I/O, so the
        work runs in a thread, off the worker's event loop.
        """
        ssl_context = None
        if tls:
            ssl_context = self.worker.security.get_listen_args("worker")["ssl_context"]
            if ssl_context is None:
                raise RuntimeError("the cluster requires TLS but this worker has no certificate")
        try:
            return await asyncio.to_thread(
                self._create, name, uid, secret, ssl_context, DDictOptions.from_dict(options),
                capacity, manager_ids, num_managers or len(manager_ids), restart_paths or {},
            )  # fmt: skip
        except Exception as e:
            wire = error_to_wire(e)
            if wire is None:
                raise
            return wire  # type: ignore[return-value]

    def _create(self, name: str, uid: str, secret: str, ssl_context: Any, opts: DDictOptions,
                capacity: int, manager_ids: list[int], num_managers: int,
                restart_paths: dict[int, str]) -> list[dict[str, Any]]:  # fmt: skip
        try:
            tcp_host = get_address_host(self.worker.address)
            socket.getaddrinfo(tcp_host, None)
        except Exception:
            tcp_host = "127.0.0.1"
        infos = []
        created: list[_Hosted] = []
        try:
            for mid in manager_ids:
                manager, restarted = _open_manager(
                    name, mid, num_managers, opts, capacity, self.worker.address,
                    restart_paths.get(int(mid)),
                )  # fmt: skip
                try:
                    server = ManagerServer(
                        manager,
                        secret,
                        tcp_host,
                        ssl_context=ssl_context,
                        socket_dir=config.get("transport.socket-dir"),
                        page_bytes=config.get_bytes("iteration.page-bytes"),
                        scratch_keep=config.get_bytes("store.scratch-bytes"),
                    )
                except BaseException:
                    manager.close(destroy=not restarted)
                    raise
                hosted = _Hosted(uid, manager, server)
                created.append(hosted)
                self.hosted[(uid, mid)] = hosted
                LOCAL_MANAGERS[(uid, mid)] = manager
                infos.append(
                    {
                        "manager_id": mid,
                        "worker": self.worker.address,
                        "hostname": socket.gethostname(),
                        "host_id": host_id(),
                        "pid": os.getpid(),
                        "uds_path": server.uds_path,
                        "tcp_host": server.tcp_host,
                        "tcp_port": server.tcp_port,
                        "store_path": manager.store.path,
                        "restarted": restarted,
                    }
                )
        except BaseException:
            for h in created:
                self.hosted.pop((uid, h.manager.manager_id), None)
                h.close(destroy=not restart_paths)
            raise
        logger.info("ddict %s: hosting managers %s on %s", name, manager_ids, self.worker.address)
        return infos

    def remove_paths(self, paths: list[str]) -> int:
        """Delete shard and socket directories that a dead process left on this host."""
        n = 0
        for p in paths:
            name = os.path.basename(p.rstrip("/"))
            if not name.startswith("ddict-"):  # only ever our own directories
                continue
            if os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
                n += 1
        return n

    def destroy_managers(self, uid: str, allow_restart: bool = False) -> int:
        """Remove every manager of dictionary ``uid`` hosted here."""
        n = 0
        for key in [k for k in self.hosted if k[0] == uid]:
            self.hosted.pop(key).close(destroy=not allow_restart)
            n += 1
        return n
