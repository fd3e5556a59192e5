"""Checkpoint rules (dragon-ddict-notes §3) on a real shard, without a cluster."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dask_ddict._hashing import key_digest
from dask_ddict._keys import dumps_key
from dask_ddict._serialize import dumps_value, loads_value
from dask_ddict.errors import (
    DDictCheckpointSyncError,
    DDictError,
    DDictFutureCheckpointError,
    DDictKeyError,
)
from dask_ddict.shard import key_counts
from dask_ddict.shard.direct import put_in_window
from dask_ddict.shard.store import ShardStore
from dask_ddict.shard.working_set import MustWait, WorkingSet


@pytest.fixture
def make_ws(tmp_path):
    stores = []

    def make(size=1, **kw):
        st = ShardStore(
            str(tmp_path / f"s{len(stores)}"), 16 << 20, indexed=kw.get("wait_for_keys", False)
        )
        stores.append(st)
        return WorkingSet(st, size, **kw)

    yield make
    for store in stores:
        store.destroy()


class Ops:
    """Readable helpers over a WorkingSet."""

    def __init__(self, ws):
        self.ws = ws

    def put(self, k, v, c, client=1, persistent=False, batch=False):
        kb = dumps_key(k)
        with self.ws.store.write() as txn:
            self.ws.put(
                txn,
                key_digest(kb),
                c,
                kb,
                dumps_value(v).join(),
                client,
                persistent=persistent,
                batch=batch,
            )

    def get(self, k, c):
        with self.ws.store.read() as txn:
            return loads_value(bytes(self.ws.get(txn, key_digest(dumps_key(k)), c).frame))

    def has(self, k, c):
        with self.ws.store.read() as txn:
            return self.ws.contains(txn, key_digest(dumps_key(k)), c)

    def pop(self, k, c, client=1):
        with self.ws.store.write() as txn:
            return loads_value(self.ws.pop(txn, key_digest(dumps_key(k)), c, client))

    def len(self, c):
        with self.ws.store.read() as txn:
            return self.ws.length(txn, c)

    def clear(self, c):
        with self.ws.store.write() as txn:
            self.ws.clear(txn, c, 1)


def test_initial_window(make_ws):
    ws = make_ws(3)
    assert (ws.oldest, ws.newest) == (0, 2)


def test_versioned_reads_and_rollback(make_ws):
    o = Ops(make_ws(3))
    o.put("k", "v0", 0)
    o.put("k", "v1", 1)
    assert o.get("k", 0) == "v0"
    assert o.get("k", 1) == "v1"
    assert o.get("k", 2) == "v1"
    assert o.get("k", 10) == "v1"  # future reads see the newest value


def test_write_to_newer_checkpoint_retires_oldest(make_ws):
    ws = make_ws(2)
    o = Ops(ws)
    o.put("a", 1, 0)
    o.put("a", 2, 2)
    assert (ws.oldest, ws.newest) == (1, 2)
    with pytest.raises(DDictCheckpointSyncError):
        o.get("a", 0)
    with pytest.raises(DDictCheckpointSyncError):
        o.put("a", 3, 0)
    with pytest.raises(DDictCheckpointSyncError):
        o.has("a", 0)
    assert o.get("a", 1) == 1  # carried forward


def test_working_set_size_1_carries_all_keys(make_ws):
    o = Ops(make_ws(1))
    o.put("a", 1, 0)
    o.put("b", 2, 0)
    o.put("c", 3, 1)
    assert o.len(1) == 3
    assert o.get("a", 1) == 1


def test_reads_never_advance(make_ws):
    ws = make_ws(2)
    o = Ops(ws)
    o.put("a", 1, 0)
    with pytest.raises(DDictKeyError):
        o.get("zz", 7)
    assert ws.newest == 1


def test_delete_hides_older_versions_but_not_for_older_readers(make_ws):
    o = Ops(make_ws(3))
    o.put("k", "old", 0)
    assert o.pop("k", 1) == "old"
    assert not o.has("k", 1)
    assert not o.has("k", 2)
    assert o.get("k", 0) == "old"
    assert o.len(0) == 1 and o.len(1) == 0


def test_delete_at_same_checkpoint_does_not_resurrect_older_value(make_ws):
    # Dragon's bug: popping a key written at c lets the value from c-1 reappear.
    o = Ops(make_ws(3))
    o.put("k", "old", 0)
    o.put("k", "new", 1)
    assert o.pop("k", 1) == "new"
    assert not o.has("k", 1)
    assert o.get("k", 0) == "old"


def test_pop_missing_raises(make_ws):
    o = Ops(make_ws(1))
    with pytest.raises(DDictKeyError):
        o.pop("nope", 0)


def test_len_across_checkpoints(make_ws):
    o = Ops(make_ws(3))
    o.put("a", 1, 0)
    o.put("b", 1, 1)
    o.put("c", 1, 2)
    assert [o.len(c) for c in range(3)] == [1, 2, 3]


def test_clear_empties_only_the_current_checkpoint(make_ws):
    o = Ops(make_ws(3))
    o.put("a", 1, 0)
    o.put("b", 1, 1)
    o.clear(1)
    assert o.len(1) == 1  # "a" lives in checkpoint 0 (Dragon semantics)
    o.clear(0)
    assert o.len(0) == 0


def test_clear_with_size_1_empties_everything(make_ws):
    o = Ops(make_ws(1))
    for i in range(5):
        o.put(i, i, i)
    o.clear(4)
    assert o.len(4) == 0


def test_wait_for_keys_visibility_and_waiting(make_ws):
    o = Ops(make_ws(2, wait_for_keys=True))
    o.put("np", 1, 0)
    o.put("p", 1, 0, persistent=True)
    assert o.has("np", 0) and o.has("p", 0)
    assert not o.has("np", 1)  # non-persistent: only at its own checkpoint
    assert o.has("p", 1)
    assert o.len(1) == 1
    with pytest.raises(MustWait):
        o.get("np", 1)  # a reader of an unwritten non-persistent key waits
    with pytest.raises(MustWait):
        o.get("missing", 0)
    assert o.get("p", 1) == 1


def test_wait_for_keys_retirement_needs_rewrites(make_ws):
    ws = make_ws(2, wait_for_keys=True)
    o = Ops(ws)
    o.put("np", 1, 0)
    with pytest.raises(MustWait):
        o.put("x", 1, 2)  # checkpoint 0 cannot retire: "np" not re-written at 1
    assert ws.newest == 1
    with pytest.raises(DDictFutureCheckpointError):
        o.put("x", 1, 2, batch=True)  # batch puts are never deferred
    o.put("np", 2, 1)
    o.put("x", 1, 2)
    assert (ws.oldest, ws.newest) == (1, 2)


def test_wait_for_writers_retirement(make_ws):
    ws = make_ws(2, wait_for_writers=True)
    o = Ops(ws)
    o.put("a", 1, 0, client=1)
    o.put("b", 1, 0, client=2)
    o.put("a", 2, 1, client=1)
    with pytest.raises(MustWait):
        o.put("a", 3, 2, client=1)  # client 2 has not moved past checkpoint 0
    o.put("b", 2, 1, client=2)
    o.put("a", 3, 2, client=1)
    assert ws.oldest == 1


def test_state_round_trip(make_ws):
    ws = make_ws(3, wait_for_writers=True)
    o = Ops(ws)
    o.put("a", 1, 4, client=9)
    state = WorkingSet.saved_state(ws.store)
    assert state["newest"] == 4 and state["writers"] == {4: {9}}


# Truth tables under wait_for_keys, working_set_size=3 (window [0, 2]).
# Writes: "p" pput at 0, "n0" put at 0, "n1" put at 1, "d" pput at 0 and deleted at 1,
# "r" put at 0 and re-put at 2.  Columns: checkpoints 0, 1, 2, 3 (3 is ahead of the window).
IN_TABLE = {
    "p": (True, True, True, True),  # persistent: carried forward, also into the future
    "n0": (True, False, False, False),  # non-persistent: only at its own checkpoint
    "n1": (False, True, False, False),
    "d": (True, False, False, False),  # the tombstone at 1 hides it at 1 and later
    "r": (True, False, True, False),
    "never": (False, False, False, False),
}


def _truth_table_ws(make_ws):
    o = Ops(make_ws(3, wait_for_keys=True))
    o.put("p", 0, 0, persistent=True)
    o.put("n0", 0, 0)
    o.put("n1", 1, 1)
    o.put("d", 0, 0, persistent=True)
    o.pop("d", 1)
    o.put("r", 0, 0)
    o.put("r", 2, 2)
    return o


@pytest.mark.parametrize("key", sorted(IN_TABLE))
def test_contains_truth_table_under_wait_for_keys(make_ws, key):
    o = _truth_table_ws(make_ws)
    assert tuple(o.has(key, c) for c in range(4)) == IN_TABLE[key]


def test_len_truth_table_under_wait_for_keys(make_ws):
    o = _truth_table_ws(make_ws)
    expected = [sum(row[c] for row in IN_TABLE.values()) for c in range(4)]
    assert [o.len(c) for c in range(4)] == expected == [4, 2, 2, 1]


@pytest.mark.parametrize("key", sorted(IN_TABLE))
def test_get_waits_exactly_where_in_is_false(make_ws, key):
    """A read blocks (MustWait) where `in` says False, under wait_for_keys, except at
    the checkpoint where the key was deleted: there it is known to be absent."""
    o = _truth_table_ws(make_ws)
    for c in range(4):
        if IN_TABLE[key][c]:
            o.get(key, c)
        elif (key, c) == ("d", 1):
            with pytest.raises(DDictKeyError):
                o.get(key, c)
        else:
            with pytest.raises(MustWait):
                o.get(key, c)


def test_in_and_len_without_wait_for_keys(make_ws):
    """Without wait_for_keys every key is visible from its checkpoint on, until deleted."""
    o = Ops(make_ws(3))
    o.put("a", 0, 0)
    o.put("b", 1, 1)
    o.pop("a", 2)
    assert [o.has("a", c) for c in range(4)] == [True, True, False, False]
    assert [o.has("b", c) for c in range(4)] == [False, True, True, True]
    assert [o.len(c) for c in range(4)] == [1, 2, 1, 1]
    with pytest.raises(DDictKeyError):
        o.get("a", 3)  # fails fast instead of waiting


def test_every_operation_on_a_retired_checkpoint_raises(make_ws):
    o = Ops(make_ws(2))
    o.put("a", 0, 0)
    o.put("a", 1, 2)  # window [1, 2]: 0 retired
    for op in (
        lambda: o.get("a", 0),
        lambda: o.has("a", 0),
        lambda: o.len(0),
        lambda: o.put("a", 2, 0),
        lambda: o.pop("a", 0),
        lambda: o.clear(0),
    ):
        with pytest.raises(DDictCheckpointSyncError):
            op()


def test_reset_to_loads_a_checkpoint_as_the_window_start(make_ws):
    ws = make_ws(3, wait_for_keys=True)
    o = Ops(ws)
    o.put("old", 1, 5)
    kb = dumps_key("k")
    with ws.store.write() as txn:
        n = ws.reset_to(txn, 7, iter([(kb, dumps_value("v").join(), 2)]))
    assert n == 1 and (ws.oldest, ws.newest) == (7, 9)
    assert o.get("k", 7) == "v" and o.get("k", 9) == "v"  # persistent flag kept
    assert not o.has("old", 7)


def test_put_alone_only_where_a_put_is_nothing_more(make_ws):
    """``put_alone`` (the manager's common put) writes in a transaction of its own only in a
    window of one checkpoint, at it, without ``wait_for_*``; elsewhere it changes nothing
    and says so (the manager then puts the full way)."""
    kb = dumps_key("k")
    d = key_digest(kb)
    ws = make_ws(1)
    o = Ops(ws)
    assert ws.put_alone(d, 0, kb, dumps_value(1).join(), 1)
    assert ws.put_alone(d, 0, kb, dumps_value(2).join(), 1)  # (an overwrite: one key still)
    assert o.get("k", 0) == 2 and o.len(0) == 1
    assert not ws.put_alone(d, 1, kb, dumps_value(3).join(), 1)  # (the window would move)
    assert ws.newest == 0 and o.get("k", 0) == 2
    for kw in ({"size": 2}, {"wait_for_keys": True}, {"wait_for_writers": True}):
        other = make_ws(**kw)
        assert not other.put_alone(d, 0, kb, dumps_value(1).join(), 1), kw
        assert not Ops(other).has("k", 0) and other.writers == {}, kw


# -- len from the shard's counts: checked against a scan after every change ---------

_COUNT_OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "persistent", "pop", "clear", "direct", "batch", "alone"]),
        st.integers(0, 5),
        st.integers(0, 7),
    ),
    max_size=40,
)


def _batch(ws: WorkingSet, puts: list[tuple[int, int]]) -> None:
    """Puts ``(key, checkpoint)`` as a batch does: one transaction, the key counts in a
    :class:`key_counts.Tally` (settled before the window moves and at the end), stopping at
    the first refused put and keeping those before it."""
    with ws.store.write() as txn:
        tally = key_counts.Tally(ws.store, txn)
        for k, c in puts:
            kb = dumps_key(k)
            try:
                ws.put(
                    txn, key_digest(kb), c, kb, dumps_value(c).join(), 1, batch=True, tally=tally
                )
            except (MustWait, DDictError):
                break
        tally.settle()


def test_a_batchs_tallied_counts_are_saved_once_and_exact(make_ws):
    ws = make_ws(1)
    o = Ops(ws)
    o.put("a", 1, 0)  # (the shard has counts: a tally adds to them)
    _batch(ws, [("b", 0), ("c", 0), ("a", 0), ("d", 0)])  # three new keys, one overwrite
    assert o.len(0) == 4
    o.pop("b", 0)
    _batch(ws, [("b", 0), ("e", 0), ("e", 1), ("f", 1)])  # the window moves mid-run
    with ws.store.read() as txn:
        assert o.len(ws.newest) == sum(1 for _ in ws.visible(txn, ws.newest))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(1, 3), wait_for_keys=st.booleans(), ops=_COUNT_OPS)
def test_len_counts_match_a_scan_after_any_changes(tmp_path_factory, size, wait_for_keys, ops):
    """``len`` reads kept counts; every mix of puts, pops, clears, window moves and
    same-host direct puts leaves them equal to counting the visible keys."""
    st_ = ShardStore(str(tmp_path_factory.mktemp("counts") / "s"), 16 << 20, indexed=wait_for_keys)
    ws = WorkingSet(st_, size, wait_for_keys=wait_for_keys)
    o = Ops(ws)
    try:
        for what, k, c in ops:
            try:
                if what in ("put", "persistent"):
                    o.put(k, c, c, persistent=what == "persistent")
                elif what == "alone":  # (the manager's common put, else the full way)
                    kb = dumps_key(k)
                    if not ws.put_alone(key_digest(kb), c, kb, dumps_value(c).join(), 1):
                        o.put(k, c, c)
                elif what == "pop":
                    o.pop(k, c)
                elif what == "clear":
                    o.clear(c)
                elif what == "batch":  # a run of puts in one transaction, counts tallied
                    _batch(ws, [((k + j) % 6, ws.newest) for j in range(3)] + [(k, c)])
                elif not wait_for_keys:  # direct puts are for dicts without it
                    kb = dumps_key(k)
                    with st_.write() as txn:
                        put_in_window(st_, txn, size, key_digest(kb), c, kb, dumps_value(c).join())
            except (MustWait, DDictKeyError, DDictCheckpointSyncError):
                pass
            for at in range(ws.oldest, ws.newest + 3):
                with st_.read() as txn:
                    scanned = sum(1 for _ in ws.visible(txn, at))
                assert o.len(at) == scanned, (what, k, c, at)
    finally:
        st_.destroy()
