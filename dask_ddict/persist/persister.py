"""Which checkpoints to persist, and the background thread that writes them.

The policy half of persistence (Dragon's ``persist_freq``/``persist_count``):
:class:`Persister` decides which retiring checkpoints go to the manager's
:class:`~dask_ddict.persist.interface.CheckpointPersister`, evicts old ones only
once a newer one is committed on *every* manager (:meth:`Persister.rotate`),
and keeps the persister's I/O off the manager's write path and off the worker's
event loop.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import DDictError
from .interface import CheckpointPersister

logger = logging.getLogger(__name__)


class Persister:
    """Which checkpoints to persist, and a background thread that writes them.

    Parameters
    ----------
    store
        Where checkpoints go.
    persist_freq, persist_count
        Dragon's policy: a retiring checkpoint ``k`` is persisted when
        ``persist_freq > 0``, ``persist_count != 0`` and ``k % persist_freq == 0``;
        the newest ``persist_count`` checkpoints complete on every manager are
        kept, with anything newer (``-1``: all; see :meth:`rotate`).
    """

    def __init__(self, store: CheckpointPersister, persist_freq: int, persist_count: int) -> None:
        self.store = store
        self.persist_freq = persist_freq
        self.persist_count = persist_count
        self._ids = store.ids()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # guards _ids and _error
        #: Told each job's outcome, ``report(chkpt, version, error or None)``, in the persisting
        #: thread (the manager records it in its shard, see ``CheckpointIO``); without
        #: it, :meth:`sync` raises the first failure.
        self.report: Callable[[int, int, BaseException | None], None] | None = None
        # One writer of the store at a time: the background thread's persists and
        # rotations, sync()'s rotation (from a request thread) and restore's discards.
        self._io = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"<Persister {self.store!r} freq={self.persist_freq} count={self.persist_count} "
            f"persisted={self._ids}>"
        )

    def wants(self, chkpt: int) -> bool:
        """Whether retiring checkpoint ``chkpt`` is persisted."""
        f = self.persist_freq
        return f > 0 and self.persist_count != 0 and chkpt % f == 0

    def ids(self) -> list[int]:
        with self._lock:
            return list(self._ids)

    def submit(
        self, release: Callable[[], None], jobs: list[tuple[int, int, Callable[[], Iterable[Any]]]]
    ) -> None:
        """Persist ``jobs`` (``(chkpt, version, entries)``: see ``CheckpointPersister.write``)
        in the background, then call ``release``.

        ``entries`` read from a snapshot that ``release`` ends.
        """
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"ddict-persist-{self.store.manager_id}", daemon=True
            )
            self._thread.start()
        self._queue.put((release, jobs))

    def sync(self) -> None:
        """Wait until every submitted checkpoint is written; raise the first failure."""
        self._queue.join()
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise DDictError(f"persisting a checkpoint failed: {err!r}", "INVALID_OPERATION")

    @property
    def idle(self) -> bool:
        """Nothing queued or under way (a move waits for it: see ``shard.moving``)."""
        return self._queue.unfinished_tasks == 0

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def write_now(self, chkpt: int, entries: Callable[[], Iterable[Any]], version: int = 0) -> None:
        """Persist this manager's part of ``version`` of one checkpoint in this thread,
        then rotate (:meth:`rotate`).

        :meth:`CheckpointPersister.write` replaces an earlier version of ``chkpt``
        itself, once the new one is committed (and recorded) on every manager;
        rotation, too, only follows the commit, so a crash at any point leaves
        the newest complete copies.
        """
        with self._io:
            try:
                self.store.write(chkpt, entries, version)
            except BaseException:
                with self._lock:  # the previous copy of chkpt is intact: ask the store
                    self._ids = self.store.ids()
                raise
            with self._lock:
                self._ids = sorted({*self._ids, chkpt})
            self._rotate()

    def rotate(self) -> None:
        """Remove the generations that newer versions replaced on every manager, then
        :meth:`_rotate` (``sync()`` asks every manager once all are done: a manager
        that finished first could not remove its previous version yet)."""
        with self._io:
            self.store.prune()
            self._rotate()

    def _rotate(self) -> None:
        """Remove what ``persist_count`` no longer keeps, never a checkpoint still needed.

        A checkpoint is only useful once *every* manager has committed it, and
        each manager rotates on its own, at its own pace.  So the count is
        taken over the dictionary's complete checkpoints
        (:meth:`CheckpointPersister.complete_ids`), not over this manager's: with
        ``persist_count=K``, everything older than the K-th newest complete id
        goes (uncommitted leftovers of those ids included), and this
        manager's ids newer than it stay, complete or not.  So the newest
        complete checkpoint is never removed, anywhere, and an older one only
        once a newer one is complete.  A manager ahead of the others keeps
        older ids until the others catch up: it rotates again at its next
        persist, and at ``sync()`` (every manager, once all are done).
        """
        k = self.persist_count
        if k <= 0:
            return
        complete = self.store.complete_ids()
        if len(complete) < k:
            return
        keep_from = complete[-k]
        doomed = [c for c in self.store.stored_ids() if c < keep_from]
        for i in doomed:
            self.store.delete(i)
            with self._lock:
                self._ids = [j for j in self._ids if j != i]
            self.store.step("rotate")
        for orphan in self.store.orphans():  # (left by a restore onto fewer managers)
            for i in [c for c in orphan.stored_ids() if c < keep_from]:
                orphan.delete(i)

    def discard_above(self, chkpt: int) -> None:
        """Delete persisted checkpoints newer than ``chkpt``, and the parts of ``chkpt``
        that are not of its restored version (the history continues from it)."""
        with self._io:
            with self._lock:
                self._ids = [i for i in self._ids if i <= chkpt]
            for i in self.store.stored_ids():  # (persisted, or left by a persist that failed)
                if i > chkpt:
                    self.store.delete(i)
            self.store.settle(chkpt)
            for orphan in self.store.orphans():  # (left by a restore onto fewer managers)
                for i in [c for c in orphan.stored_ids() if c > chkpt]:
                    orphan.delete(i)

    def _one(self, chkpt: int, version: int, entries: Callable[[], Iterable[Any]]) -> None:
        failure: BaseException | None = None
        try:
            self.write_now(chkpt, entries, version)
        except BaseException as e:
            logger.exception(
                "ddict manager %d: persisting checkpoint %d failed", self.store.manager_id, chkpt
            )
            failure = e
        if self.report is None:
            if failure is not None:
                with self._lock:
                    self._error = self._error or failure
            return
        try:
            self.report(chkpt, version, failure)
        except Exception:  # (the manager closed meanwhile: nothing left to record it in)
            logger.debug(
                "ddict manager %d: persist of %d not recorded",
                self.store.manager_id,
                chkpt,
                exc_info=True,
            )

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                release, jobs = item
                try:
                    for chkpt, version, entries in jobs:  # (each on its own: one
                        self._one(chkpt, version, entries)  # failing stops none)
                finally:
                    release()
            finally:
                self._queue.task_done()
