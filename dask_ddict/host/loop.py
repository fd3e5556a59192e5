"""EventLoop: one epoll thread serving every idle connection of a host process.

A thread per connection, each sleeping in ``recv``, costs a wake-up and an
interpreter-lock hand-over per request; with many clients the host's CPU per
request grows with their number.  Here one thread waits in ``epoll_wait`` for all
connections, reads what is ready without waiting, and serves each complete request
on the spot: under load one wake-up finds several requests.  The wait, the receive and
the plain requests (gets, ``in``s and puts of one key, and ``get_many``s:
:class:`~dask_ddict.kernels.PlainServer`) are one compiled call (:func:`~dask_ddict.kernels.poll_and_serve`, which
waits with the interpreter lock released, and waits again when it served every event
of a wake-up): plain requests run no Python at all, from one to the next, and the
events it leaves (any other request, a connection that ended, the wake-up of
:meth:`EventLoop.close`) are served here.

The loop's thread never sleeps on anything but ``epoll_wait``
(:mod:`dask_ddict._blocking`).  A request that may take long
(``Operation.inline`` is ``False``), whose body is larger than
``most_inline`` bytes, or that turns out to wait (a checkpoint, a lock, a
replica, a peer slow to read its reply) hands the loop on: an idle thread (or a
new one) takes over ``epoll_wait``, and this thread finishes the request
blocking, serves whatever that connection has sent meanwhile, gives the
connection back to the loop and becomes an idle thread itself.  A connection is
either in the loop or on one thread, never both, so its requests are served in
order; only this thread reads it while it is out.

TLS connections stay on a thread each (an ``SSLSocket`` cannot read without
waiting); so does everything while ``ddict.host.event-loop`` is ``false``.  It is on
by default: with many clients the host's CPU per request no longer grows with their
number, while a lone client on few cores loses some of its request rate (one more
system call per request); the documentation's transport pages give the measurements.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import _blocking
from ..kernels import ConnectionState, poll_and_serve, receive_nowait
from ..transport.protocol import REQ
from ..transport.sockets import send_waiting

if TYPE_CHECKING:
    from .._serialize import Scratch
    from ..kernels import PlainServer, ServedTable
    from ..transport.protocol import Reader

logger = logging.getLogger(__name__)

_IN = select.EPOLLIN
#: Events one ``epoll_wait`` returns at most (the rest come with the next).
_MOST_EVENTS = 256
_DONTWAIT = socket.MSG_DONTWAIT
#: Idle threads kept to take the loop over (more are started when needed, and end).
MOST_IDLE = 4


def _unset(ival: int = 0, payload: Any = b"") -> None:
    raise RuntimeError("a connection's reply function was not set")


class Connection(ConnectionState):
    """One client connection's serving state, bound to a dictionary by its handshake
    (``plain`` and ``reader`` are fields of its base, which the event loop reads as
    such: :class:`~dask_ddict.kernels.ConnectionState`)."""

    __slots__ = (
        "sock",
        "fd",
        "hosted",
        "scratch",
        "served",
        "owed",
        "tag",
        "reply",
        "out",
        "held",
        "holding",
        "batching",
        "sending",
    )

    def __init__(
        self,
        sock: socket.socket,
        hosted: Any,
        reader: Reader,
        scratch: Scratch,
        served: ServedTable,
    ) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.hosted = hosted  # (a .hosted.HostedDict: named here, not imported)
        self.reader = reader
        self.scratch = scratch
        self.served = served
        #: (manager, request id) of the last at-most-once reply sent (the server's
        #: ``_serve_request``).
        self.owed: list[Any] = [None]
        #: The tag of the request being served, which its reply repeats (set as it is
        #: read: ``kernels.take_request``, the server's ``_serve_one``).
        self.tag = [0]
        #: ``reply(ival, payload)``: answers the request being served (the server's).
        self.reply: Callable[..., None] = _unset
        #: Where its other writes go (error replies): the socket, or on the event loop a
        #: :class:`NoWait` over it (set with ``reply``).
        self.out: Any = sock
        #: Replies kept back to go out in one send with the next ones (:meth:`flush`),
        #: and their bytes: while ``batching`` (the event loop serves the requests one
        #: receive brought, and more are buffered) a small reply waits for theirs.
        self.held: list[bytes] = []
        self.holding = 0
        self.batching = False
        #: A thread sending what the socket did not take of the kept-back replies when the
        #: loop was handed on (:meth:`hand_off`): every later write waits for it.
        self.sending: threading.Thread | None = None
        #: Serves the plain requests at the head of its buffer in one call, on the event
        #: loop (:class:`~dask_ddict.kernels.PlainServer`; ``None``: each request is the
        #: server's).
        self.plain: PlainServer | None = None

    def __repr__(self) -> str:
        return f"<Connection fd={self.fd} {self.hosted.name!r}>"

    def flush(self) -> None:
        """Send the replies kept back, in one send (what the socket does not take now is
        sent after handing the loop on, as :class:`NoWait` sends), after what a
        :meth:`hand_off` left to send.  Every other write to the connection flushes
        first: replies leave in the order of their requests."""
        if self.sending is not None:  # (never on the loop's thread: see hand_off)
            self.sending.join()
            self.sending = None
        data = self._taken()
        if data:
            self.out.sendall(data)  # (held only on the event loop: a NoWait)

    def hand_off(self) -> None:
        """The loop was handed on while this connection is served (the request may wait
        now, holding locks): send the replies kept back without waiting, and leave what
        the socket does not take to a thread of its own.  Never waits and never raises:
        a broken connection is the request's own reply's error."""
        data = self._taken()
        if not data:
            return
        try:
            sent = self.sock.send(data, _DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError:
            return  # (the peer is gone: the next write says so)
        if sent < len(data):
            sender = threading.Thread(
                target=_send_rest, args=(self.sock, data, sent), name="ddict-send", daemon=True
            )
            try:
                sender.start()
            except RuntimeError:  # (no thread to be had: the next write, off the loop, sends it)
                self.held.append(data[sent:])
                self.holding = len(data) - sent
                return
            self.sending = sender

    def _taken(self) -> bytes:
        """The replies kept back, joined, and none kept any more."""
        held = self.held
        if not held:
            return b""
        data = held[0] if len(held) == 1 else b"".join(held)
        held.clear()
        self.holding = 0
        return data


def _send_rest(sock: socket.socket, data: bytes, sent: int) -> None:
    """(A :meth:`Connection.hand_off`'s thread.)  Send ``data[sent:]``, waiting."""
    try:
        send_waiting(sock, data, sent)
    except OSError:
        pass  # (the peer is gone: the connection's next write says so)


class NoWait:
    """A loop connection's sends: what the socket takes now, the rest after handing the
    loop on (a peer slow to read its reply holds up its own connection only)."""

    __slots__ = ("sock",)

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def sendall(self, data: Any) -> None:
        try:
            sent = self.sock.send(data, _DONTWAIT)
        except BlockingIOError:
            sent = 0
        if sent < (len(data) if type(data) is bytes else memoryview(data).nbytes):
            _blocking.will_block()
            send_waiting(self.sock, data, sent)


class EventLoop:
    """Serve connections from one polling thread at a time (see the module's doc).

    Parameters
    ----------
    serve
        Serves one request of a connection, reading (and waiting for) what it needs.
    take
        ``take(reader, tag)``: the next request whole in a connection's buffer, taken
        out of it, else the bytes it needs (:func:`~dask_ddict.kernels.take_request`).
    serve_request
        Serves a request that ``take`` gave.
    inline
        ``inline(op, arg)``: whether the loop may serve a request of operation ``op``
        (with header field ``arg``) on its own thread.
    end
        Closes a connection that failed or ended, given the exception (or ``None``).
    most_inline
        Largest request (header, key section and value) the loop receives itself.
    """

    def __init__(
        self,
        serve: Callable[[Connection], None],
        take: Callable[[Reader, list[int]], Any],
        serve_request: Callable[[Connection, Any], None],
        inline: Callable[[int, int], bool],
        end: Callable[[Connection, BaseException | None], None],
        most_inline: int,
    ) -> None:
        self._serve = serve
        self._take = take
        self._serve_request = serve_request
        self._inline = inline
        self._end = end
        self.most_inline = most_inline
        self._ep = select.epoll()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._ep.register(self._wake, _IN)
        self._conns: dict[int, Connection] = {}
        self._cond = threading.Condition()
        self._idle = 0  # threads waiting to take the loop over
        self._called = 0  # of those, how many were called to
        self._closed = False
        self._shut_down = False  # (the epoll object and the wake-up descriptor are closed)
        self._serving: Connection | None = None  # (the polling thread's, while it serves one)
        #: The events of the polling thread's batch after the one it serves, and those
        #: that a thread which handed the loop on left to the next (their requests were
        #: received already: the descriptors would not be reported again).
        self._rest: tuple[list[tuple[int, BaseException | None]], int] = ([], 0)
        self._pending: list[tuple[int, BaseException | None]] = []
        self.handoffs = 0  # times the loop moved to another thread

    def __repr__(self) -> str:
        return (
            f"<EventLoop connections={len(self._conns)} idle={self._idle} "
            f"handoffs={self.handoffs}{' closed' if self._closed else ''}>"
        )

    def start(self) -> None:
        self._spawn()

    def add(self, c: Connection) -> None:
        """Serve ``c`` from the loop (from any thread)."""
        self._conns[c.fd] = c
        try:
            self._ep.register(c.fd, _IN)
        except (OSError, ValueError) as e:  # (the loop closed meanwhile)
            self._conns.pop(c.fd, None)
            self._end(c, e)

    def close(self) -> None:
        """Stop polling and wake every idle thread (connections are the server's to close)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            if not self._shut_down:  # (the poller may have seen _closed and shut already)
                os.eventfd_write(self._wake, 1)

    # -- threads ----------------------------------------------------------------

    def _spawn(self) -> None:
        threading.Thread(target=self._run, name="ddict-loop", daemon=True).start()

    def _run(self) -> None:
        """A thread's life: poll while it is the loop; when it handed the loop on while
        serving a connection, finish that connection; then wait to be called again."""
        while True:
            c = self._poll()
            if c is None:
                return
            self._finish(c)
            with self._cond:
                if self._closed or self._idle >= MOST_IDLE:
                    return
                self._idle += 1
                while not self._called and not self._closed:
                    self._cond.wait()
                self._idle -= 1
                if self._closed:
                    return
                self._called -= 1

    def _hand_on(self) -> None:
        """(The polling thread, about to sleep while serving ``_serving``.)  Take that
        connection out of the loop and let another thread poll."""
        _blocking.serving(None)
        c = self._serving
        if c is not None:
            self._ep.unregister(c.fd)
            c.batching = False  # (off the loop: its replies go out as they come)
        self.handoffs += 1
        events, at = self._rest
        self._pending, self._rest = events[at:], ([], 0)  # (before the next poller starts)
        with self._cond:
            called = self._idle > self._called
            if called:
                self._called += 1
                self._cond.notify()
        if not called:
            self._spawn()
        if c is not None:
            c.hand_off()  # (the replies kept back go before this thread sleeps, never after)

    # -- the loop ---------------------------------------------------------------

    def _poll(self) -> Connection | None:
        """Poll and serve until this thread hands the loop on (returns the connection
        it was serving) or the loop closes (returns ``None``)."""
        _blocking.serving(self._hand_on)
        ep, conns, ready = self._ep, self._conns, self._ready
        try:
            while not self._closed:
                events = self._pending
                if events:
                    self._pending = []
                else:
                    events = poll_and_serve(ep, conns, _MOST_EVENTS)
                for i, (fd, error) in enumerate(events):
                    c = conns.get(fd)
                    if c is None:
                        continue  # (the wake-up)
                    if error is not None:
                        self._drop(c, error)
                        continue
                    self._serving = c  # (what _hand_on takes out of the loop)
                    self._rest = (events, i + 1)  # (what _hand_on leaves to the next poller)
                    moves = self.handoffs
                    try:
                        ready(c, moves)
                    except BaseException as e:  # noqa: BLE001 - this connection's end
                        self._drop(c, e)
                    if self.handoffs != moves:  # (this thread handed the loop on)
                        return c
        except (OSError, ValueError) as e:  # (closed under it)
            if not self._closed:
                logger.error("ddict host: the event loop failed; its connections end", exc_info=e)
                self._closed = True
                for c in list(self._conns.values()):
                    self._drop(c, e)
        finally:
            _blocking.serving(None)
        self._shut()
        return None

    def _ready(self, c: Connection, moves: int) -> None:
        """Receive what ``c`` sent and serve each complete request, while this thread is
        the loop (``handoffs`` is still ``moves``); hand the loop on for one it must not
        serve itself (then serve that one here, blocking).

        The common request, whole in the buffer with a value the reader copies out, is
        received and taken by one compiled call each (:func:`~dask_ddict.kernels.
        receive_nowait`, :func:`~dask_ddict.kernels.take_request`); a run of plain requests
        is served by one call (``c.plain``) before any is taken.  While more requests
        are buffered (a pipelined client's), their small replies are kept back and go
        out together (:meth:`Connection.flush`): when no whole request is left, and
        before the loop is handed on.
        """
        r, tag, take, inline, plain = c.reader, c.tag, self._take, self._inline, c.plain
        receive_nowait(r)
        c.batching = True  # (a reply waits for the next ones while more requests are here)
        while self.handoffs == moves:
            if plain is not None:
                plain.serve()
            got = take(r, tag)
            if type(got) is not int:  # (a Request)
                if not inline(got[0], got[4]):  # (its op and arg)
                    self._hand_on()
                self._serve_request(c, got)
            elif got > self.most_inline:  # (too large to receive on the loop)
                self._hand_on()
                self._serve(c)
            elif r.buffered() >= got:  # (whole, with a value received into its own buffer)
                op, _, _, _, _, _, _, arg, *_ = r.peek(REQ)  # type: ignore[misc]
                if not inline(op, arg):
                    self._hand_on()
                self._serve(c)
            else:
                r.reserve(got)
                c.batching = False
                c.flush()
                return

    def _finish(self, c: Connection) -> None:
        """Serve what ``c`` has sent (off the loop), then give it back to the loop.
        (``_serving`` is the polling thread's: not touched here.)"""
        if self._conns.get(c.fd) is not c:
            return  # (it ended while served)
        try:
            while c.reader.buffered():
                self._serve(c)
            c.flush()  # (what a hand-off left to a thread is sent before the loop has it)
            if not self._closed:
                self._ep.register(c.fd, _IN)
        except BaseException as e:  # noqa: BLE001 - this connection's end
            self._drop(c, e)

    def _drop(self, c: Connection, e: BaseException | None) -> None:
        if self._conns.get(c.fd) is not c:
            return  # (ended already)
        if c.sending is not None:  # (a hand-off's sender may wait on a peer that never
            try:  # reads: shut down, it ends with EPIPE rather than outlive the connection)
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        del self._conns[c.fd]
        try:
            self._ep.unregister(c.fd)
        except (OSError, ValueError):
            pass  # (out of the loop already, or the loop closed)
        self._end(c, e)

    def _shut(self) -> None:
        """Close the epoll object and the wake-up descriptor (once; under the lock that
        :meth:`close` writes the wake-up under, so it never writes a closed descriptor)."""
        with self._cond:
            if self._shut_down:
                return
            self._shut_down = True
            self._ep.close()
            os.close(self._wake)
