"""The process's key lane: a handle's single-key gets, ``in``s, puts, pops and
``fetch_add``s, and its ``get_many``s, over TCP in one call; and its gets, ``in``s and
puts of a manager on this host, read from the shard or committed into it in one call
(the channel's ``kernels.SharedState.read_here`` and ``put_here``).

``d[key]``, ``d.get(key)``, ``key in d``, ``d[key] = value``, ``d.pop(key)``,
``d.fetch_add(key, n)`` and ``d.get_many(keys)`` first ask :data:`LANE`
(:class:`~dask_ddict.kernels.KeyLane`, compiled where the kernels
were built), which routes the keys, finds their managers' links, and exchanges the
requests on the process's pooled connections without a Python frame (a ``get_many``:
one request per link, all sent before any reply is read; a put inside a batch: buffered
as ``BatchPut.add`` buffers it); for anything but the common case
it answers ``NotImplemented`` and the handle takes its Python path (the reference:
routing, the channel, the operation, the link's ``call``), which says what happened.
The lane reads the handle as :class:`~dask_ddict.client.base.HandleBase` declares it,
and keeps nothing of it: one lane serves every handle of the process, wired here to the
transport's pieces (the wire's codes, the channel class of a TCP link's manager, the
connection pool, the timings' switch, the buffers large values are received into).
"""

from __future__ import annotations

from typing import Any

from .. import kernels
from .._serialize import SMALL_FRAME, Framed, aligned_empty, loads_value
from ..errors import DDictTimeoutError, Status, error_for_status
from ..transport import timing
from ..transport.bounded_connection import Deadline
from ..transport.idle_pool import IDLE_POOL
from ..transport.many_key_ops import GetMany
from ..transport.operation import Operation
from ..transport.ops import Contains, FetchAdd, Get, Pop, Put
from ..transport.protocol import FLAG_PERSIST, SMALL, Op
from ..transport.socket_client import SocketChannel
from .batch import RECORD_FRAMING

#: The lane's operations, each as the Python path names it in a timeout's message.
_OPERATIONS: dict[int, Operation] = {
    int(Op.GET): Get(b"", 0),
    int(Op.CONTAINS): Contains(b"", 0),
    int(Op.PUT): Put(b"", b"", Framed((), 0), 0, 0),
    int(Op.GET_MANY): GetMany((), 0),
    int(Op.POP): Pop(b"", 0, 0),
    int(Op.FETCH_ADD): FetchAdd(b"", b"", 0, 0, 0),
}


def _timed_out(h: Any, key: Any, op: int, link: Any, mid: int, message: bytes | None) -> Any:
    """The error of a lane's operation whose time ran out, as the Python path raises it:
    the link's ``timed_out`` (no answer within the time and its slack), or the host's
    (its own wait ran out); a get's says why under ``wait_for_keys``."""
    o = _OPERATIONS[op]
    if message is None:
        e: Any = link.timed_out(o, mid, h._timeout, True)
    else:
        e = error_for_status(int(Status.TIMEOUT), message.decode(errors="replace"))
    if op == int(Op.GET) and isinstance(e, DDictTimeoutError):
        return h._no_writer(key, e)
    return e


def wired(kind: type[kernels.KeyLane] = kernels.KeyLane) -> kernels.KeyLane:
    """A lane of ``kind`` (the kernels' set, or either set's, for the tests that compare
    them) wired to this transport."""
    wire = kernels.LaneWire(
        int(Op.GET),
        int(Op.CONTAINS),
        int(Op.PUT),
        int(Op.GET_MANY),
        int(Op.POP),
        int(Op.FETCH_ADD),
        FLAG_PERSIST,
        int(Status.KEY_NOT_FOUND),
        int(Status.TIMEOUT),
        SMALL,
        SMALL_FRAME,
        RECORD_FRAMING,
    )
    return kind(
        wire, SocketChannel, IDLE_POOL, timing, aligned_empty, loads_value, _timed_out, Deadline
    )


#: The lane of every handle of this process.
LANE = wired()
