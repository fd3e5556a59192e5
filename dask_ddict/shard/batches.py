"""Batch puts: records streamed without a reply, each batch's count kept in the shard.

``start_batch_put()`` ... ``end_batch_put()`` sends records in messages that
nobody answers (:class:`~dask_ddict.transport.ops.BatchPut`); each manager
stores a message's records in one transaction, with the batch's count and first
error beside them in the shard's ``meta`` (so they survive a restart of the host
process), and :meth:`Batches.batch_end` answers the count once (and raises the
error).  The key counts of a message's records are saved once per message
(:class:`~.key_counts.Tally`).
"""

from __future__ import annotations

import pickle
import struct
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import lmdb

from .._blocking import locked
from ..errors import DDictError, DDictManagerMovedError
from . import key_counts
from .key_counts import Tally

if TYPE_CHECKING:
    from .store import ShardStore
    from .working_set import WorkingSet

_BATCH = b"batch:"  # + client id: (batch id, count, first error) of an open batch
_Q = struct.Struct("<Q")
T = TypeVar("T")


class Batches:
    """The open batches of a manager's clients (a base of ``Manager``)."""

    store: ShardStore
    working_set: WorkingSet
    _mutex: threading.Lock

    if TYPE_CHECKING:

        def _write(
            self,
            fn: Callable[[lmdb.Transaction], T],
            timeout: float | None,
            what: str,
            at: tuple[int, int] | None = None,
        ) -> T: ...

        def _check_open(self) -> None: ...

    def batch_put(
        self,
        records: list[tuple[bytes, bytes, Any]],
        chkpt: int,
        client: int,
        *,
        persistent: bool = False,
        batch: int = 0,
    ) -> None:
        """Store a batch of ``(digest, key, frame)`` without replying.

        Batch puts are never deferred.  The first error is remembered for
        :meth:`batch_end`; records before it in the message are kept, and so
        are earlier messages.  The batch's count and error live in the shard,
        written in the same transaction as its records, so they survive a
        restart of the host process; ``batch`` (an id the client draws per
        batch) keeps an abandoned batch of the same client from counting.
        """
        key = _BATCH + _Q.pack(client)
        ws = self.working_set

        def fn(txn: lmdb.Transaction) -> None:
            count, err = self._batch_state(txn, key, batch)
            tally = Tally(self.store, txn)
            if err is None:
                done, err = ws.put_many(
                    txn, records, chkpt, client, persistent=persistent, batch=True, tally=tally
                )
                if key_counts.transaction_lost(err):
                    raise err  # (rolled back, room made, tried again: see Manager._attempt)
                count += done
            tally.settle()
            self.store.put_meta(txn, key, pickle.dumps((batch, count, err)))
            self.store.later = True  # (answered at batch_end: replicas need not have it yet)

        try:
            self._write(fn, None, "batch put", (chkpt, client))
        except DDictManagerMovedError:
            raise  # (stored nowhere: its new place's count tells the client what to resend)
        except DDictError as e:  # nothing of this message was stored (frozen, full, ...)
            with locked(self._mutex), self.store.write() as txn:
                count, err = self._batch_state(txn, key, batch)
                self.store.put_meta(txn, key, pickle.dumps((batch, count, err or e)))

    def _batch_state(
        self, txn: lmdb.Transaction, key: bytes, batch: int
    ) -> tuple[int, DDictError | None]:
        raw = self.store.get_meta(txn, key)
        if raw is None:
            return 0, None
        stored, count, err = pickle.loads(raw)
        return (count, err) if stored == batch else (0, None)

    def batch_end(self, client: int, batch: int = 0) -> int:
        """Number of puts stored by the client's batch; raise its first error."""
        key = _BATCH + _Q.pack(client)
        with locked(self._mutex):
            self._check_open()  # (a manager that moved answers where it went)
            with self.store.write() as txn:
                count, err = self._batch_state(txn, key, batch)
                txn.delete(key, db=self.store.meta_db)
        if err is not None:
            raise err
        return count

    def _clear_batches(self, txn: lmdb.Transaction) -> None:
        """Forget every open batch (the shard was replaced under them)."""
        cur = txn.cursor(self.store.meta_db)
        if cur.set_range(_BATCH):
            while bytes(cur.key()).startswith(_BATCH):
                if not cur.delete():
                    break
