"""Same-host access with no round trip: open the manager's shard directly.

A shard is an LMDB environment in ``/dev/shm``: any process on the host can map
it and read a committed snapshot while the manager keeps writing (LMDB's
readers never block the writer and never see a half-written transaction).  So
a client on the manager's host (a task on any worker, or the user's process)
serves ``d[k]`` and ``k in d`` from the shard itself, at memory speed, and uses
the host process's Unix socket only for reads that must wait (a
``wait_for_keys`` read of a key not yet written) and for most writes.

Small puts that change nothing but their key (see
:func:`~dask_ddict.shard.working_set.put_in_window`) are committed by the client
itself, in a write transaction that LMDB's cross-process writer lock orders
with the manager's: no round trip either.  Everything else (a put that moves
the window, large values, dictionaries with ``wait_for_keys`` or
``wait_for_writers``, a frozen shard, a manager with waiters) goes to the
manager.

Checkpoint rules are applied from the same snapshot: the window's newest
checkpoint is stored in the shard's metadata by every write that moves it.
The value is copied out while the snapshot is open, so a caller never holds a
view of pages that a later write could reuse.

A view costs 2 descriptors, which it keeps: LMDB holds the data file's until
the environment closes, and the lock file's, on which a POSIX record lock at
this process's pid tells other processes that its reader slots are live (closing
any descriptor of that file drops the lock; another process's ``reader_check``
would then free the slots, and the manager could reuse pages a reader is
copying).  A bare read-only ``mmap`` without a reader slot could read torn pages.
So the descriptors are bounded by the number of views: at most
``ddict.transport.max-shard-views`` (32) per process, taken from the least
recently used idle one at the bound (:func:`_evict_idle`).

LMDB forbids opening one environment twice in a process, so
environments are shared process-wide (:data:`_ENVS`) and released when the
last channel using one closes (a handle's channels close with it, also when
it is garbage-collected, e.g. at the end of a task), or as soon as a read
finds the dictionary destroyed.  Readers give back the shard pages they
touched (see :mod:`dask_ddict._memory`): at once for a large value, and for
small ones after :data:`RELEASE_EVERY` bytes of pages, so a process that reads a
lot and drops it does not keep the shards in its RSS.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import lmdb

from .. import _memory, config
from .._serialize import copy_frame
from ..errors import DDictClosedError, DDictKeyError, DDictManagerUnavailableError
from ..options import DDictOptions
from ..shard.store import ShardStore
from ..shard.working_set import (
    CLOSED_DESTROYED,
    OPEN,
    check_window,
    entry_visible,
    put_in_window,
    saved_newest,
)
from .links import SocketChannel
from .ops import Contains, Get, Operation, Put

#: Seconds between checks that a shard's supervisor lives (a lost host is seen within this).
ALIVE_CHECK = 0.02
#: Seconds between a channel's attempts to map its shard again after its view was taken.
VIEW_RETRY = 0.05
#: Puts of frames up to this size may be committed by a same-host client itself.
DIRECT_PUT_MAX = 64 << 10
#: A value this big is released from the reader's mapping right after its copy.
RELEASE_LARGE = 1 << 20
#: Smaller values: every mapping of the process is released after reads that may
#: have touched this many bytes of pages (each read counts at least one page).
RELEASE_EVERY = 64 << 20


class _View:
    """A process's mapping of one shard, shared by its channels.

    ``users`` counts the channels that hold it, ``active`` the operations inside
    it right now (an evicted view is never closed under one), ``used`` is when
    it was last used (for the least-recently-used rotation).
    """

    __slots__ = ("store", "users", "span", "active", "used", "evicted")

    def __init__(self, store: ShardStore) -> None:
        self.store = store
        self.users = 0
        self.span: tuple[int, int] | None = None
        self.active = 0
        self.used = time.monotonic()
        self.evicted = False

    def copy(self, frame: memoryview) -> Any:
        """A private copy of a value frame; gives back the pages it touched when due.

        (Reading a large value with ``preadv`` instead, which maps nothing, ran
        at half the speed of this copy here.)
        """
        global _unreleased
        out = copy_frame(frame)
        n = frame.nbytes
        if n >= RELEASE_LARGE:
            _memory.release(_memory.address_of(frame), n)
            return out
        _unreleased += n + _memory.PAGE
        if _unreleased >= RELEASE_EVERY:
            _unreleased = 0
            for view in list(_ENVS.values()):
                view.release()
        return out

    def release(self) -> None:
        """Give back every page of this mapping (they stay in the shard)."""
        if self.span is None:
            self.span = _memory.mapping_of(self.store.path + "/data.mdb")
        if self.span is not None:
            _memory.release(self.span[0], self.span[1] - self.span[0])

    def close(self) -> None:
        self.evicted = True
        self.store.close()


_unreleased = 0  # bytes of pages possibly touched since the last release (process-wide)
#: path -> the process's view of it, least recently used first.
_ENVS: OrderedDict[str, _View] = OrderedDict()
_DESTROYED: dict[str, None] = {}  # paths of shards this process saw destroyed (bounded)
_MANAGED: dict[str, None] = {}  # paths of shards this process opened as their manager
# Reentrant: a dropped handle's finalizer may close its channels from inside _acquire
# (the cyclic GC runs at any allocation, e.g. while LMDB opens an environment).
_ENVS_LOCK = threading.RLock()


class ViewLimit(Exception):
    """This process already keeps ``ddict.transport.max-shard-views`` shard views."""


def _acquire(path: str, capacity: int) -> _View:
    with _ENVS_LOCK:
        view = _ENVS.get(path)
        if view is None:
            if path in _MANAGED:
                raise ViewLimit(f"{path} is served by this process: read over its socket")
            most = int(config.get("transport.max-shard-views"))
            if len(_ENVS) >= most and not _evict_idle():
                # bounded descriptors: this manager is read over its socket for now
                raise ViewLimit(f"{len(_ENVS)} shard views open (ddict.transport.max-shard-views)")
            view = _ENVS[path] = _View(ShardStore(path, capacity, create=False))
        view.users += 1
        return view


def _evict_idle() -> bool:
    """Close the least recently used view if it has been idle for ``shard-view-idle``
    and no operation is inside it (``_ENVS_LOCK`` held).  Its channels read over
    their sockets until they map their shard again.  Views in use more recently
    are kept: a working set of shards larger than the bound does not thrash.
    """
    idle = config.get_seconds("transport.shard-view-idle") or 0.0
    now = time.monotonic()
    for path, view in _ENVS.items():  # least recently used first
        if now - view.used < idle:
            return False  # (every later one was used more recently)
        if view.active == 0:
            del _ENVS[path]
            view.close()
            return True
    return False


def _release(path: str, view: _View) -> None:
    with _ENVS_LOCK:
        view.users -= 1
        if view.users > 0 or _ENVS.get(path) is not view:
            return
        del _ENVS[path]
        view.evicted = True  # no new operation enters it
        if view.active:  # (a channel closed under another thread's read:
            return  # the last operation out closes it, see SharedChannel._exit)
    view.close()


def _destroyed(path: str) -> None:
    """The shard was destroyed: close this process's view now, for every channel."""
    with _ENVS_LOCK:
        view = _ENVS.pop(path, None)
        _DESTROYED[path] = None
        while len(_DESTROYED) > 4096:
            del _DESTROYED[next(iter(_DESTROYED))]
    if view is not None:
        view.close()


def forget(path: str) -> None:
    """Close this process's client view of a shard it is about to open as its manager.

    LMDB must not have one environment open twice in a process; a restart can
    place a manager in a process that still maps the old shard as a client.
    Its channels read over the socket from then on: the shard is never mapped
    as a client's here again.
    """
    with _ENVS_LOCK:
        view = _ENVS.pop(path, None)
        _MANAGED[path] = None
        while len(_MANAGED) > 4096:
            del _MANAGED[next(iter(_MANAGED))]
    if view is not None:
        view.close()


class SharedChannel:
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

    def __init__(self, sock: SocketChannel, store_path: str, capacity: int,
                 options: DDictOptions, direct_writes: bool = True) -> None:  # fmt: skip
        self._sock = sock
        self._path = store_path
        self._capacity = capacity
        self._view: _View | None = None
        self._retry_at = 0.0
        self._size = options.working_set_size
        self._wfk = options.wait_for_keys
        # A direct put must change its manager's generation word (see shard.generations).
        self._words = sock.link.generations() if direct_writes else None
        self._direct = self._words is not None and not (
            options.wait_for_keys or options.wait_for_writers or options.read_only
        )
        self._closed = False
        self._alive_until = 0.0
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
            if view is not None and not view.evicted:
                view.active += 1
                view.used = time.monotonic()
                if _ENVS.get(self._path) is view:
                    _ENVS.move_to_end(self._path)
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
            last = view.active == 0 and view.evicted and view.users <= 0
        if last:  # its channels all closed while this operation was inside
            view.close()

    def _check_alive(self) -> None:
        """A shard outlives its processes: a manager whose host is gone must read as
        unavailable, as it does over a socket.  ``info.pid`` is the supervisor's: while
        it lives the shard is served (its host process may be restarting, and the
        shard holds every committed write), so a ``kill(pid, 0)`` at most every
        :data:`ALIVE_CHECK` seconds tells.  A manager that closed says so in the shard itself (see
        :meth:`_visible`).
        """
        now = time.monotonic()
        if now < self._alive_until:
            return
        info = self._sock.info
        try:
            os.kill(info.pid, 0)
            self._alive_until = now + ALIVE_CHECK
        except ProcessLookupError:
            raise DDictManagerUnavailableError(
                f"manager {info.manager_id} on host {info.hostname} ({info.worker}) is gone "
                f"(its supervisor, process {info.pid}, ended)"
            ) from None
        except PermissionError:
            pass  # alive, under another user

    def _visible(self, store: ShardStore, digest: bytes, chkpt: int, txn: Any) -> Any:
        """The entry visible at ``chkpt``, ``None`` if absent, ``False`` if a reader must wait."""
        newest, closed = saved_newest(store, txn, self._size)
        if closed != OPEN:
            info = self._sock.info
            if closed == CLOSED_DESTROYED:
                raise DDictClosedError(f"DDict {self._sock.link.name!r} was destroyed")
            raise DDictManagerUnavailableError(
                f"manager {info.manager_id} on host {info.hostname} is closed (its host shut down)"
            )
        check_window(chkpt, newest, self._size)
        e = store.lookup(txn, digest, chkpt)
        if entry_visible(e, chkpt, self._wfk):
            return e
        return False if self._wfk else None  # under wait_for_keys the manager waits

    def _snapshot(self, store: ShardStore) -> Any:
        try:
            return store.read()
        except lmdb.Error as e:  # the view was closed (a restart reopened the shard here)
            if self._path in _DESTROYED:
                raise DDictClosedError(f"DDict {self._sock.link.name!r} was destroyed") from None
            info = self._sock.info
            raise DDictManagerUnavailableError(
                f"manager {info.manager_id} on host {info.hostname}: shard closed ({e})"
            ) from e

    def call(self, o: Operation) -> Any:
        """Serve ``o`` from the shard when it can be (reads, small puts), else send it."""
        local = _LOCAL.get(o.__class__)
        return self._sock.call(o) if local is None else local(self, o)

    def _get(self, o: Get) -> Any:
        view = self._enter()
        if view is None:
            return self._sock.call(o)
        try:
            self._check_alive()
            with self._snapshot(view.store) as txn:
                e = self._visible(view.store, o.digest, o.chkpt, txn)
                if e:
                    return view.copy(e.frame)
        except DDictClosedError:
            _destroyed(self._path)  # after the snapshot ended: no reader left in the map
            raise
        finally:
            self._exit(view)
        if e is None:
            raise DDictKeyError()
        return self._sock.call(o)  # the manager waits for the writer

    def _put(self, o: Put) -> None:
        framed = o.framed
        if not (self._direct and framed.nbytes <= DIRECT_PUT_MAX):
            return self._sock.call(o)
        view = self._enter()
        if view is None:
            return self._sock.call(o)
        try:
            self._check_alive()
            store = view.store
            try:
                txn = store.write()
            except lmdb.Error:
                txn = None  # the view was closed: the manager answers
            if txn is not None:
                try:
                    done = put_in_window(store, txn, self._size, o.digest, o.chkpt, o.key,
                                         framed)  # fmt: skip
                except BaseException:
                    txn.abort()
                    raise
                if done:
                    txn.commit()
                    self._words.bump(self._sock.info.manager_id)  # type: ignore[union-attr]
                    return None
                txn.abort()
        finally:
            self._exit(view)
        return self._sock.call(o)

    def _contains(self, o: Contains) -> bool:
        view = self._enter()
        if view is None:
            return bool(self._sock.call(o))
        try:
            self._check_alive()
            with self._snapshot(view.store) as txn:
                return bool(self._visible(view.store, o.digest, o.chkpt, txn))
        except DDictClosedError:
            _destroyed(self._path)
            raise
        finally:
            self._exit(view)

    def close(self) -> None:
        with _ENVS_LOCK:
            view, self._view = self._view, None
            self._closed = True
        if view is not None:
            _release(self._path, view)
        self._sock.close()


#: What a same-host channel serves from the shard itself (everything else: the socket).
_LOCAL: dict[type[Operation], Callable[[SharedChannel, Any], Any]] = {
    Get: SharedChannel._get, Contains: SharedChannel._contains, Put: SharedChannel._put,
}
