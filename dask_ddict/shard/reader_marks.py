"""The marks a shard carries for the processes that read it directly.

Same-host clients map a shard and read it without asking its manager
(:mod:`dask_ddict.transport.shared`), so what they must know of the manager's
state is written into the shard's ``meta`` database, in the transactions that
change it: the newest checkpoint and whether (and why) the manager closed, whether
the dictionary is frozen, and how many operations wait at the manager (a direct
commit would not wake them, so it is not taken while any do).  Kept apart from
:mod:`.working_set`, whose rules write most of them, because readers in other
processes depend on these keys and their encoding, not on the rules.
"""

from __future__ import annotations

import struct

import lmdb

from ..kernels.pure import FROZEN, NEWEST, WAITERS
from .store import ShardStore

_NEWEST = struct.Struct("<qB")  # newest checkpoint, closed flag
# (FROZEN: b"\x01" while frozen; WAITERS: how many operations wait at the manager for
# other writes)
_COUNT = struct.Struct("<q")


#: Why a shard's manager closed, as same-host readers see it in the shard
#: (``CLOSED_MOVED``: copied to another host; the manager answers there).
OPEN, CLOSED_DESTROYED, CLOSED_HOST_GONE, CLOSED_MOVED = 0, 1, 2, 3


def saved_newest(store: ShardStore, txn: lmdb.Transaction, size: int) -> tuple[int, int]:
    """``(newest checkpoint, closed)`` of a shard as of ``txn`` (for read-only readers).

    ``closed`` is :data:`OPEN`, :data:`CLOSED_DESTROYED` (the dictionary was
    destroyed) or :data:`CLOSED_HOST_GONE` (its host process shut down).
    """
    raw = txn.get(NEWEST, db=store.meta_db)
    if raw is None:
        return size - 1, OPEN
    newest, closed = _NEWEST.unpack(raw)
    return newest, closed


def put_newest(store: ShardStore, txn: lmdb.Transaction, newest: int, why: int = OPEN) -> None:
    """Write the shard's newest checkpoint and its closed mark (``why``) in ``txn``."""
    store.put_meta(txn, NEWEST, _NEWEST.pack(newest, why))


def mark_closed(store: ShardStore, newest: int, why: int = CLOSED_DESTROYED) -> None:
    """Tell same-host readers that the manager is gone (they map the shard themselves)."""
    with store.write() as txn:
        put_newest(store, txn, newest, why)


def mark_in(store: ShardStore, txn: lmdb.Transaction, size: int, why: int) -> None:
    """Set the shard's closed mark to ``why`` in ``txn``, keeping its newest checkpoint."""
    newest, _ = saved_newest(store, txn, size)
    put_newest(store, txn, newest, why)


def frozen(store: ShardStore, txn: lmdb.Transaction) -> bool:
    """Whether the shard is frozen as of ``txn`` (read-only: writes refused)."""
    return bool(txn.get(FROZEN, db=store.meta_db) == b"\x01")


def waiters(store: ShardStore, txn: lmdb.Transaction) -> int:
    raw = txn.get(WAITERS, db=store.meta_db)
    return 0 if raw is None else _COUNT.unpack(raw)[0]


def add_waiters(store: ShardStore, txn: lmdb.Transaction, n: int) -> None:
    """Count operations waiting at the manager (``n`` may be negative; 0 resets)."""
    count = 0 if n == 0 else max(0, waiters(store, txn) + n)
    store.put_meta(txn, WAITERS, _COUNT.pack(count))
