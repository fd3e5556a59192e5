"""The host's plain reads served in one call (``kernels.ReadServer``) answer as its manager.

A host's event loop hands the run of plain reads (gets and ``in``) at the head of a
connection's buffer to :class:`~dask_ddict.kernels.ReadServer`, which answers them
without a Python object per request; anything else is the server's Python path, the
reference.  Here one real shard is served over three TCP connections at once: one
whose reads the compiled server answers, one the pure server, one the manager's path
alone; every batch of requests goes to all three and every reply must be the same, byte
for byte, while a writer changes the shard between batches.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from dask_ddict import kernels
from dask_ddict._hashing import key_digest
from dask_ddict._keys import dumps_key
from dask_ddict._serialize import dumps_value
from dask_ddict.errors import Status
from dask_ddict.host.hosted import HostedDict
from dask_ddict.host.loop import Connection
from dask_ddict.host.server import _PLAIN_READS, HostServer
from dask_ddict.kernels import pure
from dask_ddict.layout import ManagerInfo, wire_term
from dask_ddict.shard.manager import Manager
from dask_ddict.shard.store import ShardStore
from dask_ddict.shard.working_set import WorkingSet
from dask_ddict.transport import ops
from dask_ddict.transport.operation import Operation
from dask_ddict.transport.protocol import FLAG_NOREPLY
from dask_ddict.transport.socket_client import HostLink
from tests.support.polling import poll_for
from tests.support.wire import raw as _raw
from tests.support.wire import replies as _replies

try:
    from dask_ddict.kernels import _compiled
except ImportError:  # (a machine without a compiler: test_kernels says so)
    _compiled = None

#: The read servers compared with the manager's path (``None``).
SERVERS: list[Any] = [pure.ReadServer, None] + ([] if _compiled is None else [_compiled.ReadServer])
KEYS = [f"k{i}" for i in range(6)]
LARGE = 70 << 10  # a value over the largest a read server sends (the manager's then)


class Shard:
    """One manager (id 3) of a real shard, served with the event loop over TCP; one
    connection per entry of :data:`SERVERS`, its plain reads answered by that server,
    and a writer's connection."""

    def __init__(self, size: int = 2, wait_for_keys: bool = False) -> None:
        self.dir = tempfile.mkdtemp(prefix="ddict-reads-")
        uid, secret = secrets.token_hex(16), secrets.token_hex(32)
        store = ShardStore(os.path.join(self.dir, "shard"), 64 << 20, indexed=wait_for_keys)
        self.hosted = HostedDict(uid, "reads", secret)
        self.manager = Manager(3, store, WorkingSet(store, size, wait_for_keys=wait_for_keys))
        self.hosted.managers[3] = self.manager
        self.uds = socket.socket(socket.AF_UNIX)
        self.uds.bind(os.path.join(self.dir, "host.sock"))
        self.uds.listen(16)
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.server = HostServer(
            self.uds, self.tcp, {self.hosted.key: self.hosted}, set(), event_loop=True
        )
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
            os.path.join(self.dir, "shard"),
        )
        self.link = HostLink(info, uid, secret, "reads", use_uds=False)
        self.socks: list[socket.socket] = []
        self.reads: list[Any] = []
        for cls in SERVERS:
            sock = self.link._connect(3, None, None).sock
            c = self._served(sock)
            c.reads = None if cls is None else cls(c, _PLAIN_READS)
            self.socks.append(sock)
            self.reads.append(c.reads)
        self.writer = self.link._connect(3, None, None).sock
        self.tags = 0

    def _served(self, sock: socket.socket) -> Connection:
        """The host's end of ``sock``, once the event loop serves it."""
        me = sock.getsockname()

        def found() -> Connection | None:
            for c in list(self.server.loop._conns.values()):  # type: ignore[union-attr]
                if c.sock.getpeername() == me:
                    return c
            return None

        return poll_for(found, 30, "the host's end of a connection in its event loop", 0.01)

    def ask(self, sock: socket.socket, requests: list[tuple[Operation, dict[str, int]]]) -> list:
        """The replies to ``requests`` sent in one send on ``sock``: ``(status, tag, ival,
        payload)`` each, tags from 1."""
        sock.sendall(b"".join(_raw(o, i + 1, **kw) for i, (o, kw) in enumerate(requests)))
        return _replies(sock, len(requests))

    def same(self, requests: list[tuple[Operation, dict[str, int]]]) -> list:
        """Every connection's replies to ``requests``: the same; they."""
        got = [self.ask(sock, requests) for sock in self.socks]
        assert all(g == got[0] for g in got), list(zip(SERVERS, got, strict=True))
        return got[0]

    def close(self) -> None:
        for sock in [*self.socks, self.writer]:
            sock.close()
        self.link.close()
        self.server.close()
        self.manager.close()
        self.uds.close()
        self.tcp.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _digest(key: str) -> bytes:
    return key_digest(dumps_key(key))


def _put(key: str, value: Any, chkpt: int) -> ops.Put:
    kb = dumps_key(key)
    return ops.Put(key_digest(kb), kb, dumps_value(value), chkpt, 1)


_read = st.tuples(
    st.sampled_from(["get", "in", "len", "newest"]),
    st.sampled_from(KEYS),
    st.integers(-1, 6),
    st.sampled_from([0, 0, 0, 1, 2]),  # the term: none, this one, another
)


class OneShardThreeServers(RuleBasedStateMachine):
    """A writer changes one shard (puts of small and large values, deletions, checkpoints
    moving its window of two); batches of reads (with a read the loop leaves to the
    manager among them, and terms right and wrong) get the same replies from every
    connection."""

    def __init__(self) -> None:
        super().__init__()
        self.shard = Shard()
        self.newest = 0

    @rule(
        key=st.sampled_from(KEYS),
        chkpt=st.integers(0, 6),
        value=st.one_of(st.integers(), st.binary(max_size=40), st.just("large")),
    )
    def put(self, key: str, chkpt: int, value: Any) -> None:
        value = b"x" * LARGE if value == "large" else value
        ((status, _, _, _),) = self.shard.ask(self.shard.writer, [(_put(key, value, chkpt), {})])
        assert status in (0, int(Status.CHECKPOINT_RETIRED)), status

    @rule(key=st.sampled_from(KEYS), chkpt=st.integers(0, 6))
    def delete(self, key: str, chkpt: int) -> None:
        self.shard.ask(self.shard.writer, [(ops.Pop(_digest(key), chkpt, 1), {})])

    @rule(reads=st.lists(_read, min_size=1, max_size=8))
    def read(self, reads: list[tuple[str, str, int, int]]) -> None:
        term = {0: 0, 1: self.shard.manager.wire, 2: wire_term(self.shard.manager.term + 1)}
        batch: list[tuple[Operation, dict[str, int]]] = []
        for what, key, chkpt, t in reads:
            o: Operation = {
                "get": lambda: ops.Get(_digest(key), chkpt),
                "in": lambda: ops.Contains(_digest(key), chkpt),
                "len": lambda: ops.Length(max(chkpt, 0)),
                "newest": lambda: ops.Newest(),
            }[what]()
            batch.append((o, {"term": term[t]} if what in ("get", "in") else {}))
        self.shard.same(batch)

    @precondition(lambda self: _compiled is not None)
    @rule()
    def the_compiled_server_served_what_it_could(self) -> None:
        """A get of a small value at the window's newest is the compiled server's (and the
        pure one's), not the manager's."""
        newest = self.shard.manager.working_set.newest
        self.shard.ask(self.shard.writer, [(_put("small", newest, newest), {})])
        before = [r.count for r in self.shard.reads if r is not None]
        self.shard.same([(ops.Get(_digest("small"), newest), {})])
        after = [r.count for r in self.shard.reads if r is not None]
        assert [a - b for a, b in zip(after, before, strict=True)] == [1] * len(after)

    def teardown(self) -> None:
        self.shard.close()


OneShardThreeServers.TestCase.settings = settings(
    max_examples=20, stateful_step_count=15, deadline=None
)
test_one_shard_three_read_servers = OneShardThreeServers.TestCase


@pytest.fixture
def shard():
    s = Shard()
    yield s
    s.close()


def _counts(s: Shard) -> list[int]:
    return [r.count for r in s.reads if r is not None]


def test_what_only_the_manager_answers_is_left_to_it(shard):
    """A read at a retired checkpoint, under another term, of a value over the largest a
    read server sends, with a flag, or of a closed manager: no read server answers it
    (their counts stay), and every connection gets the manager's answer."""
    w = shard.writer
    for chkpt in range(4):  # (the window moves to [2, 3])
        shard.ask(w, [(_put("a", chkpt, chkpt), {}), (_put("big", b"x" * LARGE, chkpt), {})])
    before = _counts(shard)
    retired = shard.same([(ops.Get(_digest("a"), 0), {}), (ops.Contains(_digest("a"), 1), {})])
    assert [st for st, *_ in retired] == [int(Status.CHECKPOINT_RETIRED)] * 2
    other = shard.same([(ops.Get(_digest("a"), 3), {"term": wire_term(7)})])
    assert other[0][0] == int(Status.LEASE)
    large = shard.same([(ops.Get(_digest("big"), 3), {})])
    assert large[0][0] == 0 and len(large[0][3]) > LARGE
    assert _counts(shard) == before
    served = shard.same([(ops.Get(_digest("a"), 3), {}), (ops.Get(_digest("none"), 3), {})])
    assert served[0][0] == 0 and served[1][0] == int(Status.KEY_NOT_FOUND)
    assert _counts(shard) == [b + 2 for b in before]
    shard.same([(ops.Get(_digest("a"), 3), {"flags": FLAG_NOREPLY})])  # (the manager's)
    assert _counts(shard) == [b + 2 for b in before]
    shard.manager.close(destroy=False)
    closed = [shard.ask(sock, [(ops.Get(_digest("a"), 3), {})]) for sock in shard.socks]
    assert all(c == closed[0] for c in closed) and closed[0][0][0] != 0, closed
    assert _counts(shard) == [b + 2 for b in before]


def test_a_leased_dictionary_and_a_delivery_owed_are_the_managers(shard):
    """While its dictionary is leased (a replicated primary here: each read checks the
    host's lease) or its connection owes a delivery, a connection's reads are the
    server's Python path's."""
    shard.ask(shard.writer, [(_put("a", 1, 0), {})])
    before = _counts(shard)
    shard.hosted.leased = True
    try:
        got = [shard.ask(sock, [(ops.Get(_digest("a"), 0), {})]) for sock in shard.socks]
    finally:
        shard.hosted.leased = False
    assert _counts(shard) == before
    assert all(g[0][0] != 0 for g in got)  # (no lease here: refused, as the manager does)
    shard.same([(ops.Get(_digest("a"), 0), {})])
    assert _counts(shard) == [b + 1 for b in before]


def test_wait_for_keys_reads_are_the_managers():
    """Under ``wait_for_keys`` a read may wait for its writer: every read is the
    manager's, and the replies are the same."""
    s = Shard(wait_for_keys=True)
    try:
        s.ask(s.writer, [(_put("a", 1, 0), {})])
        before = _counts(s)
        s.same([(ops.Get(_digest("a"), 0), {}), (ops.Contains(_digest("b"), 0), {})])
        assert _counts(s) == before
    finally:
        s.close()


def test_the_package_serves_plain_reads_with_its_kernel_set():
    """The host's connections get the chosen set's read server."""
    assert kernels.ReadServer is (_compiled.ReadServer if kernels.COMPILED else pure.ReadServer)
