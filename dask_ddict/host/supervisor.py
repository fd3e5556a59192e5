"""HostSupervisor: starts a host process, watches it, and restarts it when it dies.

One supervisor lives in each worker's nanny (:class:`~dask_ddict.DDictNannyPlugin`),
or in the worker itself when it has no nanny.  It

* binds the host's listening sockets (a Unix socket in a private directory,
  and TCP on the worker's interface) and hands them to every incarnation of
  the host process, so that clients keep their addresses across a restart
  and wait in the backlog while it happens;
* starts the host process in a session of its own (the worker's sibling: a
  worker restart or a memory kill never touches it);
* when the host process dies, starts a new one over the same shards (LMDB keeps
  every committed write) and hands it every dictionary of its registry
  (:class:`~.registry.HostRegistry`), unless it died too often
  (:class:`RestartPolicy`): then it gives the host up and says so;
* reads the host's notices (what it decided alone) into the registry.

It speaks to each incarnation over its control pipe (:class:`~.pipe.HostPipe`), one
exchange at a time (:meth:`HostSupervisor.call`); the orchestrator's control calls
that it answers for its host are :mod:`.control_calls`.
"""

from __future__ import annotations

import collections
import logging
import os
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
from ..errors import DDictError
from . import control, hygiene, machine
from .environ import host_environ
from .hygiene import shard_directory
from .pipe import HostPipe
from .registry import HostRegistry

logger = logging.getLogger(__name__)


class RestartPolicy:
    """How often a host process may die and be restarted: at most ``most`` restarts
    within any ``window`` seconds (``ddict.host.max-restarts``,
    ``ddict.host.restart-window``, read at each death); one more death gives it up.

    A host that dies again and again (a shard that crashes it as it opens, a machine
    out of memory) would otherwise be restarted forever, and its clients would wait
    for it forever; given up, its managers are lost, and said so.  So is one whose
    incarnations fail to start ``most`` times in a row however slowly (each killed as
    its replay does not answer within ``ddict.host.start-timeout``, which may be as long
    as the window): :attr:`failed_starts`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._times: collections.deque[float] = collections.deque()
        self.count = 0  # restarts since the supervisor started
        #: Incarnations in a row that did not start (reset by one that serves).
        self.failed_starts = 0

    def __repr__(self) -> str:
        return f"<RestartPolicy restarts={self.count} recent={len(self._times)}>"

    def restart(self, most: int, window: float) -> bool:
        """Whether a host that died now is restarted (counted if so)."""
        now = self._clock()
        while self._times and now - self._times[0] > window:
            self._times.popleft()
        if len(self._times) >= most or self.failed_starts >= most:
            return False
        self._times.append(now)
        self.count += 1
        return True

    def started(self, ok: bool) -> None:
        """An incarnation started and serves (``ok``), or failed to start."""
        self.failed_starts = 0 if ok else self.failed_starts + 1

    @property
    def deaths(self) -> int:
        """The deaths within the window, this one included (when it gives up)."""
        return len(self._times) + 1

    def why(self, most: int, window: float) -> str:
        """Why :meth:`restart` said no (for the log and the orchestrator)."""
        if self.failed_starts >= most and len(self._times) < most:
            return f"failed to start {self.failed_starts} times in a row"
        n = self.deaths
        return f"died too often ({n} time{'s' if n > 1 else ''} within {window:.0f} s)"


class HostSupervisor:
    """Start, restart and speak to the host process of one worker.

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
        self.pipe: HostPipe | None = None
        self.socket_dir = ""
        self.uds_path = ""
        self.tcp_port = 0
        self._uds: socket.socket | None = None
        self._tcp: socket.socket | None = None
        self._dir_lock: int | None = None
        #: One control exchange at a time, and the registry changed with it.
        self.lock = threading.RLock()
        self._closing = False
        #: What the host serves, to replay into a new incarnation.
        self.registry = HostRegistry(scheduler)
        self.restarts = RestartPolicy()
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
        return f"<HostSupervisor {self.label!r} host_pid={pid} dicts={len(self.registry.dicts)}>"

    @property
    def restart_count(self) -> int:
        """How many times the host process was restarted."""
        return self.restarts.count

    @property
    def serving(self) -> bool:
        """Whether this host serves managers of any dictionary (that its going would lose)."""
        return self.registry.serving

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
        with self.lock:
            self._spawn()

    def _sweep_kept(self, base: str) -> None:
        try:
            hygiene.sweep_kept(base, self.security)
        except Exception as e:  # noqa: BLE001 - the next host's start tries again
            logger.info(
                "ddict: sweeping the kept shards of gone clusters under %s failed: %r", base, e
            )

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
        pipe = self.pipe = HostPipe(self.proc, self.label)
        threading.Thread(
            target=self._noted, args=(notices,), name="ddict-host-notices", daemon=True
        ).start()
        pipe.send(
            control.Init(
                self.security,
                os.getpid(),
                self.socket_dir,
                self.tls,
                config=dask.config.get("ddict"),
                restarts=self.restart_count,
                scheduler=self.scheduler,
                supervisor=self.label,
                **self.registry.init_fields(),
            )
        )
        pipe.recv(config.get_seconds("host.start-timeout"))
        self._replay(pipe)
        pipe.exchange(control.Serve())
        if self._watcher is None or not self._watcher.is_alive():
            self._watcher = threading.Thread(
                target=self._watch, name="ddict-host-watch", daemon=True
            )
            self._watcher.start()

    def _replay(self, pipe: HostPipe) -> None:
        """Hand a new incarnation every dictionary of the registry, over its shards."""
        for served in self.registry.replay():
            spec, paths = served.spec, served.paths
            if pipe.out_of_step:  # (killed: it did not answer; the next one replays all)
                return
            try:
                # (each under the term in its shard: a promoted manager's is not 0)
                msg = control.OpenManagers(spec, tuple(paths), dict(paths), served.worker, None)
                infos = pipe.exchange(msg)
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

    def _watch(self) -> None:
        """Wait for the host process to end (no polling); restart it unless closing."""
        while True:
            proc = self.proc
            assert proc is not None
            code = proc.wait()
            with self.lock:
                if self._closing:
                    return
                if proc is not self.proc:  # already replaced
                    continue
                window = config.get_seconds("host.restart-window") or 60.0
                most = int(config.get("host.max-restarts"))
                if not self.restarts.restart(most, window):
                    self._give_up(self.restarts.why(most, window))
                    return
                logger.warning(
                    "ddict host process of %s ended (code %s); restarting it over its shards",
                    self.label,
                    code,
                )
                replicated = self.registry.replicated
                self.registry.drop_replicas()  # (they died with it)
                try:
                    self._spawn()
                except Exception:
                    logger.exception("ddict: restarting the host process of %s failed", self.label)
                    self.restarts.started(False)
                    if self.proc is not None and self.proc.poll() is None:
                        self.proc.kill()
                    continue
                self.restarts.started(True)
                if replicated and self.on_restart is not None:
                    self.on_restart()

    def _give_up(self, why: str) -> None:
        """The host died too often, or failed to start too many times in a row (``why``):
        not restarted."""
        logger.error("ddict host of %s %s; not restarting: its managers are lost", self.label, why)
        self._close_listeners()  # clients are refused now, instead of waiting
        if self.on_give_up is not None:
            self.on_give_up(
                f"its host process {why} and its supervisor gave up restarting it "
                "(ddict.host.max-restarts)"
            )

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
                with self.lock:
                    self.registry.note(notice)

    # -- speaking to the host -------------------------------------------------------

    def call(self, msg: Any) -> Any:
        """Send one control message and return the host's answer (thread-safe; hold
        :attr:`lock` around it to change the registry with what it answers)."""
        with self.lock:
            if self._closing or self.pipe is None:
                raise DDictError(f"the host of {self.label} is closing", "CLOSED")
            return self.pipe.exchange(msg)

    def info(self) -> dict[str, Any]:
        """How to reach this host, and what it is."""
        return {
            "supervisor_pid": os.getpid(),
            "host_pid": self.proc.pid if self.proc else 0,
            **machine.identity(),
            "uds_path": self.uds_path,
            "tcp_host": self.tcp_host,
            "tcp_port": self.tcp_port,
            "restarts": self.restart_count,
        }

    # -- shutdown -------------------------------------------------------------------

    def _close_listeners(self) -> None:
        for sock in (self._uds, self._tcp):
            if sock is not None:
                sock.close()
        self._uds = self._tcp = None

    def close(self, timeout: float = 10.0) -> None:
        """Stop the host process (deleting its shards, keeping kept ones) and the listeners."""
        with self.lock:
            if self._closing:
                return
            self._closing = True
            proc, pipe = self.proc, self.pipe
            if proc is not None and pipe is not None and proc.poll() is None:
                try:
                    pipe.send(control.Shutdown())
                    pipe.recv(2 * timeout)  # (then killed: its wait below is the kill's)
                except Exception as e:
                    logger.info("ddict: host of %s did not shut down cleanly: %r", self.label, e)
        if proc is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if pipe is not None:
                pipe.close()
        self._close_listeners()
        self.registry.release_all()
        hygiene.release(self._dir_lock)
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
