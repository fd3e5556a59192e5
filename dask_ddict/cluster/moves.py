"""Moving managers between host processes: the orchestrator's side.

A manager moves when its worker leaves gracefully (``retire_workers``, a
cluster scaling down, ``Adaptive``, a nanny or worker closed, SIGTERM to
``dask worker``: the host supervisor's plugin asks for an *evacuation* before its
host process ends, see :mod:`.worker_plugin`) and when ``d.rebalance()`` spreads a
dictionary over the workers there are now.  Each move is three control calls
(:func:`move`): the old host pauses the manager, the new one serves it (the same
shard on the same machine, a copy across machines), the old one lets it go;
the layout's epoch moves in between, and clients that reach the old place are
told ``MOVED`` and ask for the new layout, which waits until the moves of that
dictionary are done (:class:`Moves.settled`).

Where managers go is decided by the pure functions :func:`targets` and
:func:`rebalance_plan` (unit-tested without a cluster).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..errors import DDictError, raise_from_wire
from ..layout import Layout, ManagerInfo

logger = logging.getLogger(__name__)

#: Moves remembered for ``stats``, the dashboard and the metrics (the newest kept).
KEEP_MOVES = 256


@dataclass(frozen=True)
class Move:
    """One manager's move, as ``stats``, the dashboard and the metrics show it."""

    name: str
    manager_id: int
    source: str  # worker it was hosted for
    target: str  # worker it is hosted for now
    why: str
    copied: bool  # to another machine (its shard copied), else handed over in place
    nbytes: int  # the shard's used bytes
    seconds: float  # the manager's writes were paused this long
    at: float  # time.time() when it was done


@dataclass(frozen=True)
class Candidate:
    """A worker that may take managers: its supervisor, machine and current load."""

    worker: str
    supervisor: str
    host_id: str
    managers: int  # of the dictionary being placed
    total: int  # of every dictionary


def targets(candidates: Iterable[Candidate], source_host: str) -> list[Candidate]:
    """Where a manager leaving ``source_host`` should go, best first: the fewest of its
    dictionary's managers, then of all managers, then the same machine (a move there
    copies nothing), then by address (the same choice on every run)."""
    return sorted(candidates, key=lambda c: (c.managers, c.total, c.host_id != source_host,
                                             c.worker))  # fmt: skip


def rebalance_plan(layout: Layout, workers: list[str],
                   used: dict[int, int] | None = None) -> list[tuple[int, str]]:  # fmt: skip
    """``(manager, worker)`` moves that leave every worker of ``workers`` hosting a
    number of ``layout``'s managers that differs by at most one, moving the fewest
    managers and, among equal choices, the fewest bytes (``used``: each manager's).

    A worker that hosts more than its share gives up its smallest managers; lost
    managers are left where they are.
    """
    if not workers:
        return []
    used = used or {}
    live = [m for m in layout.managers if not m.lost]
    hosted: dict[str, list[ManagerInfo]] = {w: [] for w in workers}
    outside: list[ManagerInfo] = []
    for m in live:
        (hosted[m.worker] if m.worker in hosted else outside).append(m)
    n, k = len(live), len(workers)
    base, extra = divmod(n, k)
    # the busiest workers keep the extra ones (fewer moves)
    order = sorted(workers, key=lambda w: (-len(hosted[w]), w))
    quota = {w: base + (1 if i < extra else 0) for i, w in enumerate(order)}
    leaving = list(outside)
    for w in workers:
        mine = sorted(hosted[w], key=lambda m: (used.get(m.manager_id, 0), m.manager_id))
        over = len(mine) - quota[w]
        if over > 0:
            leaving += mine[:over]
    leaving.sort(key=lambda m: (-used.get(m.manager_id, 0), m.manager_id))
    plan = []
    for m in leaving:
        w = min(workers, key=lambda w: (len(hosted[w]) - quota[w], w))
        hosted[w].append(m)
        plan.append((m.manager_id, w))
    return plan


class Moves:
    """The orchestrator's moves: one at a time per dictionary, followed by its clients.

    Parameters
    ----------
    rpc
        ``rpc(address)``: the scheduler's RPC to a host supervisor.
    layouts
        The orchestrator's registry (name -> layout), changed in place.
    """

    def __init__(self, rpc: Callable[[str], Any], layouts: dict[str, Layout]) -> None:
        self.rpc = rpc
        self.layouts = layouts
        self.log: deque[Move] = deque(maxlen=KEEP_MOVES)
        self._under_way: Counter[str] = Counter()
        self._locks: dict[str, asyncio.Lock] = {}
        self._changed = asyncio.Condition()

    def __repr__(self) -> str:
        return f"<Moves done={len(self.log)} under_way={dict(+self._under_way)}>"

    async def settled(self, name: str, timeout: float | None) -> None:
        """Return once no move of ``name`` is under way (or after ``timeout``)."""
        async def wait() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: not self._under_way.get(name))

        if self._under_way.get(name):
            try:
                await asyncio.wait_for(wait(), timeout)
            except asyncio.TimeoutError:
                pass

    async def move(self, name: str, mid: int, target: Candidate, why: str) -> Move | None:
        """Move manager ``mid`` of ``name`` to ``target``'s host; ``None`` if it is there."""
        lock = self._locks.setdefault(name, asyncio.Lock())
        self._under_way[name] += 1
        try:
            async with lock:
                return await self._move(name, mid, target, why)
        finally:
            self._under_way[name] -= 1
            if not self._under_way[name]:
                del self._under_way[name]
            async with self._changed:
                self._changed.notify_all()

    async def _move(self, name: str, mid: int, target: Candidate, why: str) -> Move | None:
        layout = self.layouts.get(name)
        if layout is None:
            raise DDictError(f"no DDict named {name!r} on this cluster", "INVALID_ARGUMENT")
        old = layout.managers[mid]
        if old.lost:
            raise DDictError(f"manager {mid} of {name!r} is lost: it cannot move",
                             "INVALID_OPERATION")  # fmt: skip
        if old.supervisor == target.supervisor:
            return None
        copy = old.host_id != target.host_id
        began = time.monotonic()
        out = await self.rpc(old.supervisor).ddict_move_out(uid=layout.uid, manager_id=mid,
                                                            copy=copy)  # fmt: skip
        raise_from_wire(out)
        try:
            reply = await self.rpc(target.supervisor).ddict_move_in(
                name=name, uid=layout.uid, secret=layout.secret,
                options=layout.options.to_dict(), capacity=layout.total_mem // layout.num_managers,
                num_managers=layout.num_managers, manager_id=mid, worker=target.worker,
                path="" if copy else out["store_path"], source=asdict(old) if copy else None,
                used=out["used_bytes"], map_size=out["map_size"],
                storage_options=out.get("storage_options"),
            )  # fmt: skip
            if reply is None:
                raise DDictError(f"worker {target.worker} has no ddict host supervisor",
                                 "INVALID_OPERATION")  # fmt: skip
            raise_from_wire(reply)
        except BaseException:
            try:
                raise_from_wire(await self.rpc(old.supervisor).ddict_move_abort(
                    uid=layout.uid, manager_id=mid))  # fmt: skip
            except Exception as e:  # noqa: BLE001 - the first failure is the one to report
                logger.warning("ddict %s: resuming manager %d after a failed move: %r", name,
                               mid, e)  # fmt: skip
            raise
        fields = set(ManagerInfo.__dataclass_fields__)
        info = ManagerInfo(**{k: v for k, v in reply[0].items() if k in fields},
                           supervisor=target.supervisor)  # fmt: skip
        layout = self.layouts.get(name, layout)  # (its epoch may have moved meanwhile)
        managers = tuple(info if m.manager_id == mid else m for m in layout.managers)
        self.layouts[name] = replace(layout, managers=managers, epoch=layout.epoch + 1)
        where = f"{info.hostname} (worker {target.worker})"
        try:
            raise_from_wire(await self.rpc(old.supervisor).ddict_move_done(
                uid=layout.uid, manager_id=mid, where=where))  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the new place serves: the move is done
            logger.warning("ddict %s: the old host of manager %d did not let it go: %r", name,
                           mid, e)  # fmt: skip
        done = Move(name, mid, old.worker, target.worker, why, copy, int(out["used_bytes"]),
                    time.monotonic() - began, time.time())  # fmt: skip
        self.log.append(done)
        logger.info("ddict %s: manager %d moved from %s to %s (%s; %s, %d bytes, writes paused "
                    "%.3f s)", name, mid, old.worker, target.worker, why,
                    "copied" if copy else "handed over", done.nbytes, done.seconds)  # fmt: skip
        return done

    def of(self, name: str) -> list[Move]:
        """The moves of dictionary ``name`` that are remembered, oldest first."""
        return [m for m in self.log if m.name == name]
