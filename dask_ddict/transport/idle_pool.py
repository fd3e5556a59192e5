"""The idle connections of a process, over all its links, bounded (:class:`IdlePool`).

A link (:class:`~.socket_client.HostLink`) opens connections to its host process and
gives each back here when an operation's answer is read; the pool decides which stay
open.  One bound for the whole process, rather than one per link, because a client may
touch any number of host processes: a per-link bound would still let its descriptors
grow with them.
"""

from __future__ import annotations

from typing import Protocol

from .. import config, kernels
from .._forking import in_child, reinit_lock
from .bounded_connection import BoundedConnection


class PooledLink(Protocol):
    """What the pool needs of a link (:class:`~.socket_client.HostLink`): its own idle
    connections, whether it is closed, and how it closes one of them."""

    idle: list[BoundedConnection]
    closed: bool

    def forget(self, conn: BoundedConnection) -> None: ...


class IdlePool:
    """The idle connections of this process, over all its links, least recently used
    first: at most ``ddict.transport.kept-connections`` stay open between operations.

    Each link's connections are its own (a connection is bound to one dictionary by
    its handshake); an operation takes one of its link's idle connections, the most
    recently used (warm), or opens a new one, and gives it back when its answer is
    read.  A connection given back past the bound closes the process's least
    recently used idle one, of any link: a client that touches many host processes,
    from any number of threads, holds a bounded number of descriptors, and the
    hosts in use keep theirs.  Connections in use are never in here, so none is
    closed under an operation.
    """

    def __init__(self) -> None:
        self.lock = kernels.ManagerLock()  # (the key lane takes it without a call)
        # (a plain dict: in the order given, least recently used first; cheaper to change
        # than an OrderedDict, twice on every operation)
        self.idle: dict[BoundedConnection, PooledLink] = {}
        # ddict.transport.kept-connections (each link sets it again when it connects)
        self.most = int(config.get("transport.kept-connections"))

    def take(self, link: PooledLink) -> BoundedConnection | None:
        with self.lock:
            if link.idle:
                conn = link.idle.pop()
                del self.idle[conn]
                return conn
        return None

    def give(self, link: PooledLink, conn: BoundedConnection) -> None:
        conn.check = None  # (no reference from an idle connection back to its link)
        with self.lock:
            if link.closed:
                over = [(conn, link)]
            else:
                link.idle.append(conn)
                self.idle[conn] = link
                if len(self.idle) <= self.most:
                    return
                over = []
                while len(self.idle) > self.most:
                    old = next(iter(self.idle))
                    owner = self.idle.pop(old)
                    owner.idle.remove(old)
                    over.append((old, owner))
        for old, owner in over:
            owner.forget(old)

    def remove(self, link: PooledLink, *, closing: bool) -> list[BoundedConnection]:
        """``link``'s idle connections, out of the pool (the link closes them); with
        ``closing``, none is given back from then on (each closes instead)."""
        with self.lock:
            link.closed = link.closed or closing
            idle, link.idle = link.idle, []
            for conn in idle:
                self.idle.pop(conn, None)
        return idle

    def forked(self) -> None:
        """In a forked child: the parent's idle connections are the parent's (see
        :mod:`dask_ddict._forking`); this process's copies of them close, unused."""
        reinit_lock(self.lock)
        for conn, link in self.idle.items():
            link.idle.clear()
            conn.close()
        self.idle.clear()  # (in place: the key lane keeps this table)


#: This process's pool.
IDLE_POOL = IdlePool()
in_child(IDLE_POOL.forked)
