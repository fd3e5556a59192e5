"""WorkingSet: Dragon's checkpoint rules over a versioned shard.

This module is pure decision logic: it never blocks, never locks and never
talks to a socket.  Every method takes an open store transaction; when an
operation cannot proceed yet it raises :class:`MustWait` and the caller (the
manager) decides whether to wait for a later write, to fail with a timeout, or
(for batch puts) to raise :class:`~dask_ddict.errors.DDictFutureCheckpointError`.

The model (Dragon's, ``docs/dragon.md``):

* each manager keeps a window of ``size`` checkpoints ``[oldest, newest]``,
  initially ``[0, size - 1]``; ``oldest == newest - size + 1`` always;
* a write at ``c > newest`` advances the window one checkpoint at a time,
  retiring the oldest; under ``wait_for_keys`` a checkpoint retires only once
  every non-persistent key it holds is re-written in the next one, under
  ``wait_for_writers`` only once every client that wrote into it has written
  into a later one;
* a read at ``c`` sees the newest version at or below ``c``; under
  ``wait_for_keys`` a non-persistent version only at its own checkpoint;
* deletes write tombstones that hide older versions at ``c`` and later, while
  readers at older checkpoints still see them (Dragon lets an older version
  reappear when a key written at ``c`` is deleted at ``c``; we do not);
* any operation below ``oldest`` raises ``DDictCheckpointSyncError``.

Storage: every version is its own store entry.  Retiring checkpoint ``p``
keeps, per key written at ``p``, only the version at ``p`` (the new *base*,
which is what "carrying keys forward" means here) and drops tombstones and,
under ``wait_for_keys``, non-persistent versions.  So at most one version per
key lives below ``oldest``, and retirement costs O(keys written at ``p``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

import lmdb

from .. import kernels
from .._hashing import key_digest
from .._serialize import frame_parts
from ..errors import (
    DDictError,
    DDictFutureCheckpointError,
    DDictKeyError,
)
from . import key_counts
from .key_counts import Window
from .reader_marks import put_newest
from .store import PERSISTENT, TOMBSTONE, Entry, ShardStore
from .visibility import check_window, entry_visible, unseen, visible_entries

_STATE = b"working_set"


class MustWait(Exception):
    """The operation cannot proceed until another write changes the shard."""


class WorkingSet(kernels.WindowState):
    """Checkpoint window and per-operation rules of one manager.

    Parameters
    ----------
    store
        The shard the versions live in.
    size
        ``working_set_size``: checkpoints kept in the window (>= 1).
    wait_for_keys, wait_for_writers
        Dragon's retirement constraints.
    start
        Checkpoint id of the window's first checkpoint (``restore_from``).
    on_retire
        Called as ``on_retire(txn, chkpt)`` just before a checkpoint retires,
        e.g. to persist it.  Injected so this class stays free of I/O policy.
    """

    store: ShardStore
    size: int
    wait_for_keys: bool
    wait_for_writers: bool
    newest: int
    writers: dict[int, set[int]]
    _window: Window | None
    on_retire: Callable[[lmdb.Transaction, int], None] | None

    def __init__(
        self,
        store: ShardStore,
        size: int = 1,
        *,
        wait_for_keys: bool = False,
        wait_for_writers: bool = False,
        start: int = 0,
        on_retire: Callable[[lmdb.Transaction, int], None] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("working_set_size must be >= 1")
        self.store = store
        self.size = size
        self.wait_for_keys = wait_for_keys
        self.wait_for_writers = wait_for_writers
        self.newest = start + size - 1
        self._window: Window | None = None
        self.writers = {}
        self.on_retire = on_retire

    def __repr__(self) -> str:
        return (
            f"<WorkingSet window=[{self.oldest}, {self.newest}] size={self.size} "
            f"wait_for_keys={self.wait_for_keys} wait_for_writers={self.wait_for_writers}>"
        )

    @property
    def oldest(self) -> int:
        return max(0, self.newest - self.size + 1)

    @property
    def window(self) -> Window:
        w = self._window
        if w is None or w.newest != self.newest:  # (built once per window move)
            w = self._window = key_counts.window(self.newest, self.size, self.wait_for_keys)
        return w

    # -- state that must survive the process (restart) -------------------------

    def save(self, txn: lmdb.Transaction) -> None:
        state = {
            "newest": self.newest,
            "size": self.size,
            "wait_for_keys": self.wait_for_keys,
            "wait_for_writers": self.wait_for_writers,
            "writers": self.writers,
        }
        self.store.put_meta(txn, _STATE, pickle.dumps(state))
        # The window's end on its own, for same-host readers (no unpickling per read).
        put_newest(self.store, txn, self.newest)

    @classmethod
    def saved_state(cls, store: ShardStore) -> dict[str, Any] | None:
        with store.read() as txn:
            raw = store.get_meta(txn, _STATE)
        return None if raw is None else pickle.loads(raw)

    def load(self, state: dict[str, Any]) -> None:
        self.newest = state["newest"]
        self.writers = {int(k): set(v) for k, v in state["writers"].items()}

    def reset_to(
        self, txn: lmdb.Transaction, chkpt: int, entries: Iterator[tuple[bytes, Any, int]]
    ) -> int:
        """Replace the whole shard by a persisted checkpoint ``chkpt``.

        The window becomes ``[chkpt, chkpt + size - 1]`` (Dragon's restore);
        ``entries`` yields ``(key bytes, value frame, flags)``.  Returns the
        number of keys loaded.
        """
        self.store.drop_all(txn)
        n = 0
        for key, frame, flags in entries:
            self.store.put(txn, key_digest(key), chkpt, key, frame, flags & PERSISTENT)
            n += 1
        self.newest = chkpt + self.size - 1
        self.writers = {}
        self.save(txn)
        key_counts.store_recount(self.store, txn, self.window)
        return n

    # -- window -------------------------------------------------------------

    def check_retired(self, chkpt: int) -> None:
        check_window(chkpt, self.newest, self.size)

    def can_retire(self, txn: lmdb.Transaction, p: int, client: int | None = None) -> bool:
        """Whether the oldest checkpoint ``p`` may retire now."""
        if self.wait_for_keys:
            for d in self.store.digests_at(txn, p):
                e = self.store.exact(txn, d, p)
                if e is None or e.tombstone or e.persistent:
                    continue
                child = self.store.exact(txn, d, p + 1)
                if child is None or child.tombstone:
                    return False
        if self.wait_for_writers:
            moved = set().union(*(self.writers.get(i, ()) for i in range(p + 1, self.newest + 1)))
            if client is not None:
                moved.add(client)
            if self.writers.get(p, set()) - moved:
                return False
        return True

    def advance_to(
        self, txn: lmdb.Transaction, chkpt: int, client: int | None = None, *, batch: bool = False
    ) -> None:
        """Advance the window until ``chkpt`` is its newest checkpoint.

        Raises
        ------
        MustWait
            A retirement constraint holds (the caller may wait).
        DDictFutureCheckpointError
            The same, for batch puts, which are never deferred.
        """
        changed, before = False, self.window
        try:
            while self.newest < chkpt:
                p = self.oldest
                if self.newest - p + 1 >= self.size:
                    if not self.can_retire(txn, p, client):
                        if batch:
                            raise DDictFutureCheckpointError(
                                f"checkpoint {chkpt} is ahead of the working set "
                                f"[{self.oldest}, {self.newest}] and checkpoint {p} "
                                "cannot retire yet (batch puts are never deferred)"
                            )
                        raise MustWait
                    self._retire(txn, p)
                self.newest += 1
                changed = True
        finally:
            if changed:
                self.save(txn)
                key_counts.shifted(self.store, txn, before, self.newest)

    def _retire(self, txn: lmdb.Transaction, p: int) -> None:
        if self.on_retire is not None:
            self.on_retire(txn, p)
        self.writers.pop(p, None)
        if not self.wait_for_keys:
            # Every version stays readable at later checkpoints (all keys carry
            # forward); dead versions are collected when their key is written.
            return
        for d in self.store.digests_at(txn, p):
            e = self.store.exact(txn, d, p)
            self.store.delete_below(txn, d, p)
            if e is not None and (e.tombstone or not e.persistent):
                self.store.delete(txn, d, p)

    def snapshot(self) -> tuple[int, dict[int, set[int]] | None]:
        """In-memory state to restore if a write transaction is rolled back."""
        writers = {c: set(w) for c, w in self.writers.items()} if self.writers else None
        return self.newest, writers

    def restore(self, snap: tuple[int, dict[int, set[int]] | None]) -> None:
        self.newest = snap[0]
        self.writers = snap[1] or {}

    def prepare_write(
        self, txn: lmdb.Transaction, chkpt: int, client: int, *, batch: bool = False
    ) -> None:
        """Checks and window moves every write does first (retired, advance, writers)."""
        newest = self.newest
        if chkpt > newest:
            self.advance_to(txn, chkpt, client, batch=batch)
        elif chkpt < newest - self.size + 1 or chkpt < 0:  # (below oldest: check_retired)
            check_window(chkpt, newest, self.size)
        if self.wait_for_writers:
            ws = self.writers.setdefault(chkpt, set())
            if client not in ws:
                ws.add(client)
                self.save(txn)

    # -- reads ----------------------------------------------------------------

    def is_visible(self, e: Entry | None, chkpt: int) -> bool:
        """Whether version ``e`` (the newest at or below ``chkpt``) is seen at ``chkpt``."""
        return entry_visible(e, chkpt, self.wait_for_keys)

    def get(self, txn: lmdb.Transaction, digest: bytes, chkpt: int) -> Entry:
        """The entry visible at ``chkpt``.

        Raises ``DDictKeyError`` when absent, or :class:`MustWait` under
        ``wait_for_keys`` (a reader of a key not yet written at its
        checkpoint waits for the writer).
        """
        if chkpt < self.newest - self.size + 1 or chkpt < 0:  # (below oldest: check_retired)
            self.check_retired(chkpt)
        e = self.store.lookup(txn, digest, chkpt)
        if e is not None and not (e.flags & TOMBSTONE or self.wait_for_keys):  # (is_visible,
            return e  # for the common case: then every version but a tombstone is seen)
        if self.is_visible(e, chkpt):
            assert e is not None
            return e
        if unseen(e, chkpt, self.wait_for_keys) is False:
            raise MustWait
        raise DDictKeyError()

    def get_many(
        self, txn: lmdb.Transaction, digests: list[bytes], chkpt: int, small: int = 0
    ) -> list[Any]:
        """The frames visible at ``chkpt`` in ``digests`` order: ``None`` where absent,
        ``False`` where a reader must wait (``wait_for_keys``; see :meth:`get`); those
        under ``small`` bytes as copies (:func:`~dask_ddict.kernels.lookup_frames`)."""
        self.check_retired(chkpt)
        wfk = self.wait_for_keys
        if not wfk:  # (every live version is seen: the frames straight from the cursor)
            return self.store.lookup_many(txn, digests, chkpt, frames=True, small=small)
        return [
            e.frame if entry_visible(e, chkpt, wfk) else unseen(e, chkpt, wfk)
            for e in self.store.lookup_many(txn, digests, chkpt)
        ]

    def contains(self, txn: lmdb.Transaction, digest: bytes, chkpt: int) -> bool:
        """Membership at ``chkpt``; never waits."""
        self.check_retired(chkpt)
        return self.is_visible(self.store.lookup(txn, digest, chkpt, whole=False), chkpt)

    def visible(
        self, txn: lmdb.Transaction, chkpt: int, after: bytes | None = None
    ) -> Iterator[tuple[bytes, Entry]]:
        """Entries visible at ``chkpt`` in digest order, resuming after ``after``."""
        self.check_retired(chkpt)
        return self.state_at(txn, chkpt, after)

    def state_at(
        self, txn: lmdb.Transaction, chkpt: int, after: bytes | None = None
    ) -> Iterator[tuple[bytes, Entry]]:
        """:meth:`visible` without the retirement check.

        The persister reads a retiring checkpoint from a snapshot taken just
        before it retired: in that snapshot it is still the window's oldest.
        """
        return visible_entries(self.store, txn, chkpt, after, self.wait_for_keys)

    def length(self, txn: lmdb.Transaction, chkpt: int) -> int:
        """Keys seen at ``chkpt``, from the shard's counts (no scan)."""
        self.check_retired(chkpt)
        w = self.window
        return key_counts.load(self.store, txn, w)[w.slot(chkpt)]

    # -- writes ---------------------------------------------------------------

    def put(
        self,
        txn: lmdb.Transaction,
        digest: bytes,
        chkpt: int,
        key: bytes,
        frame: Any,
        client: int,
        *,
        persistent: bool = False,
        batch: bool = False,
        tally: key_counts.Tally | None = None,
    ) -> None:
        """Store a value at ``chkpt`` (advancing the window if needed); its key count
        changes in ``tally`` if given (a run of puts in one transaction settles it)."""
        self._put_ready(txn, chkpt, client, batch, tally)
        t = type(frame)
        self.store.check_room(
            txn,
            (
                len(frame)
                if t is bytes
                else frame.nbytes
                if t is memoryview
                else frame_parts(frame)[1]
            )
            + len(key),
        )
        key_counts.put(
            self.store,
            txn,
            self.window,
            digest,
            chkpt,
            key,
            frame,
            self._put_flags(persistent),
            tally,
        )

    def put_alone(self, digest: bytes, chkpt: int, key: bytes, frame: Any, client: int) -> bool:
        """:meth:`put` in a write transaction of its own where it is nothing more than the
        put (a window of one checkpoint, at it, no ``wait_for_*``): whether it was put
        and committed (:meth:`~.store.ShardStore.attempt`).  Otherwise nothing changed,
        and the caller writes it the full way (``Manager._write``: a move of the window,
        a refusal that collecting dead versions may answer, the error that says why).
        A put is the hot path: this is a third of the Python calls of the full way."""
        if self.size != 1 or self.wait_for_keys or self.wait_for_writers or chkpt != self.newest:
            return False
        return self.store.attempt(lambda txn: self.put(txn, digest, chkpt, key, frame, client))

    def _put_ready(
        self,
        txn: lmdb.Transaction,
        chkpt: int,
        client: int,
        batch: bool,
        tally: key_counts.Tally | None,
    ) -> None:
        """What a put at ``chkpt`` does first: :meth:`prepare_write`, when it has anything
        to do (the checkpoint outside the window, or ``wait_for_writers``)."""
        newest = self.newest
        if chkpt > newest or chkpt < newest - self.size + 1 or chkpt < 0 or self.wait_for_writers:
            if tally is not None:
                tally.settle()  # (the counts move with the window)
            self.prepare_write(txn, chkpt, client, batch=batch)

    def _put_flags(self, persistent: bool) -> int:
        """A put's version flags (under ``wait_for_keys`` only a persistent put persists)."""
        return PERSISTENT if (persistent or not self.wait_for_keys) else 0

    def put_many(
        self,
        txn: lmdb.Transaction,
        records: list[tuple[bytes, bytes, Any]],
        chkpt: int,
        client: int,
        *,
        persistent: bool = False,
        batch: bool = False,
        tally: key_counts.Tally,
    ) -> tuple[int, DDictError | None]:
        """:meth:`put` for each ``(digest, key, frame)`` record in order, the window moved
        once (:func:`~.key_counts.put_run`): ``(how many were put, the error that stopped the
        next one)``."""
        try:
            self._put_ready(txn, chkpt, client, batch, tally)
        except DDictError as e:
            return 0, e
        return key_counts.put_run(
            self.store, txn, self.window, records, chkpt, self._put_flags(persistent), tally
        )

    def pop(self, txn: lmdb.Transaction, digest: bytes, chkpt: int, client: int) -> bytes:
        """Delete the key at ``chkpt`` and return (a copy of) its value frame.

        Under ``wait_for_keys`` a key not yet written at ``chkpt`` is waited for
        (:class:`MustWait`), as a read waits, and a delete always leaves a
        tombstone at ``chkpt``: the key is then known to be absent there.
        """
        self.prepare_write(txn, chkpt, client)
        e = self.store.lookup(txn, digest, chkpt)
        if not self.is_visible(e, chkpt):
            if unseen(e, chkpt, self.wait_for_keys) is False:
                raise MustWait
            raise DDictKeyError()
        assert e is not None
        old, key, at = bytes(e.frame), bytes(e.key), e.chkpt

        def change() -> None:
            if at == chkpt and not self.wait_for_keys:  # (under it: always a tombstone)
                self.store.delete(txn, digest, chkpt)
                older = (  # (its flags alone)
                    self.store.lookup(txn, digest, chkpt - 1, whole=False) if chkpt > 0 else None
                )
                if older is None or older.tombstone:
                    return
            self.store.put(txn, digest, chkpt, key, None, TOMBSTONE)  # (replaces one at chkpt)
            self.store.collect(txn, digest, self.oldest)

        key_counts.tracked(self.store, txn, digest, self.window, change)
        return old

    def clear(self, txn: lmdb.Transaction, chkpt: int, client: int) -> None:
        """Empty checkpoint ``chkpt`` (Dragon: older checkpoints keep their keys).

        At the oldest checkpoint the keys carried forward into it go too, so
        with ``working_set_size=1`` the dictionary ends up empty.
        """
        self.prepare_write(txn, chkpt, client)
        if self.store.entries(txn):  # (an empty shard: no page is written)
            if chkpt == self.oldest == self.newest:
                self.store.drop_all(txn)
            elif chkpt == self.oldest:
                doomed = [(d, e.chkpt) for d, e in self.store.scan(txn) if e.chkpt <= chkpt]
                for d, c in doomed:
                    self.store.delete(txn, d, c)
            else:
                retired = [d for d, e in self.store.scan(txn) if e.chkpt == chkpt]
                for d in retired:
                    self.store.delete(txn, d, chkpt)
            key_counts.store_recount(self.store, txn, self.window)  # clear scans every key anyway
        if self.writers.pop(chkpt, None):
            self.save(txn)
