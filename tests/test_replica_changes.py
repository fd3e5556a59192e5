"""A replica holds what its primary holds: the recorded changes of every write transaction,
applied in order, leave a copy of the shard identical record for record (no cluster: a
real manager and a real replica store in a temp directory)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dask_ddict._hashing import key_digest
from dask_ddict._keys import dumps_key
from dask_ddict._serialize import dumps_value, loads_value
from dask_ddict.errors import DDictError
from dask_ddict.host import hygiene, replica_store
from dask_ddict.host.replica_store import Replica
from dask_ddict.layout import ManagerInfo
from dask_ddict.shard import changes
from dask_ddict.shard.manager import Manager
from dask_ddict.shard.store import ShardStore
from dask_ddict.shard.working_set import WorkingSet

CLIENT = 3


def join_parts(parts: list) -> bytes:
    return b"".join(bytes(p) for p in parts)


def _k(key):
    kb = dumps_key(key)
    return key_digest(kb), kb


def records(store: ShardStore) -> list[list[tuple[bytes, bytes]]]:
    """Every record of every database of ``store``."""
    with store.env.begin(buffers=False) as txn:
        return [list(txn.cursor(db)) for db in changes.databases(store)]


class Pair:
    """A manager whose every commit is shipped to a replica store (as a host does)."""

    def __init__(self, path: str, *, size: int = 3, wait_for_keys: bool = True) -> None:
        os.makedirs(path + "/p")
        self.store = ShardStore(path + "/p", 64 << 20, indexed=wait_for_keys)
        self.manager = Manager(
            0, self.store, WorkingSet(self.store, size, wait_for_keys=wait_for_keys)
        )
        os.makedirs(path + "/r")
        self.store.env.copy(path + "/r")  # (the seed: a consistent copy)
        rstore = ShardStore(path + "/r", 64 << 20, indexed=wait_for_keys, create=False)
        self.replica = Replica(0, rstore, hygiene.claim(path + "/r"))
        self.shipped = 0
        self.store.replicate = self._ship

    def _ship(self, recorded: list[changes.Change], later: bool = False) -> None:
        parts, n = changes.encode(recorded)
        payload = join_parts(parts)
        assert len(payload) == n
        self.shipped += 1
        self.replica.apply(self.shipped, payload)

    def same(self) -> bool:
        return records(self.store) == records(self.replica.store)

    def close(self) -> None:
        self.manager.close()
        self.replica.close()


@pytest.fixture
def pair(tmp_path):
    p = Pair(str(tmp_path), wait_for_keys=False)
    yield p
    p.close()


def test_every_kind_of_write_reaches_the_replica(pair):
    m = pair.manager
    for i in range(20):
        d, kb = _k(i)
        m.put(d, kb, dumps_value(i).join(), 0, CLIENT)
    big = bytes(range(256)) * 8192  # 2 MiB: assembled in the store's scratch buffer
    m.put(*_k("big"), dumps_value(big).join(), 0, CLIENT)
    m.pop(_k(3)[0], 0, CLIENT)
    m.fetch_add(*_k("n"), 0, CLIENT, 5, rid=99)
    m.put(*_k(4), dumps_value("at 1").join(), 1, CLIENT)  # a new checkpoint
    m.put(*_k(5), dumps_value("at 4").join(), 4, CLIENT)  # the window moves: retirement
    m.freeze()
    m.unfreeze()
    m.clear(4, CLIENT)
    assert pair.shipped > 20
    assert pair.same()


def test_a_batchs_records_reach_the_replica(tmp_path):
    """A batch's records are written in one compiled loop of cursor ``replace`` calls
    (a window of one checkpoint): new keys, overwrites, keys with older versions to
    delete and a large value all reach the replica (they once did not)."""
    pair = Pair(str(tmp_path), size=1, wait_for_keys=False)
    m = pair.manager
    try:

        def batch(keys: range, chkpt: int, batch_id: int) -> None:
            m.batch_put(
                [(*_k(i), dumps_value(i * chkpt).join()) for i in keys],
                chkpt,
                CLIENT,
                batch=batch_id,
            )
            assert m.batch_end(CLIENT, batch_id) == len(keys)

        batch(range(50), 0, 1)  # new keys
        batch(range(25, 75), 0, 2)  # overwrites and new keys
        batch(range(0, 100, 3), 2, 3)  # the window moves: older versions go
        m.batch_put([(*_k("big"), dumps_value(bytes(3 << 20)).join())], 2, CLIENT, batch=4)
        assert m.length(2) == 75 + 9 + 1  # (0..74, the 9 new multiples of 3 up to 99, big)
        assert pair.same()
    finally:
        pair.close()


def test_a_resend_is_taken_once_and_a_gap_is_refused(pair, monkeypatch):
    monkeypatch.setattr(replica_store, "OUT_OF_STEP_AFTER", 0.2)
    m = pair.manager
    m.put(*_k("a"), dumps_value(1).join(), 0, CLIENT)
    before = records(pair.replica.store)
    parts, _ = changes.encode([(changes.PUT, 0, b"x" * 24, b"junk")])
    pair.replica.apply(pair.shipped, join_parts(parts))  # (the same number again: ignored)
    assert records(pair.replica.store) == before
    pair.replica.apply(0, b"")  # a new primary numbers from 1 again
    assert pair.replica.seq == 0
    pair.shipped = 0
    m.put(*_k("b"), dumps_value(2).join(), 0, CLIENT)
    assert pair.replica.seq == 1 and pair.same()
    with pytest.raises(DDictError, match="out of step"):  # (a gap: it missed one)
        pair.replica.apply(pair.shipped + 2, join_parts(parts))
    assert "out of step" in pair.replica.stale  # never promoted, takes nothing more
    with pytest.raises(DDictError, match="stale"):
        pair.replica.apply(0, b"")
    pair.store.replicate = None


def test_a_failed_write_ships_nothing(pair):
    m = pair.manager
    m.put(*_k("s"), dumps_value("text").join(), 0, CLIENT)
    shipped = pair.shipped
    with pytest.raises(DDictError, match="int value"):
        m.fetch_add(*_k("s"), 0, CLIENT, 1)  # (refused: its transaction rolls back)
    assert pair.shipped == shipped and pair.same()


_KEYS = st.integers(0, 12)
_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), _KEYS, st.integers(0, 3), st.binary(max_size=3000)),
        st.tuples(st.just("pop"), _KEYS, st.integers(0, 3), st.none()),
        st.tuples(st.just("add"), _KEYS, st.integers(0, 3), st.none()),
        st.tuples(st.just("clear"), st.just(0), st.integers(0, 3), st.none()),
        st.tuples(st.just("persistent"), _KEYS, st.integers(0, 3), st.binary(max_size=40)),
    ),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=_STEPS, wfk=st.booleans())
def test_any_sequence_of_writes_leaves_an_identical_replica(tmp_path_factory, steps, wfk):
    pair = Pair(str(tmp_path_factory.mktemp("pair")), wait_for_keys=wfk)
    m = pair.manager
    base = 0
    try:
        for what, key, dc, value in steps:
            chkpt = base + dc
            d, kb = _k(key)
            try:
                if what == "put":
                    m.put(d, kb, dumps_value(value).join(), chkpt, CLIENT, timeout=0)
                elif what == "persistent":
                    m.put(
                        d, kb, dumps_value(value).join(), chkpt, CLIENT, timeout=0, persistent=True
                    )
                elif what == "pop":
                    m.pop(d, chkpt, CLIENT, timeout=0)
                elif what == "add":
                    m.fetch_add(d, kb, chkpt, CLIENT, 1, timeout=0)
                else:
                    m.clear(chkpt, CLIENT, timeout=0)
            except DDictError:
                pass  # (a refused write: nothing to ship)
            base = max(base, m.working_set.oldest)
            assert pair.same()
        for key in range(13):  # reads agree too
            d, _ = _k(key)
            try:
                a = loads_value(bytes(m.pop(d, m.working_set.newest, CLIENT, timeout=0)))
            except DDictError:
                a = None
            assert a is None or isinstance(a, (bytes, int))
        assert pair.same()
    finally:
        pair.close()


def test_change_sets_sent_without_waiting_are_applied_in_their_order(pair):
    """A primary sends a batch's change sets without waiting, over several connections:
    a replica applies each once its predecessor is applied, whatever the arrival order."""
    import threading

    sets = []
    for i in range(5):
        parts, _ = changes.encode([(changes.PUT, 2, b"order", str(i).encode())])
        sets.append(join_parts(parts))
    start = pair.replica.seq
    threads = [
        threading.Thread(target=pair.replica.apply, args=(start + i + 1, sets[i]))
        for i in reversed(range(5))
    ]  # (the last first)
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert pair.replica.seq == start + 5
    with pair.replica.store.env.begin() as txn:
        assert txn.get(b"order", db=changes.databases(pair.replica.store)[2]) == b"4"


def test_a_write_that_its_replica_took_over_is_refused_as_moved():
    """A replica's host that serves the manager itself now answers a change set MOVED:
    the primary that sent it was deposed (its host was taken for lost)."""
    from types import SimpleNamespace

    from dask_ddict.errors import DDictManagerMovedError, DDictManagerUnavailableError

    hosted = SimpleNamespace(name="d", replicas={}, managers={0: object()})
    request = SimpleNamespace(manager=0, arg=1, value=b"")
    with pytest.raises(DDictManagerMovedError, match="failed over"):
        replica_store.serve(hosted, request, lambda *a: None)
    hosted.managers = {}
    with pytest.raises(DDictManagerUnavailableError, match="keeps no replica"):
        replica_store.serve(hosted, request, lambda *a: None)


def test_a_replica_that_missed_a_change_set_is_stale_and_never_promoted(tmp_path):
    """A replica whose change set failed (or whose primary dropped it) may lack
    acknowledged writes: it takes nothing more, and a promotion of it is refused."""
    from types import SimpleNamespace

    from dask_ddict.errors import DDictManagerUnavailableError
    from dask_ddict.host.replicas import take_replica

    p = Pair(str(tmp_path), wait_for_keys=False)
    try:
        with pytest.raises(DDictError, match="unknown replicated change"):
            p.replica.apply(p.shipped + 1, bytes(changes._HEAD.pack(9, 0, 0, 0)))
        assert p.replica.stale
        with pytest.raises(DDictError, match="stale"):
            p.manager.put(*_k("after"), dumps_value(1).join(), 0, CLIENT)  # (shipped to it)
        uid = "ab" * 16
        host = SimpleNamespace(
            dicts={bytes.fromhex(uid): SimpleNamespace(name="d", replicas={0: p.replica})}
        )
        with pytest.raises(DDictManagerUnavailableError, match="stale"):
            take_replica(host, uid, 0, "")
        assert host.dicts[bytes.fromhex(uid)].replicas == {}
        assert not os.path.exists(p.replica.store.path)  # (its shard is gone)
    finally:
        p.store.replicate = None
        p.manager.close()
        p.replica.lock = None  # (released by take_replica's close)


def test_a_promoted_replica_stays_claimed_until_its_manager_claims_it(tmp_path):
    """A promotion closes the replica and hands its shard to the manager that opens it:
    its owner lock passes with it (released by the caller once the manager holds its own),
    so no sweep finds the shard unowned in between; a replica whose files are gone is
    refused by name."""
    from types import SimpleNamespace

    from dask_ddict.errors import DDictManagerUnavailableError
    from dask_ddict.host.replicas import take_replica

    p = Pair(str(tmp_path), wait_for_keys=False)
    uid = "ab" * 16
    try:
        p.manager.put(*_k("kept"), dumps_value(1).join(), 0, CLIENT)
        host = SimpleNamespace(
            dicts={bytes.fromhex(uid): SimpleNamespace(name="d", replicas={0: p.replica})}
        )
        path, lock = take_replica(host, uid, 0, "")
        assert path == p.replica.store.path and lock is not None
        assert not hygiene.is_abandoned(path)  # (held across the hand-over)
        owner = hygiene.claim(path)  # (what the manager that opens it takes)
        hygiene.release(lock)
        assert not hygiene.is_abandoned(path)
        hygiene.release(owner)
        assert hygiene.is_abandoned(path)

        gone = Replica(0, ShardStore(path, 64 << 20, create=False), hygiene.claim(path))
        os.unlink(os.path.join(path, "data.mdb"))  # (its shared memory emptied)
        host.dicts[bytes.fromhex(uid)].replicas[0] = gone
        with pytest.raises(DDictManagerUnavailableError, match="lost its shard"):
            take_replica(host, uid, 0, "")
        assert hygiene.is_abandoned(path)  # (its lock let go with the refusal)
    finally:
        p.store.replicate = None
        p.manager.close()
        p.replica.lock = None  # (released above)


def test_a_replica_told_it_was_dropped_is_stale(pair):
    pair.replica.apply(-1, b"")
    assert pair.replica.stale == "its primary dropped it"
    pair.store.replicate = None  # (the primary ships to it no more)


def test_a_replicated_write_hands_the_event_loop_on_before_it_waits_for_shipping(tmp_path):
    """A replicated shard's write waits for its shipping lock (held while a replica is
    added, across a round trip): on a host's event-loop thread it hands the loop on first
    (``_blocking.will_block``), so the loop's other clients are not held up."""
    import threading

    from dask_ddict import _blocking

    store = ShardStore(str(tmp_path / "shard"), 8 << 20)
    shipped: list[int] = []
    store.replicate = lambda recorded, later: shipped.append(len(recorded))
    handed = threading.Event()
    store.shipping.acquire()  # (as host/replicas.py holds it while adding a replica)

    def release_later() -> None:
        handed.wait(5)  # (without the hand-on: released after 5 s anyway)
        store.shipping.release()

    threading.Thread(target=release_later, daemon=True).start()
    d, kb = _k("a")
    _blocking.serving(handed.set)  # (this thread runs an event loop)
    try:
        store.transact(lambda txn: store.put(txn, d, 0, kb, dumps_value(1).join(), 0))
    finally:
        _blocking.serving(None)
    assert handed.is_set() and shipped == [1]
    store.close()


def test_a_batch_waiting_for_its_replicas_answers_hands_the_event_loop_on(tmp_path):
    """A batch's change sets go to a replica without waiting for its answers, up to
    ``MOST_PENDING``; beyond, the oldest answer is waited for, and on a host's
    event-loop thread the loop is handed on first (a unit test: a fake replica link
    whose answers come only once the loop was handed on, or after 5 s)."""
    import threading

    from dask_ddict import _blocking
    from dask_ddict.host import replicas
    from dask_ddict.host.control import DictSpec
    from dask_ddict.options import DDictOptions

    handed = threading.Event()

    class Link:  # (a replica's link: each answer waits for the hand-on)
        def send(self, op, mid):
            return lambda: handed.wait(5)

    shipper = replicas.Shipper(DictSpec("d", "00" * 16, "s", DDictOptions(), 1 << 20, 1), 0, False)
    target = replicas.Target(ManagerInfo(0, "w", "h", "h:b", 1, "", "127.0.0.1", 1, ""), Link())
    shipper.targets.append(target)
    _blocking.serving(handed.set)  # (this thread runs an event loop)
    try:
        for _ in range(replicas.MOST_PENDING + 1):
            shipper.ship([], later=True)
    finally:
        _blocking.serving(None)
    assert handed.is_set() and len(target.pending) == replicas.MOST_PENDING
    assert shipper.targets == [target]  # (its answers came: it was not dropped)


def test_a_replica_that_fails_a_write_is_dropped_only_at_the_orchestrators_word(tmp_path):
    """Of two replicas, one fails a write: the other still gets it, and the write is
    acknowledged only once the orchestrator (through the host's lease: a fake keeper
    here) took the failed one out of the set; meanwhile the manager is fenced (its
    requests answered ``LEASE``, the writes after it write nothing).  Without its word,
    the write raises ``DDictLeaseError`` and the manager stays fenced (a unit test: fake
    replica links, a real shard)."""
    from dask_ddict.errors import DDictLeaseError
    from dask_ddict.host import replicas
    from dask_ddict.host.control import DictSpec
    from dask_ddict.host.hosted import HostedDict
    from dask_ddict.options import DDictOptions

    class Link:
        def __init__(self, fails: bool) -> None:
            self.fails, self.got = fails, []

        def send(self, op, mid):
            self.got.append(op.seq)

            def answer():
                if self.fails:
                    raise OSError("no route to host")

            return answer

        def close(self):
            pass

    class Keeper:  # (answers a renewal now: the orchestrator drops what was asked, or not)
        required, until = True, 0.0

        def __init__(self, agrees: bool) -> None:
            self.agrees, self.asked = agrees, 0

        def answer(self, timeout):
            self.asked += 1
            if self.agrees:
                shipper.dropped(sorted(shipper.doubts))
            return self.agrees

    def info(port: int) -> ManagerInfo:
        return ManagerInfo(0, "w", f"h{port}", "h:b", 1, "", "127.0.0.1", port, "")

    store = ShardStore(str(tmp_path / "p"), 16 << 20)
    manager = Manager(0, store, WorkingSet(store, 1))
    hosted = HostedDict("00" * 16, "d", "s")
    hosted.managers[0] = manager
    try:
        for agrees in (True, False):
            keeper = Keeper(agrees)
            shipper = replicas.Shipper(
                DictSpec("d", "00" * 16, "s", DDictOptions(replicas=2), 16 << 20, 1),
                0,
                False,
                keeper,
                hosted,
                manager,
            )  # type: ignore[arg-type]
            good, bad = Link(False), Link(True)
            shipper.targets = [replicas.Target(info(2), bad), replicas.Target(info(1), good)]
            manager.shipper, store.replicate = shipper, shipper.ship
            put = _k(("k", agrees))
            if agrees:
                manager.put(*put, dumps_value(1).join(), 0, CLIENT)  # (acknowledged)
                assert [t.link for t in shipper.targets] == [good] and not shipper.doubts
                assert hosted.managers.get(0) is manager and not store.fenced
            else:
                with pytest.raises(DDictLeaseError, match="not acknowledged"):
                    manager.put(*put, dumps_value(1).join(), 0, CLIENT)
                assert shipper.doubts == {info(2).address} and 0 in hosted.fenced
                assert store.fenced and hosted.managers.get(0) is None
                with pytest.raises(DDictLeaseError, match="takes no write now"):
                    manager.put(*_k("after"), dumps_value(2).join(), 0, CLIENT)
                assert not manager.contains(_k("after")[0], 0)  # (nothing written)
                shipper.dropped([info(2).address])  # (the orchestrator's word, later)
                assert hosted.managers.get(0) is manager and not store.fenced
            assert good.got == [1] and bad.got == [1] and keeper.asked == 1
            store.replicate = manager.shipper = None
    finally:
        manager.close()
