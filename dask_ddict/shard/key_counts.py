"""How many keys each checkpoint of a shard's window sees, kept beside the data.

``len(d)`` is a broadcast to every manager; without a count each manager
would scan every version of every key to answer it (O(keys), where ``len``
must cost one round trip).  So each shard keeps, in its ``meta``
database and in the same transaction as every change, the number of keys
visible at each checkpoint of its window, plus one slot for every checkpoint
beyond ``newest`` (no version lives there yet, so they all see the same keys).

A change of one key is accounted for by comparing the key's visibility over
the window before and after it: O(versions of that key), at most a few.  A
put (:func:`put`, also a same-host client's direct put) derives the "after"
from the versions it read for the "before"; a pop (:func:`tracked`) reads
them again.  Moving
the window shifts the slots (:func:`shifted`): the slot beyond ``newest``
becomes the new ``newest``'s, and stays right for the checkpoints beyond it,
because nothing is written above ``newest``.  Operations that touch
everything anyway (``clear``, restore, a whole-shard copy) recount
(:func:`recount`).

Visibility is :func:`~dask_ddict.shard.visibility.entry_visible`'s rule,
written again here over ``(checkpoint, flags)`` pairs so that no entry needs
decoding: the newest version at or below ``c`` is seen unless it is a
tombstone or, under ``wait_for_keys``, a non-persistent version of another
checkpoint.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard, TypeVar

import lmdb

from .. import kernels
from .._serialize import frame_parts
from ..errors import DDictError
from ..kernels import Record
from ..kernels.pure import COUNTS  # (meta: newest, then keys seen at oldest .. newest and beyond)
from .store import PERSISTENT, TOMBSTONE, ShardStore

T = TypeVar("T")


@dataclass(frozen=True)
class Window:
    """A shard's checkpoint window ``[newest - size + 1, newest]`` and its reading rule."""

    newest: int
    size: int
    wait_for_keys: bool = False

    @property
    def oldest(self) -> int:
        return self.newest - self.size + 1

    @property
    def slots(self) -> int:
        return self.size + 1  # every checkpoint of the window, and one for those beyond

    def slot(self, chkpt: int) -> int:
        """The slot of ``chkpt`` (at or above ``oldest``)."""
        return min(chkpt - self.newest, 1) + self.size - 1

    def packer(self) -> struct.Struct:
        return _packer(self.slots)


@functools.cache
def _packer(slots: int) -> struct.Struct:
    return struct.Struct(f"<q{slots}q")


@functools.lru_cache(maxsize=256)
def window(newest: int, size: int, wait_for_keys: bool = False) -> Window:
    """The (shared, immutable) :class:`Window`: puts name one per call, cheaply."""
    return Window(newest, size, wait_for_keys)


def visibility(versions: list[tuple[int, int]], w: Window) -> int:
    """Bit ``i`` set iff the key is seen at slot ``i``; ``versions`` newest first."""
    if not versions:
        return 0
    if not w.wait_for_keys and versions[0][0] <= w.oldest:  # one version decides every slot
        return 0 if versions[0][1] & TOMBSTONE else (1 << w.slots) - 1
    bits = 0
    for i in range(w.slots):
        c = w.oldest + i
        for vc, flags in versions:
            if vc <= c:
                if not flags & TOMBSTONE and (vc == c or flags & PERSISTENT or not w.wait_for_keys):
                    bits |= 1 << i
                break
    return bits


def key_bits(store: ShardStore, txn: lmdb.Transaction, digest: bytes, w: Window) -> int:
    return visibility(store.versions(txn, digest, w.newest, w.oldest), w)


def _saved(store: ShardStore, txn: lmdb.Transaction, w: Window) -> list[int] | None:
    """The counts the shard holds for ``w``, or ``None`` (none kept, or for another window)."""
    raw = txn.get(COUNTS, db=store.meta_db)
    p = w.packer()
    if raw is None or len(raw) != p.size:
        return None
    newest, *counts = p.unpack(raw)
    return counts if newest == w.newest else None


def load(store: ShardStore, txn: lmdb.Transaction, w: Window) -> list[int]:
    """The counts of ``w`` as of ``txn`` (recounted if the shard has none: a new one,
    or one written before counts were kept)."""
    counts = _saved(store, txn, w)
    return recount(store, txn, w) if counts is None else counts


def save(store: ShardStore, txn: lmdb.Transaction, w: Window, counts: list[int]) -> None:
    store.put_meta(txn, COUNTS, w.packer().pack(w.newest, *counts))


def _account(store: ShardStore, txn: lmdb.Transaction, w: Window, before: int, after: int) -> None:
    """One key's visibility went from bits ``before`` to ``after`` (already stored)."""
    if before == after:
        return
    counts = _saved(store, txn, w)
    if counts is None:
        save(store, txn, w, recount(store, txn, w))  # (no counts yet: counted with the change)
        return
    for i in range(w.slots):
        counts[i] += ((after >> i) & 1) - ((before >> i) & 1)
    save(store, txn, w, counts)


class Tally:
    """The key-count changes of a run of puts in one transaction, saved once at its end
    (:meth:`settle`): a batch of a thousand puts reads and writes the counts once, not a
    thousand times.  Only a put that changes every slot alike (a window of one
    checkpoint, no ``wait_for_keys``: one key more or less) is tallied."""

    __slots__ = ("store", "txn", "w", "n")

    def __init__(self, store: ShardStore, txn: lmdb.Transaction) -> None:
        self.store, self.txn = store, txn
        self.w: Window | None = None
        self.n = 0

    def add(self, w: Window, n: int) -> None:
        if w is not self.w:
            self.settle()
            self.w = w
        self.n += n

    def settle(self) -> None:
        """Save what was tallied (before the window moves, and at the run's end)."""
        n, w, self.n = self.n, self.w, 0
        if not n or w is None:
            return
        counts = _saved(self.store, self.txn, w)
        if counts is None:  # (no counts yet: a recount sees the tallied puts already)
            save(self.store, self.txn, w, recount(self.store, self.txn, w))
            return
        save(self.store, self.txn, w, [c + n for c in counts])


def put_run(
    store: ShardStore,
    txn: lmdb.Transaction,
    w: Window,
    records: list[Record],
    chkpt: int,
    flags: int,
    tally: Tally,
    exact: bool = False,
) -> tuple[int, DDictError | None]:
    """:func:`put` for each ``(digest, key, frame)`` record in order: ``(how many were
    put, from the first; the error that stopped the next one)``.  A record refused
    (a full shard) wrote nothing.

    The room of the whole run is checked once (``ShardStore.below_high_water``); if it
    may not fit, each put is checked (``exact``: for writers in other processes, see
    ``ShardStore.check_room``), so that the one refused is the one that does not fit.
    In a window of one checkpoint the puts run in one compiled loop
    (``ShardStore.put_over_many``): a batch's records cost a microsecond or two each.
    """
    checked = store.below_high_water(kernels.entries_bytes(records), len(records))
    if checked and w.size == 1 and not w.wait_for_keys:
        done, delta, error = store.put_over_many(txn, records, chkpt, flags)
        if delta:
            tally.add(w, delta)
        return done, error
    for done, (digest, key, frame) in enumerate(records):
        try:
            if not checked:
                store.check_room(txn, frame_parts(frame)[1] + len(key), exact=exact)
            put(store, txn, w, digest, chkpt, key, frame, flags, tally)
        except DDictError as e:
            return done, e
    return len(records), None


def transaction_lost(error: BaseException | None) -> TypeGuard[BaseException]:
    """Whether ``error`` (from :func:`put_run`) was LMDB's full map, which ends the
    transaction it met: nothing of it may be committed (roll back, make room, again)."""
    return error is not None and isinstance(error.__cause__, lmdb.MapFullError)


def tracked(
    store: ShardStore, txn: lmdb.Transaction, digest: bytes, w: Window, change: Callable[[], T]
) -> T:
    """Run ``change`` (which touches only the versions of ``digest``) and count it."""
    before = key_bits(store, txn, digest, w)
    out = change()
    _account(store, txn, w, before, key_bits(store, txn, digest, w))
    return out


def put(
    store: ShardStore,
    txn: lmdb.Transaction,
    w: Window,
    digest: bytes,
    chkpt: int,
    key: bytes,
    frame: Any,
    flags: int,
    tally: Tally | None = None,
) -> None:
    """Store a version at ``chkpt`` (in the window) and drop the dead ones, counted
    (in ``tally`` when given: saved by its :meth:`Tally.settle`).

    The key's visibility after the put follows from its versions before it:
    one walk of them, not two (a put is the hot path).
    """
    if w.size == 1 and not w.wait_for_keys:  # the default: one seek, as a plain put
        _, delta, error = store.put_over_many(txn, [(digest, key, frame)], chkpt, flags)
        if error is not None:
            raise error
        if delta:  # (seen before xor after: one key more or less)
            if tally is not None:
                tally.add(w, delta)
                return
            every = (1 << w.slots) - 1
            _account(store, txn, w, every if delta < 0 else 0, 0 if delta < 0 else every)
        return
    versions = store.versions(txn, digest, w.newest, w.oldest)
    store.put(txn, digest, chkpt, key, frame, flags)
    store.collect(txn, digest, w.oldest)
    if versions and versions[0][0] > chkpt:
        merged = (
            [v for v in versions if v[0] > chkpt]
            + [(chkpt, flags)]
            + [v for v in versions if v[0] < chkpt]
        )
    else:
        merged = [(chkpt, flags), *(v for v in versions if v[0] < chkpt)]
    _account(store, txn, w, visibility(versions, w), visibility(merged, w))


def shifted(store: ShardStore, txn: lmdb.Transaction, w: Window, newest: int) -> None:
    """Move the counts from window ``w`` to the one ending at ``newest`` (> ``w.newest``)."""
    counts = load(store, txn, w)
    steps = min(newest - w.newest, w.slots)
    save(store, txn, window(newest, w.size, w.wait_for_keys), counts[steps:] + [counts[-1]] * steps)


def recount(store: ShardStore, txn: lmdb.Transaction, w: Window) -> list[int]:
    """Count every key again (O(versions)): for changes that touch every key anyway."""
    counts = [0] * w.slots
    current: bytes | None = None
    versions: list[tuple[int, int]] = []

    def add() -> None:
        bits = visibility(versions, w)
        for i in range(w.slots):
            counts[i] += (bits >> i) & 1

    for digest, chkpt, flags in store.version_flags(txn):
        if digest != current:
            if versions:
                add()
            current, versions = digest, []
        versions.append((chkpt, flags))
    if versions:
        add()
    return counts


def store_recount(store: ShardStore, txn: lmdb.Transaction, w: Window) -> None:
    """Recount and save (after ``clear``, a restore, a copy)."""
    save(store, txn, w, recount(store, txn, w))


def ensure(store: ShardStore, txn: lmdb.Transaction, w: Window) -> None:
    """Save counts for ``w`` unless the shard has them (a re-attached shard)."""
    if _saved(store, txn, w) is None:
        store_recount(store, txn, w)
