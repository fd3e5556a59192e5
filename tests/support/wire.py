"""Requests framed by hand and replies read by hand: a pipelining client's view of a host
(tests that send several requests in one send, or ones no client would send)."""

from __future__ import annotations

import socket

from dask_ddict.transport.operation import Operation
from dask_ddict.transport.protocol import REP, REQ


def raw(o: Operation, tag: int, mid: int = 3, flags: int = 0, rid: int = 0, term: int = 0) -> bytes:
    """``o`` as a request to manager ``mid`` with ``tag`` (and request id ``rid``, the
    manager's ``term`` as the client knows it), as a pipelining client frames it."""
    e = o.encode()
    return (
        REQ.pack(
            o.op,
            e.flags | flags,
            term,
            len(e.keysec),
            mid,
            tag,
            e.chkpt,
            e.arg,
            e.client,
            -1.0 if e.timeout is None else e.timeout,
            e.vlen,
            rid,
        )
        + e.keysec
        + b"".join(bytes(p) for p in e.parts)
    )


def replies(sock: socket.socket, n: int) -> list[tuple[int, int, int, bytes]]:
    """The next ``n`` replies on ``sock``: ``(status, tag, ival, payload)`` each."""
    sock.settimeout(20)
    data, out = b"", []
    while len(out) < n:
        chunk = sock.recv(1 << 20)
        assert chunk, "the host closed the connection"
        data += chunk
        while len(data) >= REP.size:
            status, tag, ival, plen = REP.unpack_from(data)
            if len(data) < REP.size + plen:
                break
            out.append((status, tag, ival, data[REP.size : REP.size + plen]))
            data = data[REP.size + plen :]
    assert data == b""
    return out
