"""A handle's single-key operations over TCP in one call (``kernels.KeyLane``) answer as
its Python path.

The lane serves ``d[key]``, ``d.get``, ``key in d``, ``d[key] = value``, ``d.pop`` and
``d.fetch_add`` of an open handle over a plain TCP link with an idle connection, and
answers ``NotImplemented`` for anything else, before sending or after a reply that is
not OK or a broken connection (an at-most-once operation's, a ``Resend`` with its id);
the handle's Python path is the reference.  Here the compiled lane, the pure lane and
the Python path run side by side against one dictionary of a real cluster, a model of
it says what each answer must be, and every way the lane declines is checked to leave
the answer to the Python path with nothing sent twice that could matter; a host killed
under writers over the lane loses no acknowledged write.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import dask
import numpy as np
import psutil
import pytest
from distributed import Client
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from dask_ddict import DDict, DDictClosedError, DDictKeyError, kernels
from dask_ddict._serialize import loads_value
from dask_ddict.client.lane import LANE, wired
from dask_ddict.client.reads import ABSENT as READS_ABSENT
from dask_ddict.client.reads import WAIT
from dask_ddict.errors import DDictSerializationError
from dask_ddict.kernels import NO_KEY, Resend, pure
from dask_ddict.transport import timing
from dask_ddict.transport.idle_pool import IDLE_POOL
from dask_ddict.transport.ops import Contains, FetchAdd, Pop
from tests.support.cluster import local_cluster
from tests.support.handles import over_tcp
from tests.support.polling import poll_for
from tests.support.values import same, values
from tests.support.writers import under_a_host_kill

try:
    from dask_ddict.kernels import _compiled
except ImportError:  # (a machine without a compiler: test_kernels says so)
    _compiled = None

#: The lanes compared with the Python path (``None``).
LANES: list[Any] = [None, wired(pure.KeyLane)] + (
    [] if _compiled is None else [wired(_compiled.KeyLane)]
)
#: Those that serve this process's handles (the compiled lane takes only the compiled
#: router's routes: under ``DASK_DDICT__COMPILED=false`` it declines every call).
SERVING = [lane for lane in LANES[1:] if type(lane) is pure.KeyLane or kernels.COMPILED]
KEYS = ["a", "b", 7, ("t", 1), b"raw", 3.5]
COUNTERS = ["n", ("n", 2)]  # (fetch_add's: ints alone)
ABSENT = "<absent>"

values_st = st.one_of(
    values(4000, 5000, 60_000, 70_000),  # (around the limits)
    st.just(NotImplemented),  # (a value, not the lanes' "not mine": a pop never twice)
)


def _began(got: Any) -> float | None:
    """When a lane's answer says the Python path's time began (a Resend's), if it does."""
    return got.began if type(got) is Resend else None


def _get(lane: Any, h: DDict, key: Any) -> Any:
    """``h[key]`` through ``lane`` (``None``: the Python path), or :data:`ABSENT`."""
    got = NotImplemented if lane is None else lane.get(h, key)
    if got is NotImplemented or type(got) is Resend:
        try:
            return h._get(key, None, _began(got))
        except DDictKeyError:
            return ABSENT
    return ABSENT if got is NO_KEY else got


def _contains(lane: Any, h: DDict, key: Any) -> bool:
    got = NotImplemented if lane is None else lane.contains(h, key)
    if got is NotImplemented or type(got) is Resend:
        mid, digest, _ = h._route(key)
        return h._core.channel(mid).call(Contains(digest, h._chkpt, h.timeout, _began(got)))
    return got


def _put(lane: Any, h: DDict, key: Any, value: Any, persistent: bool) -> None:
    got = None if lane is None else lane.put(h, key, value, persistent)
    if got is not None or lane is None:
        h._put(key, value, persistent, _began(got))


def _pop(lane: Any, h: DDict, key: Any) -> tuple[Any, bool]:
    """``h.pop(key)`` through ``lane`` (``None``: the Python path), or :data:`ABSENT`, and
    whether the lane answered it; once a lane sent it, the Python path sends it again
    with the lane's request id."""
    got = NotImplemented if lane is None else lane.pop(h, key)
    if type(got) is tuple:  # (the value, whatever it is)
        return got[0], True
    if got is NotImplemented or type(got) is Resend:
        began, rid = (None, 0) if got is NotImplemented else got
        mid, digest, _ = h._route(key)
        try:
            frame = h._core.channel(mid).call(
                Pop(digest, h._chkpt, h._client_id, h.timeout, began, rid)
            )
        except DDictKeyError:
            return ABSENT, False
        return loads_value(frame), False
    assert got is NO_KEY, got
    return ABSENT, True


def _fetch_add(lane: Any, h: DDict, key: Any, n: int) -> tuple[Any, bool]:
    """``h.fetch_add(key, n)`` through ``lane`` (``None``: the Python path), and whether
    the lane answered it (see :func:`_pop`)."""
    got = NotImplemented if lane is None else lane.fetch_add(h, key, n)
    if got is NotImplemented or type(got) is Resend:
        began, rid = (None, 0) if got is NotImplemented else got
        mid, digest, kb = h._route(key)
        op = FetchAdd(digest, kb, h._chkpt, h._client_id, n, h.timeout, began, rid)
        return loads_value(h._core.write(mid, op)), False
    return got, True


def _get_many(lane: Any, h: DDict, keys: list[Any]) -> tuple[list[Any], list[int]]:
    """``h.get_many(keys)`` through ``lane`` (``None``: the Python path) as ``(values,
    indices of the absent keys)``, :data:`ABSENT` for an absent key."""
    got = NotImplemented if lane is None else lane.get_many(h, list(keys), ABSENT)
    if got is NotImplemented or type(got) is Resend:  # (as Reads.get_many: its own marker)
        routes = h._routes(list(keys))
        decode, small = h._decoder(None)
        values, marked = kernels.decode_values(
            routes, h._fetched(routes, True, None), decode, READS_ABSENT, WAIT, small
        )
        return [ABSENT if v is READS_ABSENT else v for v in values], marked
    return got


@pytest.fixture
def tcp(client: Client) -> Any:
    d = DDict(total_mem="64 MiB", client=client)
    h = over_tcp(d)
    try:
        yield h
    finally:
        d.destroy()


def test_the_lanes_answer_as_the_python_path(tcp):
    """A history of gets, ``in``s, puts and persistent puts (values of every kind, some
    past what one send carries), pops and ``fetch_add``s (past 64 bits too), each by one
    of the three paths through a handle without a timeout or one with, and every read
    (``get_many`` too) by all three, answered as the model says; the lanes really served
    most of them."""
    h = tcp
    h[KEYS[0]] = 0  # (routed, the room known, connections in the pool: the lanes' case)
    handles = [h, _timed(h, 30)]
    served = {id(lane): 0 for lane in LANES if lane is not None}
    served_many = dict.fromkeys(served, 0)  # (untimed get_manys of at least one key)
    served_once = dict.fromkeys(served, 0)  # (pops and fetch_adds)

    class History(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            h.clear()
            self.model: dict[Any, Any] = {}

        @rule(
            key=st.sampled_from(KEYS),
            value=values_st,
            by=st.sampled_from(range(len(LANES))),
            persistent=st.booleans(),
            timed=st.booleans(),
        )
        def put(self, key: Any, value: Any, by: int, persistent: bool, timed: bool) -> None:
            lane, at = LANES[by], handles[timed]
            got = None if lane is None else lane.put(at, key, value, persistent)
            if lane is not None and got is None:
                served[id(lane)] += 1
            else:
                _put(None, at, key, value, persistent)
            self.model[key] = value

        @rule(key=st.sampled_from(KEYS), by=st.sampled_from(range(len(LANES))), timed=st.booleans())
        def pop(self, key: Any, by: int, timed: bool) -> None:
            lane, at = LANES[by], handles[timed]
            got = _pop(lane, at, key)
            if lane is not None and got[1]:
                served_once[id(lane)] += 1
            assert same(got[0], self.model.pop(key, ABSENT)), (lane, key, got)

        @rule(
            key=st.sampled_from(COUNTERS),
            n=st.one_of(st.integers(-(2**40), 2**40), st.sampled_from([2**63 - 1, -(2**63)])),
            by=st.sampled_from(range(len(LANES))),
            timed=st.booleans(),
        )
        def fetch_add(self, key: Any, n: int, by: int, timed: bool) -> None:
            lane, at = LANES[by], handles[timed]
            old = self.model.get(key, 0)
            self.model[key] = old + n
            got = _fetch_add(lane, at, key, n)
            if lane is not None and got[1]:
                served_once[id(lane)] += 1
            assert type(got[0]) is int and got[0] == old, (lane, key, n, got)

        @rule(key=st.sampled_from(KEYS), timed=st.booleans())
        def get(self, key: Any, timed: bool) -> None:
            want, at = self.model.get(key, ABSENT), handles[timed]
            for lane in LANES:
                if lane is not None and lane.get(at, key) is not NotImplemented:
                    served[id(lane)] += 1
                got = _get(lane, at, key)
                assert same(got, want), (lane, key, got, want)
                assert _contains(lane, at, key) is (key in self.model)

        @rule(keys=st.lists(st.sampled_from([*KEYS, "never"]), max_size=8), timed=st.booleans())
        def get_many(self, keys: list[Any], timed: bool) -> None:
            want, at = [self.model.get(k, ABSENT) for k in keys], handles[timed]
            for lane in LANES:
                if lane is not None and lane.get_many(at, list(keys), ABSENT) is not (
                    NotImplemented
                ):
                    served_many[id(lane)] += 1
                got, marked = _get_many(lane, at, keys)
                assert len(got) == len(want), (lane, keys, got, want)
                assert all(same(g, w) for g, w in zip(got, want)), (lane, keys, got, want)
                assert list(marked) == [i for i, w in enumerate(want) if w is ABSENT]
            if keys and all(k in self.model for k in keys):
                assert all(same(g, w) for g, w in zip(at.get_many(keys), want))
            else:
                assert all(same(g, w) for g, w in zip(at.get_many(keys, ABSENT), want))

        @rule(key=st.sampled_from(KEYS), timed=st.booleans())
        def handle(self, key: Any, timed: bool) -> None:  # (the handle's own: LANE's)
            want, at = self.model.get(key, ABSENT), handles[timed]
            assert same(at.get(key, ABSENT), want)
            assert (key in at) is (key in self.model)
            if want is ABSENT:
                with pytest.raises(DDictKeyError):
                    at[key]
            else:
                assert same(at[key], want)

        @invariant()
        def same_length(self) -> None:
            assert len(h) == len(self.model)

    try:
        run_state_machine_as_test(
            History, settings=settings(max_examples=25, stateful_step_count=30, deadline=None)
        )
    finally:
        handles[1].detach()
    assert all(served[id(lane)] > 20 for lane in SERVING), served
    assert all(served_once[id(lane)] > 5 for lane in SERVING), served_once
    assert all(served_many[id(lane)] > 3 for lane in SERVING), served_many


def test_a_warm_tcp_handle_is_the_lanes_and_a_same_host_one_reads_here(client, tcp):
    """Over TCP the lane sends; on the managers' host it reads and commits in the shard
    mapped here (the channels' own set's read and put: ``tests/test_same_host_lane.py``),
    and leaves ``get_many``s to the Python path (which reads them here itself)."""
    d = DDict.attach(tcp.serialize())  # (on the managers' host: the shard read directly)
    try:
        for h in (tcp, d):
            h["gone"] = h["k"] = b"v"  # (routed, the room known, both links connected)
            del h["gone"]
        for lane in SERVING:
            assert lane.put(tcp, "k", b"w", False) is None
            assert lane.get(tcp, "k") == b"w" and lane.contains(tcp, "k") is True
            assert lane.get(tcp, "gone") is NO_KEY and lane.contains(tcp, "gone") is False
            assert lane.get_many(tcp, ["k", "gone", "k"], ABSENT) == ([b"w", ABSENT, b"w"], [1])
            assert lane.get_many(d, ["k", "other"], ABSENT) is NotImplemented  # (read_here's)
            for m in range(d.num_managers):  # (the hosts known alive: else the path checks)
                d._core.channel(m)._alive_until = time.monotonic() + 60
            here = isinstance(lane, kernels.KeyLane)  # (the set the channels' bases are of)
            assert lane.put(d, "k", b"x", False) is (None if here else NotImplemented)
            if not here:
                d["k"] = b"x"
            assert d["k"] == b"x"
            d["k"] = b"w"
            assert lane.get(d, "k") == (b"w" if here else NotImplemented)
            assert lane.contains(d, "k") is (True if here else NotImplemented)
            assert lane.get(d, "gone") is (NO_KEY if here else NotImplemented)
            assert lane.contains(d, "gone") is (False if here else NotImplemented)
    finally:
        d.detach()


def _idle_buffers(h: DDict) -> list[int]:
    """The receive buffers' sizes of the idle connections of ``h``'s links."""
    links = {id(ch.link): ch.link for ch in h._core._channels.values()}
    with IDLE_POOL.lock:
        return [len(c.reader._buf) for link in links.values() for c in link.idle]


def test_a_get_many_of_small_values_is_received_into_its_connection(tcp):
    """A many-key reply whose frames are all small is received into its connection's own
    buffer (grown to fit it) and decoded there before the connection goes back: the
    values are right, copies that later replies on the same connection do not change;
    a reply with a large frame (a view of its buffer) or over 256 KiB gets a buffer of
    its own, and its values stay as they were while the connection serves on."""
    h = tcp
    small = [f"s{i}" for i in range(1000)]  # (a reply of about 130 KB: past a buffer's 64 KiB)
    h.update({k: k.encode() * 20 for k in small})
    big = [f"b{i}" for i in range(300)]  # (300 frames of 4 KB: over 256 KiB)
    h.update({k: k.encode() * 990 for k in big})
    h["array"] = np.arange(1000)  # (an 8 KB frame: a view of its reply's buffer)
    for lane in SERVING:
        got, marked = lane.get_many(h, [*small, "never"], ABSENT)
        assert got == [k.encode() * 20 for k in small] + [ABSENT] and marked == [1000]
        if type(lane) is not pure.KeyLane:  # (the compiled lane's own buffer)
            assert max(_idle_buffers(h)) >= 130_000
        first = got
        arr, marked = lane.get_many(h, ["array", *small[:10]], ABSENT)
        again, _ = lane.get_many(h, small[::-1], ABSENT)  # (the same connections again)
        assert again == [k.encode() * 20 for k in small[::-1]]
        assert first[:3] == [b"s0" * 20, b"s1" * 20, b"s2" * 20]
        assert np.array_equal(arr[0], np.arange(1000)) and arr[1:] == [
            k.encode() * 20 for k in small[:10]
        ]
        many, _ = lane.get_many(h, big, ABSENT)
        assert many == [k.encode() * 990 for k in big]
        assert lane.get(h, "s5") == b"s5" * 20  # (a single get on a grown connection)
    assert max(_idle_buffers(h)) < 2 * (256 << 10) + 64  # (none grown past twice 256 KiB)


def _unloadable() -> None:
    raise RuntimeError("a value this process cannot load")


class _Unloadable:
    """A value whose pickle fails to load (a class a reader's process lacks, say)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unloadable, ())


def test_a_get_many_whose_value_cannot_be_loaded_keeps_its_connections(tcp):
    """A value that fails to decode raises its error from ``get_many``, after every
    host's reply was received and each connection went back to the pool as it was: the
    connections to the other hosts are not dropped, and the next call reads through
    them."""
    h = tcp
    keys = [f"u{i}" for i in range(200)]  # (replies of small frames from both managers)
    h.update({k: k.encode() * 30 for k in keys})
    h["bad"] = _Unloadable()
    assert len({h.which_manager(k) for k in keys}) == h.num_managers >= 2
    for lane in SERVING:
        assert lane.get_many(h, keys, ABSENT)[0] == [k.encode() * 30 for k in keys]
        with IDLE_POOL.lock:
            before = {id(c) for ch in h._core._channels.values() for c in ch.link.idle}
        with pytest.raises(DDictSerializationError, match="cannot load"):
            lane.get_many(h, ["bad", *keys], ABSENT)
        with IDLE_POOL.lock:
            after = {id(c) for ch in h._core._channels.values() for c in ch.link.idle}
        assert before and after == before
        assert lane.get_many(h, keys[::-1], ABSENT)[0] == [k.encode() * 30 for k in keys[::-1]]


def _calls(lane: Any, h: DDict, key: Any = "k", value: Any = b"x") -> list[Callable[[], Any]]:
    return [
        lambda: lane.get(h, key),
        lambda: lane.contains(h, key),
        lambda: lane.put(h, key, value, False),
        lambda: lane.get_many(h, [key, "other"], ABSENT),
    ]


def test_the_lanes_leave_every_other_case_to_the_python_path(client, tcp):
    """Each thing the lane does not serve answers ``NotImplemented`` (nothing sent), and
    the handle's own methods then do what the Python path does."""
    h = tcp
    h["k"] = b"v"
    cases: dict[str, tuple[DDict, Callable[[], Any]]] = {}

    def case(name: str, handle: DDict, undo: Callable[[], Any] = lambda: None) -> None:
        cases[name] = (handle, undo)

    fresh = over_tcp(h)  # (not routed yet: its first operation routes it)
    case("not routed", fresh)
    pickled = h.pickler(value_pickler=_ValuePickler())
    case("a value pickler", pickled)
    for lane in LANES[1:]:
        for name, (handle, _) in cases.items():
            for call in _calls(lane, handle):
                assert call() is NotImplemented, (lane, name)
        h.start_batch_put()
        try:
            assert lane.put(h, "k", b"x", False) is NotImplemented  # (a batch's own)
        finally:
            h.end_batch_put()
        assert lane.put(h, "big", b"x" * (70 << 10), False) is NotImplemented  # (two sends)
        assert lane.get_many(h, [], ABSENT) is NotImplemented  # (nothing to send)
        many = [("many", i) for i in range(5000)]  # (a request larger than one send)
        assert lane.get_many(h, many, ABSENT) is NotImplemented
        timing.reset(True)
        try:
            for call in _calls(lane, h):
                assert call() is NotImplemented  # (a timed channel: the Python path's)
        finally:
            timing.reset(False)
        with IDLE_POOL.lock:  # (a pool busy elsewhere: never waited for here)
            for call in _calls(lane, h):
                assert call() is NotImplemented
    h["big"] = b"x" * (70 << 10)  # (the Python path's: in parts)
    assert h["k"] == b"v" and h["big"] == b"x" * (70 << 10)
    assert fresh["k"] == b"v" and pickled.get("nope", 1) == 1
    with pytest.raises(ValueError, match="keys may have at most"):
        h["x" * (h._core.max_key_bytes + 1)]  # (a key too long: the Python path says why)
    fresh.detach()
    with pytest.raises(DDictClosedError):
        fresh["k"]
    pickled.detach()


@pytest.mark.parametrize("where", ["tcp", "same host"])
def test_the_lanes_buffer_a_batchs_puts_as_the_python_path(client, tcp, where):
    """Batch puts through each lane and the Python path, interleaved, into one batch whose
    buffers fill many times (small ``ddict.batch.flush-bytes``): every value reads back
    after the batch's end, values of every kind and both persistences; the lanes buffered
    most of them (a manager's first record and one that travels alone through
    ``BatchPut.add`` itself), and leave to the Python path what is its own (a value too
    large, a put of the other persistence)."""
    h = tcp if where == "tcp" else DDict.attach(tcp.serialize())
    try:
        h["warm"] = 0  # (routed, the room known)
        model: dict[Any, Any] = {}
        for persist in (False, True):
            served = dict.fromkeys(map(id, LANES[1:]), 0)
            with dask.config.set({"ddict.batch.flush-bytes": "4 KiB"}):
                h.start_batch_put(persist=persist)
            try:
                for n in range(600):
                    lane = LANES[n % len(LANES)]
                    key = (persist, n)
                    value = (b"v%d" % n, n, np.arange(n % 7))[n % 3]
                    if n % 50 == 7:  # (a record larger than a buffer: it travels alone)
                        value = b"L%d" % n * 1000
                    got = NotImplemented if lane is None else lane.batch_put(h, key, value, persist)
                    if got is NotImplemented:
                        (h.pput if persist else h.__setitem__)(key, value)
                    else:
                        assert got is None
                        served[id(lane)] += 1
                    model[key] = value
                for lane in LANES[1:]:
                    assert lane.batch_put(h, "other", b"x", not persist) is NotImplemented
                    assert lane.batch_put(h, "big", b"x" * (h._core._room + 1), persist) is (
                        NotImplemented
                    )
            finally:
                h.end_batch_put()
            assert all(served[id(lane)] > 150 for lane in SERVING), served
        held = dict(h.items())
        for key, value in model.items():
            assert same(held[key], value), (key, held.get(key), value)
    finally:
        h.clear()
        if h is not tcp:
            h.detach()


class _ValuePickler:
    """A value pickler (``d.pickler(value_pickler=...)``): the lane leaves its handle's
    values to the Python path, which frames them with it."""

    @staticmethod
    def dump(value: Any, file: Any) -> None:
        pickle.dump(value, file)

    @staticmethod
    def load(file: Any) -> Any:
        return pickle.load(file)


def _timed(h: DDict, timeout: float) -> DDict:
    """A handle of ``h``'s dictionary with ``timeout``, over TCP, each link connected."""
    with dask.config.set(  # (read as channels and links are made)
        {"ddict.local-transport": False, "ddict.transport.timeout-slack": "0.2 s"}
    ):
        t = DDict.attach(h.serialize(), timeout=timeout)
        t["warm"] = 0  # (routed, the room known)
        for m in range(t.num_managers):
            t.manager(m)[("warm", m)] = m  # (a connection pooled for each link)
    return t


def test_the_lanes_serve_a_handle_with_a_timeout_and_cut_its_waits(client, tcp):
    """A handle with a timeout is the lanes' too; against a stopped host every lane
    operation gives up within the timeout and the slack, raising what the Python path
    raises (a put: "may or may not have been applied"), its connection closed; the
    resumed host serves them again."""
    from dask_ddict import DDictTimeoutError
    from tests.support.processes import stop_process

    slack = 0.2  # (_timed's)
    t = _timed(tcp, 0.5)
    try:
        m = t.which_manager("k")
        for lane in SERVING:
            assert lane.put(t, "k", b"v", False) is None
            assert lane.get(t, "k") == b"v" and lane.contains(t, "k") is True
        link = t._core.channel(m).link
        for _ in range(4 * len(SERVING)):  # (one for each call below: each closes its own)
            IDLE_POOL.give(link, link._connect(m, None, None))
        host = psutil.Process(t.stats[m].pid)
        stop_process(host)
        # (a signal every 50 ms meanwhile: an interrupted wait must not start over)
        old = signal.signal(signal.SIGALRM, lambda *_: None)
        signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
        try:
            for lane in SERVING:
                for call, what in (
                    (lambda: lane.get(t, "k"), "did not answer GET within 0.5 s"),
                    (lambda: lane.contains(t, "k"), "did not answer CONTAINS"),
                    (lambda: lane.put(t, "k", b"w", False), "may or may not have been"),
                    (lambda: lane.get_many(t, ["k"], ABSENT), "did not answer GET_MANY"),
                ):
                    with IDLE_POOL.lock:
                        idle = len(link.idle)
                    t0 = time.monotonic()
                    with pytest.raises(DDictTimeoutError, match=what):
                        call()
                    assert 0.5 <= time.monotonic() - t0 < 0.5 + slack + 0.5
                    with IDLE_POOL.lock:  # (the connection it took is closed, not pooled)
                        assert len(link.idle) == idle - 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            host.resume()
        assert t["k"] == b"w" or t["k"] == b"v"  # (the timed-out put may have been applied)
    finally:
        t.detach()


def test_a_host_whose_own_wait_ran_out_is_the_python_paths_error(client):
    """Under ``wait_for_keys`` a get of a key not written at the reader's checkpoint waits
    at the host for the handle's timeout; the lanes raise the host's timeout as the
    Python path does, saying why (no writer put it there)."""
    from dask_ddict import DDictTimeoutError

    d = DDict(total_mem="64 MiB", client=client, wait_for_keys=True, working_set_size=2)
    try:
        t = _timed(d, 0.3)
        for lane in SERVING:
            t0 = time.monotonic()
            with pytest.raises(DDictTimeoutError, match="no writer put it there"):
                lane.get(t, "never")
            assert time.monotonic() - t0 >= 0.3
        with pytest.raises(DDictTimeoutError, match="no writer put it there"):
            t["never"]
        t.detach()
    finally:
        d.destroy()


def test_a_timed_read_sent_again_keeps_its_first_deadline():
    """A lane's timed get that waits at its host (``wait_for_keys``) and then loses its
    connection (the host SIGKILLed) is sent again by the Python path within the same
    deadline: the whole get ends within its timeout and the slack, not a second
    timeout later."""
    from dask_ddict import DDictError

    with local_cluster(1) as cl, Client(cl) as c:
        d = DDict(total_mem="32 MiB", client=c, wait_for_keys=True, working_set_size=2)
        try:
            t = _timed(d, 2.0)  # (slack 0.2 s)
            host = d.stats[t.which_manager("never")].pid
            killer = threading.Timer(1.2, os.kill, (host, signal.SIGKILL))
            killer.start()
            t0 = time.monotonic()
            with pytest.raises(DDictError):  # (a timeout, or the host named unreachable)
                t["never"]
            elapsed = time.monotonic() - t0
            killer.join()
            assert 1.2 < elapsed < 2.0 + 0.2 + 0.6, elapsed
            t.detach()
        finally:
            d.destroy()


def test_a_timed_get_many_read_again_keeps_its_first_deadline():
    """A lane's timed ``get_many`` whose host stops answering and then is SIGKILLed (its
    connection breaks) answers a :class:`Resend` of its start, in both sets; the handle
    then reads again by the Python path within the same deadline: the whole read ends
    within its timeout and the slack, with the values once the supervisor restarted the
    host, or the Python path's error; never a second timeout later."""
    from dask_ddict import DDictError
    from tests.support.processes import stop_process

    keys = list(range(50))

    def broken_under(call: Callable[[], Any]) -> tuple[Any, float, float]:
        """``call()`` while the host is stopped, then killed 1 s in: what it gave (or
        raised), when it began and how long it took; the host back after."""
        host = psutil.Process(d.stats[0].pid)
        stop_process(host)
        killer = threading.Timer(1.0, host.kill)
        killer.start()
        t0 = time.monotonic()
        try:
            got: Any = call()
        except DDictError as e:  # (not back within the time: the Python path's error)
            got = e
        elapsed = time.monotonic() - t0
        killer.join()
        poll_for(lambda: _answers(t, keys), 60, "the host restarted")
        return got, t0, elapsed

    with local_cluster(1) as cl, Client(cl) as c:
        d = DDict(total_mem="32 MiB", client=c)
        try:
            h = over_tcp(d)
            h.update({i: i for i in keys})
            t = _timed(h, 4.0)  # (slack 0.2 s)
            assert t.get_many(keys) == keys  # (the lane's, warm)
            for lane in SERVING:
                got, t0, elapsed = broken_under(lambda: lane.get_many(t, keys, ABSENT))
                assert type(got) is Resend and abs(got.began - t0) < 0.1, (lane, got)
                assert 1.0 < elapsed < 4.0, elapsed
            got, _, elapsed = broken_under(lambda: t.get_many(keys))
            assert got == keys or isinstance(got, DDictError)
            assert 1.0 < elapsed < 4.0 + 0.2 + 0.6, elapsed
            t.detach()
            h.detach()
        finally:
            d.destroy()


def _answers(t: DDict, keys: list[Any]) -> bool:
    try:
        return t.get_many(keys) == keys
    except Exception:  # noqa: BLE001 - (not back yet)
        return False


def test_the_lane_keeps_the_pool_bounded_and_whole(client, tcp):
    """Threads on both managers' links through the lane, with fewer kept connections than
    threads: every connection given back is either in the pool and its link's idle list
    (both, or neither) or closed, and the pool never holds more than its bound."""
    keys = [("p", i) for i in range(40)]
    tcp.update({k: i for i, k in enumerate(keys)})
    errors: list[BaseException] = []
    old = IDLE_POOL.most
    with dask.config.set({"ddict.transport.kept-connections": 2}):
        h = over_tcp(tcp)  # (links of its own, which keep the pool at 2)
    try:
        h[keys[0]], h[keys[1]]  # (routed and connected)
        links = {h._core.channel(m).link for m in range(h.num_managers)}

        def run(t: int) -> None:
            try:
                for n in range(300):
                    k = keys[(t * 7 + n) % len(keys)]
                    if n % 3:
                        assert h[k] == keys.index(k)
                    else:
                        h[k] = keys.index(k)
                    with IDLE_POOL.lock:
                        assert len(IDLE_POOL.idle) <= 2
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == []
        with IDLE_POOL.lock:
            pooled = {c for c, link in IDLE_POOL.idle.items() if link in links}
            listed = {c for link in links for c in link.idle}
            assert pooled == listed and 0 < len(pooled) <= 2
            assert all(c.sock.fileno() >= 0 for c in pooled)
    finally:
        IDLE_POOL.most = old
        h.detach()


def test_a_broken_at_most_once_request_is_sent_again_with_its_request_id(tcp):
    """A pop or ``fetch_add`` that a lane sent on a connection that then broke (its host
    read it and closed: it may have applied it) is answered as a :class:`Resend` with
    the request id it went with, never ``NotImplemented`` (which the Python path would
    send with a new id: applied twice); sent again with that id, the host applies it
    once (a fake host here reads the lane's request, then the real one answers).  A
    ``Resend`` is no value a dictionary holds (a handle would misread it)."""
    import socket

    from dask_ddict.errors import DDictSerializationError
    from dask_ddict.transport.bounded_connection import BoundedConnection
    from dask_ddict.transport.protocol import REQ
    from tests.support.one_client import OneClient

    h = tcp.manager(0)
    h["warm"] = 1  # (the link's connections in the pool)
    link = h._core._channels[0].link
    for lane in SERVING:
        for op in ("pop", "fetch_add"):
            rids: list[int] = []

            def behave(conn: socket.socket, host: OneClient) -> None:
                head = REQ.unpack(host.read(conn, REQ.size))
                host.read(conn, head[3] + head[10])
                rids.append(head[11])
                conn.shutdown(socket.SHUT_RDWR)  # (no reply: gone, it may have applied it)

            fake = OneClient(behave)
            sock = socket.create_connection(("127.0.0.1", fake.port))
            IDLE_POOL.give(link, BoundedConnection(sock, None))  # (the next one taken)
            got = lane.pop(h, "k") if op == "pop" else lane.fetch_add(h, "k", 5)
            fake.thread.join(10)
            assert type(got) is Resend and rids and got.rid == rids[0] != 0, (lane, op, got)
            if op == "fetch_add":  # (the fake applied nothing: the real host, once)
                before = h.fetch_add("k", 0)
                mid, digest, kb = h._route("k")
                again = FetchAdd(digest, kb, h._chkpt, h._client_id, 5, None, got.began, got.rid)
                for _ in range(2):  # (the second: answered with the first's kept reply)
                    assert loads_value(h._core.write(mid, again)) == before
                assert h["k"] == before + 5
    with pytest.raises(DDictSerializationError, match="Resend"):
        h["r"] = Resend(1.0, 7)
    h["n"] = NotImplemented  # (a value: the lanes' pop hands it back in a tuple)
    assert h.pop("n") is NotImplemented and "n" not in h


def test_a_timed_resend_that_runs_out_says_it_may_have_been_applied(tcp):
    """A lane's timed ``fetch_add`` sent again by the Python path (a :class:`Resend`), whose
    reconnection then runs out of time, says it may or may not have been applied (the
    lane sent it), never "nothing was sent": a caller told that would send it again
    with a new id."""
    from dask_ddict import DDictTimeoutError
    from dask_ddict.transport.bounded_connection import Deadline

    t = _timed(tcp, 1.0)
    t["warm"] = 1
    mid, digest, kb = t._route("ctr")
    link = t._core._channels[mid].link
    link._broken(None)  # (as the lane's broken connection leaves it)

    def connect(*args: Any) -> Any:
        raise Deadline()  # (a restarting host: no handshake in time)

    link._connect = connect
    try:
        op = FetchAdd(digest, kb, t._chkpt, t._client_id, 1, 1.0, time.monotonic(), 98765)
        with pytest.raises(DDictTimeoutError) as e:
            t._core.write(mid, op)
        assert "nothing was sent" not in str(e.value), e.value
    finally:
        del link._connect
        t.detach()


def test_a_host_killed_under_lane_writers_loses_no_acknowledged_write():
    """Writers and readers (of single keys and ``get_many``s) over TCP (the lane's) while
    the host process of one manager is SIGKILLed and restarted: the lane closes the
    broken connections, the Python path sends again, and every acknowledged write reads
    back."""
    with local_cluster(2) as cl, Client(cl) as c:
        d = DDict(total_mem="64 MiB", client=c)
        try:
            h = over_tcp(d)
            h["warm"] = 1
            acked: list[list[int]] = [[] for _ in range(3)]

            def step(i: int) -> None:
                k = len(acked[i])
                h[(i, k)] = k
                acked[i].append(k)
                assert h[(i, k)] == k
                if k % 5 == 0:  # (a get_many's two links: one may break under it)
                    assert h.get_many([(i, k), "warm", (i, k // 2)]) == [k, 1, k // 2]

            under_a_host_kill(d, step, acked)
            held = dict(d.items())
            for i, ks in enumerate(acked):
                for k in ks:
                    assert held.get((i, k)) == k, f"acknowledged write ({i}, {k}) lost"
            assert LANE.get(h, (0, 0)) == 0  # (the lane serves the new host's connections)
        finally:
            d.destroy()


def test_a_host_killed_under_lane_fetch_adds_applies_each_once():
    """Three threads take tickets (``fetch_add(key, 1)`` over TCP, the lane's) of one
    counter while its manager's host process is SIGKILLed and restarted: a ticket whose
    reply was lost is sent again by the Python path with the lane's request id, and the
    restarted host answers it with the reply it kept, not a second addition; every
    ticket is taken once, and the counter is the number of tickets."""
    with local_cluster(2) as cl, Client(cl) as c:
        d = DDict(total_mem="64 MiB", client=c)
        try:
            h = over_tcp(d).manager(0)
            assert h.fetch_add("tickets", 1) == 0
            taken: list[list[int]] = [[] for _ in range(3)]
            under_a_host_kill(d, lambda i: taken[i].append(h.fetch_add("tickets", 1)), taken)
            tickets = sorted(t for ts in taken for t in ts)
            assert tickets == list(range(1, len(tickets) + 1)), "a ticket taken twice, or lost"
            assert h["tickets"] == len(tickets) + 1
            assert type(LANE.fetch_add(h, "tickets", 0)) is int  # (the new host's: the lane's)
        finally:
            d.destroy()


def test_the_process_lane_is_the_kernels_set():
    assert type(LANE) is kernels.KeyLane
    assert repr(LANE).startswith("<KeyLane")
