"""Handing a manager to another host process: its writes pause, its shard goes whole.

A move (``rebalance()``, a retiring worker) has three steps, each a control call
of the orchestrator's (see :mod:`dask_ddict.host.moves`):

1. **out** (:meth:`Moving.move_out`, here): the manager's persists are drained,
   its writes pause (the control thread holds the manager's lock, which every
   write takes) and one empty write transaction waits for any write still under
   way, same-host clients' own commits included (LMDB's writer lock).  For a
   move to another machine that transaction also marks the shard
   :data:`~.reader_marks.CLOSED_MOVED`, so same-host clients stop committing and
   reading there.  Reads at the old place go on meanwhile.
2. **in**, at the new host process: on the same machine it opens the very same
   shard (nothing is copied); on another, it copies the shard's pages, which
   no one can change now (:meth:`Moving.shard_pages`), and opens the copy.
3. **done** (:meth:`Moving.move_done`): the manager closes here *as moved*:
   every paused and every later request, and every operation that waited here
   (``wait_for_keys``), is answered ``MOVED`` (not applied), and its client
   sends it again where the manager is now, with its request id (exactly once).
   Or **abort** (:meth:`Moving.move_abort`): the writes resume here.

Everything that is the manager lives in its shard (every checkpoint's versions,
counts, frozen and batch state, request ids, pending persists), so moving the
shard moves the manager.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import DDictError, DDictManagerMovedError
from .reader_marks import CLOSED_MOVED, OPEN, mark_in

if TYPE_CHECKING:
    from ..persist import Persister
    from .deferred import DeferredQueue
    from .store import ShardStore
    from .working_set import WorkingSet

logger = logging.getLogger(__name__)

#: How often a move waits for the manager's persister to be idle before giving up.
_DRAIN_TRIES = 20


class Moving:
    """Moving a manager out of its host process (a base of ``Manager``)."""

    manager_id: int
    store: ShardStore
    working_set: WorkingSet
    persister: Persister | None
    closed: bool
    _mutex: Any
    _cond: threading.Condition
    _deferred: DeferredQueue

    #: Why the manager left this process ("" while it serves here).
    moved: str = ""
    #: Paused for a move: the control thread holds the manager's lock.
    moving: bool = False
    #: The move copies the shard (to another machine): the shard is marked moved.
    copying: bool = False
    #: Paused while a new replica copies the shard (see :meth:`hold`).
    holding: bool = False
    #: A replicated manager's replicas (``host.replicas.Shipper``, set by its host).
    shipper: Any = None

    def move_out(self, copy: bool) -> dict[str, Any]:
        """Pause this manager's writes for a move (step 1); with ``copy``, mark the
        shard so that same-host clients leave it alone.  Returns what the new host
        needs: the shard's path and the bytes a copy takes."""
        if self.moving:
            raise DDictError(f"manager {self.manager_id} is already moving", "INVALID_OPERATION")
        self._drain_and_lock()
        try:
            store = self.store
            with store.write() as txn:  # (LMDB's writer lock: no write is under way after it)
                if copy:
                    mark_in(store, txn, self.working_set.size, CLOSED_MOVED)
            self.moving, self.copying = True, copy
            used = self.used_bytes()
        except BaseException:
            self._mutex.release()
            raise
        return {"store_path": store.path, "used_bytes": used, "map_size": store.map_size}

    def hold(self) -> dict[str, Any]:
        """Pause this manager's writes while a new replica copies its shard (the copy half
        of a move to another machine, without leaving): :meth:`shard_pages` serves the
        copy, and :meth:`unhold` resumes once the primary ships to the new replica too."""
        if self.moving:
            raise DDictError(f"manager {self.manager_id} is moving", "INVALID_OPERATION")
        self._drain_and_lock()
        try:
            with self.store.write():  # (LMDB's writer lock: no write is under way after it)
                pass
            self.moving = self.copying = self.holding = True
            used = self.used_bytes()
        except BaseException:
            self._mutex.release()
            raise
        return {"store_path": self.store.path, "used_bytes": used, "map_size": self.store.map_size}

    def unhold(self) -> None:
        """End a :meth:`hold`: writes resume."""
        if self.holding:
            self.moving = self.copying = self.holding = False
            self._mutex.release()

    def used_bytes(self) -> int:
        """The bytes of the shard's pages in use (what a copy of it takes)."""
        return int((self.store.env.info()["last_pgno"] + 1) * self.store.env.stat()["psize"])

    def _drain_and_lock(self) -> None:
        """Take the manager's lock with no persist under way or queued.

        A persist's report takes the lock too, so the persister is drained first;
        a checkpoint that retired in between queues another: drained again."""
        for _ in range(_DRAIN_TRIES):
            if self.persister is not None:
                self.persister.close()  # (runs what is queued, then stops its thread)
            self._mutex.acquire()
            if self.persister is None or self.persister.idle:
                try:
                    if self.shipper is not None:  # (a batch's changes sent without waiting)
                        self.shipper.drain()
                except BaseException:
                    self._mutex.release()
                    raise
                return
            self._mutex.release()
            time.sleep(0.01)
        raise DDictError(
            f"manager {self.manager_id}: its persists did not settle for a move",
            "INVALID_OPERATION",
        )

    def shard_pages(self) -> memoryview:
        """The shard's used pages, read-only, while paused for a copy (step 2): nothing
        writes them, so they are a consistent environment as they are."""
        if not (self.moving and self.copying):
            raise DDictError(
                f"manager {self.manager_id} is not moving to another machine", "INVALID_OPERATION"
            )
        fd = os.open(os.path.join(self.store.path, "data.mdb"), os.O_RDONLY | os.O_CLOEXEC)
        try:
            mm = mmap.mmap(fd, self.used_bytes(), prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return memoryview(mm)

    def move_abort(self) -> None:
        """The move failed at the new host: writes resume here, as if nothing happened."""
        if not self.moving:
            return
        try:
            if self.copying:
                with self.store.write() as txn:  # (same-host clients may commit again)
                    mark_in(self.store, txn, self.working_set.size, OPEN)
        finally:
            self.moving = self.copying = False
            self._mutex.release()

    def end_pause(self) -> None:
        """A manager paused for a move closes (its dictionary destroyed meanwhile): the
        pause ends, so that closing it can take its lock."""
        if self.moving:
            self.moving = self.copying = self.holding = False
            self._mutex.release()

    def move_done(self, where: str) -> None:
        """The manager serves at ``where`` now: it closes here as moved (step 3).

        Paused writes, later requests and operations waiting here are answered
        ``MOVED``; the shard is not touched (it is the new host's, or its copy is)."""
        if not self.moving:
            raise DDictError(f"manager {self.manager_id} is not moving", "INVALID_OPERATION")
        self.moved = where
        self.closed = True
        self._deferred.close(lambda: self.moved_error())
        self.moving = False
        self._mutex.release()

    def moved_error(self) -> DDictManagerMovedError:
        return DDictManagerMovedError(f"manager {self.manager_id} moved to {self.moved}")
