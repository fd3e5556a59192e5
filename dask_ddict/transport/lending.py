"""Zero-copy reads on the manager's host: a shard's pages lent to the caller.

A same-host reader maps the shard (:mod:`.shared`).  A value it reads with
``copy=False`` (or from a frozen dictionary) is not copied out: its numpy
arrays and other out-of-band pickle-5 buffers are read-only views of the
shard's own pages, mapped for it alone (:class:`~dask_ddict._memory.Lent`).
What keeps those pages unchanged is an LMDB read snapshot: LMDB never reuses
a page that an open snapshot can see, so no later write (overwrite, pop,
clear, a checkpoint's retirement, a restore) touches them, and the manager's
restart does not either (the snapshot's reader slot belongs to this process,
which is alive, so the new host process keeps it).  Destroying the
dictionary deletes the shard's files, but this process's mapping keeps their
pages until the last view is gone: the memory then goes back to the host.  A
view therefore never changes and never dangles.

The snapshot keeps every page freed after it began, not only the view's.  So
when the shard needs that room, its manager asks this process to give it
back (:func:`listen`, ``shard/making_room.py``): :meth:`Lender.release` swaps each
view's pages for a private copy at the same addresses and the snapshots end.
A view then costs its own bytes, here, and nothing of the shard.  Lending is
bounded too:

* snapshots are shared: a read whose shard has not changed since the current
  snapshot began (the manager's generation word, :mod:`~dask_ddict.shard.generations`,
  is the same) lends from that snapshot, so ten thousand views of an unchanged
  shard hold one reader slot; at most ``ddict.zero-copy.max-snapshots`` per
  shard and process are open at once;
* at most ``ddict.zero-copy.max-pinned`` bytes of values are lent per
  process at once.

Past either bound, reads copy.  A snapshot ends as soon as its last view is
gone (its mapping's ``on_gone``, called as the last array made from it, and so
the mapping, is gone), and the host learns what each process holds from its
pin board (:mod:`~dask_ddict.shard.pinboard`), shown in ``d.stats``.

Finalizers run in whichever thread drops the last view, possibly inside the
cyclic GC while this module's lock is held by the same thread: they never
wait for the lock, but queue their work for whoever holds it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import socket
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import lmdb
import numpy as np

from .. import _memory, config, kernels
from .._forking import before_fork, each, in_child, keep_forever, reinit_lock
from .._serialize import FMT_BYTES, FMT_PICKLE, SMALL_FRAME
from ..shard.pinboard import PinBoard, board_path, decode_request, encode_answer, request_path
from ..shard.store import ShardStore

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_PENDING: deque[Callable[[], Callable[[], None] | None]] = deque()
_BOARDS: dict[str, PinBoard] = {}  # path -> this process's board (per dictionary and host)
_lent = 0  # bytes lent by this process, over every shard
_LENDERS: weakref.WeakSet[Lender] = weakref.WeakSet()  # (what a release request looks in)
_LISTENERS: dict[str, socket.socket] = {}  # host socket dir -> its release requests' socket


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

    __slots__ = ("txn", "word", "uses", "lent", "nbytes", "maps", "file")

    def __init__(self, word: int) -> None:
        self.txn: lmdb.Transaction | None = None
        self.word = word  # the shard's generation word read before it began (0: unknown)
        self.uses = 1  # reads inside it right now (one at a time: LMDB's rule)
        self.lent = 0  # live views that still share the shard's pages
        self.nbytes = 0
        #: The mappings lent from it, with their values' sizes (see Lender.release).
        self.maps: list[tuple[weakref.ref[_memory.Lent], int]] = []
        #: The shard's file, open while the read using it lends: ``(path, descriptor)``
        #: (a ``get_many`` that lends many values opens it once; closed by ``end``).
        self.file: tuple[str, int] | None = None

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

    def __init__(
        self, store: ShardStore, mid: int, board: tuple[str, str, int], on_idle: Callable[[], None]
    ) -> None:
        self.store = store
        self.mid = mid
        self.open = 0  # snapshots alive
        self.current: Snapshot | None = None
        self._board_at = board
        self._on_idle = on_idle
        self.max_snapshots = int(config.get("zero-copy.max-snapshots"))
        self.max_bytes = config.get_bytes("zero-copy.max-pinned")
        self.snapshots: set[Snapshot] = set()  # (open ones: what release() looks through)
        self._span: tuple[int, int, int, str] | None = None  # (the environment's map)
        self._pinned_at: tuple[int, PinBoard | None] = (0, None)  # (pid, its board: _board)
        with _LOCK:
            _LENDERS.add(self)
        listen(board[0])

    def __repr__(self) -> str:
        return f"<Lender manager={self.mid} snapshots={self.open}>"

    def begin(self, word: int) -> Snapshot | None:
        """A snapshot for one read, no older than the commit that set ``word`` (read
        before calling); ``None`` past ``max-snapshots`` or the shard's reader slots
        (then the read copies)."""
        try:
            with _LOCK:
                s = self.current
                if s is not None and word and s.word == word and not s.uses and s.txn is not None:
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
            self.snapshots.add(s)
            old = self.current
            if word:
                self.current = s
            follow = None if old is None or old is s else self._close_if_idle(old)
        _drain()
        if follow is not None:
            follow()
        return s

    def end(self, s: Snapshot) -> None:
        """The read in ``s`` is over (what it lent lives on).  The read is counted off in
        a ``finally``: an interrupt raised while the file closes (a ``KeyboardInterrupt``
        comes between any two calls) must not leave the snapshot counted as read in,
        which would hold its reader slot, and every page freed after it began, for as
        long as the process lives."""
        try:
            file, s.file = s.file, None  # (the read's own: it is the snapshot's one user)
            if file is not None:
                os.close(file[1])
        finally:
            with _LOCK:
                s.uses -= 1
                follow = self._close_if_idle(s)
            _drain()
            if follow is not None:
                follow()

    def lend(self, s: Snapshot, frame: memoryview) -> np.ndarray | None:
        """``frame`` as a read-only array of the shard's pages, held by ``s`` until the
        view is gone or :meth:`release` copies it out; ``None`` past ``max-pinned`` (then
        the read copies).

        The pages are mapped again, apart from the environment's map (one ``mmap``: no
        copy, no page touched), so that :meth:`release` can swap them for a private
        copy without changing what this process's environment reads.
        """
        global _lent
        n = frame.nbytes
        addr = kernels.address_of(frame)
        m, skip = self._map(s, addr, n)
        if m is None:
            return None
        try:
            with _LOCK:
                if _lent + n > self.max_bytes:
                    return None
                _lent += n
                s.lent += 1
                s.nbytes += n
                if len(s.maps) > 2 * s.lent + 16:  # (views gone meanwhile: not kept forever)
                    s.maps = [(r, k) for r, k in s.maps if r() is not None]
                s.maps.append((weakref.ref(m), n))
                board = self._board()
                if board is not None:
                    board.add(self.mid, n, 1)  # (under the lock: one writer of the board)
                m.on_gone = functools.partial(self._returned, s, n, board)
        finally:
            _drain()
        arr = np.asarray(m)[skip : skip + n]  # (read-only: it cannot be made writable)
        if frame[0] == FMT_BYTES:
            # A value sought to be lent is not touched in the environment's map (its view
            # maps it apart), but an earlier copying read of it may have mapped its pages
            # there.  Raw bytes (a zarr chunk) are lent to readers that copy them out and
            # drop them, so those pages are given back now, and a task reading many
            # chunks does not grow its resident memory by them.
            _memory.release(addr, n)
        return arr

    def _map(self, s: Snapshot, addr: int, n: int) -> tuple[_memory.Lent | None, int]:
        """A mapping of the pages of the shard's file that hold the ``n`` bytes at ``addr``
        (a value in the environment's map, read in ``s``), and where in it the value
        starts; ``None`` if the file is not found (a dictionary destroyed meanwhile: the
        read copies).  The file stays open until the read ends (:meth:`end`): a mapping
        needs no descriptor, and one held longer would keep a destroyed shard's pages."""
        span = self._span
        if span is None or not span[0] <= addr < span[1]:
            span = self._span = _memory.file_span(addr)
            if span is None:
                return None, 0
        lo, _, offset, path = span
        at = offset + addr - lo
        start = at & ~(_memory.PAGE - 1)
        end = (at + n + _memory.PAGE - 1) & ~(_memory.PAGE - 1)
        if s.file is None or s.file[0] != path:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None, 0
            if s.file is not None:
                os.close(s.file[1])
            s.file = (path, fd)
        return _memory.Lent(s.file[1], start, end - start), at - start

    def _returned(self, s: Snapshot, n: int, board: PinBoard | None, private: bool) -> None:
        """The last view of a lent value is gone (its mapping's ``on_gone``, called as it
        is unmapped: any thread, any time); ``private``: :meth:`release` had copied it."""

        def back() -> Follow:
            global _lent
            if private:  # (released: it was counted off then)
                return None
            _lent -= n
            s.lent -= 1
            s.nbytes -= n
            if board is not None:
                board.add(self.mid, -n, -1)
            return self._close_if_idle(s)

        _queue(back)

    def release(self) -> int:
        """Swap every value lent from this shard that still shares its pages for a private
        copy (:meth:`~dask_ddict._memory.Lent.privatize`): the views stay as they are, at
        the same addresses, but no longer hold a snapshot, which then ends.  The host asks
        for it when a write needs the room (:func:`listen`); the bytes released."""
        try:
            with _LOCK:
                swapped = self._swap_out()
        finally:
            _drain()
        self._swapped(*swapped)
        return swapped[0]

    def _swap_out(self) -> tuple[int, int, list[Callable[[], None]]]:
        """(Under the lock.)  :meth:`release`'s copies, and the snapshots they leave idle:
        ``(bytes, views, what ends those snapshots)``, the last to run once the lock is
        released (:meth:`_swapped`)."""
        global _lent
        freed = views = 0
        follows: list[Callable[[], None]] = []
        for s in list(self.snapshots):
            for ref, n in s.maps:
                m = ref()
                if m is None or not m.privatize():
                    continue  # (private already, or gone: counted off by on_gone)
                _lent -= n
                s.lent -= 1
                s.nbytes -= n
                freed += n
                views += 1
            s.maps = []
            follow = self._close_if_idle(s)
            if follow is not None:
                follows.append(follow)
        return freed, views, follows

    def _swapped(self, freed: int, views: int, follows: list[Callable[[], None]]) -> None:
        """(The lock released.)  End the snapshots :meth:`_swap_out` left idle, then tell
        the pin board: only now that they ended does a board at 0 mean the room is free."""
        for follow in follows:
            follow()
        if views:
            try:
                with _LOCK:
                    board = self._board()
                    if board is not None:
                        board.add(self.mid, -freed, -views)
            finally:
                _drain()

    def _close_if_idle(self, s: Snapshot) -> Follow:
        """(Under the lock.) End ``s`` if nothing reads in it or holds a view of it;
        returns what ends it, to run once the lock is released."""
        if s.uses or s.lent or s.txn is None:
            return None
        if self.current is s:
            self.current = None
        self.snapshots.discard(s)
        txn, s.txn = s.txn, None
        self.open -= 1
        idle = self.open == 0

        def after() -> None:
            try:
                txn.abort()
            finally:  # (an interrupt as the abort returns must not keep the view open)
                if idle:
                    self._on_idle()

        return after

    def _board(self) -> PinBoard | None:
        """(Under the lock.)  This process's pin board of the shard's host and dictionary
        (kept per lender and process: its path is joined once, not per value)."""
        pid = os.getpid()
        if self._pinned_at[0] == pid:
            return self._pinned_at[1]
        socket_dir, uid, managers = self._board_at
        path = board_path(socket_dir, uid, pid)
        board = _BOARDS.get(path)
        if board is None:
            try:
                board = _BOARDS[path] = PinBoard(socket_dir, uid, managers)
            except OSError:  # (the host's directory is gone: nothing to tell it)
                return None
        self._pinned_at = (pid, board)
        return board


def release(uid: str, mid: int) -> int:
    """:meth:`Lender.release` of every lender of manager ``mid`` of dictionary ``uid`` in
    this process; the bytes released."""
    with _LOCK:
        lenders = [x for x in _LENDERS if x.mid == mid and x._board_at[1] == uid]
    return sum(lender.release() for lender in lenders)


def listen(socket_dir: str) -> None:
    """Answer the release requests of the host whose socket directory is ``socket_dir``
    (once per process and host): a thread waits on a datagram socket of this process's
    there (:func:`~dask_ddict.shard.pinboard.request_path`) and runs :func:`release`
    for each request, so that a view held for hours gives its shard's room back when a
    write needs it, whatever this process is doing meanwhile."""
    with _LOCK:
        if socket_dir in _LISTENERS:
            return
        path = request_path(socket_dir, os.getpid())
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            sock.bind(path)
        except OSError as e:  # (the host's directory is gone: nobody to answer)
            sock.close()
            logger.debug("ddict: no release requests from %s: %s", socket_dir, e)
            return
        _LISTENERS[socket_dir] = sock
    threading.Thread(
        target=_serve_requests,
        args=(sock,),
        daemon=True,
        name=f"ddict-release-{os.path.basename(socket_dir)}",
    ).start()


def _serve_requests(sock: socket.socket) -> None:
    while True:
        try:
            data, sender = sock.recvfrom(1024)
        except OSError:  # (closed at exit or after a fork)
            return
        try:
            uid, mid = decode_request(data)
            freed = release(uid, mid)
        except Exception:  # (a request this process cannot serve: answered, not fatal)
            logger.exception("ddict: a release request failed")
            freed = -1
        with contextlib.suppress(OSError):
            sock.sendto(encode_answer(os.getpid(), freed), sender)


@atexit.register
def _stop_listening() -> None:
    for socket_dir, sock in list(_LISTENERS.items()):
        with contextlib.suppress(OSError):
            os.unlink(request_path(socket_dir, os.getpid()))
        sock.close()
    _LISTENERS.clear()


#: What :func:`_forking` swapped out, to finish in the parent once the fork is done.
_SWAPPED: list[tuple[Lender, tuple[int, int, list[Callable[[], None]]]]] = []


def _forking() -> None:
    """Before a fork: every value this process lends is swapped for a private copy (as
    :meth:`Lender.release` does), which the child then shares copy-on-write, under the
    lending lock, held until the fork is done (:func:`_forked_parent`), so that no value
    is lent in between.  A view of the shard's pages in the child would hold them only
    while the parent's snapshot does, which may end as soon as the fork returns; copied
    here, once, before it, the copy is whole however soon that is, and a pool of forked
    workers does not copy the lent values once each.  What ends the snapshots left idle
    runs in the parent after the fork (in the child it would end the parent's)."""
    _LOCK.acquire()  # (released by _forked_parent; a child's starts free: _forked)
    for lender in list(_LENDERS):
        try:
            _SWAPPED.append((lender, lender._swap_out()))
        except Exception:  # (a value left shared: the child copies it, see _forked)
            logger.exception("ddict: lent values could not be copied before a fork")


def _forked_parent() -> None:
    swapped = list(_SWAPPED)
    _SWAPPED.clear()
    _LOCK.release()
    each(swapped, lambda done: done[0]._swapped(*done[1]))
    _drain()  # (what a finalizer queued meanwhile)


def _forked() -> None:
    """In a forked child (see :mod:`dask_ddict._forking`): what the parent lends is its
    own.  A value that :func:`_forking` could not copy is copied into this process's
    memory now, at the same addresses; the snapshots are left as they are (their
    transactions are the parent's: ``transport.mapped`` lets them go without ending
    them), their files' descriptors close, and this process lends nothing and listens
    to nobody until it reads anew."""
    global _lent
    reinit_lock(_LOCK)
    _PENDING.clear()
    for _, (_, _, follows) in _SWAPPED:  # (ending those snapshots here would end the
        each(follows, keep_forever)  # parent's: what would end them is never freed here)
    _SWAPPED.clear()

    def forked(lender: Lender) -> None:
        for s in lender.snapshots:
            for ref, _ in s.maps:
                m = ref()
                if m is not None:
                    each([m], _memory.Lent.forked)
            s.maps = []
            file, s.file = s.file, None
            if file is not None:
                with contextlib.suppress(OSError):
                    os.close(file[1])
            if s.txn is not None:
                keep_forever(s.txn)  # (never ended here, whatever closes what)
                s.txn = None
        lender.snapshots.clear()
        lender.current = None
        lender.open = 0

    each(_LENDERS, forked)
    _LENDERS.clear()
    _BOARDS.clear()
    each(_LISTENERS.values(), socket.socket.close)  # (the parent's: our copies close)
    _LISTENERS.clear()
    _lent = 0


before_fork(_forking, _forked_parent)
in_child(_forked)


#: Frames under this many bytes are never lent: a view maps whole pages of its own and
#: holds a snapshot, which for a value under a page costs several times its copy (the
#: mapping, the first touch of its page, the unmapping) and pins more than it saves.  A
#: same-host ``get_many`` copies them in its walk of the shard (``SMALL_FRAME``: the
#: same bound, so every way of reading agrees), a single read into ``bytes``
#: (:func:`~dask_ddict._serialize.copy_frame`'s copy of a frame under it), so that their
#: arrays are read-only as lent ones are.
LEND_MIN = SMALL_FRAME

#: Raw bytes frames (:data:`~dask_ddict._serialize.FMT_BYTES`, zarr chunks) at least this
#: big are lent: below it a copy costs less than a pin.
LEND_BYTES_MIN = 64 << 10


def lendable(frame: Any) -> bool:
    """Whether lending ``frame`` saves a copy: a pickle with out-of-band buffers of at
    least :data:`LEND_MIN` bytes, or large raw bytes (which
    :func:`~dask_ddict._serialize.bytes_view` readers use as they are)."""
    if frame.nbytes < LEND_MIN:
        return False
    fmt = frame[0]
    return (fmt == FMT_PICKLE and frame[4:8] != b"\0\0\0\0") or (
        fmt == FMT_BYTES and frame.nbytes >= LEND_BYTES_MIN
    )
