"""The receiving end of a filter's streams: a merge task's, or the caller's (the root).

A :class:`Receiver` listens, greets each child (its ``HELLO`` proves it belongs
to the filter: the token), reads its frames in a thread of its own, and merges
what all children send, in arrival or comparator order, giving a credit back
for every batch it has consumed (see :mod:`.streams` for the frames and
credits).  Rejected: one selector over every child instead of a reader thread
each; a node has at most ``branching_factor`` children (the caller: the top
level's), so the threads are few, and each stays plain blocking code, as the
tasks' is.
"""

from __future__ import annotations

import heapq
import logging
import pickle
import queue
import select
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from ..transport.sockets import shut
from .streams import (
    CREDIT,
    END,
    ERROR,
    HELLO,
    HELLO_MAX,
    ITEMS,
    LOST,
    PARENT,
    POLL,
    ROOT,
    TASK,
    Failed,
    Failure,
    Stopped,
    StreamLimits,
    parse_hello,
    recv_frame,
    send_frame,
    split_items,
)

logger = logging.getLogger(__name__)

#: Connections a receiver greets at once at most (a filter's tasks connect a few at a time;
#: more are strangers, refused at once rather than given a thread each).
MAX_GREETING = 256

#: What :meth:`Receiver.merged` yields when it is about to wait for its children: whoever
#: batches the merged results hands on what it holds (a merge task flushes, the
#: async iterator returns its batch) instead of keeping it until more come.
IDLE: tuple[Any, Any] = (None, None)


# -- the receiving end: a merge node or the caller ---------------------------------------------


class _Ordered:
    """A head item in a merge's heap: ``comparator(x, y)`` true puts x first; ties by arrival."""

    __slots__ = ("blob", "cmp", "item", "node", "seq")

    def __init__(
        self, item: Any, blob: bytes, node: int, seq: int, cmp: Callable[[Any, Any], bool]
    ) -> None:
        self.item, self.blob, self.node, self.seq, self.cmp = item, blob, node, seq, cmp

    def __lt__(self, other: _Ordered) -> bool:
        if self.cmp(self.item, other.item):
            return True
        if self.cmp(other.item, self.item):
            return False
        return self.seq < other.seq


class Receiver:
    """Where children connect: a merge task's, or (``parents`` given) the caller's.

    One thread accepts, one per child reads its frames into one queue, and
    :meth:`merged` (the node's own thread) takes them out in order and gives
    credits back.  The caller's receiver also answers every task of the tree where
    its parent listens (``parents``: the parent of each node).
    """

    def __init__(
        self,
        host: str,
        token: bytes,
        children: list[int],
        leaves: int,
        limits: StreamLimits,
        parents: tuple[int, ...] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
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
        self._greeting: set[socket.socket] = set()  # (connections not yet attached)
        #: Each child's socket is read by its reader thread and written (credits) by the
        #: merging thread: over TLS the two must not overlap (an SSL object is not
        #: thread-safe), so both hold the child's lock (reads only while a frame is there).
        self._locks: dict[int, threading.Lock] = {}
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(POLL)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        threading.Thread(
            target=self._accept, name=f"ddict-filter-accept-{self.address[1]}", daemon=True
        ).start()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._socks)}/{len(self._children)} children"
        return f"<Receiver {self.address[0]}:{self.address[1]} {state}>"

    # -- connections -------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._cond:
                crowded = len(self._greeting) >= MAX_GREETING
                if not crowded:
                    self._greeting.add(conn)
            if crowded:  # (a flood of strangers: only tasks of this filter connect)
                shut(conn)
                continue
            threading.Thread(
                target=self._greet,
                args=(conn,),
                daemon=True,
                name=f"ddict-filter-greet-{self.address[1]}",
            ).start()

    def _greet(self, conn: socket.socket) -> None:
        raw = conn
        try:
            conn.settimeout(self._limits.connect_timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(conn, server_side=True)
                with self._cond:
                    self._greeting.add(conn)  # (close() closes what the greeting holds)
            _, payload = recv_frame(conn, HELLO, HELLO_MAX)  # (checked before allocating)
            said = parse_hello(payload, self._token)
            if said is None:
                raise ValueError("not a child of this filter")
            node, address = said
            if self._parents is not None and not self._answer(conn, node, address):
                return  # (the root told a task where its parent is)
            self._attach(node, conn)
        except Exception as e:  # noqa: BLE001 - whatever a stranger sends: refused, closed
            logger.debug("ddict filter: a connection refused: %r", e)
            shut(conn)
        finally:
            with self._cond:
                self._greeting.discard(raw)
                self._greeting.discard(conn)

    def _answer(self, conn: socket.socket, node: int, address: tuple[str, int] | None) -> bool:
        """Tell ``node`` where its parent listens; ``True``: the parent is this receiver."""
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
                    why = (
                        f"its merge node {parent} did not start within "
                        f"{self._limits.connect_timeout} s"
                    )
                    send_frame(conn, ERROR, why.encode())  # (the task fails: not "caller left")
                    raise ValueError(why)
            if self._closed:
                raise ValueError("the filter is over")
            host, port = self._addresses[parent]
        send_frame(conn, PARENT, f"{host}|{port}".encode())
        shut(conn)
        return False

    def _attach(self, node: int, conn: socket.socket) -> None:
        with self._cond:
            if self._closed or node not in self._children or node in self._socks:
                raise ValueError(f"node {node} is not an expected child (or came twice)")
            self._locks[node] = threading.Lock()
            self._socks[node] = conn
        conn.settimeout(None)
        conn.sendall(CREDIT * self._limits.window)
        threading.Thread(
            target=self._read, args=(node, conn), daemon=True, name=f"ddict-filter-read-{node}"
        ).start()

    def _read(self, node: int, conn: socket.socket) -> None:
        tls = conn if isinstance(conn, ssl.SSLSocket) else None
        lock = self._locks[node]
        try:
            while True:
                if tls is None:
                    kind, payload = recv_frame(conn)
                else:  # (TLS: read only once a frame is there, under the child's lock)
                    if not tls.pending() and not select.select([tls], [], [], POLL)[0]:
                        if self._closed:
                            return
                        continue
                    with lock:
                        kind, payload = recv_frame(conn)
                self._q.put((node, kind, payload))
                if kind in (END, ERROR):
                    return
        except (OSError, EOFError, ValueError):  # (ValueError: select on a closed socket)
            if not self._closed:
                self._q.put((node, LOST, b""))

    def event(self, node: int, kind: int, payload: Any) -> None:
        """Queue an event beside the frames (the caller's: a task ended)."""
        self._q.put((node, kind, payload))

    def _credit(self, node: int) -> None:
        try:
            with self._locks[node]:
                self._socks[node].sendall(CREDIT)
        except OSError:
            pass  # (its reader reports it lost)

    def close(self) -> None:
        """Close every connection: children see the stream end (``put`` raises EOFError)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            socks = list(self._socks.values()) + list(self._greeting)
        for s in [self._listener, *socks]:
            shut(s)

    # -- merging -------------------------------------------------------------------

    def _next(
        self, stop: Callable[[], bool], on_task: Callable[[int, Any], None]
    ) -> tuple[int, int, Any]:
        """The next frame of a child; raises :class:`Failed` for a failed or lost one."""
        while True:
            try:
                node, kind, payload = self._q.get(timeout=POLL)
            except queue.Empty:
                if stop():
                    raise Stopped() from None
                continue
            if kind == ERROR:
                raise Failed(pickle.loads(payload))
            if kind == LOST:
                raise Failed(
                    Failure(
                        node,
                        node if node < self._leaves else None,
                        "its task stopped before its end (its worker died?)",
                        None,
                    )
                )
            if kind == TASK:
                on_task(node, payload)
                continue
            return node, kind, payload

    def merged(
        self,
        comparator: Callable[[Any, Any], bool] | None,
        stop: Callable[[], bool],
        on_task: Callable[[int, Any], None] = lambda node, what: None,
    ) -> Iterator[tuple[Any, bytes]]:
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

    def _ordered(
        self,
        cmp: Callable[[Any, Any], bool],
        stop: Callable[[], bool],
        on_task: Callable[[int, Any], None],
    ) -> Iterator[tuple[Any, bytes]]:
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
