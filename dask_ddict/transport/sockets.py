"""The socket toolkit: what every hand-made socket protocol of the package shares.

Two protocols run over sockets of our own: the key path (a client's requests to
a host process, :mod:`.handshake` and :mod:`.protocol`) and a filter's result
streams (:mod:`dask_ddict.filter.streams`).  Both read exact byte counts, take
their TLS context from the cluster's Dask ``Security``, prove a shared secret
without revealing it, and say the same thing when the peer has closed.  Those
pieces live here, once, so the two protocols cannot drift apart on any of them
(each had its own exact-read loop, TLS lookup and error texts).

The compiled kernels (:mod:`dask_ddict.kernels`) keep their own receive loops:
they are the key path's hot path, and their pure reference mirrors them.

Rejected: carrying both protocols on ``distributed.comm`` (what Dask's own
messages ride), which would make the key path's blocking, same-thread socket
calls asynchronous; see :mod:`dask_ddict.filter` for the filter's side of that
decision.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import select
import socket
import ssl
from typing import Any

from ..errors import DDictError

#: What a read says when the other end closed the connection before all it waited for.
PEER_CLOSED = "connection closed by peer"


class PeerClosed(ConnectionResetError, EOFError):
    """The other end closed the connection before all that was expected arrived.

    Both a ``ConnectionResetError`` (what the key path retries on, as the kernels
    raise it) and an ``EOFError`` (what ends a filter's stream), so that one exact
    read serves both protocols.
    """


def recv_into_exact(sock: Any, view: memoryview, during: str = "") -> None:
    """Fill ``view`` from ``sock`` (a socket, TLS or not, or anything with its
    ``recv_into``); :class:`PeerClosed` if the peer closes first (``during``: what
    was being read, said in the message)."""
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerClosed(PEER_CLOSED + (f" during {during}" if during else ""))
        got += k


def recv_exact(sock: Any, n: int, during: str = "") -> bytearray:
    """The next ``n`` bytes of ``sock`` (see :func:`recv_into_exact`)."""
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), during)
    return buf


#: Seconds a :func:`send_waiting` waits for room before it checks that its socket is
#: still open (another thread may close it: a wait on its descriptor alone would not
#: see that, and could wait on whatever file took the number next).
ROOM_CHECK = 1.0


def send_waiting(sock: socket.socket, data: Any, start: int = 0) -> None:
    """``sock.sendall(data)`` on a blocking socket (from byte ``start`` of ``data`` on),
    sent in pieces that do not wait, with a wait for room in the socket's buffer between
    them.

    One blocking ``send`` of a large buffer keeps the socket locked while it copies,
    waits and copies again, so the peer's acknowledgements wait in the socket's backlog
    and the sender's buffer empties in bursts: a 64 MiB reply over loopback TCP took
    21-22 ms that way on the 2-core VM and 16-17 ms sent as Python's ``sendall`` sends
    on a socket with a timeout (2026-11-30).  A socket with a timeout (whose
    ``sendall`` bounds the whole send) and a TLS socket (whose ``send`` takes no flags)
    are sent to as they are; a non-blocking one (timeout 0) is waited for here.  A
    socket closed meanwhile raises ``OSError(EBADF)``.
    """
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    view = view[start:]
    if isinstance(sock, ssl.SSLSocket) or sock.gettimeout():
        sock.sendall(view)
        return
    waiter: select.poll | None = None
    while view.nbytes:
        try:
            sent = sock.send(view, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        if sent:
            view = view[sent:]
            continue
        fd = sock.fileno()
        if fd < 0:
            raise OSError(errno.EBADF, "the socket was closed while sending to it")
        if waiter is None:
            waiter = select.poll()
            waiter.register(fd, select.POLLOUT)
        waiter.poll(ROOM_CHECK * 1000)  # (room, an error the next send raises, or a check)
        if sock.fileno() != fd:
            raise OSError(errno.EBADF, "the socket was closed while sending to it")


def connect(
    address: tuple[str, int], timeout: float, ssl_context: ssl.SSLContext | None = None
) -> socket.socket:
    """A TCP connection to ``address`` without Nagle's delay (TLS with ``ssl_context``)."""
    sock = socket.create_connection(address, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if ssl_context is not None:
        try:
            return ssl_context.wrap_socket(sock)
        except BaseException:
            sock.close()
            raise
    return sock


def shut(sock: socket.socket) -> None:
    """Close ``sock``, waking a thread blocked on it (a plain close would not)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def tls_context(security: Any, role: str, listen: bool = False) -> ssl.SSLContext:
    """The TLS context of the cluster's Dask ``security`` for ``role`` (``"client"``,
    ``"worker"``): to listen with, or to connect with.  Our sockets use the
    certificates the cluster's own comms use, so what travels on them is encrypted
    and only between members of the cluster.  ``DDictError`` if this process has
    none (the cluster requires TLS, this process was not given its certificate)."""
    args = security.get_listen_args(role) if listen else security.get_connection_args(role)
    ctx = args.get("ssl_context")
    if ctx is None:
        raise DDictError(
            f"the cluster requires TLS but this process has no {role} "
            "certificate (configure distributed.comm.tls or pass a client with "
            "security=)",
            "INVALID_OPERATION",
        )
    return ctx


def proof(secret: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts`` joined by ``|`` under ``secret``: a proof of the secret
    bound to what ``parts`` name, which reveals nothing of it."""
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).digest()


def matches(expected: bytes, got: bytes) -> bool:
    """Whether a proof (or a token) is the one expected, in constant time: how long
    the comparison takes tells a stranger nothing of the secret."""
    return hmac.compare_digest(expected, got)
