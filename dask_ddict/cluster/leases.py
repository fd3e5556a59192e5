"""Leases: which host processes may serve the primaries of replicated dictionaries, and until when.

A replica takes over from a primary only when the orchestrator is sure that the
primary answers nobody any more.  A partition makes that impossible to see from
outside: a primary cut off from the orchestrator and its replicas may still be
reached by a client.  So a host process serves the primaries of replicated
dictionaries only while it holds a *lease* from the orchestrator, which it renews
every half of the lease (one request per host process, whatever the number of
managers it serves: ``ddict_lease``).  The host counts its lease from just before
it asked, on its own clock, so the lease ends no later than ``duration`` after the
orchestrator sent the grant.  The orchestrator takes it as over ``duration *
RATE + margin`` after the grant, by its own clock: :data:`RATE` covers clocks that
count at different rates, ``margin`` a host that checks late (a stalled thread).

A host whose lease the orchestrator stops granting (:meth:`Leases.revoke`: it is
failing over that host's primaries) serves none of them once its lease runs out,
whatever it can or cannot reach; the orchestrator promotes a replica only after
:meth:`Leases.ends_at`.  A host known to have ended (:meth:`Leases.ended`: its
nanny refuses connections, or its supervisor said that its host process ended)
holds nothing: its replicas are promoted at once.

The report a host renews with names each primary it serves and the *term* it
serves it under (the layout's ``ManagerInfo.term``, which every change of
primary moves on); :func:`verdicts` compares it with the layouts, so that a host
learns that it was replaced before it serves anything again.

Pure data: the clock is injected, and nothing here waits or calls; unit-tested
without a cluster (``tests/test_leases.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ..layout import Layout, ManagerInfo

#: How much faster than the orchestrator's clock a host's clock may count (1%: quartz
#: clocks drift by tens of parts per million; a host's lease may last this much longer).
RATE = 1.01


@dataclass
class Held:
    """What the orchestrator knows of one host's lease."""

    granted: float  # the orchestrator's clock when it last sent a grant
    serving: bool  # whether the host said it serves primaries of replicated dictionaries


@dataclass
class Leases:
    """The leases of every host process of one orchestrator.

    Parameters
    ----------
    duration
        Seconds a grant lasts (``ddict.lease.duration``).
    margin
        Seconds added before a lease is taken as over (``ddict.lease.margin``).
    clock
        The orchestrator's clock (``time.monotonic``).
    """

    duration: float
    margin: float
    clock: Callable[[], float] = time.monotonic
    held: dict[str, Held] = field(default_factory=dict)
    #: Supervisors whose hosts get no grant (their primaries are failing over).
    revoked: set[str] = field(default_factory=set)

    def grant(self, supervisor: str, serving: bool) -> float:
        """A host renews (``serving``: it serves leased primaries): the seconds it holds
        its lease from when it asked, or 0 if it holds none (revoked)."""
        if supervisor in self.revoked:
            held = self.held.get(supervisor)
            if held is not None:
                held.serving = held.serving or serving
            return 0.0
        self.held[supervisor] = Held(self.clock(), serving)
        return self.duration

    def revoke(self, supervisor: str) -> None:
        """Grant ``supervisor``'s host nothing more (its primaries fail over)."""
        self.revoked.add(supervisor)

    def restore(self, supervisor: str) -> None:
        """Grant ``supervisor``'s host again (it is back and serves its primaries)."""
        self.revoked.discard(supervisor)

    def ended(self, supervisor: str) -> None:
        """``supervisor``'s host process is known to have ended: it holds no lease now."""
        self.held.pop(supervisor, None)

    def forget(self, supervisor: str) -> None:
        """``supervisor`` is gone for good (or joins again as a new host)."""
        self.held.pop(supervisor, None)
        self.revoked.discard(supervisor)

    def ends_at(self, supervisor: str) -> float:
        """The orchestrator's time from which ``supervisor``'s host surely holds no lease
        (its last grant's end, with :data:`RATE` and the margin; now if it has none)."""
        held = self.held.get(supervisor)
        if held is None:
            return self.clock()
        return held.granted + self.duration * RATE + self.margin

    def left(self, supervisor: str) -> float:
        """Seconds until :meth:`ends_at` (0 when it is over already)."""
        return max(0.0, self.ends_at(supervisor) - self.clock())

    def overdue(self) -> list[str]:
        """Hosts that serve leased primaries, whose lease ended without a renewal, and
        that are not revoked yet: suspects (the orchestrator asks their nannies)."""
        now = self.clock()
        return sorted(
            s
            for s, h in self.held.items()
            if h.serving
            and s not in self.revoked
            and now >= h.granted + self.duration * RATE + self.margin
        )


@dataclass(frozen=True)
class Verdicts:
    """What the orchestrator answers about the primaries a host reported.

    ``confirmed``: ``(uid, manager, term)`` the host serves under the layout's term;
    ``deposed``: ``(uid, manager, term) -> where it is served now`` (the host stops
    serving it and keeps its shard aside).  Each names the term the host reported: the
    host applies a verdict only to the manager it reported, never to one that came back
    to it under a newer term while the answer was on its way.  A primary in neither is
    pending: a change that names this host is under way, or its dictionary is not
    registered (yet)."""

    confirmed: list[tuple[str, int, int]]
    deposed: dict[tuple[str, int, int], str]


def verdicts(
    by_uid: Mapping[str, Layout], supervisor: str, reported: Iterable[tuple[str, int, int]]
) -> Verdicts:
    """``reported`` (``(uid, manager, term)`` a host serves) against the layouts.

    A primary is confirmed where the layout names this host and the same term; it is
    deposed where the layout has a newer term, or another host at the same term, or
    has given it up (lost, parked); it is pending where the layout is older than it
    (a promotion or a move to this host is not in the layout yet)."""
    confirmed: list[tuple[str, int, int]] = []
    deposed: dict[tuple[str, int, int], str] = {}
    for uid, mid, term in reported:
        layout = by_uid.get(uid)
        if layout is None or not 0 <= mid < layout.num_managers:
            continue
        m = layout.managers[mid]
        if m.term == term and m.supervisor == supervisor and not m.lost:
            confirmed.append((uid, mid, term))
        elif m.term >= term:
            deposed[(uid, mid, term)] = where(m)
    return Verdicts(confirmed, deposed)


def where(m: ManagerInfo) -> str:
    """Where manager ``m`` is served, in words (a deposed host answers ``MOVED`` with it)."""
    if m.parked:
        return "nowhere (parked)"
    if m.lost:
        return f"nowhere (lost: {m.lost_why})"
    return f"{m.hostname} (worker {m.worker})"
