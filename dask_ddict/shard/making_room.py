"""Making room when a put needs it: zero-copy views copied out, and the versions that no
reader can see any more dropped.

Every write collects its own key's dead versions (``ShardStore.collect``); a
retired checkpoint leaves those of keys not written since, which only a scan
finds.  Rather than scan at every retirement, a manager scans when a put is
refused room (:meth:`MakingRoom._make_room`): the write is rolled back, the scan
commits in a transaction of its own (LMDB reuses freed pages only once that
commits), and the write is tried once more.

Zero-copy views (``get(..., copy=False)``) hold LMDB read snapshots, and LMDB
reuses no page that a snapshot can see: every page freed after it began.  So
before that scan, the manager asks the processes that hold views of its shard
to copy them out (:meth:`MakingRoom._release_pins`, :mod:`.pinboard`): each swaps its
views' pages for private copies at the same addresses and ends its snapshots
(:meth:`dask_ddict.transport.lending.Lender.release`).  A view then costs its own
bytes, in its process, and nothing of the shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import lmdb

from .. import config
from ..errors import DDictError, DDictFullError
from .pinboard import BoardReader, alive
from .working_set import MustWait

if TYPE_CHECKING:
    from .store import ShardStore
    from .working_set import WorkingSet

logger = logging.getLogger(__name__)

T = TypeVar("T")


class NoRoom(Exception):
    """A write was refused room that collecting dead versions may give (rolled back)."""


class MakingRoom:
    """Room for a refused put (a base of ``Manager``)."""

    manager_id: int
    store: ShardStore
    working_set: WorkingSet
    _collected: int  # the window's oldest checkpoint when dead versions were last dropped
    pins: BoardReader | None
    _late: str = ""  # (why views held the room, for the error of a write still refused)
    _pins_seen: int = -1  # (the boards' changes at the last refusal: see _may_make_room)

    if TYPE_CHECKING:  # provided by the manager

        def _attempt(
            self, fn: Callable[[lmdb.Transaction], T], what: str, at: tuple[int, int] | None = None
        ) -> T: ...

    def _roomy(self, fn: Callable[[lmdb.Transaction], T], txn: lmdb.Transaction) -> T:
        """``fn(txn)``, rolled back (:class:`NoRoom`) if it was refused room that
        collecting dead versions may give (see :meth:`_attempt`)."""
        try:
            result = fn(txn)
        except BaseException:  # (whatever fn made of the refusal: a many-put's _Refused)
            if self.store.refused and self._may_make_room():
                raise NoRoom from None
            raise
        if self.store.refused and self._may_make_room():
            raise NoRoom
        return result

    def _may_make_room(self) -> bool:
        """Whether making room may give a refused write room: dead versions to collect,
        views pinning the shard, or boards that changed since the last refusal.  (A holder
        asked earlier, a stopped process continued, may end its snapshots between the
        refusal and this look: its board then shows nothing, but the room it held is
        free only now, so the write is worth trying again.)"""
        if self._collectable():
            return True
        if self.pins is None:
            return False
        changes = self.pins.changes()
        moved, self._pins_seen = changes != self._pins_seen, changes
        return moved or self._pinned()

    def _collectable(self) -> bool:
        """Whether dead versions may exist that no collection has dropped yet: only
        retirement makes them (every write collects its own key's), and only without
        ``wait_for_keys`` (whose retirement drops them itself)."""
        ws = self.working_set
        return not ws.wait_for_keys and ws.oldest > self._collected

    def _pinned(self) -> bool:
        """Whether processes of this host hold zero-copy views of the shard."""
        return self.pins is not None and self.pins.of(self.manager_id)[0] > 0

    def _release_pins(self) -> bool:
        """Ask the processes that hold views of the shard to copy them out (see the module's
        docstring), waiting ``ddict.zero-copy.release-timeout`` at most; whether the room
        they held may be free now."""
        if self.pins is None or not self._pinned():
            return False
        timeout = config.get_seconds("zero-copy.release-timeout") or 0.0
        freed, late = self.pins.release(self.manager_id, timeout)
        # Holders that died meanwhile hold nothing once their reader slots are cleared.
        died = bool(late) and self.store.env.reader_check() > 0
        if died:
            late = [pid for pid in late if alive(pid)]
        if late:
            self._late = (
                f"  Processes {', '.join(map(str, late))} of this host hold zero-copy views of "
                f"this shard (get(..., copy=False), reads of a frozen dictionary) and did not "
                f"copy them out within {timeout:g} s (ddict.zero-copy.release-timeout): the "
                "pages that writes free stay held while they live"
            )
            logger.warning(
                "ddict manager %d: processes %s did not copy out their zero-copy "
                "views of its shard in time: the pages writes freed stay held",
                self.manager_id,
                late,
            )
        elif freed:
            logger.info(
                "ddict manager %d: zero-copy views of %d bytes copied out to make room",
                self.manager_id,
                freed,
            )
        # (All answered: one may have released its views just before it was asked.)
        return freed > 0 or died or not late

    def _note_unreleased(self, e: BaseException) -> None:
        """Name in ``e``, a write still refused room, the views that were not copied out
        for it (if some were not)."""
        late, self._late = self._late, ""
        if late and isinstance(e, DDictFullError):
            e.message += late
            e.args = (e.message,)

    def _make_room(self, chkpt: int, client: int) -> bool:
        """Have zero-copy views of the shard copied out, move the window as the refused
        write to ``chkpt`` would, then drop every version that no reader can see any
        more; whether any room was made."""
        # The snapshots of processes that died hold pages until their slots are cleared.
        self._late = ""
        released = self.store.env.reader_check() > 0
        released = self._release_pins() or released
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
            return released
        self._collected = ws.oldest
        if dropped:
            logger.info(
                "ddict manager %d: dropped %d versions no reader can see to make "
                "room (window [%d, %d])",
                self.manager_id,
                dropped,
                ws.oldest,
                ws.newest,
            )
        return bool(dropped) or released
