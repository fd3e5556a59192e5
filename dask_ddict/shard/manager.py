"""Manager: one shard of a dictionary, safe to call from any thread.

A manager is the single owner of its :class:`~dask_ddict.shard.store.ShardStore`.
Its methods are called directly by tasks running in the hosting worker process
(the in-process path) and by the threads of its socket server (same-host and
remote clients), so it is thread-safe and never tied to the worker's event
loop: a hop onto the loop would cost every request more than the request itself
(``docs/design/transport.md``).

Concurrency: writes hold one lock (LMDB allows one writer anyway); reads run
lock-free in their own snapshot transaction.  An operation the working set
cannot do yet (:class:`~dask_ddict.shard.working_set.MustWait`) is deferred
(:mod:`~dask_ddict.shard.deferred`) at its checkpoint: as in Dragon, a write
to that checkpoint retries them, in the order they arrived, before it applies
itself and again after, before it releases the lock and answers.  So they are
applied in arrival order and before any later request, use no CPU while they
wait, are retried anyway after a quiet period without writes, and give up with
``DDictTimeoutError`` when their timeout expires (after a last try).

A put refused for room makes room first when versions no reader can see may
be taking it (:mod:`.room`); at-most-once requests keep their replies
(:mod:`.replies`).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import lmdb

from .. import config, kernels
from .._blocking import acquire, will_block
from .._serialize import dumps_value, loads_value, older_frame
from ..errors import DDictClosedError, DDictError, DDictFullError
from ..layout import wire_term
from .batches import Batches
from .checkpoint_io import CheckpointIO
from .deferred import DeferredQueue
from .key_counts import Tally
from .making_room import MakingRoom, NoRoom
from .moving import Moving
from .reader_marks import CLOSED_DESTROYED, FROZEN, add_waiters, mark_closed
from .replies import AtMostOnce
from .store import ShardStore
from .summaries import Summaries
from .visibility import take_page
from .working_set import MustWait, WorkingSet

if TYPE_CHECKING:  # zarr loads only where a dictionary persists
    from ..persist.persister import Persister
    from .generations import Generations
    from .pinboard import BoardReader

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _Refused(Exception):
    """Record ``index`` of a many-put was refused with ``error`` (its transaction rolls back)."""

    def __init__(self, index: int, error: DDictError) -> None:
        self.index, self.error = index, error


class Manager(
    Summaries, CheckpointIO, AtMostOnce, Batches, MakingRoom, Moving, kernels.ManagerState
):
    """One shard: a store, its working set, and the rules of waiting.

    Parameters
    ----------
    manager_id
        Index of this manager in the dictionary's layout.
    store
        The shard (injected so tests can give a store in a temp directory).
    working_set
        Checkpoint rules over ``store``.
    worker
        Address of the hosting worker, reported in stats.
    """

    manager_id: int
    store: ShardStore
    working_set: WorkingSet
    worker: str
    frozen: bool
    closed: bool

    def __init__(
        self,
        manager_id: int,
        store: ShardStore,
        working_set: WorkingSet,
        *,
        worker: str = "",
        frozen: bool = False,
        read_only: bool = False,
        persister: Persister | None = None,
        pull_shard: Callable[[Manager, str, int], int] | None = None,
    ) -> None:
        self.manager_id = manager_id
        self.store = store
        self.working_set = working_set
        self.worker = worker
        self.read_only = read_only
        self.frozen = frozen or read_only
        self.closed = False
        self.term = 0  # the term it is served under here (see the property)
        self.persister = persister
        self.pull_shard = pull_shard
        self._dumps: dict[int, lmdb.Transaction] = {}  # open replication snapshots
        self._next_dump = 0
        # (taken directly on the hot paths: a Condition's own "with" is Python code; the
        # kernels' lock is threading.Lock's interface, taken by the plain server in C)
        self._mutex = kernels.ManagerLock()
        self._cond = threading.Condition(self._mutex)
        # Operations that wait (under the lock).
        self._deferred = DeferredQueue(self._mutex, config.get_seconds("deferred.quiet-retry"))
        # Checkpoints retiring in the current write transaction, to persist
        # from a snapshot taken before that transaction changed anything.
        self._retiring: list[int] = []
        self._snapshot: lmdb.Transaction | None = None
        self._cache: dict[str, tuple[tuple[int, int, int, bool], Any]] = {}  # see _derived
        self._big_replies: set[int] = set()  # request ids whose kept reply is large
        self._collected = 0  # the window's oldest checkpoint when dead versions were dropped
        #: This dictionary's generation words on this host (set by the host process).
        self.generations: Generations | None = None
        #: What this host's processes hold of the shard as zero-copy values, and how to
        #: ask for it back (set by its host, see room.py).
        self.pins: BoardReader | None = None
        if persister is not None:
            working_set.on_retire = self._on_retire
            persister.report = self._persisted

    @property
    def term(self) -> int:
        """The term it is served under here (``ManagerInfo.term``, see ``cluster.leases``);
        :attr:`wire` is the same as requests carry it."""
        return self._term

    @term.setter
    def term(self, term: int) -> None:
        self._term, self.wire = term, wire_term(term)

    def __repr__(self) -> str:
        return (
            f"<Manager {self.manager_id} worker={self.worker!r} "
            f"window=[{self.working_set.oldest}, {self.working_set.newest}]"
            f"{' frozen' if self.frozen else ''}{' closed' if self.closed else ''}>"
        )

    # -- the two execution disciplines ------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            if self.moved:
                raise self.moved_error()
            raise DDictClosedError(f"manager {self.manager_id} is closed")

    def _attempt(
        self, fn: Callable[[lmdb.Transaction], T], what: str, at: tuple[int, int] | None = None
    ) -> T:
        """Try a write once (lock held): its result, or an exception with nothing
        changed (:class:`MustWait` if it must wait for another write).

        ``at``, the write's ``(checkpoint, client)``: when the shard refused a
        put for room (even one that ``fn`` kept as a batch's error) and versions
        that no reader can see any more may be taking it, the write is rolled
        back, they are collected in a transaction of their own (LMDB reuses freed
        pages only once that commits) and the write is tried once more
        (:meth:`_make_room`).
        """
        if self.closed:
            self._check_open()
        if self.frozen:
            raise DDictError(f"{what}: the dictionary is frozen (read-only)", "INVALID_OPERATION")
        ws, store = self.working_set, self.store
        snap = ws.snapshot()
        store.refused = False
        try:
            result = store.transact(fn if at is None else functools.partial(self._roomy, fn))
        except BaseException as e:
            ws.restore(snap)
            self._drop_retiring()
            if at is not None and isinstance(e, (DDictFullError, NoRoom)) and store.refused:
                try:
                    if self._make_room(*at) or isinstance(e, NoRoom):
                        return self._attempt(fn, what)  # (once: no second collection)
                except DDictFullError as full:
                    self._note_unreleased(full)
                    raise
                self._note_unreleased(e)
            raise
        if self._retiring:
            self._persist_retired()
        return result

    def _write(
        self,
        fn: Callable[[lmdb.Transaction], T],
        timeout: float | None,
        what: str,
        at: tuple[int, int] | None = None,
    ) -> T:
        """Run ``fn`` in a write transaction, deferred while it must wait.

        ``at`` is the write's ``(checkpoint, client)``.  As in Dragon, operations
        deferred at that checkpoint are retried first (they arrived before this
        write, so they land before it) and again once it is done (it may have
        unblocked them), before the lock is released and it returns.  A write
        without ``at`` retries every deferred operation after it.
        """
        chkpt = None if at is None else at[0]
        acquire(self._mutex)  # (a host's event loop moves on rather than wait for it)
        try:
            deferred = self._deferred
            if deferred.waiting:
                deferred.wrote()
                if chkpt is not None and deferred.waiting_at(chkpt):
                    deferred.drain(chkpt)
            try:
                result = self._attempt(fn, what, at)
            except MustWait:
                return deferred.wait(
                    lambda: self._attempt(fn, what, at),
                    timeout,
                    f"{what} on manager {self.manager_id}",
                    -1 if chkpt is None else chkpt,
                )
            if deferred.waiting:
                deferred.drain(chkpt)
            return result
        finally:
            self._mutex.release()

    def _changed(self) -> None:
        """A write outside :meth:`_write` changed the shard (lock held): retry the
        deferred operations it may have unblocked."""
        if self._deferred.waiting:
            self._deferred.wrote()
            self._deferred.drain()

    def _read(
        self,
        fn: Callable[[lmdb.Transaction], T],
        timeout: float | None,
        what: str,
        *,
        counted: bool = False,
        chkpt: int = -1,
    ) -> T:
        """Run ``fn`` in a snapshot transaction, deferred while it must wait.

        ``fn`` returns nothing that refers to the snapshot (it copies what it
        keeps): a deferred read is tried by whichever thread's write unblocks it.
        A ``counted`` wait is counted in the shard while it lasts: same-host
        clients then send their puts here instead of committing them themselves,
        since only a write through this manager retries it.
        """
        try:
            return self._read_once(fn)
        except MustWait:
            return self._wait_read(fn, timeout, what, counted=counted, chkpt=chkpt)

    def _read_once(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        self._check_open()
        with self.store.read() as txn:
            return fn(txn)

    def _wait_read(
        self,
        fn: Callable[[lmdb.Transaction], T],
        timeout: float | None,
        what: str,
        *,
        counted: bool = False,
        chkpt: int = -1,
    ) -> T:
        """:meth:`_read` once ``fn`` had to wait: again under the lock (no write can
        slip in between), then deferred at ``chkpt`` until a write lets it through."""
        will_block()  # (it is likely to: a host's event loop moves to another thread)
        if counted:
            self._count_waiter(1)
        try:
            with self._mutex:
                try:
                    return self._read_once(fn)
                except MustWait:
                    pass
                return self._deferred.wait(
                    lambda: self._read_once(fn),
                    timeout,
                    f"{what} on manager {self.manager_id}",
                    chkpt,
                )
        finally:
            if counted:
                self._count_waiter(-1)

    def _count_waiter(self, n: int) -> None:
        with self._cond:
            if not self.closed:
                with self.store.write() as txn:
                    add_waiters(self.store, txn, n)

    # -- reads ----------------------------------------------------------------

    def get(
        self,
        digest: bytes,
        chkpt: int,
        consume: Callable[[memoryview], T],
        timeout: float | None = None,
    ) -> T:
        """Hand the key's value frame to ``consume`` (a zero-copy view valid only
        during the call) and return what it returns."""
        if self.closed:
            self._check_open()
        ws = self.working_set
        with self.store.env.begin(buffers=True) as txn:  # (_read's first try, inlined)
            try:
                frame = ws.get(txn, digest, chkpt).frame
            except MustWait:
                pass
            else:
                return consume(frame)
        copy = self._wait_read(
            lambda txn: bytes(ws.get(txn, digest, chkpt).frame), timeout, "get", chkpt=chkpt
        )  # (a copy: the snapshot ends with the try)
        return consume(memoryview(copy))

    def get_many(
        self, txn: lmdb.Transaction, digests: list[bytes], chkpt: int, small: int = 0
    ) -> list[Any]:
        """The keys' frames in snapshot ``txn`` (views valid while it lives; those under
        ``small`` bytes copied): ``None`` where absent, ``False`` where the reader must
        wait (it then asks with :meth:`get`)."""
        self._check_open()
        return self.working_set.get_many(txn, digests, chkpt, small)

    def contains(self, digest: bytes, chkpt: int) -> bool:
        return self._read(lambda txn: self.working_set.contains(txn, digest, chkpt), None, "in")

    def page(
        self,
        chkpt: int,
        after: bytes | None,
        keys: bool,
        values: bool,
        max_items: int,
        max_bytes: int,
    ) -> tuple[list[tuple[bytes | None, bytes | None]], bytes | None, bool]:
        """One page of a view: ``(items, last_digest, more)``, with keys and/or values.

        Views are streamed as stateless pages resumed after the last digest, so
        a client that stops iterating early leaves nothing behind.  A shard
        that holds no key at ``chkpt`` answers from its counts, without a scan
        (a broadcast of first pages asks every manager).
        """
        if after is None and self.length(chkpt) == 0:
            return [], None, False

        def fn(txn: lmdb.Transaction) -> tuple[list[Any], bytes | None, bool]:
            return take_page(
                self.working_set.visible(txn, chkpt, after), keys, values, max_items, max_bytes
            )

        return self._read(fn, None, "iteration", chkpt=chkpt)

    def wait_for(self, digest: bytes, chkpt: int, frame: bytes, timeout: float | None) -> None:
        """Block until the key's value at ``chkpt`` serializes to ``frame`` (a raw
        ``bytes`` frame also matches the value as an older version framed it)."""
        ws = self.working_set
        older = functools.cache(lambda: older_frame(frame))  # (only if the formats differ)

        def fn(txn: lmdb.Transaction) -> None:
            ws.check_retired(chkpt)
            e = ws.store.lookup(txn, digest, chkpt)
            if not (
                ws.is_visible(e, chkpt)
                and e is not None
                and (e.frame == frame or (e.frame[0] != frame[0] and e.frame == older()))
            ):
                raise MustWait

        self._read(fn, timeout, "wait_for", counted=True, chkpt=chkpt)

    def newest_checkpoint(self) -> int:
        return self.working_set.newest

    # -- writes ---------------------------------------------------------------

    def put(
        self,
        digest: bytes,
        key: bytes,
        frame: Any,
        chkpt: int,
        client: int,
        *,
        persistent: bool = False,
        timeout: float | None = None,
    ) -> None:
        ws = self.working_set
        acquire(self._mutex)  # (the common case in one transaction, as _write would do it)
        try:
            if not (
                self.closed or self.frozen or self._deferred.waiting or self._retiring
            ) and ws.put_alone(digest, chkpt, key, frame, client):
                return
        finally:
            self._mutex.release()
        self._write(
            lambda txn: ws.put(txn, digest, chkpt, key, frame, client, persistent=persistent),
            timeout,
            "put",
            (chkpt, client),
        )

    def put_many(
        self,
        records: list[tuple[bytes, bytes, Any]],
        chkpt: int,
        client: int,
        *,
        persistent: bool = False,
        timeout: float | None = None,
    ) -> tuple[int, DDictError | None]:
        """Put ``(digest, key, frame)`` records in order, in one transaction.

        Returns how many were put and the error that stopped the next one (the
        records after it are not put: the caller puts them alone).  A record that
        must wait makes the whole call wait and start again, as a single put waits.
        A refused record leaves nothing of itself: the transaction that met it is
        rolled back, and the records before it are put again without it (what a
        put does before it is refused, e.g. moving the window, is never kept).
        """
        ws = self.working_set
        n, refused = len(records), None

        def fn(txn: lmdb.Transaction) -> None:
            tally = Tally(self.store, txn)
            for i, (digest, key, frame) in enumerate(records[:n]):
                try:
                    ws.put(
                        txn, digest, chkpt, key, frame, client, persistent=persistent, tally=tally
                    )
                except DDictError as e:
                    raise _Refused(i, e) from None
            tally.settle()

        while n:
            try:
                self._write(fn, timeout, "put", (chkpt, client))
                break
            except _Refused as r:
                n, refused = r.index, r.error
        return n, refused

    def pop(
        self, digest: bytes, chkpt: int, client: int, timeout: float | None = None, rid: int = 0
    ) -> bytes:
        """Delete a key; return its old value frame (at most once per request id)."""
        ws = self.working_set
        return self._write(
            lambda txn: self._once(txn, rid, lambda t: ws.pop(t, digest, chkpt, client)),
            timeout,
            "pop",
            (chkpt, client),
        )

    def clear(self, chkpt: int, client: int, timeout: float | None = None) -> None:
        ws = self.working_set
        if ws.oldest <= chkpt <= ws.newest and not (self.frozen or ws.wait_for_writers):
            w, n = self._counts()  # (raises if closed)
            if w.newest == ws.newest and not any(n):
                return  # nothing seen at any checkpoint: nothing to clear, no page written
        self._write(lambda txn: ws.clear(txn, chkpt, client), timeout, "clear", (chkpt, client))

    def _current(self, txn: lmdb.Transaction, digest: bytes, chkpt: int, client: int) -> Any:
        """Prepare a read-modify-write of a key at ``chkpt``: its visible entry, or ``None``."""
        ws = self.working_set
        ws.prepare_write(txn, chkpt, client)
        e = ws.store.lookup(txn, digest, chkpt)
        return e if ws.is_visible(e, chkpt) else None

    def setdefault(
        self,
        digest: bytes,
        key: bytes,
        frame: Any,
        chkpt: int,
        client: int,
        timeout: float | None = None,
    ) -> bytes:
        """The key's value frame at ``chkpt``; if it has none, ``frame`` is put first.

        One write transaction: two processes that race on the same key both get
        the value that won.  Sent again (a host restart), it returns that value.
        """
        ws = self.working_set

        def fn(txn: lmdb.Transaction) -> bytes:
            e = self._current(txn, digest, chkpt, client)
            if e is not None:
                return bytes(e.frame)
            ws.put(txn, digest, chkpt, key, frame, client)
            return bytes(memoryview(frame).cast("B")) if not isinstance(frame, bytes) else frame

        return self._write(fn, timeout, "setdefault", (chkpt, client))

    def fetch_add(
        self,
        digest: bytes,
        key: bytes,
        chkpt: int,
        client: int,
        n: int,
        timeout: float | None = None,
        rid: int = 0,
    ) -> bytes:
        """Atomically add ``n`` to an int value (absent: 0); return the old value's frame.

        Applied at most once per request id ``rid`` (a retry after a host restart
        gets the first answer)."""
        return self._write(
            lambda txn: self._once(
                txn, rid, lambda t: self._fetch_add(t, digest, key, chkpt, client, n)
            ),
            timeout,
            "fetch_add",
            (chkpt, client),
        )

    def _fetch_add(
        self, txn: lmdb.Transaction, digest: bytes, key: bytes, chkpt: int, client: int, n: int
    ) -> bytes:
        """:meth:`fetch_add`'s change in ``txn``: the old value's frame."""
        e = self._current(txn, digest, chkpt, client)
        if e is not None:
            old = loads_value(e.frame)
            if isinstance(old, bool) or not isinstance(old, int):
                raise DDictError(
                    f"fetch_add needs an int value, the key holds a {type(old).__name__}",
                    "INVALID_ARGUMENT",
                )
            old_frame = bytes(e.frame)
        else:
            old, old_frame = 0, dumps_value(0).join()
        self.working_set.put(
            txn, digest, chkpt, key, dumps_value(old + n).join(), client, persistent=True
        )
        return old_frame

    def pop_alone(
        self, digest: bytes, chkpt: int, client: int, rid: int, most: int
    ) -> bytes | None:
        """:meth:`pop` where it is nothing more than the pop (see :meth:`once_alone`; the
        plain server checked the rest, as for ``put_alone``): its reply, or ``None``."""
        ws = self.working_set
        return self.once_alone(rid, lambda txn: ws.pop(txn, digest, chkpt, client), most)

    def fetch_add_alone(
        self, digest: bytes, key: bytes, chkpt: int, client: int, n: int, rid: int, most: int
    ) -> bytes | None:
        """:meth:`fetch_add` where it is nothing more (see :meth:`pop_alone`)."""
        return self.once_alone(
            rid, lambda txn: self._fetch_add(txn, digest, key, chkpt, client, n), most
        )

    def _set_frozen(self, frozen: bool) -> None:
        with self._cond:
            self._check_open()
            before = self.frozen
            try:
                with self.store.write() as txn:  # survives a restart of the host process
                    self.store.put_meta(txn, FROZEN, b"\x01" if frozen else b"\x00")
                    self.frozen = frozen or self.read_only  # (before the commit's new word)
            except BaseException:
                self.frozen = before
                raise

    def freeze(self) -> None:
        self._set_frozen(True)

    def unfreeze(self) -> None:
        if self.read_only:
            raise DDictError("a read_only dictionary cannot be unfrozen", "INVALID_OPERATION")
        self._set_frozen(False)

    @staticmethod
    def saved_frozen(store: ShardStore) -> bool:
        """Whether the shard was frozen when its last manager stopped."""
        with store.read() as txn:
            return store.get_meta(txn, FROZEN) == b"\x01"

    # -- lifecycle ------------------------------------------------------------

    def close(self, *, destroy: bool = True, why: int = CLOSED_DESTROYED) -> None:
        """Stop serving; wake waiters with ``DDictClosedError``; delete the shard.

        ``destroy=False`` keeps the shard (a restart re-attaches it); ``why``: what readers see.
        """
        self.end_pause()
        with self._cond:
            if self.closed:
                return
            self.closed = True
            self._deferred.close(lambda: DDictClosedError(f"manager {self.manager_id} is closed"))
        with self._cond:
            dumps, self._dumps = list(self._dumps.values()), {}
        for txn in dumps:
            txn.abort()
        if self.persister is not None:
            try:
                self.persister.sync()
            except DDictError as e:
                logger.warning("manager %d: %s", self.manager_id, e)
            self.persister.close()
        try:
            mark_closed(self.store, self.working_set.newest, why)
        except Exception as e:  # a full or broken shard: readers then see the stat check
            logger.debug("manager %d: cannot mark the shard closed: %r", self.manager_id, e)
        if destroy:
            self.store.destroy()
        else:
            self.store.close()
