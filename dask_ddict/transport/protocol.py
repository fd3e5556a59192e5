"""Wire format of the key path, shared by the server and the socket client.

Why not Dask's comms: a Dask RPC costs many times a blocking socket's round trip,
which a single-key operation would pay every time (``docs/design/transport.md``,
"Measured choices of the key path", has the figures).  Dask carries control only.

Every request is a fixed header, then the key section, then the value
section; every reply is a fixed header and a payload::

    request  = REQ(op, flags, term, klen, manager, tag, chkpt, arg, client, timeout, vlen,
                   rid)
               [digest(16) + key bytes: klen] [value: vlen]
    reply    = REP(status, tag, ival, plen) [payload: plen]

One host process serves many managers, so every request names its manager;
a connection is bound to one dictionary by its handshake (``HELLO``, then on
TCP mutual proofs of that dictionary's secret: :mod:`.handshake`), which is also where a
destroyed dictionary is told apart from an unreachable one.  ``rid`` is a
request id: non-idempotent operations (``pop``, ``fetch_add``) carry one so
that a request retried after a host restart is applied at most once.  ``term`` is the
manager's term as the client's layout has it (:func:`~dask_ddict.layout.wire_term`; 0:
none, a request of several managers or a host's own): a host that serves the manager
under another answers ``MOVED`` or ``LEASE`` instead (``HostServer._other_term``).  ``tag`` is
the client's number for the request, which its reply repeats: a client that
sends several requests on one connection before reading (:mod:`.pipelined`,
:class:`~dask_ddict.AsyncDDict`'s) matches each reply to its request by it, and
drops the late reply of a request that it gave up on.  A host serves one
connection's requests in order, each answered before the next is read (a
request that waits holds its connection), so a reply repeats the tag of the
request being served.

Small messages go out in one ``sendall``; large values are sent part by part
straight from their buffers and received with ``recv_into`` into a
preallocated buffer, never joined.
"""

from __future__ import annotations

import enum
import socket
import struct
from typing import Any, Protocol

from .. import kernels
from ..kernels import REPLY, REQUEST
from .sockets import PEER_CLOSED, recv_into_exact

REQ = REQUEST  # op, flags, term, klen, manager, tag, chkpt, arg, client, timeout, vlen, rid
# (declared with the kernel that reads it)
HELLO = struct.Struct("<4s16s")  # magic, dictionary uid (16 bytes)
HELLO_MAGIC = b"DDK5"  # 3: mutual, connection-bound proofs (handshake.py); 4: batch records
# name their manager (kernels.BATCH_RECORD), host-wide operations (GET_MANY, PUT_MANY); 5: tags
REP = REPLY  # status, tag, ival, payload length (declared with the kernel that reads it)
RECORD = struct.Struct("<IxxxxQ")  # (klen, vlen) of one page record
SMALL = 64 * 1024
_DONTWAIT = socket.MSG_DONTWAIT


class Op(enum.IntEnum):
    PUT = 1
    GET = 2
    CONTAINS = 3
    POP = 4
    LEN = 5
    CLEAR = 6
    PAGE = 7
    FETCH_ADD = 8
    WAIT_FOR = 9
    BATCH_PUT = 10
    BATCH_END = 11
    STATS = 12
    NEWEST = 13
    FREEZE = 14
    UNFREEZE = 15
    PING = 16
    # 17 was ADMIN (string-named calls with pickled arguments), replaced by typed operations:
    PERSIST = 18
    PERSISTED_IDS = 19
    SYNC = 20
    RESTORE = 21
    ADVANCE = 22
    DUMP_PAGE = 23
    COPY_FROM = 24
    SET_DEFAULT = 25
    FANOUT = 26  # one request, the same operation on several managers of one host process
    ROTATE = 27
    GET_MANY = 28  # many keys of several managers of one host process (transport.many_key_ops)
    PUT_MANY = 29  # many puts, answered per manager (transport.many_key_ops)
    GET_RANGE = 30  # part of a raw-bytes value, and its size (zarr's byte ranges, getsize)
    SHARD_PAGES = 31  # a moving manager's whole shard, to its new host (host.moves)
    REPLICATE = 32  # a primary's committed changes, to a replica's host (host.replicas)
    TREE = 33  # a broadcast along a tree of host processes, each forwarding (host.forward)


FLAG_PERSIST = 1
FLAG_NOREPLY = 2

#: What a PAGE request returns of each entry (bits).
WANT_KEYS, WANT_VALUES, WANT_ITEMS = 1, 2, 3


class Hello(enum.IntEnum):
    """The host's one-byte answer to a connection's ``HELLO``."""

    OK = 1
    CLOSED = 2  # the dictionary was destroyed
    UNKNOWN = 3  # this host serves no such dictionary
    DENIED = 4  # authentication failed
    PROVE = 5  # TCP: the host's proof follows; the client proves itself next


def value_limit(shard_bytes: int, floor: int) -> int:
    """The largest request value a host takes for a manager whose shard holds
    ``shard_bytes``: the shard's size (a bigger value could never be stored), but at
    least ``floor`` (``ddict.transport.min-value-limit``: small shards still take
    replication requests, which carry a serialized layout).  Hosts refuse larger
    values unread; clients check first and send nothing."""
    return max(shard_bytes, floor)


def encode_timeout(timeout: float | None) -> float:
    return -1.0 if timeout is None else float(timeout)


def decode_timeout(value: float) -> float | None:
    return None if value < 0 else value


class Sink(Protocol):
    """Where the key path writes: a socket, or a wrapper that decides how to wait."""

    def sendall(self, data: Any, /) -> Any: ...


class Stream(Sink, Protocol):
    """What the key path reads and writes: a socket, or a client's connection that cuts
    its waits at the operation's deadline (:class:`~.bounded_connection.BoundedConnection`)."""

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0, /) -> int: ...


def send_parts(sock: Sink, parts: list[Any], total: int | None = None) -> None:
    """Send buffers in order: one syscall when small, no join when large.

    ``total`` (the bytes in ``parts``) saves measuring every part when known.
    """
    if total is None:
        total = sum(memoryview(p).nbytes for p in parts)
    if total <= SMALL:
        sock.sendall(b"".join(parts))
        return
    small: list[Any] = []
    for p in parts:
        if memoryview(p).nbytes < SMALL:
            small.append(p)
            continue
        if small:
            sock.sendall(b"".join(small))
            small = []
        sock.sendall(p)
    if small:
        sock.sendall(b"".join(small))


class Reader(kernels.ReaderState):
    """Buffered reads from a socket: small messages in one ``recv``.

    ``read`` returns views of an internal buffer (valid until the next call);
    ``read_into`` fills a caller's buffer, copying what is already buffered
    and receiving the rest straight into it.
    """

    __slots__ = ()  # (its fields: the base's, C fields in the compiled kernels)

    def __init__(self, sock: Stream, size: int = SMALL) -> None:
        self.sock = sock
        self._buf = bytearray(size)
        self._mv = memoryview(self._buf)
        self._pos = 0
        self._end = 0

    def reserve(self, need: int) -> None:
        """Make room for ``need`` bytes from the read position (moved to the start,
        or a bigger buffer)."""
        if self._pos + need > len(self._buf):
            n = self._end - self._pos
            if need > len(self._buf):
                old = self._mv[self._pos : self._end]
                self._buf = bytearray(max(need, 2 * len(self._buf)))
                self._buf[:n] = old
                self._mv = memoryview(self._buf)
            else:
                self._mv[:n] = self._mv[self._pos : self._end]
            self._pos, self._end = 0, n

    def _fill(self, need: int) -> None:
        self.reserve(need)
        while self._end - self._pos < need:
            got = self.sock.recv_into(self._mv[self._end :])
            if not got:
                raise ConnectionResetError(PEER_CLOSED)  # (as the compiled kernels do)
            self._end += got

    def buffered(self) -> int:
        """Bytes received and not read yet."""
        return self._end - self._pos

    def emptied(self) -> bytearray:
        """The buffer, for a caller that receives into it itself (nothing buffered is
        lost: there must be none); :meth:`received` then says what it holds."""
        if self._end != self._pos:
            raise RuntimeError(f"{self._end - self._pos} received bytes not read yet")
        self._pos = self._end = 0
        return self._buf

    def received(self, start: int, end: int) -> None:
        """The caller received ``end`` bytes into :meth:`emptied`'s buffer and read the
        first ``start``: the rest is read from here."""
        self._pos, self._end = start, end

    def fill_nowait(self) -> int:
        """Receive what the socket has now, without waiting (an event loop's read);
        the bytes received (0: none ready).  Raises ``ConnectionResetError`` at EOF."""
        if self._end == len(self._buf):
            self.reserve(len(self._buf) - self._pos + 1)  # (moved down, or grown)
        try:
            got = self.sock.recv_into(self._mv[self._end :], 0, _DONTWAIT)
        except BlockingIOError:
            return 0
        if not got:
            raise ConnectionResetError(PEER_CLOSED)  # (as the compiled kernels do)
        self._end += got
        return got

    def peek(self, st: struct.Struct) -> tuple[Any, ...] | None:
        """The next ``st.size`` bytes unpacked, left unread; ``None`` if not all here."""
        if self._end - self._pos < st.size:
            return None
        return st.unpack_from(self._buf, self._pos)

    def read(self, n: int) -> memoryview:
        if n == 0:
            return self._mv[0:0]
        pos = self._pos
        if self._end - pos < n:
            self._fill(n)
            pos = self._pos
        self._pos = pos + n
        return self._mv[pos : pos + n]

    def unpack(self, st: struct.Struct) -> tuple[Any, ...]:
        """The next ``st.size`` bytes, unpacked (a header: no view, no copy)."""
        n = st.size
        if self._end - self._pos < n:
            self._fill(n)
        pos = self._pos
        self._pos = pos + n
        return st.unpack_from(self._buf, pos)

    def take(self, n: int) -> bytes:
        """A copy of the next ``n`` bytes (small sections: one copy, no view kept)."""
        pos = self._pos
        if self._end - pos < n:
            self._fill(n)
            pos = self._pos
        self._pos = pos + n
        return self._mv[pos : pos + n].tobytes()

    def read_into(self, dst: memoryview) -> None:
        n = dst.nbytes
        have = min(n, self._end - self._pos)
        if have:
            dst[:have] = self._mv[self._pos : self._pos + have]
            self._pos += have
        if have < n:
            recv_into_exact(self.sock, dst[have:])
