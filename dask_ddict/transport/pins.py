"""Zero-copy reads on the manager's host: a shard's pages lent to the caller.

A same-host reader maps the shard (:mod:`.shared`).  A value it reads with
``copy=False`` (or from a frozen dictionary) is not copied out: its numpy
arrays and other out-of-band pickle-5 buffers are read-only views of the
shard's own pages.  What keeps those pages unchanged is an LMDB read
snapshot: LMDB never reuses a page that an open snapshot can see, so no
later write (overwrite, pop, clear, a checkpoint's retirement, a restore)
touches them, and the manager's restart does not either (the snapshot's
reader slot belongs to this process, which is alive, so the new host
process keeps it).  Destroying the dictionary deletes the shard's files,
but this process's mapping keeps their pages until the last view is gone:
the memory then goes back to the host.  A view therefore never changes and
never dangles; the price is that the pages writes free while it lives cannot
be reused, so the shard may fill sooner.  So it is bounded:

* snapshots are shared: a read whose shard has not changed since the current
  snapshot began (the manager's generation word, :mod:`~dask_ddict.shard.generations`,
  is the same) lends from that snapshot, so ten thousand views of an unchanged
  shard hold one reader slot; at most ``ddict.zero-copy.max-snapshots`` per
  shard and process are open at once;
* at most ``ddict.zero-copy.max-pinned`` bytes of values are lent per
  process at once.

Past either bound, reads copy.  A snapshot ends as soon as its last view is
gone (a weak-reference finalizer on the lent buffer, which every array made
from it refers to), and the host learns what each process holds from its
pin board (:mod:`~dask_ddict.shard.pinboard`), shown in ``d.stats``.

Finalizers run in whichever thread drops the last view, possibly inside the
cyclic GC while this module's lock is held by the same thread: they never
wait for the lock, but queue their work for whoever holds it.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import lmdb
import numpy as np

from .. import _memory, config
from .._serialize import FMT_BYTES, FMT_PICKLE
from ..shard.pinboard import PinBoard, board_path
from ..shard.store import ShardStore

_LOCK = threading.Lock()
_PENDING: deque[Callable[[], Callable[[], None] | None]] = deque()
_BOARDS: dict[str, PinBoard] = {}  # path -> this process's board (per dictionary and host)
_lent = 0  # bytes lent by this process, over every shard


def lent_bytes() -> int:
    """Bytes this process holds as zero-copy values (over every dictionary)."""
    return _lent


Follow = Callable[[], None] | None  # what to do once the lock is released


def _drain() -> None:
    """Run the queued work (finalizers'), unless another thread holds the lock: it will."""
    while _PENDING:
        if not _LOCK.acquire(blocking=False):
            return
        after = []
        try:
            while _PENDING:
                follow = _PENDING.popleft()()
                if follow is not None:
                    after.append(follow)
        finally:
            _LOCK.release()
        for follow in after:
            follow()


def _queue(work: Callable[[], Follow]) -> None:
    """Run ``work`` under the lock, now or by the lock's holder (never waits for it)."""
    _PENDING.append(work)
    _drain()


class Snapshot:
    """One open read transaction of a shard and what is lent from it."""

    __slots__ = ("txn", "word", "uses", "lent", "nbytes")

    def __init__(self, word: int) -> None:
        self.txn: lmdb.Transaction | None = None
        self.word = word  # the shard's generation word read before it began (0: unknown)
        self.uses = 1  # reads inside it right now (one at a time: LMDB's rule)
        self.lent = 0  # live views
        self.nbytes = 0

    def __repr__(self) -> str:
        return f"<Snapshot word={self.word:#x} uses={self.uses} lent={self.lent}>"


class Lender:
    """The snapshots this process lends one shard's pages from.

    Parameters
    ----------
    store
        The process's view of the shard.
    mid
        Its manager.
    board
        ``(socket_dir, uid, managers)`` of its host and dictionary, for the pin board.
    on_idle
        Called once no snapshot is open any more (the view may then be closed).
    """

    def __init__(self, store: ShardStore, mid: int, board: tuple[str, str, int],
                 on_idle: Callable[[], None]) -> None:  # fmt: skip
        self.store = store
        self.mid = mid
        self.open = 0  # snapshots alive
        self.current: Snapshot | None = None
        self._board_at = board
        self._on_idle = on_idle
        self.max_snapshots = int(config.get("zero-copy.max-snapshots"))
        self.max_bytes = config.get_bytes("zero-copy.max-pinned")

    def __repr__(self) -> str:
        return f"<Lender manager={self.mid} snapshots={self.open}>"

    def begin(self, word: int) -> Snapshot | None:
        """A snapshot for one read, no older than the commit that set ``word`` (read
        before calling); ``None`` past ``max-snapshots`` or the shard's reader slots
        (then the read copies)."""
        try:
            with _LOCK:
                s = self.current
                if s is not None and word and s.word == word and not s.uses \
                        and s.txn is not None:  # fmt: skip
                    s.uses = 1
                    return s
                if self.open >= self.max_snapshots:
                    return None
                self.open += 1  # (counted before it opens: the bound holds)
        finally:
            _drain()  # (work a finalizer queued while the lock was held)
        s = Snapshot(word)
        try:
            s.txn = self.store.read()
        except lmdb.ReadersFullError:  # every reader slot of the shard is taken: copy
            with _LOCK:
                self.open -= 1
            return None
        except BaseException:
            with _LOCK:
                self.open -= 1
            raise
        with _LOCK:
            old = self.current
            if word:
                self.current = s
            follow = None if old is None or old is s else self._close_if_idle(old)
        _drain()
        if follow is not None:
            follow()
        return s

    def end(self, s: Snapshot) -> None:
        """The read in ``s`` is over (what it lent lives on)."""
        with _LOCK:
            s.uses -= 1
            follow = self._close_if_idle(s)
        _drain()
        if follow is not None:
            follow()

    def lend(self, s: Snapshot, frame: memoryview) -> np.ndarray | None:
        """``frame`` as a read-only array of the shard's pages, held by ``s`` while any
        view of it lives; ``None`` past ``max-pinned`` (then the read copies)."""
        global _lent
        n = frame.nbytes
        try:
            with _LOCK:
                if _lent + n > self.max_bytes:
                    return None
                _lent += n
                s.lent += 1
                s.nbytes += n
                board = self._board()
                if board is not None:
                    board.add(self.mid, n, 1)  # (under the lock: one writer of the board)
        finally:
            _drain()
        arr = np.frombuffer(frame, dtype=np.uint8)
        # Raw bytes (a zarr chunk) are lent to readers that copy them out and drop them:
        # their pages go back with the view, so a task reading many chunks does not
        # grow its resident memory by them.  Arrays lent to user code keep theirs: a
        # value read again then maps nothing (giving them back makes the next lend of
        # the value an order of magnitude slower here).
        addr = _memory.address_of(arr) if frame[0] == FMT_BYTES else 0
        weakref.finalize(arr, self._returned, s, addr, n, board)
        return arr

    def _returned(self, s: Snapshot, addr: int, n: int, board: PinBoard | None) -> None:
        """The last view of a lent value is gone (a finalizer: any thread, any time).

        With ``addr``, the pages its readers touched are given back at once (only this
        process's page-table entries go: the data stays in the shard, and the
        snapshot still holds it here).
        """
        if addr:
            _memory.release(addr, n)

        def back() -> Follow:
            global _lent
            _lent -= n
            s.lent -= 1
            s.nbytes -= n
            if board is not None:
                board.add(self.mid, -n, -1)
            return self._close_if_idle(s)

        _queue(back)

    def _close_if_idle(self, s: Snapshot) -> Follow:
        """(Under the lock.) End ``s`` if nothing reads in it or holds a view of it;
        returns what ends it, to run once the lock is released."""
        if s.uses or s.lent or s.txn is None:
            return None
        if self.current is s:
            self.current = None
        txn, s.txn = s.txn, None
        self.open -= 1
        idle = self.open == 0

        def after() -> None:
            txn.abort()
            if idle:
                self._on_idle()

        return after

    def _board(self) -> PinBoard | None:
        socket_dir, uid, managers = self._board_at
        path = board_path(socket_dir, uid, os.getpid())
        board = _BOARDS.get(path)
        if board is None:
            try:
                board = _BOARDS[path] = PinBoard(socket_dir, uid, managers)
            except OSError:  # (the host's directory is gone: nothing to tell it)
                return None
        return board


#: Raw bytes frames (:data:`~dask_ddict._serialize.FMT_BYTES`, zarr chunks) at least this
#: big are lent: below it a copy costs less than a pin.
LEND_BYTES_MIN = 64 << 10


def lendable(frame: Any) -> bool:
    """Whether lending ``frame`` saves a copy: a pickle with out-of-band buffers, or large
    raw bytes (which :func:`~dask_ddict._serialize.bytes_view` readers use as they are)."""
    if frame.nbytes < 16:
        return False
    fmt = frame[0]
    return (fmt == FMT_PICKLE and frame[4:8] != b"\0\0\0\0") or (
        fmt == FMT_BYTES and frame.nbytes >= LEND_BYTES_MIN
    )
