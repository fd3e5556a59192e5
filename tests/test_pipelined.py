"""AsyncDDict's requests pipelined with tags over an event loop's shared connections
(:mod:`dask_ddict.transport.pipelined`): the pipe alone, then on a real cluster over TCP."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import dask.config
import numpy as np
import psutil
import pytest
from distributed import Client

from dask_ddict import AsyncDDict, DDict, DDictTimeoutError
from dask_ddict.transport import channels
from dask_ddict.transport.many_key_ops import GetMany, PutMany
from dask_ddict.transport.operation import Kind
from dask_ddict.transport.pipelined import Pipe, Unpipeable
from dask_ddict.transport.protocol import REP, REQ
from tests.support.cluster import local_cluster

# -- the pipe alone (a fake transport that records what is written) ------------------------


class _Link:
    name, kind, _every, info = "d", "tcp", None, None
    terms: dict[int, int] = {}  # (its managers' terms: none)

    def __repr__(self) -> str:
        return "<link>"


class _Transport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.sent.append(bytes(data))

    def writelines(self, parts: Any) -> None:
        self.sent.append(b"".join(bytes(p) for p in parts))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True


class _Sock:
    def close(self) -> None:
        pass


def _pipe() -> tuple[Pipe, _Transport]:
    p = Pipe(_Link(), 0, _Sock())  # type: ignore[arg-type]
    t = _Transport()
    p.connection_made(t)  # type: ignore[arg-type]
    return p, t


def _reply(tag: int, payload: bytes, status: int = 0, ival: int = 0) -> bytes:
    return REP.pack(status, tag, ival, len(payload)) + payload


def _feed(p: Pipe, data: bytes, most: int = 1 << 30) -> None:
    """What the event loop does with received bytes: into the pipe's buffers, at most
    ``most`` at a time."""
    while data:
        buf = p.get_buffer(-1)
        n = min(len(buf), len(data), most)
        assert n > 0  # (never an empty buffer)
        buf[:n] = data[:n]
        data = data[n:]
        p.buffer_updated(n)


def _tags(t: _Transport) -> list[int]:
    return [REQ.unpack_from(m)[5] for m in t.sent]


def test_replies_are_matched_to_requests_by_tag_in_any_order_and_in_any_pieces():
    async def main() -> None:
        p, t = _pipe()
        ops = [GetMany(((0, [bytes(16)]),), 0, None) for _ in range(3)]
        futs = [p.send(o, o.encode(), 0) for o in ops]
        tags = _tags(t)
        assert tags == [tag for tag, _ in futs] and len(set(tags)) == 3  # one tag each
        stream = (
            _reply(tags[2], b"third")
            + _reply(tags[0], b"first" * 2000)
            + _reply(tags[1], b"second")
        )
        _feed(p, stream, most=7)  # (in 7-byte pieces, headers cut anywhere)
        got = [await f for _, f in futs]
        assert [bytes(g[2]) for g in got] == [b"first" * 2000, b"second", b"third"]
        assert not p.pending and p._pos == p._end and p._into is None  # (all read)

    asyncio.run(main())


def test_a_request_given_up_on_drops_its_late_reply_and_a_waiting_one_closes_its_pipe():
    async def main() -> None:
        p, t = _pipe()
        read = GetMany(((0, [bytes(16)]),), 0, 1.0)
        tag, fut = p.send(read, read.encode(), 0)
        p.give_up(tag, DDictTimeoutError("late"))
        with pytest.raises(DDictTimeoutError):
            await fut
        tag2, fut2 = p.send(read, read.encode(), 0)
        _feed(p, _reply(tag, b"stale") + _reply(tag2, b"fresh"))  # the late one first
        assert bytes((await fut2)[2]) == b"fresh" and not t.closed
        # A put may wait on the host: no request joins its connection until it is answered,
        # and one given up on closes it (what was sent after it would wait behind it).
        put = PutMany([], 0, 1, False, 1.0)
        assert put.kind is Kind.IDEMPOTENT
        tag3, _ = p.send(put, put.encode(), 0)
        assert p.waits == 1
        _feed(p, _reply(tag3, b""))
        assert p.waits == 0
        tag4, fut4 = p.send(put, put.encode(), 0)
        p.give_up(tag4, DDictTimeoutError("late"))
        assert t.aborted and p.closed  # (what was not sent of it never is: it failed)
        with pytest.raises(DDictTimeoutError):
            await fut4

    asyncio.run(main())


def test_large_payloads_are_received_into_their_own_buffers_whatever_the_pieces():
    """Large replies go straight into their request's (aligned) buffer, small ones and
    headers through the pipe's; a late large reply is read past; pieces of any size."""
    rng = np.random.default_rng(5)

    async def main() -> None:
        for most in (7, 4093, 65536, 1 << 30):  # (7: every header split too)
            p, _ = _pipe()
            ops = [GetMany(((0, [bytes(16)]),), 0, None) for _ in range(5)]
            sent = [p.send(o, o.encode(), 0) for o in ops]
            p.give_up(sent[1][0], DDictTimeoutError("late"))  # (its reply comes anyway)
            bodies = [rng.bytes(n) for n in (300_000, 200_000, 17, 5000, 70_000)]
            _feed(p, b"".join(_reply(tag, body) for (tag, _), body in zip(sent, bodies)), most)
            for i in (0, 2, 3, 4):
                got = (await sent[i][1])[2]
                assert bytes(got) == bodies[i], (most, i)
                if len(bodies[i]) >= 4096:
                    assert type(got) is memoryview  # (the request's own buffer)
            assert not p.pending and p._into is None and p._pos == p._end

    asyncio.run(main())


def test_a_reply_that_cannot_be_received_fails_its_request():
    class _NoRoom(GetMany):
        def buffer(self, nbytes: int) -> Any:
            raise MemoryError(f"no room for {nbytes} bytes")

    async def main() -> None:
        p, _ = _pipe()
        big, small = _NoRoom(((0, [bytes(16)]),), 0, None), GetMany(((0, [bytes(16)]),), 0, None)
        (tag1, fut1), (tag2, fut2) = p.send(big, big.encode(), 0), p.send(small, small.encode(), 0)
        _feed(p, _reply(tag1, bytes(8192)) + _reply(tag2, b"ok"))
        with pytest.raises(MemoryError, match="no room"):
            await fut1
        with pytest.raises(Unpipeable):  # (its bytes unread: the connection cannot go on)
            await fut2
        assert p.closed and not p.pending

    asyncio.run(main())


def test_idle_pipes_beyond_the_newest_open_one_are_closed():
    """Puts in flight each hold a pipe of their own: once answered, those pipes do not
    stay open beside the one that takes the next requests."""

    class _P:
        def __init__(self, waits: int = 0, pending: int = 0) -> None:
            self.closed, self.waits, self.pending = False, waits, dict.fromkeys(range(pending))

        def close(self) -> None:
            self.closed = True

    class _L(_Link):
        closed = False

        def __init__(self) -> None:
            import weakref

            self.pipes: Any = weakref.WeakKeyDictionary()

    async def main() -> None:
        from dask_ddict.transport.pipelined import Pipes

        pipes = Pipes(_L(), asyncio.get_running_loop())  # type: ignore[arg-type]
        idle_old, busy_read, waiting, newest = _P(), _P(pending=2), _P(waits=1, pending=1), _P()
        pipes.pipes = [idle_old, busy_read, waiting, newest]  # type: ignore[list-item]
        assert pipes._open() is newest
        assert idle_old.closed and not busy_read.closed and not waiting.closed
        assert pipes.pipes == [busy_read, waiting, newest]
        pipes._close_now()

    asyncio.run(main())


def test_connecting_errors_are_raised_as_the_blocking_path_would_or_sent_there():
    import errno

    from dask_ddict import DDictClosedError
    from dask_ddict.errors import DDictManagerMovedError
    from dask_ddict.transport.pipelined import Pipes

    async def main() -> None:
        link = _Link()
        link.pipes = {}  # type: ignore[attr-defined]
        pipes = Pipes(link, asyncio.get_running_loop())  # type: ignore[arg-type]
        for raised, seen in [
            (TimeoutError("not connected in time"), TimeoutError),
            (TimeoutError(errno.ETIMEDOUT, "kernel"), Unpipeable),
            (ConnectionResetError("restarting"), Unpipeable),
            (DDictManagerMovedError("moved"), Unpipeable),
            (DDictClosedError("destroyed"), DDictClosedError),
        ]:

            def connect(mid: int, deadline: Any, e: BaseException = raised) -> Any:
                raise e

            link.connect_detached = connect  # type: ignore[attr-defined]
            with pytest.raises(seen):
                await pipes.pipe(0, None)
        pipes._close_now()

    asyncio.run(main())


def test_a_connection_made_for_a_caller_that_left_is_closed():
    import socket
    import threading

    from dask_ddict.transport.pipelined import Pipes

    made: list[socket.socket] = []
    go = threading.Event()

    def connect(mid: int, deadline: Any) -> socket.socket:
        go.wait(5)
        a, b = socket.socketpair()
        b.close()
        made.append(a)
        return a

    async def main() -> None:
        link = _Link()
        link.pipes = {}  # type: ignore[attr-defined]
        link.connect_detached = connect  # type: ignore[attr-defined]
        pipes = Pipes(link, asyncio.get_running_loop())  # type: ignore[arg-type]
        task = asyncio.create_task(pipes.pipe(0, None))
        await asyncio.sleep(0.05)
        task.cancel()  # (while it connects)
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()
        for _ in range(500):
            if made and made[0].fileno() == -1:
                break
            await asyncio.sleep(0.01)
        assert made and made[0].fileno() == -1 and not pipes.pipes
        pipes._close_now()

    asyncio.run(main())


def test_a_lost_connection_sends_its_requests_by_the_blocking_path():
    async def main() -> None:
        p, _ = _pipe()
        read = GetMany(((0, [bytes(16)]),), 0, None)
        _, fut = p.send(read, read.encode(), 0)
        p.connection_lost(ConnectionResetError("reset"))
        assert p.closed
        with pytest.raises(Unpipeable, match="ended"):
            await fut

    asyncio.run(main())


def test_a_same_host_pipe_whose_supervisor_is_gone_sends_by_the_blocking_path():
    """While requests are in flight on a Unix-socket pipe, the host's supervisor is checked
    every alive-check (a stopped host process and a dead one look alike from a socket):
    once it is gone, they go by the blocking path, which says so."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # (a pid that no process has now)

    class _Info:
        pid = gone.pid

    class _UdsLink(_Link):
        kind, _every, info = "uds", 0.05, _Info()

    async def main() -> None:
        p = Pipe(_UdsLink(), 0, _Sock())  # type: ignore[arg-type]
        t = _Transport()
        p.connection_made(t)  # type: ignore[arg-type]
        read = GetMany(((0, [bytes(16)]),), 0, None)
        _, fut = p.send(read, read.encode(), 0)
        with pytest.raises(Unpipeable, match="supervisor .* is gone"):
            await asyncio.wait_for(fut, 5)
        assert t.closed

    asyncio.run(main())


# -- on a cluster, over TCP ------------------------------------------------------------------


def _tcp(d: DDict, timeout: float | None = None) -> AsyncDDict:
    """An asynchronous handle of ``d`` that reaches every manager over TCP (its channels
    made: an event loop's first batch would make them in a worker thread)."""
    with dask.config.set({"ddict.local-transport": False}):
        t = DDict.attach(d.serialize(), timeout=timeout)
        for m in range(d.num_managers):
            t._core.channel(m)
    return AsyncDDict(t)


def _blocking_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the blocking path's many-key calls made from now on."""
    calls: list[str] = []
    for name in ("get_many", "each"):
        real = getattr(channels.Channels, name)

        def counted(
            self: Any, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any
        ) -> Any:
            calls.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(channels.Channels, name, counted)
    real_put = DDict._put_many

    def put_many(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append("put_many")
        return real_put(self, *args, **kwargs)

    monkeypatch.setattr(DDict, "_put_many", put_many)
    return calls


def test_coroutines_share_one_connection_per_host_with_no_thread(client, monkeypatch):
    """200 coroutines, each putting then getting its own keys one after another: every
    request is written on the loop's connections as it is made (one per host for the
    gets, which never wait), answered by tag, with no worker thread and no blocking
    call; the values are the ones put."""
    with DDict(total_mem="64 MiB", client=client) as d:
        t = _tcp(d)
        links = {t.ddict._core.channel(m).link for m in range(d.num_managers)}
        assert len(links) >= 2 and all(link.kind == "tcp" for link in links)
        calls = _blocking_calls(monkeypatch)

        async def main() -> None:
            async def one(c: int) -> list[Any]:
                for i in range(20):
                    await t.put((c, i), np.full(3, c * 100 + i))
                return [await t.get((c, i)) for i in range(20)]

            got = await asyncio.gather(*(one(c) for c in range(200)))
            for c, values in enumerate(got):
                assert [int(v[0]) for v in values] == [c * 100 + i for i in range(20)]
            loop = asyncio.get_running_loop()
            for link in links:
                pipes = link.pipes[loop].pipes
                assert 1 <= len(pipes) <= 4, pipes  # (puts in flight may each hold one)
            assert await t.get("absent", "dflt") == "dflt"

        asyncio.run(main())
        assert calls == []  # nothing went by the blocking path
        assert d.get_many([(c, 19) for c in range(200)])[199][0] == 199 * 100 + 19
        t.detach()


def test_a_batch_over_pipes_and_same_host_shards_at_once(client, monkeypatch):
    """One manager reached by TCP (pipelined), the other read and written from its shard
    on this host (in a worker thread meanwhile): each key's put and get lands where it
    belongs, in one batch per loop turn."""
    with DDict(total_mem="64 MiB", client=client) as d:
        t = DDict.attach(d.serialize())
        with dask.config.set({"ddict.local-transport": False}):
            t._core.channel(0)  # a socket channel: pipelined
        assert t._core.channel(1).kind == "shm"  # its shard, read here
        assert list(t._core.pipe_links([0, 1])) == [0]
        at = AsyncDDict(t)
        keys = list(range(300))
        assert {d.which_manager(k) for k in keys} == {0, 1}
        calls = _blocking_calls(monkeypatch)

        async def main() -> None:
            await asyncio.gather(*(at.put(k, -k) for k in keys))
            assert await asyncio.gather(*(at.get(k) for k in keys)) == [-k for k in keys]

        asyncio.run(main())
        assert calls.count("put_many") == 1 and calls.count("get_many") == 1  # (the shard's)
        assert d.get_many(keys) == [-k for k in keys]
        t.detach()


def test_large_values_travel_the_pipes_whole_and_aligned(client, monkeypatch):
    """Large values beside small ones, gathered: each large reply is received into its
    own buffer, numpy arrays come out 64-byte aligned, and nothing goes by the blocking
    path (a get_many reply is sent in parts, never joined, and read as one)."""
    with DDict(total_mem="256 MiB", client=client) as d:
        t = _tcp(d)
        calls = _blocking_calls(monkeypatch)
        big = {f"big{i}": np.arange(i, i + (1 << 20), dtype="f8") for i in range(4)}  # 8 MiB

        async def main() -> None:
            await asyncio.gather(
                *(t.put(k, v) for k, v in big.items()), *(t.put(i, i) for i in range(100))
            )
            got = await asyncio.gather(*(t.get(k) for k in big), *(t.get(i) for i in range(100)))
            for (k, v), g in zip(big.items(), got):
                np.testing.assert_array_equal(g, v)
                assert g.ctypes.data % 64 == 0, k
            assert list(got[len(big) :]) == list(range(100))

        asyncio.run(main())
        assert calls == []
        t.detach()


def test_pipes_close_with_the_loop_and_with_the_handle(client):
    """No descriptor outlives ``asyncio.run`` or ``detach()``: each socket the loop's
    pipes opened is closed when the loop ends, and the blocking path's pooled ones and
    a later loop's pipes when the handle is detached.  (The sockets themselves, not
    the process's count of descriptors: the test cluster's own connections open and
    close meanwhile.)"""
    with DDict(total_mem="32 MiB", client=client) as d:
        d["k"] = 1
        t = _tcp(d)
        t.ddict["k"]  # (channels made; the blocking connections pooled)
        links = {t.ddict._core.channel(m).link for m in range(d.num_managers)}
        pooled = [c.sock for link in links for c in link.idle]
        assert pooled and all(s.fileno() >= 0 for s in pooled)

        def piped() -> list[Any]:
            loop = asyncio.get_running_loop()
            return [p.sock for link in links if loop in link.pipes for p in link.pipes[loop].pipes]

        async def use() -> Any:
            got = await asyncio.gather(*(t.get("k") for _ in range(10)))
            return got, piped()

        got, opened = asyncio.run(use())
        assert got == [1] * 10 and opened
        assert all(s.fileno() == -1 for s in opened)  # (closed as the loop ended)
        assert all(s.fileno() >= 0 for s in pooled)  # (the blocking path's: kept)

        async def detach() -> list[Any]:
            assert await t.get("k") == 1
            link = t.ddict._core.channel(d.which_manager("k")).link
            assert link.pipes[asyncio.get_running_loop()].pipes
            socks = piped()
            t.detach()
            await asyncio.sleep(0.05)
            assert asyncio.get_running_loop() not in link.pipes  # (nor kept for the loop)
            return socks

        later = asyncio.run(detach())
        assert later and all(s.fileno() == -1 for s in later)
        assert all(s.fileno() == -1 for s in pooled)  # (the blocking path's pooled ones too)


def test_a_stopped_host_times_out_once_and_its_late_replies_are_dropped(client):
    """Gets of a stopped host fail with its timeout; once it resumes, its replies to them
    come late on the same connection, are dropped by their tags, and the next gets are
    answered with their own values."""
    with DDict(total_mem="16 MiB", client=client) as d:
        d.update({i: i for i in range(20)})
        t = _tcp(d, timeout=1)
        t.ddict.get_many(range(20))  # (connected before the hosts stop)
        hosts = [psutil.Process(pid) for pid in {s.pid for s in d.stats}]

        async def main() -> None:
            assert await asyncio.gather(*(t.get(i) for i in range(20))) == list(range(20))
            for h in hosts:
                h.suspend()
            try:
                t0 = time.monotonic()
                got = await asyncio.gather(*(t.get(i) for i in range(20)), return_exceptions=True)
                took = time.monotonic() - t0
            finally:
                for h in hosts:
                    h.resume()
            assert all(isinstance(g, DDictTimeoutError) for g in got), got
            assert "did not answer GET_MANY" in str(got[0]) and took < 1 + 1.0 + 1.5
            for _ in range(3):  # the same pipes: late replies first, then these
                assert await asyncio.gather(*(t.get(i) for i in range(20))) == list(range(20))

        asyncio.run(main())
        t.detach()


def test_puts_in_flight_when_a_host_process_is_killed_are_all_acknowledged_and_kept():
    """A host process killed under pipelined puts (its supervisor starts another on the
    same listeners): the puts on the lost connection are sent again by the blocking path
    (a put again has the same effect), so every put succeeds, and every one is there."""
    with (
        local_cluster(1) as cl,
        Client(cl) as c,
    ):
        d = DDict(total_mem="64 MiB", client=c)
        try:
            t = _tcp(d)
            t.ddict["warm"] = 0
            pid = d.stats[0].pid

            async def main() -> int:
                acked = [0]

                async def writer(w: int) -> int:
                    for i in range(300):
                        await t.put((w, i), np.full(16, w * 1000 + i))
                        acked[0] += 1
                    return 300

                async def killer() -> None:
                    for _ in range(10_000):  # (until a quarter of the puts are answered)
                        if acked[0] >= 600:
                            break
                        await asyncio.sleep(0.001)
                    assert acked[0] < 8 * 300  # (the others are still to be put)
                    os.kill(pid, signal.SIGKILL)

                done = await asyncio.gather(*(writer(w) for w in range(8)), killer())
                return sum(n for n in done if n)

            assert asyncio.run(main()) == 8 * 300
            assert d.stats[0].pid != pid  # (it was killed under the puts, and replaced)
            got = d.get_many([(w, i) for w in range(8) for i in range(300)])
            assert [int(v[0]) for v in got] == [w * 1000 + i for w in range(8) for i in range(300)]
            t.detach()
        finally:
            d.destroy()


def test_a_stale_handles_pipelined_puts_and_gets_follow_a_moved_manager():
    """A manager moves to another worker under an asynchronous handle that has not seen
    the move: its old host answers the pipelined requests MOVED (a many-put, per
    manager), and each put and get follows it by the blocking path; nothing is lost
    and nothing fails."""
    with (
        local_cluster(3) as cl,
        Client(cl) as c,
    ):
        d = DDict(managers_per_worker=1, total_mem="96 MiB", client=c, timeout=30)
        try:
            t = _tcp(d, timeout=30)
            keys = [k for k in range(400) if d.which_manager(k) == 0][:40]
            others = [k for k in range(400) if d.which_manager(k) != 0][:40]

            async def put_all(base: int) -> None:
                await asyncio.gather(*(t.put(k, base + k) for k in keys + others))

            async def main() -> None:
                await put_all(0)
                home = d.manager_workers[0]
                away = next(w for w in d.manager_workers if w != home)
                there = await asyncio.to_thread(
                    c.sync, c.scheduler.ddict_move, name=d.get_name(), manager_id=0, worker=away
                )
                assert there["target"] == away
                await put_all(1000)  # its old host answers MOVED for manager 0's puts
                got = await asyncio.gather(*(t.get(k) for k in keys + others))
                assert got == [1000 + k for k in keys + others]  # (where manager 0 went)

            asyncio.run(main())
            assert d.manager_workers[0] != d.manager_workers[1]
            assert d.get_many(keys + others) == [1000 + k for k in keys + others]
            t.detach()
        finally:
            d.destroy()


def test_pipelined_writers_and_readers_go_on_through_a_retirement():
    """Coroutines keep putting and reading over TCP pipes while a worker retires: its
    managers move first (Dask moves a retiring worker's data, and so do we), its host's
    connections close under the pipes, and every put is acknowledged, every value read
    back is the one put, and all of them are there after the move."""
    from tests.support.writers import wait_gone

    with (
        local_cluster(3, memory_limit="1GiB") as cl,
        Client(cl) as c,
    ):
        d = DDict(managers_per_worker=1, total_mem="96 MiB", client=c, timeout=60)
        try:
            t = _tcp(d, timeout=60)
            leaving = d.manager_workers[0]

            async def main() -> list[int]:
                done, after = [0], [0]
                moved = asyncio.Event()

                async def writer(w: int) -> int:
                    i = 0
                    while i < 20_000 and (not moved.is_set() or after[0] < 600):
                        await t.put((w, i), w * 100_000 + i)
                        assert await t.get((w, i)) == w * 100_000 + i
                        done[0] += 1
                        after[0] += moved.is_set()
                        i += 1
                    return i

                async def retire() -> int:
                    for _ in range(10_000):  # (once writing is well under way)
                        if done[0] >= 300:
                            break
                        await asyncio.sleep(0.001)
                    await asyncio.to_thread(
                        lambda: (c.retire_workers([leaving]), wait_gone(d, leaving))
                    )
                    moved.set()
                    return 0

                return list(await asyncio.gather(*(writer(w) for w in range(6)), retire()))

            counts = asyncio.run(main())[:6]
            assert leaving not in d.manager_workers and d.moves
            assert min(counts) > 50 and max(counts) < 20_000  # (writing before and after)
            keys = [(w, i) for w, n in enumerate(counts) for i in range(n)]
            assert d.get_many(keys) == [w * 100_000 + i for w, i in keys]
            t.detach()
        finally:
            d.destroy()
