"""HostServer: the key-path server of one host process, serving many managers.

One accept thread per listener; a connection's handshake on a thread of its
own; then its requests on that thread, with blocking ``recv_into``/``sendall``,
or, with ``ddict.host.event-loop: true`` and without TLS, from the host's event
loop (:mod:`.loop`: one ``epoll`` thread for every idle connection, which hands
itself on to another thread when a request must sleep).  Nothing busy-waits:
threads sleep in ``accept``, ``epoll_wait`` or ``recv``, or on a manager's
condition variable.  The host process runs no Dask
tasks, so no task holds the GIL that these threads need.

The listening sockets are not this process's own: the supervisor bound them
and passes them to every incarnation of the host process.  Addresses therefore
survive a host-process restart, and a client that connects while the host is
restarting waits in the listen backlog instead of being refused.

A connection is bound to one dictionary (a :class:`~.hosted.HostedDict`) by its
handshake (:mod:`~dask_ddict.transport.handshake`): on TCP the host and then the client
prove that they know the dictionary's secret, bound to both nonces, the
direction and this host process, inside TLS with the cluster's certificates
when the cluster uses TLS; Unix-socket peers are checked with ``SO_PEERCRED``.
A peer that has not finished its handshake within
``ddict.transport.handshake-timeout`` is dropped, the connections of a host
process are bounded (``ddict.host.max-connections``), and every length in a
request is checked against its limit before a buffer is allocated.  Each
request names its manager, and :data:`~dask_ddict.transport.table.HANDLERS` maps
each operation to the manager call that serves it (each operation is declared
once, see :mod:`~dask_ddict.transport.table`).  Every request is counted for its
managers and operation (:mod:`.served`: the managers' stats report the counts).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _blocking, config, kernels
from .._serialize import Scratch
from ..errors import (
    DDictClosedError,
    DDictError,
    DDictFullError,
    DDictKeyError,
    DDictLeaseError,
    DDictManagerMovedError,
    DDictManagerUnavailableError,
    wire_error,
)
from ..layout import term_is_newer
from ..shard.lease_word import LEASE_CLOCK
from ..transport.handshake import host_side
from ..transport.operation import Answerer, Reply, Request
from ..transport.ops import Page
from ..transport.protocol import (
    FLAG_NOREPLY,
    FLAG_PERSIST,
    REP,
    REQ,
    SMALL,
    Op,
    Reader,
    Sink,
    send_parts,
    value_limit,
)
from ..transport.sockets import send_waiting
from ..transport.table import ANSWERERS, HANDLERS, HOST_WIDE, INLINE
from . import fan_out
from .forward import serve_tree
from .hosted import HostedDict
from .loop import Connection, EventLoop, NoWait
from .replica_store import serve as serve_replica
from .served import Counting, count_fanout

if TYPE_CHECKING:
    from ..shard.manager import Manager

logger = logging.getLogger(__name__)

_FANOUT = int(Op.FANOUT)
_TREE = int(Op.TREE)
_REPLICATE = int(Op.REPLICATE)  # (an enum member's lookup costs more than the comparison)
#: What a host serves whatever its lease: a replica's change sets (a replica applies
#: them under its primary's lease), a shard's pages (the orchestrator's moves and seeds).
_UNLEASED = frozenset({_REPLICATE, int(Op.SHARD_PAGES)})
_new_request = tuple.__new__  # a Request from its fields, without NamedTuple's __new__

#: Values up to this size are copied out of a connection's receive buffer; larger ones are
#: received straight into a buffer of their own (the connection's scratch).
_TAKEN = 1 << 20
#: The largest request the event loop receives itself: a taken value and its key (larger
#: ones are received off the loop).
_MOST_INLINE = REQ.size + _TAKEN + (64 << 10)
_HEAD = REQ.size
_MISSING = wire_error(DDictKeyError())  # (a plain get's answer for a key not found)

#: accept() errors that end when resources come back: wait and accept again.
_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}


@dataclass(frozen=True)
class ServingLimits:
    """What one peer may make a host process hold, checked before anything is allocated.

    A request's value may be at most its manager's shard size (a bigger one could
    never be stored), or ``min_value_limit`` for small shards (a replication request
    carries a dictionary's serialized layout); a key at most ``max_key_bytes``.  A
    request over a limit is answered with an error and its connection dropped (its
    body is never read).  A request without a reply (a batch's records) that a lapsed
    lease holds up waits at most ``hold_up`` for it (see ``HostServer._hold_up``).
    """

    handshake_timeout: float = 10.0  # ddict.transport.handshake-timeout
    max_connections: int = 4096  # ddict.host.max-connections
    max_key_bytes: int = 1 << 20  # ddict.transport.max-key-bytes
    min_value_limit: int = 64 << 20  # ddict.transport.min-value-limit
    hold_up: float = 30.0  # ddict.failover-timeout

    @classmethod
    def from_config(cls) -> ServingLimits:
        return cls(
            config.get_seconds("transport.handshake-timeout") or 10.0,
            int(config.get("host.max-connections")),
            config.get_bytes("transport.max-key-bytes"),
            config.get_bytes("transport.min-value-limit"),
            config.get_seconds("failover-timeout") or 0.0,
        )

    def most_value(self, capacity: int) -> int:
        """The largest request body for a shard of ``capacity`` bytes."""
        return value_limit(capacity, self.min_value_limit)

    def doubtful(self, manager: Manager | None, klen: int, vlen: int) -> bool:
        """Whether a request to ``manager`` (``None``: not hosted here) with a key section
        of ``klen`` bytes and a value of ``vlen`` may be over the limits: the cheap test,
        run for every request, that ``HostServer._check_lengths`` decides."""
        return (
            manager is None
            or klen > self.max_key_bytes + 16
            or (vlen > manager.store.capacity and vlen > self.min_value_limit)
        )


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
    limits
        Handshake deadline, most connections, longest key: see :class:`ServingLimits`.
    event_loop
        Serve connections other than TLS ones from an :class:`~.loop.EventLoop`
        (``ddict.host.event-loop``) rather than a thread each.
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
        limits: ServingLimits | None = None,
        event_loop: bool = False,
    ) -> None:
        self.dicts = dicts
        self.closed_dicts = closed
        self._uds, self._tcp = uds, tcp
        self._ssl = ssl_context
        # Pages are at most this host's page_bytes, whether asked alone or in a broadcast.
        page = functools.partial(Page.answer, page_bytes=page_bytes)
        self.answerers: dict[Any, Answerer] = {**ANSWERERS, Op.PAGE: page}
        self.handlers: dict[Any, Callable[..., None]] = {
            **HANDLERS,
            Op.PAGE: lambda m, r, reply: reply(*page(m, r)),
        }
        self._scratch_keep = scratch_keep
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.limits = limits or ServingLimits()
        host, port = tcp.getsockname()[:2]
        self._target = f"{host}:{port}"  # as layouts name this host process (tcp_host:tcp_port)
        self._incarnation = secrets.token_bytes(16)  # new with every host process
        #: The requests the event loop serves in compiled code (``kernels.PlainServer``):
        #: a get of an absent key is answered as the manager's ``DDictKeyError``; larger
        #: values go through the manager's path, in parts.
        self._plain = kernels.PlainRequests(
            int(Op.GET),
            int(Op.CONTAINS),
            int(Op.PUT),
            int(Op.GET_MANY),
            int(Op.GET_RANGE),
            int(Op.POP),
            int(Op.FETCH_ADD),
            FLAG_PERSIST,
            int(_MISSING[0]),
            _MISSING[1],
            SMALL,
            self.limits.max_key_bytes + 16,
            LEASE_CLOCK,
        )
        #: Serves the connections that are not TLS (``None``: a thread each, as TLS's).
        self.loop = (
            EventLoop(
                self._serve_one,
                functools.partial(kernels.take_request, _TAKEN, Request),
                self._serve_request,
                _inline,
                self._end,
                most_inline=_MOST_INLINE,
            )
            if event_loop
            else None
        )

    def __repr__(self) -> str:
        return f"<HostServer dicts={len(self.dicts)} connections={len(self._conns)}>"

    def start(self) -> None:
        """Start accepting (after the host process has re-opened its managers)."""
        if self.loop is not None:
            self.loop.start()
        for lsock, kind in ((self._uds, "uds"), (self._tcp, "tcp")):
            t = threading.Thread(
                target=self._accept_loop,
                args=(lsock, kind),
                name=f"ddict-accept-{kind}",
                daemon=True,
            )
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
                if len(self._conns) >= self.limits.max_connections:
                    logger.warning(
                        "ddict host: %d connections, the most allowed "
                        "(ddict.host.max-connections); refusing one",
                        len(self._conns),
                    )
                    conn.close()
                    continue
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn, kind), name="ddict-conn", daemon=True
            ).start()

    def _handshake(self, conn: socket.socket, kind: str) -> tuple[socket.socket, HostedDict]:
        conn.settimeout(self.limits.handshake_timeout)  # an idle stranger is dropped
        if kind == "tcp":
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                tls = self._ssl.wrap_socket(conn, server_side=True)
                with self._lock:
                    self._conns.discard(conn)
                    self._conns.add(tls)
                conn = tls
        reader = Reader(conn, 128)
        hosted = host_side(
            conn,
            reader.read,
            self.dicts.get,
            self.closed_dicts.__contains__,
            tcp=kind == "tcp",
            target=self._target,
            incarnation=self._incarnation,
        )
        conn.settimeout(None)
        return conn, hosted

    def _serve(self, conn: socket.socket, kind: str) -> None:
        """Handshake, then serve ``conn`` from the event loop, or on this thread (TLS)."""
        try:
            conn, hosted = self._handshake(conn, kind)
            looped = self.loop is not None and not isinstance(conn, ssl.SSLSocket)
            c = Connection(
                conn, hosted, Reader(conn), Scratch(self._scratch_keep), hosted.served.connection()
            )
            if looped:
                c.out = NoWait(conn)
                c.reply = _loop_replier(c)
                c.plain = kernels.PlainServer(c, self._plain)
            else:
                c.reply = _replier(conn, c.tag)
        except Exception as e:  # noqa: BLE001 - a stranger, or a peer that left: dropped
            self._ended(conn, e)
            return
        if looped and self.loop is not None:
            self.loop.add(c)
            return
        try:
            while True:
                self._serve_one(c)
        except Exception as e:  # noqa: BLE001 - see _ended
            self._end(c, e)

    def _end(self, c: Connection, e: BaseException | None) -> None:
        """``c`` ended (``e``: why): forget it and close it."""
        c.hosted.served.release(c.served)
        self._ended(c.sock, e)

    def _ended(self, conn: socket.socket, e: BaseException | None) -> None:
        if isinstance(e, (ConnectionError, OSError, ssl.SSLError, PermissionError)):
            if not self._closed and not isinstance(e, ConnectionResetError):
                logger.debug("ddict connection ended: %r", e)
        elif e is not None:  # a bug: logged, and only this connection dropped
            logger.error("ddict host: connection failed", exc_info=e)
        with self._lock:
            self._conns.discard(conn)
        try:
            conn.close()
        except OSError:
            pass

    # -- requests ---------------------------------------------------------------

    def _serve_one(self, c: Connection) -> None:
        """Read one request of ``c`` (waiting for what it needs) and serve it.

        Its lengths are checked before its body is read (a value over its limit is
        never received); a value over :data:`_TAKEN` bytes is received into the
        connection's scratch buffer rather than copied out of its reader.
        """
        reader, hosted, limits = c.reader, c.hosted, self.limits
        op, flags, term, klen, mid, tag, chkpt, arg, client, timeout, vlen, rid = reader.unpack(REQ)
        c.tag[0] = tag  # (what this request's reply repeats)
        if c.owed[0] is not None:  # (before a refusal drops the connection: _serve_request)
            _deliver(c.owed)
        if limits.doubtful(hosted.managers.get(mid), klen, vlen):  # (before the body is read)
            self._check_lengths(c, mid, klen, vlen, flags, tag)
        keysec = reader.take(klen)
        if vlen <= _TAKEN:
            value: Any = reader.take(vlen)
        else:
            value = c.scratch.get(vlen)
            reader.read_into(value)
        self._serve_request(
            c,
            _new_request(
                Request,
                (
                    op,
                    flags,
                    mid,
                    chkpt,
                    arg,
                    client,
                    None if timeout < 0 else timeout,  # (decode_timeout)
                    keysec[:16],
                    keysec[16:],
                    value,
                    rid,
                    term,
                ),
            ),
            checked=True,
        )

    def _serve_request(self, c: Connection, req: Request, checked: bool = False) -> None:
        """Serve ``req``, read whole (by :meth:`_serve_one`, or taken out of the event
        loop's buffer by :func:`~dask_ddict.kernels.take_request`), counted in ``c``'s
        ``served``; ``c.tag[0]`` is its tag.  Its lengths are checked here unless they
        were (``checked``: before its body was read).

        ``c.owed`` holds the manager and request id of the connection's last
        at-most-once request: a new request proves its reply was read (a client
        sends the next one only after reading the last reply whole; a pipelining
        client sends no at-most-once operation), so the manager may drop a large kept
        reply (:meth:`Manager.delivered`).
        """
        op: Any = req[0]  # (a plain int: the tables' IntEnum keys find it)
        flags, mid, tag = req[1], req[2], c.tag[0]
        hosted, reply, served, owed = c.hosted, c.reply, c.served, c.owed
        if owed[0] is not None:
            _deliver(owed)
        manager = hosted.managers.get(mid)
        if manager is None and op in _UNLEASED:  # (a fenced primary's shard is copied too)
            manager = hosted.find(mid)
        if not checked:  # (the loop's requests, once whole: at most _MOST_INLINE bytes)
            klen, vlen = len(req[7]) + len(req[8]), len(req[9])
            if self.limits.doubtful(manager, klen, vlen):
                self._check_lengths(c, mid, klen, vlen, flags, tag)
        try:
            if (
                hosted.leased
                and op not in _UNLEASED
                and (manager is not None or op == _FANOUT or op == _TREE or op in HOST_WIDE)
            ):
                if flags & FLAG_NOREPLY and not hosted.lease.valid():
                    self._hold_up(hosted)
                hosted.lease.check(hosted.name)  # (a replicated primary here: see .lease)
            if op == _FANOUT:  # one operation on several of this dictionary's managers
                self._fan_out(hosted, served, req, reply)
            elif op == _TREE:  # the same, forwarded to other hosts first (see .forward)
                serve_tree(
                    hosted,
                    req,
                    reply,
                    functools.partial(self._fan_out, hosted, served),
                    self._ssl is not None,
                )
            elif op == _REPLICATE:  # (a replica's, not a manager's)
                serve_replica(hosted, req, reply)
            elif op in HOST_WIDE:  # (e.g. get_many: several managers, one request)
                HOST_WIDE[op](
                    Counting(hosted.managers, served, op),
                    req,
                    reply,
                    functools.partial(self._missing, hosted, flags),
                )
            else:
                handler = self.handlers.get(op)
                if manager is None or handler is None:
                    self._dispatch(hosted, req, reply)  # (raises what the client should see)
                else:
                    if req[11] and req[11] != manager.wire:  # (its client's term, and this one's)
                        raise self._other_term(hosted, manager, req[11])
                    served.count(mid, op)
                    handler(manager, req, reply)
                    if req[10]:  # (its request id)
                        owed[0] = (manager, req[10])
        except Exception as e:
            c.flush()  # (the replies kept back go first, also before the connection ends)
            if flags & FLAG_NOREPLY:
                raise
            _send_error(c.out, e, tag)

    def _fan_out(self, hosted: HostedDict, served: Any, req: Request, reply: Reply) -> None:
        """Serve a :class:`~dask_ddict.transport.ops.FanOut` ``req`` on its managers here
        (counted in ``served``, its connection's counts; see :mod:`.fan_out`)."""
        count_fanout(served, hosted.managers, req.digest + req.key, req.arg)
        fan_out.serve(
            functools.partial(self._dispatch, hosted),
            req,
            reply,
            managers=hosted.managers,
            generations=hosted.generations,
            answers=hosted.answers,
            pins=hosted.changes,
            answerers=self.answerers,
        )

    def _dispatch(self, hosted: HostedDict, req: Request, reply: Reply) -> None:
        """Serve ``req`` on its manager through the operation table."""
        manager = hosted.managers.get(req.manager)
        if manager is None:
            raise self._not_hosted(hosted, req.manager)
        handler = self.handlers.get(req.op)  # IntEnum keys: a plain int finds them
        if handler is None or req.op == Op.FANOUT or req.op == Op.TREE:
            raise DDictError(f"unknown operation {req.op}", "INVALID_ARGUMENT")
        handler(manager, req, reply)

    def _hold_up(self, hosted: HostedDict, mid: int | None = None) -> None:
        """Wait, up to ``ddict.failover-timeout``, for this host's lease (and manager
        ``mid``'s confirmation, a manager that opened here and waits for it) before serving
        a request without a reply: a batch's records.  Refused, they would be lost from
        the middle of the batch (its connection dropped, its next records stored), and its
        client would learn of it only from a short count at the batch's end, with nothing
        to send again; a client waits as long for any other request's lease.  A lease the
        orchestrator revokes (its primaries fail over) or that does not come back ends the
        wait, and the request is refused as before."""
        lease = hosted.lease
        if lease is None:
            return
        _blocking.will_block()
        lease.wait(
            self.limits.hold_up, lambda: lease.valid() and (mid is None or mid in hosted.managers)
        )

    def _missing(self, hosted: HostedDict, flags: int, mid: int) -> DDictError:
        """What a request on several managers gets for manager ``mid``, not served here:
        one without a reply waits for it first if it waits for its confirmation."""
        if flags & FLAG_NOREPLY and hosted.leased and mid in hosted.fenced:
            self._hold_up(hosted, mid)
        return self._not_hosted(hosted, mid)

    def _not_hosted(self, hosted: HostedDict, mid: int) -> DDictError:
        if hosted.key in self.closed_dicts:
            return DDictClosedError(f"DDict {hosted.name!r} was destroyed")
        if mid in hosted.moved:
            return DDictManagerMovedError(
                f"manager {mid} of {hosted.name!r} moved to {hosted.moved[mid][0]}"
            )
        if mid in hosted.fenced:
            return DDictLeaseError(
                f"manager {mid} of {hosted.name!r} does not serve at process "
                f"{os.getpid()} now: {hosted.fenced[mid][1]}"
            )
        return DDictManagerUnavailableError(
            f"manager {mid} of {hosted.name!r} is not hosted by process {os.getpid()}"
        )

    def _other_term(self, hosted: HostedDict, manager: Manager, term: int) -> DDictError:
        """A request for ``manager`` under another term than the one it is served under here
        (``term``, :func:`~dask_ddict.layout.wire_term`): a client that knows of a newer one
        (this host was replaced and does not know it yet) is answered ``LEASE``, and this
        host renews at once to learn it; one that knows of an older one is told ``MOVED``
        (it asks the orchestrator for the layout and sends it again)."""
        mid = manager.manager_id
        if term_is_newer(term, manager.wire):
            if hosted.lease is not None:
                hosted.lease.renew_soon()
            return DDictLeaseError(
                f"manager {mid} of {hosted.name!r} is served under a newer "
                f"term than process {os.getpid()} knows of: it asks the "
                "orchestrator"
            )
        return DDictManagerMovedError(
            f"manager {mid} of {hosted.name!r} is served under a newer "
            f"term (term {manager.term}) than its client knows of"
        )

    def _check_lengths(
        self, c: Connection, mid: int, klen: int, vlen: int, flags: int = 0, tag: int = 0
    ) -> None:
        """Refuse (and drop) a request whose key or value could never be stored (answered
        unless it asked for no reply: its client reads the next answer as its next
        request's, so it learns from the dropped connection instead)."""
        hosted = c.hosted
        manager = hosted.managers.get(mid)
        e: DDictError
        if klen > self.limits.max_key_bytes + 16:
            e = DDictError(
                f"a {klen}-byte key section is over the limit (ddict.transport.max-key-bytes)",
                "INVALID_ARGUMENT",
            )
        elif manager is None:
            moved = hosted.moved.get(mid)
            fenced = hosted.fenced.get(mid)
            replica = hosted.replicas.get(mid)  # (a change set: up to twice a shard's value)
            if (
                vlen <= self.limits.max_key_bytes
                or (moved is not None and vlen <= self.limits.most_value(moved[1]))
                or (fenced is not None and vlen <= self.limits.most_value(fenced[0].store.capacity))
                or (
                    replica is not None
                    and vlen <= 2 * self.limits.most_value(replica.store.capacity)
                )
            ):
                return  # the body is read, then answered: not hosted here, closed, or MOVED
            e = self._not_hosted(hosted, mid)
        elif vlen > self.limits.most_value(manager.store.capacity):
            e = DDictFullError(
                f"a {vlen}-byte value cannot fit manager {mid}'s "
                f"{manager.store.capacity}-byte shard"
            )
        else:
            return
        c.flush()  # (the replies kept back go first, also before the connection ends)
        if not flags & FLAG_NOREPLY:
            _send_error(c.out, e, tag)
        raise ConnectionAbortedError(f"request over the limits: {e.message}")

    # -- lifecycle --------------------------------------------------------------

    def close(self) -> None:
        """Drop every connection.  The listeners are the supervisor's: left as they are."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        if self.loop is not None:
            self.loop.close()
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass


def _deliver(owed: list[Any]) -> None:
    """A connection's next request came: the last at-most-once reply was read whole, so
    its manager may drop what it kept of it (:meth:`Manager.delivered`)."""
    last, owed[0] = owed[0], None
    last[0].delivered(last[1])


def _send_error(conn: Sink, e: BaseException, tag: int) -> None:
    """Answer the request tagged ``tag`` with ``e`` (the client raises it again); ``conn``:
    the connection's ``out`` (on the event loop a :class:`~.loop.NoWait`: a client slow to
    read holds up only its own connection, never the loop)."""
    status, msg = wire_error(e)
    send_parts(conn, [REP.pack(status, tag, 0, len(msg)), msg])


def _inline(op: int, arg: int) -> bool:
    """Whether the event loop serves a request itself (a broadcast: its inner operation's)."""
    return op in INLINE and (op != _FANOUT or arg in INLINE)


def _loop_replier(c: Connection) -> Reply:
    """The reply function of a connection served by the event loop: a small payload's
    reply goes in one send that does not wait (:func:`~dask_ddict.kernels.send_reply`),
    with what the socket did not take sent after handing the loop on, as
    :class:`~.loop.NoWait` sends the others (a peer slow to read holds up only itself).

    While the loop serves requests that one receive brought and more of them are
    buffered (``c.batching``), a small reply is kept back (a copy: its payload may be a
    view of a snapshot that ends with the handler) and goes out with the next ones in
    one send (:meth:`~.loop.Connection.flush`); any other reply flushes them first."""
    sock, tag, reader, held = c.sock, c.tag, c.reader, c.held
    send, small, general, head = kernels.send_reply, SMALL, _replier(c.out, tag), REP.pack

    def reply(ival: int = 0, payload: Any = b"") -> None:
        if c.batching and reader.buffered() >= _HEAD:  # (another request is here)
            t = type(payload)
            n = len(payload) if t is bytes else payload.nbytes if t is memoryview else small + 1
            if n <= small and (t is bytes or payload.c_contiguous):
                held.append(head(0, tag[0], ival, n) + payload)
                c.holding += REP.size + n
                if c.holding > small:
                    c.flush()
                return
        if held or c.sending is not None:
            c.flush()
        rest = send(sock, tag[0], ival, payload, small)
        if rest is None:
            return
        if rest is NotImplemented:
            general(ival, payload)
            return
        _blocking.will_block()
        send_waiting(sock, rest)

    return reply


def _replier(out: Sink, tag: list[int]) -> Reply:
    """The reply function of a connection whose sends go through ``out`` (its socket, or
    the event loop's :class:`~.loop.NoWait` over it); ``tag[0]``: the tag of the request
    being served (its reply repeats it)."""
    send, head = out.sendall, REP.pack

    def reply(ival: int = 0, payload: Any = b"") -> None:
        t = type(payload)
        if t is bytes or t is memoryview:  # (types whose "+" is a concatenation)
            n = len(payload) if t is bytes else payload.nbytes
            if n <= SMALL:  # one copy, one send (as send_parts, with less around it)
                send(head(0, tag[0], ival, n) + payload)
                return
        elif t is list:  # a payload in parts: sent as they are, never joined when large
            n = sum(p.nbytes if type(p) is memoryview else len(p) for p in payload)
            send_parts(out, [head(0, tag[0], ival, n), *payload], REP.size + n)
            return
        else:
            n = memoryview(payload).nbytes
        send_parts(out, [head(0, tag[0], ival, n), payload], REP.size + n)

    return reply
