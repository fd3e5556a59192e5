"""Client side of the key path: channels to managers.

A *channel* reaches one manager.  :class:`InProcessChannel` calls a manager
living in this process (a task on the hosting worker) directly;
:class:`SocketChannel` talks to its server over a Unix socket (same host) or
TCP (other hosts, optionally TLS).  Both have the same methods, so the
``DDict`` handle never knows which one it holds.

Socket channels keep one blocking connection per thread (tasks of one worker
run in several threads) and use it from the calling thread: no event loop and
no thread hand-off on the key path.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import socket
import ssl
import threading
from typing import Any

from .._serialize import SMALL_FRAME, Framed, aligned_empty, copy_frame
from ..errors import DDictManagerUnavailableError, DDictTimeoutError, raise_for_status
from ..layout import ManagerInfo
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
    encode_timeout,
    send_parts,
)

#: Extra seconds a client waits beyond an operation's own timeout before it
#: declares the manager unresponsive (the manager answers TIMEOUT itself).
GRACE = 10.0


class InProcessChannel:
    """Direct calls into a manager of this process (~µs, no syscalls)."""

    kind = "inprocess"

    def __init__(self, manager: Manager) -> None:
        self.manager = manager

    def __repr__(self) -> str:
        return f"<InProcessChannel manager={self.manager.manager_id}>"

    def put(self, digest: bytes, key: bytes, framed: Framed, chkpt: int, client: int,
            persistent: bool, timeout: float | None) -> None:  # fmt: skip
        self.manager.put(
            digest, key, framed, chkpt, client, persistent=persistent, timeout=timeout
        )

    def get(self, digest: bytes, chkpt: int, timeout: float | None) -> Any:
        return self.manager.get(digest, chkpt, copy_frame, timeout)

    def contains(self, digest: bytes, chkpt: int) -> bool:
        return self.manager.contains(digest, chkpt)

    def pop(self, digest: bytes, chkpt: int, client: int, timeout: float | None) -> Any:
        return self.manager.pop(digest, chkpt, client, timeout)

    def length(self, chkpt: int) -> int:
        return self.manager.length(chkpt)

    def clear(self, chkpt: int, client: int, timeout: float | None) -> None:
        self.manager.clear(chkpt, client, timeout)

    def page(self, chkpt: int, after: bytes | None, want: int, max_items: int) -> Any:
        return self.manager.page(chkpt, after, want, max_items, 1 << 20)

    def fetch_add(self, digest: bytes, key: bytes, chkpt: int, client: int, n: int,
                  timeout: float | None) -> Any:  # fmt: skip
        return self.manager.fetch_add(digest, key, chkpt, client, n, timeout)

    def wait_for(self, digest: bytes, chkpt: int, frame: bytes, timeout: float | None) -> None:
        self.manager.wait_for(digest, chkpt, frame, timeout)

    def batch_put(self, records: list[tuple[bytes, bytes, Framed]], chkpt: int, client: int,
                  persistent: bool) -> None:  # fmt: skip
        self.manager.batch_put(
            records, chkpt, client, persistent=persistent
        )

    def batch_end(self, client: int) -> int:
        return self.manager.batch_end(client)

    def stats(self) -> dict[str, Any]:
        return self.manager.stats()

    def newest_checkpoint(self) -> int:
        return self.manager.newest_checkpoint()

    def freeze(self) -> None:
        self.manager.freeze()

    def unfreeze(self) -> None:
        self.manager.unfreeze()

    def admin(self, name: str, *args: Any) -> Any:
        return self.manager.admin(name, *args)

    def close(self) -> None:
        pass


class _Conn:
    __slots__ = ("sock", "reader", "timeout")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = Reader(sock)
        self.timeout: float | None = None


class SocketChannel:
    """Blocking-socket requests to one manager's server.

    Parameters
    ----------
    info
        Where the manager is.
    secret
        The dictionary's secret (TCP authentication).
    use_uds
        Connect through the manager's Unix socket (same host) instead of TCP.
    ssl_context
        Client TLS context when the cluster requires TLS.
    connect_timeout
        Seconds to wait for a connection.
    """

    def __init__(
        self,
        info: ManagerInfo,
        secret: str,
        *,
        use_uds: bool,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        self.info = info
        self.kind = "uds" if use_uds else ("tls" if ssl_context else "tcp")
        self._secret = secret.encode()
        self._ssl = ssl_context
        self._connect_timeout = connect_timeout
        self._local = threading.local()
        self._all: list[_Conn] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<SocketChannel manager={self.info.manager_id} kind={self.kind}>"

    # -- connection management ---------------------------------------------------

    def _unavailable(self, e: BaseException) -> DDictManagerUnavailableError:
        return DDictManagerUnavailableError(
            f"manager {self.info.manager_id} on worker {self.info.worker} is unreachable "
            f"({type(e).__name__}: {e})"
        )

    def _connect(self) -> _Conn:
        info = self.info
        try:
            if self.kind == "uds":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self._connect_timeout)
                sock.connect(info.uds_path)
            else:
                sock = socket.create_connection(
                    (info.tcp_host, info.tcp_port), timeout=self._connect_timeout
                )
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._ssl is not None:
                    sock = self._ssl.wrap_socket(sock, server_hostname=None)
                nonce = _recv_exact(sock, AUTH_NONCE)
                sock.sendall(hmac.new(self._secret, nonce, hashlib.sha256).digest())
                if _recv_exact(sock, 1) != b"\x01":
                    raise PermissionError("manager rejected the credentials")
            sock.settimeout(None)
        except (OSError, ssl.SSLError, PermissionError) as e:
            raise self._unavailable(e) from e
        conn = _Conn(sock)
        with self._lock:
            self._all.append(conn)
        return conn

    def _conn(self) -> _Conn:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
        return conn

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

    # -- requests ---------------------------------------------------------------

    def _call(
        self,
        op: Op,
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
        conn = self._conn()
        want = None if timeout is None else timeout + GRACE
        try:
            if want != conn.timeout:
                conn.sock.settimeout(want)
                conn.timeout = want
            head = REQ.pack(
                op, flags, len(keysec), chkpt, arg, client, encode_timeout(timeout), vlen
            )
            send_parts(conn.sock, [head, keysec, *(value or ())], REQ.size + len(keysec) + vlen)
            if not reply:
                return 0, None
            status, ival, plen = REP.unpack(conn.reader.read(REP.size))
            if plen >= SMALL_FRAME:
                payload: Any = aligned_empty(plen)
                conn.reader.read_into(payload)
            else:
                payload = bytes(conn.reader.read(plen))
        except TimeoutError as e:
            self._drop(conn)
            raise DDictTimeoutError(
                f"manager {self.info.manager_id} on {self.info.worker} did not answer "
                f"within {want} s"
            ) from e
        except (OSError, ssl.SSLError) as e:
            self._drop(conn)
            raise self._unavailable(e) from e
        if status:
            raise_for_status(status, bytes(payload).decode(errors="replace"))
        return ival, payload

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
                  persistent: bool) -> None:  # fmt: skip
        parts: list[Any] = []
        total = 0
        for d, k, f in records:
            parts += [RECORD.pack(16 + len(k), f.nbytes) + d + k, *f.parts]
            total += RECORD.size + 16 + len(k) + f.nbytes
        flags = FLAG_NOREPLY | (FLAG_PERSIST if persistent else 0)
        self._call(
            Op.BATCH_PUT, flags=flags, value=parts, vlen=total, chkpt=chkpt, client=client,
            reply=False,
        )  # fmt: skip

    def batch_end(self, client: int) -> int:
        return self._call(Op.BATCH_END, client=client)[0]

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
