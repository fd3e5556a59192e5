"""The dictionary follows the cluster: evacuating a leaving host, rebalancing onto new ones.

The orchestrator's handlers for the cluster's changes of shape, on top of the
moves themselves (:mod:`.moves`):

* ``ddict_evacuate``: a host supervisor's plugin asks it while its nanny (or
  nanny-less worker) closes gracefully, before the host process ends: every
  manager there moves to the remaining workers, spread evenly (each to the worker
  with the fewest of its dictionary's managers, on the same machine when tied),
  trying the next worker when one cannot take it (no room).  A manager that no
  worker can take stays where it is and is lost with its host, said at WARNING
  with why, and named in ``stats``' moves and the dashboard;
* ``ddict_rebalance`` (``d.rebalance()``), and each worker that joins when
  ``ddict.move.rebalance-on-join`` is set: managers move until every worker's
  count differs by at most one (:func:`.moves.rebalance_plan`);
* ``ddict_move``: one manager to a chosen worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

from distributed.core import Status

from .. import config
from ..errors import DDictError
from ..layout import Layout
from .moves import Candidate, Move, Moves, rebalance_plan, targets

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)


class Orchestrator(Protocol):
    """What moves need of the orchestrator (``DDictSchedulerPlugin``)."""

    dicts: dict[str, Layout]
    scheduler: Scheduler

    @property
    def gone(self) -> set[str]: ...
    def supervisor_of(self, worker: str) -> str: ...
    def why_leaving(self, supervisor: str, why: str) -> str: ...
    def spawn(self, work: Awaitable[Any]) -> None: ...


class Elastic:
    """Evacuations and rebalances of every dictionary of one orchestrator."""

    def __init__(self, plugin: Orchestrator) -> None:
        self.plugin = plugin
        self.moves = Moves(lambda address: plugin.scheduler.rpc(address), plugin.dicts)
        self._host_ids: dict[str, str] = {}  # supervisor -> its machine's host id
        self.stranded: list[dict[str, Any]] = []  # managers no worker could take (newest last)

    def __repr__(self) -> str:
        return f"<Elastic {self.moves!r} stranded={len(self.stranded)}>"

    def handlers(self) -> dict[str, Any]:
        return {"ddict_evacuate": self.evacuate, "ddict_rebalance": self.rebalance,
                "ddict_move": self.move_one, "ddict_moves": self.moves_of}  # fmt: skip

    # -- handlers -------------------------------------------------------------------

    async def evacuate(self, supervisor: str, why: str = "") -> dict[str, Any]:
        """Move every manager of ``supervisor``'s host to the remaining workers."""
        plugin = self.plugin
        if plugin.scheduler.status != Status.running:
            return {"moved": 0, "stranded": 0}  # the cluster is closing: nothing to keep
        why = plugin.why_leaving(supervisor, why)
        moved, stranded = 0, 0
        for name, layout in list(plugin.dicts.items()):
            for m in layout.managers:
                if m.supervisor != supervisor or m.lost:
                    continue
                tried = []
                for c in targets(await self._candidates(name, supervisor), m.host_id):
                    try:
                        await self.moves.move(name, m.manager_id, c, why)
                    except Exception as e:  # noqa: BLE001 - the next worker may take it
                        tried.append(f"{c.worker}: {e}")
                        continue
                    moved += 1
                    break
                else:
                    stranded += 1
                    self._strand(name, m.manager_id, m.worker, why, tried)
        return {"moved": moved, "stranded": stranded}

    async def rebalance(self, name: str) -> list[dict[str, Any]]:
        """Move ``name``'s managers so that the workers' counts differ by at most one."""
        layout = self.plugin.dicts.get(name)
        if layout is None:
            raise DDictError(f"no DDict named {name!r} on this cluster", "INVALID_ARGUMENT")
        candidates = {c.worker: c for c in await self._candidates(name, "")}
        done = []
        for mid, worker in rebalance_plan(layout, sorted(candidates)):
            move = await self.moves.move(name, mid, candidates[worker], "rebalance()")
            if move is not None:
                done.append(asdict(move))
        return done

    async def move_one(self, name: str, manager_id: int, worker: str) -> dict[str, Any] | None:
        """Move manager ``manager_id`` of ``name`` to ``worker``'s host."""
        candidates = {c.worker: c for c in await self._candidates(name, "")}
        if worker not in candidates:
            raise DDictError(f"worker {worker} cannot take managers (not connected, not "
                             "running, or without a ddict host)", "INVALID_ARGUMENT")  # fmt: skip
        move = await self.moves.move(name, int(manager_id), candidates[worker], "moved on request")
        return None if move is None else asdict(move)

    def moves_of(self, name: str) -> list[dict[str, Any]]:
        """The remembered moves of ``name`` (and managers it could not move), oldest first."""
        return [asdict(m) for m in self.moves.of(name)] + \
            [s for s in self.stranded if s["name"] == name]  # fmt: skip

    async def rebalance_all(self) -> None:
        """``ddict.move.rebalance-on-join``: a worker joined; spread every dictionary."""
        for name in list(self.plugin.dicts):
            try:
                await self.rebalance(name)
            except Exception as e:  # noqa: BLE001 - logged; the next join tries again
                logger.warning("ddict %s: rebalancing onto a new worker failed: %r", name, e)

    def worker_joined(self) -> None:
        if config.get("move.rebalance-on-join") and self.plugin.dicts:
            self.plugin.spawn(self.rebalance_all())

    # -- helpers --------------------------------------------------------------------

    def _strand(self, name: str, mid: int, worker: str, why: str, tried: list[str]) -> None:
        where = "; ".join(tried) or "no other worker runs a ddict host"
        self.stranded.append({"name": name, "manager_id": mid, "source": worker, "target": "",
                              "why": f"{why}: could not move ({where})"})  # fmt: skip
        del self.stranded[:-256]
        logger.warning("ddict %s: manager %d could not move off %s (%s): %s; its keys go with "
                       "its host", name, mid, worker, why, where)  # fmt: skip

    async def _candidates(self, name: str, leaving: str) -> list[Candidate]:
        """Running workers with a ddict host, other than ``leaving``'s supervisor."""
        plugin = self.plugin
        per_dict: dict[str, int] = {}
        total: dict[str, int] = {}
        for n, layout in plugin.dicts.items():
            for m in layout.managers:
                if not m.lost:
                    total[m.supervisor] = total.get(m.supervisor, 0) + 1
                    if n == name:
                        per_dict[m.supervisor] = per_dict.get(m.supervisor, 0) + 1
        out = []
        for w, ws in list(plugin.scheduler.workers.items()):
            sup = plugin.supervisor_of(w)
            if ws.status != Status.running or sup == leaving or sup in plugin.gone:
                continue
            host = await self._host_id(sup)
            if host:
                out.append(Candidate(w, sup, host, per_dict.get(sup, 0), total.get(sup, 0)))
        return out

    async def _host_id(self, supervisor: str) -> str:
        """The machine of ``supervisor`` ("" if it does not answer: not a candidate)."""
        known = self._host_ids.get(supervisor)
        if known is None:
            try:
                info = await asyncio.wait_for(
                    self.plugin.scheduler.rpc(supervisor).ddict_host_info(),
                    config.get_seconds("host.probe-timeout"))  # fmt: skip
            except Exception:  # noqa: BLE001 - not reachable: not a candidate now
                return ""
            if not isinstance(info, dict) or "host_id" not in info:
                return ""
            known = self._host_ids[supervisor] = info["host_id"]
        return known


__all__ = ["Elastic", "Move"]
