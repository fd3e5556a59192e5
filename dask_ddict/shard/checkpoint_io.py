"""Persisting, restoring and replicating a manager's checkpoints.

The part of :class:`~dask_ddict.shard.manager.Manager` that moves whole
checkpoints in and out of its shard, kept apart from the key operations:

* retiring checkpoints are persisted from a read snapshot taken inside the
  write that retires them (so the write path never waits for zarr);
* ``persist``/``restore``/``advance`` and ``sync`` serve the dictionary's
  persistence calls (the zarr I/O itself is :mod:`dask_ddict.persist`);
* ``dump_page``/``replace_with``/``copy_from`` copy a whole shard, manager to
  manager, for ``clone``, ``copy`` and ``synchronize_ddicts``.
"""

from __future__ import annotations

import logging
import pickle
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import lmdb

from ..errors import DDictError
from . import key_counts

if TYPE_CHECKING:
    from ..persist.persister import Persister
    from .store import ShardStore
    from .working_set import WorkingSet

logger = logging.getLogger(__name__)

#: The shard's record of its persists (in ``meta``, beside the data, so that it outlives
#: the host process): ``{"pending": {chkpt: version}, "failed": {chkpt: why}}``.  A
#: checkpoint is pending from the write that accepts it (``persist()``, or the
#: retirement that wants it) until its store commits that version of it; a failed one
#: stays failed until this manager commits it or a newer one.
_PERSISTS = b"persists"
#: The shard's *history* (in ``meta``): the version of a checkpoint persisted as it
#: retires (see ``persist.versioned``).  The same on every manager of a dictionary: set
#: from its uid when its shards are made, and to the number a restore sends to all.
HISTORY = b"history"
_MASK = (1 << 62) - 1
#: Why a persist is failed when the host process that accepted it died before it was
#: committed and the checkpoint can no longer be read as it was.
LOST = (
    "the host process that accepted it died before committing it, and the checkpoint "
    "has retired since, so it cannot be read again"
)


class CheckpointIO:
    """Whole checkpoints in and out of a manager's shard (a base of ``Manager``)."""

    manager_id: int
    store: ShardStore
    working_set: WorkingSet
    read_only: bool
    persister: Persister | None
    pull_shard: Callable[[Any, str, int], int] | None  # (the manager, source, manager id)
    _cond: threading.Condition
    _changed: Callable[[], None]
    _dumps: dict[int, lmdb.Transaction]
    _next_dump: int
    _retiring: list[int]
    _snapshot: lmdb.Transaction | None

    if TYPE_CHECKING:  # provided by the manager

        def _check_open(self) -> None: ...
        def _clear_batches(self, txn: lmdb.Transaction) -> None: ...

    # -- persistence of retiring checkpoints ------------------------------------

    def _on_retire(self, txn: lmdb.Transaction, chkpt: int) -> None:
        """Working-set hook, inside the write transaction that retires ``chkpt``.

        A read transaction begun now sees the last commit, i.e. the shard
        before this write changed anything, where ``chkpt`` is still whole
        (under ``wait_for_keys`` retirement deletes its non-persistent keys).
        """
        assert self.persister is not None
        if self.persister.wants(chkpt):
            if self._snapshot is None:
                self._snapshot = self.store.read()
            self._retiring.append(chkpt)
            self._note(txn, accepted=(chkpt, self.history(txn)))

    def _drop_retiring(self) -> None:
        if self._snapshot is not None:
            self._snapshot.abort()
        self._snapshot, self._retiring = None, []

    def _persist_retired(self) -> None:
        snap, ids = self._snapshot, self._retiring
        self._snapshot, self._retiring = None, []
        assert snap is not None and self.persister is not None
        version = self.history(snap)  # (as it was when they retired)
        self.persister.submit(snap.abort, [(c, version, self._entries_at(snap, c)) for c in ids])

    def _entries_at(self, txn: lmdb.Transaction, chkpt: int) -> Callable[[], Iterator[Any]]:
        ws = self.working_set

        def entries() -> Iterator[tuple[memoryview, memoryview, int]]:
            for _, e in ws.state_at(txn, chkpt):
                yield e.key, e.frame, e.flags

        return entries

    def _need_persister(self, what: str) -> Persister:
        if self.persister is None:
            raise DDictError(f"{what} needs persist_path= at creation", "INVALID_OPERATION")
        return self.persister

    def history(self, txn: lmdb.Transaction) -> int:
        """The shard's history (:data:`HISTORY`): the version of retiring checkpoints."""
        raw = self.store.get_meta(txn, HISTORY)
        return 0 if raw is None else int(raw)

    def set_history(self, txn: lmdb.Transaction, history: int) -> None:
        self.store.put_meta(txn, HISTORY, str(int(history) & _MASK).encode())

    def persist(self, chkpt: int, version: int = 0) -> None:
        """Persist this manager's part of ``version`` of checkpoint ``chkpt`` now (in the
        background), whatever ``persist_freq``.  Every manager is sent the same
        version by ``persist()`` (0, from a client that sends none: as before versions,
        every such persist of ``chkpt`` is one version, its newest generation read)."""
        persister = self._need_persister("persist()")
        with self._cond:
            self._check_open()
            self.working_set.check_retired(chkpt)
            self.store.transact(lambda txn: self._note(txn, accepted=(chkpt, version)))
            snap = self.store.read()
        persister.submit(snap.abort, [(chkpt, version, self._entries_at(snap, chkpt))])

    def persisted_ids(self) -> list[int]:
        """The ids with a version every manager has committed (one listing of the
        store's commit record)."""
        return [] if self.persister is None else self.persister.store.complete_ids()

    def sync(self) -> list[tuple[int, str]]:
        """Wait for background persistence to finish; the checkpoints that failed.

        ``[(chkpt, why), ...]``: accepted for persistence here (by ``persist()`` or
        a retirement) and not committed, for good: the store refused them, or the
        host process that accepted them died and they could not be read again
        (:meth:`resume_persists`).  Reading them changes nothing (a resent sync
        says the same); they stay failed until this manager commits them or a
        newer checkpoint.
        """
        if self.persister is None:
            return []
        self.persister.sync()
        with self.store.read() as txn:
            return sorted(self._persists(txn)["failed"].items())

    # -- the shard's record of its persists -----------------------------------------

    def _persists(self, txn: lmdb.Transaction) -> dict[str, Any]:
        raw = self.store.get_meta(txn, _PERSISTS)
        state = {"pending": {}, "failed": {}} if raw is None else pickle.loads(raw)
        if isinstance(state["pending"], set):  # (an older shard's: versions unknown)
            state["pending"] = {c: None for c in state["pending"]}
        return state

    def _note(
        self,
        txn: lmdb.Transaction,
        *,
        accepted: tuple[int, int] | None = None,
        done: tuple[int, int | None] | None = None,
        failed: tuple[int, int | None, str] | None = None,
    ) -> None:
        """Record a persist ``(chkpt, version)`` accepted, committed (``done``) or failed
        (``(chkpt, version, why)``), in ``txn``.  A checkpoint pending in a later version
        than the one reported stays pending."""
        state = self._persists(txn)
        pending = state["pending"]
        if accepted is not None:
            pending[accepted[0]] = accepted[1]
        if done is not None:
            if pending.get(done[0], done[1]) in (done[1], None):
                pending.pop(done[0], None)
            state["failed"] = {c: why for c, why in state["failed"].items() if c > done[0]}
        if failed is not None:
            if pending.get(failed[0], failed[1]) in (failed[1], None):
                pending.pop(failed[0], None)
            state["failed"][failed[0]] = failed[2]
        self.store.put_meta(txn, _PERSISTS, pickle.dumps(state))

    def _forget_persists(self, txn: lmdb.Transaction, chkpt: int) -> None:
        """A restore of ``chkpt``: the persists of ``chkpt`` and newer, failed or
        pending (all ended: the restore waited for them), are of a history that ends
        here (a failed newer version of ``chkpt`` too: the restored one is the
        checkpoint now), so ``sync()`` no longer reports them."""
        state = self._persists(txn)
        for kind in ("pending", "failed"):
            state[kind] = {c: v for c, v in state[kind].items() if c < chkpt}
        self.store.put_meta(txn, _PERSISTS, pickle.dumps(state))

    def _persisted(self, chkpt: int, version: int, error: BaseException | None) -> None:
        """The persister's report of one job (its thread): recorded in the shard."""
        with self._cond:  # (a closing manager too: its store closes after its persists)
            if error is None:
                self.store.transact(lambda txn: self._note(txn, done=(chkpt, version)))
            else:
                why = f"{type(error).__name__}: {error}"
                self.store.transact(lambda txn: self._note(txn, failed=(chkpt, version, why)))

    def resume_persists(self) -> None:
        """Redo the persists a dead host process accepted and did not commit.

        Called when a new host process re-attaches the shard.  A checkpoint still
        in the window, or (without ``wait_for_keys``, whose retirement drops
        versions) the one that retired last, reads exactly as it did: it is
        persisted again.  Any other is recorded as failed (:data:`LOST`), which
        ``sync()`` then reports.
        """
        if self.persister is None:
            return
        with self.store.read() as txn:
            pending = sorted(self._persists(txn)["pending"].items())
        if not pending:
            return
        # (finished, but not noted in the shard before it died: that version of it)
        committed = self.persister.store.recorded()
        ws = self.working_set
        floor = ws.oldest - (0 if ws.wait_for_keys else 1)

        def done(c: int, v: int | None) -> bool:
            return any(c == chkpt and v in (None, version) for chkpt, version in committed)

        redo = [(c, v) for c, v in pending if not done(c, v) and c >= floor]

        def settle(txn: lmdb.Transaction) -> None:
            for c, v in pending:
                if done(c, v):
                    self._note(txn, done=(c, v))
                elif c < floor:
                    logger.warning(
                        "ddict manager %d: checkpoint %d was not persisted: %s",
                        self.manager_id,
                        c,
                        LOST,
                    )
                    self._note(txn, failed=(c, v, LOST))

        with self._cond:
            self.store.transact(settle)
            snap = self.store.read()
        if redo:
            logger.info(
                "ddict manager %d: persisting again checkpoints %s, which the previous "
                "host process accepted and did not commit",
                self.manager_id,
                [c for c, _ in redo],
            )
            assert self.persister is not None
            self.persister.submit(
                snap.abort,
                [
                    (c, self.history(snap) if v is None else v, self._entries_at(snap, c))
                    for c, v in redo
                ],
            )
        else:
            snap.abort()

    def rotate(self) -> None:
        """Remove what newer versions replaced, and apply ``persist_count`` over the
        checkpoints complete on every manager now."""
        if self.persister is not None and not self.read_only:
            self.persister.rotate()

    def restore(self, chkpt: int, *, discard_newer: bool = True, history: int = 0) -> int:
        """Replace the shard by persisted checkpoint ``chkpt`` (its newest version that
        every manager has: see ``VersionedPersister.versions``); return its key count.

        The window becomes ``[chkpt, chkpt + working_set_size - 1]``.  Outside
        read-only mode persisted checkpoints newer than ``chkpt`` are deleted
        (the history continues from it, as in Dragon), and the shard's history
        becomes ``history`` (the same number on every manager; 0: one derived from
        the current history and ``chkpt``, the same on managers that had the same).
        """
        persister = self._need_persister("restore()")
        persister.sync()
        with self._cond:
            self._check_open()
            snap = self.working_set.snapshot()
            try:
                with self.store.write() as txn:
                    n = self.working_set.reset_to(txn, chkpt, persister.store.read(chkpt))
                    self._clear_batches(txn)
                    if not self.read_only:
                        self.set_history(
                            txn, history or (self.history(txn) * 1_000_003 + chkpt + 1)
                        )
                        self._forget_persists(txn, chkpt)
            except BaseException:
                self.working_set.restore(snap)
                raise
            self._changed()
        if discard_newer and not self.read_only:
            persister.discard_above(chkpt)
        return n

    def advance(self) -> int:
        """Read-only replay: load the checkpoint ``persist_freq`` after the current one."""
        if not self.read_only:
            raise DDictError("advance() is for read_only dictionaries", "INVALID_OPERATION")
        persister = self._need_persister("advance()")
        step = persister.persist_freq or 1
        nxt = self.working_set.oldest + step
        self.restore(nxt, discard_newer=False)
        return nxt

    # -- replication (clone, copy, synchronize_ddicts) ----------------------------------

    def dump_page(self, token: int | None, after: bytes | None, max_bytes: int = 8 << 20) -> Any:
        """One page of this shard's raw records, from one snapshot across pages.

        The first call (``token=None``) opens the snapshot and returns its
        token; the last page (``more=False``) closes it.  Returns
        ``(records, more, working-set state, token)``.
        """
        self._check_open()
        with self._cond:
            if token is None:
                self._next_dump += 1
                token = self._next_dump
                self._dumps[token] = self.store.read()
            txn = self._dumps.get(token)
            if txn is None:
                raise DDictError(f"unknown or finished dump {token}", "INVALID_ARGUMENT")
            ws = self.working_set
            state = {
                "newest": ws.newest,
                "size": ws.size,
                "writers": {c: sorted(w) for c, w in ws.writers.items()},
            }
        records, more = self.store.raw_page(txn, after, max_bytes)
        if not more:
            with self._cond:
                self._dumps.pop(token, None)
            txn.abort()
        return records, more, state, token

    def replace_with(
        self, pages: Iterator[tuple[list[tuple[bytes, bytes]], dict[str, Any]]]
    ) -> int:
        """Replace the whole shard (every checkpoint of the window) by another's pages."""
        n = 0
        with self._cond:
            self._check_open()
            snap = self.working_set.snapshot()
            try:
                with self.store.write() as txn:
                    self.store.drop_all(txn)
                    state: dict[str, Any] = {}
                    for records, state in pages:  # noqa: B007 (the last page's state is read below)
                        self.store.put_raw(txn, records)
                        n += len(records)
                    if state.get("size", self.working_set.size) != self.working_set.size:
                        raise DDictError(
                            f"cannot copy a shard with working_set_size={state['size']} into "
                            f"one with {self.working_set.size}",
                            "INVALID_ARGUMENT",
                        )
                    if state:
                        self.working_set.load(state)
                        self.working_set.save(txn)
                    key_counts.store_recount(self.store, txn, self.working_set.window)
                    self._clear_batches(txn)
            except BaseException:
                self.working_set.restore(snap)
                raise
            self._changed()
        return n

    def copy_from(self, source: str, manager_id: int) -> int:
        """Pull shard ``manager_id`` of the dictionary serialized as ``source`` (clone)."""
        if self.pull_shard is None:
            raise DDictError("this manager cannot replicate (no puller)", "INVALID_OPERATION")
        return self.pull_shard(self, source, manager_id)
