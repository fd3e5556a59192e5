"""A host process's half of replicas: the replicas it keeps, and its managers' shipping.

A dictionary created with ``replicas=k`` has each manager's shard copied to ``k``
other host processes (on other machines when the cluster has several; the
orchestrator places them, see :mod:`dask_ddict.cluster.replicas`):

* **seeding** a replica is the copy half of a move: the primary's writes pause
  (``Moving.hold``), the replica's host copies its used pages
  (:class:`~dask_ddict.transport.whole_checkpoints.ShardPages`, :func:`seed`), the
  primary adds the replica to its :class:`Shipper` and resumes (:func:`targets`);
* **shipping**: every write transaction that a replicated manager commits is
  recorded (:mod:`dask_ddict.shard.changes`) and sent to each replica
  (:class:`~dask_ddict.transport.whole_checkpoints.Replicate`, numbered) before
  the write is answered, so an acknowledged write is in every replica of the
  replica set that the orchestrator knows.  A replica that does not take it (its
  host gone or cut off, out of step) is not dropped here: the primary stops
  answering (its requests get ``LEASE``) and asks the orchestrator, through its
  lease's renewal (:mod:`.lease`), to take that replica out of the set, which it
  does (that replica is then never promoted) unless it is failing the primary over;
  only then is the write answered.  A primary that cannot reach the orchestrator
  either acknowledges nothing more;
* **promotion**: when the primary's host is lost, the orchestrator has a replica's
  host serve the manager over the replica's shard (:func:`promote`), as a move
  to this machine would.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .. import config
from .._blocking import will_block
from ..errors import DDictLeaseError, DDictManagerMovedError, DDictManagerUnavailableError
from ..layout import ManagerInfo, host_id
from ..shard import changes
from ..shard.lease_word import lease_clock
from ..shard.store import ShardStore
from ..transport.socket_client import HostLink
from ..transport.tls_settings import default_security
from ..transport.whole_checkpoints import Replicate
from . import hygiene, moves
from .control import DictSpec
from .lease import RETRY
from .replica_store import Replica

if TYPE_CHECKING:
    from ..shard.manager import Manager
    from .hosted import HostedDict
    from .lease import LeaseKeeper

logger = logging.getLogger(__name__)


class Host(Protocol):
    """What replicas need of the host process (``process.Host``)."""

    dicts: dict[bytes, HostedDict]

    def hosted(self, spec: DictSpec) -> HostedDict: ...


def seed(
    host: Host,
    spec: DictSpec,
    mid: int,
    source: dict[str, Any],
    used: int,
    map_size: int,
    tls: bool,
) -> str:
    """Keep a new replica of manager ``mid``: its shard copied from ``source`` (the primary,
    held by ``Moving.hold``).  Returns the replica's path."""
    path, lock = moves.receive(spec, mid, source, used, map_size, tls)  # (claimed there)
    store = None
    try:
        store = _replica_store(spec, path)
        hosted = host.dicts[bytes.fromhex(spec.uid)] = host.hosted(spec)
    except BaseException:
        if store is not None:
            store.close()
        import shutil

        shutil.rmtree(path, ignore_errors=True)  # (before its lock goes: a copy of ours)
        hygiene.release(lock)
        raise
    old = hosted.replicas.pop(mid, None)
    hosted.replicas[mid] = Replica(mid, store, lock)
    if old is not None:
        old.close()
    logger.info(
        "ddict host %d: keeps a replica of manager %d of %s (%d bytes)",
        os.getpid(),
        mid,
        spec.name,
        used,
    )
    return path


def drop(host: Host, uid: str, mid: int) -> bool:
    """Stop keeping the replica of manager ``mid`` of ``uid`` here (its shard deleted)."""
    hosted = host.dicts.get(bytes.fromhex(uid))
    replica = None if hosted is None else hosted.replicas.pop(mid, None)
    if replica is None:
        return False
    replica.close()
    return True


def take_replica(host: Host, uid: str, mid: int, old_path: str) -> tuple[str, int | None]:
    """The path of the replica of manager ``mid`` here, closed as a replica so that the
    host can serve it as the manager (a promotion), and its owner lock, which the
    caller releases once the manager claimed the shard (no sweep takes it in between).
    The lost primary's shard, if it is on this machine, is removed (no process serves
    it any more)."""
    hosted = host.dicts.get(bytes.fromhex(uid))
    replica = None if hosted is None else hosted.replicas.pop(mid, None)
    if replica is None:
        raise DDictManagerUnavailableError(
            f"process {os.getpid()} keeps no replica of manager {mid} of {uid}"
        )
    if replica.stale:  # (it may lack acknowledged writes: never the primary)
        replica.close()
        raise DDictManagerUnavailableError(
            f"the replica of manager {mid} of {uid} here is stale: {replica.stale}"
        )
    lock, replica.lock = replica.lock, None
    try:
        replica.close(destroy=False)
        path = replica.store.path
        if not os.path.isfile(os.path.join(path, "data.mdb")):
            raise DDictManagerUnavailableError(
                f"the replica of manager {mid} of {uid} here lost its shard {path}"
            )
    except BaseException:
        hygiene.release(lock)
        raise
    if old_path and old_path != path:
        try:
            hygiene.remove([old_path])  # (only if every process that owned it is dead)
        except OSError as e:  # (its space comes back at the next sweep)
            logger.warning("ddict host: removing the lost primary's shard %s: %r", old_path, e)
    return path, lock


def give_back(host: Host, spec: DictSpec, mid: int, path: str, lock: int | None) -> None:
    """Keep again, as a replica, the shard that :func:`take_replica` handed over to a
    promotion whose opening failed: it holds every write its lost primary acknowledged
    and may be the last copy of them, so it stays claimed here (a sweep takes an
    unclaimed shard) for the orchestrator's next try.  One that cannot be re-opened is
    marked kept before its owner lock goes: never swept."""
    try:
        store = _replica_store(spec, path)
    except Exception as e:  # noqa: BLE001 - the promotion's own failure is the one raised
        logger.error("ddict host: the replica of manager %d (%s) is kept: %r", mid, path, e)
        hygiene.mark_kept(path)
        hygiene.release(lock)
        return
    hosted = host.dicts[bytes.fromhex(spec.uid)] = host.hosted(spec)
    hosted.replicas[mid] = Replica(mid, store, lock)


def _replica_store(spec: DictSpec, path: str) -> ShardStore:
    """The shard of a replica at ``path`` (a copy received, or one given back), opened."""
    return ShardStore(
        path,
        spec.capacity,
        spec.options.manager_pool_full_thresh,
        indexed=spec.options.wait_for_keys,
        create=False,
    )


# -- a primary's side ---------------------------------------------------------------------------


#: Change sets sent to a replica without waiting (a batch's) before the oldest is awaited.
MOST_PENDING = 16


@dataclass
class Target:
    """One replica of a primary: where it is kept, the last change set sent to it, and the
    answers of those sent without waiting (collected before the next acknowledged write
    is answered)."""

    info: ManagerInfo
    link: HostLink
    seq: int = 0
    pending: deque[Callable[[], Any]] = field(default_factory=deque)


class Shipper:
    """A replicated manager's replicas: every commit's changes are sent to each of them
    before the write is answered (``ShardStore.replicate``)."""

    def __init__(
        self,
        spec: DictSpec,
        manager_id: int,
        tls: bool,
        keeper: LeaseKeeper | None = None,
        hosted: HostedDict | None = None,
        manager: Manager | None = None,
    ) -> None:
        self.spec = spec
        self.manager_id = manager_id
        self.tls = tls
        self.targets: list[Target] = []
        #: ``deposed(where)``: a replica took over from this primary (its host was taken
        #: for lost): the host stops serving it here (set by the host).
        self.deposed: Callable[[str], None] | None = None
        self.shipped = 0  # change sets sent (to each replica)
        self.timeout = config.get_seconds("replica.timeout")  # (read once: every write waits)
        #: The host's lease, through which the orchestrator is asked to drop a replica
        #: (``None``, or one not required: no orchestrator this host reaches, so a replica
        #: that fails is dropped here, as nothing can be cut off in one machine's process).
        self.keeper = keeper
        self.hosted, self.manager = hosted, manager
        #: Addresses of replicas that failed a write and that the orchestrator has not
        #: taken out of the replica set yet: the manager answers nobody meanwhile.
        self.doubts: set[tuple[Any, ...]] = set()
        self._failing: list[tuple[Target, BaseException]] = []  # (this write's: _settle)
        self.closed = False

    def __repr__(self) -> str:
        return (
            f"<Shipper manager={self.manager_id} replicas={len(self.targets)} "
            f"shipped={self.shipped}>"
        )

    def add(self, info: ManagerInfo) -> None:
        ssl_context = None
        if self.tls:
            ssl_context = default_security().get_connection_args("client")["ssl_context"]
        spec = self.spec
        link = HostLink(
            info,
            spec.uid,
            spec.secret,
            spec.name,
            use_uds=bool(config.get("local-transport"))
            and info.host_id == host_id()
            and os.path.exists(info.uds_path),
            ssl_context=ssl_context,
            max_value=1 << 62,
        )
        self.remove(info.address)
        try:  # (change set 0: the replica numbers this primary's from 1)
            link.call(Replicate(0, [], 0, self.timeout), self.manager_id)
        except BaseException:
            link.close()
            raise
        self._retarget([*self.targets, Target(info, link)])

    def _retarget(self, targets: list[Target]) -> None:
        """Ship to ``targets`` from now on; the host's kept ``stats`` answers, which count
        them, are stale (``HostedDict.changes``)."""
        self.targets = targets
        if self.hosted is not None:
            self.hosted.reshaped += 1

    def remove(self, address: tuple[str, str, int] | list[Any]) -> None:
        """Stop shipping to the replica at ``address`` (the orchestrator's word)."""
        keep = []
        for t in self.targets:
            if list(t.info.address) == list(address):
                t.link.close()
            else:
                keep.append(t)
        if len(keep) != len(self.targets):
            self._retarget(keep)
        if tuple(address) in self.doubts:
            self.dropped([tuple(address)])

    def ship(self, recorded: list[changes.Change], later: bool = False) -> None:
        """Send one commit's changes to every replica, in order; wait until each applied
        them (and every change set sent before), unless ``later`` (a batch's records,
        answered at its end, when the next write waits for them all).  A replica that
        fails is taken out of the set by the orchestrator before this returns
        (:meth:`_settle`); one that took over deposes this primary (``MOVED``)."""
        parts, nbytes = changes.encode(recorded)
        self.shipped += 1
        if self.targets and not later:
            will_block()  # (each replica's answer: a host's event loop moves on meanwhile)
        for t in list(self.targets):
            t.seq += 1
            self._step(
                t,
                lambda t=t: t.pending.append(  # type: ignore[misc]
                    t.link.send(Replicate(t.seq, parts, nbytes, self.timeout), self.manager_id)
                ),
            )
            while len(t.pending) > MOST_PENDING and self._live(t):
                will_block()  # (the oldest answer is waited for: the event loop moves on)
                self._step(t, t.pending.popleft())
        if later:
            self._settle()
        else:
            self.drain()

    def drain(self) -> None:
        """Wait until every replica applied every change set sent to it."""
        if any(t.pending for t in self.targets):
            will_block()
        for t in list(self.targets):
            while t.pending and self._live(t):
                self._step(t, t.pending.popleft())
        self._settle()

    def _live(self, t: Target) -> bool:
        return t in self.targets and all(f is not t for f, _ in self._failing)

    def _step(self, t: Target, step: Callable[[], Any]) -> None:
        if not self._live(t):
            return
        try:
            step()
        except DDictManagerMovedError as e:  # a replica serves it now: this write and
            if self.deposed is not None:  # the next ones are answered MOVED, not here
                self.deposed(f"{t.info.hostname} ({t.info.worker})")
            raise DDictManagerMovedError(f"manager {self.manager_id} {e.message}") from None
        except Exception as e:  # noqa: BLE001 - a replica that cannot follow: see _settle
            t.pending.clear()
            self._failing.append((t, e))

    def _settle(self) -> None:
        """The replicas that failed this write (after every other one was sent it): dropped
        here if no orchestrator can be asked (:attr:`keeper`), else :meth:`_doubt`."""
        if not self._failing:
            return
        failing, self._failing = self._failing, []
        keeper = self.keeper
        if keeper is None or not keeper.required:
            for t, e in failing:
                self._drop(t, e)
        else:
            self._doubt(failing, keeper)

    def _drop(self, t: Target, e: BaseException) -> None:
        """Drop replica ``t`` here (no orchestrator to ask: see :attr:`keeper`)."""
        if t in self.targets:
            self._retarget([o for o in self.targets if o is not t])
        try:  # (and told so if it can hear it: it must never be promoted now)
            t.link.call(Replicate(-1, [], 0, 1.0), self.manager_id)
        except Exception:  # noqa: BLE001 - gone, or unreachable: said below
            pass
        t.link.close()
        logger.warning(
            "ddict %s: manager %d dropped its replica on %s (%s): %s",
            self.spec.name,
            self.manager_id,
            t.info.hostname,
            t.info.worker,
            e,
        )

    def _doubt(self, failing: list[tuple[Target, BaseException]], keeper: LeaseKeeper) -> None:
        """Replicas ``failing`` failed a write: nothing is acknowledged without them until
        the orchestrator took them out of the replica set (:meth:`dropped`, from the
        lease's renewal that asked it, once for all of them).  Meanwhile this manager
        answers nobody (``LEASE``), and the writes that wait for its shipping lock write
        nothing (``store.fenced``)."""
        addresses = {tuple(t.info.address) for t, _ in failing}
        why = (
            "; ".join(
                f"its replica on {t.info.hostname} ({t.info.worker}) failed a write ({e})"
                for t, e in failing
            )
            + "; the orchestrator has not taken it out of the replica set yet"
        )
        self.doubts |= addresses
        if self.manager is not None:
            self.manager.store.fenced = why
            if self.hosted is not None:
                self.hosted.fence(self.manager, why)
        logger.warning("ddict %s: manager %d: %s (asked now)", self.spec.name, self.manager_id, why)
        will_block()
        answered = keeper.answer(max(0.0, keeper.until - lease_clock()) + RETRY)
        if self.closed:
            raise DDictManagerMovedError(
                f"manager {self.manager_id} is served elsewhere now: "
                "this write was not acknowledged"
            )
        if addresses & self.doubts:
            said = "it did not agree" if answered else "it did not answer"
            raise DDictLeaseError(
                f"manager {self.manager_id}: {why} ({said}): this write is not "
                "acknowledged (it may be applied once the replica set is "
                "settled, or not at all)"
            )

    def dropped(self, addresses: list[tuple[Any, ...]]) -> None:
        """The orchestrator took the replicas at ``addresses`` out of the replica set (a
        lease renewal's answer): they are dropped, and without doubts the manager serves."""
        gone = set(addresses)
        out = [t for t in self.targets if tuple(t.info.address) in gone]
        if out:
            self._retarget([t for t in self.targets if all(t is not o for o in out)])
        for t in out:
            t.pending.clear()
            t.link.close()
            logger.warning(
                "ddict %s: manager %d dropped its replica on %s (%s): the "
                "orchestrator took it out of the replica set",
                self.spec.name,
                self.manager_id,
                t.info.hostname,
                t.info.worker,
            )
        self.doubts -= gone
        if self.manager is not None and not self.targets:
            self.manager.store.replicate = None
        if not self.doubts and self.hosted is not None and self.manager is not None:
            self.hosted.confirm(self.manager_id, self.manager.term)

    def close(self) -> None:
        self.closed = True
        for t in self.targets:
            t.pending.clear()
            t.link.close()
        self._retarget([])


def targets(
    manager: Manager,
    spec: DictSpec,
    tls: bool,
    add: dict[str, Any] | None,
    remove: list[Any],
    release: bool,
    deposed: Callable[[str], None] | None = None,
    keeper: LeaseKeeper | None = None,
    hosted: HostedDict | None = None,
) -> list[list[Any]]:
    """Change ``manager``'s replicas: ``add`` one (its host's layout fields), ``remove``
    those at these host addresses; then end a ``Moving.hold`` (``release``).  Returns the
    host addresses of the replicas it ships to now (without ``add`` or ``remove``: which
    are live, for the orchestrator's reckoning)."""
    shipper = manager.shipper
    try:
        with manager.store.shipping:  # (no commit is being shipped meanwhile)
            if shipper is None and add is not None:
                shipper = manager.shipper = Shipper(
                    spec, manager.manager_id, tls, keeper, hosted, manager
                )
                shipper.deposed = deposed
            if shipper is not None:
                for address in remove:
                    shipper.remove(address)
                if add is not None:
                    fields = set(ManagerInfo.__dataclass_fields__)
                    shipper.add(ManagerInfo(**{k: v for k, v in add.items() if k in fields}))
                manager.store.replicate = shipper.ship if shipper.targets else None
    finally:
        if release:
            manager.unhold()
    return [] if shipper is None else [list(t.info.address) for t in shipper.targets]
