"""A handle's checkpoints: moving its own id, and the managers' persisted checkpoints.

Checkpoint moves (``checkpoint()``, ``rollback()``, ``checkpoint_id``) change
only the handle and send no message; the persistence calls send one typed
operation (:mod:`dask_ddict.transport.ops`) to every manager (or the chosen one).
"""

from __future__ import annotations

import time
from typing import Any

from ..arguments import check_int, check_timeout
from ..errors import DDictPersistCheckpointError, DDictTimeoutError
from ..transport.operation import Operation
from ..transport.ops import Newest
from ..transport.whole_checkpoints import (
    Advance,
    Persist,
    PersistedIds,
    Restore,
    Rotate,
    Sync,
    new_version,
)
from .base import HandleBase


class Checkpoints(HandleBase):
    """Checkpoint ids and persistence of a handle (a base of :class:`~dask_ddict.DDict`)."""

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
        self._each(Persist(self._chkpt, new_version()), "persist")

    def persisted_ids(self) -> list[int]:
        """Checkpoint ids persisted (and committed) on every manager, ascending."""
        sets = [set(ids) for ids in self._each(PersistedIds())]
        return sorted(set.intersection(*sets)) if sets else []

    def sync(self, timeout: float | str | None = None) -> None:
        """Wait until background persistence is done on every manager.

        When it returns, every checkpoint that was asked to be persisted
        (``persist()``, or a retirement under ``persist_freq``) is committed on
        every manager.  A host process that died while persisting leaves its
        successor to redo it, which ``sync()`` waits for too.  Then every manager
        applies ``persist_count`` over the checkpoints now complete on all of
        them (one more broadcast): after ``sync()``, each holds the newest
        ``persist_count`` complete checkpoints and nothing older, and of each
        checkpoint only its newest version that every manager has committed.

        Parameters
        ----------
        timeout
            Seconds (or a duration such as ``"30s"``) that the whole of it may
            take, both broadcasts included (plus ``ddict.transport.timeout-slack``
            for the answers to travel).  ``None`` (the default): as long as the
            store needs, whatever the handle's ``timeout``: a checkpoint's size,
            not the handle's latency, sets how long writing it takes.  Dragon's
            ``sync(timeout=...)``.

        Raises
        ------
        DDictPersistCheckpointError
            Naming each checkpoint that some manager failed to persist, those
            managers, and why (the store refused it, or its host process died
            and the checkpoint had retired since, so it could not be read
            again).  A manager reports a failed checkpoint until it commits it
            or a newer one.
        DDictTimeoutError
            ``timeout`` ran out first, naming the manager that did not answer.
            Nothing is lost: the persists go on in the background, and a later
            ``sync()`` waits for them again.
        """
        seconds = check_timeout(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        try:
            failed = self._each(Sync(seconds), "sync")
            if any(failed):
                raise DDictPersistCheckpointError(not_persisted(self._managers(), failed))
            if self._core.layout.options.persist_path:  # (each manager removes what is
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._each(Rotate(left))  # replaced everywhere now, what persist_count drops)
        except DDictTimeoutError as e:
            raise DDictTimeoutError(
                f"sync() of DDict {self._core.name!r}: background persistence was not done on "
                f"every manager within {seconds} s ({e.message}); the persists go on, and a "
                "later sync() waits for them"
            ) from None

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
        self._check()  # (a closed handle says so first)
        self._no_batch("restore()")
        if not self._core.layout.options.persist_path:
            raise DDictPersistCheckpointError(
                f"restore({chkpt}) of {self._core.name!r}: this dictionary persists nothing "
                "(it was created without persist_path=): create one with "
                "persist_path=<the zarr store> and restore_from=<checkpoint>"
            )
        try:
            self.sync()  # (persists under way end first: what they commit may be chkpt's)
        except DDictPersistCheckpointError:
            pass  # (one that failed leaves what was persisted before: chkpt may be there)
        ids = self.persisted_ids()
        if chkpt not in ids:
            opts = self._core.layout.options
            raise DDictPersistCheckpointError(
                f"restore({chkpt}) of {self._core.name!r}: checkpoint {chkpt} is not persisted "
                f"on every manager in the store {opts.persist_path!r} (persisted on every "
                f"manager: {ids}); nothing was changed"
            )
        self._each(Restore(chkpt, new_version()), f"restore {chkpt}")
        self._chkpt = chkpt

    def advance(self) -> int:
        """Read-only replay: load the next persisted checkpoint (``+ persist_freq``).

        Returns the new checkpoint id (this handle moves to it).
        """
        new = self._each(Advance(), "advance")
        self._chkpt = max(new)
        return self._chkpt


def not_persisted(mids: list[int], failed: list[list[tuple[int, str]]]) -> str:
    """What ``sync()`` says of the checkpoints that managers ``mids`` failed to persist
    (``failed[i]``: manager ``mids[i]``'s ``[(chkpt, why)]``): one line per checkpoint
    and reason, naming the managers."""
    by: dict[tuple[int, str], list[int]] = {}
    for mid, items in zip(mids, failed, strict=True):
        for chkpt, why in items:
            by.setdefault((chkpt, why), []).append(mid)
    lines = [
        f"checkpoint {c} on manager{'s' if len(ms) > 1 else ''} {', '.join(map(str, ms))}: {why}"
        for (c, why), ms in sorted(by.items())
    ]
    return (
        "sync(): some persisted checkpoints are not committed on every manager:\n  "
        + "\n  ".join(lines)
        + "\nPersist a checkpoint still in the working set again "
        "(d.persist() at it), or restore from one that persisted_ids() lists."
    )
