"""HostedDict: one dictionary as a host process serves it.

The host process (:class:`~dask_ddict.host.process.Host`) makes one for each dictionary
it serves managers or keeps replicas of, and its server (:mod:`.server`) finds one by the
uid a connection's handshake names: everything a request of that dictionary needs is
here, so that the serving loop looks up nothing else.  It holds

* the managers that serve, and those *fenced* (opened, but not serving until the
  orchestrator confirms them, or until it drops a replica that failed a write: their
  requests are answered ``LEASE``), with :meth:`HostedDict.fence` and
  :meth:`HostedDict.confirm` moving a manager between the two;
* where managers that moved away went (answered ``MOVED``), and the replicas of other
  hosts' managers kept here (:mod:`.replica_store`);
* the managers' generation words and the broadcast answers kept under them
  (``FanOut``), the pin boards of its shards (zero-copy values), the requests served
  (:mod:`.served`), and the host's lease, which its primaries need while ``leased``
  (:mod:`.lease`).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from .. import kernels
from .served import Served

if TYPE_CHECKING:
    from ..shard.generations import Generations
    from ..shard.manager import Manager
    from ..shard.pinboard import BoardReader
    from .lease import LeaseKeeper
    from .replica_store import Replica


#: Seconds a host reuses the persisted ids it listed for its kept stats answers.
PERSISTED_FRESH = 1.0


class HostedDict(kernels.HostedState):
    """One dictionary's managers on this host, and the secret that admits its clients
    (``managers``, ``lease`` and ``leased`` are fields of its base, which the plain
    server reads as such: :class:`~dask_ddict.kernels.HostedState`)."""

    __slots__ = (
        "uid",
        "key",
        "name",
        "secret",
        "generations",
        "answers",
        "pins",
        "served",
        "moved",
        "replicas",
        "fenced",
        "reshaped",
        "_fencing",
        "_persisted",
    )

    def __init__(
        self,
        uid: str,
        name: str,
        secret: str,
        generations: Generations | None = None,
        pins: BoardReader | None = None,
        lease: LeaseKeeper | None = None,
    ) -> None:
        self.uid = uid
        self.key = bytes.fromhex(uid)  # as clients name it in their HELLO
        self.name = name
        self.secret = secret.encode()
        self.managers: dict[int, Manager] = {}
        #: Its managers' generation words here, and broadcast answers kept under them.
        self.generations = generations
        self.answers: dict[Any, Any] = {}
        #: What processes of this host pin of its shards (zero-copy values).
        self.pins = pins
        #: The requests served for its managers here (their stats report them).
        self.served = Served()
        #: Managers that moved to another host process: where to (answered ``MOVED``),
        #: and their shard's size (a request's body up to it is read, then answered).
        self.moved: dict[int, tuple[str, int]] = {}
        #: Replicas of other host processes' managers kept here (see :mod:`.replicas`).
        self.replicas: dict[int, Replica] = {}
        #: This host's lease, which its primaries need while ``leased`` (a replicated
        #: dictionary, on a cluster whose orchestrator this host reaches: see :mod:`.lease`).
        self.lease = lease
        self.leased = False
        #: Its primaries that do not serve now, and why: waiting for the orchestrator to
        #: confirm them, or to drop a replica that failed a write (answered ``LEASE``).
        self.fenced: dict[int, tuple[Manager, str]] = {}
        #: How many times one of its primaries' replica sets changed (``Shipper``).
        self.reshaped = 0
        self._fencing = threading.Lock()  # (fence and confirm: a writer's, the lease's thread)
        self._persisted: tuple[float, tuple[int, ...]] = (-PERSISTED_FRESH, ())  # (read at, ids)

    def __repr__(self) -> str:
        return f"<HostedDict {self.name!r} managers={sorted(self.managers)}>"

    def find(self, mid: int) -> Manager | None:
        """Manager ``mid`` here, serving or fenced."""
        manager = self.managers.get(mid)
        if manager is None and mid in self.fenced:
            manager = self.fenced[mid][0]
        return manager

    def fence(self, manager: Manager, why: str) -> None:
        """``manager`` stops serving (its requests are answered ``LEASE``, ``why``) until
        :meth:`confirm`; a fenced one keeps its first reason."""
        mid = manager.manager_id
        with self._fencing:
            if self.managers.get(mid) is manager:
                del self.managers[mid]
            if mid not in self.fenced:
                self.fenced[mid] = (manager, why)

    def confirm(self, mid: int, term: int) -> None:
        """The orchestrator confirmed manager ``mid`` under ``term``, which serves from now
        on unless a replica of it is in doubt (see ``Shipper.doubts``)."""
        with self._fencing:
            fenced = self.fenced.get(mid)
            if fenced is None or fenced[0].term != term:
                return
            manager = fenced[0]
            if manager.shipper is not None and manager.shipper.doubts:
                return
            self.managers[mid] = manager
            del self.fenced[mid]
            manager.store.fenced = ""

    def changes(self) -> int:
        """What a kept ``stats`` answer holds besides its shards: a number that moves
        with the pin boards, the requests served, its primaries' replica sets, the
        operations their deferred queues hold and the checkpoints persisted by every
        manager (``FanOut``'s ``pins``), none of which commits here (a replica made or
        dropped, a deferred operation that timed out, the last manager's part of a
        persist committed by another host).  A hash of them, not a sum: one that goes
        up as another goes down moves it too."""
        pinned = 0 if self.pins is None else int(self.pins.changes())
        managers = list(self.managers.values())
        waiting = tuple(len(m._deferred) for m in managers)
        parts = (pinned, self.served.moves(), self.reshaped, waiting, self._persisted_ids(managers))
        return hash(parts) & ((1 << 62) - 1)

    def _persisted_ids(self, managers: list[Manager]) -> Any:
        """The checkpoints persisted by every manager, as one persisting manager's store
        lists them (every manager's lists the same), read again once
        :data:`PERSISTED_FRESH` seconds passed: a listing is real I/O (an object store's
        request), which a stats poll answered from a kept answer would otherwise pay
        each time.  Any other request served here moves the served count, so only an
        answer polled with nothing else served between can be that much older.  A
        listing that fails gives a word never seen before: no kept answer is reused,
        and each manager's own ``stats`` says what failed."""
        now = time.monotonic()
        at, ids = self._persisted
        if now - at < PERSISTED_FRESH:
            return ids
        persisting = next((m for m in managers if m.persister is not None), None)
        try:
            ids = () if persisting is None else tuple(persisting.persisted_ids())
        except Exception:  # noqa: BLE001 - reported by the manager's own stats
            return ("unread", now)
        self._persisted = (now, ids)
        return ids
