"""Capacity: how much of its room a shard's data takes, and the refusal of a put
that would take it over its threshold (a base of
:class:`~dask_ddict.shard.store.ShardStore`).

A put asks :meth:`Capacity.check_room` first; exact counts cost three ``stat``
calls, so between them a running over-estimate decides.  A put that LMDB itself
refuses (its map full) is said by :meth:`Capacity._map_full`: both errors say
what to do (:data:`FULL_REMEDY`).
"""

from __future__ import annotations

from typing import Any

import lmdb

from .._entry import ENTRY_HEADER
from ..errors import DDictFullError

#: What to do about a full shard, said with every :class:`DDictFullError` of a put.
FULL_REMEDY = (
    "Free space (pop, clear, or let old checkpoints retire), or create the dictionary "
    "with a larger total_mem (each of its managers' shards is total_mem / managers; more "
    "managers add room only with total_mem to match) or a higher manager_pool_full_thresh"
)


class Capacity:
    """The room of a shard (a base of ``ShardStore``, which sets these)."""

    env: lmdb.Environment
    capacity: int
    full_thresh: float
    indexed: bool
    refused: bool
    _data: Any
    _index: Any
    _meta: Any
    _psize: int
    _used_estimate: int
    _next_own: int

    def usage(self, txn: lmdb.Transaction) -> tuple[int, int]:
        """``(bytes in pages that hold live data, entries)``: free-list pages excluded,
        entries are stored versions (tombstones included)."""
        pages = entries = 0
        for db in (
            (self._data, self._index, self._meta) if self.indexed else (self._data, self._meta)
        ):
            st = txn.stat(db)
            pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
            if db is self._data:
                entries = st["entries"]
        return pages * self._psize, entries

    def used_bytes(self, txn: lmdb.Transaction) -> int:
        """Bytes in pages that hold live data (free-list pages excluded)."""
        return self.usage(txn)[0]

    def below_high_water(self, nbytes: int, puts: int = 1) -> bool:
        """Whether ``puts`` puts of ``nbytes`` in all surely fit: the shard's high-water
        mark (which bounds what is used) plus twice their bytes stays under the limit.
        One ``env.info()`` for a whole batch, where :meth:`check_room` ``exact`` takes one
        per put."""
        need = 2 * (nbytes + puts * (ENTRY_HEADER + 64))
        return (
            self.env.info()["last_pgno"] + 4
        ) * self._psize + need <= self.full_thresh * self.capacity

    def check_room(self, txn: lmdb.Transaction, nbytes: int, *, exact: bool = False) -> None:
        """Refuse a put of ``nbytes`` that would take the shard over its threshold.

        Exact page counts cost three ``stat`` calls, so they are taken only
        when a running over-estimate (bytes put since the last exact count,
        doubled for B-tree overhead) comes near the limit, or when another
        process committed since this one's last commit (:meth:`transact` notes
        the id of its own: a same-host client's direct puts, which the estimate
        misses).  ``exact`` always counts: for writers in other processes.
        """
        if exact and self.below_high_water(nbytes):
            return
        put, nbytes = nbytes, nbytes + ENTRY_HEADER + 64
        limit = self.full_thresh * self.capacity
        if not exact and txn.id() != self._next_own:
            exact = True  # another process committed since this one's last commit: count
        if not exact and self._used_estimate + 2 * nbytes <= limit:
            self._used_estimate += 2 * nbytes
            return
        used = self.used_bytes(txn)
        self._used_estimate = used + 2 * nbytes
        need = used + nbytes
        if need > limit:
            self.refused = True
            raise DDictFullError(
                f"shard is full: a {put}-byte put does not fit: the shard holds {used} of the "
                f"{int(limit)} bytes puts may fill ({self.full_thresh:.0%} of its "
                f"{self.capacity}: manager_pool_full_thresh={self.full_thresh:g}).  {FULL_REMEDY}"
            )

    def _map_full(self, nbytes: int) -> DDictFullError:
        """The error of a put of ``nbytes`` that LMDB refused: its map is full."""
        self.refused = True
        reach = (self.env.info()["last_pgno"] + 1) * self._psize  # (its high-water mark)
        return DDictFullError(
            f"shard is full: a {nbytes}-byte put does not fit: the shard's map of "
            f"{self.capacity} bytes is full (its pages reach {reach} bytes).  {FULL_REMEDY}"
        )
