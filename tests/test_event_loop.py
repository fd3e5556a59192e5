"""The host's event loop: many connections on one thread, and the requests it must hand on.

A real :class:`HostServer` over a Unix socket and TCP, a real shard, real client
links; no cluster.  What is checked: requests of many connections at once all
come back right; a request that waits (``wait_for_keys``), one that is not
served inline (``wait_for``), a large value and a peer that does not read its
reply each move the loop to another thread and hold up nobody else; the loop's
threads end with the server; thread-per-connection serving (``event_loop=False``)
still serves.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time

import numpy as np
import pytest

from dask_ddict._hashing import key_digest
from dask_ddict._keys import dumps_key
from dask_ddict._serialize import dumps_value, loads_value
from dask_ddict.errors import DDictTimeoutError
from dask_ddict.host.hosted import HostedDict
from dask_ddict.host.server import HostServer
from dask_ddict.layout import ManagerInfo
from dask_ddict.shard.manager import Manager
from dask_ddict.shard.store import ShardStore
from dask_ddict.shard.working_set import WorkingSet
from dask_ddict.transport import ops
from dask_ddict.transport.protocol import REQ, Reader
from dask_ddict.transport.socket_client import HostLink, SocketChannel
from tests.support.polling import poll_for

BOUND = 30.0  # seconds any wait here may take on a loaded 2-core machine


class Served:
    """A host server of one manager (id 3), and client channels to it."""

    def __init__(self, tmp_path, *, event_loop: bool = True, wait_for_keys: bool = False):
        self.uid, self.secret = secrets.token_hex(16), secrets.token_hex(32)
        store = ShardStore(str(tmp_path / "shard"), 256 << 20, indexed=wait_for_keys)
        self.hosted = HostedDict(self.uid, "loop", self.secret)
        self.manager = Manager(3, store, WorkingSet(store, 1, wait_for_keys=wait_for_keys))
        self.hosted.managers[3] = self.manager
        self.uds = socket.socket(socket.AF_UNIX)
        path = str(tmp_path / "host.sock")
        self.uds.bind(path)
        self.uds.listen(256)
        self.tcp = socket.create_server(("127.0.0.1", 0), backlog=256)
        self.server = HostServer(
            self.uds, self.tcp, {self.hosted.key: self.hosted}, set(), event_loop=event_loop
        )
        self.server.start()
        self.info = ManagerInfo(
            3,
            "w",
            "h",
            "h:b",
            os.getpid(),
            path,
            "127.0.0.1",
            self.tcp.getsockname()[1],
            str(tmp_path / "shard"),
        )
        self.links: list[HostLink] = []

    def link(self, use_uds: bool = True) -> HostLink:
        link = HostLink(self.info, self.uid, self.secret, "loop", use_uds=use_uds)
        self.links.append(link)
        return link

    def channel(self, use_uds: bool = True) -> SocketChannel:
        return SocketChannel(self.link(use_uds), self.info)

    def close(self) -> None:
        for link in self.links:
            link.close()
        self.server.close()
        self.manager.close()
        self.uds.close()
        self.tcp.close()


@pytest.fixture
def served(tmp_path):
    s = Served(tmp_path)
    yield s
    s.close()


def _key(name: str) -> tuple[bytes, bytes]:
    kb = dumps_key(name)
    return key_digest(kb), kb


def _put(ch: SocketChannel, name: str, value) -> None:
    d, kb = _key(name)
    ch.call(ops.Put(d, kb, dumps_value(value), 0, 1))


def _get(ch: SocketChannel, name: str, timeout: float | None = None):
    return loads_value(ch.call(ops.Get(_key(name)[0], 0, timeout)))


def _loop_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "ddict-loop" and t.is_alive()}


@pytest.mark.parametrize("event_loop", [True, False])
def test_many_connections_at_once_each_get_their_own_answers(tmp_path, event_loop):
    s = Served(tmp_path, event_loop=event_loop)
    try:
        chans = [s.channel(use_uds=i % 2 == 0) for i in range(24)]
        errors: list[BaseException] = []

        def client(i: int, ch: SocketChannel) -> None:
            try:
                for j in range(60):
                    _put(ch, f"{i}:{j}", (i, j, b"v" * (j * 50)))
                for j in range(60):
                    assert _get(ch, f"{i}:{j}") == (i, j, b"v" * (j * 50))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=client, args=(i, ch)) for i, ch in enumerate(chans)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND)
        assert not errors, errors[0]
        assert chans[0].call(ops.Length(0)) == 24 * 60
        loop = s.server.loop
        if event_loop:
            assert loop is not None and loop.handoffs == 0  # (every request was served inline)
        else:
            assert loop is None
    finally:
        s.close()


def test_a_waiting_read_moves_the_loop_and_holds_up_no_one(tmp_path):
    s = Served(tmp_path, wait_for_keys=True)
    try:
        waiter, other = s.channel(), s.channel(use_uds=False)
        got: list = []
        t = threading.Thread(target=lambda: got.append(_get(waiter, "late", timeout=BOUND)))
        t.start()
        poll_for(lambda: s.manager._deferred.waiting, BOUND, "the read to wait", 0.01)
        assert s.manager._deferred.waiting, "the read never waited"
        before = s.server.loop.handoffs
        assert before >= 1  # (the waiting read took the loop's thread with it)
        for j in range(50):  # served meanwhile, by the loop's new thread
            _put(other, f"o{j}", j)
            assert _get(other, f"o{j}") == j
        assert t.is_alive() and not got
        _put(other, "late", "here")  # the write it waited for
        t.join(BOUND)
        assert got == ["here"]
        assert _get(waiter, "o7") == 7  # (its connection is back in the loop, and served)
    finally:
        s.close()


def test_operations_not_served_inline_and_large_values_go_to_a_thread(served):
    ch = served.channel(use_uds=False)
    big = np.arange(1 << 20, dtype=np.float64)  # 8 MiB: over the loop's most inline
    _put(ch, "big", big)
    assert served.server.loop.handoffs >= 1
    np.testing.assert_array_equal(_get(ch, "big"), big)
    d, _ = _key("big")
    n = served.server.loop.handoffs
    ch.call(ops.WaitFor(d, 0, dumps_value(big).join(), 5.0))  # not inline: a thread's
    assert served.server.loop.handoffs > n
    _put(ch, "small", 1)  # the same connection, back in the loop
    assert _get(ch, "small") == 1


def test_a_peer_that_does_not_read_its_reply_holds_up_only_itself(served):
    setter = served.channel()
    big = np.full(4 << 20, 7, dtype=np.uint8)  # far more than a socket buffer holds
    _put(setter, "big", big)
    slow = served.link()
    answer = slow.send(ops.Get(_key("big")[0], 0), 3)  # asked, not read
    others = [served.channel(use_uds=i % 2 == 0) for i in range(4)]
    t0 = time.monotonic()
    for j in range(20):
        for ch in others:
            _put(ch, f"x{j}", j)
            assert _get(ch, f"x{j}") == j
    assert time.monotonic() - t0 < BOUND
    status, payload = answer()  # read at last: whole
    assert status == 0
    np.testing.assert_array_equal(loads_value(ops.Get(b"", 0).result(status, payload)), big)


def test_the_loops_threads_end_with_the_server(tmp_path):
    before = _loop_threads()  # (other tests' servers: theirs may still be ending)
    s = Served(tmp_path, wait_for_keys=True)
    ch, other = s.channel(), s.channel()
    with pytest.raises(DDictTimeoutError):  # the read waited, on a thread of its own
        _get(ch, "never", timeout=0.3)
    _put(other, "k", 1)
    ours = _loop_threads() - before
    assert s.server.loop.handoffs >= 1 and len(ours) >= 2  # (the loop's, and the waiter's)
    s.close()
    poll_for(lambda: not any(t.is_alive() for t in ours), BOUND, "the loop's threads to end", 0.02)
    assert not any(t.is_alive() for t in ours)


def test_reader_reads_without_waiting_and_peeks_whole_headers():
    a, b = socket.socketpair()
    try:
        r = Reader(a, 64)
        assert r.fill_nowait() == 0 and r.peek(REQ) is None  # nothing sent yet
        head = REQ.pack(2, 0, 0, 3, 7, 1, 0, 0, 0, -1.0, 5, 0)
        b.sendall(head[:10])
        assert r.fill_nowait() == 10 and r.peek(REQ) is None and r.buffered() == 10
        b.sendall(head[10:] + b"keyvalue")
        assert r.fill_nowait() == REQ.size - 10  # (as much as the 64-byte buffer holds)
        assert r.fill_nowait() == 8  # (a full buffer grows)
        assert r.peek(REQ) == REQ.unpack(head) and r.buffered() == REQ.size + 8  # (not read)
        r.reserve(REQ.size + 8 + 1000)  # room for a larger request: grown, nothing lost
        assert r.unpack(REQ) == REQ.unpack(head) and bytes(r.read(8)) == b"keyvalue"
        b.close()
        with pytest.raises(ConnectionResetError):
            r.fill_nowait()
    finally:
        a.close()
