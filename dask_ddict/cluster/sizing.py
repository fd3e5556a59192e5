"""Whether a host's shards fit beside its workers: the memory warning at creation.

Shards live outside the workers (in ``/dev/shm``, served by the host process), so
Dask's memory manager never counts them: a worker spills and pauses at fractions of its
``memory_limit`` whatever the shards take.  The warning must therefore say when the
shards really crowd the workers out, not compare configured limits: a
``LocalCluster``'s default limits already add up to the whole machine, so "limits plus
shards exceed the memory" holds for every dictionary on it, and a warning that fires
on the default setup is noise that users learn to ignore.

So :func:`memory_warnings` compares what is measured on the host after the shards
opened (available memory, free space of the shard directory, shard bytes that hold
no memory yet) with what the workers may still grow by before Dask pauses them.  It
warns only when the shards make the difference: the shards alone do not fit, or the
workers' growth fits without the shards but not beside them.  A host that is short
of memory with or without any dictionary is not the dictionary's to report.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import dask.config
from dask.utils import format_bytes

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)

__all__ = ["HostMemory", "memory_warnings", "pause_fraction"]


@dataclass(frozen=True)
class HostMemory:
    """One host as measured right after a creation opened its shards.

    Attributes
    ----------
    host
        How the host is named in the warning (its IP).
    available
        Memory available on the host now (shards that are reserved already took theirs).
    shard_dir_free
        Free bytes in the shard directory (``ddict.store.directory``, a tmpfs).
    shard_bytes
        Size of every shard on the host.
    unbacked
        The part of ``shard_bytes`` that holds no memory yet (shards not reserved at
        creation, ``ddict.store.reserve: false``): what their writes will still take.
    growth
        What the host's workers may still grow by before Dask pauses them: for each
        worker with a memory limit, ``memory_limit * pause`` less what it uses now.
    """

    host: str
    available: int
    shard_dir_free: int
    shard_bytes: int
    unbacked: int
    growth: int


def pause_fraction(config: dict[str, object]) -> float:
    """The fraction of ``memory_limit`` at which Dask stops a worker's growth.

    ``distributed.worker.memory.pause`` (the worker stops running tasks), else
    ``terminate`` (the nanny restarts it), else the whole limit.  ``config`` is
    ``dask.config.get("distributed.worker.memory")``.
    """
    for name in ("pause", "terminate"):
        value = config.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return 1.0


def memory_warnings(h: HostMemory) -> list[str]:
    """What to tell the creator about host ``h`` (empty: its shards fit).

    Three over-commits, each one the shards' doing:

    * the shards not yet in memory exceed the free space of the shard directory: their
      writes will fail when they fill it;
    * the shards exceed the memory there is for them (what is available, plus what the
      reserved shards already hold);
    * the workers' growth fits in that memory without the shards, but not beside them:
      the host runs out before Dask spills or pauses a worker (the OOM killer, or swap).
    """
    out = []
    if h.unbacked > h.shard_dir_free:
        out.append(
            f"host {h.host}: {format_bytes(h.unbacked)} of DDict shards are not in memory yet "
            f"(ddict.store.reserve is off) but the shard directory has "
            f"{format_bytes(h.shard_dir_free)} free: writes will fail once it is full; "
            "lower total_mem, add hosts, or give the directory (ddict.store.directory) room"
        )
    room = h.available + (h.shard_bytes - h.unbacked)  # for shards and workers together
    if h.shard_bytes > room:
        out.append(
            f"host {h.host}: its DDict shards ({format_bytes(h.shard_bytes)}) exceed the "
            f"memory there is for them ({format_bytes(room)}): filling them will push the "
            "host into swap or the OOM killer; lower total_mem or add hosts"
        )
    elif h.growth <= room < h.shard_bytes + h.growth:
        out.append(
            f"host {h.host}: its DDict shards ({format_bytes(h.shard_bytes)}) and what its "
            f"workers may still use before Dask pauses them ({format_bytes(h.growth)}: "
            "memory_limit x distributed.worker.memory.pause, less what they use now) exceed "
            f"its available memory ({format_bytes(room)} without the shards); memory_limit "
            "does not count shard pages, so the host runs out before Dask spills or pauses a "
            "worker: lower memory_limit or total_mem (docs/guide/operations.md, Sizing memory)"
        )
    return out


def hosts_warnings(
    scheduler: Scheduler, replies: list[list[dict[str, Any]]], warned_hosts: set[str]
) -> list[str]:
    """What the hosts of a new dictionary's shards say about fitting them (once per host).

    Each supervisor's reply carries its host's memory as measured after the
    shards opened (:func:`dask_ddict.host.machine.memory`); the workers' growth comes from
    the scheduler's view of them.  The decision is :func:`memory_warnings`; ``warned_hosts``
    (updated) are warned once.
    """
    measured: dict[str, HostMemory] = {}
    pause = pause_fraction(dask.config.get("distributed.worker.memory"))
    for reply in replies:
        m = reply[0] if reply else {}
        if "available" not in m or m["host_id"] in warned_hosts:
            continue  # warned about already, or not measured (an older supervisor)
        ip, seen = m["tcp_host"], measured.get(m["host_id"])
        if seen is None:
            growth = sum(
                max(
                    0,
                    int(ws.memory_limit * pause) - int(getattr(ws, "metrics", {}).get("memory", 0)),
                )
                for ws in scheduler.workers.values()
                if ws.host == ip and ws.memory_limit
            )
            seen = HostMemory(ip, m["available"], m["shard_dir_free"], 0, 0, growth)
        measured[m["host_id"]] = replace(
            seen,
            available=min(seen.available, m["available"]),
            shard_dir_free=min(seen.shard_dir_free, m["shard_dir_free"]),
            shard_bytes=seen.shard_bytes + m["shard_bytes"],  # per supervisor: add up
            unbacked=seen.unbacked + m["unbacked"],
        )
    out = []
    for hid, host in measured.items():
        said = memory_warnings(host)
        if said:
            warned_hosts.add(hid)  # once per host: the advice does not change
            logger.info("ddict: %s", "; ".join(said))
            out.extend(said)
    return out
