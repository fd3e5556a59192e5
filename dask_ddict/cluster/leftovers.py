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

import logging
import os
from typing import TYPE_CHECKING, Protocol

from distributed.comm import get_address_host

from ..host import hygiene
from ..layout import Layout, host_id

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)


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
