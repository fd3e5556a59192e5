"""The idle connections of a process, over all its links, bounded (:class:`Kept`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Protocol

from .. import config

Conn = Any  # (a link's connection: :class:`~.conn.Conn`)


class HostLink(Protocol):
    """What the pool needs of a link (:class:`~.links.HostLink`)."""

    idle: list[Any]
    closed: bool

    def forget(self, conn: Any) -> None: ...


class Kept:
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
        self.lock = threading.Lock()
        self.idle: OrderedDict[Conn, HostLink] = OrderedDict()
        # ddict.transport.kept-connections (each link sets it again when it connects)
        self.most = int(config.get("transport.kept-connections"))

    def take(self, link: HostLink) -> Conn | None:
        with self.lock:
            if link.idle:
                conn = link.idle.pop()
                del self.idle[conn]
                return conn
        return None

    def give(self, link: HostLink, conn: Conn) -> None:
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
                    old, owner = self.idle.popitem(last=False)
                    owner.idle.remove(old)
                    over.append((old, owner))
        for old, owner in over:
            owner.forget(old)

    def remove(self, link: HostLink, *, closing: bool) -> list[Conn]:
        """``link``'s idle connections, out of the pool (the link closes them); with
        ``closing``, none is given back from then on (each closes instead)."""
        with self.lock:
            link.closed = link.closed or closing
            idle, link.idle = link.idle, []
            for conn in idle:
                self.idle.pop(conn, None)
        return idle


#: This process's pool.
KEPT = Kept()
