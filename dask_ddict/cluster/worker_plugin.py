"""The Dask side of hosting: thin plugins that own a :class:`HostSupervisor`.

Managers live in a host process next to each worker, never in the worker
(see :mod:`dask_ddict.host`).  Who supervises that process depends on the
worker:

* under a nanny (the default of ``LocalCluster`` and ``dask worker``), the
  :class:`DDictNannyPlugin` does.  The nanny outlives worker restarts, so the
  host process, its managers and their clients never notice one;
* without a nanny (``processes=False``, ``dask worker --no-nanny``), the
  :class:`DDictWorkerPlugin` does, and the managers end with the worker.

Either way the supervisor's control calls (:class:`~dask_ddict.host.control_calls.ControlCalls`)
are installed as handlers on that server, and the orchestrator addresses them there
(``WorkerState.nanny`` or the worker).

Every worker process also tells the orchestrator what its ``hash()`` of a probe
string is (:func:`~dask_ddict._hashing.probe_hash`), once when the plugin starts
in it: tasks run there and place keys by a user ``__hash__``, so clients compare
their own against it.  Only the worker process can say: a nanny's own seed is not
its worker's (a ``LocalCluster``'s nannies run in the client's process).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from distributed.comm import get_address_host
from distributed.diagnostics.plugin import NannyPlugin, WorkerPlugin

from .. import config
from .._hashing import probe_hash
from ..host.control_calls import ControlCalls
from ..host.off_loop import off_loop
from ..host.supervisor import HostSupervisor

if TYPE_CHECKING:
    from distributed import Nanny, Worker

logger = logging.getLogger(__name__)


def _tcp_host(address: str) -> str:
    """The interface of a server's address, or loopback for in-process transports."""
    try:
        host = get_address_host(address)
        socket.getaddrinfo(host, None)
        return host
    except Exception:
        return "127.0.0.1"


def _lease_giver(server: Any) -> str:
    """Where the host process renews its lease: the scheduler, if it can reach it (TCP or
    TLS; an in-process scheduler it cannot, and nothing is cut off in one process)."""
    address = str(getattr(server.scheduler, "address", "") or "")
    return address if address.startswith(("tcp://", "tls://")) else ""


async def _gone(**kwargs: Any) -> None:
    """What a closed supervisor answers: nothing (the orchestrator reads "host gone")."""
    return None


async def report_hash_probe(worker: Worker) -> None:
    """Tell the orchestrator this worker process's :func:`probe_hash` (once per process).

    ``PYTHONHASHSEED`` from the environment goes along as a hint for the warning's
    remedy only; the check compares the probes.  A scheduler without the orchestrator
    (the plugin set up by hand) has nothing to tell: that is not an error.
    """
    try:
        seed = os.environ.get("PYTHONHASHSEED", "")
        await worker.scheduler.ddict_hash_probe(
            worker=worker.address, probe=probe_hash(), seed=seed
        )
    except Exception as e:  # noqa: BLE001 - a missing handler, a scheduler going away
        logger.info("ddict: could not report this worker's hash probe: %r", e)


async def tell_host_gone(server: Any, why: str, closing: bool = True, ended: bool = False) -> None:
    """Tell the orchestrator that this server's host goes away, ``why`` (see
    :meth:`~dask_ddict.cluster.scheduler_plugin.DDictSchedulerPlugin.host_gone`).

    Waits at most ``ddict.host.probe-timeout``: a scheduler that is closing, or
    gone, must not hold up the close of a nanny (nor is it an error).
    """
    try:
        await asyncio.wait_for(
            server.scheduler.ddict_host_gone(
                supervisor=server.address, why=why, closing=closing, ended=ended
            ),
            config.get_seconds("host.probe-timeout"),
        )
    except Exception as e:  # noqa: BLE001 - a scheduler going away, a missing handler
        logger.info("ddict: could not tell the scheduler that this host goes (%s): %r", why, e)


async def evacuate(server: Any, why: str) -> None:
    """Ask the orchestrator to move this host's managers to the remaining workers, and
    wait until it did (at most ``ddict.move.timeout``): the host process, and with it
    any shard still here, ends right after.  A scheduler that closes moves nothing."""
    try:
        said = await asyncio.wait_for(
            server.scheduler.ddict_evacuate(supervisor=server.address, why=why, closing=True),
            config.get_seconds("move.timeout"),
        )
    except Exception as e:  # noqa: BLE001 - a scheduler going away, a missing handler
        logger.info("ddict: could not move this host's managers away (%s): %r", why, e)
        return
    if isinstance(said, dict) and said.get("moved"):
        logger.info(
            "ddict: %d managers moved off this host before it closes (%s)", said["moved"], why
        )


def _restarted(server: Any, loop: asyncio.AbstractEventLoop) -> None:
    """The supervisor restarted a host with replicas (from its watching thread): tell the
    orchestrator, which makes them again."""

    async def tell() -> None:
        try:
            await server.scheduler.ddict_host_restarted(supervisor=server.address)
        except Exception as e:  # noqa: BLE001 - a scheduler going away
            logger.warning(
                "ddict: could not tell the scheduler that this host restarted "
                "(its replicas are made again at the next change): %r",
                e,
            )

    try:
        asyncio.run_coroutine_threadsafe(tell(), loop)
    except RuntimeError:  # the server's loop is closed: nobody to tell
        pass


def _gave_up(server: Any, loop: asyncio.AbstractEventLoop, why: str) -> None:
    """The supervisor gave its host up (from its watching thread): tell the orchestrator."""
    try:
        asyncio.run_coroutine_threadsafe(
            tell_host_gone(server, why, closing=False, ended=True), loop
        )
    except RuntimeError:  # the server's loop is closed: nobody to tell
        pass


class _Supervising:
    """What both plugins do: own a supervisor and expose its handlers on a server."""

    name = "ddict"
    idempotent = True

    supervisor: HostSupervisor | None = None
    #: The supervisor's control calls, installed as the server's handlers.
    control_handlers: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.supervisor!r}>"

    async def _start(self, server: Any) -> None:
        security = server.security
        tls = server.address.startswith("tls://") or bool(security.require_encryption)
        sup = self.supervisor = HostSupervisor(
            _tcp_host(server.address), security, server.address, tls, _lease_giver(server)
        )
        sup.on_give_up = functools.partial(_gave_up, server, asyncio.get_running_loop())
        sup.on_restart = functools.partial(_restarted, server, asyncio.get_running_loop())
        self.control_handlers = ControlCalls(sup).handlers()
        await off_loop(sup.start)  # starting a process: off the event loop
        server.handlers.update(self.control_handlers)

    async def _stop(self, server: Any, why: str) -> None:
        """Close the supervisor, and so its host, once its managers moved away.

        A graceful close (a retired worker, a cluster scaling down, SIGTERM) first
        asks the orchestrator to move this host's managers to the remaining workers
        (:func:`evacuate`); the control handlers serve meanwhile.  Then the
        orchestrator hears that the host goes (``why``: what closes), so that clients
        of any manager left here are told their host is gone, and why, rather than
        meeting a refused connection or a shard marked closed.
        """
        sup = self.supervisor
        if sup is None:
            return
        if sup.serving and config.get("move.on-retire"):
            await evacuate(server, why)
        self.supervisor = None
        for name in self.control_handlers or ():
            server.handlers[name] = _gone
        self.control_handlers = None
        serving = sup.serving
        if serving:
            await tell_host_gone(server, why)
        await off_loop(sup.close)
        if serving:  # (now its host process ended: its primaries' replicas need not wait
            await tell_host_gone(server, why, ended=True)  # for its lease's end)


class DDictNannyPlugin(_Supervising, NannyPlugin):
    """Supervises the host process of a worker that has a nanny."""

    async def setup(self, nanny: Nanny) -> None:
        await self._start(nanny)

    async def teardown(self, nanny: Nanny) -> None:
        await self._stop(nanny, "its nanny closed")


class DDictWorkerPlugin(_Supervising, WorkerPlugin):
    """Supervises the host process of a worker without a nanny (else does nothing)."""

    async def setup(self, worker: Worker) -> None:
        await report_hash_probe(worker)
        if worker.nanny:
            return  # the nanny's plugin supervises: the host outlives this process
        await self._start(worker)

    async def teardown(self, worker: Worker) -> None:
        await self._stop(worker, "its worker (which supervised it: no nanny) closed")
