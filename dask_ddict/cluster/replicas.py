"""Replicas, the orchestrator's side: where each is kept, placing and repairing them.

A dictionary created with ``replicas=k`` keeps, for each manager (the *primary*),
``k`` copies of its shard in other host processes, on other machines when the
cluster has several (:func:`replica_targets`).  Every write a primary commits
is applied on each live replica before it is answered
(:mod:`dask_ddict.host.replicas`), so when a primary's host is lost suddenly
(SIGKILL, a dead machine) nothing acknowledged is lost:

* **failover** (:mod:`.failover`): the orchestrator has a replica's host serve
  the manager over the replica's shard (a promotion), the layout's epoch moves,
  and clients that fail to reach the lost host wait for it
  (``ddict.failover-timeout``) and send their operation again there, with its
  request id (applied exactly once);
* **repair** (:meth:`Replicas.place`): a manager with fewer live replicas than
  asked gets new ones, seeded from a consistent copy of its primary (the copy
  half of a move: its writes pause meanwhile), after a failover, after a
  replica's host is lost or leaves, and when a worker joins;
* replicas **follow moves**: a primary that moves ships to its replicas from its
  new place before the layout names it (``Moves.on_served``), and a replica
  whose host retires is made again elsewhere first.

With ``replicas=1``, two hosts lost at once (the primary's and its replica's)
lose that manager as without replicas.

How a replica takes over (failover) and who may serve (leases):
:mod:`.failover`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..errors import raise_from_wire
from ..layout import Layout, ManagerInfo
from .moves import Candidate, Moves

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replica:
    """One replica of a manager: the worker whose host process keeps it, and how the
    primary reaches that host (its layout fields)."""

    manager_id: int
    worker: str
    supervisor: str
    host_id: str
    info: dict[str, Any]


def address_of(r: Replica) -> tuple[Any, ...]:
    """The address of the host process that keeps replica ``r`` (as a primary names it)."""
    return (r.info.get("uds_path"), r.info.get("tcp_host"), r.info.get("tcp_port"))


def replica_targets(
    candidates: Iterable[Candidate], primary: ManagerInfo, have: list[Replica], load: dict[str, int]
) -> list[Candidate]:
    """Where a new replica of ``primary`` should go, best first: never the primary's host
    process or one that keeps a replica of it already; another machine than the
    primary's and its replicas' first; then the host process that keeps the fewest
    replicas (``load``, by supervisor) and managers; then by address."""
    taken = {primary.supervisor} | {r.supervisor for r in have}
    machines = {primary.host_id} | {r.host_id for r in have}
    return sorted(
        (c for c in candidates if c.supervisor not in taken),
        key=lambda c: (c.host_id in machines, load.get(c.supervisor, 0), c.total, c.worker),
    )


#: Lost supervisors remembered (:attr:`Replicas.gone`).
MOST_GONE = 1024
#: Seconds after which a placement that left a manager short of replicas is tried again.
PLACE_AGAIN = 5.0


class Replicas:
    """The replicas of every dictionary of one orchestrator.

    Parameters
    ----------
    rpc
        ``rpc(address)``: the scheduler's RPC to a host supervisor.
    layouts
        The orchestrator's registry (name -> layout).
    moves
        The orchestrator's moves (a replica is seeded, and a primary promoted, as one
        of its dictionary's moves: one at a time, followed by its clients).
    candidates
        ``await candidates(name, leaving)``: the workers that may keep a replica.
    spawn
        Runs a coroutine in the background (repairs).
    remove_left
        ``await remove_left(worker, machine, paths)``: removes what a lost host left on
        its machine (``leftovers.remove_paths_on``).
    failing
        The managers failing over (``(name, manager) -> supervisor``, kept by
        :class:`.failover.Failover`): not placed meanwhile.
    suspected
        ``suspected(supervisor)``: whether that host is suspected (its lease revoked:
        see :mod:`.failover`): no replica is seeded onto it, and it is not called.
    """

    def __init__(
        self,
        rpc: Callable[[str], Any],
        layouts: dict[str, Layout],
        moves: Moves,
        candidates: Callable[[str, str], Awaitable[list[Candidate]]],
        spawn: Callable[[Awaitable[Any]], None],
        remove_left: Callable[[str, str, list[str]], Awaitable[Any]] | None = None,
        failing: Mapping[tuple[str, int], str] | None = None,
        suspected: Callable[[str], bool] | None = None,
    ) -> None:
        self.rpc = rpc
        self.layouts = layouts
        self.moves = moves
        self.candidates = candidates
        self.spawn = spawn
        self.remove_left = remove_left
        self.failing: Mapping[tuple[str, int], str] = {} if failing is None else failing
        self._queued: set[tuple[str, str]] = set()  # repairs asked, not begun (see repair)
        self._again: set[str] = set()  # dictionaries short of replicas, tried again later
        self._later: dict[str, float] = {}  # ...after this many seconds (doubled each time)
        self._suspected: Callable[[str], bool] = suspected or (lambda supervisor: False)
        #: name -> manager -> its replicas
        self.placed: dict[str, dict[int, list[Replica]]] = {}
        #: Supervisors whose hosts were lost (the latest :data:`MOST_GONE`; one that joins
        #: again is taken out): never asked again, since a call to one waits out the
        #: connect timeout (30 s) while its dictionary's placements wait behind it.
        self.gone: dict[str, None] = {}
        moves.on_served = self.follow

    def __repr__(self) -> str:
        n = sum(len(r) for per in self.placed.values() for r in per.values())
        return f"<Replicas dicts={len(self.placed)} replicas={n}>"

    # -- what is where ------------------------------------------------------------------

    def of(self, name: str) -> dict[int, list[Replica]]:
        return self.placed.setdefault(name, {})

    def supervisors(self, name: str) -> set[str]:
        """The host supervisors that keep replicas of ``name``."""
        return {r.supervisor for reps in self.placed.get(name, {}).values() for r in reps}

    def joined(self, supervisor: str, worker: str) -> None:
        """``worker`` joined with its host at ``supervisor``: that host is not gone, and the
        replicas it keeps are kept for ``worker`` now (a nanny restarted its worker at a
        new address: they are checked with that worker when it leaves)."""
        self.gone.pop(supervisor, None)
        for per in self.placed.values():
            for reps in per.values():
                reps[:] = [
                    replace(r, worker=worker) if r.supervisor == supervisor else r for r in reps
                ]

    def supervisors_for(self, worker: str) -> set[str]:
        """The host supervisors that keep replicas for ``worker`` (of any dictionary)."""
        return {
            r.supervisor
            for per in self.placed.values()
            for reps in per.values()
            for r in reps
            if r.worker == worker
        }

    def forget(self, name: str) -> None:
        """``name`` was destroyed (its replicas with it, by their hosts)."""
        self.placed.pop(name, None)

    def _load(self) -> dict[str, int]:
        load: dict[str, int] = {}
        for per in self.placed.values():
            for reps in per.values():
                for r in reps:
                    load[r.supervisor] = load.get(r.supervisor, 0) + 1
        return load

    # -- seeding (create, repair) -------------------------------------------------------------

    async def place(self, name: str, leaving: str = "", queued: bool = False) -> int:
        """Give every manager of ``name`` the replicas it is short of (none on ``leaving``'s
        host); how many were made.  One that finds no worker stays short (said in stats)."""
        return await self.moves.serially(name, self._place(name, leaving, queued), followed=False)

    async def _place(self, name: str, leaving: str, queued: bool = False) -> int:
        if queued:  # (begun: a repair asked from now on is another one)
            self._queued.discard((name, leaving))
        layout = self.layouts.get(name)
        if layout is None or not layout.options.replicas:
            return 0
        made, short = 0, False
        for mid in range(len(layout.managers)):
            # (each manager as it is now: a failover or a move may have changed it while
            # the ones before were seeded)
            layout = self.layouts.get(name)
            if layout is None:
                break
            m = layout.managers[mid]
            if m.lost or m.supervisor in self.gone or (name, mid) in self.failing:
                continue  # (its failover places its replicas once one took over)
            have = self.of(name).setdefault(mid, [])
            await self._reckon(layout, m, have)
            while len(have) < layout.options.replicas:
                choice = replica_targets(
                    [
                        c
                        for c in await self.candidates(name, leaving)
                        if c.supervisor not in self.gone
                        and not self._suspected(c.supervisor)
                        and c.satisfies(m.policy)
                    ],
                    m,
                    have,
                    self._load(),
                )
                if not choice:
                    fit = "" if m.policy is None else f" that satisfies {m.policy!r}"
                    logger.warning(
                        "ddict %s: manager %d has %d of its %d replicas: no other "
                        "worker%s can keep one",
                        name,
                        mid,
                        len(have),
                        layout.options.replicas,
                        fit,
                    )
                    short = True
                    break
                try:
                    r = await self._seed(layout, m, choice[0])
                except Exception as e:  # noqa: BLE001 - said; stays short until the next try
                    logger.warning(
                        "ddict %s: seeding a replica of manager %d on %s failed: %r",
                        name,
                        mid,
                        choice[0].worker,
                        e,
                    )
                    short = True
                    break
                if r.supervisor in self.gone:  # (its host was lost while it was seeded)
                    await self._detach(self.layouts.get(name) or layout, r)
                    continue
                have.append(r)
                made += 1
        if not short:
            self._later.pop(name, None)
        elif name not in self._again:  # (a worker whose host was not up yet, a replica cut
            self._again.add(name)  # off meanwhile: tried again a while later)
            self.spawn(self._place_again(name))
        return made

    async def _place_again(self, name: str) -> None:
        """:meth:`repair` ``name`` once more, :data:`PLACE_AGAIN` seconds from now, twice
        that after the next that leaves a manager short, and so on up to a minute."""
        pause = self._later[name] = min(60.0, 2 * self._later.get(name, PLACE_AGAIN / 2))
        await asyncio.sleep(pause)
        self._again.discard(name)
        await self.repair(name)

    async def _reckon(self, layout: Layout, primary: ManagerInfo, have: list[Replica]) -> None:
        """Forget (and drop) the replicas of ``have`` that ``primary`` no longer ships to: it
        dropped them (a timeout, a full shard; they are stale, never promoted) without the
        orchestrator knowing."""
        if not have:
            return
        try:
            live = await self.rpc(primary.supervisor).ddict_replica_targets(
                uid=layout.uid, manager_id=primary.manager_id
            )
            raise_from_wire(live)
        except Exception:  # noqa: BLE001 - not known now: left as they are
            return
        shipping = {tuple(a) for a in live}
        for r in [r for r in have if address_of(r) not in shipping]:
            have.remove(r)
            logger.warning(
                "ddict %s: manager %d no longer ships to its replica on %s: it is made again",
                layout.name,
                primary.manager_id,
                r.worker,
            )
            await self.drop(layout.uid, r)

    async def _seed(self, layout: Layout, primary: ManagerInfo, target: Candidate) -> Replica:
        """Copy ``primary``'s shard to ``target``'s host as a new replica (the primary's
        writes paused meanwhile) and have the primary ship to it."""
        mid, uid = primary.manager_id, layout.uid
        src = self.rpc(primary.supervisor)
        held = await src.ddict_replica_hold(uid=uid, manager_id=mid)
        raise_from_wire(held)
        seeded = False
        try:
            info = await self.rpc(target.supervisor).ddict_replica_seed(
                spec=held["spec"],
                manager_id=mid,
                source=asdict(primary),
                used=held["used_bytes"],
                map_size=held["map_size"],
                worker=target.worker,
            )
            raise_from_wire(info)
            seeded = True
            raise_from_wire(
                await src.ddict_replica_targets(uid=uid, manager_id=mid, add=info, release=True)
            )
        except BaseException:
            try:  # (the primary's writes resume; its host may be what failed)
                raise_from_wire(
                    await src.ddict_replica_targets(uid=uid, manager_id=mid, release=True)
                )
            except Exception as e:  # noqa: BLE001 - the first failure is the one to report
                logger.warning(
                    "ddict %s: resuming manager %d after a failed seed: %r", layout.name, mid, e
                )
            if seeded:
                await self.drop(
                    uid, Replica(mid, target.worker, target.supervisor, target.host_id, {})
                )
            raise
        logger.info(
            "ddict %s: manager %d has a replica on %s (%d bytes copied)",
            layout.name,
            mid,
            target.worker,
            held["used_bytes"],
        )
        return Replica(mid, target.worker, target.supervisor, target.host_id, info)

    async def drop(self, uid: str, r: Replica) -> None:
        """Replica ``r``'s host stops keeping it (its shard deleted), if it can be reached."""
        try:
            await self.rpc(r.supervisor).ddict_replica_drop(uid=uid, manager_id=r.manager_id)
        except Exception as e:  # noqa: BLE001 - its host is gone, or its shard is swept later
            logger.info(
                "ddict: dropping the replica of manager %d on %s failed: %r",
                r.manager_id,
                r.worker,
                e,
            )

    # -- a lost host ---------------------------------------------------------------------------

    def host_lost(self, supervisor: str) -> list[tuple[str, Replica]]:
        """``supervisor``'s host is gone: it is never called again, and the replicas it
        kept are forgotten (returned: their primaries stop shipping to them, see
        :meth:`forget_lost`)."""
        self.gone[supervisor] = None
        while len(self.gone) > MOST_GONE:
            del self.gone[next(iter(self.gone))]
        gone: list[tuple[str, Replica]] = []
        for name, per in self.placed.items():
            for reps in per.values():
                gone += [(name, r) for r in reps if r.supervisor == supervisor]
                reps[:] = [r for r in reps if r.supervisor != supervisor]
        return gone

    async def forget_lost(
        self,
        gone: list[tuple[str, Replica]],
        supervisor: str,
        left: list[tuple[str, str, list[str]]],
        failing: list[str],
    ) -> None:
        """What a lost host leaves: its files on its machine (``left``: ``(worker, machine,
        paths)``), and its replicas (``gone``), which their primaries stop shipping to and
        which are made again elsewhere (but for the dictionaries of ``failing``, placed
        once their failover is done)."""
        if left and self.remove_left is not None:
            paths = sorted({p for _, _, ps in left for p in ps if p})
            await self.remove_left(left[0][0], left[0][1], paths)
        for name, r in gone:  # (their primaries would drop them at their next write)
            if name in self.layouts:
                await self._detach(self.layouts[name], r)
        for name in sorted({name for name, _ in gone} - set(failing)):
            await self.repair(name, leaving=supervisor)

    async def repair(self, name: str, leaving: str = "") -> None:
        """:meth:`place`, its failure said (the next change of the cluster tries again); a
        repair asked while another waits to begin is that one."""
        if name not in self.layouts or (name, leaving) in self._queued:
            return
        self._queued.add((name, leaving))
        try:
            await self.place(name, leaving, queued=True)
        except Exception as e:  # noqa: BLE001 - said; the next change tries again
            logger.warning("ddict %s: repairing its replicas failed: %r", name, e)
        finally:
            self._queued.discard((name, leaving))

    def host_restarted(self, supervisor: str) -> None:
        """``supervisor`` restarted its host process: the replicas it kept died with the
        old one, and those of its managers may lack the last write the old one committed
        (it died before shipping it): all are made again."""
        stale: list[tuple[str, Replica]] = []
        for name, per in self.placed.items():
            layout = self.layouts.get(name)
            for mid, reps in per.items():
                here = layout is not None and layout.managers[mid].supervisor == supervisor
                stale += [(name, r) for r in reps if here or r.supervisor == supervisor]
                reps[:] = [] if here else [r for r in reps if r.supervisor != supervisor]
        if stale:
            logger.warning(
                "ddict: the host process of %s restarted: %d replicas are made again",
                supervisor,
                len(stale),
            )
            self.spawn(self._remake(stale))

    async def _remake(self, stale: list[tuple[str, Replica]]) -> None:
        for name, r in stale:
            layout = self.layouts.get(name)
            if layout is not None:
                await self._detach(layout, r)
                await self.drop(layout.uid, r)
        for name in sorted({name for name, _ in stale}):
            await self.repair(name)

    # -- moves -----------------------------------------------------------------------------------

    async def follow(self, name: str, info: ManagerInfo) -> None:
        """Manager ``info`` serves at a new place (a move): its replicas are shipped to from
        there on, before any client is told where it is.  A replica kept by its new host
        process is dropped (made again elsewhere)."""
        layout = self.layouts.get(name)
        reps = self.placed.get(name, {}).get(info.manager_id, [])
        if layout is None or not reps:
            return
        keep = []
        for r in reps:
            if r.supervisor == info.supervisor:
                await self.drop(layout.uid, r)
                continue
            try:
                raise_from_wire(
                    await self.rpc(info.supervisor).ddict_replica_targets(
                        uid=layout.uid, manager_id=info.manager_id, add=r.info
                    )
                )
            except Exception as e:  # noqa: BLE001 - dropped: made again elsewhere
                logger.warning(
                    "ddict %s: manager %d's replica on %s did not follow its move: %r",
                    name,
                    info.manager_id,
                    r.worker,
                    e,
                )
                await self.drop(layout.uid, r)
                continue
            keep.append(r)
        reps[:] = keep
        if len(keep) < layout.options.replicas:
            self.spawn(self.repair(name))

    async def evacuate(self, supervisor: str) -> int:
        """Make the replicas kept by ``supervisor``'s host (which retires) again on other
        hosts first, then drop them there; how many were made."""
        made = 0
        for name, per in list(self.placed.items()):
            leaving = [r for reps in per.values() for r in reps if r.supervisor == supervisor]
            layout = self.layouts.get(name)
            if not leaving or layout is None:
                continue
            for r in leaving:  # (short now: placed again below, while they still ship)
                per[r.manager_id].remove(r)
            made += await self.place(name, leaving=supervisor)
            for r in leaving:
                await self._detach(layout, r)
                await self.drop(layout.uid, r)
        return made

    async def _detach(self, layout: Layout, r: Replica) -> None:
        """The primary stops shipping to replica ``r``."""
        primary = layout.managers[r.manager_id]
        if primary.lost or primary.supervisor in self.gone or self._suspected(primary.supervisor):
            return
        try:
            raise_from_wire(
                await self.rpc(primary.supervisor).ddict_replica_targets(
                    uid=layout.uid, manager_id=r.manager_id, remove=[list(address_of(r))]
                )
            )
        except Exception as e:  # noqa: BLE001 - it drops the replica when it fails to ship
            logger.info(
                "ddict %s: manager %d kept shipping to %s: %r",
                layout.name,
                r.manager_id,
                r.worker,
                e,
            )
