"""The process's key lane: a handle's single-key gets, ``in``s and puts over TCP in one call.

``d[key]``, ``d.get(key)``, ``key in d`` and ``d[key] = value`` first ask :data:`LANE`
(:class:`~dask_ddict.kernels.KeyLane`, compiled where the kernels were built), which
routes the key, finds its manager's link, and exchanges the request on one of the
process's pooled connections without a Python frame; for anything but the common case
it answers ``NotImplemented`` and the handle takes its Python path (the reference:
routing, the channel, the operation, the link's ``call``), which says what happened.
The lane reads the handle as :class:`~dask_ddict.client.base.HandleBase` declares it,
and keeps nothing of it: one lane serves every handle of the process, wired here to the
transport's pieces (the wire's codes, the channel class of a TCP link's manager, the
connection pool, the timings' switch, the buffers large values are received into).
"""

from __future__ import annotations

from .. import kernels
from .._serialize import SMALL_FRAME, aligned_empty, loads_value
from ..errors import Status
from ..transport import timing
from ..transport.idle_pool import IDLE_POOL
from ..transport.protocol import FLAG_PERSIST, SMALL, Op
from ..transport.socket_client import SocketChannel


def wired(kind: type[kernels.KeyLane] = kernels.KeyLane) -> kernels.KeyLane:
    """A lane of ``kind`` (the kernels' set, or either set's, for the tests that compare
    them) wired to this transport."""
    wire = kernels.LaneWire(
        int(Op.GET),
        int(Op.CONTAINS),
        int(Op.PUT),
        FLAG_PERSIST,
        int(Status.KEY_NOT_FOUND),
        SMALL,
        SMALL_FRAME,
    )
    return kind(wire, SocketChannel, IDLE_POOL, timing, aligned_empty, loads_value)


#: The lane of every handle of this process.
LANE = wired()
