"""Making room: dropping the versions that no reader can see any more, when a put needs it.

Every write collects its own key's dead versions (``ShardStore.collect``); a
retired checkpoint leaves those of keys not written since, which only a scan
finds.  Rather than scan at every retirement, a manager scans when a put is
refused room (:meth:`Room._make_room`): the write is rolled back, the scan
commits in a transaction of its own (LMDB reuses freed pages only once that
commits), and the write is tried once more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import lmdb

from ..errors import DDictError
from .working_set import MustWait

if TYPE_CHECKING:
    from .store import ShardStore
    from .working_set import WorkingSet

logger = logging.getLogger(__name__)

T = TypeVar("T")


class NoRoom(Exception):
    """A write was refused room that collecting dead versions may give (rolled back)."""


class Room:
    """Room for a refused put (a base of ``Manager``)."""

    manager_id: int
    store: ShardStore
    working_set: WorkingSet
    _collected: int  # the window's oldest checkpoint when dead versions were last dropped

    if TYPE_CHECKING:  # provided by the manager

        def _attempt(self, fn: Callable[[lmdb.Transaction], T], what: str,
                     at: tuple[int, int] | None = None) -> T: ...  # fmt: skip

    def _roomy(self, fn: Callable[[lmdb.Transaction], T], txn: lmdb.Transaction) -> T:
        """``fn(txn)``, rolled back (:class:`NoRoom`) if it was refused room that
        collecting dead versions may give (see :meth:`_attempt`)."""
        try:
            result = fn(txn)
        except BaseException:  # (whatever fn made of the refusal: a many-put's _Refused)
            if self.store.refused and self._collectable():
                raise NoRoom from None
            raise
        if self.store.refused and self._collectable():
            raise NoRoom
        return result

    def _collectable(self) -> bool:
        """Whether dead versions may exist that no collection has dropped yet: only
        retirement makes them (every write collects its own key's), and only without
        ``wait_for_keys`` (whose retirement drops them itself)."""
        ws = self.working_set
        return not ws.wait_for_keys and ws.oldest > self._collected

    def _make_room(self, chkpt: int, client: int) -> bool:
        """Move the window as the refused write to ``chkpt`` would, then drop every
        version that no reader can see any more; whether anything was dropped."""
        ws = self.working_set

        def fn(txn: lmdb.Transaction) -> int:
            if chkpt > ws.newest:
                try:
                    ws.advance_to(txn, chkpt, client)
                except MustWait:  # (a retirement waits: collect what is dead already)
                    pass
            return self.store.collect_all(txn, ws.oldest) if self._collectable() else 0

        try:
            dropped = self._attempt(fn, "making room")
        except DDictError:
            return False
        self._collected = ws.oldest
        if dropped:
            logger.info("ddict manager %d: dropped %d versions no reader can see to make "
                        "room (window [%d, %d])", self.manager_id, dropped, ws.oldest,
                        ws.newest)  # fmt: skip
        return bool(dropped)

