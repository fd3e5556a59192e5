"""A host process's lease: it serves the primaries of replicated dictionaries only while it holds one.

Why, and the orchestrator's side: :mod:`dask_ddict.cluster.leases`.  Here:

* :class:`LeaseKeeper` renews this host process's lease, in a thread of its own
  (one request to the orchestrator every half of the lease, never on a client's
  path), reporting the primaries it serves with their terms, the replicas it asks
  to drop, and the shards it keeps aside; it writes the lease's end into the lease
  word (:mod:`dask_ddict.shard.lease_word`) for same-host readers;
* :func:`report` and :func:`apply` are what a renewal says and how its answer is
  applied to the host: a manager that the orchestrator *confirms* is served (a
  leased manager starts unserved wherever it opens: created, moved here, promoted,
  re-opened by a new incarnation, and learns first that it is the primary); one it
  *deposes* stops serving for good and keeps its shard aside until the
  orchestrator says to *discard* it; a replica it agreed to *drop* (a primary's
  replica failed a write, and the orchestrator took it out of the replica set, see
  :meth:`~.replicas.Shipper.ship`) is dropped and the primary answers again.

:meth:`LeaseKeeper.valid` is what the server checks for every request of a
replicated primary here: the lease holds now.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from .. import kernels
from ..errors import DDictLeaseError
from ..shard.lease_word import LeaseWord, lease_clock

if TYPE_CHECKING:
    from ..shard.manager import Manager

logger = logging.getLogger(__name__)

#: Seconds between tries while the orchestrator does not answer, or grants nothing.
RETRY = 0.5
#: A lease is renewed every ``1 / RENEW`` of it: half of it is left for tries again
#: (every :data:`RETRY` s) when the orchestrator does not answer a renewal at once.
RENEW = 2
#: First pause before a renewal asked again for a manager that waits for its verdict
#: (doubled up to half the lease): a new primary serves once it is confirmed.
SOON = 0.02


class Hosted(Protocol):
    """What the lease needs of a dictionary served here (``hosted.HostedDict``)."""

    uid: str
    leased: bool
    managers: dict[int, Manager]
    fenced: dict[int, tuple[Manager, str]]

    def find(self, mid: int) -> Manager | None: ...
    def confirm(self, mid: int, term: int) -> None: ...


class Host(Protocol):
    """What the lease needs of the host process (``process.Host``)."""

    @property
    def dicts(self) -> Mapping[bytes, Hosted]: ...

    #: Deposed primaries' shards kept aside: (uid, manager) -> path.
    aside: dict[tuple[str, int], str]

    def depose(self, uid: str, manager: Manager, where: str) -> None: ...
    def discard(self, uid: str, mid: int, path: str) -> None: ...


def report(host: Host) -> dict[str, Any]:
    """What a renewal tells the orchestrator: the leased primaries this host serves or
    waits to serve (``[uid, manager, term]``), the replicas its primaries ask to drop
    (``[uid, manager, term, [addresses]]``), the shards it keeps aside."""
    serving: list[list[Any]] = []
    doubts: list[list[Any]] = []
    for hosted in list(host.dicts.values()):
        if not hosted.leased:
            continue
        for manager in [*hosted.managers.values(), *(m for m, _ in hosted.fenced.values())]:
            serving.append([hosted.uid, manager.manager_id, manager.term])
            shipper = manager.shipper
            if shipper is not None and shipper.doubts:
                doubts.append(
                    [
                        hosted.uid,
                        manager.manager_id,
                        manager.term,
                        [list(a) for a in shipper.doubts],
                    ]
                )
    aside = [[uid, mid, path] for (uid, mid), path in list(host.aside.items())]
    return {"serving": serving, "doubts": doubts, "aside": aside}


def apply(host: Host, answer: dict[str, Any]) -> None:
    """Apply the orchestrator's answer to a renewal (see :func:`report`).  A verdict
    names the term that the renewal reported: a manager that came back here under a
    newer term while the answer was on its way is not the one judged, and is left be."""
    by_uid = {h.uid: h for h in list(host.dicts.values())}
    for uid, mid, where, term in answer.get("deposed", ()):
        hosted = by_uid.get(uid)
        manager = None if hosted is None else hosted.find(mid)
        if hosted is not None and manager is not None and manager.term == term:
            host.depose(uid, manager, where)
    for uid, mid, addresses in answer.get("dropped", ()):
        hosted = by_uid.get(uid)
        manager = None if hosted is None else hosted.find(mid)
        if manager is not None and manager.shipper is not None:
            manager.shipper.dropped([tuple(a) for a in addresses])
    for uid, mid, term in answer.get("confirmed", ()):
        hosted = by_uid.get(uid)
        if hosted is not None:
            hosted.confirm(mid, term)
    for uid, mid, path in answer.get("discard", ()):
        host.discard(uid, mid, path)


class LeaseKeeper(kernels.LeaseState):
    """This host process's lease, renewed in a thread of its own (``required`` and
    ``until`` are fields of its base, which the plain server reads as such:
    :class:`~dask_ddict.kernels.LeaseState`).

    Parameters
    ----------
    scheduler
        The orchestrator's address (the scheduler's), or ``""``: no orchestrator this
        process can reach (an in-process cluster), so no lease is needed: nothing can
        be cut off from it.
    supervisor
        The address that names this host to the orchestrator (its nanny's, or its
        nanny-less worker's).
    security
        The cluster's ``distributed.Security`` (TLS), or ``None``.
    host
        The host process (:class:`Host`).
    word
        The lease word that same-host readers check.
    """

    def __init__(
        self, scheduler: str, supervisor: str, security: Any, host: Host, word: LeaseWord
    ) -> None:
        self.scheduler = scheduler
        self.supervisor = supervisor
        self.security = security
        self.host = host
        self.word = word
        #: Whether leases are kept at all: the orchestrator says so at the first renewal
        #: (``ddict.lease.duration: null`` there turns them off); until then, yes.
        self.required = bool(scheduler)
        self.until = 0.0  # (of lease_clock) the lease's end
        self.duration = 0.0  # seconds the last grant lasted
        self.granted = False  # whether the last answer granted a lease (else revoked)
        self.started = 0  # renewals sent
        self.rounds = 0  # renewals answered (the ``started``-th at most)
        self._changed = threading.Condition()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        if not self.required:
            word.set(float("inf"))

    def __repr__(self) -> str:
        left = self.until - lease_clock()
        return f"<LeaseKeeper {self.supervisor} left={left:.3f}s rounds={self.rounds}>"

    # -- what the server checks ---------------------------------------------------------

    def valid(self) -> bool:
        """Whether this host may serve its leased primaries now."""
        return not self.required or lease_clock() < self.until

    def check(self, name: str = "") -> None:
        """Raise :class:`DDictLeaseError` unless :meth:`valid`."""
        if not self.valid():
            raise self.lapsed(name)

    def lapsed(self, name: str = "") -> DDictLeaseError:
        what = f"DDict {name!r}'s primaries" if name else "its primaries"
        if self.rounds == 0:
            why = "it has not renewed its lease with the orchestrator yet"
        else:
            why = (
                "its lease from the orchestrator lapsed (it cannot reach the orchestrator, "
                "or the orchestrator is failing its primaries over)"
            )
        return DDictLeaseError(f"host process {os.getpid()} does not serve {what} now: {why}")

    # -- the renewals --------------------------------------------------------------------

    def start(self) -> None:
        if not self.required or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="ddict-lease", daemon=True)
        self._thread.start()

    def renew_soon(self) -> None:
        """Renew now (a primary waits for its verdict, or asks to drop a replica)."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # (closed)
                pass

    def answer(self, timeout: float) -> bool:
        """Renew now and wait for the orchestrator's answer to a renewal sent after this
        call (at most ``timeout`` seconds); whether one came (and was applied)."""
        with self._changed:
            due = self.started + 1  # (a renewal under way may have reported before the call)
            self.renew_soon()
            return (
                self._changed.wait_for(lambda: self.rounds >= due or self._closed, timeout)
                and self.rounds >= due
            )

    def wait(self, timeout: float, ready: Callable[[], bool]) -> bool:
        """Renew at once, and again, until ``ready()`` (the lease holds, a manager was
        confirmed), at most ``timeout`` seconds; whether it is.  It stops early when the
        orchestrator answers without a lease: the primaries here are failing over.

        For a request that cannot be refused (a batch's records: see
        ``HostServer._hold_up``), whose client would learn of the refusal only as a
        short count at the batch's end: a scheduler busy for longer than half a lease
        lapses it, and the next renewal brings it back."""
        deadline = time.monotonic() + timeout
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0 or self._closed or not self.required:
                return ready()
            if self.answer(left) and not self.granted:
                return ready()
        return True

    def close(self) -> None:
        self._closed = True
        self.renew_soon()
        with self._changed:
            self._changed.notify_all()

    def _run(self) -> None:
        try:
            asyncio.run(self._renewing())
        except Exception:  # noqa: BLE001 - a bug: said; the lease lapses, the host serves on
            logger.exception("ddict host %d: the lease's thread failed", os.getpid())

    async def _renewing(self) -> None:
        from distributed.core import rpc

        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        args = {} if self.security is None else self.security.get_connection_args("worker")
        orchestrator = rpc(self.scheduler, connection_args=args)
        soon = SOON
        said = False
        reported: dict[str, Any] = {}
        try:
            while not self._closed:
                self._wake.clear()
                now = report(self.host)
                if not any(now.values()) and not any(reported.values()):
                    # (nothing leased here, and the orchestrator knows it: no renewal until
                    # a leased manager opens here, which wakes this thread)
                    await self._wake.wait()
                    continue
                reported = now
                with self._changed:
                    self.started += 1
                began = lease_clock()
                pause = RETRY
                try:
                    answer = await asyncio.wait_for(
                        orchestrator.ddict_lease(supervisor=self.supervisor, report=now),
                        max(RETRY, (self.duration or 3 * RETRY) / 3),
                    )
                except Exception as e:  # noqa: BLE001 - unreachable, closing: tried again
                    if not said:
                        logger.warning(
                            "ddict host %d: renewing its lease failed (tried again every %g s): %r",
                            os.getpid(),
                            RETRY,
                            e,
                        )
                        said = True
                else:
                    said = False
                    after = self._renewed(began, answer)
                    if after is None:
                        return
                    pause = after
                if self._waiting():
                    pause, soon = min(pause, soon), min(2 * soon, max(SOON, pause))
                else:
                    soon = SOON
                try:
                    await asyncio.wait_for(self._wake.wait(), pause)
                except TimeoutError:
                    pass
        finally:
            await orchestrator.close_rpc()

    def _renewed(self, began: float, answer: Any) -> float | None:
        """Apply a renewal's ``answer`` (sent at ``began``): the pause before the next one
        (``None``: no leases on this cluster)."""
        if not isinstance(answer, dict):  # (an orchestrator that does not know leases)
            answer = {"lease": None}
        lease = answer.get("lease", 0.0)
        if lease is None:  # leases are off there: serve freely
            self.required = False
            self.word.set(float("inf"))
            apply(self.host, {"confirmed": report(self.host)["serving"]})
            self._answered()
            return None
        self.granted = bool(lease)
        if not lease:  # revoked: its primaries are failing over, whatever it can reach
            self.until = 0.0
            self.word.set(0.0)
        apply(self.host, answer)
        if lease:
            self.duration = float(lease)
            self.until = began + self.duration
            self.word.set(0.0 if self._doubtful() else self.until)
        self._answered()
        return self.duration / RENEW if lease else RETRY

    def _answered(self) -> None:
        with self._changed:
            self.rounds = self.started
            self._changed.notify_all()

    def _waiting(self) -> bool:
        """Whether a leased manager here waits for a verdict or a replica's drop."""
        return any(hosted.leased and hosted.fenced for hosted in list(self.host.dicts.values()))

    def _doubtful(self) -> bool:
        """Whether a primary here waits for the orchestrator to drop a replica (its shard
        may hold a write that was not acknowledged: same-host readers stop meanwhile)."""
        return any(
            m.shipper is not None and m.shipper.doubts
            for hosted in list(self.host.dicts.values())
            if hosted.leased
            for m in [*hosted.managers.values(), *(m for m, _ in hosted.fenced.values())]
        )
