"""A process's mappings of shards ("views"), shared by all its same-host channels.

LMDB forbids opening one environment twice in a process, so environments
are shared process-wide (:data:`_ENVS`) and released when the last channel
using one closes (a handle's channels close with it, also when it is
garbage-collected, e.g. at the end of a task), or as soon as a read finds
the dictionary destroyed, but never while values lent from it live
(zero-copy reads, :mod:`.lending`): those keep the mapping, and so the pages,
until the last is gone.

A view costs 2 descriptors, which it keeps: LMDB holds the data file's until
the environment closes, and the lock file's, on which a POSIX record lock at
this process's pid tells other processes that its reader slots are live (closing
any descriptor of that file drops the lock; another process's ``reader_check``
would then free the slots, and the manager could reuse pages a reader is
copying).  A bare read-only ``mmap`` without a reader slot could read torn pages.
So the descriptors are bounded by the number of views: at most
``ddict.transport.max-shard-views`` (32) per process, taken from the least
recently used idle one at the bound (:func:`_evict_idle`).

Readers give back the shard pages they touched (see :mod:`dask_ddict._memory`)
once they may have touched :data:`RELEASE_EVERY` bytes of distinct pages, so a
process that reads a lot and drops it does not keep the shards in its RSS.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .. import _memory, config, kernels
from .._forking import each, in_child, keep_forever, reinit_lock
from .._serialize import copy_frame
from ..shard.store import ShardStore
from .lending import Lender

#: Values this big count their own pages once until the next release (see _View.copy),
#: and are remembered as mapped meanwhile: those whose pages a copying read touches with
#: the interpreter lock released first, which a value read again skips (``_View.mapped``).
RELEASE_LARGE = kernels.PRELOADED
#: Every mapping of the process is released after reads that may have touched this
#: many bytes of distinct pages (each small read counts at least one page).
RELEASE_EVERY = 96 << 20


def touched(nbytes: int, reads: int = 1) -> None:
    """Count ``nbytes`` of shard pages this process has touched in ``reads`` copies out
    of a shard (or values a client committed into one); give every mapping's pages
    back when :data:`RELEASE_EVERY` bytes were counted."""
    global _unreleased
    _unreleased += nbytes + reads * _memory.PAGE
    if _unreleased >= RELEASE_EVERY:
        _unreleased = 0
        _memory.MAPPED.clear()
        with _ENVS_LOCK:  # (a view closed meanwhile is skipped: its range may be reused)
            for view in _ENVS.values():
                if not view.closed:
                    view.release()


class _View(kernels.ViewState):
    """A process's mapping of one shard, shared by its channels.

    ``users`` counts the channels that hold it, ``active`` the operations inside
    it right now (an evicted view is never closed under one), ``used`` is when
    it was last used (for the least-recently-used rotation).  Its base holds what the
    key lane's same-host read checks (``store``, ``evicted``, ``closed``, ``used``:
    C fields in the compiled kernels).
    """

    __slots__ = ("users", "span", "active", "lender", "__weakref__")

    def __init__(self, store: ShardStore) -> None:
        self.store = store
        self.users = 0
        self.span: tuple[int, int] | None = None
        self.active = 0
        self.used = time.monotonic()
        self.evicted = False
        self.closed = False
        self.lender: Lender | None = None  # its zero-copy snapshots (see .lending), once lent
        _VIEWS.add(self)

    def enter(self) -> bool:
        """Count one operation inside, unless the view was closed for its channels
        (decided under the lock that :meth:`close` decides under: a close then waits
        for the operation to leave, ``SharedChannel._exit``)."""
        with _ENVS_LOCK:
            if self.evicted:
                return False
            self.active += 1
            self.used = time.monotonic()  # (the eviction's order: see _evict_idle)
            return True

    @property
    def lending(self) -> bool:
        """Whether values lent from this mapping live on (it must stay open)."""
        return self.lender is not None and self.lender.open > 0

    def copy(
        self,
        frame: memoryview,
        part: memoryview | None = None,
        copy: Callable[[Any], Any] = copy_frame,
    ) -> Any:
        """A private copy of a value frame (or of ``part`` of it), made by ``copy``; gives
        back the pages it touched when due.

        (Reading a large value with ``preadv`` instead, which maps nothing, ran
        at half the speed of this copy here.)  A large value's pages stay mapped
        until the process has touched :data:`RELEASE_EVERY` bytes of distinct
        pages: reading a hot value again then faults nothing, and its resident
        set stays bounded.  A single read's large value is mapped already when the
        frame comes here: its pages were touched with the interpreter lock released
        (``kernels.touch_pages``, unless :meth:`mapped` says they are still mapped,
        or py-lmdb's ``preload`` of a value sought ``whole``), so mapping them again
        in one call (``MADV_POPULATE_READ``) only walked them twice (a fifth of a cold
        1 MiB read's time); a many-key walk's frames (never preloaded) and a lend
        refused past ``max-pinned`` fault their pages in this copy.  A part's read
        counts the whole frame's pages too, once (the compiled seek of a byte range
        touches only the part's: then the pages are only given back sooner than they
        need be), but records them as counted, not mapped (``-n``): a whole read after
        it still has its pages touched with the lock released first.
        """
        n = frame.nbytes
        out = copy(frame if part is None else part)
        if n >= RELEASE_LARGE:
            addr = kernels.address_of(frame)
            seen = _memory.MAPPED.get(addr)
            if seen == n or (seen == -n and part is not None):
                return out  # (still mapped, or counted, from an earlier read)
            _memory.MAPPED[addr] = n if part is None else -n
        touched(n)
        return out

    def mapped(self, frame: memoryview) -> bool:
        """Whether this process mapped the pages of ``frame`` (a large value's) since it
        last gave them back (:meth:`copy` records those of whole reads): copying it again
        faults nothing."""
        n = frame.nbytes
        return n >= RELEASE_LARGE and _memory.MAPPED.get(kernels.address_of(frame)) == n

    def release(self) -> None:
        """Give back every page of this mapping (they stay in the shard)."""
        if self.span is None:
            self.span = _memory.mapping_of(self.store.path + "/data.mdb")
        if self.span is not None:
            _memory.release(self.span[0], self.span[1] - self.span[0])

    def close(self) -> None:
        """Close the mapping: now, or once the operations inside it are done (the last
        one out closes it, see ``SharedChannel._exit``) and the values lent from it
        are gone (the last one closes it, :meth:`idle`).  No operation enters it again.

        Decided under the lock that operations enter under: with none inside, no
        snapshot can begin (one begins only inside an operation), so the lending
        count can only fall.  A view kept for its lent values may be taken up again
        by a channel of this process (see :func:`_acquire`): LMDB opens an
        environment once per process.
        """
        path = self.store.path
        with _ENVS_LOCK:
            self.evicted = True
            if self.closed:
                return
            if self.active or self.lending:
                if self.lending and path not in _DESTROYED and path not in _MANAGED:
                    _LENDING[path] = self
                return
            self.closed = True
            if _LENDING.get(path) is self:
                del _LENDING[path]
        span = self.span or (_memory.mapping_of(path + "/data.mdb") if _memory.MAPPED else None)
        self.store.close()
        if span is not None:  # (a later map may take the same addresses: not these pages)
            _memory.forget(span[0], span[1] - span[0])

    def idle(self) -> None:
        """The last lent value is gone: close now if the view was closed meanwhile."""
        if self.evicted:
            self.close()


#: Every view of this process, open or not (what a forked child closes: see _forked).
_VIEWS: weakref.WeakSet[_View] = weakref.WeakSet()
_unreleased = 0  # bytes of pages possibly touched since the last release (process-wide)
#: path -> the process's view of it.
_ENVS: dict[str, _View] = {}
_DESTROYED: dict[str, None] = {}  # paths of shards this process saw destroyed (bounded)
_MANAGED: dict[str, None] = {}  # paths of shards this process opened as their manager
#: Paths of shards whose environments this process inherited from its parent (a fork)
#: and cannot close: read over their sockets (see _forked).
_INHERITED: dict[str, None] = {}
#: Views closed while values lent from them live (open until the last is gone).
_LENDING: dict[str, _View] = {}
# Reentrant: a dropped handle's finalizer may close its channels from inside _acquire
# (the cyclic GC runs at any allocation, e.g. while LMDB opens an environment).
_ENVS_LOCK = threading.RLock()


def _forked() -> None:
    """In a forked child (see :mod:`dask_ddict._forking`): the environments are the
    parent's, and so are their reader slots.  Every view this process inherited is
    closed for it (open, kept for lent values, closed for its channels but not yet for
    those, or being closed by a thread of the parent): where the compiled kernels reach
    py-lmdb's objects, its transactions are let go without ending them and the
    environment closes, so that its channels map their shards anew, as this process;
    elsewhere (or where a thread of the parent was inside it) an open one is never freed
    here, and that shard is read over its host's socket (py-lmdb opens an environment
    once per process)."""
    reinit_lock(_ENVS_LOCK)
    each(_VIEWS, inherited)
    _ENVS.clear()
    _LENDING.clear()
    _memory.MAPPED.clear()


def inherited(view: _View) -> None:
    """(In a forked child.)  ``view``, the parent's, closed for this process: its
    transactions let go and its environment closed, or never freed and its shard read
    over the socket (see :func:`_forked`); also for views that only something other
    than :data:`_VIEWS` still holds (``shared``'s dropped commits)."""
    was_closed, view.closed, view.evicted = view.closed, True, True
    if kernels.disown_transactions(view.store.env):
        view.store.close()
    elif not was_closed:
        keep_forever(view.store)
        _INHERITED[view.store.path] = None


in_child(_forked)


class ViewLimit(Exception):
    """This process already keeps ``ddict.transport.max-shard-views`` shard views."""


def _acquire(path: str, capacity: int) -> _View:
    with _ENVS_LOCK:
        view = _ENVS.get(path)
        if view is None and path in _LENDING:  # still open for its lent values: taken up
            view = _ENVS[path] = _LENDING.pop(path)
            view.evicted = False
        if view is None:
            if path in _MANAGED:
                raise ViewLimit(f"{path} is served by this process: read over its socket")
            if path in _INHERITED:
                raise ViewLimit(f"{path} is mapped by this process's parent: read over its socket")
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
    # Least recently used first (operations stamp ``used``; sorting at the bound, which
    # is rare, costs less than keeping the order on every operation).
    for path, view in sorted(_ENVS.items(), key=lambda pv: pv[1].used):
        if now - view.used < idle:
            return False  # (every later one was used more recently)
        if view.active == 0 and not view.lending:
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
    view.close()  # (with an operation inside, the last one out closes it)


def _destroyed(path: str) -> None:
    """The shard was destroyed: close this process's view now, for every channel."""
    _close_for_good(path, _DESTROYED)


def forget(path: str) -> None:
    """Close this process's client view of a shard it is about to open as its manager.

    LMDB must not have one environment open twice in a process; a restart can
    place a manager in a process that still maps the old shard as a client.
    Its channels read over the socket from then on: the shard is never mapped
    as a client's here again.
    """
    _close_for_good(path, _MANAGED)


def _close_for_good(path: str, why: dict[str, None]) -> None:
    """Close ``path``'s view (see :meth:`_View.close`) and remember the path in ``why``
    (``_DESTROYED`` or ``_MANAGED``, each bounded to its 4096 newest paths)."""
    with _ENVS_LOCK:
        view = _ENVS.pop(path, None)
        why[path] = None
        while len(why) > 4096:
            del why[next(iter(why))]
    if view is not None:
        view.close()
