"""Removing what lost and parked managers left on their machines.

A manager whose host process ended without destroying it (a lost host) leaves
its socket directory, and a parked one (see :mod:`.elastic`) its whole shard,
kept on purpose.  Only a process on that machine can remove them: a live
worker's host supervisor there, else the orchestrator itself when it runs on
that machine (a ``LocalCluster`` scaled down to nothing), else nobody until a
host starts there again and sweeps (see :mod:`dask_ddict.host.hygiene`; a
parked shard's ``kept`` marker keeps it from sweeps, so it is said at INFO).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol

from distributed.comm import get_address_host, get_address_host_port

from ..host import hygiene
from ..layout import Layout, host_id

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)

#: How often a probe of a supervisor checks whether its port refuses connections.
REFUSED_EVERY = 0.1


class Orchestrator(Protocol):
    scheduler: Scheduler

    def supervisor_of(self, worker: str) -> str: ...


async def remove_lost(
    plugin: Orchestrator, layout: Layout, kept: bool = False, only_parked: bool = False
) -> None:
    """Delete what ``layout``'s lost managers left (``kept``: shards kept for a restart
    too; parked shards always; ``only_parked``: nothing else)."""
    for m in layout.managers:
        if not m.lost or (only_parked and not m.parked):
            continue
        removed = await remove_paths_on(
            plugin,
            m.worker,
            m.host_id,
            [m.store_path, os.path.dirname(m.uds_path)],
            kept or m.parked,
        )
        if not removed and m.parked:
            logger.info(
                "ddict %s: parked manager %d's shard %s stays on %s (no process "
                "there to remove it)",
                layout.name,
                m.manager_id,
                m.store_path,
                m.hostname,
            )


async def remove_paths_on(
    plugin: Orchestrator, worker: str, machine: str, paths: list[str], kept: bool = False
) -> bool:
    """Remove ``paths`` (abandoned ``ddict-*`` directories: see ``hygiene.remove``) on the
    machine of ``worker`` (host id ``machine``) through a live worker's supervisor there,
    else here if this is that machine; whether someone could."""
    host = get_address_host(worker) if worker else ""
    helpers = [
        plugin.supervisor_of(a) for a, ws in plugin.scheduler.workers.items() if ws.host == host
    ]
    for helper in helpers[:1]:
        try:
            await plugin.scheduler.rpc(helper).ddict_remove_paths(paths=paths, kept=kept)
            return True
        except Exception as e:  # noqa: BLE001 - tried here next, else said
            logger.info("ddict: removing %s failed: %r", paths, e)
    if machine == host_id():
        return hygiene.remove(paths, kept) > 0
    return False


async def refused(address: str) -> bool:
    """Whether a TCP connection to ``address`` (a Dask address) is refused: nothing listens
    there, its process is gone.  Dask's own comms retry a refused connection for their
    whole connect timeout; this answers at once."""
    try:
        host, port = get_address_host_port(address)
    except Exception:  # noqa: BLE001 - not a TCP address (inproc://): not known here
        return False
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
    except ConnectionRefusedError:
        return True
    except Exception:  # noqa: BLE001 - a timeout, an unreachable network: not known here
        return False
    writer.close()
    return False


#: What :func:`ask` found: an answer, its process gone, or neither within the time.
ANSWERED, GONE, UNKNOWN = "answered", "gone", "unknown"


async def ask(call: Awaitable[Any], address: str, timeout: float | None) -> tuple[str, Any]:
    """``(ANSWERED, call's answer)``; ``(GONE, None)`` once ``address`` refuses connections
    (its process is gone: checked every :data:`REFUSED_EVERY` s meanwhile, since a
    process killed while a connection to it was being accepted never answers it); or
    ``(UNKNOWN, None)`` when ``timeout`` passed (a partition, a stopped machine) or the
    call failed otherwise: whether the process lives is not known then."""
    task = asyncio.ensure_future(call)
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
    try:
        while not task.done():
            if await refused(address):
                return GONE, None
            left = None if deadline is None else deadline - asyncio.get_running_loop().time()
            if left is not None and left <= 0:
                return UNKNOWN, None
            await asyncio.wait(
                [task], timeout=REFUSED_EVERY if left is None else min(REFUSED_EVERY, left)
            )
        if task.exception() is not None:
            return (GONE if await refused(address) else UNKNOWN), None
        return ANSWERED, task.result()
    finally:
        if not task.done():
            task.cancel()
