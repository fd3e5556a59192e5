"""A same-host client's single reads and puts in one call (``SharedState.read_here`` and
``put_here``: the key lane's ``d[key]``, ``d.get``, ``key in d`` and ``d[key] = value``
on the managers' host) answer as the channel's Python path (``SharedChannel._get``,
``_contains`` and ``_put``, the reference).

The read serves the common case (a small value, the view open, the host known alive,
the shard open and the checkpoint in its window) and declines everything else with
``NotImplemented``, which the Python path then serves and explains.  Here the compiled
read, the pure read and the Python path run side by side on one dictionary of a real
cluster, against a model, while writes commit from this process and from the managers,
views close under it and the dictionary freezes; every way the read declines is checked
by making it happen.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import dask
import pytest
from distributed import Client
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from dask_ddict import (
    DDict,
    DDictCheckpointSyncError,
    DDictClosedError,
    DDictError,
    DDictKeyError,
    kernels,
)
from dask_ddict._serialize import SMALL_FRAME, dumps_value, loads_value
from dask_ddict.client.lane import LANE
from dask_ddict.kernels import NO_KEY, pure
from dask_ddict.transport import mapped, shared, timing
from dask_ddict.transport.ops import Contains, Get
from dask_ddict.transport.shared import SharedChannel
from tests.support.cluster import local_cluster
from tests.support.shards import slots_of, snapshots
from tests.support.values import same, values
from tests.support.writers import under_a_host_kill

try:
    from dask_ddict.kernels import _compiled
except ImportError:  # (a machine without a compiler: test_kernels says so)
    _compiled = None

#: The reads compared with the Python path: the pure one always (it reads any channel's
#: attributes), the compiled one where the channels' bases are its own.
READS: list[Any] = [pure.SharedState.read_here] + (
    [_compiled.SharedState.read_here] if _compiled is not None and kernels.COMPILED else []
)
#: The puts compared with the Python path, as the reads.
PUTS: dict[str, Any] = {"pure": pure.SharedState.put_here} | (
    {"compiled": _compiled.SharedState.put_here}
    if _compiled is not None and kernels.COMPILED
    else {}
)
PUTTERS = ["manager", "python", *PUTS]
KEYS = ["a", "b", 7, ("t", 1), b"raw", 3.5]
ABSENT = "<absent>"

values_st = values(4000, 4079, 4080, 5000, 70_000)  # (around the limit: SMALL_FRAME)


def _small(value: Any) -> bool:
    """Whether ``value``'s frame is one the read serves (under ``SMALL_FRAME``)."""
    return dumps_value(value).nbytes < SMALL_FRAME


def _channel(h: DDict, key: Any) -> tuple[SharedChannel, bytes]:
    mid, digest, _ = h._route(key)
    ch = h._core.channel(mid)
    assert type(ch) is SharedChannel, ch  # (the managers' host: read here)
    return ch, digest


def _python(h: DDict, key: Any, contains: bool = False) -> Any:
    """The channel's Python path's answer (the reference), :data:`ABSENT` for none."""
    ch, digest = _channel(h, key)
    if contains:
        return bool(ch.call(Contains(digest, h._chkpt)))
    try:
        return kernels.decoded(ch.call(Get(digest, h._chkpt)), loads_value)
    except DDictKeyError:
        return ABSENT


def _here(read: Any, h: DDict, key: Any, contains: bool = False) -> Any:
    """``read``'s answer (``NotImplemented`` kept), :data:`ABSENT` for :data:`NO_KEY`."""
    ch, digest = _channel(h, key)
    got = read(ch, digest, h._chkpt, contains, loads_value)
    return ABSENT if got is NO_KEY else got


def _put_here(put: Any, h: DDict, key: Any, value: Any) -> Any:
    """``put``'s answer for ``h[key] = value`` (routed and framed as the lane does)."""
    router, dumps = h._routed or h._routing()
    mid, digest, kb, framed = router.record(key, value, dumps)
    return put(h._core.channel(mid), digest, kb, framed, h._chkpt)


def _alive(h: DDict) -> None:
    """Every channel's host known alive for a while (the Python path's check, done)."""
    for m in range(h.num_managers):
        ch = h._core.channel(m)
        ch._check_alive()
        ch._alive_until = time.monotonic() + 60


@pytest.fixture
def here(client):
    d = DDict(total_mem="64 MiB", client=client)
    try:
        yield d
    finally:
        d.destroy()


def test_the_reads_here_answer_as_the_python_path(here, client):
    """A history of puts (committed by this process, or by the managers: a handle over
    the socket), deletions, views closed under the channels, freezes, and reads by every
    read and the Python path, each answered as the model says; a small value is always
    served, a large one always declined (and seen by ``in``)."""
    d = here
    with dask.config.set({"ddict.local-read": False}):
        sock = DDict.attach(d.serialize())
    served = {id(read): 0 for read in READS} | dict.fromkeys(PUTS, 0)

    class History(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            d.clear()
            self.model: dict[Any, Any] = {}

        @rule(key=st.sampled_from(KEYS), value=values_st, by=st.sampled_from(PUTTERS))
        def put(self, key: Any, value: Any, by: str) -> None:
            """Put by the manager (a handle over its socket), this process's Python path,
            or a put_here (declined: the Python path's); a large value is always
            declined, a small one committed here unless the commit's rules leave it to
            the Python path (a shard's first put after ``clear``, which has no key
            counts yet, say)."""
            if by == "manager":
                sock[key] = value
            elif by == "python":
                d._put(key, value, False)
            else:
                _alive(d)
                got = _put_here(PUTS[by], d, key, value)
                if got is None:
                    served[by] += 1
                    assert dumps_value(value).nbytes <= kernels.DIRECT_PUT_MAX
                else:
                    assert got is NotImplemented, (by, key, got)
                    d._put(key, value, False)
            self.model[key] = value

        @rule(key=st.sampled_from(KEYS), by_manager=st.booleans())
        def delete(self, key: Any, by_manager: bool) -> None:
            h = sock if by_manager else d
            if key in self.model:
                del h[key]
                del self.model[key]

        @rule(key=st.sampled_from(KEYS))
        def read(self, key: Any) -> None:
            want = self.model.get(key, ABSENT)
            _alive(d)
            ch, _ = _channel(d, key)
            mapped_here = ch._view is not None and not ch._view.evicted  # (else: declined)
            for read in READS:
                got = _here(read, d, key)
                if mapped_here and (want is ABSENT or _small(want)):
                    assert same(got, want), (read, key, got, want)
                    served[id(read)] += 1
                else:
                    assert got is NotImplemented, (read, key, got)
                seen = _here(read, d, key, True)
                assert seen is ((want is not ABSENT) if mapped_here else NotImplemented)
            assert same(_python(d, key), want)
            assert _python(d, key, True) is (want is not ABSENT)
            assert same(d.get(key, ABSENT), want) and (key in d) is (want is not ABSENT)

        @rule(key=st.sampled_from(KEYS))
        def view_closed(self, key: Any) -> None:
            """The channel's view closed for its channels (as an idle one is taken for
            another shard): declined until the channel maps the shard again."""
            ch, _ = _channel(d, key)
            view = ch._view
            if view is None or view.evicted:
                return
            with mapped._ENVS_LOCK:
                mapped._ENVS.pop(ch._path, None)
            view.close()
            _alive(d)
            want = self.model.get(key, ABSENT)
            for read in READS:
                assert _here(read, d, key) is NotImplemented
                assert _here(read, d, key, True) is NotImplemented
            mid = d.which_manager(key)
            never = next(("never", i) for i in range(100) if d.which_manager(("never", i)) == mid)
            if "compiled" in PUTS:  # (the pure put commits by put_batch, which maps it again)
                assert _put_here(PUTS["compiled"], d, never, 1) is NotImplemented
            ch._retry_at = 0.0  # (its next Python path maps the shard again, at once)
            assert same(d.get(key, ABSENT), want) and never not in d
            assert ch._view is not view and not ch._view.evicted

        @rule()
        def frozen(self) -> None:
            """Frozen: small values are still read here (none is lent), and the read
            notes the frozen mark as the Python path would (large values are lent by
            ``d[key]`` while it says frozen)."""
            d.freeze()
            try:
                self.read_all(True)
            finally:
                d.unfreeze()
            self.read_all(False)

        def read_all(self, frozen: bool) -> None:
            for key in KEYS:
                self.read(key)
                ch, _ = _channel(d, key)
                if ch._view is not None and not ch._view.evicted:
                    assert ch._seen[2] is frozen

    try:
        run_state_machine_as_test(
            History, settings=settings(max_examples=20, stateful_step_count=25, deadline=None)
        )
    finally:
        sock.detach()
    assert all(served[id(read)] > 20 for read in READS), served
    d["warm"] = 0  # (the history's puts here are drawn: a few may be all; here, surely)
    _alive(d)
    assert all(_put_here(put, d, "warm", name) is None for name, put in PUTS.items()), served
    assert d["warm"] == list(PUTS)[-1]


def test_the_key_lane_reads_here_and_the_python_path_is_not_called(here, monkeypatch):
    """``d[key]``, ``d.get`` and ``key in d`` on the managers' host are the lane's read:
    the channel's Python path is not asked (only to check the host alive, every
    ``ALIVE_CHECK``), and the read writes what the Python path writes of the shard's
    state (its transaction id, window and frozen mark) after a commit."""
    d = here
    d["k"] = b"v" * 100
    d["big"] = b"v" * 5000
    _alive(d)
    called: list[str] = []
    for op in (Get, Contains):
        real = shared._LOCAL[op]

        def spy(self: Any, o: Any, real: Any = real) -> Any:
            called.append(type(o).__name__)
            return real(self, o)

        monkeypatch.setitem(shared._LOCAL, op, spy)
    ch, _ = _channel(d, "k")
    d["k"] = b"w" * 100  # (a commit: the shard's state read again by the next read)
    for _ in range(50):
        assert d["k"] == b"w" * 100 and d.get("nope", 3) == 3
        assert "k" in d and "nope" not in d
    assert called == [], called
    with ch._view.store.read() as txn:
        assert ch._seen == (txn.id(), 0, False)
    assert d["big"] == b"v" * 5000 and called == ["Get"]  # (a large value: the path's)


def test_the_reads_here_decline_what_the_python_path_must_say(client):
    """Each case the read does not serve answers ``NotImplemented``, and the handle's
    own read then says what the Python path says."""
    with DDict(total_mem="32 MiB", client=client, working_set_size=2) as d:
        d["k"] = 1
        d["big"] = b"x" * 5000
        _alive(d)
        ch, digest = _channel(d, "k")
        for read in READS:
            assert read(ch, digest, 0, False, loads_value) == 1
            assert read(ch, digest, -1, False, loads_value) is NotImplemented
            assert read(ch, digest, 2**70, False, loads_value) is NotImplemented
            assert read(ch, "k", 0, False, loads_value) is NotImplemented
            assert read(ch, digest[:8], 0, False, loads_value) is NotImplemented
            assert _here(read, d, "big") is NotImplemented and _here(read, d, "big", True) is True
        assert d["big"] == b"x" * 5000
        # the host's liveness not checked within ALIVE_CHECK: the Python path checks it
        ch._alive_until = 0.0
        assert all(_here(read, d, "k") is NotImplemented for read in READS)
        assert d["k"] == 1 and ch._alive_until > time.monotonic()
        assert all(_here(read, d, "k") == 1 for read in READS)
        # a dropped batch's commit to let go first
        ch._orphans = [None]
        try:
            assert all(_here(read, d, "k") is NotImplemented for read in READS)
        finally:
            ch._orphans = shared._ORPHANS
        # timings on: every operation is timed, as one
        timing.reset(True)
        try:
            assert LANE.get(d, "k") is NotImplemented and LANE.contains(d, "k") is NotImplemented
        finally:
            timing.reset(False)
        # a retired checkpoint: the Python path raises
        old = DDict.attach(d.serialize())
        d.checkpoint_id = 2
        d["k"] = 2  # (the window is now [1, 2])
        _alive(old)
        assert all(_here(read, old, "k") is NotImplemented for read in READS)
        with pytest.raises(DDictCheckpointSyncError):
            old["k"]
        with pytest.raises(DDictCheckpointSyncError):  # (its channel's state known now)
            old["k"]
        _alive(old)
        assert _channel(old, "k")[0]._seen[1] == 2  # (the newest checkpoint, as read)
        assert all(_here(read, old, "k") is NotImplemented for read in READS)
        # a channel closed
        gone, _ = _channel(old, "k")
        old.detach()
        assert all(read(gone, digest, 2, False, loads_value) is NotImplemented for read in READS)
        # a value pickler, and a handle's target: the pickler's path; the target read here
        pickled = d.pickler(value_pickler=_Pickler())
        assert LANE.get(pickled, "k") is NotImplemented
        assert pickled.get("nope", 5) == 5
        mid = d.which_manager("k")
        to, other = d.manager(mid), d.manager(1 - mid)
        assert to["k"] == 2 and other.get("k") is None  # (routed by their first reads)
        _alive(to)
        assert LANE.get(to, "k") == 2
        assert LANE.get(other, "k") is NO_KEY  # (not that manager's key)
        # destroyed by another handle: the shard's closed mark
        other = DDict.attach(d.serialize())
        other.destroy()
        assert all(_here(read, d, "k") is NotImplemented for read in READS)
        with pytest.raises(DDictClosedError):
            d["k"]


class _Pickler:
    @staticmethod
    def dump(value: Any, file: Any) -> None:
        file.write(repr(value).encode())

    @staticmethod
    def load(file: Any) -> Any:
        return file.read().decode()


def test_a_wait_for_keys_or_replicated_dictionary_is_the_python_paths(client):
    """A reader that may wait for a writer (``wait_for_keys``), and a replicated
    manager (its lease checked at every read): declined, read right by the handle."""
    with DDict(total_mem="32 MiB", client=client, wait_for_keys=True, working_set_size=2) as d:
        d["k"] = 1
        _alive(d)
        assert all(_here(read, d, "k") is NotImplemented for read in READS)
        assert d["k"] == 1 and "k" in d
    with DDict(total_mem="32 MiB", client=client, replicas=1) as d:
        d["k"] = 1
        assert d["k"] == 1 and "k" in d  # (the Python path's: its lease checked each time)
        assert all(_here(read, d, "k") is NotImplemented for read in READS)
        assert all(_here(read, d, "k", True) is NotImplemented for read in READS)


def test_reads_here_count_their_pages_and_keep_one_snapshot(here, monkeypatch):
    """A read here counts what the Python path's copy counts (the value's bytes and a
    page, towards giving the process's mappings back), and renews py-lmdb's spare
    snapshot: after a thousand reads, beside the Python path's and py-lmdb's own, the
    process holds one reader slot of the shard, and no snapshot in it."""
    d = here
    d["k"] = b"v" * 300
    _alive(d)
    ch, _ = _channel(d, "k")
    env = ch._view.store.env
    for read in READS:
        monkeypatch.setattr(mapped, "_unreleased", 0)
        n = dumps_value(b"v" * 300).nbytes
        assert _here(read, d, "k") == b"v" * 300
        assert mapped._unreleased == n + mapped._memory.PAGE
    for i in range(1000):
        assert d["k"] == b"v" * 300
        if i % 100 == 0:
            _python(d, "k")
            assert _snapshot_id(env) > 0  # (py-lmdb's own snapshot, beside the lane's)
    assert slots_of(env, os.getpid()) == 1  # (the spare's: renewed by every read)
    assert all(pid != os.getpid() for pid, _ in snapshots(env))  # (holding nothing)


def _snapshot_id(env: Any) -> int:
    """The transaction id of a snapshot of ``env`` begun and ended by py-lmdb (its
    transaction object gone with the call: it keeps its slot while it lives)."""
    with env.begin() as txn:
        return int(txn.id())


def test_reads_here_while_other_threads_close_the_views(client):
    """Reads through the lane from three threads while a fourth closes the channels'
    views again and again, and handles attach and detach: every answer right (read
    here, or over the socket while a view is closed), nothing raised, and many of them
    the lane's own."""
    with DDict(total_mem="32 MiB", client=client) as d:
        want = {i: ("v", i) for i in range(50)}
        d.update(want)
        stop = threading.Event()
        errors: list[BaseException] = []
        served = [0]

        def reader() -> None:
            try:
                for n in range(20_000):
                    if stop.is_set():
                        return
                    i = n % 50
                    if n % 100 == 0:
                        _alive(d)
                    got = LANE.get(d, i)
                    if got is not NotImplemented:
                        assert got == want[i]
                        served[0] += 1
                    assert d[i] == want[i] and i in d
            except BaseException as e:  # noqa: BLE001 - said below
                errors.append(e)

        def closer() -> None:
            try:
                for _ in range(200):
                    if stop.is_set():
                        return
                    with mapped._ENVS_LOCK:
                        views = list(mapped._ENVS.items())
                    for path, view in views:
                        with mapped._ENVS_LOCK:
                            if mapped._ENVS.get(path) is view:
                                del mapped._ENVS[path]
                        view.close()
                    h = DDict.attach(d.serialize())
                    assert h[3] == want[3]
                    h.detach()
                    time.sleep(0.005)
            except BaseException as e:  # noqa: BLE001 - said below
                errors.append(e)

        threads = [threading.Thread(target=reader) for _ in range(3)]
        threads.append(threading.Thread(target=closer))
        for t in threads:
            t.start()
        threads[-1].join(120)
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert served[0] > 1000
        assert all(d[i] == want[i] for i in want)


def test_puts_here_decline_what_the_python_path_must_say(client):
    """Each put the channel may not commit itself answers ``NotImplemented`` with nothing
    written, and the handle's own put then does what the Python path does."""
    with DDict(total_mem="32 MiB", client=client) as d:
        d["k"] = 0
        _alive(d)
        for name, put in PUTS.items():
            assert _put_here(put, d, "k", name) is None and d["k"] == name
            assert _put_here(put, d, "big", b"x" * (70 << 10)) is NotImplemented
            assert d.get("big") is None  # (nothing written: the manager's to put)
        d["big"] = b"x" * (70 << 10)
        assert d["big"] == b"x" * (70 << 10)
        # frozen: refused by the commit's rules, and by the Python path, which says so
        d.freeze()
        assert all(_put_here(put, d, "k", 1) is NotImplemented for put in PUTS.values())
        with pytest.raises(DDictError, match="frozen"):
            d["k"] = 1
        d.unfreeze()
        # (a waiter at the manager: tests/test_same_host.py, whose put the lane leaves)
        # the host's liveness due for its check; a dropped batch's commit to let go
        ch, _ = _channel(d, "k")
        ch._alive_until = 0.0
        assert all(_put_here(put, d, "k", 2) is NotImplemented for put in PUTS.values())
        _alive(d)
        ch._orphans = [None]
        try:
            assert all(_put_here(put, d, "k", 2) is NotImplemented for put in PUTS.values())
        finally:
            ch._orphans = shared._ORPHANS
        assert d["k"] == list(PUTS)[-1]  # (the last put committed here: nothing since)
        # through the lane itself: a manager-directed handle, timings, a value pickler, a
        # key too long
        mid = d.which_manager("k")
        to, other = d.manager(mid), d.manager(1 - mid)
        to["k"], other["k"] = 4, 5  # (routed by their first puts; "k" is mid's key)
        _alive(to)
        _alive(other)
        assert LANE.put(to, "k", 6, False) is None and to["k"] == 6 and d["k"] == 6
        assert LANE.put(other, "k", 7, False) is None and other["k"] == 7 and d["k"] == 6
        timing.reset(True)
        try:
            assert LANE.put(d, "k", 8, False) is NotImplemented
        finally:
            timing.reset(False)
        pickled = d.pickler(value_pickler=_Pickler())
        assert LANE.put(pickled, "k", 9, False) is NotImplemented
        assert LANE.put(d, "x" * (d._core.max_key_bytes + 1), 1, False) is NotImplemented
        assert d["k"] == 6
        # a checkpoint past the window: the manager's, which moves the window
        d.checkpoint_id = 1
        assert all(_put_here(put, d, "k", 3) is NotImplemented for put in PUTS.values())
        d["k"] = 3
        assert d.stats[d.which_manager("k")].newest_checkpoint == 1 and d["k"] == 3
        # a retired checkpoint: the Python path raises
        old = DDict.attach(d.serialize())
        old.checkpoint_id = 1
        old["k"]  # (routed, its channels made)
        d.checkpoint_id = 2
        d["k"] = 10  # (the window of one is now [2])
        _alive(old)
        assert all(_put_here(put, old, "k", 11) is NotImplemented for put in PUTS.values())
        with pytest.raises(DDictCheckpointSyncError):
            old["k"] = 11
        gone, _ = _channel(old, "k")
        old.detach()  # (a closed channel)
        router, dumps = d._routed
        _, digest, kb, framed = router.record("k", 12, dumps)
        assert all(put(gone, digest, kb, framed, 2) is NotImplemented for put in PUTS.values())
        assert d["k"] == 10
    for options in (
        {"working_set_size": 2},
        {"wait_for_keys": True, "working_set_size": 2},
        {"local_write": False},
    ):
        config = {"ddict.local-write": options.pop("local_write", True)}
        with dask.config.set(config), DDict(total_mem="32 MiB", client=client, **options) as d:
            d["k"] = 0
            _alive(d)
            assert all(_put_here(put, d, "k", 1) is NotImplemented for put in PUTS.values())
            d["k"] = 1
            assert d["k"] == 1


def test_a_host_killed_under_same_host_writers_loses_no_acknowledged_write():
    """Writers on the managers' host (their puts committed by the lane, in this process)
    and readers while the host process of one manager is SIGKILLed and restarted: every
    acknowledged write reads back, and the lane committed most of them."""
    with local_cluster(2) as cl, Client(cl) as c:
        d = DDict(total_mem="64 MiB", client=c)
        try:
            d["warm"] = 1
            acked: list[list[int]] = [[] for _ in range(3)]
            committed = [0]

            def step(i: int) -> None:
                k = len(acked[i])
                if LANE.put(d, (i, k), k, False) is None:
                    committed[0] += 1
                else:
                    d[(i, k)] = k
                acked[i].append(k)
                assert d[(i, k)] == k

            under_a_host_kill(d, step, acked)
            held = dict(d.items())
            for i, ks in enumerate(acked):
                for k in ks:
                    assert held.get((i, k)) == k, f"acknowledged write ({i}, {k}) lost"
            assert committed[0] > sum(len(ks) for ks in acked) // 2
        finally:
            d.destroy()
