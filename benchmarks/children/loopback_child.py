"""The far end of ``_bench_refs.loopback_seconds``: for every byte it receives, it sends
one message of ``nbytes`` (a request/response, like a get); it exits when the socket
closes.  ``loopback_child.py <port> <nbytes>``."""

from __future__ import annotations

import socket
import sys


def main(port: int, nbytes: int) -> None:
    data = b"\x01" * nbytes
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while s.recv(1):
        s.sendall(data)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
