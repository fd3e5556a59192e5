"""The dictionary follows the cluster: evacuating a leaving host, rebalancing onto new ones.

The orchestrator's handlers for the cluster's changes of shape, on top of the
moves themselves (:mod:`.moves`):

* ``ddict_evacuate``: a host supervisor's plugin asks it while its nanny (or
  nanny-less worker) closes gracefully, before the host process ends: every
  manager there moves to the remaining workers, spread evenly (each to the worker
  with the fewest of its dictionary's managers, on the same machine when tied),
  trying the next worker when one cannot take it (no room, a persist path the
  other machine cannot see).  A manager that no worker can take (the last
  worker left, no room anywhere) is *parked*, never dropped: its shard stays in
  its machine's shared memory, kept, and its operations fail with an error that
  says so (said at WARNING, in ``stats``' moves, on the dashboard).  A worker that
  joins on that machine takes it at once, and ``d.rebalance()`` asks again;
  ``destroy()`` and the orchestrator's close remove it;
* ``ddict_rebalance`` (``d.rebalance()``), and each worker that joins when
  ``ddict.move.rebalance-on-join`` is set: managers move until every worker's
  count differs by at most one (:func:`.moves.rebalance_plan`), moving the
  fewest bytes;
* ``ddict_move``: one manager to a chosen worker.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

from distributed.core import Status

from .. import config
from ..errors import DDictError, DDictManagerUnavailableError
from ..layout import Layout
from ..placement import Policy
from .failover import Failover
from .leases import Leases
from .leftovers import remove_paths_on
from .liveness import Liveness
from .moves import Candidate, Move, Moves, rebalance_plan, targets
from .replicas import Replicas

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)

#: How many times a closing host's evacuation looks again for managers that other
#: evacuations moved there meanwhile (each pass waits for the moves under way).
EVACUATION_PASSES = 5


class Orchestrator(Protocol):
    """What moves need of the orchestrator (``DDictSchedulerPlugin``)."""

    dicts: dict[str, Layout]
    scheduler: Scheduler
    leases: Leases | None
    liveness: Liveness

    def supervisor_of(self, worker: str) -> str: ...
    def spawn(self, work: Awaitable[Any]) -> None: ...


class Elastic:
    """Evacuations and rebalances of every dictionary of one orchestrator."""

    def __init__(self, plugin: Orchestrator) -> None:
        self.plugin = plugin
        self.moves = Moves(lambda address: plugin.scheduler.rpc(address), plugin.dicts)
        self._host_ids: dict[str, str] = {}  # supervisor -> its machine's host id
        self._evacuating: dict[str, asyncio.Lock] = {}  # one evacuation per supervisor
        #: supervisors whose host closes (their last evacuation began): they take nothing
        self._leaving: set[str] = set()
        failing: dict[tuple[str, int], str] = {}  # (the managers failing over: both see them)
        self.replicas = Replicas(
            self.moves.rpc,
            plugin.dicts,
            self.moves,
            self._candidates,
            plugin.spawn,
            functools.partial(remove_paths_on, plugin),
            failing,
            lambda s: self.failover.suspected(s),
        )
        self.failover = Failover(self.replicas, plugin.leases, failing, plugin.liveness.probe)

    def __repr__(self) -> str:
        return f"<Elastic {self.moves!r}>"

    def handlers(self) -> dict[str, Any]:
        return {
            "ddict_evacuate": self.evacuate,
            "ddict_rebalance": self.rebalance,
            "ddict_move": self.move_one,
            "ddict_moves": self.moves_of,
            "ddict_replicas": self.replicas_of,
            "ddict_host_restarted": self.replicas.host_restarted,
        }

    # -- handlers -------------------------------------------------------------------

    async def evacuate(
        self, supervisor: str, why: str = "", park: bool = True, closing: bool = False
    ) -> dict[str, Any]:
        """Move every manager of ``supervisor``'s host to the remaining workers (and park
        those that none can take, unless not ``park``: they stay where they are).

        ``closing``: the host's last evacuation (its nanny closes): from then on it takes
        no manager.  Several hosts close at once when a cluster scales down (to zero,
        or ``adapt`` retiring a few): a manager that another evacuation was moving here
        when this one began arrives after this host's first pass, so passes repeat,
        each once the moves under way are done, until none is left here.
        """
        plugin = self.plugin
        if plugin.scheduler.status != Status.running:
            return {"moved": 0, "parked": 0}  # the cluster is closing: nothing to keep
        if closing:
            self._leaving.add(supervisor)
        async with self._evacuating.setdefault(supervisor, asyncio.Lock()):
            why = plugin.liveness.why_leaving(supervisor, why)
            said = await self._evacuate(supervisor, why, park)
            for _ in range(EVACUATION_PASSES if closing else 0):
                for name in list(plugin.dicts):  # (the moves into this host, if any)
                    await self.moves.settled(name, config.get_seconds("move.timeout"))
                if not self._hosted(supervisor):
                    break
                more = await self._evacuate(supervisor, why, park)
                said = {k: said.get(k, 0) + v for k, v in more.items()}
            return said

    def _hosted(self, supervisor: str) -> bool:
        """Whether ``supervisor``'s host serves a manager (not lost) of any dictionary."""
        return any(
            m.supervisor == supervisor and not m.lost
            for layout in self.plugin.dicts.values()
            for m in layout.managers
        )

    async def _evacuate(self, supervisor: str, why: str, park: bool) -> dict[str, Any]:
        moved, parked = 0, 0
        for name, first in list(self.plugin.dicts.items()):
            for mid in range(first.num_managers):
                layout = self.plugin.dicts.get(name)  # (as the moves leave it)
                m = None if layout is None else layout.managers[mid]
                if m is None or m.supervisor != supervisor or m.lost:
                    continue
                tried = []
                keeping = {r.supervisor for r in self.replicas.of(name).get(mid, ())}
                fit = [
                    c for c in await self._candidates(name, supervisor) if c.satisfies(m.policy)
                ]  # (a pinned manager: only where it may be)
                for c in sorted(
                    targets(fit, m.host_id), key=lambda c: c.supervisor in keeping
                ):  # (not with its replica)
                    if c.supervisor in self._leaving:  # (began to close since the list)
                        continue
                    try:
                        await self.moves.move(name, m.manager_id, c, why)
                    except Exception as e:  # noqa: BLE001 - the next worker may take it
                        tried.append(f"{c.worker}: {e}")
                        continue
                    moved += 1
                    break
                else:
                    if park:
                        parked += 1
                        await self._park(name, m.manager_id, m.worker, why, tried, m.policy)
        replicas = await self.replicas.evacuate(supervisor)
        return {"moved": moved, "parked": parked, "replicas": replicas}

    def worker_retiring(self, worker: str) -> None:
        """Dask started to retire ``worker`` (its status is ``closing_gracefully``): its
        host's managers move now, while Dask drains its data, instead of when its nanny
        closes; one that no worker can take yet is left to that final evacuation."""
        if not config.get("move.on-retire"):
            return
        supervisor = self.plugin.supervisor_of(worker)
        if self._hosted(supervisor):
            self.plugin.spawn(self.evacuate(supervisor, park=False))

    async def rebalance(self, name: str) -> list[dict[str, Any]]:
        """Move ``name``'s managers so that the workers' counts differ by at most one."""
        layout = self.plugin.dicts.get(name)
        if layout is None:
            raise DDictError(f"no DDict named {name!r} on this cluster", "INVALID_ARGUMENT")
        done = await self.adopt_parked(name)
        candidates = {c.worker: c for c in await self._candidates(name, "")}
        used = await self._used(self.plugin.dicts[name])
        for mid, worker in rebalance_plan(self.plugin.dicts[name], sorted(candidates), used):
            policy = self.plugin.dicts[name].managers[mid].policy
            if not candidates[worker].satisfies(policy):
                continue  # (pinned: it stays where its policy holds)
            try:
                move = await self.moves.move(name, mid, candidates[worker], "rebalance()")
            except DDictError as e:  # (e.g. a local persist path the worker cannot see)
                logger.warning(
                    "ddict %s: rebalance left manager %d where it is: %s", name, mid, e.message
                )
                continue
            if move is not None:
                done.append(asdict(move))
        return done

    async def move_one(self, name: str, manager_id: int, worker: str) -> dict[str, Any] | None:
        """Move manager ``manager_id`` of ``name`` to ``worker``'s host."""
        candidates = {c.worker: c for c in await self._candidates(name, "")}
        if worker not in candidates:
            raise DDictError(
                f"worker {worker} cannot take managers (not connected, not "
                "running, or without a ddict host)",
                "INVALID_ARGUMENT",
            )
        layout = self.plugin.dicts.get(name)
        policy = (
            None
            if layout is None or not 0 <= int(manager_id) < layout.num_managers
            else layout.managers[int(manager_id)].policy
        )
        if not candidates[worker].satisfies(policy):
            raise DDictError(
                f"worker {worker} does not satisfy manager {manager_id}'s "
                f"placement policy {policy!r}",
                "INVALID_ARGUMENT",
            )
        move = await self.moves.move(name, int(manager_id), candidates[worker], "moved on request")
        return None if move is None else asdict(move)

    async def adopt_parked(self, name: str | None = None) -> list[dict[str, Any]]:
        """Serve the parked managers (of ``name``, else of every dictionary) at workers
        on the machines where their shards wait; the moves made."""
        done = []
        for n in [k for k in self.plugin.dicts if name in (None, k)]:
            await self.moves.settled(n, config.get_seconds("move.timeout"))
            layout = self.plugin.dicts.get(n)
            parked = [] if layout is None else [m for m in layout.managers if m.parked]
            for m in parked:
                here = [
                    c
                    for c in await self._candidates(n, "")
                    if c.host_id == m.host_id and c.satisfies(m.policy)
                ]
                for c in targets(here, m.host_id):
                    try:
                        move = await self.moves.adopt(
                            n, m.manager_id, c, "parked manager taken by a worker on its machine"
                        )
                    except DDictManagerUnavailableError as e:  # its shard is gone
                        self.moves.unpark(n, m.manager_id, f"{m.lost_why}; then {e.message}")
                        break
                    except Exception as e:  # noqa: BLE001 - the next worker may take it
                        logger.warning(
                            "ddict %s: %s could not take parked manager %d: %r",
                            n,
                            c.worker,
                            m.manager_id,
                            e,
                        )
                        continue
                    if move is not None:
                        done.append(asdict(move))
                    break
        return done

    def replicas_of(self, name: str) -> dict[int, list[str]]:
        """The workers that keep each manager's replicas of ``name``."""
        return {mid: [r.worker for r in reps] for mid, reps in self.replicas.of(name).items()}

    async def repair_all(self) -> None:
        """Replicas for every manager short of them (a worker joined), also those whose
        primary dropped one without the orchestrator knowing."""
        for name in [n for n, lay in list(self.plugin.dicts.items()) if lay.options.replicas]:
            try:
                await self.replicas.place(name)
            except Exception as e:  # noqa: BLE001 - said; the next join tries again
                logger.warning("ddict %s: making its missing replicas failed: %r", name, e)

    def moves_of(self, name: str) -> list[dict[str, Any]]:
        """The remembered moves of ``name`` (parkings too: no target), oldest first."""
        return [asdict(m) for m in self.moves.of(name)]

    async def rebalance_all(self) -> None:
        """``ddict.move.rebalance-on-join``: a worker joined; spread every dictionary."""
        for name in list(self.plugin.dicts):
            try:
                await self.rebalance(name)
            except Exception as e:  # noqa: BLE001 - logged; the next join tries again
                logger.warning("ddict %s: rebalancing onto a new worker failed: %r", name, e)

    def worker_joined(self, worker: str) -> None:
        """A worker joined: once it runs, it takes the parked managers of its machine,
        and managers from the others when ``ddict.move.rebalance-on-join`` says so."""
        self._leaving.discard(self.plugin.supervisor_of(worker))  # (a new nanny at an old
        # nanny's address: it takes managers)
        if any(lay.options.replicas for lay in self.plugin.dicts.values()):
            self.plugin.spawn(self._once_running(worker, self.repair_all))
        if config.get("move.rebalance-on-join") and self.plugin.dicts:
            self.plugin.spawn(self._once_running(worker, self.rebalance_all))
        elif self.moves.busy or any(
            m.parked for layout in self.plugin.dicts.values() for m in layout.managers
        ):  # (a move may end parked)
            self.plugin.spawn(self._once_running(worker, self.adopt_parked))

    async def _once_running(self, worker: str, then: Callable[[], Awaitable[Any]]) -> None:
        """``then()`` once ``worker`` runs (it registers before it does), or never if it
        leaves first or takes longer than ``ddict.move.timeout``."""
        scheduler = self.plugin.scheduler
        deadline = time.monotonic() + (config.get_seconds("move.timeout") or 600.0)
        while (ws := scheduler.workers.get(worker)) is not None and time.monotonic() < deadline:
            if ws.status == Status.running:
                await then()
                return
            await asyncio.sleep(0.1)  # (a few rounds: the worker says it runs at once)

    # -- helpers --------------------------------------------------------------------

    async def _park(
        self,
        name: str,
        mid: int,
        worker: str,
        why: str,
        tried: list[str],
        policy: Policy | None = None,
    ) -> None:
        where = "; ".join(tried) or (
            "no other worker runs a ddict host"
            if policy is None
            else f"no other worker satisfies its placement policy {policy!r}"
        )
        why = f"{why}, and no worker could take it ({where})"
        try:
            await self.moves.park(name, mid, why)
        except Exception as e:  # noqa: BLE001 - said; its keys go with its host
            logger.warning(
                "ddict %s: manager %d of %s could neither move nor be parked (%s; "
                "%r): its keys go with its host",
                name,
                mid,
                worker,
                why,
                e,
            )

    async def _used(self, layout: Layout) -> dict[int, int]:
        """Each manager's bytes as its host sees them (0 where it does not answer)."""

        async def of(supervisor: str) -> dict[int, int]:
            try:
                return await self.moves.shard_bytes(supervisor, layout.uid)
            except Exception:  # noqa: BLE001 - a plan without sizes is still a plan
                return {}

        used: dict[int, int] = {}
        for part in await asyncio.gather(
            *map(of, {m.supervisor for m in layout.managers if not m.lost})
        ):
            used.update(part)
        return used

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
            if (
                ws.status != Status.running
                or sup == leaving
                or sup in self._leaving
                or sup in plugin.liveness.gone
            ):
                continue
            host = await self._host_id(sup)
            if host:
                out.append(
                    Candidate(
                        w,
                        sup,
                        host,
                        per_dict.get(sup, 0),
                        total.get(sup, 0),
                        name=ws.name,
                        host=ws.host,
                        resources=tuple((ws.resources or {}).items()),
                    )
                )
        return out

    async def _host_id(self, supervisor: str) -> str:
        """The machine of ``supervisor`` ("" if it does not answer: not a candidate)."""
        known = self._host_ids.get(supervisor)
        if known is None:
            try:
                info = await asyncio.wait_for(
                    self.plugin.scheduler.rpc(supervisor).ddict_host_info(),
                    config.get_seconds("host.probe-timeout"),
                )
            except Exception:  # noqa: BLE001 - not reachable: not a candidate now
                return ""
            if not isinstance(info, dict) or "host_id" not in info:
                return ""
            known = self._host_ids[supervisor] = info["host_id"]
        return known


__all__ = ["Elastic", "Move"]
