"""One client connection to a host process, whose waits never outlast their operation.

:class:`~.socket_client.HostLink` opens, pools and retries connections; a
:class:`BoundedConnection` is what one of them does while an operation uses it: each
blocking call is cut at the operation's deadline (:class:`Deadline`) and, on the same
host, into slices between which the host's liveness is checked.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable
from typing import Any, cast

from .protocol import Reader
from .sockets import send_waiting


class Deadline(Exception):
    """The operation's own time ran out (reported by the link as ``DDictTimeoutError``)."""


class BoundedConnection:
    """One connection to a host process, whose waits never outlast their operation.

    The link reads and writes through this object (the handshake, :class:`Reader`,
    :func:`send_parts`), so that every blocking call is cut at the operation's
    deadline and, where the host's liveness can be checked, into slices of
    ``ddict.transport.alive-check``: when a slice goes by with nothing to read (or
    no room to write), :attr:`check` runs and the call is simply made again.  A
    socket timeout leaves nothing half done (``recv_into``/``send`` either moved
    bytes or raised before moving any), so waiting in slices loses no byte.
    """

    __slots__ = ("sock", "reader", "timeout", "deadline", "check", "every", "_recv_into", "_send")

    def __init__(self, sock: socket.socket, every: float | None) -> None:
        self.sock = sock
        self.every = every  # the slice; None: nothing to check between them, one wait
        self.timeout: float | None = None  # the socket's, as last set
        self.deadline: float | None = None
        self.check: Callable[[], None] | None = None
        self._recv_into = sock.recv_into
        self._send = sock.send
        self.reader = Reader(self)

    def begin(self, deadline: float | None, check: Callable[[], None] | None) -> None:
        """Wait at most until ``deadline`` (``None``: as long as the host is not gone)."""
        self.deadline = deadline
        self.check = check
        if deadline is not None or self.timeout != self.every:  # (else _arm changes nothing)
            self._arm()

    def _arm(self) -> None:
        wait = self.every
        if self.deadline is not None:
            left = max(0.001, self.deadline - time.monotonic())
            wait = left if wait is None else min(wait, left)
        if wait != self.timeout:
            self.sock.settimeout(wait)
            self.timeout = wait

    def waited(self, e: TimeoutError) -> None:
        """A slice went by: raise :class:`Deadline` past the deadline, or whatever
        :attr:`check` raises (the host is gone); else wait again."""
        if e.errno is not None:  # ETIMEDOUT from the kernel: the connection broke
            raise e
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise Deadline() from None
        if self.check is not None:
            self.check()
        self._arm()

    def recv_into(self, buf: Any, n: int = 0, flags: int = 0) -> int:
        while True:
            try:
                return self._recv_into(buf, n, flags)
            except TimeoutError as e:
                self.waited(e)

    def recv(self, n: int) -> bytes:
        buf = bytearray(n)
        return bytes(buf[: self.recv_into(buf, n)])

    def sendall(self, data: Any) -> None:
        if self.timeout is None:  # a blocking socket: nothing to cut
            send_waiting(self.sock, data)
            return
        view = memoryview(data).cast("B")
        sent, n = 0, view.nbytes
        while sent < n:
            try:
                sent += self._send(view[sent:])
            except TimeoutError as e:
                self.waited(e)

    def tls_handshake(self) -> None:
        """Finish the TLS handshake, its waits cut like every other (it goes on where a
        slice left it)."""
        tls = cast(ssl.SSLSocket, self.sock)
        while True:
            try:
                tls.do_handshake()
                return
            except TimeoutError as e:
                self.waited(e)

    def getsockopt(self, *args: Any) -> Any:
        return self.sock.getsockopt(*args)

    def close(self) -> None:
        self.check = None
        try:
            self.sock.close()
        except OSError:
            pass
