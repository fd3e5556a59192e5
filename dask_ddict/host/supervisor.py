"""HostSupervisor: starts a host process, restarts it when it dies, and speaks for it.

One supervisor lives in each worker's nanny (:class:`~dask_ddict.DDictNannyPlugin`),
or in the worker itself when it has no nanny.  It

* binds the host's listening sockets (a Unix socket in a private directory,
  and TCP on the worker's interface) and hands them to every incarnation of
  the host process, so that clients keep their addresses across a restart
  and wait in the backlog while it happens;
* starts the host process in a session of its own (the worker's sibling: a
  worker restart or a memory kill never touches it);
* remembers which managers it serves, and when the host process dies,
  starts a new one over the same shards (LMDB keeps every committed write);
* holds an owner lock on each shard (see :mod:`.hygiene`), so a shard stays
  claimed while its host process restarts;
* answers the orchestrator's control calls (``ddict_create_managers``,
  ``ddict_destroy_managers``, ``ddict_remove_paths``, ``ddict_host_info``, the
  ``ddict_move_*`` steps of a move, ``ddict_shard_bytes`` and ``ddict_probe``), which
  it installs
  as handlers of the nanny or worker.

Control calls block on the host's pipe, so the async handlers run them in a
thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import dask.config

from .. import config
from ..errors import DDictError, DDictManagerUnavailableError, error_to_wire
from ..layout import host_id
from ..options import DDictOptions
from . import control, hygiene
from .control import DictSpec
from .environ import host_environ
from .hygiene import shard_directory

logger = logging.getLogger(__name__)


class HostDiedError(DDictManagerUnavailableError):
    """The host process ended while answering a control message."""


async def off_loop(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``await asyncio.to_thread(fn, ...)``, also while the interpreter exits.

    Once a script's main thread has ended, Python shuts the thread pools down
    (``concurrent.futures``' exit hook runs before any ``atexit`` handler), and a
    cluster closed after that (Dask's own ``atexit`` handler closes the local clusters
    a script left open) would meet ``RuntimeError: cannot schedule new futures after
    shutdown`` in every control call of its nannies' plugins: a traceback per call,
    and managers that could neither move nor be parked.  Then ``fn`` runs in a thread
    of its own instead, which a closing interpreter still starts.
    """
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    try:
        pooled = loop.run_in_executor(None, call)
    except RuntimeError:  # (the pool is shut down: the interpreter exits)
        pass
    else:
        return await pooled
    done: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = call(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # (its loop closed meanwhile)
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="ddict-off-loop", daemon=True).start()
    return await done


class HostSupervisor:
    """Start, restart and control the host process of one worker.

    Parameters
    ----------
    tcp_host
        Interface for the host's TCP listener (the worker's host).
    security
        The cluster's ``distributed.Security`` (TLS certificates), or ``None``.
    label
        A name for logs (the nanny's or worker's address).
    tls
        Serve TCP over TLS, as the cluster's own comms do.
    scheduler
        The scheduler's address: the orchestrator that grants the host's lease (see
        :mod:`.lease`); ``""``: none the host process can reach (an in-process cluster).
    """

    def __init__(
        self,
        tcp_host: str,
        security: Any = None,
        label: str = "",
        tls: bool = False,
        scheduler: str = "",
    ) -> None:
        self.tcp_host = tcp_host
        self.security = security
        self.label = label
        self.tls = tls
        self.scheduler = scheduler
        self.proc: subprocess.Popen[bytes] | None = None
        self.socket_dir = ""
        self.uds_path = ""
        self.tcp_port = 0
        self._uds: socket.socket | None = None
        self._tcp: socket.socket | None = None
        self._dir_lock: int | None = None
        self._lock = threading.RLock()  # one control exchange at a time
        self._closing = False
        # What the host serves, to replay into a new incarnation.
        self._dicts: dict[str, tuple[DictSpec, dict[int, str], str]] = {}
        self._closed: list[str] = []
        #: Managers paused for a move out: their shard paths, until done or aborted.
        self._moving: dict[tuple[str, int], str] = {}
        self._moving_specs: dict[str, tuple[DictSpec, dict[int, str], str]] = {}
        self._shard_locks: dict[tuple[str, int], int] = {}
        #: The replicas kept by the host: the dictionary each belongs to (for a promotion),
        #: and its path.
        self._replicas: dict[tuple[str, int], tuple[DictSpec, str]] = {}
        #: Deposed primaries' shards that the host keeps aside (its notices say which).
        self._aside: dict[tuple[str, int], str] = {}
        self._restarts: collections.deque[float] = collections.deque()
        self.restart_count = 0
        self._watcher: threading.Thread | None = None
        #: Called (from the watching thread, never blocking) with why, when this
        #: supervisor gives its host up: the plugin tells the orchestrator.
        self.on_give_up: Callable[[str], None] | None = None
        #: Called (from the watching thread, never blocking) when a new incarnation of a
        #: host with replicas (kept, or of its managers) serves: they were lost with the
        #: old one, and the orchestrator makes them again.
        self.on_restart: Callable[[], None] | None = None

    def __repr__(self) -> str:
        pid = self.proc.pid if self.proc else None
        return f"<HostSupervisor {self.label!r} host_pid={pid} dicts={len(self._dicts)}>"

    # -- start and restart ----------------------------------------------------------

    def start(self) -> None:
        """Sweep what dead processes left, bind the listeners, start the host process.

        Kept shards whose orchestrator is gone are swept too, in a thread of their own:
        telling needs a question to each scheduler that kept one (see
        :func:`.hygiene.keeper_states`), which must not hold up a worker's start.
        """
        for base in {shard_directory(), self._socket_base()}:
            hygiene.sweep(base)
        threading.Thread(
            target=self._sweep_kept, args=(shard_directory(),), name="ddict-sweep-kept", daemon=True
        ).start()
        self.socket_dir = tempfile.mkdtemp(prefix=f"{hygiene.PREFIX}host-", dir=self._socket_base())
        self._dir_lock = hygiene.claim(self.socket_dir)
        self.uds_path = os.path.join(self.socket_dir, "host.sock")
        self._uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._uds.bind(self.uds_path)
        self._uds.listen(1024)
        family = socket.AF_INET6 if ":" in self.tcp_host else socket.AF_INET
        self._tcp = socket.socket(family, socket.SOCK_STREAM)
        self._tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._tcp.bind((self.tcp_host, 0))
        self._tcp.listen(1024)
        self.tcp_port = self._tcp.getsockname()[1]
        with self._lock:
            self._spawn()

    def _sweep_kept(self, base: str) -> None:
        try:
            hygiene.sweep_kept(base, self.security)
        except Exception as e:  # noqa: BLE001 - the next host's start tries again
            logger.info(
                "ddict: sweeping the kept shards of gone clusters under %s failed: %r", base, e
            )

    def _keep(self, path: str, why: str, uid: str, mid: int, spec: DictSpec | None) -> None:
        """Mark the shard at ``path`` kept (``why``: see :mod:`.hygiene`), recording the
        orchestrator that keeps it: this host's scheduler, while it keeps the shard."""
        name = spec.name if spec is not None else ""
        try:
            hygiene.mark_kept(path, record=hygiene.keeper(self.scheduler, why, name, uid, mid))
        except OSError as e:  # (gone meanwhile: nothing to keep)
            logger.info("ddict: marking %s kept failed: %r", path, e)

    def _spec(self, uid: str) -> DictSpec | None:
        entry = self._dicts.get(uid) or self._moving_specs.get(uid)
        return None if entry is None else entry[0]

    @staticmethod
    def _socket_base() -> str:
        return config.get("transport.socket-dir") or tempfile.gettempdir()

    def _spawn(self) -> None:
        """Start an incarnation and replay every dictionary into it (lock held)."""
        assert self._uds is not None and self._tcp is not None
        notices, told = os.pipe()  # (the host's own word to this supervisor: _noted)
        fds = (self._uds.fileno(), self._tcp.fileno(), told)
        changes = config.get("host.environ")  # (null: none)
        env = host_environ(os.environ, {} if changes is None else changes)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dask_ddict.host", *map(str, fds)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=fds,
                bufsize=0,
                start_new_session=True,
                env=env,
                cwd=self.socket_dir,
            )
        except BaseException:
            os.close(notices)
            raise
        finally:
            os.close(told)
        threading.Thread(
            target=self._noted, args=(notices,), name="ddict-host-notices", daemon=True
        ).start()
        self._send(
            control.Init(
                self.security,
                os.getpid(),
                self.socket_dir,
                self.tls,
                tuple(self._closed),
                dask.config.get("ddict"),
                self.restart_count,
                self.scheduler,
                self.label,
                tuple((u, m, p) for (u, m), p in self._aside.items()),
            )
        )
        self._recv(config.get_seconds("host.start-timeout"))
        for spec, paths, worker in list(self._dicts.values()):
            try:
                msg = control.OpenManagers(spec, tuple(paths), dict(paths), worker)
                infos = self._exchange(msg)
            except Exception as e:
                logger.error(
                    "ddict %s: re-opening managers %s failed: %r", spec.name, list(paths), e
                )
                continue
            for info in infos:
                if not info["restarted"]:
                    logger.error(
                        "ddict %s: manager %d came back empty (its shard was gone)",
                        spec.name,
                        info["manager_id"],
                    )
                paths[info["manager_id"]] = info["store_path"]
        self._exchange(control.Serve())
        if self._watcher is None or not self._watcher.is_alive():
            self._watcher = threading.Thread(
                target=self._watch, name="ddict-host-watch", daemon=True
            )
            self._watcher.start()

    def _watch(self) -> None:
        """Wait for the host process to end (no polling); restart it unless closing."""
        while True:
            proc = self.proc
            assert proc is not None
            code = proc.wait()
            with self._lock:
                if self._closing:
                    return
                if proc is not self.proc:  # already replaced
                    continue
                now = time.monotonic()
                window = config.get_seconds("host.restart-window") or 60.0
                while self._restarts and now - self._restarts[0] > window:
                    self._restarts.popleft()
                if len(self._restarts) >= int(config.get("host.max-restarts")):
                    logger.error(
                        "ddict host of %s died %d times in %.0f s; not restarting: "
                        "its managers are lost",
                        self.label,
                        len(self._restarts) + 1,
                        window,
                    )
                    self._close_listeners()  # clients are refused now, instead of waiting
                    if self.on_give_up is not None:
                        n = len(self._restarts) + 1
                        self.on_give_up(
                            f"its host process died too often ({n} time"
                            f"{'s' if n > 1 else ''} within {window:.0f} s) and its "
                            "supervisor gave up restarting it "
                            "(ddict.host.max-restarts)"
                        )
                    return
                self._restarts.append(now)
                self.restart_count += 1
                logger.warning(
                    "ddict host process of %s ended (code %s); restarting it over its shards",
                    self.label,
                    code,
                )
                replicated = bool(self._replicas) or any(
                    spec.options.replicas for spec, _, _ in self._dicts.values()
                )
                for _, path in self._replicas.values():  # (their registry died with it)
                    shutil.rmtree(path, ignore_errors=True)
                self._replicas.clear()
                try:
                    self._spawn()
                except Exception:
                    logger.exception("ddict: restarting the host process of %s failed", self.label)
                    if self.proc is not None and self.proc.poll() is None:
                        self.proc.kill()
                    continue
                if replicated and self.on_restart is not None:
                    self.on_restart()

    def _noted(self, fd: int) -> None:
        """Read an incarnation's notices until it ends (see ``process.Host``)."""
        with os.fdopen(fd, "rb") as f:
            while True:
                try:
                    notice = control.recv(f)
                except Exception:  # noqa: BLE001 - cut short: the host died meanwhile
                    return
                if notice is None:
                    return
                with self._lock:
                    self._note(notice)

    def _note(self, notice: Any) -> None:
        """What the host decided alone: this supervisor's books follow (lock held)."""
        key = (notice.uid, notice.manager_id)
        if isinstance(notice, control.Deposed):
            self._keep(
                notice.path, hygiene.ASIDE, notice.uid, notice.manager_id, self._spec(notice.uid)
            )
            entry = self._dicts.get(notice.uid)
            if entry is not None:
                entry[1].pop(notice.manager_id, None)
                if not entry[1]:
                    del self._dicts[notice.uid]
            hygiene.release(self._shard_locks.pop(key, None))
            self._aside[key] = notice.path
        elif isinstance(notice, control.Discarded):
            self._aside.pop(key, None)

    # -- the pipe -----------------------------------------------------------------

    def _send(self, msg: Any) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            control.send(self.proc.stdin, msg)  # type: ignore[arg-type]
        except (BrokenPipeError, OSError) as e:
            raise HostDiedError(f"the host process of {self.label} is gone ({e})") from None

    def _recv(self, timeout: float | None) -> Any:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout

        def read(n: int) -> bytes:
            buf = bytearray()
            while len(buf) < n:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not select.select([fd], [], [], wait)[0]:
                    raise DDictError(
                        f"the host process of {self.label} did not answer within {timeout} s",
                        "TIMEOUT",
                    )
                chunk = os.read(fd, n - len(buf))
                if not chunk:
                    raise HostDiedError(f"the host process of {self.label} ended")
                buf += chunk
            return bytes(buf)

        ok, value = control.read_message(read)  # read() raises at EOF: never None here
        if not ok:
            raise value
        return value

    def _exchange(self, msg: Any) -> Any:
        self._send(msg)
        return self._recv(config.get_seconds("host.start-timeout"))

    def call(self, msg: Any) -> Any:
        """Send one control message and return the host's answer (thread-safe)."""
        with self._lock:
            if self._closing:
                raise DDictError(f"the host of {self.label} is closing", "CLOSED")
            return self._exchange(msg)

    # -- control calls (the orchestrator's handlers) ------------------------------

    def info(self) -> dict[str, Any]:
        """How to reach this host, and what it is."""
        try:
            import psutil

            memory = int(psutil.virtual_memory().total)
        except Exception:
            memory = 0
        return {
            "supervisor_pid": os.getpid(),
            "host_pid": self.proc.pid if self.proc else 0,
            "host_id": host_id(),
            "hostname": socket.gethostname(),
            "uds_path": self.uds_path,
            "tcp_host": self.tcp_host,
            "tcp_port": self.tcp_port,
            "memory": memory,
            "restarts": self.restart_count,
        }

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
        spec = DictSpec(
            name,
            uid,
            secret,
            DDictOptions.from_dict(options),
            int(capacity),
            int(num_managers),
            storage_options,
        )
        paths = {int(k): v for k, v in (restart_paths or {}).items()}
        with self._lock:
            infos = self.call(
                control.OpenManagers(spec, tuple(int(m) for m in manager_ids), paths, worker)
            )
            known = self._dicts.setdefault(uid, (spec, {}, worker))[1]
            for info in infos:
                known[info["manager_id"]] = info["store_path"]
                self._shard_locks[(uid, info["manager_id"])] = hygiene.claim(info["store_path"])
            if uid in self._closed:
                self._closed.remove(uid)
        return self._described(infos, worker)

    def _described(self, infos: list[dict[str, Any]], worker: str) -> list[dict[str, Any]]:
        """The host's answer for managers it opened, with how to reach them (layout fields)."""
        where = self.info()
        memory = self.memory()  # measured after the shards opened (and were reserved)
        return [
            {
                **i,
                **memory,
                "worker": worker,
                "pid": where["supervisor_pid"],
                "uds_path": self.uds_path,
                "tcp_host": self.tcp_host,
                "tcp_port": self.tcp_port,
                "host_id": where["host_id"],
                "hostname": where["hostname"],
            }
            for i in infos
        ]

    # -- moves (see dask_ddict.host.moves) -------------------------------------------

    def move_out(self, uid: str, manager_id: int, copy: bool) -> dict[str, Any]:
        """Pause a manager that leaves this host.  It is no longer replayed into a new
        incarnation from now on (the new host may serve its shard already)."""
        mid = int(manager_id)
        with self._lock:
            entry = self._dicts.get(uid)
            if entry is None or mid not in entry[1]:
                raise DDictError(f"manager {mid} of {uid} is not hosted here", "INVALID_ARGUMENT")
            reply = self.call(control.MoveOut(uid, mid, bool(copy)))
            self._moving[(uid, mid)] = entry[1].pop(mid)
            if not entry[1]:
                del self._dicts[uid]
                self._moving_specs[uid] = entry
        return {**reply, "storage_options": entry[0].storage_options}

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
        spec = DictSpec(
            name,
            uid,
            secret,
            DDictOptions.from_dict(options),
            int(capacity),
            int(num_managers),
            storage_options,
        )
        mid = int(manager_id)
        with self._lock:
            infos = self.call(
                control.MoveIn(spec, mid, worker, path, source, int(used), int(map_size), int(term))
            )
            known = self._dicts.setdefault(uid, (spec, {}, worker))[1]
            for info in infos:
                known[mid] = info["store_path"]
                self._shard_locks[(uid, mid)] = hygiene.claim(info["store_path"])
            if uid in self._closed:
                self._closed.remove(uid)
        return self._described(infos, worker)

    def move_prepare(self, name: str, manager_id: int, capacity: int, nbytes: int) -> str:
        """Make the file of a manager's copy ready before its move pauses it (its path)."""
        with self._lock:
            return str(
                self.call(control.MovePrepare(name, int(manager_id), int(capacity), int(nbytes)))
            )

    def move_done(self, uid: str, manager_id: int, where: str, park: bool = False) -> None:
        """The manager serves at ``where`` now (``park``: nowhere, its shard kept here):
        this host stops serving it."""
        mid = int(manager_id)
        with self._lock:
            path = self._moving.pop((uid, mid), None)
            spec = self._spec(uid)
            self._moving_specs.pop(uid, None)
            if park and path:  # (before its owner lock goes: no sweep takes it)
                self._keep(path, hygiene.PARKED, uid, mid, spec)
            hygiene.release(self._shard_locks.pop((uid, mid), None))
            try:
                self.call(control.MoveDone(uid, mid, where, bool(park)))
            except HostDiedError:  # (its next incarnation does not serve it)
                logger.info("ddict: the host of %s ended during a move", self.label)

    def move_abort(self, uid: str, manager_id: int) -> None:
        """The move failed: the manager serves on here (re-opened if the host restarted)."""
        mid = int(manager_id)
        with self._lock:
            path = self._moving.pop((uid, mid), None)
            if path is None:
                return
            entry = self._dicts.get(uid) or self._moving_specs.pop(uid, None)
            if entry is None:
                return
            self._dicts.setdefault(uid, entry)[1][mid] = path
            try:
                self.call(control.MoveAbort(uid, mid))
            except DDictError:  # a new incarnation, which did not open it: open it now
                spec, _, worker = entry
                self.call(control.OpenManagers(spec, (mid,), {mid: path}, worker))

    # -- replicas (see dask_ddict.host.replicas) -----------------------------------------

    def replica_hold(self, uid: str, manager_id: int) -> dict[str, Any]:
        """Pause a manager here while a new replica copies its shard (what that needs)."""
        with self._lock:
            entry = self._dicts.get(uid)
            if entry is None:
                raise DDictError(f"no manager of {uid} is hosted here", "INVALID_ARGUMENT")
            reply = self.call(control.ReplicaHold(uid, int(manager_id)))
        return {**reply, "spec": entry[0].to_wire()}

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
        with self._lock:
            path = self.call(control.ReplicaSeed(dspec, mid, source, int(used), int(map_size)))
            self._replicas[(dspec.uid, mid)] = (dspec, path)
            if dspec.uid in self._closed:
                self._closed.remove(dspec.uid)
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
        with self._lock:
            entry = self._dicts.get(uid)
            if entry is None:
                raise DDictError(f"no manager of {uid} is hosted here", "INVALID_ARGUMENT")
            return list(
                self.call(
                    control.ReplicaTargets(
                        entry[0], int(manager_id), add, tuple(remove or ()), bool(release)
                    )
                )
            )

    def replica_drop(self, uid: str, manager_id: int) -> bool:  # (stop keeping one here)
        with self._lock:
            self._replicas.pop((uid, int(manager_id)), None)
            return bool(self.call(control.ReplicaDrop(uid, int(manager_id))))

    def replica_promote(
        self, uid: str, manager_id: int, worker: str = "", old_path: str = "", term: int = 0
    ) -> list[dict[str, Any]]:
        """Serve a manager whose primary is lost over the replica kept here, under ``term``
        (once the orchestrator confirms it: see :mod:`.lease`)."""
        mid = int(manager_id)
        with self._lock:
            kept = self._replicas.pop((uid, mid), None)
            served = self._dicts.get(uid)
            if kept is None and served is not None and mid in served[1]:
                # (promoted by a call whose answer the orchestrator did not get: the same)
                return self._described(
                    [{"manager_id": mid, "store_path": served[1][mid], "restarted": True}], worker
                )
            if kept is None:
                raise DDictError(
                    f"no replica of manager {mid} of {uid} is kept here", "MANAGER_UNAVAILABLE"
                )
            spec = kept[0]
            infos = self.call(control.ReplicaPromote(spec, mid, worker, old_path, int(term)))
            self._dicts.setdefault(uid, (spec, {}, worker))[1][mid] = infos[0]["store_path"]
            self._shard_locks[(uid, mid)] = hygiene.claim(infos[0]["store_path"])
        return self._described(infos, worker)

    @staticmethod
    def probe(directory: str, token: str, step: str) -> bool:
        """Whether this machine sees what another wrote in ``directory`` (a persist path):
        ``step`` "leave" writes a probe file named by ``token``, "find" says whether it is
        there, "clear" removes it."""
        path = os.path.join(directory, f".ddict-probe-{token}")
        if step == "leave":
            os.makedirs(directory, exist_ok=True)
            with open(path, "w"):
                pass
            return True
        if step == "clear":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return True
        return os.path.exists(path)

    def shard_bytes(self, uid: str) -> dict[int, int]:
        """The used bytes of each of ``uid``'s managers here (rebalance moves the fewest)."""
        with self._lock:
            return dict(self.call(control.ShardBytes(uid))) if uid in self._dicts else {}

    def memory(self) -> dict[str, int]:
        """This host's memory as the orchestrator's sizing check needs it, measured now.

        ``memory`` and ``available`` are the host's (``psutil``), ``shard_dir_free`` the
        free bytes of the shard directory (``/dev/shm``: its tmpfs size, not the RAM),
        ``shard_bytes`` the size of every shard this supervisor serves and ``unbacked``
        the part of it that holds no memory yet: nothing when shards are reserved at
        creation (``ddict.store.reserve``), else what their writes will still take.
        Measured rather than computed, so that the check sees what really is there.
        """
        import psutil

        vm = psutil.virtual_memory()
        st = os.statvfs(shard_directory())
        shards = unbacked = 0
        with self._lock:
            known = [
                (spec.capacity, path)
                for spec, paths, _ in self._dicts.values()
                for path in paths.values()
            ]
        for capacity, path in known:
            try:
                allocated = os.stat(os.path.join(path, "data.mdb")).st_blocks * 512
            except OSError:  # removed meanwhile
                continue
            shards += capacity
            unbacked += max(0, capacity - allocated)
        return {
            "memory": int(vm.total),
            "available": int(vm.available),
            "shard_dir_free": st.f_bavail * st.f_frsize,
            "shard_bytes": shards,
            "unbacked": unbacked,
        }

    def destroy_managers(self, uid: str, allow_restart: bool = False) -> int:
        with self._lock:
            entry = self._dicts.pop(uid, None)
            self._moving_specs.pop(uid, None)  # (a move under way is not resumed here)
            for key in [k for k in self._aside if k[0] == uid]:  # (the host deletes them)
                del self._aside[key]
            for key in [k for k in self._replicas if k[0] == uid]:
                del self._replicas[key]
            for key in [k for k in self._moving if k[0] == uid]:
                del self._moving[key]
            if uid not in self._closed:
                self._closed.append(uid)
                del self._closed[:-1024]  # a bounded memory of destroyed dictionaries
            try:
                closed = int(self.call(control.CloseManagers(uid, allow_restart)))
            except HostDiedError:
                # The next incarnation will not serve it: its shards go now, or are kept.
                spec, paths = (entry[0], entry[1]) if entry is not None else (None, {})
                for mid, path in paths.items():
                    if allow_restart:
                        self._keep(path, hygiene.RESTART, uid, mid, spec)
                    else:
                        shutil.rmtree(path, ignore_errors=True)
                raise
            else:
                if allow_restart and entry is not None:  # (the host marked them: say whose,
                    for mid, path in entry[1].items():  # before the owner locks go)
                        self._keep(path, hygiene.RESTART, uid, mid, entry[0])
                return closed
            finally:
                for key in [k for k in self._shard_locks if k[0] == uid]:
                    hygiene.release(self._shard_locks.pop(key))

    @staticmethod
    def remove_paths(paths: list[str], kept: bool = False) -> int:
        """Delete shard and socket directories whose owners are provably dead (``kept``:
        also shards kept for a restart or parked, which nothing will re-attach now)."""
        return hygiene.remove(paths, kept)

    @property
    def serving(self) -> bool:
        """Whether this host serves managers of any dictionary (that its going would lose)."""
        return bool(self._dicts or self._moving)

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
            "ddict_host_info": wrap(self.info),
            "ddict_move_out": wrap(self.move_out),
            "ddict_move_prepare": wrap(self.move_prepare),
            "ddict_move_in": wrap(self.move_in),
            "ddict_move_done": wrap(self.move_done),
            "ddict_move_abort": wrap(self.move_abort),
            "ddict_shard_bytes": wrap(self.shard_bytes),
            "ddict_probe": wrap(self.probe),
            **{
                f"ddict_replica_{n}": wrap(getattr(self, f"replica_{n}"))
                for n in ("hold", "seed", "targets", "drop", "promote")
            },
        }

    # -- shutdown -------------------------------------------------------------------

    def _close_listeners(self) -> None:
        for sock in (self._uds, self._tcp):
            if sock is not None:
                sock.close()
        self._uds = self._tcp = None

    def close(self, timeout: float = 10.0) -> None:
        """Stop the host process (deleting its shards, keeping kept ones) and the listeners."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            proc = self.proc
            if proc is not None and proc.poll() is None:
                try:
                    self._send(control.Shutdown())
                    self._recv(timeout)
                except Exception as e:
                    logger.info("ddict: host of %s did not shut down cleanly: %r", self.label, e)
        if proc is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for f in (proc.stdin, proc.stdout):
                if f is not None:
                    f.close()
        self._close_listeners()
        for fd in self._shard_locks.values():
            hygiene.release(fd)
        self._shard_locks.clear()
        hygiene.release(self._dir_lock)
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
