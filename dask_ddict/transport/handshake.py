"""The key path's handshake: a connection bound to one dictionary, proven both ways.

Over TCP both ends prove that they know the dictionary's secret, the host
first, before the client sends a key or unpickles a byte::

    client -> host   HELLO(magic, dictionary uid) + client nonce (32 bytes)
    host -> client   PROVE + host incarnation (16) + host nonce (32) + host proof (32)
    client           checks the host proof; a host that cannot make it is not the
                     dictionary's (e.g. a process that took over a dead host's port)
    client -> host   client proof (32)
    host -> client   OK, or DENIED

    proof = HMAC-SHA256(secret, VERSION | role | uid | target | incarnation
                                | client nonce | host nonce)

``role`` (``host``/``client``) binds the direction: a host's proof is never a
client's.  ``target`` is the address of the host process as the dictionary's
layout names it (``tcp_host:tcp_port``): the host process computes it from its
own listener, the client from where it dialled, so a handshake relayed to any
other host process fails.  Fresh nonces on both sides make a replayed handshake
fail.  An attacker on the path can still read and alter traffic after an honest
handshake: only TLS (the cluster's certificates, both directions) stops that.

Over a Unix socket (same host, private 0700 directory) each end checks the
other's uid with ``SO_PEERCRED`` instead, and the host answers OK at once.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
from collections.abc import Callable
from typing import Any

from .protocol import HELLO, HELLO_MAGIC, Hello
from .sockets import matches, recv_exact
from .sockets import proof as hmac_proof

VERSION = b"ddict-key-path/3"
NONCE = 32
INCARNATION = 16
PROOF = 32
_PEERCRED = struct.Struct("3i")
_DURING = "the handshake"  # (what a peer that closes interrupted)


class HandshakeError(PermissionError):
    """The other end failed to prove who it is (or is not a DDict peer at all)."""


def proof(
    secret: bytes,
    role: bytes,
    uid: bytes,
    target: str,
    incarnation: bytes,
    client_nonce: bytes,
    host_nonce: bytes,
) -> bytes:
    """One side's proof of the secret, bound to this connection (see the module docstring)."""
    return hmac_proof(
        secret, VERSION, role, uid, target.encode(), incarnation, client_nonce, host_nonce
    )


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket."""
    _, uid, _ = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return int(uid)


def client_side(sock: Any, uid: bytes, secret: bytes, target: str, *, tcp: bool) -> Hello:
    """Run the client's half; return the host's final answer (``Hello.OK`` or why not).

    Raises
    ------
    HandshakeError
        The host did not prove the secret, or (Unix socket) runs as another user.
    """
    if not tcp and peer_uid(sock) != os.getuid():
        raise HandshakeError(f"the host process at {target} runs as another user")
    client_nonce = secrets.token_bytes(NONCE)
    sock.sendall(HELLO.pack(HELLO_MAGIC, uid) + client_nonce)
    answer = _answer(sock, target)
    if answer != Hello.PROVE:
        if tcp and answer not in (Hello.CLOSED, Hello.UNKNOWN):  # (nothing is sent after those)
            raise HandshakeError(
                f"the process at {target} answered {answer.name} without proving that it "
                "serves this dictionary (not its host process)"
            )
        return answer
    got = bytes(recv_exact(sock, INCARNATION + NONCE + PROOF, _DURING))
    incarnation, host_nonce, host_proof = (got[:INCARNATION], got[INCARNATION:-PROOF], got[-PROOF:])
    args = (uid, target, incarnation, client_nonce, host_nonce)
    if not matches(proof(secret, b"host", *args), host_proof):
        raise HandshakeError(
            f"the process at {target} did not prove that it serves this "
            "dictionary (not its host process: wrong secret or relayed)"
        )
    sock.sendall(proof(secret, b"client", *args))
    return _answer(sock, target)


def _answer(sock: Any, target: str) -> Hello:
    """The host's one-byte answer; a byte that is none is no DDict host's."""
    byte = recv_exact(sock, 1, _DURING)[0]
    try:
        return Hello(byte)
    except ValueError:
        raise HandshakeError(
            f"the process at {target} is not a DDict host process (it answered {byte})"
        ) from None


def host_side(
    conn: Any,
    read: Callable[[int], Any],
    find: Callable[[bytes], Any],
    closed: Callable[[bytes], bool],
    *,
    tcp: bool,
    target: str,
    incarnation: bytes,
) -> Any:
    """Run the host's half; return the dictionary the connection is bound to.

    ``find(uid)`` gives the hosted dictionary (with ``secret``) or ``None``;
    ``closed(uid)`` says whether it was destroyed here.

    Raises
    ------
    HandshakeError
        Not a DDict client, an unknown or destroyed dictionary (after telling
        the client so), another user (Unix socket), or a wrong proof.
    """
    if not tcp and peer_uid(conn) != os.getuid():
        raise HandshakeError("peer runs as another user")
    magic, uid = HELLO.unpack(bytes(read(HELLO.size)))
    if magic != HELLO_MAGIC:
        raise HandshakeError("not a DDict client (or one of another version)")
    client_nonce = bytes(read(NONCE))
    hosted = find(uid)
    if hosted is None:
        answer = Hello.CLOSED if closed(uid) else Hello.UNKNOWN
        conn.sendall(bytes([answer]))
        raise HandshakeError(f"no dictionary {uid.hex()} here ({answer.name})")
    if not tcp:
        conn.sendall(bytes([Hello.OK]))
        return hosted
    host_nonce = secrets.token_bytes(NONCE)
    args = (uid, target, incarnation, client_nonce, host_nonce)
    conn.sendall(
        bytes([Hello.PROVE]) + incarnation + host_nonce + proof(hosted.secret, b"host", *args)
    )
    if not matches(proof(hosted.secret, b"client", *args), bytes(read(PROOF))):
        conn.sendall(bytes([Hello.DENIED]))
        raise HandshakeError("bad credentials")
    conn.sendall(bytes([Hello.OK]))
    return hosted
