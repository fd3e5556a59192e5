"""The host's server alone: its operation table behind real sockets, a real shard, no cluster.

A :class:`HostServer` serves one :class:`Manager` over a Unix socket and TCP; the
client side is the real :class:`HostLink`/:class:`SocketChannel`, so every
operation makes the full trip: encode, dispatch through ``HANDLERS``, reply,
decode, and errors come back typed.
"""

from __future__ import annotations

import os
import pickle
import secrets
import socket
from typing import Any

import numpy as np
import pytest

from dask_ddict._hashing import key_digest
from dask_ddict._keys import dumps_key
from dask_ddict._serialize import dumps_value, loads_value
from dask_ddict.errors import DDictClosedError, DDictError, DDictKeyError, Status
from dask_ddict.host import fan_out
from dask_ddict.host.hosted import PERSISTED_FRESH, HostedDict
from dask_ddict.host.server import HostServer
from dask_ddict.layout import ManagerInfo, term_is_newer, wire_term
from dask_ddict.shard.manager import Manager
from dask_ddict.shard.store import ShardStore
from dask_ddict.shard.working_set import WorkingSet
from dask_ddict.transport import ops, table
from dask_ddict.transport.many_key_ops import GetMany
from dask_ddict.transport.operation import Kind, Request
from dask_ddict.transport.protocol import FLAG_NOREPLY, REP, REQ, Op
from dask_ddict.transport.socket_client import HostLink, SocketChannel
from dask_ddict.transport.whole_checkpoints import Persist
from tests.support.manager_calls import put
from tests.support.polling import poll_for
from tests.support.wire import raw as _raw
from tests.support.wire import replies as _replies


def _serve(tmp_path, event_loop: bool, wait_for_writers: bool = False):
    """A host server over a real shard, and ``channel(use_uds)``: a client's channel to its
    manager 3 (``channel.server``: the server; ``channel.manager``: the manager)."""
    uid, secret = secrets.token_hex(16), secrets.token_hex(32)
    store = ShardStore(str(tmp_path / "shard"), 16 << 20)
    hosted = HostedDict(uid, "srv", secret)
    hosted.managers[3] = Manager(3, store, WorkingSet(store, 1, wait_for_writers=wait_for_writers))
    uds = socket.socket(socket.AF_UNIX)
    path = str(tmp_path / "host.sock")
    uds.bind(path)
    uds.listen(16)
    tcp = socket.create_server(("127.0.0.1", 0))
    closed: set[bytes] = set()
    dicts = {hosted.key: hosted}
    server = HostServer(uds, tcp, dicts, closed, event_loop=event_loop)
    server.start()
    info = ManagerInfo(
        3,
        "w",
        "h",
        "h:b",
        os.getpid(),
        path,
        "127.0.0.1",
        tcp.getsockname()[1],
        str(tmp_path / "shard"),
    )
    links = []

    def channel(use_uds: bool, auth: str = secret) -> SocketChannel:
        link = HostLink(info, uid, auth, "srv", use_uds=use_uds)
        links.append(link)
        return SocketChannel(link, info)

    channel.host_ends = lambda: list(server._conns)  # type: ignore[attr-defined]
    channel.server = server  # type: ignore[attr-defined]
    channel.manager = hosted.managers[3]  # type: ignore[attr-defined]
    yield channel, dicts, closed
    for link in links:
        link.close()
    server.close()
    hosted.managers[3].close()


@pytest.fixture(params=[False, True], ids=["thread", "loop"])
def served(tmp_path, request):
    """:func:`_serve`, its connections on a thread each or served by its event loop."""
    yield from _serve(tmp_path, request.param)


@pytest.fixture
def looped(tmp_path):
    """:func:`_serve` with the event loop."""
    yield from _serve(tmp_path, True)


@pytest.fixture
def looped_waiting(tmp_path):
    """:func:`_serve` with the event loop, and puts that wait for the checkpoint's writers
    (``wait_for_writers``: a put at a new checkpoint waits while one is missing)."""
    yield from _serve(tmp_path, True, wait_for_writers=True)


@pytest.mark.parametrize("use_uds", [True, False])
def test_every_table_operation_round_trips(served, use_uds):
    channel, _, _ = served
    ch = channel(use_uds)
    kb = dumps_key("k")
    d = key_digest(kb)
    ch.call(ops.Put(d, kb, dumps_value([1, 2]), 0, 1))
    assert loads_value(ch.call(ops.Get(d, 0))) == [1, 2]
    assert ch.call(ops.Contains(d, 0)) and ch.call(ops.Length(0)) == 1
    n = dumps_key("n")
    assert loads_value(ch.call(ops.FetchAdd(key_digest(n), n, 0, 1, 4))) == 0
    items, _, more = ch.call(ops.Page(0, None, 3, 10))
    assert len(items) == 2 and not more
    assert ch.call(ops.Stats()).manager_id == 3 and ch.call(ops.Newest()) == 0
    assert ch.call(ops.Ping()) == os.getpid()
    ch.call(ops.WaitFor(d, 0, dumps_value([1, 2]).join(), 1.0))
    assert loads_value(ch.call(ops.Pop(d, 0, 1))) == [1, 2]
    with pytest.raises(DDictKeyError):
        ch.call(ops.Get(d, 0))
    ch.call(ops.BatchPut([(3, d, kb, dumps_value(5))], 0, 9, False, 77))
    assert ch.call(ops.BatchEnd(9, 77)) == 1
    (frames,) = ch.call(GetMany(((3, [d, key_digest(dumps_key("absent"))]),), 0))
    assert loads_value(frames[0]) == 5 and frames[1] is None
    ch.call(ops.Freeze())
    with pytest.raises(DDictError, match="frozen"):
        ch.call(ops.Put(d, kb, dumps_value(1), 0, 1))
    ch.call(ops.Unfreeze())
    ch.call(ops.Clear(0, 1))
    assert ch.call(ops.Length(0)) == 0
    with pytest.raises(DDictError, match="persist"):  # this manager has no persist_path
        ch.call(Persist(0))


def test_every_operation_is_declared_once_and_served():
    """One class per wire code, each with a host handler: nothing is spelled elsewhere."""
    assert set(table.OPERATIONS) == set(table.HANDLERS) == set(Op)
    for code, cls in table.OPERATIONS.items():
        assert cls.op is code
        assert cls.serve.__qualname__ != "Operation.serve", cls  # (the base only raises)
        assert isinstance(cls.kind, Kind) or cls in (ops.FanOut, ops.TreeOut)  # (its inner's)
    assert ops.FanOut(ops.Length(0), (0,)).kind is ops.Length.kind
    assert ops.TreeOut(ops.Length(0), (0,), ()).kind is ops.Length.kind


@pytest.mark.parametrize("use_uds", [True, False])
def test_a_fan_out_answers_for_every_manager_in_one_request(served, use_uds):
    channel, _, _ = served
    ch = channel(use_uds)
    kb = dumps_key("k")
    ch.call(ops.Put(key_digest(kb), kb, dumps_value(1), 0, 1))
    got = ch.call(ops.FanOut(ops.Length(0), (3, 9, 3)))  # 9 is not hosted here
    assert [(mid, status, ival) for mid, status, ival, _ in got] == [
        (3, 0, 1),
        (9, int(Status.MANAGER_UNAVAILABLE), 0),
        (3, 0, 1),
    ]
    assert b"not hosted" in got[1][3]
    stats = ch.call(ops.FanOut(ops.Stats(), (3,)))
    assert ops.Stats().result(stats[0][2], stats[0][3]).manager_id == 3
    nested = ch.call(ops.FanOut(ops.FanOut(ops.Length(0), (3,)), (3,)))  # never served
    assert nested[0][1] == Status.INVALID_ARGUMENT and b"unknown operation" in nested[0][3]


def test_a_wrong_secret_is_refused_over_tcp_and_a_closed_dict_says_so(served):
    channel, dicts, closed = served
    with pytest.raises(DDictError):
        channel(False, auth="0" * 64).call(ops.Length(0))
    assert channel(True).call(ops.Length(0)) == 0
    (key,) = dicts
    hosted = dicts.pop(key)  # what the host process does when a dictionary is destroyed
    closed.add(key)
    with pytest.raises(DDictClosedError):
        channel(True).call(ops.Length(0))
    dicts[key] = hosted  # (for the fixture's teardown)


@pytest.mark.parametrize("use_uds", [True, False])
def test_an_answer_never_collected_does_not_become_the_next_ones(served, use_uds):
    """A broadcast sends to every host, then reads the answers; one it never reads
    (its caller failed meanwhile) must not be read as the next request's answer."""
    channel, _, _ = served
    ch = channel(use_uds)
    kb = dumps_key("k")
    ch.call(ops.Put(key_digest(kb), kb, dumps_value(1), 0, 1))
    pending = ch.link.send(ops.Stats(), 3)  # sent, never collected
    del pending
    assert ch.call(ops.Length(0)) == 1  # the right answer, on a fresh connection
    answer = ch.link.send(ops.Length(0), 3)
    assert ch.call(ops.Newest()) == 0  # another connection: each request its own answer
    assert answer() == (1, b"") and ch.call(ops.Newest()) == 0


@pytest.mark.parametrize("use_uds", [True, False])
def test_a_process_keeps_a_bounded_pool_of_idle_connections(served, use_uds):
    """Connections are pooled per link (threads that take turns share one) and a process
    keeps at most ``ddict.transport.kept-connections`` idle ones over all its links,
    least recently used closed first: its descriptors do not grow with the hosts it uses."""
    import threading

    import dask.config

    from dask_ddict.transport.idle_pool import IDLE_POOL

    channel, _, _ = served
    with dask.config.set({"ddict.transport.kept-connections": 2}):
        chans = [channel(use_uds) for _ in range(5)]  # as five host processes
    kept = IDLE_POOL
    open_now = lambda: sum(len(ch.link._all) for ch in chans)  # noqa: E731
    for ch in chans:
        assert ch.call(ops.Length(0)) == 0
    kept_links = [link for link in kept.idle.values() if any(link is ch.link for ch in chans)]
    assert len(kept_links) <= 2 and chans[-1].link in kept_links  # the most recent ones
    assert open_now() <= 2  # (the others are closed; this process's server closes its ends)
    for ch in chans:  # an evicted link simply connects again
        assert ch.call(ops.Length(0)) == 0
    threads = [threading.Thread(target=chans[0].call, args=(ops.Length(0),)) for _ in range(8)]
    for t in threads:  # one after the other: one connection serves them all
        t.start()
        t.join()
    assert len(chans[0].link._all) == 1 and open_now() <= 2


def _fan_out(o: Any, mids: tuple[int, ...], **host: Any) -> list[Any]:
    """Broadcast ``o`` to managers ``mids`` as a host serves it (``fan_out.serve`` with
    ``host``'s managers, words and kept answers); each manager's result."""
    got: list = []
    flags, keysec, value, vlen, chkpt, arg, client, timeout = ops.FanOut(o, mids).encode()
    req = Request(
        Op.FANOUT, flags, mids[0], chkpt, arg, client, timeout, keysec[:16], keysec[16:], b"", 0, 0
    )
    fan_out.serve(None, req, lambda ival=0, payload=b"": got.append(payload), **host)
    return [o.result(ival, data) for _, _, ival, data in pickle.loads(got[0])]


def test_broadcast_answers_are_kept_under_the_managers_generation_words(tmp_path, monkeypatch):
    """A host answers a repeated ``len``/``stats``/first-page broadcast from what it kept,
    until a commit (its own or a same-host client's) gives a manager a new word."""
    from dask_ddict.shard.generations import Generations, path_for
    from dask_ddict.shard.manager import Manager as M

    gens = Generations(path_for(str(tmp_path), "ab" * 16), 4, create=True)
    stores = {m: ShardStore(str(tmp_path / f"s{m}"), 4 << 20) for m in (1, 2)}
    managers = {m: Manager(m, st, WorkingSet(st, 1)) for m, st in stores.items()}
    for m, manager in managers.items():
        manager.generations = gens
        manager.store.on_commit = lambda m=m: gens.bump(m)
        gens.bump(m)
    answers: dict = {}

    def broadcast(o):
        return _fan_out(o, (1, 2), managers=managers, generations=gens, answers=answers)

    try:
        kb = dumps_key("k")
        managers[1].put(key_digest(kb), kb, dumps_value(1).join(), 0, 7)
        assert broadcast(ops.Length(0)) == [1, 0]
        monkeypatch.setattr(M, "length", lambda *a: pytest.fail("not kept"))
        assert broadcast(ops.Length(0)) == [1, 0]  # kept: no manager asked
        monkeypatch.undo()
        managers[2].put(key_digest(kb), kb, dumps_value(2).join(), 0, 7)  # a commit: new word
        assert broadcast(ops.Length(0)) == [1, 1]
        gens.bump(1)  # what a same-host client's direct put does after its commit
        first = broadcast(ops.Page(0, None, 3, 10))
        assert [len(items) for items, _, _ in first] == [1, 1]
        assert [s.num_keys for s in broadcast(ops.Stats())] == [1, 1]
        assert broadcast(ops.Length(0)) == [1, 1]  # each operation its own kept answer
        assert [s.manager_id for s in broadcast(ops.Stats())] == [1, 2]
        assert broadcast(ops.Length(3)) == [1, 1] and broadcast(ops.Newest()) == [0, 0]
    finally:
        for manager in managers.values():
            manager.close()
        gens.close()


def test_a_kept_stats_answer_is_stale_once_a_primarys_replica_set_changed(tmp_path):
    """``stats`` reports each manager's replicas, which change without a commit (a replica
    made after a failover, one dropped): the host's kept answer is not reused after such
    a change (it once answered ``replicas=0`` for good after a repair made the replica).
    A unit test: a real shard and host dict, fake replica links."""
    from dask_ddict.host import replicas
    from dask_ddict.host.control import DictSpec
    from dask_ddict.options import DDictOptions
    from dask_ddict.shard.generations import Generations, path_for

    class Link:
        def close(self) -> None:
            pass

    uid = "cd" * 16
    gens = Generations(path_for(str(tmp_path), uid), 1, create=True)
    store = ShardStore(str(tmp_path / "s0"), 4 << 20)
    manager = Manager(0, store, WorkingSet(store, 1))
    manager.generations = gens
    gens.bump(0)
    hosted = HostedDict(uid, "d", "s", gens)
    hosted.managers[0] = manager
    spec = DictSpec("d", uid, "s", DDictOptions(replicas=2), 4 << 20, 1)
    shipper = manager.shipper = replicas.Shipper(spec, 0, False, None, hosted, manager)

    def info(port: int) -> ManagerInfo:
        return ManagerInfo(0, "w", f"h{port}", "h:b", 1, "", "127.0.0.1", port, "")

    def replicas_now() -> int:
        (stats,) = _fan_out(
            ops.Stats(),
            (0,),
            managers=hosted.managers,
            generations=gens,
            answers=hosted.answers,
            pins=hosted.changes,
        )
        return stats.replicas

    try:
        assert replicas_now() == 0 and hosted.answers  # (kept)
        shipper._retarget([replicas.Target(info(1), Link()), replicas.Target(info(2), Link())])
        assert replicas_now() == 2  # (what Shipper.add ends with)
        shipper.remove(info(2).address)
        assert replicas_now() == 1
        shipper.remove(info(2).address)  # (no change: the kept answer stands)
        words = list(hosted.answers.values())[0][0]
        assert replicas_now() == 1 and list(hosted.answers.values())[0][0] is words
        shipper.dropped([info(1).address])
        assert replicas_now() == 0
        shipper._retarget([replicas.Target(info(3), Link())])
        assert replicas_now() == 1
        shipper.close()
        assert replicas_now() == 0
    finally:
        manager.close()
        gens.close()


def test_a_kept_stats_answer_is_stale_once_a_deferred_operation_timed_out(tmp_path):
    """``stats`` reports the operations a manager defers (a read under ``wait_for_keys`` of
    a key not written yet); one that times out commits nothing and is no request: the
    host's kept answer is not reused after it (a unit test: a real shard and host dict)."""
    import threading

    from dask_ddict.errors import DDictTimeoutError
    from dask_ddict.shard.generations import Generations, path_for

    uid = "ce" * 16
    gens = Generations(path_for(str(tmp_path), uid), 1, create=True)
    store = ShardStore(str(tmp_path / "s0"), 4 << 20, indexed=True)
    manager = Manager(0, store, WorkingSet(store, 1, wait_for_keys=True))
    manager.generations = gens
    gens.bump(0)
    hosted = HostedDict(uid, "d", "s", gens)
    hosted.managers[0] = manager
    host = {"managers": hosted.managers, "generations": gens, "answers": hosted.answers}

    def deferred() -> int:
        (stats,) = _fan_out(ops.Stats(), (0,), pins=hosted.changes, **host)
        return stats.deferred_ops

    def wait() -> None:
        with pytest.raises(DDictTimeoutError):
            manager.get(key_digest(dumps_key("later")), 0, bytes, timeout=1.0)

    try:
        assert deferred() == 0 and hosted.answers  # (kept)
        waiter = threading.Thread(target=wait)
        waiter.start()
        poll_for(lambda: deferred() == 1, 10, "the get deferred")
        waiter.join(10)
        assert not waiter.is_alive() and deferred() == 0
    finally:
        manager.close()
        gens.close()


def test_a_kept_stats_answer_is_stale_once_another_host_completed_a_persist(tmp_path):
    """``stats`` reports the checkpoints persisted by every manager; the last manager's part
    may be committed by another host, which commits nothing here: the host's kept answer
    is not reused once it listed them again (at most ``PERSISTED_FRESH`` seconds later),
    and a listing that fails keeps no answer and raises nothing there (a unit test: real
    shards and persisters, a real host dict)."""
    from dask_ddict.persist import Persister, ZarrPersister
    from dask_ddict.shard.generations import Generations, path_for

    uid = "cf" * 16
    gens = Generations(path_for(str(tmp_path), uid), 2, create=True)
    managers = []
    for mid in range(2):
        store = ShardStore(str(tmp_path / f"s{mid}"), 4 << 20, indexed=True)
        persister = Persister(ZarrPersister(str(tmp_path / "store"), "d", mid, 2), 1, -1)
        managers.append(Manager(mid, store, WorkingSet(store, 1), persister=persister))
    here, there = managers  # (manager 1 is another host's)
    here.generations = gens
    gens.bump(0)
    hosted = HostedDict(uid, "d", "s", gens)
    hosted.managers[0] = here
    host = {"managers": hosted.managers, "generations": gens, "answers": hosted.answers}

    def persisted() -> tuple[int, ...]:
        (stats,) = _fan_out(ops.Stats(), (0,), pins=hosted.changes, **host)
        return stats.persisted_ids

    try:
        for m in managers:
            put(m, f"k{m.manager_id}", m.manager_id)
        here.persist(0)
        assert here.sync() == [] and here.persisted_ids() == []
        assert persisted() == () and hosted.answers  # (kept)
        there.persist(0)
        assert there.sync() == [] and here.persisted_ids() == [0]
        poll_for(lambda: persisted() == (0,), 2 + 2 * PERSISTED_FRESH, "the persist seen")
        listed = 0

        def unlistable() -> list[int]:
            nonlocal listed
            listed += 1
            raise OSError("the store is unreachable")

        here.persisted_ids = unlistable  # type: ignore[method-assign]
        hosted._persisted = (-PERSISTED_FRESH, ())  # (listed again at once)
        words = {hosted.changes() for _ in range(3)}
        assert len(words) == 3 and listed == 3  # (no kept answer reused; nothing raised)
    finally:
        for m in managers:
            m.close()
        gens.close()


@pytest.mark.parametrize("use_uds", [True, False])
def test_a_byte_range_is_cut_by_the_values_host_and_only_it_travels(served, use_uds):
    """``GetRange``: the host answers ``value[start:stop]`` (a Python slice) of a raw-bytes
    value and its size, served as ``Manager.get`` serves a whole value (``wait_for_keys``
    included); a pickled value is refused with a typed error, never unpickled."""
    import threading

    from dask_ddict.errors import DDictSerializationError

    channel, dicts, _ = served
    ch = channel(use_uds)
    value = bytes(range(256)) * 400  # (100 KiB: received into an aligned buffer)
    kb, pb = dumps_key("raw"), dumps_key("pickled")
    d = key_digest(kb)
    ch.call(ops.Put(d, kb, dumps_value(value), 0, 1))
    ch.call(ops.Put(key_digest(pb), pb, dumps_value(bytearray(b"abc")), 0, 1))
    n = len(value)
    spans = [
        (0, 10),
        (5, 5),
        (n - 3, n + 99),
        (-7, n << 1),
        (-(n + 9), 4),
        (3, -2),
        (9, 2),
        (n + 1, n + 5),
        (-(1 << 70), 1 << 70),
    ]  # (beyond 64 bits: clamped, same slice)
    for start, stop in spans:
        size, part = ch.call(ops.GetRange(d, 0, start, stop))
        assert size == n and bytes(part) == value[start:stop], (start, stop)
    moved = ch.link.call(ops.GetRange(d, 0, 1000, 1100), 3)  # what came over the socket
    assert moved[0] == n and memoryview(moved[1]).nbytes == 100
    assert ch.call(ops.GetRange(d, 0, 0, 0)) == (n, b"")  # the size alone
    with pytest.raises(DDictSerializationError, match="not raw bytes"):
        ch.call(ops.GetRange(key_digest(pb), 0, 0, 2))
    with pytest.raises(DDictKeyError):
        ch.call(ops.GetRange(key_digest(dumps_key("absent")), 0, 0, 2))
    (hosted,) = dicts.values()
    ws = hosted.managers[3].working_set
    ws.wait_for_keys = True  # a reader of a key not written at its checkpoint waits for it
    try:
        lb = dumps_key("late")
        writer = threading.Timer(
            0.3, ch.call, (ops.Put(key_digest(lb), lb, dumps_value(b"written late"), 0, 1),)
        )
        writer.start()
        try:
            assert ch.call(ops.GetRange(key_digest(lb), 0, -4, 99, 30.0)) == (12, b"late")
        finally:
            writer.join(30)
    finally:
        ws.wait_for_keys = False


# -- the quick exchange (HostLink._quick: a kept connection, the compiled receive) -----------


@pytest.mark.parametrize("use_uds", [True, False])
@pytest.mark.parametrize("size", [0, 4_000, 4_096, 70_000, 3 << 20])
def test_replies_of_every_size_come_whole_through_a_kept_connection(served, use_uds, size):
    """A small reply is received whole by the kernel; one of ``SMALL_FRAME`` bytes or
    more, or larger than the connection's buffer, goes on through its reader."""
    channel, _, _ = served
    ch = channel(use_uds)
    value = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8).tobytes()
    for i in range(3):  # (the first connects; the others take the kept connection)
        kb = dumps_key(f"k{i}")
        ch.call(ops.Put(key_digest(kb), kb, dumps_value(value), 0, 1))
        assert loads_value(ch.call(ops.Get(key_digest(kb), 0))) == value
        assert len(ch.link._all) == 1
    with pytest.raises(DDictKeyError):  # (an error reply, through the kept connection)
        ch.call(ops.Get(key_digest(dumps_key("absent")), 0))
    assert ch.call(ops.Length(0)) == 3 and len(ch.link._all) == 1


@pytest.mark.parametrize("use_uds", [True, False])
def test_requests_of_every_size_are_taken_whole(served, use_uds):
    """Puts around the sizes where the host changes how it takes a request: a value it
    copies out of the connection's buffer (up to 1 MiB), one it receives into a buffer
    of its own, and, on the event loop, one too large to receive there (read after
    handing the loop on); each reads back whole, and the next small one still works."""
    from dask_ddict.host.server import _MOST_INLINE, _TAKEN

    channel, _, _ = served
    ch = channel(use_uds)
    loop = channel.server.loop
    for n, size in enumerate([0, 100, _TAKEN - 64, _TAKEN + 64, _MOST_INLINE, 3 << 20]):
        value = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8).tobytes()
        kb = dumps_key(f"big{n}")
        before = loop.handoffs if loop is not None else 0
        ch.call(ops.Put(key_digest(kb), kb, dumps_value(value), 0, 1))
        if loop is not None:  # (only a request over _MOST_INLINE is read off the loop)
            assert (loop.handoffs > before) == (size >= _MOST_INLINE - 100), size
        assert loads_value(ch.call(ops.Get(key_digest(kb), 0))) == value
        assert ch.call(ops.Contains(key_digest(dumps_key("nothing")), 0)) is False
    assert ch.call(ops.Length(0)) == 6 and len(ch.link._all) == 1


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda v: v[:-5], b"ends inside its digests"),
        (lambda v: v + b"more", b"goes on after its digests"),
    ],
)
def test_a_many_key_read_cut_or_overlong_is_refused_and_the_connection_serves_on(
    served, change, says
):
    """A ``GetMany`` whose value ends inside its digests (a table that promises more keys
    than it carries), or goes on after them, is answered with an error saying so, not
    read as other digests; the connection then serves its next request."""
    channel, _, _ = served
    ch = channel(False)
    kb = dumps_key("here")
    ch.call(ops.Put(key_digest(kb), kb, dumps_value(1), 0, 1))
    o = GetMany(((3, [key_digest(kb), key_digest(dumps_key("other"))]),), 0)
    e = o.encode()
    bad = change(b"".join(bytes(p) for p in e.parts))
    conn = ch.link._connect(3, None, None)
    try:
        conn.sock.sendall(
            REQ.pack(o.op, e.flags, 0, 0, 3, 5, 0, 0, 0, -1.0, len(bad), 0)
            + bad
            + _raw(ops.Get(key_digest(kb), 0), 6)
        )
        (status, tag, _, msg), (status2, tag2, _, frame) = _replies(conn.sock, 2)
        assert (tag, tag2) == (5, 6) and status != 0 and status2 == 0
        assert says in msg and loads_value(frame) == 1
    finally:
        conn.sock.close()


@pytest.mark.parametrize("use_uds", [True, False])
def test_pipelined_requests_are_answered_in_order_each_with_its_tag(served, use_uds):
    """Many requests in one send (a pipelining client's): puts, gets, a missing key (an
    error reply), a reply too large to be kept back, an operation the loop does not
    serve itself: every reply comes, in the order of the requests, with its tag."""
    channel, _, _ = served
    ch = channel(use_uds)
    big = b"B" * (200 << 10)
    kbs = [dumps_key(f"p{i}") for i in range(40)]
    ch.call(ops.Put(key_digest(dumps_key("big")), dumps_key("big"), dumps_value(big), 0, 1))
    conn = ch.link._connect(3, None, None)
    try:
        reqs, want = [], []
        for i, kb in enumerate(kbs):
            reqs.append(_raw(ops.Put(key_digest(kb), kb, dumps_value(i), 0, 1), 2 * i))
            want.append((0, 2 * i, None))
            reqs.append(_raw(ops.Get(key_digest(kb), 0), 2 * i + 1))
            want.append((0, 2 * i + 1, i))
        reqs.insert(7, _raw(ops.Get(key_digest(dumps_key("absent")), 0), 1000))
        want.insert(7, (int(Status.KEY_NOT_FOUND), 1000, None))
        reqs.insert(20, _raw(ops.Get(key_digest(dumps_key("big")), 0), 1001))
        want.insert(20, (0, 1001, big))
        reqs.insert(30, _raw(ops.WaitFor(key_digest(kbs[0]), 0, dumps_value(0).join()), 1002))
        want.insert(30, (0, 1002, None))
        conn.sock.sendall(b"".join(reqs))
        got = _replies(conn.sock, len(reqs))
        assert [(s, t) for s, t, _, _ in got] == [(s, t) for s, t, _ in want]
        for (_, _, _, payload), (_, _, value) in zip(got, want):
            if value is not None:
                assert loads_value(payload) == value
    finally:
        conn.sock.close()


@pytest.mark.parametrize("use_uds", [True, False])
def test_pipelined_replies_to_a_slow_reader_come_whole_and_in_order(served, use_uds):
    """200 gets of 30-37 KB values in one send, read only a second later: the host's
    sends are cut short by the full socket, and every reply still comes whole, in order,
    with its tag."""
    import time

    channel, _, _ = served
    ch = channel(use_uds)
    values = {i: bytes([i]) * (30_000 + 1_000 * i) for i in range(8)}
    for i, v in values.items():
        kb = dumps_key(f"v{i}")
        ch.call(ops.Put(key_digest(kb), kb, dumps_value(v), 0, 1))
    conn = ch.link._connect(3, None, None)
    try:
        conn.sock.sendall(
            b"".join(
                _raw(ops.Get(key_digest(dumps_key(f"v{j % 8}")), 0), 10 + j) for j in range(200)
            )
        )
        time.sleep(1.0)
        got = _replies(conn.sock, 200)
        assert [t for _, t, _, _ in got] == [10 + j for j in range(200)]
        assert all(s == 0 and loads_value(p) == values[j % 8] for j, (s, _, _, p) in enumerate(got))
    finally:
        conn.sock.close()


@pytest.mark.parametrize("use_uds", [True, False])
def test_a_moved_manager_is_answered_among_pipelined_requests(served, use_uds):
    """A request for a manager that moved away is answered MOVED, and the request after
    it on the same connection is served."""
    channel, dicts, _ = served
    next(iter(dicts.values())).moved[5] = ("elsewhere:1", 16 << 20)
    ch = channel(use_uds)
    conn = ch.link._connect(3, None, None)
    try:
        kb = dumps_key("x")
        conn.sock.sendall(
            _raw(ops.Put(key_digest(kb), kb, dumps_value(b"z" * 2000), 0, 1), 5, mid=5)
            + _raw(ops.Length(0), 6)
        )
        got = _replies(conn.sock, 2)
        assert (got[0][0], got[0][1]) == (int(Status.MOVED), 5) and b"elsewhere:1" in got[0][3]
        assert got[1][:3] == (0, 6, 0)
    finally:
        conn.sock.close()


def test_a_request_under_another_term_is_answered_moved_or_lease_and_never_served(served):
    """A client that knows the manager under an older term than its host serves it (a
    failover or a move since its layout) is told ``MOVED``; one that knows a newer term
    (this host was replaced and has not learned it yet) ``LEASE``: neither request is
    applied.  The same term, or none (a host's own requests), is served."""
    channel, _, _ = served
    manager = channel.manager
    manager.term = 40_000  # (past 15 bits: terms compare as serial numbers)
    conn = channel(False).link._connect(3, None, None)
    kb = dumps_key("termed")
    put = ops.Put(key_digest(kb), kb, dumps_value(1), 0, 1)
    try:
        conn.sock.sendall(
            _raw(put, 1, term=wire_term(39_999))
            + _raw(put, 2, term=wire_term(40_001))
            + _raw(ops.Length(0), 3, term=wire_term(40_000))
            + _raw(ops.Length(0), 4)
        )
        got = _replies(conn.sock, 4)
        assert [(st, tag) for st, tag, _, _ in got] == [
            (int(Status.MOVED), 1),
            (int(Status.LEASE), 2),
            (0, 3),
            (0, 4),
        ]
        assert b"newer term" in got[0][3] and b"asks the orchestrator" in got[1][3]
        assert got[2][2] == got[3][2] == 0  # (nothing was put)
    finally:
        conn.sock.close()
        manager.term = 0
    assert term_is_newer(wire_term(0), wire_term(2**15 - 1))  # (after a wrap)
    assert not term_is_newer(wire_term(5), wire_term(5))


@pytest.mark.parametrize("use_uds", [True, False])
@pytest.mark.parametrize("noreply", [False, True])
def test_a_key_over_the_limit_that_the_loop_took_whole_is_refused(served, use_uds, noreply):
    """A request with a key over ``max-key-bytes`` that the event loop receives whole
    (under its largest), or, on a thread of its own, is refused from its header (its
    body never sent): answered with an error naming the limit (none when it asked for
    no reply), and its connection dropped."""
    channel, _, _ = served
    ch = channel(use_uds)
    conn = ch.link._connect(3, None, None)
    try:
        klen = (1 << 20) + 100
        body = b"k" * klen + b"v" * 10 if channel.server.loop is not None else b""
        conn.sock.sendall(
            REQ.pack(
                int(Op.PUT), FLAG_NOREPLY if noreply else 0, 0, klen, 3, 77, 0, 0, 1, -1.0, 10, 0
            )
            + body
        )
        conn.sock.settimeout(10)
        data = b""
        while chunk := conn.sock.recv(1 << 16):
            data += chunk
        if noreply:
            assert data == b""
        else:
            status, tag, _, plen = REP.unpack_from(data)
            assert tag == 77 and status == int(Status.INVALID_ARGUMENT)
            assert b"max-key-bytes" in data[REP.size :]
    finally:
        conn.sock.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use_uds", [True, False])
def test_a_reply_kept_back_is_sent_before_the_next_request_waits(served, use_uds):
    """A put, then in the same send a wait for a key that only a reader of the put's
    reply will write: the put's reply must not wait behind the wait (no deadlock)."""
    channel, _, _ = served
    ch, other = channel(use_uds), channel(use_uds)
    a, c = dumps_key("a"), dumps_key("c")
    conn = ch.link._connect(3, None, None)
    try:
        conn.sock.sendall(
            _raw(ops.Put(key_digest(a), a, dumps_value(1), 0, 1), 1)
            + _raw(ops.WaitFor(key_digest(c), 0, dumps_value(2).join(), 30.0), 2)
        )
        assert _replies(conn.sock, 1) == [(0, 1, 0, b"")]  # (the put's, while the wait waits)
        other.call(ops.Put(key_digest(c), c, dumps_value(2), 0, 1))
        assert _replies(conn.sock, 1) == [(0, 2, 0, b"")]
    finally:
        conn.sock.close()


def test_replies_kept_back_are_sent_before_a_failed_request_drops_the_connection(served):
    """[a get (its reply kept back), a put asking no reply for a manager not here]: the
    put's failure ends the connection, and the get's reply still reaches the client."""
    channel, _, _ = served
    ch = channel(True)
    kb = dumps_key("k")
    ch.call(ops.Put(key_digest(kb), kb, dumps_value(1), 0, 1))
    conn = ch.link._connect(3, None, None)
    try:
        conn.sock.sendall(
            _raw(ops.Get(key_digest(kb), 0), 1)
            + _raw(ops.Put(key_digest(kb), kb, dumps_value(2), 0, 1), 2, mid=99, flags=FLAG_NOREPLY)
        )
        conn.sock.settimeout(10)
        data = b""
        while chunk := conn.sock.recv(1 << 16):
            data += chunk
        status, tag, _, plen = REP.unpack_from(data)
        assert (status, tag) == (0, 1) and loads_value(data[REP.size : REP.size + plen]) == 1
        assert len(data) == REP.size + plen  # (and nothing for the put)
    finally:
        conn.sock.close()


def test_a_waiting_put_of_a_client_gone_meanwhile_times_out_and_is_not_applied(looped_waiting):
    """[a slow get (its reply kept back), a put that must wait, 0.5 s timeout], the
    client gone before the put waits: handing the loop on (which sends the kept-back
    reply) fails quietly, and the put times out unapplied instead of staying queued."""
    import time

    channel, _, _ = looped_waiting
    ch, server, manager = channel(True), channel.server, channel.manager
    k, k2 = dumps_key("k"), dumps_key("k2")
    ch.call(ops.Put(key_digest(k), k, dumps_value(1), 0, 1))  # (the writers of 0: client 1)
    get = server.handlers[Op.GET]

    def slow_get(m, r, reply):  # (the loop is busy a moment: the client leaves meanwhile)
        time.sleep(0.3)
        get(m, r, reply)

    server.handlers[Op.GET] = slow_get
    try:
        conn = ch.link._connect(3, None, None)
        conn.sock.sendall(
            _raw(ops.Get(key_digest(k), 0), 1)
            + _raw(ops.Put(key_digest(k2), k2, dumps_value(2), 1, 2, timeout=0.5), 2)
        )
        conn.sock.close()
        time.sleep(1.0)  # (past the put's timeout)
        for _ in range(500):  # (it times out by then; on a loaded machine a little later)
            if not manager._deferred.waiting:
                break
            time.sleep(0.02)
    finally:
        server.handlers[Op.GET] = get
    assert len(manager._deferred.waiting) == 0
    ch.call(ops.Put(key_digest(k), k, dumps_value(3), 1, 1))  # (client 1 moves on)
    with pytest.raises(DDictKeyError):
        ch.call(ops.Get(key_digest(k2), 1))


@pytest.mark.timeout(60)
def test_a_client_that_reads_nothing_holds_up_no_other_client(looped_waiting):
    """A client whose socket is full pipelines [a get, a put that must wait]: the get's
    kept-back reply cannot go, and handing the loop on for the waiting put leaves it to
    a thread of its own instead of waiting with the manager's lock held; another
    client's put is served at once, and the get's reply comes once the client reads."""
    import threading
    import time

    channel, _, _ = looped_waiting
    ch, other, server = channel(True), channel(True), channel.server
    k, k2 = dumps_key("k"), dumps_key("k2")
    ch.call(ops.Put(key_digest(k), k, dumps_value(1), 0, 1))
    conn, filled = _stalled(ch, server)
    try:
        conn.sock.sendall(
            _raw(ops.Get(key_digest(k), 0), 1)
            + _raw(ops.Put(key_digest(k2), k2, dumps_value(2), 1, 2, timeout=30), 2)
        )
        time.sleep(0.5)
        done = threading.Event()
        z = dumps_key("z")
        threading.Thread(
            target=lambda: (
                other.call(ops.Put(key_digest(z), z, dumps_value(0), 0, 3)),
                done.set(),
            ),
            daemon=True,
        ).start()
        assert done.wait(10), "another client's put waited for a client that reads nothing"
        conn.sock.settimeout(20)
        got = b""
        while len(got) < filled:  # (the filler first, then the get's reply)
            got += conn.sock.recv(min(1 << 20, filled - len(got)))
        status, tag, _, plen = REP.unpack(_recv_exact(conn.sock, REP.size))
        assert (status, tag) == (0, 1) and loads_value(_recv_exact(conn.sock, plen)) == 1
    finally:
        conn.sock.close()


@pytest.mark.timeout(60)
def test_a_delivered_reply_waits_for_its_manager_off_the_loop(looped):
    """A pop with a request id and a large reply, then the connection's next request
    while the manager's lock is held (as a move holds it): dropping the kept reply waits
    for the lock after handing the loop on, so another client's get is served at once;
    the next request is answered once the lock is free."""
    import threading

    channel, _, _ = looped
    ch, other, manager = channel(True), channel(True), channel.manager
    big, k = dumps_key("big"), dumps_key("k")
    ch.call(ops.Put(key_digest(big), big, dumps_value(b"b" * 10_000), 0, 1))
    ch.call(ops.Put(key_digest(k), k, dumps_value(1), 0, 1))
    conn = ch.link._connect(3, None, None)
    try:
        conn.sock.sendall(_raw(ops.Pop(key_digest(big), 0, 1), 1, rid=77))
        status, tag, _, plen = REP.unpack(_recv_exact(conn.sock, REP.size))
        assert (status, tag) == (0, 1) and loads_value(
            _recv_exact(conn.sock, plen)
        ) == b"b" * 10_000
        assert 77 in manager._big_replies  # (kept until the client shows it read it)
        with manager._mutex:  # (a move holds the manager's lock)
            conn.sock.sendall(_raw(ops.Length(0), 2))
            done = threading.Event()
            threading.Thread(
                target=lambda: (other.call(ops.Get(key_digest(k), 0)), done.set()), daemon=True
            ).start()
            assert done.wait(10), "the event loop waited for a manager's lock"
        status, tag, ival, plen = REP.unpack(_recv_exact(conn.sock, REP.size))
        assert (status, tag, ival) == (0, 2, 1) and 77 not in manager._big_replies
    finally:
        conn.sock.close()


def _stalled(ch: SocketChannel, server: HostServer) -> tuple[Any, int]:
    """A new connection of ``ch`` whose host end's send buffer is full (a client that
    reads nothing), and the filler bytes in it (to be read before any reply)."""
    import time

    before = set(server._conns)
    conn = ch.link._connect(3, None, None)
    host_end = next(iter(set(server._conns) - before))
    for _ in range(500):  # (its handshake's timeout is lifted just after the client's end)
        if host_end.gettimeout() is None:
            break
        time.sleep(0.01)
    filled = 0
    while True:
        try:
            filled += host_end.send(b"\0" * 4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return conn, filled


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the host closed the connection"
        data += chunk
    return data


@pytest.mark.timeout(60)
def test_an_error_reply_to_a_client_that_reads_nothing_holds_up_no_other_client(looped):
    """A get of a missing key from a client whose socket is full: its error reply waits
    for that client after handing the loop on, and another client is served at once."""
    import threading
    import time

    channel, _, _ = looped
    ch, other, server = channel(True), channel(True), channel.server
    z = dumps_key("z")
    other.call(ops.Put(key_digest(z), z, dumps_value(0), 0, 3))  # (connected first)
    conn, _ = _stalled(ch, server)
    try:
        conn.sock.sendall(_raw(ops.Get(key_digest(dumps_key("missing")), 0), 1))
        time.sleep(0.5)
        done = threading.Event()
        threading.Thread(
            target=lambda: (
                other.call(ops.Put(key_digest(z), z, dumps_value(1), 0, 3)),
                done.set(),
            ),
            daemon=True,
        ).start()
        assert done.wait(10), "the event loop waited for a client that reads nothing"
    finally:
        conn.sock.close()


@pytest.mark.parametrize("use_uds", [True, False])
def test_a_kept_connection_that_broke_is_resent_or_said_maybe_applied(served, use_uds):
    """The host dropped an idle connection (as a restarted host would): a read or an
    idempotent write on it is sent again on a new one; an operation that cannot be
    resent says that it may or may not have been applied."""
    channel, _, _ = served
    ch = channel(use_uds)
    kb = dumps_key("k")
    ch.call(ops.Put(key_digest(kb), kb, dumps_value(1), 0, 1))

    def drop_the_hosts_ends() -> None:  # (ours stay kept: the next request goes out on one)
        for end in channel.host_ends():
            try:
                end.shutdown(socket.SHUT_RDWR)  # (it never answers on it: EOF, or a reset)
            except OSError:
                pass  # (an end of a connection that broke before, not yet forgotten)

    before = list(ch.link._all)
    drop_the_hosts_ends()
    assert loads_value(ch.call(ops.Get(key_digest(kb), 0))) == 1
    assert ch.link._all and not set(ch.link._all) & set(before)  # a new connection
    drop_the_hosts_ends()
    ch.call(ops.Put(key_digest(kb), kb, dumps_value(2), 0, 1))
    assert loads_value(ch.call(ops.Get(key_digest(kb), 0))) == 2

    class Unsafe(ops.Length):  # (as an operation that cannot be resent would be)
        kind = Kind.UNSAFE

    drop_the_hosts_ends()
    with pytest.raises(DDictError, match="LEN .*may or may not have been applied"):
        ch.call(Unsafe(0))
    assert ch.call(Unsafe(0)) == 1  # (then on a new connection)


@pytest.mark.timeout(30)  # (closed: a wait that went on would go on for good)
@pytest.mark.parametrize("closed", [False, True])
def test_a_kept_same_host_connection_checks_its_host_while_it_waits(tmp_path, closed):
    """On the same host a wait is cut into ``alive-check`` slices and the host's
    supervisor is checked between them: a host that never answers and whose
    supervisor is gone raises at once, and the connection is not kept (its late
    answer would be read as the next request's).  ``closed``: the link is closed by
    another thread between two slices (a dictionary closing): the wait ends there."""
    from dask_ddict.errors import DDictManagerUnavailableError
    from dask_ddict.transport.bounded_connection import BoundedConnection
    from dask_ddict.transport.idle_pool import IDLE_POOL

    info = ManagerInfo(
        3,
        "w",
        "h",
        "h:b",
        os.getpid(),
        str(tmp_path / "none.sock"),
        "127.0.0.1",
        1,
        str(tmp_path / "shard"),
    )
    import dask.config

    with dask.config.set({"ddict.transport.alive-check": "20 ms"}):
        link = HostLink(info, secrets.token_hex(16), "s", "quiet", use_uds=True)
    ours, silent = socket.socketpair()  # (a host that reads requests and never answers)
    conn = BoundedConnection(ours, link._every)
    conn.begin(None, None)
    link._all.append(conn)
    IDLE_POOL.give(link, conn)
    checks = []

    def check() -> None:
        checks.append(1)
        if closed:
            link.close()  # (its connections in use too)
        elif len(checks) == 3:
            raise DDictManagerUnavailableError("manager 3 is gone (its supervisor ended)")

    link._checker = lambda mid: check  # type: ignore[method-assign]
    try:
        with pytest.raises(
            DDictManagerUnavailableError,
            match="socket file is gone" if closed else "supervisor ended",
        ):
            link.call(ops.Length(0), 3)  # (closed: sent again, to a host that is not there)
        assert len(checks) == (1 if closed else 3) and silent.recv(1 << 16)  # (it went out)
        assert conn not in link._all and not link.idle and ours.fileno() == -1
    finally:
        link.close()
        silent.close()
