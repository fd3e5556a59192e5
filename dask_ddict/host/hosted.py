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
from typing import TYPE_CHECKING, Any

from .served import Served

if TYPE_CHECKING:
    from ..shard.generations import Generations
    from ..shard.manager import Manager
    from ..shard.pinboard import BoardReader
    from .lease import LeaseKeeper
    from .replica_store import Replica


class HostedDict:
    """One dictionary's managers on this host, and the secret that admits its clients."""

    __slots__ = (
        "uid",
        "key",
        "name",
        "secret",
        "managers",
        "generations",
        "answers",
        "pins",
        "served",
        "moved",
        "replicas",
        "lease",
        "leased",
        "fenced",
        "reshaped",
        "_fencing",
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
        up as another goes down moves it too.  The persisted ids are read from each
        persisting manager's store, as its ``stats`` reads them: a kept answer then
        saves the rest of the answer, not that listing."""
        pinned = 0 if self.pins is None else int(self.pins.changes())
        managers = list(self.managers.values())
        waiting = tuple(len(m._deferred) for m in managers)
        persisted = tuple(tuple(m.persisted_ids()) for m in managers if m.persister is not None)
        parts = (pinned, self.served.moves(), self.reshaped, waiting, persisted)
        return hash(parts) & ((1 << 62) - 1)
