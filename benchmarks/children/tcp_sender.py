"""The sender of ``bench_moves.py``'s TCP reference row, run on the second host.

``tcp_sender.py HOST PORT NBYTES REPS``: ``REPS`` times, connects to ``HOST:PORT``,
sends ``NBYTES`` bytes, shuts its side down and waits for the receiver's one byte (the
receiver times each connection from its accept to the last byte).
"""

from __future__ import annotations

import socket
import sys


def main(host: str, port: int, nbytes: int, reps: int) -> None:
    buf = memoryview(b"\x01" * (4 << 20))
    for _ in range(reps):
        s = socket.create_connection((host, port), timeout=60)
        left = nbytes
        while left:
            k = min(left, len(buf))
            s.sendall(buf[:k])
            left -= k
        s.shutdown(socket.SHUT_WR)
        s.recv(1)
        s.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
