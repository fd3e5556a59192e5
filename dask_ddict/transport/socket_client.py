"""The key path's socket client: links to host processes, channels to managers over them.

A :class:`HostLink` reaches one host process for one dictionary, over its
Unix socket (same host) or TCP (other hosts, optionally TLS).  An operation
takes one of its pooled connections (tasks of one worker run in several
threads: each operation has one to itself) and uses it from the calling
thread: no event loop and no thread hand-off on the key path.  Every manager
that the host serves shares the link.

A :class:`SocketChannel` is one manager seen through its host's link; it
sends any operation of :mod:`.ops` with one ``call(operation)``.

Failures are handled here, once:

* the connection breaks (the host process died; its supervisor restarts it
  on the same listening sockets): the link reconnects and retries the request
  while the operation's time lasts, as the operation's :class:`~.operation.Kind`
  allows: reads and idempotent operations are resent, ``pop`` and ``fetch_add``
  carry a request id so that the host applies them at most once, and a batch
  (which cannot be resent) fails with an error that says it may or may not have
  been applied;
* the connection is refused or the socket file is gone (the supervisor, and
  so the host, is gone): ``DDictManagerUnavailableError`` at once, naming
  manager and host;
* a host that is stopped or busy (SIGSTOP, a long operation, a partition) is
  waited for: an operation's ``timeout`` bounds the whole of it (connecting,
  the handshake, the request and the answer) plus a small slack
  (``ddict.transport.timeout-slack``), then ``DDictTimeoutError``; without a
  timeout it waits as long as it takes.  No phase has a deadline of its own.
  While it waits, a same-host client checks every ``ddict.transport.alive-check``
  that the host's supervisor lives (a stopped process and a dead one look
  alike from a socket: the supervisor tells them apart), so a host that is
  gone still raises ``DDictManagerUnavailableError`` instead of a wait
  forever.  Over TCP the host's kernel answers for a stopped process, and a
  dead one's supervisor closes the listener (connections are then refused).

Connections are pooled per link and bounded per process: an operation takes
an idle connection of its link (or opens one) and gives it back when its
answer is read, and a process keeps at most ``ddict.transport.kept-connections``
idle ones over all its links, least recently used closed first (see
:class:`~.idle_pool.IdlePool`).  So its descriptors stay bounded whatever the number of
host processes and threads that use them.
"""

from __future__ import annotations

import errno
import os
import secrets
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

from .. import config
from .._forking import each, in_child, reinit_lock
from .._serialize import SMALL_FRAME
from ..errors import (
    DDictClosedError,
    DDictError,
    DDictFullError,
    DDictManagerMovedError,
    DDictManagerUnavailableError,
    DDictTimeoutError,
    Status,
    raise_for_status,
)
from ..kernels import QUIET, receive_reply
from ..layout import ManagerInfo
from .bounded_connection import BoundedConnection, Deadline
from .handshake import HandshakeError, client_side
from .idle_pool import IDLE_POOL
from .operation import Kind, Operation
from .protocol import (
    REP,
    REQ,
    SMALL,
    Hello,
    send_parts,
)

if TYPE_CHECKING:
    from ..shard.generations import Generations
    from ..shard.lease_word import LeaseWord

#: Connection errors that mean nobody listens any more (the host is gone), in words.
_GONE = {
    errno.ECONNREFUSED: "it refuses connections: its supervisor closed its listeners",
    errno.ENOENT: "its socket file is gone: its supervisor closed",
    errno.EHOSTUNREACH: "its machine cannot be reached",
    errno.ENETUNREACH: "its machine's network cannot be reached",
}


#: ``explain(mid, error, place)``: see :meth:`~.channels.Channels.explain`.
Explain = Callable[[int, DDictManagerUnavailableError, "tuple[str, str, int] | None"], DDictError]


_ONCE = Kind.ONCE  # (an enum member's lookup costs more than the comparison)
_MOVED = int(Status.MOVED)
_LEASE = int(Status.LEASE)

#: Every link of this process (what a forked child closes its copies of).
_LINKS: weakref.WeakSet[HostLink] = weakref.WeakSet()


in_child(lambda: each(_LINKS, lambda link: link.forked()))


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

    def __init__(
        self,
        info: ManagerInfo,
        uid: str,
        secret: str,
        name: str,
        *,
        use_uds: bool,
        ssl_context: ssl.SSLContext | None = None,
        max_value: int = 1 << 62,
    ) -> None:
        self.info = info
        self._max_value = max_value  # the host's limit for a request's value (value_limit)
        self.kind = "uds" if use_uds else ("tls" if ssl_context else "tcp")
        self.name = name
        self.uid = uid
        self._uid = bytes.fromhex(uid)
        self._target = info.uds_path if use_uds else f"{info.tcp_host}:{info.tcp_port}"
        self._secret = secret.encode()
        self._ssl = ssl_context
        self._slack = config.get_seconds("transport.timeout-slack") or 0.0
        # Same host: while waiting, check the host's supervisor this often (over TCP
        # there is nothing to check: one wait, cut only at the operation's deadline).
        self._every = (config.get_seconds("transport.alive-check") or 1.0) if use_uds else None
        self._most = int(config.get("transport.kept-connections"))
        # Every connection, idle or in use (closed with the link).
        self._all: list[BoundedConnection] = []
        self._lock = threading.Lock()
        #: This link's idle connections, most recently used last (under ``IDLE_POOL.lock``).
        self.idle: list[BoundedConnection] = []
        self.closed = False
        self._generations: Generations | None = None
        self._lease_word: LeaseWord | None = None
        #: What turns "manager ``mid`` cannot be reached" into what its user should read
        #: (:meth:`~.channels.Channels.explain`); ``None``: this process's own view.
        self.explain: Explain | None = None
        #: ``follow(mid, deadline)``: the link to a moved manager's new host (see
        #: :meth:`~.channels.Channels.follow`); ``None``: a move is an error here.
        self.follow: Callable[[int, float | None], HostLink] | None = None
        #: ``settle(mid, deadline, since)``: the link to send again to, after manager
        #: ``mid`` answered ``LEASE`` here (first at ``since``): see
        #: :meth:`~.channels.Channels.settle`; ``None``: ``LEASE`` is an error here.
        self.settle: Callable[[int, float | None, float], HostLink] | None = None
        #: The terms of the managers it reaches, as this process's layout says them
        #: (:func:`~.protocol.wire_term`; shared with its connections, see
        #: :meth:`~.channels.Channels.adopt`); a manager's requests carry it, and a host
        #: that serves it under another answers for it (``MOVED``, ``LEASE``).  Empty:
        #: none (a host's own links).
        self.terms: dict[int, int] = {}
        #: Each event loop's pipelined connections to this host (:mod:`.pipelined`).
        self.pipes: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        _LINKS.add(self)

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
                    path_for(os.path.dirname(self.info.uds_path), self._uid.hex())
                )
            except OSError:
                return None
        return self._generations

    def lease_word(self) -> LeaseWord:
        """The lease word of this (same) host's process, mapped once (see
        :mod:`~dask_ddict.shard.lease_word`); raises ``OSError`` if there is none."""
        if self._lease_word is None:
            from ..shard.lease_word import LeaseWord, path_for

            self._lease_word = LeaseWord(path_for(os.path.dirname(self.info.uds_path)))
        return self._lease_word

    def where(self, mid: int) -> str:
        return f"manager {mid} of {self.name!r} on host {self.info.hostname} ({self.info.worker})"

    # -- connections --------------------------------------------------------------

    def _checker(self, mid: int) -> Callable[[], None] | None:
        """What a wait for this host checks between slices (same host: its supervisor)."""
        if self._every is None:
            return None
        pid = self.info.pid

        def check() -> None:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise self.unavailable(
                    mid, f"is gone (its supervisor, process {pid}, ended)"
                ) from None
            except PermissionError:
                pass  # alive, under another user

        return check

    def unavailable(self, mid: int, detail: str, followable: bool = True) -> DDictError:
        """The error for manager ``mid``, which cannot be reached: ``detail`` is what this
        process saw ("is gone (its supervisor ... ended)"); :attr:`explain` may know why
        its host is gone, or that it moved (``followable``: not after a failed handshake)."""
        e = DDictManagerUnavailableError(f"{self.where(mid)} {detail}")
        if self.explain is None:
            return e
        return self.explain(mid, e, self.info.address if followable else None)

    def _connect(
        self, mid: int, deadline: float | None, check: Callable[[], None] | None
    ) -> BoundedConnection:
        """A new connection, its handshake done, by ``deadline`` (``None``: whenever the
        host answers, if it is not gone).  Raises :class:`Deadline` when time runs out."""
        info = self.info
        try:
            if self.kind == "uds":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn = BoundedConnection(sock, self._every)
                conn.begin(deadline, check)
                # (never waits: into the listen backlog, the supervisor's, also while the
                # host process is stopped or restarting; a full one is EAGAIN, retried)
                try:
                    sock.connect(info.uds_path)
                except BaseException:
                    sock.close()
                    raise
            else:
                left = None if deadline is None else max(0.001, deadline - time.monotonic())
                try:
                    sock = socket.create_connection((info.tcp_host, info.tcp_port), timeout=left)
                except TimeoutError as e:
                    if e.errno is None:  # (its timeout was the operation's)
                        raise Deadline() from None
                    raise
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._ssl is not None:
                    sock = self._ssl.wrap_socket(
                        sock, server_hostname=None, do_handshake_on_connect=False
                    )
                conn = BoundedConnection(sock, self._every)
                conn.begin(deadline, check)
            try:
                if isinstance(sock, ssl.SSLSocket):
                    conn.tls_handshake()
                answer = client_side(
                    conn, self._uid, self._secret, self._target, tcp=self.kind != "uds"
                )
            except BaseException:
                conn.close()
                raise
        except HandshakeError as e:  # never retried: this peer is not the dictionary's host
            raise self.unavailable(mid, f"cannot be reached: {e}", followable=False) from None
        except (Deadline, DDictError):
            raise
        except (OSError, ssl.SSLError) as e:
            if getattr(e, "errno", None) in _GONE or isinstance(e, ssl.SSLError):
                raise self._unavailable(mid, e) from e
            raise  # e.g. reset mid-handshake: the host is restarting, the caller retries
        if answer != Hello.OK:
            conn.close()
            if answer == Hello.CLOSED:
                raise DDictClosedError(f"DDict {self.name!r} was destroyed")
            if answer == Hello.DENIED:
                raise DDictManagerUnavailableError(
                    f"{self.where(mid)}: the host refused the credentials"
                )
            raise self.unavailable(mid, "is not served by its host any more")
        with self._lock:
            self._all.append(conn)
        IDLE_POOL.most = self._most
        return conn

    def timed_out(
        self, o: Operation, mid: int, timeout: float | None, sent: bool
    ) -> DDictTimeoutError:
        """The error of operation ``o`` on manager ``mid``, unanswered within ``timeout``
        plus the slack (``sent``: the request went out, so a write may have been applied)."""
        maybe = (
            ""
            if o.kind is Kind.READ
            else "; the operation may or may not have been applied"
            if sent
            else "; nothing was sent (connecting)"
        )
        return DDictTimeoutError(
            f"{self.where(mid)} did not answer {o.op.name} within "
            f"{timeout} s (+{self._slack} s slack){maybe}"
        )

    def connect_detached(self, mid: int, deadline: float | None) -> socket.socket:
        """A new connection's socket, its handshake done by ``deadline`` (of
        ``time.monotonic()``), that is not this link's (not pooled, not closed with it):
        :mod:`.pipelined` serves it from an event loop.  Raises what connecting raises,
        or ``TimeoutError`` at the deadline."""
        try:
            conn = self._connect(mid, deadline, self._checker(mid))
        except Deadline:
            raise TimeoutError(f"{self.where(mid)}: not connected in time") from None
        with self._lock:
            self._all.remove(conn)
        conn.sock.settimeout(None)
        return conn.sock

    def _unavailable(self, mid: int, e: BaseException) -> DDictError:
        said = _GONE.get(getattr(e, "errno", None) or 0, f"{type(e).__name__}: {e}")
        return self.unavailable(mid, f"is unreachable ({said})")

    def forget(self, conn: BoundedConnection) -> None:
        """Close one of this link's connections (broken, or past the process's bound)."""
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)
        conn.close()

    def _broken(self, conn: BoundedConnection | None) -> None:
        """``conn`` broke: the host process may have restarted, so its idle siblings are
        likely broken too; all are closed (the next operation opens a fresh one)."""
        for c in [*([conn] if conn is not None else []), *IDLE_POOL.remove(self, closing=False)]:
            self.forget(c)

    def close(self) -> None:
        IDLE_POOL.remove(self, closing=True)
        with self._lock:
            conns, self._all = self._all, []
        for c in conns:
            c.close()
        for pipes in list(self.pipes.values()):
            pipes.close()

    def forked(self) -> None:
        """In a forked child (see :mod:`dask_ddict._forking`): the parent's connections,
        idle, in use by its other threads or pipelined on its event loops, are the
        parent's; this process's copies of them close, and it connects anew."""
        reinit_lock(self._lock)
        self.idle.clear()  # (the pool's table of them is cleared by its own handler)
        conns, self._all = self._all, []
        for c in conns:
            c.close()
        loops, self.pipes = list(self.pipes.values()), weakref.WeakKeyDictionary()
        for pipes in loops:  # (their loops run in the parent: nothing is closed there)
            for p in pipes.pipes:
                p.sock.close()
            pipes.pipes = []

    # -- requests -------------------------------------------------------------------

    def call(self, o: Operation, mid: int) -> tuple[int, Any]:
        """Send operation ``o`` to manager ``mid``; return the host's ``(ival, payload)``."""
        if o.kind is not _ONCE and o.replies and self.kind != "tls":
            return self._quick(o, mid)
        return self._call(o, mid)

    def _quick(self, o: Operation, mid: int) -> tuple[int, Any]:
        """:meth:`call` on an idle connection, for an operation with no deadline and no
        request id: the request in one ``sendall``, the reply received by
        :func:`~dask_ddict.kernels.receive_reply` (its header and a small payload in one
        ``recv``, compiled).  Most operations go this way; they fail as in
        :meth:`_exchange` (which retries those it may resend), and one with a deadline,
        a large request or reply, or no idle connection goes (or reads) as there."""
        flags, keysec, value, vlen, chkpt, arg, client, timeout = o.encode()
        total = REQ.size + len(keysec) + vlen
        if timeout is not None or total > SMALL or vlen > self._max_value:
            return self._call(o, mid)
        conn = IDLE_POOL.take(self)
        if conn is None:
            return self._call(o, mid)
        check = None if self._every is None else self._checker(mid)  # (same host: alive?)
        try:
            conn.begin(None, check)
            sock = conn.sock
            term = self.terms.get(mid, 0) if o.follows else 0  # (not several managers')
            conn.sendall(
                b"".join(
                    (
                        REQ.pack(
                            o.op,
                            flags,
                            term,
                            len(keysec),
                            mid,
                            0,
                            chkpt,
                            arg,
                            client,
                            -1.0,
                            vlen,
                            0,
                        ),
                        keysec,
                        *value,
                    )
                )
            )
            reader = conn.reader
            buf, got = reader.emptied(), 0
            while True:
                status, ival, plen, payload, got = receive_reply(
                    sock, buf, got, conn.timeout, SMALL_FRAME
                )
                if status != QUIET:
                    break
                if check is not None:  # (a slice went by: the host's supervisor lives?)
                    check()
            if payload is None:  # (SMALL_FRAME bytes or more: a reader's buffer holds at least
                # SMALL, so any less came whole) into a buffer of its own, as in _exchange
                reader.received(REP.size, got)
                payload = o.buffer(plen)
                reader.read_into(payload)
        except DDictError as e:  # (the host is gone, or moved: its reply is never read)
            self.forget(conn)
            if (
                type(e) is DDictManagerMovedError
                and self.follow is not None
                and o.follows
                and o.kind is not Kind.UNSAFE
            ):
                return self.follow(mid, None).call(o, mid)
            raise
        except (OSError, ssl.SSLError) as e:
            self._broken(conn)
            if o.kind is Kind.UNSAFE:
                raise self._maybe_applied(o, mid, e) from e
            return self._call(o, mid)  # (resent on a new connection, as _exchange resends)
        except BaseException:  # (an interrupt: the reply is never read)
            self.forget(conn)
            raise
        IDLE_POOL.give(self, conn)
        if status:
            if status == _MOVED and self.follow is not None and o.follows:
                return self.follow(mid, None).call(o, mid)
            if status == _LEASE and self.settle is not None and o.follows:
                return self._call(o, mid)  # (it waits for a primary: _exchange)
            raise_for_status(status, bytes(payload).decode(errors="replace"))
        return ival, payload

    def _maybe_applied(self, o: Operation, mid: int, e: BaseException) -> DDictError:
        """The error of an operation that cannot be resent, whose connection broke."""
        return DDictError(
            f"{self.where(mid)}: the connection broke during {o.op.name} "
            f"({type(e).__name__}); it may or may not have been applied",
            "MANAGER_UNAVAILABLE",
        )

    def _call(self, o: Operation, mid: int) -> tuple[int, Any]:
        """:meth:`call` through :meth:`_exchange` (retries, deadlines, request ids)."""
        exchange = self._exchange(o, mid)
        try:
            next(exchange)
            next(exchange)
        except StopIteration as done:
            return done.value
        raise AssertionError("an exchange yields once")

    def send(
        self, o: Operation, mid: int, start: float | None = None
    ) -> Callable[[], tuple[int, Any]]:
        """Send ``o`` now; the returned function waits for the answer.

        A broadcast sends to every host from one thread, then collects the
        answers: the hosts work at once without a thread per host.  Failures
        after the request went out are handled when the answer is collected
        (a broken connection is retried there, as :meth:`call` retries).
        ``start``: when the broadcast began (its operations' time counts from
        then, so that connecting to one host never lends another more time).
        """
        exchange = self._exchange(o, mid, start)
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

    def _exchange(
        self,
        o: Operation,
        mid: int,
        began: float | None = None,
        rid: int = 0,
        waited: bool = False,
        lapsed: float = 0.0,
    ) -> Generator[None, None, tuple[int, Any]]:
        """Request and answer, with retries; yields once, when the request first went out.

        With a timeout, everything (connecting, the handshake, reconnecting to a
        restarting host, the answer) fits in it plus the slack; without one, nothing
        here gives up on a host that is not known to be gone.  A manager that moved (its
        old host answers ``MOVED``: not applied; or is gone, and the orchestrator knows
        where it went) is followed: the same request and id, in the same time (callers
        follow operations on several managers: ``Operation.follows``).  One whose host
        answers ``LEASE`` (it may not serve it now) is sent again, with its id, where
        :attr:`settle` says, until a primary answers (``lapsed``: since when it waits)."""
        flags, keysec, value, vlen, chkpt, arg, client, timeout = o.encode()
        op, kind = o.op, o.kind
        if began is None:  # (its time may have begun before: the key lane's)
            began = o.began
        if vlen > self._max_value:  # the host would refuse it unread: say why, send nothing
            raise DDictFullError(
                f"{self.where(mid)}: a {vlen}-byte value cannot fit: its host "
                f"takes at most {self._max_value} bytes (the shard's size, "
                "or ddict.transport.min-value-limit)"
            )
        if timeout is None:
            start, deadline, wire_timeout = 0.0, None, -1.0  # (encode_timeout)
        else:
            start = time.monotonic() if began is None else began
            deadline, wire_timeout = start + timeout + self._slack, float(timeout)
        check = None if self._every is None else self._checker(mid)
        if not rid and kind is _ONCE:
            rid = o.rid or secrets.randbits(63) + 1  # (the key lane's, sent before)
        term = self.terms.get(mid, 0) if o.follows else 0  # (not several managers')
        head = REQ.pack(
            op, flags, term, len(keysec), mid, 0, chkpt, arg, client, wire_timeout, vlen, rid
        )
        total = REQ.size + len(keysec) + vlen
        attempt, sent = 0, o.began is not None  # (the key lane's: it sent it first)
        while True:
            conn = None
            try:
                if attempt and check is not None:  # (after a broken connection)
                    check()  # a same-host supervisor that ended: gone, no retry
                conn = IDLE_POOL.take(self)
                if conn is None:
                    conn = self._connect(mid, deadline, check)
                conn.begin(deadline, check)
                sent = True  # (from here on, the host may have read it)
                if total <= SMALL and conn.timeout is None:  # (send_parts, for one small send)
                    conn.sock.sendall(b"".join((head, keysec, *value)))
                else:
                    send_parts(conn, [head, keysec, *value], total)
                if not o.replies:
                    IDLE_POOL.give(self, conn)
                    return 0, None
                if not waited:
                    waited = True
                    try:
                        yield
                    except GeneratorExit:  # never collected: its answer would be read
                        self.forget(conn)  # as the next request's, so the connection goes
                        raise
                    if deadline is not None:  # (the socket's wait is relative: what is left
                        conn._arm()  # now, after other hosts' answers were collected)
                reader = conn.reader
                status, _, ival, plen = reader.unpack(REP)  # (one request at a time: no tag)
                if plen >= SMALL_FRAME:
                    payload: Any = o.buffer(plen)
                    reader.read_into(payload)
                else:
                    payload = reader.take(plen)
            except DDictError as e:  # connecting, or the host is gone: what the caller should see
                if conn is not None:
                    self.forget(conn)
                if (
                    type(e) is DDictManagerMovedError
                    and self.follow is not None
                    and o.follows
                    and (kind is not Kind.UNSAFE or not sent)
                ):
                    return (
                        yield from self.follow(mid, deadline)._exchange(
                            o, mid, start, rid, waited, lapsed
                        )
                    )
                raise
            except Deadline as e:
                if conn is not None:
                    self.forget(conn)
                raise self.timed_out(o, mid, timeout, sent) from e
            except (OSError, ssl.SSLError) as e:
                self._broken(conn)
                if kind is Kind.UNSAFE:
                    raise self._maybe_applied(o, mid, e) from e
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise self._unavailable(mid, e) from e
                # the host restarts (its supervisor keeps the listeners: no refusal)
                pause = min(0.5, 0.02 * 2**attempt)
                time.sleep(pause if deadline is None else min(pause, deadline - now))
                attempt += 1
                if timeout is not None:  # a waiting operation waits only what is left
                    left = max(0.0, timeout - (time.monotonic() - start))
                    head = REQ.pack(
                        op, flags, term, len(keysec), mid, 0, chkpt, arg, client, left, vlen, rid
                    )
                continue
            IDLE_POOL.give(self, conn)
            if status:
                if status == _MOVED and self.follow is not None and o.follows:
                    return (
                        yield from self.follow(mid, deadline)._exchange(
                            o, mid, start, rid, waited, lapsed
                        )
                    )
                if (
                    status == _LEASE
                    and self.settle is not None
                    and o.follows
                    and kind is not Kind.UNSAFE
                ):
                    lapsed = lapsed or time.monotonic()
                    link = self.settle(mid, deadline, lapsed)  # (raises when it gives up)
                    if link is not self:
                        return (yield from link._exchange(o, mid, start, rid, waited, lapsed))
                    attempt = 0
                    if timeout is not None:  # (what is left of its time)
                        left = max(0.0, timeout - (time.monotonic() - start))
                        head = REQ.pack(
                            op,
                            flags,
                            term,
                            len(keysec),
                            mid,
                            0,
                            chkpt,
                            arg,
                            client,
                            left,
                            vlen,
                            rid,
                        )
                    continue
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
