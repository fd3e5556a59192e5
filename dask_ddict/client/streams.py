"""The streams of a filter's results: from task to task, and to the caller, over sockets.

Why not Dask's ``Queue`` or ``Variable``: they carry their data through the
scheduler, which must never be on a data path.  Why plain sockets rather than
``distributed.comm``: the code at both ends is synchronous (a task's thread,
the caller's iterator), and a blocking socket per child with an explicit
credit window is the simplest way to bound what is in flight.

Each child (a task) connects to its parent (a merge task, or the caller) and
sends frames of one kind byte and an 8-byte length:

* ``HELLO``: the filter's token, the child's node number, and the address the
  child itself listens on (merge nodes) or nothing;
* ``ITEMS``: a batch of pickled items (each with a 4-byte length);
* ``END`` (all sent) or ``ERROR`` (a pickled :class:`Failure`).

The parent writes one byte per credit back: a child sends a batch only with a
credit in hand, and the parent gives one back when it has consumed a batch.  So
at most ``window`` batches per child are buffered at any time, whatever the
size of the result.  The caller's end (the root) also tells each task where its
parent listens (``PARENT``): merge tasks bind their port only once they run, so
they say it to the root, which answers their children.
"""

from __future__ import annotations

import heapq
import hmac
import logging
import pickle
import queue
import socket
import ssl
import struct
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .. import config
from ..errors import DDictError, DDictTaskError

logger = logging.getLogger(__name__)

_HEAD = struct.Struct("!BQ")
_LEN = struct.Struct("!I")
_NODE = struct.Struct("!q")
HELLO, PARENT, ITEMS, END, ERROR = 1, 2, 3, 4, 5
LOST, TASK = 6, 7  # (events of a hub's queue, not frames)
ROOT = -1
#: What :meth:`Hub.merged` yields when it is about to wait for its children: whoever
#: batches the merged results hands on what it holds (a merge task flushes, the
#: async iterator returns its batch) instead of keeping it until more come.
IDLE: tuple[Any, Any] = (None, None)
TOKEN_BYTES = 32
_CREDIT = b"\x01"
_POLL = 0.1  # seconds between checks that the other end is still there, while waiting


@dataclass(frozen=True)
class Limits:
    """How results travel: batches, the credit window, and how long to wait for peers."""

    batch_items: int
    batch_bytes: int
    window: int
    flush_after: float
    connect_timeout: float

    @classmethod
    def from_config(cls) -> Limits:
        return cls(int(config.get("compute.batch-items")), config.get_bytes("compute.batch-bytes"),
                   int(config.get("compute.window")),
                   config.get_seconds("compute.flush-after") or 0.0,
                   config.get_seconds("compute.connect-timeout") or 60.0)  # fmt: skip


@dataclass(frozen=True)
class Failure:
    """What a failed node sends up the tree, and the caller raises."""

    node: int
    manager_id: int | None
    text: str  # the exception and its traceback, as the task saw them
    error: bytes | None  # the exception pickled (None: it does not pickle)

    @classmethod
    def of(cls, node: int, manager_id: int | None, e: BaseException) -> Failure:
        text = "".join(traceback.format_exception(e))
        try:
            raw: bytes | None = pickle.dumps(e)
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its text travels
            raw = None
        return cls(node, manager_id, text, raw)

    def exception(self) -> DDictTaskError:
        where = f"manager {self.manager_id}" if self.manager_id is not None \
            else f"merge node {self.node}"  # fmt: skip
        last = self.text.strip().splitlines()[-1] if self.text.strip() else "failed"
        err = DDictTaskError(f"filter: mgr_code on {where} raised {last}", manager_id=self.manager_id)
        cause: BaseException | None = None
        if self.error is not None:
            try:
                cause = pickle.loads(self.error)
            except Exception:  # noqa: BLE001 - e.g. its class is not importable here
                cause = None
        if cause is not None:
            cause.add_note(f"(raised on {where}; its traceback there:)\n{self.text}")
            err.__cause__ = cause
        else:
            err.add_note(self.text)
        return err


class Failed(Exception):
    """A child failed: its :class:`Failure` goes on up (or is raised at the root)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.text)
        self.failure = failure


class Stopped(Exception):
    """The hub was closed (its own parent left) while it waited."""


# -- frames ------------------------------------------------------------------------


def send_frame(sock: socket.socket, kind: int, payload: bytes = b"") -> None:
    head = _HEAD.pack(kind, len(payload))
    if len(payload) < 1 << 16:
        sock.sendall(head + payload)
    else:
        sock.sendall(head)
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the other end closed the stream")
        got += k
    return buf


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    kind, n = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    return kind, bytes(_recv_exact(sock, n)) if n else b""


def hello(token: bytes, node: int, address: tuple[str, int] | None) -> bytes:
    where = f"{address[0]}|{address[1]}".encode() if address is not None else b""
    return token + _NODE.pack(node) + where


def parse_hello(payload: bytes, token: bytes) -> tuple[int, tuple[str, int] | None] | None:
    """``(node, address)`` of a child's hello, ``None`` if it does not know the token."""
    if len(payload) < TOKEN_BYTES + _NODE.size or not hmac.compare_digest(
        payload[:TOKEN_BYTES], token
    ):
        return None
    (node,) = _NODE.unpack_from(payload, TOKEN_BYTES)
    rest = payload[TOKEN_BYTES + _NODE.size :].decode()
    if not rest:
        return node, None
    host, port = rest.rsplit("|", 1)
    return node, (host, int(port))


def connect(address: tuple[str, int], timeout: float,
            ssl_context: ssl.SSLContext | None = None) -> socket.socket:  # fmt: skip
    """A stream's socket to ``address`` (TLS with ``ssl_context``: the cluster's)."""
    sock = socket.create_connection(address, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if ssl_context is not None:
        try:
            return ssl_context.wrap_socket(sock)
        except BaseException:
            sock.close()
            raise
    return sock


def tls_context(security: Any, role: str, listen: bool) -> ssl.SSLContext:
    """The cluster's TLS context for a filter's streams, in ``role`` (``"client"``: the
    caller, ``"worker"``: a task): the certificates the cluster's own comms use, so a
    filter's results travel encrypted and only between members of the cluster."""
    args = security.get_listen_args(role) if listen else security.get_connection_args(role)
    ctx = args.get("ssl_context")
    if ctx is None:
        raise DDictError(f"the cluster requires TLS but this process has no {role} "
                         "certificate (configure distributed.comm.tls or pass a client with "
                         "security=)", "INVALID_OPERATION")  # fmt: skip
    return ctx


def _close(sock: socket.socket) -> None:
    """Close ``sock``, waking a thread blocked on it (a plain close would not)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def split_items(payload: bytes) -> deque[bytes]:
    """The pickled items of an ``ITEMS`` frame."""
    out: deque[bytes] = deque()
    mv = memoryview(payload)
    off = 0
    while off < len(mv):
        (n,) = _LEN.unpack_from(mv, off)
        off += _LEN.size
        out.append(bytes(mv[off : off + n]))
        off += n
    return out


# -- the sending end: ``out_queue`` --------------------------------------------------


class Sender:
    """A child's end of its stream: ``out_queue`` of ``mgr_code``, a merge task's output.

    :meth:`put` batches items (at most ``batch_items`` items or about
    ``batch_bytes`` bytes, or what came within ``flush_after``) and sends a
    batch only with a credit from the parent: a producer faster than the
    caller reads blocks in :meth:`put`.  Once the parent has gone (the caller
    left the ``with`` block), :meth:`put` raises ``EOFError``.

    Without a socket, the sender connects at its first flush, with ``join``
    (a socket, or ``None``: the caller has left); ``before_wait`` is called
    once, just before it first waits for a credit (a leaf leaves its worker's
    thread pool then).
    """

    def __init__(self, sock: socket.socket | None, limits: Limits,
                 join: Callable[[], socket.socket | None] | None = None,
                 before_wait: Callable[[], None] | None = None) -> None:  # fmt: skip
        self._sock = sock
        self._join = join
        self._before_wait = before_wait
        self._limits = limits
        self._batch: list[bytes] = []
        self._bytes = 0
        self._since = 0.0
        self._credits = 0
        self.left = False

    def __repr__(self) -> str:
        state = "left" if self.left else f"credits={self._credits} batched={len(self._batch)}"
        return f"<out_queue {state}>"

    def put(self, item: Any) -> None:
        """Send ``item`` to the caller (pickled here); ``EOFError`` once it has left."""
        self.put_pickled(pickle.dumps(item, protocol=5))

    def put_pickled(self, blob: bytes) -> None:
        if self.left:
            raise EOFError("the filter's caller has left: no more results are read")
        now = time.monotonic()
        if not self._batch:
            self._since = now
        self._batch.append(blob)
        self._bytes += len(blob)
        lim = self._limits
        if (len(self._batch) >= lim.batch_items or self._bytes >= lim.batch_bytes
                or now - self._since >= lim.flush_after):  # fmt: skip
            self.flush()

    def flush(self) -> None:
        """Send the batch, waiting for a credit (the parent's room) if needed."""
        if not self._batch:
            return
        self._connected()
        self._poll(block=False)
        if self._credits == 0 and self._before_wait is not None:
            self._before_wait()
            self._before_wait = None
        while self._credits == 0:
            self._poll(block=True)
        parts = []
        for blob in self._batch:
            parts += [_LEN.pack(len(blob)), blob]
        self._send(ITEMS, b"".join(parts))
        self._credits -= 1
        self._batch.clear()
        self._bytes = 0

    def end(self) -> None:
        """All sent: flush and say so."""
        self.flush()
        self._connected()
        self._send(END)

    def fail(self, failure: Failure) -> None:
        """Send ``failure`` up (best effort: no credit needed, a gone parent ignored)."""
        try:
            send_frame(self._connected(), ERROR, pickle.dumps(failure))
        except (OSError, EOFError):
            self.left = True

    def close(self) -> None:
        if self._sock is not None:
            _close(self._sock)

    def _connected(self) -> socket.socket:
        """The socket to the parent, joined now if not yet (its first credits read:
        the parent gives its window as it attaches); ``EOFError`` if the caller left."""
        if self._sock is None:
            join, self._join = self._join, None
            sock = None if join is None else join()
            if sock is None:
                self._left()
            self._sock = sock
            self._poll(block=True)
        assert self._sock is not None
        return self._sock

    def gone(self) -> bool:
        """Whether the parent has left (checked without waiting)."""
        if not self.left:
            try:
                self._poll(block=False)
            except EOFError:
                pass
        return self.left

    def _send(self, kind: int, payload: bytes = b"") -> None:
        try:
            send_frame(self._connected(), kind, payload)
        except OSError:
            self._left()

    def _poll(self, block: bool) -> None:
        if self._sock is None:
            return  # (not joined yet: no credit to read)
        sock = self._sock
        try:
            if not block:  # (no MSG_DONTWAIT: a TLS socket takes no flags)
                sock.settimeout(0.0)
            data = sock.recv(4096)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:
            self._left()
        finally:
            if not block:
                sock.settimeout(None)
        if not data:
            self._left()
        self._credits += len(data)

    def _left(self) -> None:
        self.left = True
        raise EOFError("the filter's caller has left: no more results are read")


# -- the receiving end: a merge node or the caller ---------------------------------------------


class _Ordered:
    """A head item in a merge's heap: ``comparator(x, y)`` true puts x first; ties by arrival."""

    __slots__ = ("blob", "cmp", "item", "node", "seq")

    def __init__(self, item: Any, blob: bytes, node: int, seq: int,
                 cmp: Callable[[Any, Any], bool]) -> None:  # fmt: skip
        self.item, self.blob, self.node, self.seq, self.cmp = item, blob, node, seq, cmp

    def __lt__(self, other: _Ordered) -> bool:
        if self.cmp(self.item, other.item):
            return True
        if self.cmp(other.item, self.item):
            return False
        return self.seq < other.seq


class Hub:
    """Where children connect: a merge task, or (``parents`` given) the caller.

    One thread accepts, one per child reads its frames into one queue, and
    :meth:`merged` (the node's own thread) takes them out in order and gives
    credits back.  The caller's hub also answers every task of the tree where
    its parent listens (``parents``: the parent of each node).
    """

    def __init__(self, host: str, token: bytes, children: list[int], leaves: int,
                 limits: Limits, parents: tuple[int, ...] | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:  # fmt: skip
        self._ssl = ssl_context  # (TLS clusters: every child's connection is TLS)
        self._token = token
        self._leaves = leaves  # nodes below this number are managers
        self._children = set(children)
        self._limits = limits
        self._parents = parents
        self._q: queue.Queue[tuple[int, int, Any]] = queue.Queue()
        self._socks: dict[int, socket.socket] = {}
        self._addresses: dict[int, tuple[str, int]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(_POLL)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        threading.Thread(target=self._accept, name=f"ddict-filter-accept-{self.address[1]}",
                         daemon=True).start()  # fmt: skip

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._socks)}/{len(self._children)} children"
        return f"<Hub {self.address[0]}:{self.address[1]} {state}>"

    # -- connections -------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._greet, args=(conn,), daemon=True,
                             name=f"ddict-filter-greet-{self.address[1]}").start()  # fmt: skip

    def _greet(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self._limits.connect_timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(conn, server_side=True)
            kind, payload = recv_frame(conn)
            said = parse_hello(payload, self._token) if kind == HELLO else None
            if said is None:
                raise ValueError("not a child of this filter")
            node, address = said
            if self._parents is not None and not self._answer(conn, node, address):
                return  # (the root told a task where its parent is)
            self._attach(node, conn)
        except (OSError, EOFError, ValueError) as e:
            logger.debug("ddict filter: a connection refused: %r", e)
            _close(conn)

    def _answer(self, conn: socket.socket, node: int, address: tuple[str, int] | None) -> bool:
        """Tell ``node`` where its parent listens; ``True``: the parent is this hub."""
        assert self._parents is not None
        with self._cond:
            if address is not None:
                self._addresses[node] = address
                self._cond.notify_all()
            parent = self._parents[node] if 0 <= node < len(self._parents) else None
            if parent is None:
                raise ValueError(f"no node {node} in this filter")
            if parent == ROOT:
                send_frame(conn, PARENT)
                return True
            deadline = time.monotonic() + self._limits.connect_timeout
            while parent not in self._addresses and not self._closed:
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    raise ValueError(f"merge node {parent} never started")
            if self._closed:
                raise ValueError("the filter is over")
            host, port = self._addresses[parent]
        send_frame(conn, PARENT, f"{host}|{port}".encode())
        _close(conn)
        return False

    def _attach(self, node: int, conn: socket.socket) -> None:
        with self._cond:
            if self._closed or node not in self._children or node in self._socks:
                raise ValueError(f"node {node} is not an expected child (or came twice)")
            self._socks[node] = conn
        conn.settimeout(None)
        conn.sendall(_CREDIT * self._limits.window)
        threading.Thread(target=self._read, args=(node, conn), daemon=True,
                         name=f"ddict-filter-read-{node}").start()  # fmt: skip

    def _read(self, node: int, conn: socket.socket) -> None:
        try:
            while True:
                kind, payload = recv_frame(conn)
                self._q.put((node, kind, payload))
                if kind in (END, ERROR):
                    return
        except (OSError, EOFError):
            if not self._closed:
                self._q.put((node, LOST, b""))

    def event(self, node: int, kind: int, payload: Any) -> None:
        """Queue an event beside the frames (the caller's: a task ended)."""
        self._q.put((node, kind, payload))

    def _credit(self, node: int) -> None:
        try:
            self._socks[node].sendall(_CREDIT)
        except OSError:
            pass  # (its reader reports it lost)

    def close(self) -> None:
        """Close every connection: children see the stream end (``put`` raises EOFError)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            socks = list(self._socks.values())
        for s in [self._listener, *socks]:
            _close(s)

    # -- merging -------------------------------------------------------------------

    def _next(self, stop: Callable[[], bool], on_task: Callable[[int, Any], None]
              ) -> tuple[int, int, Any]:  # fmt: skip
        """The next frame of a child; raises :class:`Failed` for a failed or lost one."""
        while True:
            try:
                node, kind, payload = self._q.get(timeout=_POLL)
            except queue.Empty:
                if stop():
                    raise Stopped() from None
                continue
            if kind == ERROR:
                raise Failed(pickle.loads(payload))
            if kind == LOST:
                raise Failed(Failure(node, node if node < self._leaves else None,
                                     "its task stopped before its end (its worker died?)", None))  # fmt: skip
            if kind == TASK:
                on_task(node, payload)
                continue
            return node, kind, payload

    def merged(self, comparator: Callable[[Any, Any], bool] | None, stop: Callable[[], bool],
               on_task: Callable[[int, Any], None] = lambda node, what: None,
               ) -> Iterator[tuple[Any, bytes]]:  # fmt: skip
        """``(item or None, pickled item)`` of every child: in arrival order, or merged in
        ``comparator`` order (items are unpickled here only to be compared); and
        :data:`IDLE` each time it is about to wait for a child."""
        if comparator is None:
            live = set(self._children)
            while live:
                if self._q.empty():
                    yield IDLE
                node, kind, payload = self._next(stop, on_task)
                if kind == ITEMS:
                    for blob in split_items(payload):
                        yield None, blob
                    self._credit(node)
                elif kind == END:
                    live.discard(node)
            return
        yield from self._ordered(comparator, stop, on_task)

    def _ordered(self, cmp: Callable[[Any, Any], bool], stop: Callable[[], bool],
                 on_task: Callable[[int, Any], None]) -> Iterator[tuple[Any, bytes]]:  # fmt: skip
        batches: dict[int, deque[deque[bytes]]] = {n: deque() for n in self._children}
        ended: set[int] = set()

        def take(node: int) -> bytes | None:
            while not batches[node] and node not in ended:
                other, kind, payload = self._next(stop, on_task)
                if kind == ITEMS:
                    batches[other].append(split_items(payload))
                elif kind == END:
                    ended.add(other)
            if not batches[node]:
                return None
            first = batches[node][0]
            blob = first.popleft()
            if not first:
                batches[node].popleft()
                self._credit(node)
            return blob

        def waits(node: int) -> bool:
            return not batches[node] and node not in ended and self._q.empty()

        heap: list[_Ordered] = []
        seq = 0
        for node in sorted(self._children):
            if waits(node):
                yield IDLE
            blob = take(node)
            if blob is not None:
                heapq.heappush(heap, _Ordered(pickle.loads(blob), blob, node, seq, cmp))
                seq += 1
        while heap:
            top = heapq.heappop(heap)
            yield top.item, top.blob
            if waits(top.node):
                yield IDLE
            blob = take(top.node)
            if blob is not None:
                heapq.heappush(heap, _Ordered(pickle.loads(blob), blob, top.node, seq, cmp))
                seq += 1
