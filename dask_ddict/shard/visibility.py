"""What a reader at a checkpoint sees of a key's versions, and a view's pages.

Dragon's visibility rules, as pure functions of a version and a checkpoint:
the manager (:class:`~.working_set.WorkingSet`) and same-host readers that
read the shard themselves (:mod:`dask_ddict.transport.shared`) apply the same
ones, so a direct read and a read through the host cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lmdb

from ..errors import DDictCheckpointSyncError
from .store import Entry, ShardStore


def check_window(chkpt: int, newest: int, size: int) -> None:
    """Raise ``DDictCheckpointSyncError`` if ``chkpt`` precedes the window ending at ``newest``."""
    oldest = max(0, newest - size + 1)
    if chkpt < oldest:
        raise DDictCheckpointSyncError(
            f"checkpoint {chkpt} has retired (this manager keeps [{oldest}, {newest}])"
        )


def entry_visible(e: Entry | None, chkpt: int, wait_for_keys: bool) -> bool:
    """Whether version ``e`` (the newest at or below ``chkpt``) is seen at ``chkpt``.

    Under ``wait_for_keys`` a non-persistent version is seen only at its own checkpoint.
    Shared by the manager and by same-host readers of the shard.
    """
    if e is None or e.tombstone:
        return False
    return not (wait_for_keys and not e.persistent and e.chkpt != chkpt)


def unseen(e: Entry | None, chkpt: int, wait_for_keys: bool) -> bool | None:
    """What a reader at ``chkpt`` gets for a version ``e`` it does not see: ``None``
    (absent) or, under ``wait_for_keys``, ``False`` (it waits for the key's writer).

    A key deleted at the reader's own checkpoint is known to be absent there: it
    reads as absent at once, also under ``wait_for_keys`` (Dragon's deleted set).
    """
    if not wait_for_keys or (e is not None and e.chkpt == chkpt and e.tombstone):
        return None
    return False


def visible_entries(
    store: ShardStore, txn: lmdb.Transaction, chkpt: int, after: bytes | None, wait_for_keys: bool
) -> Iterator[tuple[bytes, Entry]]:
    """Entries seen at ``chkpt`` in digest order, after digest ``after`` (no window check).

    Shared by the manager (views, persistence) and by same-host readers that
    scan the shard themselves (a scan beside the shard sends no value anywhere).
    """
    decided: bytes | None = None
    for d, e in store.scan(txn, after):
        if d == decided or e.chkpt > chkpt:
            continue
        decided = d
        if entry_visible(e, chkpt, wait_for_keys):
            yield d, e


def take_page(
    entries: Iterator[tuple[bytes, Entry]],
    keys: bool,
    values: bool,
    max_items: int,
    max_bytes: int,
    copy: Callable[[Any], Any] = bytes,
) -> tuple[list[tuple[Any, Any]], bytes | None, bool]:
    """One page of a view from ``entries``: ``(items, last digest, more)``.

    At most ``max_items`` items and about ``max_bytes`` bytes (at least one item);
    values are copied out with ``copy`` while the snapshot lives.
    """
    items: list[tuple[Any, Any]] = []
    size = 0
    last = None
    for d, e in entries:
        if len(items) >= max_items or (items and size >= max_bytes):
            return items, last, True
        k = bytes(e.key) if keys else None
        v = copy(e.frame) if values else None
        size += (len(k) if k else 0) + (len(e.frame) if values else 0)
        items.append((k, v))
        last = d
    return items, last, False
