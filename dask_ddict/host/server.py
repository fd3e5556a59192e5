"""HostServer: the key-path server of one host process, serving many managers.

One accept thread per listener and one thread per connection, each using
blocking ``recv_into``/``sendall``: the fastest design measured on these
machines (``transport-notes.md``, D'/C'), with no event-loop hop and no busy
waiting (threads sleep in ``accept``/``recv`` or on a manager's condition
variable).  The host process runs no Dask tasks, so no task holds the GIL that
these threads need.

The listening sockets are not this process's own: the supervisor bound them
and passes them to every incarnation of the host process.  Addresses therefore
survive a host-process restart, and a client that connects while the host is
restarting waits in the listen backlog instead of being refused.

A connection is bound to one dictionary by its handshake (``HELLO``); on TCP
the peer then proves that it knows the dictionary's secret (HMAC over a
nonce), optionally inside TLS with the cluster's certificates.  Unix-socket
peers are checked with ``SO_PEERCRED``.  Each request names its manager, and
:data:`~dask_ddict.transport.ops.HANDLERS` maps each operation to the manager
call that serves it (each operation is declared once, in :mod:`~dask_ddict.transport.ops`).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import hmac
import logging
import os
import secrets
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._serialize import Scratch
from ..errors import (
    DDictClosedError,
    DDictError,
    DDictManagerUnavailableError,
    status_of,
)
from ..transport.ops import HANDLERS, Page, Reply, Request
from ..transport.protocol import (
    AUTH_NONCE,
    FLAG_NOREPLY,
    HELLO,
    HELLO_MAGIC,
    REP,
    REQ,
    Hello,
    Op,
    Reader,
    decode_timeout,
    send_parts,
)

if TYPE_CHECKING:
    from ..shard.manager import Manager

logger = logging.getLogger(__name__)

_PEERCRED = struct.Struct("3i")
#: accept() errors that end when resources come back: wait and accept again.
_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}


class HostedDict:
    """One dictionary's managers on this host, and the secret that admits its clients."""

    __slots__ = ("uid", "key", "name", "secret", "managers")

    def __init__(self, uid: str, name: str, secret: str) -> None:
        self.uid = uid
        self.key = bytes.fromhex(uid)  # as clients name it in their HELLO
        self.name = name
        self.secret = secret.encode()
        self.managers: dict[int, Manager] = {}

    def __repr__(self) -> str:
        return f"<HostedDict {self.name!r} managers={sorted(self.managers)}>"


class HostServer:
    """Serve every manager of this host process over the supervisor's listeners.

    Parameters
    ----------
    uds, tcp
        Listening sockets (bound by the supervisor, inherited by this process).
    dicts
        The dictionaries served here, by uid (shared with the host process,
        which adds and removes them).
    closed
        Uids of dictionaries destroyed here: their clients get ``CLOSED``.
    ssl_context
        Server-side TLS context for TCP, or ``None``.
    page_bytes, scratch_keep
        Soft size of a view's page; receive buffer kept per connection.
    """

    def __init__(
        self,
        uds: socket.socket,
        tcp: socket.socket,
        dicts: dict[bytes, HostedDict],
        closed: set[bytes],
        *,
        ssl_context: ssl.SSLContext | None = None,
        page_bytes: int = 1 << 20,
        scratch_keep: int = 128 << 20,
    ) -> None:
        self.dicts = dicts
        self.closed_dicts = closed
        self._uds, self._tcp = uds, tcp
        self._ssl = ssl_context
        self.handlers: dict[Any, Callable[..., None]] = {**HANDLERS, Op.PAGE: functools.partial(Page.serve, page_bytes=page_bytes)}
        self._scratch_keep = scratch_keep
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def __repr__(self) -> str:
        return f"<HostServer dicts={len(self.dicts)} connections={len(self._conns)}>"

    def start(self) -> None:
        """Start accepting (after the host process has re-opened its managers)."""
        for lsock, kind in ((self._uds, "uds"), (self._tcp, "tcp")):
            t = threading.Thread(target=self._accept_loop, args=(lsock, kind),
                                 name=f"ddict-accept-{kind}", daemon=True)  # fmt: skip
            t.start()
            self._threads.append(t)

    # -- connections ------------------------------------------------------------

    def _accept_loop(self, lsock: socket.socket, kind: str) -> None:
        while not self._closed:
            try:
                conn, _ = lsock.accept()
            except OSError as e:
                if e.errno in _TRANSIENT and not self._closed:
                    # Out of descriptors or memory: the flood ends, the listener stays.
                    logger.warning("ddict host: accept failed (%s); retrying", e)
                    time.sleep(0.1)
                    continue
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, kind), name="ddict-conn",
                             daemon=True).start()  # fmt: skip

    def _handshake(self, conn: socket.socket, kind: str) -> tuple[socket.socket, HostedDict]:
        if kind == "uds":
            _, uid, _ = _PEERCRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
            if uid != os.getuid():
                raise PermissionError(f"peer uid {uid} is not this host's uid")
        else:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                tls = self._ssl.wrap_socket(conn, server_side=True)
                with self._lock:
                    self._conns.discard(conn)
                    self._conns.add(tls)
                conn = tls
        reader = Reader(conn, 64)
        magic, dict_uid = HELLO.unpack(reader.read(HELLO.size))
        if magic != HELLO_MAGIC:
            raise PermissionError("not a DDict client")
        hosted = self.dicts.get(dict_uid)
        if hosted is None:
            answer = Hello.CLOSED if dict_uid in self.closed_dicts else Hello.UNKNOWN
            conn.sendall(bytes([answer]))
            raise PermissionError(f"no dictionary {dict_uid.hex()} here ({answer.name})")
        if kind == "tcp":
            nonce = secrets.token_bytes(AUTH_NONCE)
            conn.sendall(nonce)
            answer_mac = bytes(reader.read(32))
            expected = hmac.new(hosted.secret, nonce, hashlib.sha256).digest()
            if not hmac.compare_digest(answer_mac, expected):
                conn.sendall(bytes([Hello.DENIED]))
                raise PermissionError("bad credentials")
        conn.sendall(bytes([Hello.OK]))
        return conn, hosted

    def _serve(self, conn: socket.socket, kind: str) -> None:
        try:
            conn, hosted = self._handshake(conn, kind)
            reader = Reader(conn)
            scratch = Scratch(self._scratch_keep)
            sock = conn

            def reply(ival: int = 0, payload: Any = b"") -> None:
                send_parts(sock, [REP.pack(0, ival, memoryview(payload).nbytes), payload])

            while True:
                self._one_request(conn, reader, scratch, hosted, reply)
        except (ConnectionError, OSError, ssl.SSLError, PermissionError) as e:
            if not self._closed and not isinstance(e, ConnectionResetError):
                logger.debug("ddict connection ended: %r", e)
        except Exception:  # a bug: log it, drop only this connection
            logger.exception("ddict host: connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    # -- requests ---------------------------------------------------------------

    def _one_request(self, conn: socket.socket, reader: Reader, scratch: Scratch,
                     hosted: HostedDict, reply: Reply) -> None:  # fmt: skip
        op, flags, klen, mid, chkpt, arg, client, timeout, vlen, rid = REQ.unpack(
            reader.read(REQ.size)
        )
        keysec = bytes(reader.read(klen))
        if vlen <= 1 << 20:
            value: Any = bytes(reader.read(vlen))
        else:
            value = scratch.get(vlen)
            reader.read_into(value)
        try:
            manager = hosted.managers.get(mid)
            if manager is None:
                if hosted.key in self.closed_dicts:
                    raise DDictClosedError(f"DDict {hosted.name!r} was destroyed")
                raise DDictManagerUnavailableError(
                    f"manager {mid} of {hosted.name!r} is not hosted by process {os.getpid()}"
                )
            handler = self.handlers.get(op)  # IntEnum keys: a plain int finds them
            if handler is None:
                raise DDictError(f"unknown operation {op}", "INVALID_ARGUMENT")
            req = Request(op, flags, mid, chkpt, arg, client, decode_timeout(timeout),
                          keysec[:16], keysec[16:], value, rid)  # fmt: skip
            handler(manager, req, reply)
        except Exception as e:
            if flags & FLAG_NOREPLY:
                raise
            msg = str(getattr(e, "message", "") or e).encode()
            send_parts(conn, [REP.pack(status_of(e), 0, len(msg)), msg])

    # -- lifecycle --------------------------------------------------------------

    def close(self) -> None:
        """Drop every connection.  The listeners are the supervisor's: left as they are."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass
