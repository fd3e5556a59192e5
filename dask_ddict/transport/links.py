"""Client side of the key path: links to host processes and channels to managers.

A :class:`HostLink` reaches one host process for one dictionary, over its
Unix socket (same host) or TCP (other hosts, optionally TLS).  It keeps one
blocking connection per thread (tasks of one worker run in several threads)
and uses it from the calling thread: no event loop and no thread hand-off on
the key path.  Every manager that the host serves shares the link.

A :class:`SocketChannel` is one manager seen through its host's link; it
sends any operation of :mod:`.ops` with one ``call(operation)``.

Failures are handled here, once:

* the connection breaks (the host process died; its supervisor restarts it
  on the same listening sockets): the link reconnects and retries the request
  while the operation's time lasts, as the operation's :class:`~.ops.Kind`
  allows: reads and idempotent operations are resent, ``pop`` and ``fetch_add``
  carry a request id so that the host applies them at most once, and a batch
  (which cannot be resent) fails with an error that says it may or may not have
  been applied;
* the connection is refused or the socket file is gone (the supervisor, and
  so the host, is gone): ``DDictManagerUnavailableError`` at once, naming
  manager and host;
* no answer within the operation's ``timeout`` plus a small slack
  (``ddict.transport.timeout-slack``): ``DDictTimeoutError``.
"""

from __future__ import annotations

import errno
import os
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from .. import config
from .._serialize import SMALL_FRAME, aligned_empty
from ..errors import (
    DDictClosedError,
    DDictError,
    DDictFullError,
    DDictManagerUnavailableError,
    DDictTimeoutError,
    raise_for_status,
)
from ..layout import ManagerInfo
from .handshake import HandshakeError, client_side
from .ops import Kind, Operation
from .protocol import (
    REP,
    REQ,
    Hello,
    Reader,
    encode_timeout,
    send_parts,
)

if TYPE_CHECKING:
    from ..shard.generations import Generations

#: Connection errors that mean nobody listens any more (the host is gone).
_GONE = {errno.ECONNREFUSED, errno.ENOENT, errno.EHOSTUNREACH, errno.ENETUNREACH}


class _Conn:
    __slots__ = ("sock", "reader", "timeout", "pending")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = Reader(sock)
        self.timeout: float | None = None
        self.pending = False  # a request went out whose answer is not read yet


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
                 ssl_context: ssl.SSLContext | None = None,
                 max_value: int = 1 << 62) -> None:  # fmt: skip
        self.info = info
        self._max_value = max_value  # the host's limit for a request's value (value_limit)
        self.kind = "uds" if use_uds else ("tls" if ssl_context else "tcp")
        self.name = name
        self._uid = bytes.fromhex(uid)
        self._target = info.uds_path if use_uds else f"{info.tcp_host}:{info.tcp_port}"
        self._secret = secret.encode()
        self._ssl = ssl_context
        self._connect_timeout = config.get_seconds("transport.connect-timeout") or 10.0
        self._reconnect = config.get_seconds("transport.reconnect-timeout") or 30.0
        self._slack = config.get_seconds("transport.timeout-slack") or 0.0
        self._local = threading.local()
        self._all: list[_Conn] = []
        self._lock = threading.Lock()
        self._generations: Generations | None = None

    def __repr__(self) -> str:
        info = self.info
        where = info.uds_path if self.kind == "uds" else f"{info.tcp_host}:{info.tcp_port}"
        return f"<HostLink {self.name!r} {self.kind} {where}>"

    def generations(self) -> Generations | None:
        """The dictionary's generation words on this (same) host, mapped once; ``None``
        if they cannot be (then nothing may commit into its shards but the host)."""
        if self._generations is None and self.kind == "uds":
            from ..shard.generations import Generations, path_for

            try:
                self._generations = Generations(
                    path_for(os.path.dirname(self.info.uds_path), self._uid.hex()))
            except OSError:
                return None
        return self._generations

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
                answer = client_side(sock, self._uid, self._secret, self._target,
                                     tcp=self.kind != "uds")  # fmt: skip
            except BaseException:
                sock.close()
                raise
        except TimeoutError as e:
            raise DDictTimeoutError(f"{self.where(mid)}: no answer to connect within {wait:.1f} s"
                                    ) from e  # fmt: skip
        except HandshakeError as e:  # never retried: this peer is not the dictionary's host
            raise DDictManagerUnavailableError(f"{self.where(mid)}: {e}") from None
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

    def call(self, o: Operation, mid: int) -> tuple[int, Any]:
        """Send operation ``o`` to manager ``mid``; return the host's ``(ival, payload)``."""
        exchange = self._exchange(o, mid)
        try:
            next(exchange)
            next(exchange)
        except StopIteration as done:
            return done.value
        raise AssertionError("an exchange yields once")

    def send(self, o: Operation, mid: int) -> Callable[[], tuple[int, Any]]:
        """Send ``o`` now; the returned function waits for the answer.

        A broadcast sends to every host from one thread, then collects the
        answers: the hosts work at once without a thread per host.  Failures
        after the request went out are handled when the answer is collected
        (a broken connection is retried there, as :meth:`call` retries).
        """
        exchange = self._exchange(o, mid)
        try:
            next(exchange)
        except StopIteration as done:  # no reply expected, or answered while sending
            result: tuple[int, Any] = done.value
            return lambda: result

        def answer() -> tuple[int, Any]:
            try:
                next(exchange)
            except StopIteration as done:
                return done.value
            raise AssertionError("an exchange yields once")

        return answer

    def _exchange(self, o: Operation, mid: int) -> Generator[None, None, tuple[int, Any]]:
        """Request and answer, with retries; yields once, when the request first went out."""
        flags, keysec, value, vlen, chkpt, arg, client, timeout = o.encode()
        op, kind = o.op, o.kind
        if vlen > self._max_value:  # the host would refuse it unread: say why, send nothing
            raise DDictFullError(f"{self.where(mid)}: a {vlen}-byte value cannot fit: its host "
                                 f"takes at most {self._max_value} bytes (the shard's size, "
                                 "or ddict.transport.min-value-limit)")  # fmt: skip
        want = None if timeout is None else timeout + self._slack
        start = time.monotonic()
        # With a timeout, everything (reconnecting included) fits in it; without one,
        # reconnecting to a restarting host may take reconnect-timeout from a failure.
        deadline = None if want is None else start + want
        rid = secrets.randbits(63) + 1 if kind is Kind.ONCE else 0
        head = REQ.pack(op, flags, len(keysec), mid, chkpt, arg, client, encode_timeout(timeout),
                        vlen, rid)  # fmt: skip
        total = REQ.size + len(keysec) + vlen
        attempt, waited = 0, False
        while True:
            conn = getattr(self._local, "conn", None)
            try:
                if conn is None:
                    conn = self._local.conn = self._connect(mid, deadline)
                sock_timeout = None if want is None else max(0.001, start + want - time.monotonic())
                if sock_timeout != conn.timeout:
                    conn.sock.settimeout(sock_timeout)
                    conn.timeout = sock_timeout
                if conn.pending:  # (one exchange at a time per thread and host)
                    raise RuntimeError(f"{self.where(mid)}: an answer is pending on this "
                                       "thread's connection: collect it first")  # fmt: skip
                send_parts(conn.sock, [head, keysec, *value], total)
                if not o.replies:
                    return 0, None
                conn.pending = True
                if not waited:
                    waited = True
                    try:
                        yield
                    except GeneratorExit:  # never collected: its answer would be read
                        self._drop(conn)  # as the next request's, so the connection goes
                        raise
                status, ival, plen = REP.unpack(conn.reader.read(REP.size))
                if plen >= SMALL_FRAME:
                    payload: Any = aligned_empty(plen)
                    conn.reader.read_into(payload)
                else:
                    payload = bytes(conn.reader.read(plen))
                conn.pending = False
            except DDictError:  # from connecting: already what the caller should see
                raise
            except TimeoutError as e:
                if conn is not None:
                    self._drop(conn)
                maybe = "" if kind is Kind.READ else "; the operation may or may not have been applied"
                raise DDictTimeoutError(
                    f"{self.where(mid)} did not answer {op.name} within {timeout} s "
                    f"(+{self._slack} s slack){maybe}"
                ) from e
            except (OSError, ssl.SSLError) as e:
                if conn is not None:
                    self._drop(conn)
                if kind is Kind.UNSAFE:
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

    def call(self, o: Operation) -> Any:
        """Send an operation (:mod:`.ops`) to this manager; return its result."""
        return o.result(*self.link.call(o, self.mid))

    def close(self) -> None:
        pass  # the link is the core's, shared by the host's managers
