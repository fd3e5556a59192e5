"""The host's plain requests served in one call (``kernels.PlainServer``) answer as its
manager.

A host's event loop hands the run of plain requests (gets, ``in``s and puts of one key) at
the head of a connection's buffer to :class:`~dask_ddict.kernels.PlainServer`, which
answers them without a Python object per request; anything else is the server's Python
path, the reference.  Here one host serves three managers of three real shards, each
through a connection of its own: one whose plain requests the compiled server answers,
one the pure server, one the manager's path alone.  Every batch of requests goes to all
three, each to its own manager, and every reply must be the same, byte for byte: the
shards go through the same history.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import struct
import tempfile
import time
import zlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from dask_ddict import kernels
from dask_ddict._hashing import key_digest
from dask_ddict._keys import dumps_key
from dask_ddict._serialize import (
    _HEAD,
    FMT_BYTES,
    FMT_PICKLE,
    FMT_RAW,
    Framed,
    dumps_value,
    loads_value,
)
from dask_ddict.errors import Status
from dask_ddict.host.hosted import HostedDict
from dask_ddict.host.lease import LeaseKeeper
from dask_ddict.host.loop import Connection
from dask_ddict.host.server import HostServer
from dask_ddict.kernels import GROUP, pure
from dask_ddict.layout import ManagerInfo, wire_term
from dask_ddict.shard.generations import Generations, path_for
from dask_ddict.shard.lease_word import lease_clock
from dask_ddict.shard.manager import Manager
from dask_ddict.shard.store import ShardStore
from dask_ddict.shard.working_set import WorkingSet
from dask_ddict.transport import ops
from dask_ddict.transport.many_key_ops import GetMany
from dask_ddict.transport.operation import Operation
from dask_ddict.transport.protocol import FLAG_NOREPLY, FLAG_PERSIST, REP, REQ, SMALL, Op
from dask_ddict.transport.socket_client import HostLink
from tests.support.polling import poll_for
from tests.support.wire import raw as _raw
from tests.support.wire import replies as _replies

try:
    from dask_ddict.kernels import _compiled
except ImportError:  # (a machine without a compiler: test_kernels says so)
    _compiled = None

#: The plain servers compared with the manager's path (``None``): the compiled one with
#: the compiled set's managers (it reads their state from the set's C fields; a manager of
#: the pure set, DASK_DDICT__COMPILED=false, is left to the manager's path).
SERVERS: list[Any] = [None, pure.PlainServer] + (
    [_compiled.PlainServer] if kernels.COMPILED else []
)
KEYS = [f"k{i}" for i in range(6)]
LARGE = 70 << 10  # a value over the largest a plain server sends (the manager's then)
GROUP_COUNT = struct.Struct("<I")  # (a many-key table's count of groups)

#: Requests, each with its header's fields; an operation of several managers is made
#: for the connection's manager (a function of its id).
Batch = list[tuple[Any, dict[str, int]]]


class Shards:
    """A host serving one manager per entry of :data:`SERVERS` (ids 3, 4, ...), each of a
    shard of its own, with the event loop over TCP; one connection to each, its plain
    requests answered by that server."""

    def __init__(self, size: int = 1, wait_for_keys: bool = False, capacity: int = 64 << 20):
        self._made = contextlib.ExitStack()  # (what close() undoes, last made first)
        try:
            self._open(size, wait_for_keys, capacity)
        except BaseException:
            self._made.close()  # (a failed start leaves nothing behind either)
            raise

    def _open(self, size: int, wait_for_keys: bool, capacity: int) -> None:
        made = self._made
        self.dir = tempfile.mkdtemp(prefix="ddict-plain-")
        made.callback(shutil.rmtree, self.dir, ignore_errors=True)
        uid, secret = secrets.token_hex(16), secrets.token_hex(32)
        self.hosted = HostedDict(uid, "plain", secret)
        self.managers: list[Manager] = []
        for i in range(len(SERVERS)):
            path = os.path.join(self.dir, f"shard{i}")
            store = ShardStore(path, capacity, indexed=wait_for_keys)
            m = Manager(3 + i, store, WorkingSet(store, size, wait_for_keys=wait_for_keys))
            made.callback(m.close)
            self.hosted.managers[3 + i] = m
            self.managers.append(m)
        self.uds = made.enter_context(socket.socket(socket.AF_UNIX))
        self.uds.bind(os.path.join(self.dir, "host.sock"))
        self.uds.listen(16)
        self.tcp = made.enter_context(socket.create_server(("127.0.0.1", 0)))
        self.server = HostServer(
            self.uds, self.tcp, {self.hosted.key: self.hosted}, set(), event_loop=True
        )
        made.callback(self.server.close)
        self.server.start()
        info = ManagerInfo(
            3,
            "w",
            "h",
            "h:b",
            os.getpid(),
            os.path.join(self.dir, "host.sock"),
            "127.0.0.1",
            self.tcp.getsockname()[1],
            os.path.join(self.dir, "shard0"),
        )
        self.link = HostLink(info, uid, secret, "plain", use_uds=False)
        made.callback(self.link.close)
        self.socks: list[socket.socket] = []
        self.plain: list[Any] = []
        for cls in SERVERS:
            sock = made.enter_context(self.link._connect(3, None, None).sock)
            c = self._served(sock)
            c.plain = None if cls is None else cls(c, self.server._plain)
            self.socks.append(sock)
            self.plain.append(c.plain)

    def _served(self, sock: socket.socket) -> Connection:
        """The host's end of ``sock``, once the event loop serves it."""
        me = sock.getsockname()

        def found() -> Connection | None:
            for c in list(self.server.loop._conns.values()):  # type: ignore[union-attr]
                if c.sock.getpeername() == me:
                    return c
            return None

        return poll_for(found, 30, "the host's end of a connection in its event loop", 0.01)

    def same(self, requests: Batch) -> list:
        """Every connection's replies to ``requests`` (each to its own manager, in one send,
        tags from 1): the same; they."""
        got = []
        for i, sock in enumerate(self.socks):
            sock.sendall(
                b"".join(
                    _raw(o(3 + i) if callable(o) else o, t + 1, mid=3 + i, **kw)
                    for t, (o, kw) in enumerate(requests)
                )
            )
            said = f"manager {3 + i} ".encode()  # (errors name their manager)
            got.append(
                [
                    (s, t, n, p.replace(said, b"manager 3 "))
                    for s, t, n, p in _replies(sock, len(requests))
                ]
            )
        assert all(g == got[0] for g in got), list(zip(SERVERS, got, strict=True))
        return got[0]

    def same_contents(self) -> None:
        """Every shard holds the same keys and values, counts and kept replies (its data
        and meta tables, but the manager's id)."""
        seen = []
        for m in self.managers:
            store = m.store
            with store.read() as txn:
                tables = [
                    [(bytes(k), bytes(v)) for k, v in txn.cursor(db).iternext()]
                    for db in (store._data, store.meta_db)
                ]
            tables[1] = [(k, v) for k, v in tables[1] if k != b"manager"]
            seen.append(tables)
        assert all(t == seen[0] for t in seen), list(zip(SERVERS, seen, strict=True))

    def counts(self) -> list[int]:
        """Requests the plain servers answered, so far."""
        return [p.count for p in self.plain if p is not None]

    def close(self) -> None:
        self._made.close()


def _digest(key: str) -> bytes:
    return key_digest(dumps_key(key))


def _span(value: Any) -> tuple[int, int]:
    """A byte range's bounds drawn from a request's value: from either end, past the
    end, empty and reversed ones among them."""
    if value == "large":
        return LARGE - 9, -2
    n = value if isinstance(value, int) else len(value) * 7 - 40
    return n % 23 - 11, n % 19 - 4


def _put(key: str, value: Any, chkpt: int) -> ops.Put:
    kb = dumps_key(key)
    return ops.Put(key_digest(kb), kb, dumps_value(value), chkpt, 1)


#: Ints whose pickles differ in form (BININT1, BININT2, BININT, LONG1), at the edges of
#: 64 bits (a ``fetch_add`` past them is the manager's).
EDGES = [0, 255, 256, 65535, 65536, -1, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1]
EDGES += [2**63 - 1, -(2**63), 2**40 + 7, -(2**48)]

_request = st.tuples(
    st.sampled_from(
        ["get", "get", "in", "put", "put", "persist", "pop", "len", "newest", "many", "many2"]
        + ["range", "range", "pop", "add", "add", "add"]
    ),
    st.sampled_from(KEYS),
    st.one_of(st.integers(-1, 6), st.just("newest")),
    st.one_of(
        st.integers(-(2**40), 2**40),
        st.sampled_from(EDGES),
        st.booleans(),
        st.binary(max_size=40),
        st.just("large"),
    ),
    st.sampled_from([0, 0, 0, 1, 2]),  # the term: none, this one, another
)


def _rid(value: Any) -> int:
    """An at-most-once request's id drawn from its value: none, or one of a few (a request
    id seen before is a resend: the reply kept of its first is the answer)."""
    return zlib.crc32(repr(value).encode()) % 7


class ThreeServers(RuleBasedStateMachine):
    """Batches of requests (plain ones, ones the loop leaves to the manager among them,
    puts that move the window, large values, pops, terms right and wrong) get the same
    replies from every server, and the shards the same contents."""

    size = 1

    def __init__(self) -> None:
        super().__init__()
        self.shards = Shards(self.size)

    @rule(requests=st.lists(_request, min_size=1, max_size=8))
    def batch(self, requests: list[tuple[str, str, Any, Any, int]]) -> None:
        m = self.shards.managers[0]
        term = {0: 0, 1: m.wire, 2: wire_term(m.term + 1)}
        batch: Batch = []
        for what, key, chkpt, value, t in requests:
            c = m.working_set.newest if chkpt == "newest" else chkpt
            v = b"x" * LARGE if value == "large" else value
            o: Operation = {
                "get": lambda: ops.Get(_digest(key), c),
                "in": lambda: ops.Contains(_digest(key), c),
                "put": lambda: _put(key, v, max(c, 0)),
                "persist": lambda: _put(key, v, max(c, 0)),
                "pop": lambda: ops.Pop(_digest(key), max(c, 0), 1),
                "add": lambda: ops.FetchAdd(
                    _digest(key), dumps_key(key), max(c, 0), 1, v if type(v) is int else 1
                ),
                "len": lambda: ops.Length(max(c, 0)),
                "newest": lambda: ops.Newest(),
                "range": lambda: ops.GetRange(_digest(key), c, *_span(value)),
                "many": lambda: lambda mid: GetMany(((mid, [_digest(k) for k in KEYS]),), c),
                "many2": lambda: (
                    lambda mid: GetMany(
                        ((mid, [_digest(key)]), (mid, [_digest(k) for k in KEYS[::-1]])), c
                    )
                ),
            }[what]()
            kw = {"term": term[t]} if what in ("get", "in", "put", "range", "pop", "add") else {}
            if what == "persist":
                kw["flags"] = FLAG_PERSIST
            if what in ("pop", "add"):
                kw["rid"] = _rid(value)
            batch.append((o, kw))
        self.shards.same(batch)
        self.shards.same_contents()

    @precondition(lambda self: _compiled is not None)
    @rule(put=st.booleans())
    def the_plain_servers_served_what_they_could(self, put: bool) -> None:
        """A small put at the window's newest checkpoint (in a window of one) and a get of
        it are the plain servers', not the manager's."""
        newest = self.shards.managers[0].working_set.newest
        self.shards.same([(_put("small", newest, newest), {})])  # (the manager counts the room)
        before = self.shards.counts()
        writes = [(_put("small", newest, newest), {})] if put else []
        many = (lambda mid: GetMany(((mid, [_digest("small"), _digest("never")]),), newest), {})
        self.shards.same([*writes, (ops.Get(_digest("small"), newest), {}), many])
        served = 2 + (put and self.size == 1)
        assert [a - b for a, b in zip(self.shards.counts(), before, strict=True)] == [served] * (
            len(SERVERS) - 1
        )

    def teardown(self) -> None:
        self.shards.close()


class ThreeServersWindowOfTwo(ThreeServers):
    size = 2


for machine in (ThreeServers, ThreeServersWindowOfTwo):
    machine.TestCase.settings = settings(max_examples=20, stateful_step_count=12, deadline=None)
test_three_servers_window_of_one = ThreeServers.TestCase
test_three_servers_window_of_two = ThreeServersWindowOfTwo.TestCase


@pytest.fixture
def shards():
    s = Shards()
    yield s
    s.close()


def test_what_only_the_manager_answers_is_left_to_it(shards):
    """A read at a retired checkpoint, under another term, of a value over the largest a
    plain server sends, with a flag, a put at another checkpoint, or to a frozen or closed
    manager: no plain server answers it (their counts stay), and every connection gets the
    manager's answer."""
    for chkpt in range(4):  # (the window moves to [3])
        shards.same([(_put("a", chkpt, chkpt), {}), (_put("big", b"x" * LARGE, chkpt), {})])
    before = shards.counts()
    retired = shards.same([(ops.Get(_digest("a"), 0), {}), (ops.Contains(_digest("a"), 1), {})])
    assert [st for st, *_ in retired] == [int(Status.CHECKPOINT_RETIRED)] * 2
    other = shards.same([(ops.Get(_digest("a"), 3), {"term": wire_term(7)})])
    assert other[0][0] == int(Status.LEASE)
    large = shards.same([(ops.Get(_digest("big"), 3), {})])
    assert large[0][0] == 0 and len(large[0][3]) > LARGE
    assert shards.counts() == before
    seen = shards.same([(ops.Contains(_digest("big"), 3), {})])  # (its flags alone: plain)
    assert seen[0][2] == 1
    before = [b + 1 for b in before]
    assert shards.same([(_put("b", 1, 5), {})])[0][0] == 0  # (the window moves: the manager's)
    assert shards.counts() == before
    served = shards.same([(ops.Get(_digest("a"), 5), {}), (ops.Get(_digest("none"), 5), {})])
    assert served[0][0] == 0 and served[1][0] == int(Status.KEY_NOT_FOUND)
    assert shards.counts() == [b + 2 for b in before]
    shards.same([(ops.Get(_digest("a"), 5), {"flags": FLAG_NOREPLY})])  # (the manager's)
    elsewhere = shards.same([(GetMany(((99, [_digest("a")]),), 5), {})])  # (not hosted here)
    assert elsewhere[0][0] == int(Status.MANAGER_UNAVAILABLE)
    big = shards.same([(lambda mid: GetMany(((mid, [_digest("a"), _digest("big")]),), 5), {})])
    assert big[0][0] == 0 and len(big[0][3]) > LARGE  # (a value of JOIN bytes or more)
    for m in shards.managers:
        m.freeze()
    frozen = shards.same([(_put("a", 2, 5), {})])
    assert frozen[0][0] != 0
    assert shards.counts() == [b + 2 for b in before]
    for m in shards.managers:
        m.close(destroy=False)
    closed = shards.same([(ops.Get(_digest("a"), 5), {})])
    assert closed[0][0] != 0
    assert shards.counts() == [b + 2 for b in before]


def _more(before: list[int], pure_n: int, compiled_n: int) -> list[int]:
    """The plain servers' counts after ``before``: ``pure_n`` more for the pure one,
    ``compiled_n`` for the compiled one."""
    served = [s for s in SERVERS if s is not None]
    return [
        b + (pure_n if s is pure.PlainServer else compiled_n)
        for b, s in zip(before, served, strict=True)
    ]


def _add(key: str, n: int, chkpt: int = 0) -> ops.FetchAdd:
    return ops.FetchAdd(_digest(key), dumps_key(key), chkpt, 1, n)


def test_pops_and_fetch_adds_are_plain_and_kept_as_the_manager_keeps_them(shards):
    """A ``pop`` or ``fetch_add`` at the window's checkpoint of a key whose only version is
    there, or absent, is the plain servers' (an absent key's pop the compiled one's), its
    reply kept under its request id in the same transaction, byte for byte as the
    manager keeps it; a resend of a request id, a value that is not an int of 64 bits (a
    bool, bytes, a sum past 64 bits), a reply kept until read (a popped value over
    ``BIG_REPLY`` bytes) or one over the largest a plain server sends are the manager's.
    A connection whose last at-most-once reply was the manager's is the plain servers'
    again once that reply is settled (a small one), not while a large one is kept."""
    puts = [(_put(f"i{n}", n, 0), {}) for n in (5, 300, 70000, -5, 2**40, 2**31)]
    shards.same(puts + [(_put("t", True, 0), {}), (_put("b", b"xy", 0), {})])
    shards.same([(_put("top", 2**63 - 1, 0), {}), (_put("big", b"x" * 5000, 0), {})])
    shards.same([(_put("huge", b"x" * LARGE, 0), {})])
    before = shards.counts()
    adds = [(_add(f"i{n}", 3), {"rid": 10 + i}) for i, n in enumerate((5, 300, 70000))]
    adds += [(_add(f"i{n}", -(2**41)), {"rid": 20 + i}) for i, n in enumerate((-5, 2**40, 2**31))]
    adds += [(_add("new", -7), {"rid": 30}), (_add("new", 2), {}), (_add("low", -(2**63)), {})]
    got = shards.same(adds)
    assert [loads_value(p) for *_, p in got] == [5, 300, 70000, -5, 2**40, 2**31, 0, -7, 0]
    assert shards.counts() == [b + 9 for b in before]
    shards.same_contents()
    values = shards.same([(ops.Get(_digest(k), 0), {}) for k in ("i5", "i-5", "new", "low")])
    assert [loads_value(p) for *_, p in values] == [8, -(2**41) - 5, -5, -(2**63)]
    stores = [m.store for m in shards.managers]  # (each added what the manager's path adds)
    assert {s._used_estimate for s in stores} == {stores[0]._used_estimate}

    before = shards.counts()
    again = shards.same([(_add("i5", 100), {"rid": 10})])  # (a resend: its first reply)
    assert loads_value(again[0][3]) == 5 and shards.counts() == before
    for key in ("t", "b", "top"):  # (refused, refused; past 64 bits: the pure one's too)
        shards.same([(_add(key, 1), {"rid": 40 + len(key)})])
    assert shards.counts() == _more(before, 1, 0)
    assert loads_value(shards.same([(ops.Get(_digest("top"), 0), {})])[0][3]) == 2**63
    shards.same_contents()

    before = shards.counts()
    pops = shards.same(
        [(ops.Pop(_digest("i300"), 0, 1), {"rid": 50}), (ops.Pop(_digest("i-5"), 0, 1), {})]
        + [(ops.Pop(_digest("never"), 0, 1), {"rid": 51})]
    )
    assert [loads_value(p) for *_, p in pops[:2]] == [303, -(2**41) - 5]
    assert pops[2][0] == int(Status.KEY_NOT_FOUND)
    assert shards.counts() == _more(before, 2, 3)  # (an absent key: the compiled one's)
    shards.same_contents()
    before = shards.counts()
    resent = shards.same([(ops.Pop(_digest("i300"), 0, 1), {"rid": 50})])
    assert loads_value(resent[0][3]) == 303 and shards.counts() == before

    big = shards.same([(ops.Pop(_digest("big"), 0, 1), {"rid": 60})])  # (kept until read)
    assert len(big[0][3]) > pure.BIG_REPLY and shards.counts() == before
    shards.same([(ops.Get(_digest("i70000"), 0), {})])  # (the delivery: the server's)
    assert shards.counts() == before
    shards.same([(ops.Pop(_digest("huge"), 0, 1), {})])  # (over the largest sent: in parts)
    shards.same([(ops.Pop(_digest("i70000"), 0, 1), {"rid": 61})])  # (settled: plain)
    assert shards.counts() == [b + 1 for b in before]
    shards.same_contents()


def test_kept_replies_wrap_around_their_ring_as_the_managers_do(shards):
    """Past ``RID_KEEP`` request ids, each new reply takes the oldest one's slot (its reply
    dropped): the plain servers' rings wrap as the manager's, and a resend of an id that
    fell out is applied again, one still kept is not."""
    before = shards.counts()
    n = pure.RID_KEEP + 5
    for at in range(0, n, 500):
        shards.same([(_add("c", 1), {"rid": 1 + i}) for i in range(at, min(n, at + 500))])
    # (all of them plain but those split across receives: the manager's path reads them)
    assert all(a - b >= n - 20 for a, b in zip(shards.counts(), before, strict=True))
    shards.same_contents()
    with shards.managers[0].store.read() as txn:
        kept = [k for k, _ in txn.cursor(shards.managers[0].store.meta_db) if k[:4] == pure.RID]
    assert len(kept) == pure.RID_KEEP
    again = shards.same([(_add("c", 1), {"rid": 1}), (_add("c", 1), {"rid": n})])
    assert [loads_value(p) for *_, p in again] == [n, n - 1]  # (applied again; kept)
    shards.same_contents()


def test_a_put_whose_manager_is_busy_is_the_managers(shards):
    """While another thread holds a manager's lock (a write of its own), a plain put is not
    written by the plain server: the manager's path waits for the lock, then writes it.
    The loop is handed on to another thread for each: the connections whose requests came
    with the same wake-up (received already) are served by the next one."""
    before = shards.counts()
    for m in shards.managers:
        m._mutex.acquire()
    batch = [(_put("a", 1, 0), {}), (ops.Get(_digest("a"), 0), {})]
    try:
        for i, sock in enumerate(shards.socks):
            sock.sendall(b"".join(_raw(o, t + 1, mid=3 + i) for t, (o, _) in enumerate(batch)))
        poll_for(
            lambda: shards.server.loop.handoffs >= len(SERVERS), 30, "every put waits for its lock"
        )
    finally:
        for m in shards.managers:
            m._mutex.release()
    got = [_replies(sock, 2) for sock in shards.socks]
    assert all([st for st, *_ in g] == [0, 0] for g in got), got
    assert all(g[1][3] == got[0][1][3] for g in got)
    assert shards.counts() == before  # (neither the put nor the get after it: the manager's)


def test_byte_ranges_of_raw_bytes_values_are_the_plain_servers(shards):
    """A byte range (``GetRange``: the size, and ``value[start:stop]``) of a raw-bytes
    value is answered by the plain servers as the manager answers it, a large value's
    too (only its part is sent, and read); a pickled value's (the manager's error), and a
    part larger than a plain server sends, are the manager's."""
    big = bytes(range(256)) * ((LARGE >> 8) + 1)
    shards.same([(_put("raw", b"0123456789", 0), {}), (_put("big", big, 0), {})])
    shards.same([(_put("pickled", 12345, 0), {})])
    before = shards.counts()
    spans = [(2, 5), (-3, 99), (0, 0), (7, 2), (-99, -8), (0, 10)]
    got = shards.same([(ops.GetRange(_digest("raw"), 0, a, b), {}) for a, b in spans])
    assert [(s, n, p) for s, _, n, p in got] == [(0, 10, b"0123456789"[a:b]) for a, b in spans]
    got = shards.same([(ops.GetRange(_digest("big"), 0, -300, -44), {})])
    assert got[0][2:] == (len(big), big[-300:-44])
    missing = shards.same([(ops.GetRange(_digest("nothing"), 0, 0, 2), {})])
    assert missing[0][0] == int(Status.KEY_NOT_FOUND)
    assert shards.counts() == [b + len(spans) + 2 for b in before]
    pickled = shards.same([(ops.GetRange(_digest("pickled"), 0, 0, 2), {})])
    assert pickled[0][0] == int(Status.SERIALIZATION)
    whole = shards.same([(ops.GetRange(_digest("big"), 0, 0, len(big)), {})])
    assert whole[0][2:] == (len(big), big)
    assert shards.counts() == [b + len(spans) + 2 for b in before]  # (the manager's)


#: Bounds of a byte range: the ends of 64 bits, around a short value's length, and past
#: 64 bits (which the client clamps).
EDGES = [-(2**63), -(2**62), -1000, -11, -10, -1, 0, 1, 9, 10, 11, 2**63 - 1, 2**70, -(2**70)]


def _framed(key: str, frame: bytes, chkpt: int = 0) -> ops.Put:
    """A put of ``frame`` as it is (a frame the client never makes, among them)."""
    kb = dumps_key(key)
    return ops.Put(key_digest(kb), kb, Framed([frame], len(frame)), chkpt, 1)


def test_byte_ranges_of_any_frame_and_bounds_are_the_managers_answers(shards):
    """Every bound at the edges of 64 bits, of every frame a shard may hold (a declared
    payload longer or shorter than the frame, of 2**63 and 2**64 - 1 bytes, no payload,
    frames shorter than their head, raw buffers, pickles, an unknown format): the same
    answers from every server; the plain servers answer the raw-bytes frames' (whole
    heads) and leave the others to the manager."""
    payload = b"0123456789"
    frames = {
        "raw": _HEAD.pack(FMT_BYTES, 0, 10) + payload,
        "longer": _HEAD.pack(FMT_BYTES, 0, 50) + payload,
        "huge": _HEAD.pack(FMT_BYTES, 0, 2**64 - 1) + payload,
        "sign": _HEAD.pack(FMT_BYTES, 0, 2**63) + payload,
        "shorter": _HEAD.pack(FMT_BYTES, 0, 4) + payload,
        "none": _HEAD.pack(FMT_BYTES, 0, 0),
        "buffers": _HEAD.pack(FMT_BYTES, 3, 10) + payload,
        "short": bytes([FMT_BYTES]) + bytes(7),
        "empty": b"",
        "rawbuffer": _HEAD.pack(FMT_RAW, 0, 10) + payload,
        "pickle": _HEAD.pack(FMT_PICKLE, 0, 10) + payload,
        "unknown": _HEAD.pack(9, 0, 10) + payload,
    }
    shards.same([(_framed(k, f), {}) for k, f in frames.items()])
    plain = [k for k, f in frames.items() if len(f) >= _HEAD.size and f[0] == FMT_BYTES]
    before = shards.counts()
    asked = [(k, a, b) for k in frames for a in EDGES for b in EDGES]
    for i in range(0, len(asked), 250):
        shards.same([(ops.GetRange(_digest(k), 0, a, b), {}) for k, a, b in asked[i : i + 250]])
    served = sum(k in plain for k, _, _ in asked)
    assert shards.counts() == [b + served for b in before]


def test_a_byte_range_split_across_receives_and_at_the_largest_part(shards):
    """A range whose bounds arrive in a later receive than its header is answered once
    whole; a part of exactly the largest a plain server sends is the plain servers', one
    byte more the manager's."""
    value = bytes(range(256)) * 1024  # (256 KiB)
    shards.same([(_put("v", value, 0), {})])
    before = shards.counts()
    outs = []
    for i, sock in enumerate(shards.socks):
        data = b"".join(
            _raw(ops.GetRange(_digest("v"), 0, 2, 9), t + 1, mid=3 + i) for t in range(3)
        )
        cut = len(data) // 3 + REQ.size + 16 + 4  # (inside the second one's bounds)
        sock.sendall(data[:cut])
        time.sleep(0.2)
        sock.sendall(data[cut:])
        outs.append(_replies(sock, 3))
    assert all(o == outs[0] for o in outs)
    assert [(s, n, p) for s, _, n, p in outs[0]] == [(0, len(value), value[2:9])] * 3
    most = SMALL
    got = shards.same(
        [
            (ops.GetRange(_digest("v"), 0, 5, 5 + most), {}),
            (ops.GetRange(_digest("v"), 0, 5, 6 + most), {}),
        ]
    )
    assert [p for *_, p in got] == [value[5 : 5 + most], value[5 : 6 + most]]
    assert shards.counts() == [b + 4 for b in before]  # (3 split, the largest part)


def test_plain_puts_keep_the_key_counts(shards):
    """Plain puts of new keys and of keys already there count each key once: ``len`` is
    the manager's count of the shard, and the same as if the manager had put them."""
    shards.same([(_put("first", 0, 0), {})])  # (the first write of a shard: the manager's)
    before = shards.counts()
    batch: Batch = [(_put(f"n{i % 7}", i, 0), {}) for i in range(20)]
    shards.same(batch)
    assert shards.counts() == [b + 20 for b in before]
    ((_, _, n, _),) = shards.same([(ops.Length(0), {})])
    assert n == 8
    for m in shards.managers:
        assert m.length(0) == 8


def test_plain_puts_keep_the_room_estimate_and_the_next_transaction(shards):
    """A plain put adds what the manager's path adds to its store's running room estimate
    and notes its transaction as the store's own (the compiled server writes both as C
    fields, ``kernels.StoreState``): the shards' room checks stay the same after them.  The
    compiled server writes a run of puts received together in one transaction (a group);
    the pure one, the reference, one transaction each."""
    shards.same([(_put("first", 0, 0), {})])  # (the first write of a shard: the manager's)
    before = shards.counts()
    stores = [m.store for m in shards.managers]
    first = [s._next_own for s in stores]
    shards.same([(_put(f"r{i % 5}", b"x" * (i * 37), 0), {}) for i in range(12)])
    assert shards.counts() == [b + 12 for b in before]
    assert {s._used_estimate for s in stores} == {stores[0]._used_estimate}
    assert stores[0]._used_estimate > 12 * 64
    transactions = [s._next_own - f for s, f in zip(stores, first, strict=True)]
    assert transactions[:2] == [12, 12]  # (the manager's path, the pure server: one each)
    assert transactions[2:] == [1] * (len(SERVERS) - 2)  # (the compiled server: one group)
    for store in stores:
        txn = store.env.begin(write=True)  # (the next one is the store's own)
        try:
            assert txn.id() == store._next_own
        finally:
            txn.abort()


def test_a_group_of_puts_that_fills_the_shard_is_the_managers_from_its_first():
    """A run of puts that LMDB refuses part way (the map full, the room estimate let
    through) is dropped whole: no reply of it was sent, and the manager's path serves it
    from its first put on, as it serves a run of puts one by one.  Every server answers
    the same, and every put acknowledged is there."""
    shards = Shards(capacity=1 << 20)
    try:
        for m in shards.managers:
            m.store.full_thresh = 1e6  # (the estimate never refuses: LMDB does)
        shards.same([(_put("first", 0, 0), {})])  # (the first write of a shard: the manager's)
        value = b"v" * (2 << 10)  # (a recv's worth of puts is one group)
        got = shards.same([(_put(f"f{i}", value, 0), {}) for i in range(900)])
        ok = [i for i, (status, *_) in enumerate(got) if status == 0]
        assert 0 < len(ok) < 900 and ok == list(range(len(ok))), [g[0] for g in got]
        assert all(p.dropped for p in shards.plain[2:]), "no group dropped"  # (compiled)
        assert all(status == int(Status.POOL_FULL) for status, *_ in got[len(ok) :]), got[-1]
        kept = shards.same([(ops.Get(_digest(f"f{i}"), 0), {}) for i in ok])
        assert {status for status, *_ in kept} == {0}
        assert all(value in payload for *_, payload in kept)
    finally:
        shards.close()


def test_every_plain_put_gives_its_manager_a_new_generation_word(shards, tmp_path):
    """The host's commit hook (``kernels.GenerationBump``, of either set) runs after every
    put, the plain servers' as the manager's path's: a same-host reader's kept answers
    are never kept past a change (``shard.generations``)."""
    gens = Generations(path_for(str(tmp_path), "ef" * 16), 3 + len(SERVERS), create=True)
    try:
        for i, m in enumerate(shards.managers):
            m.store.on_commit = (pure.GenerationBump if i % 2 else kernels.GenerationBump)(
                gens, 3 + i
            )
        shards.same([(_put("first", 0, 0), {})])  # (the first write of a shard: the manager's)
        before = shards.counts()
        seen: list[set[int]] = [set() for _ in SERVERS]
        for n in range(5):
            shards.same([(_put(f"g{n % 2}", n, 0), {})])
            for i in range(len(SERVERS)):
                word = gens.get(3 + i)
                assert word > 0 and word % 2 and word not in seen[i], (i, word, seen[i])
                seen[i].add(word)
        assert shards.counts() == [b + 5 for b in before]  # (the plain servers' puts)
        assert gens.get(0) == gens.get(1) == gens.get(2) == 0
    finally:
        for m in shards.managers:
            m.store.on_commit = None
        gens.close()


def test_a_put_near_a_full_shard_is_the_managers(shards):
    """A put that the running estimate of the shard's room does not clear is left by the
    compiled server to the manager, which counts the shard's pages (as the pure server's
    ``put_alone`` does) and refuses it if it does not fit."""
    shards.same([(_put("first", 0, 0), {})])  # (the first write of a shard: the manager's)
    before = shards.counts()
    for m in shards.managers:
        m.store._used_estimate = int(m.store.full_thresh * m.store.capacity)
    got = shards.same([(_put("a", 1, 0), {})])
    assert got[0][0] == 0
    assert shards.counts()[1:] == before[1:]  # (the compiled server's: left to the manager)
    assert shards.same([(_put("a", 2, 0), {})])[0][0] == 0
    assert shards.counts()[1:] == [b + 1 for b in before[1:]]  # (the estimate is exact again)


@pytest.mark.parametrize("valid", [True, False])
def test_a_leased_dictionarys_reads_are_served_while_its_lease_holds(shards, valid):
    """A leased dictionary (a replicated primary here) is read by the plain servers while
    the host's lease holds; its puts (shipped to replicas first) and everything once the
    lease lapsed are the manager's path's, which refuses them with ``LEASE``."""
    shards.same([(_put("first", 0, 0), {}), (_put("a", 1, 0), {})])
    lease = LeaseKeeper("tcp://127.0.0.1:9", "tcp://127.0.0.1:9", None, None, None)  # type: ignore[arg-type]
    lease.until = lease_clock() + (600.0 if valid else -1.0)
    shards.hosted.lease, shards.hosted.leased = lease, True
    before = shards.counts()
    got = shards.same([(ops.Get(_digest("a"), 0), {}), (_put("a", 2, 0), {})])
    if valid:
        assert [st for st, *_ in got] == [0, 0]
        assert shards.counts() == [b + 1 for b in before]  # (the read, not the put)
    else:
        assert [st for st, *_ in got] == [int(Status.LEASE)] * 2
        assert shards.counts() == before
    shards.hosted.lease = None  # (leased without a lease: the server's path, as ever)
    assert shards.same([(ops.Contains(_digest("a"), 0), {})])[0][0] != 0
    assert shards.counts() == ([b + 1 for b in before] if valid else before)


def test_wait_for_keys_requests_are_the_managers():
    """Under ``wait_for_keys`` a read may wait for its writer: every request is the
    manager's, and the replies are the same."""
    s = Shards(wait_for_keys=True)
    try:
        s.same([(_put("a", 1, 0), {})])
        before = s.counts()
        s.same([(ops.Get(_digest("a"), 0), {}), (ops.Contains(_digest("b"), 0), {})])
        assert s.counts() == before
    finally:
        s.close()


def test_the_package_serves_plain_requests_with_its_kernel_set():
    """The host's connections get the chosen set's plain server."""
    expected = _compiled.PlainServer if kernels.COMPILED else pure.PlainServer
    assert kernels.PlainServer is expected


def _table(mid: int, digests: list[bytes], cut: int) -> bytes:
    """A many-key read's value for ``digests`` of ``mid`` (``cut``: bytes dropped from its
    end, or added when negative: one that does not add up)."""
    value = GROUP_COUNT.pack(1) + GROUP.pack(mid, len(digests)) + b"".join(digests)
    return value[: len(value) - cut] if cut > 0 else value + b"\0" * -cut


_fuzzed = st.lists(
    st.tuples(
        st.sampled_from(
            [int(Op.GET), int(Op.CONTAINS), int(Op.PUT), int(Op.GET_MANY), int(Op.GET_RANGE)]
            + [int(Op.LEN), 99]
        ),
        st.sampled_from([0, 0, 0, FLAG_PERSIST, FLAG_NOREPLY, 255]),  # flags
        st.sampled_from([0, 0, 0, 1, 65535]),  # term
        st.sampled_from([None, None, 99]),  # manager: the connection's, or not hosted
        st.integers(-2, 2),  # checkpoint
        st.sampled_from([0, 0, 0, 7]),  # request id
        st.one_of(
            st.binary(min_size=16, max_size=16),
            st.binary(max_size=40),
            st.tuples(st.sampled_from(KEYS), st.binary(min_size=16, max_size=16)),
        ),  # key section: a digest, anything, or a stored key's digest and a range's bounds
        st.one_of(
            st.binary(max_size=60),
            st.tuples(
                st.lists(st.binary(min_size=16, max_size=16), max_size=4), st.integers(-3, 3)
            ),
        ),  # value: bytes, or a many-key table of the connection's manager, cut or padded
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(requests=_fuzzed)
def test_fuzzed_requests_get_the_same_answers_from_every_server(requests):
    """Requests with every field drawn (flags, terms, request ids, key sections of any
    length, values, many-key tables that do not add up, managers not hosted, operations
    that do not exist), each framed whole: every connection gets the same replies, or
    is dropped at the same point, and the host serves on."""
    s = Shards()
    try:
        s.same([(_put(KEYS[0], b"0123456789" * 3, 0), {}), (_put(KEYS[1], 12345, 0), {})])
        got = []
        for i, sock in enumerate(s.socks):
            own = 3 + i
            data = b""
            for t, (op, flags, term, mid, chkpt, rid, keysec, value) in enumerate(requests):
                if isinstance(value, tuple):
                    value = _table(own, *value)
                if isinstance(keysec, tuple):
                    keysec = _digest(keysec[0]) + keysec[1]
                data += (
                    REQ.pack(
                        op,
                        flags,
                        term,
                        len(keysec),
                        own if mid is None else mid,
                        t + 1,
                        chkpt,
                        0,
                        1,
                        -1.0,
                        len(value),
                        rid,
                    )
                    + keysec
                    + value
                )
            data += _raw(ops.Newest(), 1000, mid=own)  # (the end: its reply says all came)
            sock.sendall(data)
            got.append(_until(sock, 1000, f"manager {own} ".encode()))
        assert all(g == got[0] for g in got), list(zip(SERVERS, got, strict=True))
        fresh = s.link._connect(3, None, None).sock  # (the host serves on)
        try:
            fresh.sendall(_raw(ops.Newest(), 1, mid=3))
            assert _replies(fresh, 1)[0][0] == 0
        finally:
            fresh.close()
    finally:
        s.close()


def _until(sock: socket.socket, last: int, said: bytes) -> list[Any]:
    """The replies on ``sock`` up to the one tagged ``last``, or to the end of the stream
    (then ``"closed"`` last); ``said`` (a manager's name in errors) made common."""
    sock.settimeout(30)
    data, out = b"", []
    while True:
        while len(data) >= REP.size:
            status, tag, ival, plen = REP.unpack_from(data)
            if len(data) < REP.size + plen:
                break
            out.append((status, tag, ival, data[REP.size : REP.size + plen].replace(said, b"M ")))
            data = data[REP.size + plen :]
            if tag == last:
                return out
        try:
            chunk = sock.recv(1 << 20)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return [*out, "closed"]
        data += chunk
