"""Client side of the key path: links to host processes and channels to managers.

A :class:`HostLink` reaches one host process for one dictionary, over its
Unix socket (same host) or TCP (other hosts, optionally TLS).  It keeps one
blocking connection per thread (tasks of one worker run in several threads)
and uses it from the calling thread: no event loop and no thread hand-off on
the key path.  Every manager that the host serves shares the link.

A :class:`SocketChannel` is one manager seen through its host's link.

Failures are handled here, once:

* the connection breaks (the host process died; its supervisor restarts it
  on the same listening sockets): the link reconnects and retries the request
  while the operation's time lasts.  Requests that are not idempotent
  (``pop``, ``fetch_add``) carry a request id, so the host applies them at most
  once; a batch, which cannot be retried, fails with an error that says it may
  or may not have been applied;
* the connection is refused or the socket file is gone (the supervisor, and
  so the host, is gone): ``DDictManagerUnavailableError`` at once, naming
  manager and host;
* no answer within the operation's ``timeout`` plus a small slack
  (``ddict.transport.timeout-slack``): ``DDictTimeoutError``.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import pickle
import secrets
import socket
import ssl
import threading
import time
from typing import Any

from .. import config
from .._serialize import SMALL_FRAME, Framed, aligned_empty, copy_frame
from ..errors import (
    DDictClosedError,
    DDictError,
    DDictManagerUnavailableError,
    DDictTimeoutError,
    raise_for_status,
)
from ..layout import ManagerInfo
from .protocol import (
    AUTH_NONCE,
    FLAG_NOREPLY,
    FLAG_PERSIST,
    HELLO,
    HELLO_MAGIC,
    RECORD,
    REP,
    REQ,
    Hello,
    Op,
    Reader,
    encode_timeout,
    send_parts,
)

#: Safe to send again after a broken connection (the same request, the same effect).
IDEMPOTENT = frozenset({
    Op.GET, Op.CONTAINS, Op.LEN, Op.PAGE, Op.STATS, Op.NEWEST, Op.PING, Op.PUT, Op.CLEAR,
    Op.FREEZE, Op.UNFREEZE, Op.WAIT_FOR, Op.ADMIN,
    Op.BATCH_END,  # the batch's state is in the shard; a lost answer shows as a short count
})  # fmt: skip
#: Operations that change nothing: a timed-out one needs no "may or may not" warning.
READS = frozenset({Op.GET, Op.CONTAINS, Op.LEN, Op.PAGE, Op.STATS, Op.NEWEST, Op.PING,
                   Op.WAIT_FOR})  # fmt: skip
#: Retried with their request id: the host applies them at most once.
AT_MOST_ONCE = frozenset({Op.POP, Op.FETCH_ADD})
#: Connection errors that mean nobody listens any more (the host is gone).
_GONE = {errno.ECONNREFUSED, errno.ENOENT, errno.EHOSTUNREACH, errno.ENETUNREACH}


class _Conn:
    __slots__ = ("sock", "reader", "timeout")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = Reader(sock)
        self.timeout: float | None = None


class HostLink:
    """Blocking-socket requests to one host process, for one dictionary.

    Parameters
    ----------
    info
        Any manager of the host (its addresses are the host's).
    uid, secret, name
        The dictionary: its handshake identity, TCP secret and name (messages).
    use_uds
        Connect through the host's Unix socket (same host) instead of TCP.
    ssl_context
        Client TLS context when the cluster requires TLS.
    """

    def __init__(self, info: ManagerInfo, uid: str, secret: str, name: str, *, use_uds: bool,
                 ssl_context: ssl.SSLContext | None = None) -> None:  # fmt: skip
        self.info = info
        self.kind = "uds" if use_uds else ("tls" if ssl_context else "tcp")
        self.name = name
        self._hello = HELLO.pack(HELLO_MAGIC, bytes.fromhex(uid))
        self._secret = secret.encode()
        self._ssl = ssl_context
        self._connect_timeout = config.get_seconds("transport.connect-timeout") or 10.0
        self._reconnect = config.get_seconds("transport.reconnect-timeout") or 30.0
        self._slack = config.get_seconds("transport.timeout-slack") or 0.0
        self._local = threading.local()
        self._all: list[_Conn] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        info = self.info
        where = info.uds_path if self.kind == "uds" else f"{info.tcp_host}:{info.tcp_port}"
        return f"<HostLink {self.name!r} {self.kind} {where}>"

    def where(self, mid: int) -> str:
        return f"manager {mid} of {self.name!r} on host {self.info.hostname} ({self.info.worker})"

    # -- connections --------------------------------------------------------------

    def _connect(self, mid: int, deadline: float | None) -> _Conn:
        wait = self._connect_timeout
        if deadline is not None:  # never past the operation's own deadline
            wait = max(0.001, min(wait, deadline - time.monotonic()))
        info = self.info
        try:
            if self.kind == "uds":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(wait)
                sock.connect(info.uds_path)
            else:
                sock = socket.create_connection((info.tcp_host, info.tcp_port), timeout=wait)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._ssl is not None:
                    sock = self._ssl.wrap_socket(sock, server_hostname=None)
            try:
                sock.sendall(self._hello)
                if self.kind != "uds":
                    nonce = _recv_exact(sock, AUTH_NONCE)
                    sock.sendall(hmac.new(self._secret, nonce, hashlib.sha256).digest())
                answer = _recv_exact(sock, 1)[0]
            except BaseException:
                sock.close()
                raise
        except TimeoutError as e:
            raise DDictTimeoutError(f"{self.where(mid)}: no answer to connect within {wait:.1f} s"
                                    ) from e  # fmt: skip
        except (OSError, ssl.SSLError) as e:
            if getattr(e, "errno", None) in _GONE or isinstance(e, ssl.SSLError):
                raise self._unavailable(mid, e) from e
            raise  # e.g. reset mid-handshake: the host is restarting, the caller retries
        if answer != Hello.OK:
            sock.close()
            if answer == Hello.CLOSED:
                raise DDictClosedError(f"DDict {self.name!r} was destroyed")
            reason = "refused the credentials" if answer == Hello.DENIED else "does not serve it"
            raise DDictManagerUnavailableError(f"{self.where(mid)}: the host {reason}")
        sock.settimeout(None)
        conn = _Conn(sock)
        with self._lock:
            self._all.append(conn)
        return conn

    def _unavailable(self, mid: int, e: BaseException) -> DDictManagerUnavailableError:
        return DDictManagerUnavailableError(
            f"{self.where(mid)} is unreachable ({type(e).__name__}: {e})"
        )

    def _drop(self, conn: _Conn) -> None:
        self._local.conn = None
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)
        try:
            conn.sock.close()
        except OSError:
            pass

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for c in conns:
            try:
                c.sock.close()
            except OSError:
                pass
        self._local = threading.local()

    # -- requests -------------------------------------------------------------------

    def call(
        self,
        op: Op,
        mid: int,
        *,
        flags: int = 0,
        keysec: bytes = b"",
        value: list[Any] | None = None,
        vlen: int = 0,
        chkpt: int = 0,
        arg: int = 0,
        client: int = 0,
        timeout: float | None = None,
        reply: bool = True,
    ) -> tuple[int, Any]:
        """Send one request to manager ``mid``; return ``(ival, payload)``."""
        want = None if timeout is None else timeout + self._slack
        start = time.monotonic()
        # With a timeout, everything (reconnecting included) fits in it; without one,
        # reconnecting to a restarting host may take reconnect-timeout from a failure.
        deadline = None if want is None else start + want
        rid = secrets.randbits(63) + 1 if op in AT_MOST_ONCE else 0
        head = REQ.pack(op, flags, len(keysec), mid, chkpt, arg, client, encode_timeout(timeout),
                        vlen, rid)  # fmt: skip
        total = REQ.size + len(keysec) + vlen
        attempt = 0
        while True:
            conn = getattr(self._local, "conn", None)
            try:
                if conn is None:
                    conn = self._local.conn = self._connect(mid, deadline)
                sock_timeout = None if want is None else max(0.001, start + want - time.monotonic())
                if sock_timeout != conn.timeout:
                    conn.sock.settimeout(sock_timeout)
                    conn.timeout = sock_timeout
                send_parts(conn.sock, [head, keysec, *(value or ())], total)
                if not reply:
                    return 0, None
                status, ival, plen = REP.unpack(conn.reader.read(REP.size))
                if plen >= SMALL_FRAME:
                    payload: Any = aligned_empty(plen)
                    conn.reader.read_into(payload)
                else:
                    payload = bytes(conn.reader.read(plen))
            except DDictError:  # from connecting: already what the caller should see
                raise
            except TimeoutError as e:
                if conn is not None:
                    self._drop(conn)
                maybe = "" if op in READS else "; the operation may or may not have been applied"
                raise DDictTimeoutError(
                    f"{self.where(mid)} did not answer {op.name} within {timeout} s "
                    f"(+{self._slack} s slack){maybe}"
                ) from e
            except (OSError, ssl.SSLError) as e:
                if conn is not None:
                    self._drop(conn)
                if op not in IDEMPOTENT and op not in AT_MOST_ONCE:
                    raise DDictError(
                        f"{self.where(mid)}: the connection broke during {op.name} "
                        f"({type(e).__name__}); it may or may not have been applied",
                        "MANAGER_UNAVAILABLE",
                    ) from e
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self._reconnect
                if now >= deadline:
                    raise self._unavailable(mid, e) from e
                time.sleep(min(0.5, 0.02 * 2**attempt, deadline - now))  # the host restarts
                attempt += 1
                if timeout is not None:  # a waiting operation waits only what is left
                    left = max(0.0, timeout - (time.monotonic() - start))
                    head = REQ.pack(op, flags, len(keysec), mid, chkpt, arg, client, left,
                                    vlen, rid)  # fmt: skip
                continue
            if status:
                raise_for_status(status, bytes(payload).decode(errors="replace"))
            return ival, payload


class SocketChannel:
    """One manager, reached through its host's :class:`HostLink`."""

    def __init__(self, link: HostLink, info: ManagerInfo) -> None:
        self.link = link
        self.info = info
        self.mid = info.manager_id
        self.kind = link.kind

    def __repr__(self) -> str:
        return f"<SocketChannel manager={self.mid} kind={self.kind}>"

    def _call(self, op: Op, **kwargs: Any) -> tuple[int, Any]:
        return self.link.call(op, self.mid, **kwargs)

    def put(self, digest: bytes, key: bytes, framed: Framed, chkpt: int, client: int,
            persistent: bool, timeout: float | None) -> None:  # fmt: skip
        self._call(
            Op.PUT, flags=FLAG_PERSIST if persistent else 0, keysec=digest + key,
            value=framed.parts, vlen=framed.nbytes, chkpt=chkpt, client=client, timeout=timeout,
        )  # fmt: skip

    def get(self, digest: bytes, chkpt: int, timeout: float | None) -> Any:
        return self._call(Op.GET, keysec=digest, chkpt=chkpt, timeout=timeout)[1]

    def contains(self, digest: bytes, chkpt: int) -> bool:
        return bool(self._call(Op.CONTAINS, keysec=digest, chkpt=chkpt)[0])

    def pop(self, digest: bytes, chkpt: int, client: int, timeout: float | None) -> Any:
        return self._call(Op.POP, keysec=digest, chkpt=chkpt, client=client, timeout=timeout)[1]

    def length(self, chkpt: int) -> int:
        return self._call(Op.LEN, chkpt=chkpt)[0]

    def clear(self, chkpt: int, client: int, timeout: float | None) -> None:
        self._call(Op.CLEAR, chkpt=chkpt, client=client, timeout=timeout)

    def page(self, chkpt: int, after: bytes | None, want: int, max_items: int) -> Any:
        more, payload = self._call(
            Op.PAGE, keysec=after or b"", chkpt=chkpt, arg=want | (max_items << 8)
        )
        mv = memoryview(payload)
        last = bytes(mv[:16])
        items = []
        off = 16
        while off < mv.nbytes:
            klen, vlen = RECORD.unpack_from(mv, off)
            off += RECORD.size
            k = bytes(mv[off : off + klen]) if want & 1 else None
            off += klen
            v = copy_frame(mv[off : off + vlen]) if want & 2 else None
            off += vlen
            items.append((k, v))
        return items, (last if items else None), bool(more)

    def fetch_add(self, digest: bytes, key: bytes, chkpt: int, client: int, n: int,
                  timeout: float | None) -> Any:  # fmt: skip
        return self._call(
            Op.FETCH_ADD, keysec=digest + key, chkpt=chkpt, arg=n, client=client, timeout=timeout
        )[1]

    def wait_for(self, digest: bytes, chkpt: int, frame: bytes, timeout: float | None) -> None:
        self._call(
            Op.WAIT_FOR, keysec=digest, value=[frame], vlen=len(frame), chkpt=chkpt,
            timeout=timeout,
        )  # fmt: skip

    def batch_put(self, records: list[tuple[bytes, bytes, Framed]], chkpt: int, client: int,
                  persistent: bool, batch: int) -> None:  # fmt: skip
        parts: list[Any] = []
        total = 0
        for d, k, f in records:
            parts += [RECORD.pack(16 + len(k), f.nbytes) + d + k, *f.parts]
            total += RECORD.size + 16 + len(k) + f.nbytes
        flags = FLAG_NOREPLY | (FLAG_PERSIST if persistent else 0)
        self._call(
            Op.BATCH_PUT, flags=flags, value=parts, vlen=total, chkpt=chkpt, client=client,
            arg=batch, reply=False,
        )  # fmt: skip

    def batch_end(self, client: int, batch: int) -> int:
        return self._call(Op.BATCH_END, client=client, arg=batch)[0]

    def stats(self) -> dict[str, Any]:
        return pickle.loads(self._call(Op.STATS)[1])

    def newest_checkpoint(self) -> int:
        return self._call(Op.NEWEST)[0]

    def freeze(self) -> None:
        self._call(Op.FREEZE)

    def unfreeze(self) -> None:
        self._call(Op.UNFREEZE)

    def admin(self, name: str, *args: Any) -> Any:
        payload = pickle.dumps(args)
        result = self._call(Op.ADMIN, keysec=name.encode(), value=[payload], vlen=len(payload))
        return pickle.loads(result[1])

    def ping(self) -> int:
        return self._call(Op.PING)[0]

    def close(self) -> None:
        pass  # the link is the core's, shared by the host's managers


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    mv = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(mv[got:])
        if not k:
            raise ConnectionResetError("connection closed during handshake")
        got += k
    return bytes(buf)
