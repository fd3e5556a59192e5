"""At-most-once requests: the replies a manager keeps so that a resend is not applied twice.

A request that is not idempotent (``pop``, ``fetch_add``) carries a request id.
Its reply is stored in the shard in the same transaction as the change it
made, so a request resent after a broken connection (a host process restarted
between its commit and its answer) gets the first answer instead of being
applied again.  Replies are kept for the last ``RID_KEEP`` request ids; a large
one (a popped value) only until its client has read it (:meth:`AtMostOnce.delivered`),
so that the popped value's bytes are free for other keys at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import lmdb

from .._blocking import locked
from ..kernels.pure import BIG_REPLY, RID, RID_ID, RID_KEEP, RID_SEQ, RID_SLOT

if TYPE_CHECKING:
    from .store import ShardStore

logger = logging.getLogger(__name__)


def _reply_key(rid: int) -> bytes:
    """Where the reply of request ``rid`` is kept (the compiled servers' ``_rid_key``)."""
    return RID + RID_ID.pack(rid)


class _FullWay(Exception):
    """A request that :meth:`AtMostOnce.once_alone` leaves to the manager's full way."""


class AtMostOnce:
    """The kept replies of a manager (a base of ``Manager``)."""

    store: ShardStore
    closed: bool
    _mutex: threading.Lock
    _big_replies: set[int]

    def _once(
        self, txn: lmdb.Transaction, rid: int, fn: Callable[[lmdb.Transaction], bytes]
    ) -> bytes:
        """``fn(txn)``, or the reply it gave when request ``rid`` was applied before.

        The reply is stored in the same transaction as the change, so either
        both are committed or neither is.  ``rid == 0``: no deduplication.
        """
        if not rid:
            return fn(txn)
        done = self.store.get_meta(txn, _reply_key(rid))
        if done is not None:  # a resend: the reply its first try got, kept until read
            if len(done) > BIG_REPLY:
                self._big_replies.add(rid)
            return done
        reply = fn(txn)
        self._keep(txn, rid, reply)
        if len(reply) > BIG_REPLY:
            self._big_replies.add(rid)
        return reply

    def _keep(self, txn: lmdb.Transaction, rid: int, reply: bytes) -> None:
        """Keep ``reply`` under request id ``rid`` in the ring's next slot, whose request's
        reply goes."""
        raw = self.store.get_meta(txn, RID_SEQ)
        seq = 0 if raw is None else RID_ID.unpack(raw)[0]
        slot = RID_SLOT + RID_ID.pack(seq % RID_KEEP)
        old = self.store.get_meta(txn, slot)
        if old is not None:
            txn.delete(RID + old, db=self.store.meta_db)
        self.store.put_meta(txn, slot, RID_ID.pack(rid))
        self.store.put_meta(txn, RID_SEQ, RID_ID.pack(seq + 1))
        self.store.put_meta(txn, _reply_key(rid), reply)

    def once_alone(
        self, rid: int, fn: Callable[[lmdb.Transaction], bytes], most: int
    ) -> bytes | None:
        """:meth:`_once` of ``fn`` in a write transaction of its own (``store.attempt``: the
        caller holds the lock and checked that ``fn`` is nothing more there): its reply,
        or ``None`` with nothing written, for the caller to write it the full way (the
        manager's ``_write``): ``fn`` raised (the full way raises it, or does more),
        ``rid`` was applied before (the full way answers its kept reply), the reply is
        one kept only until its client read it (the full way tracks it), or it is over
        ``most`` bytes (the largest the caller sends)."""
        got: list[bytes] = []

        def apply(txn: lmdb.Transaction) -> None:
            if rid and self.store.get_meta(txn, _reply_key(rid)) is not None:
                raise _FullWay
            reply = fn(txn)
            if len(reply) > most or (rid and len(reply) > BIG_REPLY):
                raise _FullWay
            if rid:
                self._keep(txn, rid, reply)
            got.append(reply)

        return got[0] if self.store.attempt(apply) else None

    def keeps(self, rid: int) -> bool:
        """Whether request ``rid``'s reply is kept only until its client read it (then
        :meth:`delivered` drops it)."""
        return rid in self._big_replies

    def delivered(self, rid: int) -> None:
        """Request ``rid``'s client read its reply: a large kept reply is dropped now.

        The host learns it from the connection (the next request on a connection
        comes only after its previous reply was read whole), so a resend, which
        only follows a connection that broke before its reply was read, still finds
        the reply.  Small replies stay in the ring of the last ``RID_KEEP``.
        """
        if rid not in self._big_replies:
            return
        with locked(self._mutex):  # (a move holds it: a host's event loop moves on meanwhile)
            self._big_replies.discard(rid)
            if self.closed:
                return
            try:
                self.store.transact(lambda txn: txn.delete(_reply_key(rid), db=self.store.meta_db))
            except Exception:  # (the ring drops it later: never the connection's failure)
                logger.debug("kept reply %d not dropped", rid, exc_info=True)
