"""Failover: a replica takes over a primary whose host is lost or cut off, and never two.

When a primary's host is lost (SIGKILL, a dead machine) its replicas hold every
write it acknowledged (see :mod:`.replicas`), so one of them can take over.
Under a partition neither side can tell "lost" from "cut off": a primary cut off
from the orchestrator and its replicas may still be reached by a client.  So the
replica set and the right to serve belong to the orchestrator alone:

* a primary acknowledges a write only once every replica of the set that the
  orchestrator knows has it; one that cannot reach a replica asks the orchestrator
  to take that replica out of the set (a renewal's ``doubts``, :meth:`Failover.lease`),
  which it does (the replica is then never promoted) unless it is failing that
  primary over;
* a host serves its replicated primaries only while it holds a *lease*
  (:mod:`.leases`); a replica is promoted only once the old primary's lease is
  surely over, under a new term (``ManagerInfo.term``); it serves once its host's
  next renewal confirms it, and the old primary learns at its own next renewal
  that it was deposed (and keeps its shard aside until told to discard it);
* a host whose lease ran out without a renewal and whose nanny does not answer is
  *suspected* (:meth:`Failover.watch`): its leased primaries fail over.  If no
  replica can be reached either (the orchestrator is the one cut off), a primary
  waits, unavailable but never marked lost, until one can, or until its own host
  renews again and is reinstated (its replicas have all it acknowledged).

A primary whose host is *proven* gone (its nanny refuses connections, or its
supervisor said that its host process ended) holds no lease: its replica takes
over at once, as it did before leases.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from .. import config
from ..layout import Layout, ManagerInfo
from .leases import Leases, verdicts
from .liveness import ANSWERED, GONE, ask
from .moves import Move
from .replicas import Replica, Replicas, address_of

logger = logging.getLogger(__name__)

#: Seconds between tries to promote a manager none of whose replicas answered.
PROMOTE_AGAIN = 1.0


class Failover:
    """The failovers of every dictionary of one orchestrator, and its hosts' leases.

    Parameters
    ----------
    replicas
        Where the replicas are (:class:`.Replicas`, which it shares ``failing`` with).
    leases
        The hosts' leases; ``None``: none are kept (``ddict.lease.duration: null``), and
        a replica takes over as soon as its primary's host is found lost.
    failing
        ``(name, manager) -> supervisor`` of the managers failing over (shared with
        ``replicas``, which does not place them meanwhile).
    probe
        ``await probe(supervisor)``: whether that host's nanny answers
        (``liveness.ANSWERED``, ``GONE`` or ``UNKNOWN``).
    """

    def __init__(
        self,
        replicas: Replicas,
        leases: Leases | None,
        failing: dict[tuple[str, int], str],
        probe: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        self.replicas = replicas
        self.leases = leases
        self.failing = failing
        self.probe = probe
        #: (name, manager) whose promotion call is under way (its primary is not
        #: reinstated meanwhile: the replica may be serving it already, unconfirmed).
        self.promoting: set[tuple[str, int]] = set()
        #: Hosts that failed to take a primary's write (cut off from it?), until when (of
        #: ``time.monotonic``) no replica is seeded onto them: a seed would wait for them.
        self.doubtful: dict[str, float] = {}
        self._probing: set[str] = set()  # (overdue hosts whose nannies are being asked)
        self._changed: asyncio.Condition | None = None

    def __repr__(self) -> str:
        return f"<Failover failing={len(self.failing)} leases={self.leases!r}>"

    def suspected(self, supervisor: str) -> bool:
        """Whether ``supervisor``'s host is suspected (its lease revoked), or failed a
        primary's write a short while ago (:attr:`doubtful`)."""
        if self.leases is None:
            return False
        return (
            supervisor in self.leases.revoked
            or self.doubtful.get(supervisor, 0.0) > time.monotonic()
        )

    def _revoked(self, supervisor: str) -> bool:
        return self.leases is not None and supervisor in self.leases.revoked

    # -- a host lost, or suspected -----------------------------------------------------------

    def host_lost(self, supervisor: str, why: str, proven: bool = True) -> dict[str, list[int]]:
        """``supervisor``'s host is gone (``proven``: its supervisor said that its host
        process ended; else its nanny does not answer, or refuses connections): the
        replicas it kept are forgotten, and each primary there that has a replica fails
        over (in the background, counted as a move of its dictionary at once, so clients
        asking for the layout wait for it) once its lease is surely over.  Returns the
        primaries failing over from there, by dictionary: not lost."""
        replicas = self.replicas
        gone = replicas.host_lost(supervisor)
        failing = self._fail_over_from(supervisor, why, proven)
        # what the lost host leaves on its machine: the failed-over shards, the replicas
        left = [
            (m.worker, m.host_id, [m.store_path, os.path.dirname(m.uds_path)])
            for name, mids in failing.items()
            for m in replicas.layouts[name].managers
            if m.manager_id in mids
        ] + [(r.worker, r.host_id, [r.info.get("store_path", "")]) for _, r in gone]
        if gone or left:
            replicas.spawn(replicas.forget_lost(gone, supervisor, left, sorted(failing)))
        return self._failing_at(supervisor)

    def suspect(self, supervisor: str, why: str) -> dict[str, list[int]]:
        """``supervisor``'s host did not renew its lease and its nanny does not answer (a
        partition, a stopped machine): its leased primaries fail over once its lease is
        surely over.  The replicas it keeps stay known (a primary that cannot reach one
        asks to drop it); the host is not taken for gone, and one that renews before its
        primaries were promoted serves them again (:meth:`lease`)."""
        return self._fail_over_from(supervisor, why, False)

    async def watch(self) -> None:
        """Every third of a lease: a host that serves leased primaries and did not renew is
        suspected if its nanny does not answer either; one whose nanny answers (its host
        process restarting or stalled) keeps them."""
        leases = self.leases
        if leases is None or self.probe is None:
            return
        while True:
            await asyncio.sleep(leases.duration / 3)
            for supervisor in leases.overdue():
                if supervisor not in self._probing:
                    self._probing.add(supervisor)
                    self.replicas.spawn(self._suspect_if_silent(supervisor))

    async def _suspect_if_silent(self, supervisor: str) -> None:
        assert self.leases is not None and self.probe is not None
        try:
            said = await self.probe(supervisor)
        finally:
            self._probing.discard(supervisor)
        if said == ANSWERED or supervisor not in self.leases.overdue():
            return  # (alive, or it renewed while its nanny was asked)
        why = (
            f"its host did not renew its lease within {self.leases.duration:g} s and its "
            f"nanny {'refuses connections' if said == GONE else 'does not answer'}"
        )
        failing = self.suspect(supervisor, why)
        if failing:
            logger.warning(
                "ddict: the host of %s is suspected (%s): managers %s fail over",
                supervisor,
                why,
                failing,
            )

    def _fail_over_from(self, supervisor: str, why: str, proven: bool) -> dict[str, list[int]]:
        """Fail over every primary at ``supervisor``'s host that has a replica and is not
        failing over already (see :meth:`host_lost`); the new ones, by dictionary."""
        if self.leases is not None:
            self.leases.revoke(supervisor)
            if proven:
                self.leases.ended(supervisor)
        self._wake()
        replicas = self.replicas
        failing: dict[str, list[int]] = {}
        for name, layout in replicas.layouts.items():
            for m in layout.managers:
                if (
                    m.supervisor == supervisor
                    and not m.lost
                    and (name, m.manager_id) not in self.failing
                    and replicas.placed.get(name, {}).get(m.manager_id)
                ):
                    failing.setdefault(name, []).append(m.manager_id)
                    self.failing[(name, m.manager_id)] = supervisor
        for name, mids in failing.items():
            for mid in mids:  # (each at once: one whose replicas cannot be reached does not
                replicas.moves.begin(name)  # hold up the others)
                replicas.spawn(self._fail_over(name, mid, supervisor, why))
        return failing

    def _failing_at(self, supervisor: str) -> dict[str, list[int]]:
        """The primaries failing over from ``supervisor``, by dictionary."""
        out: dict[str, list[int]] = {}
        for (name, mid), sup in self.failing.items():
            if sup == supervisor:
                out.setdefault(name, []).append(mid)
        return out

    async def _fail_over(self, name: str, mid: int, supervisor: str, why: str) -> None:
        """Promote a replica of manager ``mid`` (:meth:`_promote`), then make the replicas it
        is short of.  The failover counts as a move of its dictionary under way (clients
        that ask for the layout wait for it) until it is done, or until a first round of
        its replicas did not answer (clients then keep asking)."""
        moves = self.replicas.moves
        counted = [True]

        async def stalled() -> None:
            if counted[0]:
                counted[0] = False
                await moves.end(name)

        try:
            await self._promote(name, mid, why, stalled)
        finally:
            await stalled()
        await self.replicas.repair(name, leaving=supervisor)

    # -- promotion ----------------------------------------------------------------------------

    async def _lease_over(self, supervisor: str, key: tuple[str, int]) -> bool:
        """Wait until ``supervisor``'s host surely holds no lease; ``False`` if ``key`` stops
        failing over meanwhile (its host was reinstated)."""
        if self.leases is None:
            return self.failing.get(key) == supervisor
        if self._changed is None:
            self._changed = asyncio.Condition()
        left = self.leases.left(supervisor)
        if left > 0:
            logger.info(
                "ddict %s: manager %d fails over in %.1f s, once the lease of its host "
                "(%s) is surely over",
                key[0],
                key[1],
                left,
                supervisor,
            )
        while self.failing.get(key) == supervisor:
            left = self.leases.left(supervisor)
            if left <= 0:
                return True
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    pass
        return False

    def _wake(self) -> None:
        """A lease ended, or a failover's state changed: the failovers waiting look again."""
        cond = self._changed
        if cond is None:
            return

        async def notify() -> None:
            async with cond:
                cond.notify_all()

        self.replicas.spawn(notify())

    async def _promote(
        self, name: str, mid: int, why: str, stalled: Callable[[], Awaitable[None]]
    ) -> None:
        """Have a replica of manager ``mid`` serve it, once its primary's lease is surely
        over, under the next term.  A replica that answers no (none kept there, or a
        stale one) is not tried again; while some did not answer at all (cut off too, or
        gone: only Dask's removal of its worker says so) or failed to open their shard
        (kept there as a replica), they are tried again every :data:`PROMOTE_AGAIN` s,
        until one serves or the primary's host is reinstated (``stalled()`` is awaited
        after the first such round); with none left, the manager is lost."""
        key, replicas = (name, mid), self.replicas
        layout = replicas.layouts.get(name)
        if layout is None:
            self.failing.pop(key, None)
            return
        old = layout.managers[mid]
        began = time.monotonic()
        refused: set[str] = set()
        failed: set[str] = set()  # (said once each)
        said_waiting = False
        while True:
            if not await self._lease_over(old.supervisor, key):
                return  # (reinstated)
            layout = replicas.layouts.get(name)
            if layout is None:
                self.failing.pop(key, None)
                return
            reps = [
                r
                for r in replicas.of(name).get(mid, [])
                if r.supervisor not in replicas.gone and r.supervisor not in refused
            ]
            unknown = False
            for r in sorted(reps, key=lambda r: self.suspected(r.supervisor)):
                said, reply = await self._promote_on(layout, old, r)
                if said == ANSWERED and not (isinstance(reply, dict) and "error" in reply):
                    self._promoted(name, old, r, reply, why, began)
                    return
                if said == ANSWERED and reply["error"][2] == "MANAGER_UNAVAILABLE":
                    refused.add(r.supervisor)  # (it answered no: stale, or no replica there)
                    logger.warning(
                        "ddict %s: replica of manager %d on %s could not take over: %s",
                        name,
                        mid,
                        r.worker,
                        reply["error"][1],
                    )
                else:  # (a refused connection is no proof either: a firewall's REJECT; and
                    # a replica whose opening failed is kept there, for the next try)
                    unknown = True
                    if said == ANSWERED and r.supervisor not in failed:
                        failed.add(r.supervisor)
                        logger.warning(
                            "ddict %s: replica of manager %d on %s could not take over "
                            "yet (tried again every %g s): %s",
                            name,
                            mid,
                            r.worker,
                            PROMOTE_AGAIN,
                            reply["error"][1],
                        )
            if not unknown or self.failing.get(key) != old.supervisor:
                break
            if not said_waiting:
                said_waiting = True
                logger.warning(
                    "ddict %s: manager %d waits for a replica to take over: none "
                    "answered (tried again every %g s)",
                    name,
                    mid,
                    PROMOTE_AGAIN,
                )
                await stalled()
            await asyncio.sleep(PROMOTE_AGAIN)
        if self.failing.pop(key, None) is None:
            return
        replicas.placed.get(name, {}).pop(mid, None)
        replicas.moves._place(
            name,
            replace(old, lost=True, lost_why=f"{why}; and none of its replicas could take over"),
        )
        logger.warning("ddict %s: manager %d is lost with its host and its replicas", name, mid)

    async def _promote_on(self, layout: Layout, old: ManagerInfo, r: Replica) -> tuple[str, Any]:
        """Ask replica ``r``'s host to serve ``old``'s manager under the next term (see
        :func:`.liveness.ask`); the promotion counts as under way meanwhile."""
        key = (layout.name, old.manager_id)
        self.promoting.add(key)
        try:
            return await ask(
                self.replicas.rpc(r.supervisor).ddict_replica_promote(
                    uid=layout.uid,
                    manager_id=old.manager_id,
                    worker=r.worker,
                    old_path=old.store_path,
                    term=old.term + 1,
                ),
                r.supervisor,
                _promote_timeout(),
            )
        finally:
            self.promoting.discard(key)

    def _promoted(
        self, name: str, old: ManagerInfo, r: Replica, reply: Any, why: str, began: float
    ) -> None:
        """Replica ``r`` serves ``old``'s manager now (``reply``: where): the layout says so
        in a new epoch; the other replicas (which may lag it) are made again."""
        replicas, mid = self.replicas, old.manager_id
        self.failing.pop((name, mid), None)
        fields = set(ManagerInfo.__dataclass_fields__) - {"supervisor", "term", "policy"}
        info = ManagerInfo(
            **{k: v for k, v in reply[0].items() if k in fields},
            supervisor=r.supervisor,
            term=old.term + 1,
            policy=old.policy,
        )
        others = [o for o in replicas.of(name).pop(mid, []) if o.supervisor != r.supervisor]
        replicas.moves._place(name, info)
        layout = replicas.layouts.get(name)
        for other in others:
            if layout is not None:
                replicas.spawn(replicas.drop(layout.uid, other))
        replicas.moves._done(
            Move(
                name,
                mid,
                old.worker,
                r.worker,
                f"failover: {why}",
                False,
                0,
                time.monotonic() - began,
                time.time(),
            )
        )
        logger.warning(
            "ddict %s: manager %d failed over to its replica on %s (%s)", name, mid, r.worker, why
        )

    # -- a host's renewal (see .leases) ------------------------------------------------------

    def lease(self, supervisor: str, report: dict[str, Any]) -> dict[str, Any]:
        """A host renews its lease (the ``ddict_lease`` handler): it is granted one unless
        it is suspected; a suspected host that is back serves again those of its
        primaries that no replica took over (reinstated); what it serves is confirmed or
        deposed (:func:`.verdicts`); replicas it asks to drop are taken out of the
        replica set (never promoted then) if it still serves their primary; shards it
        keeps aside are discarded once their manager has its replicas again."""
        if self.leases is None:
            return {"lease": None}
        replicas = self.replicas
        by_uid = {layout.uid: layout for layout in replicas.layouts.values()}
        serving = [(str(u), int(m), int(t)) for u, m, t in report.get("serving", ())]
        if self._revoked(supervisor) and supervisor not in replicas.gone:
            self._reinstate(supervisor, serving, by_uid)
        said = verdicts(by_uid, supervisor, serving)
        dropped = []
        for uid, mid, term, addresses in report.get("doubts", ()):
            layout = by_uid.get(uid)
            if layout is None or self._revoked(supervisor) or not 0 <= mid < layout.num_managers:
                continue
            m = layout.managers[mid]
            if m.supervisor != supervisor or m.term != term or m.lost:
                continue
            self._take_out(layout, mid, {tuple(a) for a in addresses})
            dropped.append([uid, mid, addresses])
        discard = []
        for uid, mid, path in report.get("aside", ()):
            layout = by_uid.get(uid)
            if (
                layout is None
                or not 0 <= mid < layout.num_managers
                or (
                    layout.managers[mid].store_path != path
                    and (
                        layout.managers[mid].lost
                        or len(replicas.of(layout.name).get(mid, ())) >= layout.options.replicas
                    )
                )
            ):
                discard.append([uid, mid, path])  # (its dictionary is gone, or has it elsewhere)
        granted = self.leases.grant(supervisor, bool(serving))
        return {
            "lease": granted,
            "confirmed": [list(k) for k in said.confirmed],
            "deposed": [[u, m, w, t] for (u, m, t), w in said.deposed.items()],
            "dropped": dropped,
            "discard": discard,
        }

    def _reinstate(
        self, supervisor: str, serving: list[tuple[str, int, int]], by_uid: dict[str, Layout]
    ) -> None:
        """Suspected ``supervisor``'s host is back: each of its primaries still failing over,
        with no promotion call under way and no replica serving it, is its again (its
        replicas hold every write it acknowledged: it acknowledged none without them); once
        none is failing over, it is granted leases again."""
        for uid, mid, term in serving:
            layout = by_uid.get(uid)
            if layout is None or not 0 <= mid < layout.num_managers:
                continue
            key, m = (layout.name, mid), layout.managers[mid]
            if (
                self.failing.get(key) == supervisor
                and key not in self.promoting
                and m.supervisor == supervisor
                and m.term == term
            ):
                del self.failing[key]
                logger.warning(
                    "ddict %s: manager %d stays at %s: its host renewed its lease "
                    "before a replica took over",
                    layout.name,
                    mid,
                    m.worker,
                )
        if supervisor not in self.failing.values():
            assert self.leases is not None
            self.leases.restore(supervisor)
            logger.warning("ddict: the host of %s renews its lease again", supervisor)
        self._wake()

    def _take_out(self, layout: Layout, mid: int, addresses: set[tuple[Any, ...]]) -> None:
        """The primary of manager ``mid`` cannot reach its replicas at ``addresses``: they
        leave the replica set (never promoted now), dropped where they are (if they can
        be reached), and new ones are made."""
        replicas = self.replicas
        reps = replicas.of(layout.name).get(mid, [])
        out = [r for r in reps if address_of(r) in addresses]
        if not out:
            return
        reps[:] = [r for r in reps if address_of(r) not in addresses]
        assert self.leases is not None
        for r in out:
            self.doubtful[r.supervisor] = time.monotonic() + 3 * self.leases.duration
            logger.warning(
                "ddict %s: manager %d's replica on %s failed a write: it leaves the "
                "replica set (made again elsewhere)",
                layout.name,
                mid,
                r.worker,
            )
            replicas.spawn(replicas.drop(layout.uid, r))
        replicas.spawn(replicas.repair(layout.name))

    def lease_ended(self, supervisor: str) -> None:
        """``supervisor`` said that its host process ended: it holds no lease."""
        if self.leases is not None:
            self.leases.ended(supervisor)
        self._wake()


def _promote_timeout() -> float:
    """Seconds a promotion call may take (opening a shard; its supervisor may finish
    another control call first); one without an answer is tried again later."""
    return 4 * (config.get_seconds("host.probe-timeout") or 3.0)
