"""Puts that a same-host client commits into a shard itself, without its manager.

A put that changes nothing but its key (its checkpoint inside the window, the shard
open and not frozen, no operation waiting at the manager for a write) needs none of
the manager's in-memory state: the client commits it in a write transaction of its own,
which LMDB's writer lock orders with the manager's, and that commit is its
acknowledgement (see :mod:`dask_ddict.transport.shared`).  The rules are read from the
shard's metadata (:mod:`.working_set` keeps them there).
"""

from __future__ import annotations

from typing import Any

import lmdb

from ..errors import DDictError
from ..kernels.pure import OWNER
from . import key_counts
from .reader_marks import OPEN, frozen, saved_newest, waiters
from .store import PERSISTENT, ShardStore
from .visibility import check_window


def put_in_window(
    store: ShardStore,
    txn: lmdb.Transaction,
    size: int,
    digest: bytes,
    chkpt: int,
    key: bytes,
    frame: Any,
) -> bool:
    """A put that a same-host client may commit in the shard itself; ``False``: ask the manager.

    Only for dictionaries without ``wait_for_keys``/``wait_for_writers`` (no
    per-write bookkeeping, no blocked readers).  The client may do it when
    the put changes nothing but the key: its checkpoint is inside the window
    (no retirement, so no persistence and no in-memory state of the manager
    moves), the shard is open and not frozen, and no operation waits at the
    manager for a write (only the manager could wake it).  LMDB's writer lock
    orders it with the manager's own writes; its commit is the acknowledgement,
    exactly as for a put that the manager commits.
    """
    done, error = puts_in_window(store, txn, size, chkpt, [(digest, key, frame)])
    if error is not None:
        raise error
    return bool(done)


# OWNER: which host process serves the shard (its socket directory): a client that
# commits into a shard itself does so only for the host it knows (a manager may have
# moved).


def set_owner(store: ShardStore, owner: str) -> None:
    with store.write() as txn:
        store.put_meta(txn, OWNER, owner.encode())


def puts_in_window(
    store: ShardStore,
    txn: lmdb.Transaction,
    size: int,
    chkpt: int,
    records: list[tuple[bytes, bytes, Any]],
    owner: bytes | None = None,
) -> tuple[int, DDictError | None]:
    """:func:`put_in_window` for many ``(digest, key, frame)`` records in one transaction
    (the shard's state checked once): ``(how many were put, from the first; the error
    that stopped them)``.  A record refused (e.g. a full shard) wrote nothing.  With
    ``owner``, none is put unless that host process serves the shard (see :data:`OWNER`).
    """
    if owner is not None and txn.get(OWNER, db=store.meta_db) not in (owner, None):
        return 0, None  # (moved to another host process: its manager's to apply)
    try:
        newest = _direct_window(store, txn, size, chkpt)
    except DDictError as e:
        return 0, e
    if newest is None:
        return 0, None
    tally = key_counts.Tally(store, txn)
    done, error = key_counts.put_run(
        store, txn, key_counts.window(newest, size), records, chkpt, PERSISTENT, tally, exact=True
    )
    if key_counts.transaction_lost(error):
        return 0, None  # (the transaction is lost: all the manager's, which can make room)
    tally.settle()
    return done, error


def _direct_window(store: ShardStore, txn: lmdb.Transaction, size: int, chkpt: int) -> int | None:
    """The window's newest checkpoint if a client may put at ``chkpt`` itself, else ``None``."""
    newest, closed = saved_newest(store, txn, size)
    if closed != OPEN or chkpt > newest:
        return None
    check_window(chkpt, newest, size)
    if frozen(store, txn) or waiters(store, txn):
        return None
    return newest
