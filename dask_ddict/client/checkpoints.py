"""A handle's checkpoints: moving its own id, and the managers' persisted checkpoints.

Checkpoint moves (``checkpoint()``, ``rollback()``, ``checkpoint_id``) change
only the handle and send no message; the persistence calls send one typed
operation (:mod:`dask_ddict.transport.ops`) to every manager (or the chosen one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..arguments import check_int
from ..errors import DDictPersistCheckpointError
from ..transport.ops import (
    Advance,
    Newest,
    Operation,
    Persist,
    PersistedIds,
    Restore,
    Rotate,
    Sync,
)

if TYPE_CHECKING:
    from .core import _Core


class Checkpoints:
    """Checkpoint ids and persistence of a handle (a base of :class:`~dask_ddict.DDict`)."""

    _core: _Core
    _chkpt: int
    _timeout: float | None

    if TYPE_CHECKING:  # provided by the handle

        def _check(self) -> None: ...
        def _managers(self) -> list[int]: ...
        def _no_batch(self, what: str) -> None: ...

    # -- checkpoints --------------------------------------------------------------

    @property
    def checkpoint_id(self) -> int:
        self._check()
        return self._chkpt

    @checkpoint_id.setter
    def checkpoint_id(self, value: int) -> None:
        self._check()
        self._chkpt = check_int("checkpoint_id", value, 0)

    def checkpoint(self) -> None:
        """Move this handle to the next checkpoint (no message is sent)."""
        self._check()
        self._no_batch("checkpoint()")
        self._chkpt += 1

    def rollback(self) -> None:
        """Move this handle to the previous checkpoint (floored at 0)."""
        self._check()
        self._no_batch("rollback()")
        self._chkpt = max(0, self._chkpt - 1)

    def sync_to_newest_checkpoint(self) -> None:
        """Move to the newest checkpoint any manager (or the chosen one) holds."""
        self._chkpt = max(self._core.each(Newest(self._timeout), self._managers()))

    # -- persistence ---------------------------------------------------------------

    def _each(self, o: Operation, progress: str = "") -> list[Any]:
        """Send ``o`` to every manager (or the chosen one); their results.

        With ``progress``, a bar of that name follows the managers (see
        :mod:`dask_ddict.progress`).
        """
        return self._core.each(o, self._managers(), progress)

    def persist(self) -> None:
        """Persist this handle's current checkpoint to ``persist_path`` now.

        Written in the background on every manager (see :meth:`sync`),
        whatever ``persist_freq`` and ``persist_count`` say.
        """
        self._no_batch("persist()")
        self._each(Persist(self._chkpt), "persist")

    def persisted_ids(self) -> list[int]:
        """Checkpoint ids persisted (and committed) on every manager, ascending."""
        sets = [set(ids) for ids in self._each(PersistedIds())]
        return sorted(set.intersection(*sets)) if sets else []

    def sync(self) -> None:
        """Wait until background persistence is done on every manager.

        Then every manager applies ``persist_count`` over the checkpoints now
        complete on all of them (one more broadcast): after ``sync()``, each
        holds the newest ``persist_count`` complete checkpoints and nothing older.
        """
        self._each(Sync(), "sync")
        if self._core.layout.options.persist_count > 0:
            self._each(Rotate())

    def restore(self, chkpt: int) -> None:
        """Load persisted checkpoint ``chkpt`` on every manager and move this handle to it.

        Outside read-only mode, persisted checkpoints newer than ``chkpt`` are
        discarded (the history continues from it).  Other handles keep their
        own checkpoint ids.

        Raises
        ------
        DDictPersistCheckpointError
            If some manager has not persisted ``chkpt``.
        """
        check_int("chkpt", chkpt, 0)
        self._no_batch("restore()")
        self.sync()
        ids = self.persisted_ids()
        if chkpt not in ids:
            raise DDictPersistCheckpointError(
                f"checkpoint {chkpt} is not persisted on every manager (persisted: {ids})"
            )
        self._each(Restore(chkpt), f"restore {chkpt}")
        self._chkpt = chkpt

    def advance(self) -> int:
        """Read-only replay: load the next persisted checkpoint (``+ persist_freq``).

        Returns the new checkpoint id (this handle moves to it).
        """
        new = self._each(Advance(), "advance")
        self._chkpt = max(new)
        return self._chkpt
