"""A fake host: a loopback TCP listener that takes one client and answers it as a test
says (a host that skips its proof, a squatter on a host's port, a hostile reply), and
records what the client sent."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from dask_ddict.transport.sockets import recv_exact


class OneClient:
    """Takes one client on a loopback port (``port``, ``target``: ``"127.0.0.1:PORT"``):
    ``behave(conn, self)`` answers it, then what the client sends until it closes (or
    ``timeout`` seconds pass quietly) is added to ``received``."""

    def __init__(
        self, behave: Callable[[socket.socket, OneClient], None], timeout: float = 10.0
    ) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target = f"127.0.0.1:{self.port}"
        self.received = bytearray()
        self.thread = threading.Thread(target=self._run, args=(behave, timeout), daemon=True)
        self.thread.start()

    def _run(self, behave: Callable[[socket.socket, OneClient], None], timeout: float) -> None:
        self.listener.settimeout(20)
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn, self.listener:
            conn.settimeout(timeout)
            behave(conn, self)
            try:
                while data := conn.recv(65536):
                    self.received += data
            except OSError:
                pass

    def read(self, conn: socket.socket, n: int) -> bytes:
        """``n`` bytes from the client, recorded."""
        got = bytes(recv_exact(conn, n, "a test"))
        self.received += got
        return got
