"""The streams of a filter's results: from task to task, and to the caller, over sockets.

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

Why not Dask's ``Queue`` or ``Variable``: they carry their data through the
scheduler, which must never be on a data path.  Why sockets of our own rather
than ``distributed.comm``: the code at both ends is synchronous (a task's
thread, the caller's iterator), and a blocking socket per child with an
explicit credit window is the simplest way to bound what is in flight (see
:mod:`dask_ddict.filter` for the measured comparison).  Exact reads, TLS
contexts, token checks and connecting come from the key path's toolkit,
:mod:`dask_ddict.transport.sockets`.
"""

from __future__ import annotations

import logging
import pickle
import socket
import ssl
import struct
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import config
from ..errors import DDictTaskError
from ..transport.sockets import matches, recv_exact, shut

logger = logging.getLogger(__name__)

_HEAD = struct.Struct("!BQ")
_LEN = struct.Struct("!I")
_NODE = struct.Struct("!q")
HELLO, PARENT, ITEMS, END, ERROR = 1, 2, 3, 4, 5
LOST, TASK = 6, 7  # (events of a receiver's queue, not frames)
ROOT = -1  # the parent of the tree's top nodes: the caller
TOKEN_BYTES = 32
CREDIT = b"\x01"  # one batch's room, written back by the parent
POLL = 0.1  # seconds between checks that the other end is still there, while waiting


@dataclass(frozen=True)
class StreamLimits:
    """How results travel: batches, the credit window, and how long to wait for peers."""

    batch_items: int
    batch_bytes: int
    window: int
    flush_after: float
    connect_timeout: float

    @classmethod
    def from_config(cls) -> StreamLimits:
        return cls(
            int(config.get("compute.batch-items")),
            config.get_bytes("compute.batch-bytes"),
            int(config.get("compute.window")),
            config.get_seconds("compute.flush-after") or 0.0,
            config.get_seconds("compute.connect-timeout") or 60.0,
        )


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
        where = (
            f"manager {self.manager_id}"
            if self.manager_id is not None
            else f"merge node {self.node}"
        )
        last = self.text.strip().splitlines()[-1] if self.text.strip() else "failed"
        err = DDictTaskError(
            f"filter: mgr_code on {where} raised {last}", manager_id=self.manager_id
        )
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
    """The receiver was closed (its own parent left) while it waited."""


# -- frames ------------------------------------------------------------------------


def send_frame(sock: socket.socket, kind: int, payload: bytes = b"") -> None:
    head = _HEAD.pack(kind, len(payload))
    if len(payload) < 1 << 16:
        sock.sendall(head + payload)
    else:
        sock.sendall(head)
        sock.sendall(payload)


def recv_frame(
    sock: socket.socket,
    only: int | None = None,
    max_bytes: int = 0,
) -> tuple[int, bytes]:
    """The next frame; with ``only``, a frame of that kind of at most ``max_bytes`` or
    ``ValueError`` before anything is allocated (what a stranger's first frame gets).
    A peer that closes raises :class:`~dask_ddict.transport.sockets.PeerClosed`, an
    ``EOFError``."""
    kind, n = _HEAD.unpack(recv_exact(sock, _HEAD.size))
    if only is not None and (kind != only or n > max_bytes):
        raise ValueError(f"expected a frame {only} of at most {max_bytes} bytes, got {kind} of {n}")
    return kind, bytes(recv_exact(sock, n)) if n else b""


#: The largest ``HELLO``: token, node number, and an address (host and port).
HELLO_MAX = TOKEN_BYTES + _NODE.size + 512


def hello(token: bytes, node: int, address: tuple[str, int] | None) -> bytes:
    where = f"{address[0]}|{address[1]}".encode() if address is not None else b""
    return token + _NODE.pack(node) + where


def parse_hello(payload: bytes, token: bytes) -> tuple[int, tuple[str, int] | None] | None:
    """``(node, address)`` of a child's hello, ``None`` if it does not know the token."""
    if len(payload) < TOKEN_BYTES + _NODE.size or not matches(token, payload[:TOKEN_BYTES]):
        return None
    (node,) = _NODE.unpack_from(payload, TOKEN_BYTES)
    rest = payload[TOKEN_BYTES + _NODE.size :].decode()
    if not rest:
        return node, None
    host, port = rest.rsplit("|", 1)
    return node, (host, int(port))


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

    def __init__(
        self,
        sock: socket.socket | None,
        limits: StreamLimits,
        join: Callable[[], socket.socket | None] | None = None,
        before_wait: Callable[[], None] | None = None,
    ) -> None:
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
        if (
            len(self._batch) >= lim.batch_items
            or self._bytes >= lim.batch_bytes
            or now - self._since >= lim.flush_after
        ):
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
            shut(self._sock)

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
