"""The Dask side of hosting: thin plugins that own a :class:`HostSupervisor`.

Managers live in a host process next to each worker, never in the worker
(see :mod:`dask_ddict.host`).  Who supervises that process depends on the
worker:

* under a nanny (the default of ``LocalCluster`` and ``dask worker``), the
  :class:`DDictNannyPlugin` does.  The nanny outlives worker restarts, so the
  host process, its managers and their clients never notice one;
* without a nanny (``processes=False``, ``dask worker --no-nanny``), the
  :class:`DDictWorkerPlugin` does, and the managers end with the worker.

Either way the supervisor's control handlers are installed on that server, and
the orchestrator addresses them there (``WorkerState.nanny`` or the worker).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING, Any

from distributed.comm import get_address_host
from distributed.diagnostics.plugin import NannyPlugin, WorkerPlugin

from .._hashing import hash_seed
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


async def _gone(**kwargs: Any) -> None:
    """What a closed supervisor answers: nothing (the orchestrator reads "host gone")."""
    return None


class _Supervising:
    """What both plugins do: own a supervisor and expose its handlers on a server."""

    name = "ddict"
    idempotent = True

    supervisor: HostSupervisor | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.supervisor!r}>"

    async def _start(self, server: Any, hash_seed: str) -> None:
        security = server.security
        tls = server.address.startswith("tls://") or bool(security.require_encryption)
        sup = self.supervisor = HostSupervisor(_tcp_host(server.address), security,
                                               server.address, tls, hash_seed)  # fmt: skip
        await asyncio.to_thread(sup.start)  # starting a process: off the event loop
        server.handlers.update(sup.handlers())

    async def _stop(self, server: Any) -> None:
        sup, self.supervisor = self.supervisor, None
        if sup is None:
            return
        for name in sup.handlers():
            server.handlers[name] = _gone
        await asyncio.to_thread(sup.close)


class DDictNannyPlugin(_Supervising, NannyPlugin):
    """Supervises the host process of a worker that has a nanny."""

    async def setup(self, nanny: Nanny) -> None:
        # The nanny starts its workers with this seed (it sets one when none is configured).
        await self._start(nanny, str(nanny.pre_spawn_env.get("PYTHONHASHSEED", "")))

    async def teardown(self, nanny: Nanny) -> None:
        await self._stop(nanny)


class DDictWorkerPlugin(_Supervising, WorkerPlugin):
    """Supervises the host process of a worker without a nanny (else does nothing)."""

    async def setup(self, worker: Worker) -> None:
        if worker.nanny:
            return  # the nanny's plugin supervises: the host outlives this process
        await self._start(worker, hash_seed())

    async def teardown(self, worker: Worker) -> None:
        await self._stop(worker)
