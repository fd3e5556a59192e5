"""The Manager alone: a real shard in a temp directory, no cluster, no sockets."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dask_ddict._serialize import dumps_value, loads_value
from dask_ddict.errors import DDictError, DDictFullError, DDictKeyError, DDictTimeoutError
from dask_ddict.persist import Persister, ZarrPersister
from dask_ddict.shard.manager import Manager
from dask_ddict.shard.store import ShardStore
from dask_ddict.shard.working_set import WorkingSet
from tests.support.manager_calls import CLIENT, get, k, put


@pytest.fixture(params=[2, 1], ids=["window2", "window1"])
def manager(tmp_path, request):
    """A manager with a window of two checkpoints, and one of one (the default, where a
    put is written in one transaction of its own: ``WorkingSet.put_alone``)."""
    store = ShardStore(str(tmp_path / "shard"), 16 << 20)
    persister = Persister(ZarrPersister(str(tmp_path / "store"), "m", 0, 1), 1, -1)
    m = Manager(0, store, WorkingSet(store, request.param), persister=persister)
    yield m
    m.close()


def test_put_get_pop_len_and_pages(manager):
    for i in range(5):
        put(manager, f"k{i}", i)
    assert get(manager, "k3") == 3 and manager.length(0) == 5
    assert manager.contains(k("k1")[0], 0)
    assert loads_value(manager.pop(k("k1")[0], 0, CLIENT)) == 1
    with pytest.raises(DDictKeyError):
        get(manager, "k1")
    items, _, more = manager.page(0, None, True, True, 100, 1 << 20)
    assert not more and sorted(loads_value(bytes(v)) for _, v in items) == [0, 2, 3, 4]


def test_fetch_add_applies_each_request_id_once(manager):
    d, kb = k("n")
    assert loads_value(manager.fetch_add(d, kb, 0, CLIENT, 5, rid=11)) == 0
    again = manager.fetch_add(d, kb, 0, CLIENT, 5, rid=11)  # a retried request
    assert loads_value(again) == 0 and get(manager, "n") == 5
    assert loads_value(manager.fetch_add(d, kb, 0, CLIENT, 1, rid=12)) == 5
    put(manager, "s", "text")
    with pytest.raises(DDictError, match="int value"):
        manager.fetch_add(*k("s"), 0, CLIENT, 1)


def test_wait_for_wakes_on_a_write_and_times_out(manager):
    d, _ = k("flag")
    with pytest.raises(DDictTimeoutError):
        manager.wait_for(d, 0, dumps_value(1).join(), 0.05)
    t = threading.Timer(0.1, lambda: put(manager, "flag", 1))
    t.start()
    start = time.monotonic()
    manager.wait_for(d, 0, dumps_value(1).join(), 10)
    assert time.monotonic() - start < 5
    t.join()


def test_frozen_refuses_writes_and_batches_count(manager):
    records = [(*k(f"b{i}"), dumps_value(i).join()) for i in range(4)]
    manager.batch_put(records, 0, CLIENT, batch=99)
    assert manager.batch_end(CLIENT, 99) == 4 and get(manager, "b3") == 3
    manager.freeze()
    with pytest.raises(DDictError, match="frozen"):
        put(manager, "x", 1)
    manager.batch_put(records[:1], 0, CLIENT, batch=100)
    with pytest.raises(DDictError, match="frozen"):
        manager.batch_end(CLIENT, 100)
    manager.unfreeze()
    put(manager, "x", 1)
    assert get(manager, "x") == 1


def test_persist_and_restore(manager):
    put(manager, "a", "old")
    manager.persist(0)
    manager.sync()
    put(manager, "a", "new")
    assert manager.persisted_ids() == [0]
    assert manager.restore(0) == 1 and get(manager, "a") == "old"


def test_a_closed_manager_refuses_everything(manager):
    put(manager, "a", 1)
    manager.close(destroy=False)
    with pytest.raises(DDictError):
        get(manager, "a")


def test_a_put_without_room_is_refused_as_ever_where_puts_go_alone(tmp_path):
    """In a window of one checkpoint a put is first tried in a transaction of its own
    (``WorkingSet.put_alone``); each commit still runs the shard's hook (what same-host
    readers' caches watch), and a put the shard has no room for is refused the full way:
    ``DDictFullError`` naming its size, nothing of it kept, the other keys intact."""
    store = ShardStore(str(tmp_path / "shard"), 4 << 20, full_thresh=0.5)
    m = Manager(0, store, WorkingSet(store, 1))
    commits = []
    store.on_commit = lambda: commits.append(1)
    try:
        put(m, "a", 1)
        put(m, "a", 2)
        assert len(commits) == 2 and m.length(0) == 1
        with pytest.raises(DDictFullError, match=r"a \d+-byte put does not fit"):
            put(m, "big", bytes(3 << 20))
        assert get(m, "a") == 2 and m.length(0) == 1  # (its room-making may have committed)
        with pytest.raises(DDictKeyError):
            get(m, "big")
        put(m, "b", 3)
        assert get(m, "b") == 3 and m.length(0) == 2
    finally:
        m.close()


# -- broadcasts: len and stats from kept counts and a per-shard generation -------------


def last_txn(store):
    """The shard's last committed transaction id (what a snapshot reads)."""
    with store.read() as txn:
        return txn.id()


def test_len_reads_kept_counts_and_never_scans(tmp_path, monkeypatch):
    store = ShardStore(str(tmp_path / "shard"), 16 << 20)
    m = Manager(0, store, WorkingSet(store, 2))
    try:
        for i in range(300):
            put(m, i, i, chkpt=i % 2)
        m.pop(k(7)[0], 1, CLIENT)

        def scan(*a, **kw):
            raise AssertionError("len scanned the shard")

        monkeypatch.setattr(store, "scan", scan)
        monkeypatch.setattr(store, "version_flags", scan)
        assert (m.length(0), m.length(1), m.length(5)) == (150, 299, 299)
    finally:
        m.close()


def test_a_same_host_clients_direct_put_is_seen_by_cached_len_and_stats(tmp_path):
    """A client commits small puts into the shard itself, without the manager: the
    shard's generation changes, so the manager's cached ``len``/``stats`` do too."""
    path = str(tmp_path / "shard")
    store = ShardStore(path, 16 << 20)
    m = Manager(0, store, WorkingSet(store, 1))
    client = textwrap.dedent(f"""
        from dask_ddict._hashing import key_digest
        from dask_ddict._keys import dumps_key
        from dask_ddict._serialize import dumps_value
        from dask_ddict.shard.store import ShardStore
        from dask_ddict.shard.direct import put_in_window
        s = ShardStore({path!r}, 16 << 20, create=False)  # as a same-host client opens it
        kb = dumps_key("b")
        with s.write() as txn:
            assert put_in_window(s, txn, 1, key_digest(kb), 0, kb, dumps_value(2).join())
    """)
    try:
        put(m, "a", 1)
        assert m.length(0) == 1 and m.stats()["num_keys"] == 1
        assert m.length(0) == 1  # (cached: the generation did not change)
        gen = last_txn(m.store)
        assert gen and m._cache["counts"][0][1] == gen  # (no generations file: txn ids)
        subprocess.run([sys.executable, "-c", client], check=True, timeout=60)
        assert last_txn(m.store) != gen
        assert m.length(0) == 2 and m.stats()["num_keys"] == 2
        m.freeze()
        assert m.stats()["frozen"] is True  # state of the manager's own is in the cache key
    finally:
        m.close()


def test_clear_of_an_empty_shard_writes_nothing(manager):
    gen = last_txn(manager.store)
    manager.clear(0, CLIENT)
    assert last_txn(manager.store) == gen  # no write transaction at all
    put(manager, "a", 1)
    manager.clear(0, CLIENT)
    assert manager.length(0) == 0 and last_txn(manager.store) != gen


def test_a_large_pop_reply_is_kept_for_a_resend_until_its_client_read_it(manager):
    """A resend of a pop (the same request id, after a broken connection) gets the value
    again; once the host saw the client read the reply, the kept copy is dropped, and
    small replies stay in the ring of the last request ids."""
    import numpy as np

    big = np.arange(1 << 17, dtype="u8")  # 1 MiB
    put(manager, "big", big)
    put(manager, "small", 1)
    used = manager.store.transact(manager.store.used_bytes)
    first = manager.pop(k("big")[0], 0, CLIENT, rid=21)
    again = manager.pop(k("big")[0], 0, CLIENT, rid=21)  # resent: not applied twice
    assert bytes(again) == bytes(first) and (loads_value(first) == big).all()
    kept = manager.store.transact(manager.store.used_bytes)
    assert kept > used - (1 << 20) + (1 << 19)  # the reply still holds the value's bytes
    manager.delivered(21)
    assert manager.store.transact(manager.store.used_bytes) < used - (1 << 19)
    assert loads_value(manager.pop(k("small")[0], 0, CLIENT, rid=22)) == 1
    manager.delivered(22)
    assert loads_value(manager.pop(k("small")[0], 0, CLIENT, rid=22)) == 1  # small: kept


def test_a_manager_paused_for_a_move_closes_without_waiting_for_itself(manager):
    """A dictionary destroyed while one of its managers is paused for a move (its lock
    held by the control thread that closes it too): closing ends the pause."""
    out = manager.move_out(copy=False)
    assert out["used_bytes"] > 0 and manager.moving
    closer = threading.Thread(target=manager.close, daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive() and manager.closed and not manager.moving


def test_a_batch_message_that_fills_the_map_is_refused_whole_and_said_at_the_end(tmp_path):
    """A snapshot that no board knows keeps every page freed after it: a batch's message
    meets LMDB's full map mid-way, which ends its transaction.  The message is rolled
    back (room is made, it is tried once more) and its end says the shard is full, with
    the count of what was stored before it (it used to raise LMDB's ``BadTxnError``)."""
    store = ShardStore(str(tmp_path / "shard"), 16 << 20)
    m = Manager(0, store, WorkingSet(store, 1))
    try:
        value = dumps_value(bytes(1 << 20)).join()
        records = [(*k(i), value) for i in range(4)]
        m.batch_put(records, 0, CLIENT, batch=1)
        held = store.env.begin()  # (a reader's snapshot)
        try:
            for _ in range(20):
                m.batch_put(records, 0, CLIENT, batch=1)
            with pytest.raises(DDictFullError, match="map of"):
                m.batch_end(CLIENT, 1)
        finally:
            held.abort()
        assert all(get(m, i) == bytes(1 << 20) for i in range(4))  # nothing acknowledged lost
    finally:
        m.close()
