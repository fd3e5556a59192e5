"""Same-host access with no round trip: open the manager's shard directly.

A shard is an LMDB environment in ``/dev/shm``: any process on the host can map
it and read a committed snapshot while the manager keeps writing (LMDB's
readers never block the writer and never see a half-written transaction).  So
a client on the manager's host (a task on any worker, or the user's process)
serves ``d[k]`` and ``k in d`` from the shard itself, at memory speed, and uses
the host process's Unix socket only for reads that must wait (a
``wait_for_keys`` read of a key not yet written) and for most writes.

Small puts that change nothing but their key (see
:func:`~dask_ddict.shard.direct.put_in_window`) are committed by the client
itself, in a write transaction that LMDB's cross-process writer lock orders
with the manager's: no round trip either.  Everything else (a put that moves
the window, large values, dictionaries with ``wait_for_keys`` or
``wait_for_writers``, a frozen shard, a manager with waiters) goes to the
manager.

Checkpoint rules are applied from the same snapshot: the window's newest
checkpoint is stored in the shard's metadata by every write that moves it.
A value is copied out while the snapshot is open, so a caller never holds a
view of pages that a later write could reuse; or, for a zero-copy read, the
snapshot stays open for as long as the caller holds the value (:mod:`.lending`).
The process's mappings of shards are :mod:`.mapped`'s.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import lmdb

from .. import config, kernels
from .._entry import TOMBSTONE
from .._forking import each, in_child
from .._serialize import SMALL_FRAME, Framed, Taken, raw_payload, raw_range
from ..errors import (
    DDictClosedError,
    DDictError,
    DDictFullError,
    DDictKeyError,
    DDictManagerMovedError,
)
from ..kernels import DIRECT_PUT_MAX
from ..options import DDictOptions
from ..shard.direct import puts_in_window
from ..shard.reader_marks import CLOSED_DESTROYED, CLOSED_MOVED, OPEN, frozen, saved_newest
from ..shard.store import ShardStore
from ..shard.visibility import check_window, entry_visible, take_page, unseen, visible_entries
from .lending import Lender, Snapshot, lendable
from .many_key_ops import GetMany
from .mapped import (
    _DESTROYED,
    _ENVS_LOCK,
    ViewLimit,
    _acquire,
    _destroyed,
    _release,
    _View,
    inherited,
    touched,
)
from .operation import Operation
from .ops import Contains, Get, GetRange, Page, Put
from .protocol import WANT_KEYS, WANT_VALUES
from .socket_client import SocketChannel

#: Seconds between checks that a shard's supervisor lives (a lost host is seen within this).
ALIVE_CHECK = 0.02
#: Seconds between a channel's attempts to map its shard again after its view was taken.
VIEW_RETRY = 0.05
_LEND: Any = object()  # (a read to serve from a lent snapshot)


class _OverSocket(Exception):
    """The shard is moving to another machine, or (a read that must not wait) its manager
    is unavailable: this operation goes to its manager's socket, which says why."""


class SharedChannel(kernels.SharedState):
    """A :class:`SocketChannel` whose reads, and small in-window puts, use the shard directly.

    Parameters
    ----------
    sock
        The manager's channel through its host's Unix socket (everything else).
    store_path, capacity, options
        The shard and the dictionary's options.
    direct_writes
        Whether small puts may be committed here (``ddict.local-write``).

    The channel maps its shard while the process's views allow
    (``ddict.transport.max-shard-views``); a view idle for
    ``ddict.transport.shard-view-idle`` may be taken for another shard, and the
    channel then reads over its socket until it can map its shard again.
    """

    def __init__(
        self,
        sock: SocketChannel,
        store_path: str,
        capacity: int,
        options: DDictOptions,
        direct_writes: bool = True,
    ) -> None:
        self._sock = sock
        self._path = store_path
        self._capacity = capacity
        self._view: _View | None = None
        self._retry_at = 0.0
        self._size = options.working_set_size
        self._wfk = options.wait_for_keys
        # A direct put must change its manager's generation word (see shard.generations);
        # zero-copy reads share a snapshot while it has not changed (see .lending).
        self._gens = sock.link.generations()
        self._words = self._gens if direct_writes else None
        self._mid = sock.info.manager_id
        self._owner = os.path.dirname(sock.info.uds_path).encode()  # (its host's socket dir)
        # (transaction id, newest checkpoint, frozen) last read from the shard's metadata
        self._seen: tuple[int, int, bool] = (-1, 0, False)
        self._direct = self._words is not None and not (
            options.wait_for_keys
            or options.wait_for_writers
            or options.read_only
            or options.replicas  # (a replicated write goes through its primary's host)
        )
        # A replicated shard is read here only while its host lives and holds its lease (a
        # replica may take over once it is gone or cut off): checked at every read, not
        # every ALIVE_CHECK seconds (a host without a lease word is read over its socket).
        self._alive_for = 0.0 if options.replicas else ALIVE_CHECK
        self._lease = sock.link.lease_word() if options.replicas else None
        self._closed = False
        self._alive_until = 0.0
        # (what the key lane's read of a small value here checks and calls, see
        # kernels.SharedState: the dropped batches' commits, and the pages' count)
        self._orphans = _ORPHANS
        self._touched = touched
        try:
            self._attach()
        except ViewLimit:  # over the socket until a view is free (see _enter)
            pass

    def __repr__(self) -> str:
        return f"<SharedChannel manager={self._sock.info.manager_id} path={self._path!r}>"

    def __getattr__(self, name: str) -> Any:
        # The link, the manager's info: those of its socket.
        return getattr(self._sock, name)

    @property
    def kind(self) -> str:
        """``"shm"`` while the shard is mapped here, else the socket's kind."""
        view = self._view
        return "shm" if view is not None and not view.evicted else self._sock.kind

    def _attach(self) -> _View:
        """Map the shard (a view of this process's, possibly another's idle one)."""
        view = _acquire(self._path, self._capacity)
        try:
            view.store.check_stamp(self._sock.info.manager_id)  # never another manager's shard
        except BaseException:
            _release(self._path, view)
            raise
        with _ENVS_LOCK:
            old, self._view = self._view, view
        if old is not None:
            _release(self._path, old)
        return view

    def _enter(self) -> _View | None:
        """The view for one operation (counted as active), or ``None``: use the socket."""
        with _ENVS_LOCK:
            view = self._view
            if view is not None and view.enter():
                return view
        now = time.monotonic()
        if self._closed or now < self._retry_at:
            return None
        self._retry_at = now + VIEW_RETRY  # (not on every operation while views are short)
        try:
            view = self._attach()
        except Exception:  # noqa: BLE001 - e.g. ViewLimit, a shard gone: the socket answers
            return None
        return self._enter() if view is self._view else None

    @staticmethod
    def _exit(view: _View) -> None:
        with _ENVS_LOCK:
            view.active -= 1
            last = view.active == 0 and view.evicted
        if last:  # it was closed while this operation was inside
            view.close()
        if _ORPHANS:  # (a dropped batch's commit done by now: its view too)
            _let_go_orphans()

    def _check_alive(self, quiet: bool = False) -> None:
        """A shard outlives its processes: a manager whose host is gone must read as
        unavailable, as it does over a socket.  ``info.pid`` is the supervisor's: while
        it lives the shard is served (its host process may be restarting, and the
        shard holds every committed write), so a ``kill(pid, 0)`` at most every
        :data:`ALIVE_CHECK` seconds tells.  A replicated manager whose host holds no
        lease now (see :mod:`~dask_ddict.shard.lease_word`) is asked over its socket.
        A manager that closed says so in the shard itself (see :meth:`_visible`).
        ``quiet``: what is unavailable raises :class:`_OverSocket` at once, for the
        socket's path to say, never the explanation (which may ask the orchestrator, or
        wait for a failover).
        """
        now = time.monotonic()
        if now < self._alive_until:
            return
        info = self._sock.info
        try:
            os.kill(info.pid, 0)
            self._alive_until = now + self._alive_for
        except ProcessLookupError:
            if quiet:
                raise _OverSocket() from None
            raise self._sock.link.unavailable(
                self._mid, f"is gone (its supervisor, process {info.pid}, ended)"
            ) from None
        except PermissionError:
            pass  # alive, under another user
        if self._lease is not None and not self._lease.valid():
            raise _OverSocket()  # (its host answers, or says it may not serve it now)

    def _word(self) -> int:
        """The manager's generation word (0: unknown), read *before* a snapshot begins
        (snapshots are shared while it is unchanged, see :mod:`.lending`)."""
        gens = self._gens
        return 0 if gens is None else gens.words.item(self._mid)

    def _visible(
        self, store: ShardStore, digest: bytes, chkpt: int, txn: Any, whole: bool = True
    ) -> Any:
        """The entry visible at ``chkpt``, ``None`` if absent, ``False`` if a reader must wait
        (``whole``: its value is read whole, see :meth:`ShardStore.lookup`)."""
        seen = self._seen  # (_check_state's common case, inlined: every read passes here)
        if txn.id() != seen[0] or chkpt < 0 or chkpt <= seen[1] - self._size:
            self._check_state(store, chkpt, txn)
        e = store.lookup(txn, digest, chkpt, whole)
        if e is not None and not (e.flags & TOMBSTONE or self._wfk):  # (entry_visible's
            return e  # common case: then every version but a deletion is seen)
        if entry_visible(e, chkpt, self._wfk):
            return e
        return unseen(e, chkpt, self._wfk)  # (False: the manager waits)

    def _check_state(self, store: ShardStore, chkpt: int, txn: Any, quiet: bool = False) -> None:
        """Raise if the shard is closed, or ``chkpt`` retired, as of ``txn`` (``quiet``:
        as :meth:`_check_alive` says).

        The shard's state (its window, whether it closed or is frozen) changes only
        with a commit, and every commit has a new transaction id: while snapshots
        see the transaction the state was last read in, the state is that one (a
        read then costs no lookup in the shard's metadata).
        """
        tid = txn.id()
        seen = self._seen
        if tid == seen[0]:
            check_window(chkpt, seen[1], self._size)
            return
        newest, closed = saved_newest(store, txn, self._size)
        if closed != OPEN:
            if closed == CLOSED_MOVED:  # (to another machine: its host answers, then says where)
                raise _OverSocket()
            if closed == CLOSED_DESTROYED:
                raise DDictClosedError(f"DDict {self._sock.link.name!r} was destroyed")
            if quiet:
                raise _OverSocket()
            raise self._sock.link.unavailable(self._mid, "is closed (its host shut down)")
        self._seen = (tid, newest, frozen(store, txn))
        check_window(chkpt, newest, self._size)

    def _frozen(self, store: ShardStore, txn: Any) -> bool:
        """Whether the shard is frozen as of ``txn``."""
        seen = self._seen
        return seen[2] if txn.id() == seen[0] else frozen(store, txn)

    def _snapshot(self, store: ShardStore, quiet: bool = False) -> Any:
        try:
            return store.read()
        except lmdb.Error as e:  # the view was closed (a restart reopened the shard here)
            if self._path in _DESTROYED:
                raise DDictClosedError(f"DDict {self._sock.link.name!r} was destroyed") from None
            if quiet:
                raise _OverSocket() from e
            raise self._sock.link.unavailable(
                self._mid, f"cannot be read: its shard closed ({e})"
            ) from e

    @contextlib.contextmanager
    def _inside(self, view: _View, quiet: bool = False) -> Iterator[None]:
        """One operation in ``view`` (from :meth:`_enter`): the host must live, and a
        dictionary found destroyed is forgotten here (after the operation's snapshot
        ended: no reader is left in the map).  ``quiet``: as :meth:`_check_alive`."""
        try:
            self._check_alive(quiet)
            yield
        except DDictClosedError:
            _destroyed(self._path)
            raise
        finally:
            self._exit(view)

    @contextlib.contextmanager
    def _reading(
        self, view: _View, lend: bool, quiet: bool = False
    ) -> Iterator[tuple[Any, Callable[[Any], Any]]]:
        """A snapshot of the shard and how a value's frame leaves it: lent from a shared
        lending snapshot (``lend``, see :mod:`.lending`), or copied (without ``lend``, or
        when ``max-snapshots`` are open; ``quiet``: as :meth:`_snapshot`)."""
        if lend:
            lender = view.lender or self._lender(view)
            snap = lender.begin(self._word())
            if snap is not None:
                try:
                    yield snap.txn, functools.partial(_lent_or_copied, view, lender, snap)
                finally:
                    lender.end(snap)
                return
        with self._snapshot(view.store, quiet) as txn:
            yield txn, view.copy

    def call(self, o: Operation) -> Any:
        """Serve ``o`` from the shard when it can be (reads, small puts), else send it."""
        local = _LOCAL.get(o.__class__)
        if local is None:
            return self._sock.call(o)
        try:
            return local(self, o)
        except (_OverSocket, DDictManagerMovedError):  # (moved: the socket's link follows
            return self._sock.call(o)  # it, as it does a manager that answers MOVED)

    def _get(self, o: Get) -> Any:
        view = self._enter()
        if view is None:
            return self._sock.call(o)
        try:
            self._check_alive()
            got: Any = _LEND
            # A read touches none of a large value's pages as it seeks it: a lent one is
            # mapped apart, a copied one has them touched before the copy (_copied).
            with self._snapshot(view.store) as txn:  # (a value not lent is copied from here)
                e = self._visible(view.store, o.digest, o.chkpt, txn, whole=False)
                if not e:
                    got = e
                elif (
                    o.lend is False
                    or not lendable(e.frame)
                    or not (o.lend or self._frozen(view.store, txn))
                ):
                    return _copied(view, e.frame)  # (else lent, as Dragon)
            if got is _LEND:  # (read again in a lending snapshot: it may have changed since)
                got = self._lend(view, o.digest, o.chkpt)
                if got is not None and got is not False:
                    return got
        except DDictClosedError:
            _destroyed(self._path)  # after the snapshot ended: no reader left in the map
            raise
        finally:
            self._exit(view)
        if got is None:
            raise DDictKeyError()
        return self._sock.call(o)  # the manager waits for the writer

    def _lender(self, view: _View) -> Lender:
        """The view's lender, made on first use: outside ``_ENVS_LOCK``, since a lender
        takes the lending lock as it is made, and a finalizer that the cyclic GC runs
        under the lending lock (a dropped handle's channels closing) takes
        ``_ENVS_LOCK``.  Two threads may make one each: the first installed is kept."""
        lender = view.lender
        if lender is not None:
            return lender
        gens = self._gens
        made = Lender(
            view.store,
            self._sock.info.manager_id,
            (
                os.path.dirname(self._sock.info.uds_path),
                self._sock.link.uid,
                len(gens.words) if gens is not None else 0,
            ),
            view.idle,
        )
        with _ENVS_LOCK:
            if view.lender is None:
                view.lender = made
            return view.lender

    def _lend(self, view: _View, digest: bytes, chkpt: int) -> Any:
        """The value's frame lent from a snapshot (see :mod:`.lending`), else copied; ``None``:
        absent, ``False``: a reader must wait (the manager's)."""
        with self._reading(view, True) as (txn, out):
            # (sought untouched when it is lent: its view maps it apart; with no lending
            # snapshot free, it is copied: touched first, with the lock released)
            e = self._visible(view.store, digest, chkpt, txn, whole=out == view.copy)
            return out(e.frame) if e else e

    def _get_range(self, o: GetRange) -> Any:
        """Part of a raw-bytes value from a snapshot of the shard: only the part is copied
        out (a range is mostly a small part of a large value, such as one inner chunk of
        a zarr shard, which zarr decodes at once; lending the whole value would hold it,
        and give back all its pages, for that)."""
        view = self._enter()
        if view is None:
            return self._sock.call(o)
        with self._inside(view), self._reading(view, False) as (txn, _):
            e = self._visible(view.store, o.digest, o.chkpt, txn, whole=False)
            if e:
                return self._part(view, e, o)
        if e is None:
            raise DDictKeyError()
        return self._sock.call(o)  # the manager waits for the writer

    def range_here(self, o: GetRange) -> Any:
        """:meth:`_get_range` from an event loop, which must not wait: ``(size, part)``,
        ``None`` for an absent key, or ``NotImplemented`` (no view of the shard here, a
        reader who must wait for a writer, a value that is not raw bytes, anything that
        raises: the caller's thread reads it by :meth:`call`, which says what happened).
        A part is a copy of microseconds (the rest of the value is not touched), a
        thread's round trip tens of them."""
        view = self._enter()
        if view is None:
            return NotImplemented
        try:
            with self._inside(view, True), self._snapshot(view.store, True) as txn:
                self._check_state(view.store, o.chkpt, txn, True)
                e = self._visible(view.store, o.digest, o.chkpt, txn, whole=False)
                if not e:
                    return None if e is None else NotImplemented
                return self._part(view, e, o)
        except Exception:  # noqa: BLE001 - the thread's read meets it again and says it
            return NotImplemented

    @staticmethod
    def _part(view: _View, e: Any, o: GetRange) -> tuple[int, Any]:
        """``(size, a copy of part o.start:o.stop)`` of entry ``e``'s raw-bytes value (sought
        untouched: only the part's pages are read; counted whole, see ``_View.copy``)."""
        size, part = raw_range(e.frame, o.start, o.stop)
        return size, view.copy(e.frame, part)

    def _get_many(self, o: GetMany) -> list[list[Any]]:
        """This manager's keys of ``o`` (one group) from one snapshot of the shard."""
        view = self._enter()
        if view is None:
            return self._sock.call(o)
        ((_, digests),) = o.groups
        try:
            self._check_alive()
            if not o.lend:
                with self._snapshot(view.store) as txn:
                    if o.lend is False or not self._frozen(view.store, txn):
                        return [self._many(view, view.copy, digests, o.chkpt, txn, o.absent)]
            with self._reading(view, True) as (txn, out):
                return [self._many(view, out, digests, o.chkpt, txn)]
        except DDictClosedError:
            _destroyed(self._path)
            raise
        finally:
            self._exit(view)

    def place_many(
        self,
        digests: list[bytes],
        positions: bytes,
        out: list[Any],
        chkpt: int,
        absent: Any,
        lend: bool | None = False,
    ) -> bool:
        """The values of ``digests`` read from one snapshot of the shard into ``out`` at
        ``positions`` (``absent`` for an absent key: see
        :func:`~dask_ddict.kernels.place_values`), as :meth:`_get_many` reads a group;
        ``False`` (part of ``out`` may be written): not read here, the caller's
        :class:`~.many_key_ops.GetMany` reads them (no view of the shard, a key a reader
        may have to wait for, or anything that raises, said there again).  ``lend``: a
        frame of ``SMALL_FRAME`` bytes or more is lent from a shared lending snapshot
        (:meth:`_reading`), a smaller one copied by the walk, as a copying read copies
        it (lending costs more than such a copy, and the value is as read-only: its
        buffers are those of a ``bytes``).  ``lend=None`` (a read that lends only from a
        frozen shard) copies from one that is not frozen.  It never waits for an answer:
        a manager that is unavailable declines at once (an event loop reads here), and
        the ``GetMany`` path explains it, once."""
        if self._wfk:  # (a key may have to be waited for: GetMany's, with its rules)
            return False
        view = self._enter()
        if view is None:
            return False
        try:
            with self._inside(view, True), self._reading(view, bool(lend), True) as (txn, take):
                self._check_state(view.store, chkpt, txn, True)
                if lend is None and self._frozen(view.store, txn):
                    return False  # (its large values are lent: GetMany's)
                nbytes, copies = view.store.place_values(
                    txn, digests, positions, out, chkpt, SMALL_FRAME, absent, take
                )
        except Exception:  # noqa: BLE001 - the GetMany path meets it again and says it
            return False
        touched(nbytes, copies)
        return True

    def _many(
        self,
        view: _View,
        out: Callable[[Any], Any],
        digests: list[bytes],
        chkpt: int,
        txn: Any,
        absent: Any = None,
    ) -> list[Any]:
        """Frames (taken out of ``txn`` with ``out``: copied, or lent), ``None`` for absent
        keys, ``False`` to wait for; or, copying for a reader that gave its marker of an
        absent key (``absent``: see :class:`GetMany`), the values, decoded here."""
        store = view.store
        self._check_state(store, chkpt, txn)
        if not self._wfk:  # (every live version is seen: the frames straight from the cursor)
            copying = out == view.copy  # (small frames: copied by the cursor's walk itself)
            if copying and absent is not None:
                values, nbytes, copies = store.lookup_values(
                    txn, digests, chkpt, SMALL_FRAME, absent, out
                )
                touched(nbytes, copies)
                return values
            frames = store.lookup_many(
                txn, digests, chkpt, frames=True, small=SMALL_FRAME if copying else 0
            )
            taken, nbytes, copies = kernels.taken_out(frames, out)
            if copying:
                touched(nbytes, copies)
            return taken
        got: list[Any] = []
        for e in store.lookup_many(txn, digests, chkpt):
            if not entry_visible(e, chkpt, self._wfk):
                got.append(unseen(e, chkpt, self._wfk))
                continue
            got.append(out(e.frame))
        return got

    def _put(self, o: Put) -> None:
        framed = o.framed
        if self._direct and framed.nbytes <= DIRECT_PUT_MAX:
            done, error = self.put_batch([(o.digest, o.key, framed)], o.chkpt)
            if error is not None:
                raise error
            if done:
                return None
        return self._sock.call(o)  # (not one this client may commit: the manager's)

    def put_batch(
        self, records: list[tuple[bytes, bytes, Framed]], chkpt: int, most: int | None = None
    ) -> tuple[int, DDictError | None]:
        """Commit the leading ``records`` that this client may commit itself (as
        :meth:`_put` does one), all in one transaction; return how many, and the
        error that stopped them, if one did.  The rest are the manager's to apply.

        ``most``: the largest frame committed here (default :data:`DIRECT_PUT_MAX`;
        a caller that writes large
        values from beside the shard, such as :class:`~dask_ddict.DDictStore`'s
        chunk writes, raises it: the value is then copied once, into the shard,
        and crosses no socket)."""
        if not self._direct:
            return 0, None
        view = self._enter()
        if view is None:
            return 0, None
        done, error = 0, None
        try:
            self._check_alive()
            store = view.store
            if most is None and self._compiled_commit(store, records, chkpt, queue=False):
                return len(records), None  # (one C call: else the same rules in Python)
            try:
                txn = store.write()
            except lmdb.Error:
                return 0, None  # the view was closed: the manager applies them
            most = DIRECT_PUT_MAX if most is None else most
            small = kernels.leading_within(records, most)
            try:
                done, error = puts_in_window(
                    store, txn, self._size, chkpt, records[:small], self._owner
                )
            except BaseException:
                txn.abort()
                raise
            if isinstance(error, DDictFullError):
                error = None  # the manager's to apply: it can drop versions no one sees
            if done:
                txn.commit()
                self._words.bump(self._sock.info.manager_id)  # type: ignore[union-attr]
            else:
                txn.abort()
        finally:
            self._exit(view)
        if most is not None and most > DIRECT_PUT_MAX:  # (else none is large)
            large = sum(r[2].nbytes for r in records[:done] if r[2].nbytes > DIRECT_PUT_MAX)
            if large:  # (written through this process's mapping: out of its RSS when due)
                touched(large)
        return done, error

    def put_batch_behind(
        self, records: list[tuple[bytes, bytes, Framed]], chkpt: int
    ) -> CommitBehind | None:
        """:meth:`put_batch` of ``records`` queued for this process's commit thread, which
        commits them without the interpreter lock while the caller goes on (a batch's
        next flush is routed and framed meanwhile); :meth:`CommitBehind.collect` then
        says what :meth:`put_batch` would have said.  ``None``: not queued (pure
        kernels, ``ddict.batch.commit-behind`` off, a window of more than one
        checkpoint, a large value, a value whose frame is not all ``bytes``...): the
        caller calls :meth:`put_batch`."""
        if not self._direct or not config.get("batch.commit-behind"):
            return None
        view = self._enter()
        if view is None:
            return None
        try:
            self._check_alive()
            commit = self._compiled_commit(view.store, records, chkpt, queue=True)
            if commit is None:
                return None
            behind, view = CommitBehind(self, view, commit, records, chkpt), None
            return behind
        finally:
            if view is not None:
                self._exit(view)

    def _compiled_commit(
        self,
        store: ShardStore,
        records: list[tuple[bytes, bytes, Framed]],
        chkpt: int,
        queue: bool,
    ) -> Any:
        """A :class:`~dask_ddict.kernels.DirectCommit` of ``records`` into ``store`` (a
        window of one checkpoint, frames up to :data:`DIRECT_PUT_MAX`): queued for the
        commit thread (``queue``) or committed now, in C, by the rules of
        ``puts_in_window``; ``None``: not queued, or not committed (nothing written: the
        caller commits them by those rules in Python)."""
        if self._size != 1 or store.indexed:
            return None
        if kernels.leading_within(records, DIRECT_PUT_MAX) != len(records):
            return None
        commit = kernels.DirectCommit()
        shard = (store.env, store._data, store._meta, records, chkpt, self._owner)
        room = (store.full_thresh * store.capacity, store._psize)
        words = (self._words.words, self._mid)  # type: ignore[union-attr]
        if queue:
            return commit if commit.start(*shard, *room, *words) else None
        return commit if commit.commit(*shard, *room, *words) == kernels.COMMITTED else None

    def _contains(self, o: Contains) -> bool:
        view = self._enter()
        if view is None:
            return bool(self._sock.call(o))
        with self._inside(view), self._snapshot(view.store) as txn:
            return bool(self._visible(view.store, o.digest, o.chkpt, txn, whole=False))

    def _page(self, o: Page) -> Any:
        """One page of a view scanned from a snapshot of the shard: iterating a same-host
        manager (a task beside its shard, ``to_bag``, ``filter``) sends no value through
        a socket.  With ``o.lend``, the values' frames are lent from a shared snapshot
        (as :meth:`_get_many`'s), or copied when none is free."""
        view = self._enter()
        if view is None:
            return self._sock.call(o)
        try:
            self._check_alive()
            with self._reading(view, bool(o.lend and o.want & WANT_VALUES)) as (txn, out):
                return self._take_page(view, o, txn, out)
        except DDictClosedError:
            _destroyed(self._path)
            raise
        finally:
            self._exit(view)

    def _take_page(self, view: _View, o: Page, txn: Any, copy: Callable[[Any], Any]) -> Any:
        store = view.store
        self._check_state(store, o.chkpt, txn)
        page_bytes = config.get_bytes("iteration.page-bytes")
        return take_page(
            visible_entries(store, txn, o.chkpt, o.after, self._wfk),
            bool(o.want & WANT_KEYS),
            bool(o.want & WANT_VALUES),
            max(1, o.max_items),
            min(page_bytes, o.max_bytes or page_bytes),
            copy,
        )

    def close(self) -> None:
        with _ENVS_LOCK:
            view, self._view = self._view, None
            self._closed = True
        if view is not None:
            _release(self._path, view)
        self._sock.close()
        if _ORPHANS:  # (a dropped batch's commit done by now: its view too)
            _let_go_orphans()


def _copied(view: _View, frame: Any) -> Any:
    """A copy of a value's ``frame``, sought without its pages touched: a large one has
    them touched first, with the interpreter lock released (``kernels.touch_pages``, as
    py-lmdb's preload would have), unless this process mapped them since it last gave
    them back (a value read again: nothing to fault, and no second walk of its pages).
    Raw bytes past a small frame come as the value itself (:class:`Taken`), copied once."""
    n = frame.nbytes
    if n >= kernels.PRELOADED and not view.mapped(frame):
        kernels.touch_pages(frame)
    raw = raw_payload(frame) if n >= SMALL_FRAME else None
    return view.copy(frame) if raw is None else Taken(view.copy(frame, raw, bytes))


def _lent_or_copied(view: _View, lender: Lender, snap: Snapshot, frame: Any) -> Any:
    """``frame`` lent from ``snap`` (see :mod:`.lending`), or copied when lending it saves
    nothing or is past ``max-pinned``."""
    lent = lender.lend(snap, frame) if lendable(frame) else None
    return view.copy(frame) if lent is None else lent


#: What a same-host channel serves from the shard itself (everything else: the socket).
_LOCAL: dict[type[Operation], Callable[[SharedChannel, Any], Any]] = {
    Get: SharedChannel._get,
    Contains: SharedChannel._contains,
    Put: SharedChannel._put,
    GetMany: SharedChannel._get_many,
    Page: SharedChannel._page,
    GetRange: SharedChannel._get_range,
}


class CommitBehind:
    """A flush of a same-host batch committed behind it (:meth:`SharedChannel.
    put_batch_behind`): the shard's view stays open for the commit thread until the
    commit is done (the thread changes the manager's generation word itself)."""

    __slots__ = ("_channel", "_view", "_commit", "records", "_chkpt", "_pid")

    def __init__(
        self,
        channel: SharedChannel,
        view: _View,
        commit: Any,
        records: list[tuple[bytes, bytes, Framed]],
        chkpt: int,
    ) -> None:
        self._channel, self._commit = channel, commit
        self._view: _View | None = view
        self.records, self._chkpt, self._pid = records, chkpt, os.getpid()

    def __del__(self) -> None:
        # A batch dropped without its end.  Never waits here: the collector may run this
        # inside a write transaction of this thread, which the commit may be waiting
        # for; one not done yet is kept and let go later (_let_go_orphans).
        if self._view is None:
            return
        if self._pid != os.getpid() or self._commit.done():
            self._done()
        else:
            _ORPHANS.append(self)

    def _done(self) -> int:
        """What the commit came to, once it did; the view let go (in a forked child, the
        parent's view and commit are the parent's: left as they are)."""
        if self._pid != os.getpid():
            self._view = None
            return int(kernels.FORKED)
        try:
            return int(self._commit.wait())
        finally:
            view, self._view = self._view, None
            if view is not None:
                SharedChannel._exit(view)

    def collect(self) -> tuple[int, DDictError | None]:
        """What :meth:`SharedChannel.put_batch` of the records says: all of them put, or,
        where the commit thread left them (nothing of them written), what the channel's
        own commit of them says now (in the same order: nothing of the batch went to the
        manager meanwhile).  Never inside a write transaction of this thread."""
        outcome = self._done()
        if outcome == kernels.COMMITTED:
            return len(self.records), None
        if outcome == kernels.FORKED:
            raise DDictError(
                f"a batch's commit queued in process {self._pid}, which forked this one: "
                "its puts are that process's",
                "INVALID_OPERATION",
            )
        return self._channel.put_batch(self.records, self._chkpt)


#: Commits behind a batch that was dropped before they were done (its views still open).
_ORPHANS: list[CommitBehind] = []


def _forked() -> None:
    """(In a forked child.)  The dropped commits are the parent's; their views, which
    the collector may have taken out of ``mapped``'s books before it resurrected them,
    are closed for this process as ``mapped`` closes the others (never left to close
    later, after a channel here may have mapped the same shard again)."""
    views = [o._view for o in _ORPHANS if o._view is not None]
    for orphan in _ORPHANS:
        orphan._view = None
    _ORPHANS.clear()
    each(views, inherited)


in_child(_forked)


def _let_go_orphans() -> None:
    """Let go of the views of the dropped batches' commits that are done by now (at the
    end of each same-host operation, a channel's close, and exit: never waiting)."""
    for orphan in list(_ORPHANS):
        if orphan._pid == os.getpid() and not orphan._commit.done():
            continue
        try:
            _ORPHANS.remove(orphan)
        except ValueError:
            continue  # (another thread's)
        orphan._done()


atexit.register(_let_go_orphans)
