"""ManagerServer: a manager's own socket server (Unix socket and TCP).

One accept thread per listener and one thread per connection, each using
blocking ``recv_into``/``sendall``: the fastest design measured on these
machines when the worker is idle (``transport-notes.md``, D'/C'), with no
event-loop hop and no busy waiting (threads sleep in ``accept``/``recv`` or on
the manager's condition variable).

Security: the Unix socket lives in a private 0700 directory, and each peer's
uid is checked with ``SO_PEERCRED``.  TCP binds to the worker's own interface,
optionally wraps connections in TLS with the cluster's certificates, and
authenticates every connection once with an HMAC challenge on the
dictionary's secret.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import pickle
import secrets
import shutil
import socket
import ssl
import struct
import tempfile
import threading
from typing import Any

from .._serialize import Scratch
from ..errors import status_of
from ..manager import Manager
from .protocol import (
    AUTH_NONCE,
    FLAG_NOREPLY,
    FLAG_PERSIST,
    RECORD,
    REP,
    REQ,
    Op,
    Reader,
    decode_timeout,
    send_parts,
)

logger = logging.getLogger(__name__)

_PEERCRED = struct.Struct("3i")


def private_socket_dir(base: str | None, label: str) -> str:
    """A fresh 0700 directory for a Unix socket (no chmod race)."""
    base = base or tempfile.gettempdir()
    return tempfile.mkdtemp(prefix=f"ddict-{label}-", dir=base)


class ManagerServer:
    """Serve one manager over a Unix socket and TCP.

    Parameters
    ----------
    manager
        The manager to serve.
    secret
        The dictionary's secret (HMAC key for TCP connections).
    tcp_host
        Interface to bind TCP to (the worker's host).
    ssl_context
        Server-side TLS context, or ``None`` for plain TCP.
    socket_dir
        Where to create the private socket directory (default: tempdir).
    page_bytes
        Soft limit of one page of a streamed view.
    """

    manager: Manager
    uds_path: str
    tcp_host: str
    tcp_port: int

    def __init__(
        self,
        manager: Manager,
        secret: str,
        tcp_host: str = "127.0.0.1",
        *,
        ssl_context: ssl.SSLContext | None = None,
        socket_dir: str | None = None,
        page_bytes: int = 1 << 20,
        scratch_keep: int = 128 << 20,
    ) -> None:
        self.manager = manager
        self._scratch_keep = scratch_keep
        self._key = secret.encode()
        self._ssl = ssl_context
        self._page_bytes = page_bytes
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

        self._dir = private_socket_dir(socket_dir, f"m{manager.manager_id}")
        self.uds_path = os.path.join(self._dir, "manager.sock")
        self._uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._uds.bind(self.uds_path)
        self._uds.listen(128)

        family = socket.AF_INET6 if ":" in tcp_host else socket.AF_INET
        self._tcp = socket.socket(family, socket.SOCK_STREAM)
        self._tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._tcp.bind((tcp_host, 0))
        self._tcp.listen(128)
        self.tcp_host = tcp_host
        self.tcp_port = self._tcp.getsockname()[1]

        for lsock, kind in ((self._uds, "uds"), (self._tcp, "tcp")):
            t = threading.Thread(
                target=self._accept_loop,
                args=(lsock, kind),
                name=f"ddict-accept-{kind}-{manager.manager_id}",
                daemon=True,
            )
            t.start()
            self._threads.append(t)

    def __repr__(self) -> str:
        return (
            f"<ManagerServer manager={self.manager.manager_id} uds={self.uds_path!r} "
            f"tcp={self.tcp_host}:{self.tcp_port} connections={len(self._conns)}>"
        )

    # -- connections ------------------------------------------------------------

    def _accept_loop(self, lsock: socket.socket, kind: str) -> None:
        while not self._closed:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            t = threading.Thread(
                target=self._serve, args=(conn, kind), name="ddict-conn", daemon=True
            )
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            t.start()

    def _handshake(self, conn: socket.socket, kind: str) -> socket.socket:
        if kind == "uds":
            _, uid, _ = _PEERCRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
            if uid != os.getuid():
                raise PermissionError(f"peer uid {uid} is not this worker's uid")
            return conn
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._ssl is not None:
            tls = self._ssl.wrap_socket(conn, server_side=True)
            with self._lock:
                self._conns.discard(conn)
                self._conns.add(tls)
            conn = tls
        nonce = secrets.token_bytes(AUTH_NONCE)
        conn.sendall(nonce)
        reader = Reader(conn, 64)
        answer = bytes(reader.read(32))
        expected = hmac.new(self._key, nonce, hashlib.sha256).digest()
        if not hmac.compare_digest(answer, expected):
            raise PermissionError("bad credentials")
        conn.sendall(b"\x01")
        return conn

    def _serve(self, conn: socket.socket, kind: str) -> None:
        try:
            conn = self._handshake(conn, kind)
            reader = Reader(conn)
            scratch = Scratch(self._scratch_keep)
            while True:
                self._one_request(conn, reader, scratch)
        except (ConnectionError, OSError, ssl.SSLError, PermissionError) as e:
            if not self._closed and not isinstance(e, ConnectionResetError):
                logger.debug("ddict connection ended: %r", e)
        except Exception:  # a bug: log it, drop only this connection
            logger.exception("ddict manager %d: connection failed", self.manager.manager_id)
        finally:
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    # -- requests ---------------------------------------------------------------

    def _one_request(self, conn: socket.socket, reader: Reader, scratch: Scratch) -> None:
        op, flags, klen, chkpt, arg, client, timeout, vlen = REQ.unpack(reader.read(REQ.size))
        keysec = bytes(reader.read(klen))
        if vlen <= 1 << 20:
            value: Any = bytes(reader.read(vlen))
        else:
            value = scratch.get(vlen)
            reader.read_into(value)
        try:
            self._dispatch(conn, Op(op), flags, keysec, value, chkpt, arg, client, timeout)
        except Exception as e:
            if flags & FLAG_NOREPLY:
                raise
            msg = str(getattr(e, "message", "") or e).encode()
            send_parts(conn, [REP.pack(status_of(e), 0, len(msg)), msg])

    def _dispatch(
        self,
        conn: socket.socket,
        op: Op,
        flags: int,
        keysec: bytes,
        value: Any,
        chkpt: int,
        arg: int,
        client: int,
        timeout_f: float,
    ) -> None:
        m = self.manager
        timeout = decode_timeout(timeout_f)
        digest, key = keysec[:16], keysec[16:]

        def reply(ival: int = 0, payload: Any = b"") -> None:
            send_parts(conn, [REP.pack(0, ival, memoryview(payload).nbytes), payload])

        if op == Op.GET:
            m.get(digest, chkpt, reply_frame(conn), timeout)
        elif op == Op.PUT:
            m.put(
                digest, key, value, chkpt, client,
                persistent=bool(flags & FLAG_PERSIST), timeout=timeout,
            )  # fmt: skip
            reply()
        elif op == Op.CONTAINS:
            reply(int(m.contains(digest, chkpt)))
        elif op == Op.POP:
            reply(0, m.pop(digest, chkpt, client, timeout))
        elif op == Op.LEN:
            reply(m.length(chkpt))
        elif op == Op.CLEAR:
            m.clear(chkpt, client, timeout)
            reply()
        elif op == Op.PAGE:
            items, last, more = m.page(
                chkpt, digest or None, arg & 0xFF, max(1, arg >> 8), self._page_bytes
            )
            parts: list[Any] = [last or bytes(16)]
            for k, v in items:
                parts += [RECORD.pack(len(k or b""), len(v or b"")), k or b"", v or b""]
            reply(int(more), b"".join(parts))
        elif op == Op.FETCH_ADD:
            reply(0, m.fetch_add(digest, key, chkpt, client, arg, timeout))
        elif op == Op.WAIT_FOR:
            m.wait_for(digest, chkpt, value, timeout)
            reply()
        elif op == Op.BATCH_PUT:
            m.batch_put(
                list(iter_records(value)), chkpt, client, persistent=bool(flags & FLAG_PERSIST)
            )
            if not flags & FLAG_NOREPLY:
                reply()
        elif op == Op.BATCH_END:
            reply(m.batch_end(client))
        elif op == Op.STATS:
            reply(0, pickle.dumps(m.stats()))
        elif op == Op.NEWEST:
            reply(m.newest_checkpoint())
        elif op == Op.FREEZE:
            m.freeze()
            reply()
        elif op == Op.UNFREEZE:
            m.unfreeze()
            reply()
        elif op == Op.PING:
            reply(os.getpid())
        elif op == Op.ADMIN:
            reply(0, pickle.dumps(m.admin(keysec.decode(), *pickle.loads(value))))
        else:  # pragma: no cover - Op() already rejected unknown values
            raise ValueError(f"unknown op {op}")

    # -- lifecycle --------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting, drop every connection, remove the socket directory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        for s in (self._uds, self._tcp, *conns):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)


def reply_frame(conn: socket.socket) -> Any:
    """A ``consume`` callback that sends a value frame while its snapshot lives."""

    def consume(frame: memoryview) -> None:
        send_parts(conn, [REP.pack(0, 0, frame.nbytes), frame])

    return consume


def iter_records(data: Any) -> Any:
    """Decode ``[RECORD][digest+key][frame]...`` batch records."""
    mv = memoryview(data)
    off, n = 0, mv.nbytes
    while off < n:
        klen, vlen = RECORD.unpack_from(mv, off)
        off += RECORD.size
        keysec = bytes(mv[off : off + klen])
        off += klen
        yield keysec[:16], keysec[16:], mv[off : off + vlen]
        off += vlen
