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
import secrets
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

from ..arguments import local_store
from ..errors import DDictError, raise_from_wire
from ..layout import Layout, ManagerInfo
from ..placement import Policy

logger = logging.getLogger(__name__)

T = TypeVar("T")

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
    #: what a placement policy looks at (``placement.Policy.matches``)
    name: Any = None
    host: str = ""  # the worker's IP address
    resources: tuple[tuple[str, float], ...] = ()

    def satisfies(self, policy: Policy | None) -> bool:
        """Whether this worker may take a manager placed under ``policy``."""
        return policy is None or policy.matches(
            self.worker, self.name, self.host, self.host_id.split(":")[0], dict(self.resources)
        )


def targets(candidates: Iterable[Candidate], source_host: str) -> list[Candidate]:
    """Where a manager leaving ``source_host`` should go, best first: the fewest of its
    dictionary's managers, then of all managers, then the same machine (a move there
    copies nothing), then by address (the same choice on every run)."""
    return sorted(
        candidates, key=lambda c: (c.managers, c.total, c.host_id != source_host, c.worker)
    )


def rebalance_plan(
    layout: Layout, workers: list[str], used: dict[int, int] | None = None
) -> list[tuple[int, str]]:
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
        #: (uid, manager) -> the storage options of a parked manager (credentials for its
        #: persist store, which are otherwise kept nowhere here), for its adoption
        self.parked_options: dict[tuple[str, int], Any] = {}
        #: (machine, other machine, local persist path) -> whether the other sees it
        self._sees: dict[tuple[str, str, str], bool] = {}
        #: ``await on_served(name, info)``: a manager is served at its new place, before
        #: the layout says so (its replicas follow it there, see ``replicas``).
        self.on_served: Callable[[str, ManagerInfo], Awaitable[None]] | None = None

    def __repr__(self) -> str:
        return f"<Moves done={len(self.log)} under_way={dict(+self._under_way)}>"

    @property
    def busy(self) -> bool:
        """Whether a move of any dictionary is under way."""
        return bool(self._under_way)

    async def settled(self, name: str, timeout: float | None) -> None:
        """Return once no move of ``name`` is under way (or after ``timeout``)."""

        async def wait() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: not self._under_way.get(name))

        if self._under_way.get(name):
            try:
                await asyncio.wait_for(wait(), timeout)
            except TimeoutError:
                pass

    async def move(self, name: str, mid: int, target: Candidate, why: str) -> Move | None:
        """Move manager ``mid`` of ``name`` to ``target``'s host; ``None`` if it is there."""
        return await self.serially(name, self._move(name, mid, target, why))

    async def park(self, name: str, mid: int, why: str) -> Move:
        """Stop serving manager ``mid`` of ``name`` where it is but keep its shard in its
        machine's shared memory (no worker can take it): see :meth:`adopt`."""
        return await self.serially(name, self._park(name, mid, why))

    async def adopt(self, name: str, mid: int, target: Candidate, why: str) -> Move | None:
        """Serve parked manager ``mid`` of ``name`` at ``target``'s host, on the machine
        where its shard waits; ``None`` if it is not parked (any more)."""
        return await self.serially(name, self._adopt(name, mid, target, why))

    def unpark(self, name: str, mid: int, why: str) -> None:
        """Parked manager ``mid``'s shard is gone from its machine: it is lost, ``why``."""
        layout = self.layouts.get(name)
        if layout is not None and layout.managers[mid].parked:
            self.parked_options.pop((layout.uid, mid), None)
            self._place(name, replace(layout.managers[mid], parked=False, lost_why=why))
            logger.warning("ddict %s: parked manager %d is lost: %s", name, mid, why)

    async def serially(self, name: str, step: Awaitable[T], followed: bool = True) -> T:
        """Run ``step``, one at a time per dictionary, counted as under way meanwhile
        (``followed``: clients asking for the layout wait for it; a step that changes no
        manager's place, a replica's seeding, need not make them wait)."""
        lock = self._locks.setdefault(name, asyncio.Lock())
        if followed:
            self.begin(name)
        try:
            async with lock:
                return await step
        finally:
            if followed:
                await self.end(name)

    def begin(self, name: str) -> None:
        """A change of ``name``'s layout is under way (clients asking for it wait)."""
        self._under_way[name] += 1

    async def end(self, name: str) -> None:
        """:meth:`begin`'s change is done."""
        self._under_way[name] -= 1
        if not self._under_way[name]:
            del self._under_way[name]
        async with self._changed:
            self._changed.notify_all()

    def _layout(self, name: str) -> Layout:
        layout = self.layouts.get(name)
        if layout is None:
            raise DDictError(f"no DDict named {name!r} on this cluster", "INVALID_ARGUMENT")
        return layout

    def _manager(self, name: str, mid: int) -> tuple[Layout, ManagerInfo]:
        """``name``'s layout and its manager ``mid`` (a typed refusal for any other id)."""
        layout = self._layout(name)
        if not 0 <= mid < len(layout.managers):
            raise DDictError(
                f"manager_id {mid} of {name!r} is not one of its managers "
                f"(0 to {len(layout.managers) - 1})",
                "INVALID_ARGUMENT",
            )
        return layout, layout.managers[mid]

    async def _move(self, name: str, mid: int, target: Candidate, why: str) -> Move | None:
        layout, old = self._manager(name, mid)
        if old.lost:
            raise DDictError(
                f"manager {mid} of {name!r} is lost: it cannot move", "INVALID_OPERATION"
            )
        if old.supervisor == target.supervisor:
            return None
        copy = old.host_id != target.host_id
        prepared = ""
        if copy:
            await self._check_persist_path(layout, old, target)
            prepared = await self._prepare(layout, old, target)
        began = time.monotonic()
        out = await self._out(layout, old, copy)
        try:
            info = await self._in(
                layout,
                mid,
                target,
                out,
                path=prepared if copy else out["store_path"],
                source=asdict(old) if copy else None,
                term=old.term + 1,
            )
        except BaseException:
            try:
                raise_from_wire(
                    await self.rpc(old.supervisor).ddict_move_abort(uid=layout.uid, manager_id=mid)
                )
            except Exception as e:  # noqa: BLE001 - the first failure is the one to report
                logger.warning(
                    "ddict %s: resuming manager %d after a failed move: %r", name, mid, e
                )
            raise
        await self._served(name, info)
        where = f"{info.hostname} (worker {target.worker})"
        try:
            raise_from_wire(
                await self.rpc(old.supervisor).ddict_move_done(
                    uid=layout.uid, manager_id=mid, where=where
                )
            )
        except Exception as e:  # noqa: BLE001 - the new place serves: the move is done
            logger.warning(
                "ddict %s: the old host of manager %d did not let it go: %r", name, mid, e
            )
        return self._done(
            Move(
                name,
                mid,
                old.worker,
                target.worker,
                why,
                copy,
                int(out["used_bytes"]),
                time.monotonic() - began,
                time.time(),
            )
        )

    async def _park(self, name: str, mid: int, why: str) -> Move:
        layout, old = self._manager(name, mid)
        if old.lost:
            raise DDictError(
                f"manager {mid} of {name!r} is lost: it cannot be parked", "INVALID_OPERATION"
            )
        began = time.monotonic()
        # (marked as copied away: same-host clients stop using the shard)
        out = await self._out(layout, old, copy=True)
        self.parked_options[(layout.uid, mid)] = out.get("storage_options")
        info = replace(old, lost=True, parked=True, lost_why=why)
        self._place(name, info)
        try:
            raise_from_wire(
                await self.rpc(old.supervisor).ddict_move_done(
                    uid=layout.uid, manager_id=mid, where="nowhere (parked)", park=True
                )
            )
        except Exception as e:  # noqa: BLE001 - parked as far as is known: a worker there
            # finds its shard or not (then it is lost, see unpark)
            self._place(name, replace(info, lost_why=f"{why} (its host did not confirm: {e!r})"))
        return self._done(
            Move(
                name,
                mid,
                old.worker,
                "",
                why,
                False,
                int(out["used_bytes"]),
                time.monotonic() - began,
                time.time(),
            )
        )

    async def _adopt(self, name: str, mid: int, target: Candidate, why: str) -> Move | None:
        layout, old = self._manager(name, mid)
        if not old.parked:
            return None
        began = time.monotonic()
        out = {
            "used_bytes": 0,
            "map_size": 0,
            "storage_options": self.parked_options.get((layout.uid, mid)),
        }
        info = await self._in(
            layout, mid, target, out, path=old.store_path, source=None, term=old.term + 1
        )
        self.parked_options.pop((layout.uid, mid), None)
        await self._served(name, info)
        return self._done(
            Move(
                name,
                mid,
                old.worker,
                target.worker,
                why,
                False,
                0,
                time.monotonic() - began,
                time.time(),
            )
        )

    async def _check_persist_path(
        self, layout: Layout, old: ManagerInfo, target: Candidate
    ) -> None:
        """Refuse to move a manager to another machine that does not see its local
        ``persist_path`` (its persisted checkpoints would stay behind); a probe file
        left by the old machine tells, once per pair of machines and path."""
        directory = local_store(layout.options.persist_path)
        if not layout.options.persist_path or directory is None:
            return  # (nothing persisted, or an object store: seen from everywhere)
        key = (old.host_id, target.host_id, directory)
        if key not in self._sees:
            token = secrets.token_hex(8)
            src, dst = self.rpc(old.supervisor), self.rpc(target.supervisor)
            raise_from_wire(await src.ddict_probe(directory=directory, token=token, step="leave"))
            try:
                seen = await dst.ddict_probe(directory=directory, token=token, step="find")
                raise_from_wire(seen)
            finally:
                await src.ddict_probe(directory=directory, token=token, step="clear")
            self._sees[key] = seen is True
        if not self._sees[key]:
            raise DDictError(
                f"manager {old.manager_id} of {layout.name!r} persists to {directory}, a path "
                f"that {old.hostname} has and {target.worker}'s machine does not see: moved "
                "there it would leave its persisted checkpoints behind.  It moves only to "
                "workers on its own machine (else it is parked there); to let managers move "
                "between machines, persist to a shared file system or an object store "
                "(persist_path='s3://...')",
                "INVALID_OPERATION",
            )

    async def _prepare(self, layout: Layout, old: ManagerInfo, target: Candidate) -> str:
        """Step 0 of a copy, while the manager still works: ``target``'s host makes the
        file of its copy ready, sized by what it uses now (allocating and mapping pages
        costs about as much as receiving them, and the pause is left with the transfer).
        Its path, or "" if it could not (the copy is then made during the pause)."""
        mid = old.manager_id
        try:
            nbytes = (await self.shard_bytes(old.supervisor, layout.uid)).get(mid, 0)
            path = await self.rpc(target.supervisor).ddict_move_prepare(
                name=layout.name,
                manager_id=mid,
                nbytes=nbytes,
                capacity=layout.total_mem // layout.num_managers,
            )
            raise_from_wire(path)
            return str(path)
        except Exception as e:  # noqa: BLE001 - an optimisation: the move goes on without it
            logger.info(
                "ddict %s: preparing manager %d's copy on %s failed: %r",
                layout.name,
                mid,
                target.worker,
                e,
            )
            return ""

    async def shard_bytes(self, supervisor: str, uid: str) -> dict[int, int]:
        """The used bytes of each of dictionary ``uid``'s managers at ``supervisor``'s host."""
        used = await self.rpc(supervisor).ddict_shard_bytes(uid=uid)
        raise_from_wire(used)
        return {int(k): int(v) for k, v in used.items()}

    async def _out(self, layout: Layout, old: ManagerInfo, copy: bool) -> dict[str, Any]:
        """Step 1: pause manager ``old`` at its host (``copy``: its shard marked moved)."""
        out = await self.rpc(old.supervisor).ddict_move_out(
            uid=layout.uid, manager_id=old.manager_id, copy=copy
        )
        raise_from_wire(out)
        return dict(out)

    async def _in(
        self,
        layout: Layout,
        mid: int,
        target: Candidate,
        out: dict[str, Any],
        path: str,
        source: dict[str, Any] | None,
        term: int,
    ) -> ManagerInfo:
        """Step 2: ``target``'s host serves manager ``mid`` over its shard at ``path`` (this
        machine's), or over a copy from ``source``, under ``term`` (see
        ``ManagerInfo.term``); returns where it is served."""
        reply = await self.rpc(target.supervisor).ddict_move_in(
            name=layout.name,
            uid=layout.uid,
            secret=layout.secret,
            options=layout.options.to_dict(),
            capacity=layout.total_mem // layout.num_managers,
            num_managers=layout.num_managers,
            manager_id=mid,
            worker=target.worker,
            path=path,
            source=source,
            used=out["used_bytes"],
            map_size=out["map_size"],
            storage_options=out.get("storage_options"),
            term=term,
        )
        if reply is None:
            raise DDictError(
                f"worker {target.worker} has no ddict host supervisor", "INVALID_OPERATION"
            )
        raise_from_wire(reply)
        now = self.layouts.get(layout.name)
        if now is None or now.uid != layout.uid:  # destroyed meanwhile: served nowhere
            raise_from_wire(
                await self.rpc(target.supervisor).ddict_destroy_managers(uid=layout.uid)
            )
            raise DDictError(
                f"DDict {layout.name!r} was destroyed while manager {mid} moved",
                "INVALID_OPERATION",
            )
        fields = set(ManagerInfo.__dataclass_fields__) - {"supervisor", "term", "policy"}
        return ManagerInfo(
            **{k: v for k, v in reply[0].items() if k in fields},
            supervisor=target.supervisor,
            term=term,
            policy=layout.managers[mid].policy,
        )

    async def _served(self, name: str, info: ManagerInfo) -> None:
        """``info``'s manager serves at its new place: :attr:`on_served`, then the layout."""
        if self.on_served is not None:
            await self.on_served(name, info)
        self._place(name, info)

    def _place(self, name: str, info: ManagerInfo) -> None:
        """The layout with ``info`` for its manager, in a new epoch (clients follow)."""
        layout = self.layouts.get(name)  # (its epoch may have moved meanwhile)
        if layout is None:
            return  # (destroyed meanwhile)
        managers = tuple(info if m.manager_id == info.manager_id else m for m in layout.managers)
        self.layouts[name] = replace(layout, managers=managers, epoch=layout.epoch + 1)

    def _done(self, move: Move) -> Move:
        self.log.append(move)
        if move.target:
            logger.info(
                "ddict %s: manager %d moved from %s to %s (%s; %s, %d bytes, writes paused %.3f s)",
                move.name,
                move.manager_id,
                move.source or "(parked)",
                move.target,
                move.why,
                "copied" if move.copied else "handed over",
                move.nbytes,
                move.seconds,
            )
        else:
            logger.warning(
                "ddict %s: manager %d parked on the machine of %s: %s",
                move.name,
                move.manager_id,
                move.source,
                move.why,
            )
        return move

    def of(self, name: str) -> list[Move]:
        """The moves of dictionary ``name`` that are remembered, oldest first."""
        return [m for m in self.log if m.name == name]
