"""Requests of one event loop, pipelined with tags over shared connections.

:class:`~dask_ddict.AsyncDDict` is used from an event loop by many coroutines
at once.  The blocking key path (:mod:`.socket_client`: a pooled connection per
operation, used from the calling thread) would cost such a caller a worker
thread and a connection per request in flight, and a hop to that thread and
back for each.  Here, instead, the coroutines of one loop share its
connections to a host process (:class:`Pipes`): a request is written as soon
as it is made, without waiting for the answers of those before it, and each
reply is matched to its request by the ``tag`` it repeats
(:data:`~.protocol.REP`).  The loop's own selector reads the replies: no thread,
no hop.  The host serves one connection's requests in order.

Only what cannot wait on the host travels on a connection that others share:
a request that may (a put, whose shard may be busy) closes its connection to
new requests until it is answered (:attr:`Pipe.waits`), so that no request
waits behind one that waits for something else.

Everything unusual goes by the blocking path instead, which already knows
what to do (it reconnects, retries, follows moved managers and explains why a
host cannot be reached): :class:`Unpipeable` says so to the caller, which
sends the same operations there.  That is safe because only reads and
idempotent operations are sent here (never ``pop``, ``fetch_add`` or a
batch).  So: a TLS link (the handshake and the records are the blocking
socket's), a connection that cannot be made or breaks, a value over the
host's limit, and a manager that moved.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .._serialize import SMALL_FRAME
from ..errors import DDictError, DDictManagerMovedError, Status, raise_for_status
from .operation import Encoded, Kind, Operation
from .protocol import REP, REQ, SMALL, encode_timeout

if TYPE_CHECKING:
    from .socket_client import HostLink

_HEAD = REP.size
_MOVED = int(Status.MOVED)
_LEASE = int(Status.LEASE)
_TAGS = 1 << 32


class Unpipeable(Exception):
    """This request must go by the blocking path (:mod:`.socket_client`): see the module's doc."""


class Pipe(asyncio.BufferedProtocol):
    """One connection to a host process, shared by the coroutines of one event loop.

    Replies are received into a buffer of the pipe's (headers and small payloads), and a
    large payload straight into its request's own buffer (aligned, as the blocking path
    receives it: one copy, by the kernel).

    Parameters
    ----------
    link
        The host's link (its name for messages, its liveness check).
    mid
        A manager of the host (named when its liveness check fails).
    sock
        The connected socket, its handshake done (closed with the pipe).
    """

    def __init__(self, link: HostLink, mid: int, sock: socket.socket) -> None:
        self.link = link
        self.sock = sock
        self.transport: asyncio.Transport | None = None
        #: ``tag -> (future of (status, ival, payload), operation)`` of requests in flight.
        self.pending: dict[int, tuple[asyncio.Future[Any], Operation]] = {}
        #: Requests in flight that may wait on the host: none joins them while there are.
        self.waits = 0
        self.closed = False
        self._tag = 0
        self._buf = bytearray(SMALL)
        self._mv = memoryview(self._buf)
        self._pos = self._end = 0  # (the received bytes not read yet: _buf[_pos:_end])
        #: A large payload being received into its own buffer: (future, status, ival, buffer).
        self._into: tuple[asyncio.Future[Any], int, int, Any] | None = None
        self._have = 0
        #: Same host: the host's supervisor, checked while requests are in flight.
        self._pid = link.info.pid if link.kind == "uds" else None
        self._every = link._every or 1.0
        self._checking: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        return (
            f"<Pipe {self.link.name!r} {self.link.kind} in flight={len(self.pending)} "
            f"waits={self.waits}{' closed' if self.closed else ''}>"
        )

    # -- asyncio.BufferedProtocol -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._into is not None:
            return memoryview(self._into[3])[self._have :]
        return self._mv[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._into is not None:
            self._have += nbytes
            fut, status, ival, payload = self._into
            if self._have == memoryview(payload).nbytes:
                self._into = None
                if not fut.done():
                    fut.set_result((status, ival, payload))
            return
        self._end += nbytes
        self._read()

    def _read(self) -> None:
        """Deliver every whole reply received; start receiving a large payload into its
        request's buffer; make room for the rest."""
        buf, mv, pending = self._buf, self._mv, self.pending
        need = _HEAD
        while self._end - self._pos >= _HEAD:
            status, tag, ival, plen = REP.unpack_from(buf, self._pos)
            start = self._pos + _HEAD
            have = self._end - start
            entry = pending.get(tag)
            if have < plen and (entry is None or plen < SMALL_FRAME):
                need = _HEAD + plen  # (a small payload, or a late reply's: buffered here)
                break
            self._pos = start + min(have, plen)
            if entry is None:
                continue  # (the late reply of a request given up on: dropped)
            del pending[tag]
            fut, o = entry
            if o.kind is not Kind.READ:
                self.waits -= 1
            try:
                if plen >= SMALL_FRAME:  # (aligned, as the blocking path receives it)
                    payload: Any = o.buffer(plen)
                    payload[: min(have, plen)] = mv[start : self._pos]
                else:
                    payload = bytes(mv[start : self._pos])
            except Exception as e:  # noqa: BLE001 - (no room for it) this request's; the
                _settle(fut, e)  # connection cannot go on without reading its bytes
                self._fail(Unpipeable(f"a reply from {self.link!r} could not be received"))
                self.close(abort=True)
                return
            if have < plen:  # the rest straight into it
                self._into, self._have = (fut, status, ival, payload), have
                self._pos = self._end = 0
                return
            if not fut.done():
                fut.set_result((status, ival, payload))
        self._room(need)

    def _room(self, need: int) -> None:
        """Room for ``need`` bytes from the read position (moved down, or a bigger buffer)."""
        n = self._end - self._pos
        if n == 0:
            self._pos = self._end = 0
            if len(self._buf) > 4 * SMALL and need <= SMALL:  # (grown for a late large
                self._buf = bytearray(SMALL)  # reply: not kept)
                self._mv = memoryview(self._buf)
        if self._pos + need <= len(self._buf) and self._end < len(self._buf):
            return
        if need > len(self._buf):
            grown = bytearray(max(need, 2 * len(self._buf)))
            grown[:n] = self._mv[self._pos : self._end]
            self._buf, self._mv = grown, memoryview(grown)
        else:
            self._mv[:n] = self._mv[self._pos : self._end]
        self._pos, self._end = 0, n

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._checking is not None:
            self._checking.cancel()
        error = Unpipeable(f"the connection to {self.link!r} ended ({exc!r})")
        if self._into is not None:
            _settle(self._into[0], error)
            self._into = None
        self._fail(error)
        self.sock.close()

    def _fail(self, error: BaseException) -> None:
        pending, self.pending = self.pending, {}
        self.waits = 0
        for fut, _ in pending.values():
            _settle(fut, error)

    # -- requests -----------------------------------------------------------------------

    def send(self, o: Operation, encoded: Encoded, mid: int) -> tuple[int, asyncio.Future[Any]]:
        """Write ``o`` (``encoded``) for manager ``mid`` now; its tag, and the future of
        its reply."""
        flags, keysec, value, vlen, chkpt, arg, client, timeout = encoded
        self._tag = tag = self._tag % (_TAGS - 1) + 1
        head = REQ.pack(
            o.op,
            flags,
            self.link.terms.get(mid, 0),
            len(keysec),
            mid,
            tag,
            chkpt,
            arg,
            client,
            encode_timeout(timeout),
            vlen,
            0,
        )
        transport = self.transport
        assert transport is not None
        if REQ.size + len(keysec) + vlen <= SMALL:
            transport.write(b"".join((head, keysec, *value)))
        else:
            transport.writelines((head, keysec, *value))
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if not self.pending and self._pid is not None and self._checking is None:
            self._checking = asyncio.get_running_loop().call_later(self._every, self._alive)
        self.pending[tag] = (fut, o)
        if o.kind is not Kind.READ:
            self.waits += 1
        return tag, fut

    def give_up(self, tag: int, error: BaseException) -> None:
        """Request ``tag`` is answered with ``error`` (its deadline passed); its reply, when
        it comes, is dropped."""
        entry = self.pending.pop(tag, None)
        if entry is None:
            return
        fut, o = entry
        _settle(fut, error)
        if o.kind is not Kind.READ:  # (it may still be waiting on the host, ahead of any
            self.close(abort=True)  # request sent after it: the others go by the blocking
            # path; and what is not sent yet of it never is: its caller was told it failed)

    def _alive(self) -> None:
        """While requests are in flight on a same-host connection: its host's supervisor
        lives, checked every ``ddict.transport.alive-check`` (as the blocking path does).
        A gone one closes the pipe: the blocking path says why (here, on the event loop,
        nothing may ask the orchestrator)."""
        self._checking = None
        if not self.pending or self.closed or self._pid is None:
            return
        try:
            os.kill(self._pid, 0)
        except ProcessLookupError:
            self._fail(Unpipeable(f"the supervisor of {self.link!r} is gone"))
            self.close(abort=True)
            return
        except PermissionError:
            pass  # alive, under another user
        self._checking = asyncio.get_running_loop().call_later(self._every, self._alive)

    def close(self, abort: bool = False) -> None:
        """Close the connection (``abort``: at once, dropping what is not sent yet)."""
        self.closed = True
        if self.transport is None:
            self.sock.close()
        elif abort:
            self.transport.abort()
        else:
            self.transport.close()


def _close_made(connecting: asyncio.Future[socket.socket]) -> None:
    """A connection made for a caller that left: closed (or its error, seen)."""
    if not connecting.cancelled() and connecting.exception() is None:
        connecting.result().close()


def _settle(fut: asyncio.Future[Any], error: BaseException) -> None:
    """``fut`` fails with ``error``, marked as seen: a request whose caller stopped
    waiting (cancelled) leaves no "exception was never retrieved" behind."""
    if not fut.done():
        fut.set_exception(error)
        fut.exception()


class Pipes:
    """The pipes of one event loop to one host process (one link).

    A request takes the most recent pipe that no waiting request closed, or a new
    one (connected in a worker thread: the handshake is the blocking link's).  The
    pipes close with the link, or when the loop's ``asyncio.run`` ends (a task holds
    them: it is cancelled then).
    """

    def __init__(self, link: HostLink, loop: asyncio.AbstractEventLoop) -> None:
        self.link = link
        self.loop = loop
        self.pipes: list[Pipe] = []
        self._connecting = asyncio.Lock()
        self._keeper = loop.create_task(self._keep(), name=f"ddict-pipes {link.name!r}")

    def __repr__(self) -> str:
        return f"<Pipes {self.link!r} {len(self.pipes)} connections>"

    async def _keep(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            self._close_now()

    def _open(self) -> Pipe | None:
        """The most recent pipe that takes requests; idle ones beyond it are closed (those
        that waiting puts made are not kept after them)."""
        found = None
        for p in reversed(self.pipes):
            if p.closed or p.waits:
                continue
            if found is None:
                found = p
            elif not p.pending:
                p.close()
        if len(self.pipes) > 1:
            self.pipes = [p for p in self.pipes if not p.closed]
        return found

    async def pipe(self, mid: int, deadline: float | None) -> Pipe:
        """An open pipe (connected now if none is, by ``deadline``: else ``TimeoutError``)."""
        p = self._open()
        if p is not None:
            return p
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        await asyncio.wait_for(self._connecting.acquire(), left)  # (TimeoutError: late)
        try:
            p = self._open()
            if p is not None:
                return p
            connecting = asyncio.ensure_future(asyncio.to_thread(self._connect, mid, deadline))
            try:
                sock = await asyncio.shield(connecting)
            except asyncio.CancelledError:  # (its caller left: the socket it makes is closed)
                connecting.add_done_callback(_close_made)
                raise
            try:
                make = (
                    self.loop.create_unix_connection
                    if sock.family == socket.AF_UNIX
                    else self.loop.create_connection
                )
                _, p = await make(lambda: Pipe(self.link, mid, sock), sock=sock)
            except BaseException:
                sock.close()
                raise
            self.pipes.append(p)
            if self.link.closed:  # (closed while connecting)
                self._close_now()
                raise Unpipeable(f"{self.link!r} closed")
            return p
        finally:
            self._connecting.release()

    def _connect(self, mid: int, deadline: float | None) -> socket.socket:
        """(A worker thread.)  A new connection's socket; ``TimeoutError`` at the deadline;
        what the blocking path would raise as it is (a destroyed dictionary, a host that
        is gone, explained), but :class:`Unpipeable` where it would go on (a moved manager
        followed, a connection reset while the host restarts: retried)."""
        try:
            return self.link.connect_detached(mid, deadline)
        except TimeoutError as e:
            if e.errno is None:  # (the deadline's: connect_detached's own)
                raise
            raise Unpipeable(f"cannot connect to {self.link!r}: {e!r}") from e
        except DDictManagerMovedError as e:
            raise Unpipeable(f"cannot connect to {self.link!r}: {e!r}") from e
        except DDictError:
            raise
        except Exception as e:  # noqa: BLE001 - (the blocking path connects again)
            raise Unpipeable(f"cannot connect to {self.link!r}: {e!r}") from e

    def _close_now(self) -> None:
        pipes, self.pipes = self.pipes, []
        for p in pipes:
            p.close()
        if self.link.pipes.get(self.loop) is self:  # (the loop is not kept for it)
            del self.link.pipes[self.loop]
        if not self._keeper.done() and self._keeper is not asyncio.current_task(self.loop):
            self._keeper.cancel()

    def close(self) -> None:
        """Close every pipe (from any thread: on the loop's, if it still runs; the
        sockets alone if the loop has closed)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self._close_now()
            return
        try:
            self.loop.call_soon_threadsafe(self._close_now)  # (RuntimeError: it closed)
        except RuntimeError:
            pipes, self.pipes = self.pipes, []
            for p in pipes:
                p.sock.close()


def pipes_of(link: HostLink) -> Pipes:
    """The running loop's :class:`Pipes` to ``link``'s host."""
    loop = asyncio.get_running_loop()
    pipes = link.pipes.get(loop)
    if pipes is None:
        pipes = link.pipes[loop] = Pipes(link, loop)
    return pipes


async def send(
    link: HostLink, o: Operation, mid: int, began: float
) -> Callable[[], Awaitable[tuple[int, Any]]]:
    """Send ``o`` to manager ``mid`` over this loop's pipes to ``link``'s host; the
    returned coroutine function waits for its ``(ival, payload)`` (as
    :meth:`~.socket_client.HostLink.send` does, the hosts work at once).

    ``began``: when the caller's operation began (``time.monotonic()``): ``o.timeout``
    (plus ``ddict.transport.timeout-slack``) counts from then.  Raises
    :class:`Unpipeable` (now, or from the answer) where the blocking path must send it.
    """
    if link.kind == "tls" or link.closed:
        raise Unpipeable(f"{link!r} is not pipelined")
    if o.kind not in (Kind.READ, Kind.IDEMPOTENT) or not o.replies:
        raise Unpipeable(f"{o.op.name} is not sent again safely")  # (a caller's mistake)
    timeout = o.timeout
    encoded = o.encode()
    if encoded.vlen > link._max_value:
        raise Unpipeable("over the host's limit: the blocking path says so")
    deadline = None if timeout is None else began + timeout + link._slack
    try:
        pipe = await pipes_of(link).pipe(mid, deadline)
    except TimeoutError:
        raise link.timed_out(o, mid, timeout, False) from None
    tag, fut = pipe.send(o, encoded, mid)
    timer = None
    if deadline is not None:  # (the error is made only if the time runs out)
        timer = asyncio.get_running_loop().call_later(
            max(0.0, deadline - time.monotonic()),
            lambda: pipe.give_up(tag, link.timed_out(o, mid, timeout, True)),
        )

    async def answer() -> tuple[int, Any]:
        try:
            status, ival, payload = await fut
        finally:
            if timer is not None:
                timer.cancel()
        if status:
            if status == _MOVED or status == _LEASE:
                raise Unpipeable(
                    f"manager {mid} moved, or its host may not serve it now: the "
                    "blocking path follows it, or waits for its primary"
                )
            raise_for_status(status, bytes(payload).decode(errors="replace"))
        return ival, payload

    return answer


async def exchange_all(
    requests: list[tuple[HostLink, Operation, int]],
) -> list[tuple[int, Any] | BaseException]:
    """Each ``(link, operation, manager)`` sent at once (their time counts from now),
    then every answer awaited: its ``(ival, payload)``, or what it raised
    (:class:`Unpipeable`: it is the blocking path's to send)."""
    began = time.monotonic()
    sent: list[Callable[[], Awaitable[tuple[int, Any]]] | BaseException] = []
    for link, o, mid in requests:
        try:
            sent.append(await send(link, o, mid, began))
        except Exception as e:  # noqa: BLE001 - this request's answer
            sent.append(e)
    out: list[tuple[int, Any] | BaseException] = []
    for answer in sent:
        if isinstance(answer, BaseException):
            out.append(answer)
            continue
        try:
            out.append(await answer())
        except Exception as e:  # noqa: BLE001 - (the others are still awaited)
            out.append(e)
    return out


def time_left(timeout: float | None, began: float) -> float | None:
    """What is left of an operation's ``timeout`` that began at ``began``: a request that
    a pipe could not send goes by the blocking path in that time, not in a new one."""
    return None if timeout is None else max(0.001, timeout - (time.monotonic() - began))
