"""A same-host batch's flushes committed behind the client by the compiled kernels'
commit thread (``kernels.DirectCommit``, ``ddict.batch.commit-behind``).

The thread's commit must write exactly what the client's own commit
(``shard.direct.puts_in_window``) writes, or nothing at all: both are run on twin shards
and their bytes compared; every rule that sends a put to the manager is set in a real
shard and the commit must leave it untouched.  On a cluster, batches cross a
refusal in their middle (a waiter at the manager, a full shard) and must land in order.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import dask
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_ddict import DDict, DDictFullError, DDictManagerUnavailableError, kernels
from dask_ddict._hashing import key_digest
from dask_ddict._serialize import Framed, dumps_value
from dask_ddict.kernels import pure
from dask_ddict.shard.direct import puts_in_window, set_owner
from dask_ddict.shard.key_counts import COUNTS
from dask_ddict.shard.reader_marks import FROZEN, WAITERS, put_newest
from dask_ddict.shard.store import ShardStore
from dask_ddict.transport import mapped, shared
from tests.support.forked import answer_of

try:
    from dask_ddict.kernels import _compiled
except ImportError:  # (no compiler: the kernels' own test says so)
    _compiled = None

needs_compiled = pytest.mark.skipif(
    _compiled is None or not kernels.COMPILED, reason="the commit thread is the compiled set's"
)
OWNER = b"/tmp/owner-of-the-shard"


def _records(pairs: list[tuple[bytes, Any]]) -> list[tuple[bytes, bytes, Framed]]:
    return [(key_digest(k), k, dumps_value(v)) for k, v in pairs]


def _shard() -> tuple[str, ShardStore]:
    path = tempfile.mkdtemp(prefix="ddict-test-behind-", dir="/dev/shm")
    return path, ShardStore(path, 8 << 20)


@contextlib.contextmanager
def _twins() -> Iterator[tuple[ShardStore, ShardStore]]:
    """Two empty shards of one checkpoint, each with its owner mark and its key counts
    (as a host serves them: a commit that finds no counts leaves the recount to its
    caller)."""
    made = [_shard(), _shard()]
    try:
        for _, store in made:
            set_owner(store, OWNER.decode())
            with store.write() as txn:
                done, error = puts_in_window(store, txn, 1, 0, _records([(b"seed", 0)]), OWNER)
                assert (done, error) == (1, None)
        yield made[0][1], made[1][1]
    finally:
        for path, store in made:
            store.close()
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def twins() -> Iterator[tuple[ShardStore, ShardStore]]:
    with _twins() as made:
        yield made


def _behind(
    store: ShardStore, records: list[Any], chkpt: int = 0, owner: bytes = OWNER, now: bool = False
) -> int:
    """The commit thread's commit of ``records`` into ``store`` (``now``: the same commit
    made by this thread, as a same-host put makes it): what it came to."""
    assert _compiled is not None
    commit = _compiled.DirectCommit()
    if now:
        return int(commit.commit(*_args(store, records, chkpt, owner)))
    assert commit.start(*_args(store, records, chkpt, owner))
    return int(commit.wait())


def _args(store: ShardStore, records: list[Any], chkpt: int, owner: bytes) -> tuple[Any, ...]:
    """``DirectCommit.start``'s and ``commit``'s arguments, as the client's channel
    gives them (no generation words)."""
    room = (store.full_thresh * store.capacity, store._psize)
    return (store.env, store._data, store._meta, records, chkpt, owner, *room)


def _contents(store: ShardStore) -> tuple[list[tuple[bytes, bytes]], bytes | None]:
    """Every data record's bytes, and the key counts' record."""
    with store.read() as txn:
        data = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=store._data)]
        return data, store.get_meta(txn, COUNTS)


@needs_compiled
@settings(max_examples=40, deadline=None)
@given(
    batches=st.lists(
        st.tuples(
            st.booleans(),  # the window moves first (older versions then go with each put)
            st.lists(
                st.tuples(
                    st.integers(0, 30),
                    st.one_of(
                        st.binary(max_size=200),
                        # overflow pages, drawn as a length and a fill: random bytes this
                        # long exhaust hypothesis's entropy budget (its data_too_large check)
                        st.builds(
                            bytes.__mul__, st.binary(min_size=1, max_size=4), st.integers(500, 2250)
                        ),
                        st.integers(),
                        st.text(max_size=50),
                    ),
                ),
                min_size=1,
                max_size=40,
            ),
        ),
        min_size=1,
        max_size=4,
    )
)
@pytest.mark.parametrize("now", [False, True])
def test_the_thread_writes_what_the_clients_commit_writes(now, batches):
    """Twin shards, one written by the commit thread and one by ``puts_in_window`` (the
    client's own commit, through py-lmdb and the kernels the process runs): the same
    bytes in every record, the same key counts, after every flush; the window moved now
    and then (by a new key put through ``puts_in_window`` on both, whose count saves the
    new window's: a commit that finds the counts of another window is left, as the
    rules test below checks)."""
    with _twins() as (ours, theirs):
        _same_writes(ours, theirs, batches, now)


def _same_writes(ours: ShardStore, theirs: ShardStore, batches: list[Any], now: bool) -> None:
    newest = 0
    for moves, batch in batches:
        if moves:
            newest += 1
            for store in (ours, theirs):
                with store.write() as txn:
                    put_newest(store, txn, newest)
                    seed = _records([(b"seed%d" % newest, 0)])  # (new: counted anew)
                    assert puts_in_window(store, txn, 1, newest, seed, OWNER) == (1, None)
        records = _records([(b"key%d" % k, v) for k, v in batch])
        assert _behind(ours, records, newest, now=now) == kernels.COMMITTED
        with theirs.write() as txn:
            assert puts_in_window(theirs, txn, 1, newest, records, OWNER) == (len(records), None)
        assert _contents(ours) == _contents(theirs)


@needs_compiled
@pytest.mark.parametrize(
    "rule",
    ["frozen", "waiters", "owner", "closed", "newer", "retired", "no counts", "full"],
)
def test_a_rule_not_met_leaves_the_shard_untouched(twins, rule):
    """Each rule that makes a put the manager's (``puts_in_window``'s) makes the thread
    write nothing and say so: the caller then commits or sends the records itself."""
    store, _ = twins
    records = _records([(b"a", 1), (b"b", b"x" * 100)])
    owner, chkpt = OWNER, 0
    with store.write() as txn:
        if rule == "frozen":
            store.put_meta(txn, FROZEN, b"\x01")
        elif rule == "waiters":
            store.put_meta(txn, WAITERS, struct.pack("<q", 1))
        elif rule == "closed":
            put_newest(store, txn, 0, 1)
        elif rule == "newer":
            chkpt = 1  # (beyond the window: the manager moves it)
        elif rule == "retired":
            put_newest(store, txn, 3)
        elif rule == "no counts":
            txn.delete(COUNTS, db=store._meta)
        elif rule == "owner":
            owner = b"/tmp/another-host"
    if rule == "full":
        records = _records([(b"big%d" % i, b"x" * 60_000) for i in range(200)])  # 12 MB
    before = _contents(store)
    assert _behind(store, records, chkpt, owner) == kernels.LEFT
    assert _behind(store, records, chkpt, owner, now=True) == kernels.LEFT
    assert _contents(store) == before


def test_records_the_thread_cannot_read_are_not_queued(twins):
    """A frame with a part that is not ``bytes`` (a buffer of the caller's, which may
    change), or no records: nothing is queued; the pure set queues nothing at all."""
    store, _ = twins
    args = (store.env, store._data, store._meta)
    view = (key_digest(b"k"), b"k", Framed((memoryview(b"abc"),), 3))
    for s in [pure] if _compiled is None else [pure, _compiled]:
        assert not s.DirectCommit().start(*args, [view], 0, OWNER, 1e9, 4096)
        assert s.DirectCommit().commit(*args, [view], 0, OWNER, 1e9, 4096) == kernels.LEFT
        assert not s.DirectCommit().start(*args, [], 0, OWNER, 1e9, 4096)
        assert s.DirectCommit().wait() == kernels.LEFT
    assert not pure.DirectCommit().start(*args, _records([(b"k", 1)]), 0, OWNER, 1e9, 4096)


@contextlib.contextmanager
def _dropped_while_it_waits(store: ShardStore, key: bytes) -> Iterator[mapped._View]:
    """A batch's commit of ``key`` into ``store`` dropped (in a reference cycle, by the
    collector) while this thread holds the shard's writer lock, which the commit waits
    for; the view it keeps (counted as inside) is yielded while the lock is held.  Once
    the lock is free the commit lands, and a later same-host operation lets its view go:
    both checked on the way out."""
    view = mapped._View(store)
    view.active = 1  # (the flush's operation inside the view, as put_batch_behind counts it)
    records = _records([(key, 1)])
    txn = store.write()  # (this thread holds the writer lock)
    try:
        commit = _compiled.DirectCommit()
        assert commit.start(*_args(store, records, 0, OWNER))
        cycle: list[Any] = [shared.CommitBehind(None, view, commit, records, 0)]  # type: ignore[arg-type]
        cycle.append(cycle)
        del cycle, commit
        gc.collect()  # (a wait here would be for ever)
        assert view.active == 1 and len(shared._ORPHANS) == 1
        yield view
    finally:
        txn.abort()
    deadline = time.monotonic() + 30
    while shared._ORPHANS and time.monotonic() < deadline:
        shared._let_go_orphans()
        time.sleep(0.01)
    assert view.active == 0 and not shared._ORPHANS
    with store.read() as txn:
        assert store.lookup(txn, key_digest(key), 0) is not None


@needs_compiled
@pytest.mark.timeout(60)
def test_a_commit_dropped_inside_a_write_transaction_is_not_waited_for(twins):
    """The collector may drop a batch's commit while this thread holds the shard's
    writer lock (a put of its own), which the commit waits for: nothing waits then (it
    would wait for ever); the commit lands once the lock is free, and its view is let go
    at a later same-host operation."""
    with _dropped_while_it_waits(twins[0], b"late"):
        pass


@needs_compiled
@pytest.mark.timeout(120)
def test_a_child_forked_with_a_dropped_commit_closes_its_view(twins):
    """A commit dropped before it was done, then a fork: the child closes its copy of
    the commit's view at once (as it closes every view it inherits), waits for nothing,
    and leaves no dropped commit of its parent's; the parent's lands as ever."""
    with _dropped_while_it_waits(twins[0], b"forked") as view:

        def child() -> list[Any]:
            return [len(shared._ORPHANS), view.closed, kernels.commits_behind()]

        assert answer_of(child) == [0, True, (0, 0)]


# -- on a cluster ----------------------------------------------------------------------

SMALL_FLUSHES = {"ddict.batch.flush-bytes": "4 KiB", "ddict.local-transport": True}


def _over_socket(d: DDict) -> DDict:
    with dask.config.set({"ddict.local-read": False}):
        return DDict.attach(d.serialize())


@pytest.mark.parametrize("behind", [True, False])
def test_a_same_host_batch_lands_whole_and_in_order(client, behind):
    """Many flushes per shard, each key written in several of them: the last value of
    each key is what every reader sees, through the shard and through the managers; the
    flushes were committed behind the batch (compiled) or by the client (off, pure)."""
    before = kernels.commits_behind()
    config = {**SMALL_FLUSHES, "ddict.batch.commit-behind": behind}
    with dask.config.set(config), DDict(total_mem="64 MiB", client=client) as d:
        assert {d._core.channel(m).kind for m in range(2)} == {"shm"}
        for rnd in range(3):
            d.start_batch_put()
            for i in range(1500):
                d[f"k{i}"] = f"{rnd}-{i}".encode() * 4
            d.end_batch_put()
        sock = _over_socket(d)
        want = {f"k{i}": f"2-{i}".encode() * 4 for i in range(1500)}
        assert len(d) == len(sock) == 1500
        assert all(d[k] == v and sock[k] == v for k, v in want.items())
        sock.detach()
    committed = kernels.commits_behind()[0] - before[0]
    if behind and kernels.COMPILED:
        assert committed >= 10  # (4 KiB flushes of about 100 records: dozens)
    else:
        assert committed == 0


def test_a_waiter_mid_batch_sends_the_rest_to_the_manager_in_order(client):
    """A waiter appears at a manager while a batch's flushes are committed behind it:
    the commits then refused go to the manager (none written by the thread), after the
    ones committed, and the waiter is woken by the batch's own put."""
    before = kernels.commits_behind()
    with dask.config.set(SMALL_FLUSHES), DDict(total_mem="64 MiB", client=client) as d:
        woke = threading.Event()
        w = DDict.attach(d.serialize())
        waiter = threading.Thread(
            target=lambda: (w.wait_for("flag", 7, timeout=60), woke.set()), daemon=True
        )
        d.start_batch_put()
        for i in range(2000):
            d[f"k{i % 500}"] = i
            if i == 800:
                waiter.start()
                time.sleep(0.5)  # (its count of waiters is in the shard)
        d["flag"] = 7
        for i in range(2000, 2600):
            d[f"k{i % 500}"] = i
        d.end_batch_put()
        assert woke.wait(30)
        sock = _over_socket(d)
        last = {f"k{i % 500}": i for i in range(2600)}  # (each key's last put)
        assert {k: sock[k] for k in last} == last
        assert d["flag"] == 7
        sock.detach()
        w.detach()
    committed, left = (a - b for a, b in zip(kernels.commits_behind(), before, strict=True))
    if kernels.COMPILED:  # (before the waiter, and once refused by the waiter's manager)
        assert committed > 0 and left > 0


def test_a_full_shard_mid_batch_is_reported_and_keeps_what_it_stored(client):
    """A batch that fills its shards fails at its end with the manager's full error;
    every key it stored reads back whole, and the shard takes puts after a clear."""
    with dask.config.set(SMALL_FLUSHES), DDict(total_mem="8 MiB", client=client) as d:
        value = os.urandom(3000)
        d.start_batch_put()
        for i in range(4000):  # (12 MB into 8 MiB)
            d[i] = value
        with pytest.raises(DDictFullError, match="manager"):
            d.end_batch_put()
        stored = list(d.keys())
        assert 0 < len(stored) < 4000
        assert all(d[k] == value for k in stored[:: max(1, len(stored) // 50)])
        d.clear()
        d.start_batch_put()
        for i in range(100):
            d[i] = value
        d.end_batch_put()
        assert len(d) == 100


def test_an_error_at_the_end_still_waits_for_every_commit(client, monkeypatch):
    """A batch's end that fails on one manager (its host gone, injected here) still
    waits for the commits behind the batch on the others before it raises: none is left
    running with the batch closed, none keeps its shard's view."""
    with dask.config.set(SMALL_FLUSHES), DDict(total_mem="64 MiB", client=client) as d:
        d.start_batch_put()
        for i in range(1000):
            d[i] = b"v" * 100
        batch = d._batch
        assert batch is not None
        channels = [d._core.channel(m) for m in range(2)]

        def gone(quiet: bool = False) -> None:
            raise DDictManagerUnavailableError("manager 0 is gone (injected)")

        monkeypatch.setattr(channels[0], "_check_alive", gone)
        with pytest.raises(DDictManagerUnavailableError, match="injected"):
            d.end_batch_put()
        assert not batch._behind
        assert all(ch._view is None or ch._view.active == 0 for ch in channels)


def test_an_error_in_a_flush_fails_the_batch(client, monkeypatch):
    """A flush that fails on its way (the manager's host found gone, injected here)
    raises from the put that made it, and the batch's end raises it again: the records
    of that flush were never stored, so the batch is not whole."""
    with dask.config.set(SMALL_FLUSHES), DDict(total_mem="64 MiB", client=client) as d:
        d.start_batch_put()
        channel = d._core.channel(0)
        real, calls = channel._check_alive, [0]

        def flaky(quiet: bool = False) -> None:
            calls[0] += 1
            if calls[0] == 3:
                raise DDictManagerUnavailableError("manager 0 is gone (injected)")
            real(quiet)

        monkeypatch.setattr(channel, "_check_alive", flaky)
        raised = 0
        for i in range(2000):
            try:
                d[i] = b"v" * 100
            except DDictManagerUnavailableError:
                raised += 1
        assert raised == 1
        with pytest.raises(DDictManagerUnavailableError, match="injected"):
            d.end_batch_put()


def test_a_batch_dropped_without_its_end_lets_its_shard_go(client):
    """A batch whose handle is dropped with commits behind it: they run out, and the
    shard's view is not held for them (its count of operations inside goes back)."""
    with dask.config.set(SMALL_FLUSHES), DDict(total_mem="64 MiB", client=client) as d:
        h = DDict.attach(d.serialize())
        assert len(d) == 0  # (its answer kept by the hosts under the generation words)
        h.start_batch_put()
        for i in range(1000):
            h[i] = b"v" * 100
        views = [h._core.channel(m)._view for m in range(2)]
        del h
        gc.collect()
        deadline = time.monotonic() + 10
        while any(v is not None and v.active for v in views) and time.monotonic() < deadline:
            assert "x" not in d  # (a same-host operation: lets go of what is done)
            time.sleep(0.05)
        assert all(v is None or v.active == 0 for v in views)
        stored = sum(1 for _ in d.keys())
        assert stored > 0 and len(d) == stored  # (each commit changed its manager's word)
        d[0] = 1  # (the shards take writes: no lock held for the dropped batch)
        assert d[0] == 1
