"""The channels of one dictionary: one per manager, chosen once, following moves.

:class:`Channels` turns a :class:`~dask_ddict.layout.Layout` into one channel per
manager, picked on its first use:

* same host (same ``/dev/shm``): a :class:`~dask_ddict.transport.shared.SharedChannel`,
  reading the shard directly and writing through the host's Unix socket
  (or only the socket, when direct reads are off or not permitted);
* another host: a :class:`~dask_ddict.transport.socket_client.SocketChannel` over
  TCP, with TLS when the cluster uses it.

Channels to managers of one host process share one
:class:`~dask_ddict.transport.socket_client.HostLink`.  A manager that moved (its
old host answers ``MOVED``, or is gone) is followed to where the orchestrator says it
is now (:meth:`Channels.follow`), and one whose host may not serve it now (``LEASE``)
is sent again once the orchestrator has settled it (:meth:`Channels.settle`); the
channels of managers that moved are made again on their next use.

It is the one object a client handle holds (its core subclasses it), so it also
offers the operations on several managers, each in a module of its own:
broadcasts (:meth:`Channels.each`, :mod:`.broadcast`) and many-key reads
(:meth:`Channels.get_many`, :mod:`.many_key_reads`).  Clients use it and so do
host processes, which pull shards from other managers for replication; neither
needs the other.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from .. import config
from .._forking import each, in_child, reinit_lock
from ..errors import (
    DDictClosedError,
    DDictError,
    DDictLeaseError,
    DDictManagerMovedError,
    DDictManagerUnavailableError,
    manager_lost,
)
from ..layout import Layout, ManagerInfo, host_id, wire_term
from . import broadcast, many_key_reads, timing
from .operation import Operation
from .protocol import value_limit
from .socket_client import Explain, HostLink, SocketChannel
from .sockets import tls_context
from .timing import TimedChannel
from .tls_settings import default_security

logger = logging.getLogger(__name__)

#: Seconds between two questions to the orchestrator about a parked manager.
ASK_PARKED = 0.5
#: Seconds between two questions to the orchestrator of an operation that waits for a
#: replicated manager's primary (its host answered ``LEASE``).
SETTLE_POLL = 0.2


def _place(info: ManagerInfo) -> tuple[Any, ...]:
    """Where a manager is served: equal iff the same host process serves the same shard."""
    return (*info.address, info.store_path, info.lost)


def _weakly(method: Callable[..., HostLink]) -> Callable[..., HostLink]:
    """``method`` (:meth:`Channels.follow` or :meth:`Channels.settle`), bound weakly: once
    its channels are gone, a link that calls it gets ``DDictClosedError``."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> HostLink:
        f = ref()
        if f is None:
            raise DDictClosedError("the DDict was detached")
        return f(*args, **kwargs)

    return call


def _weak_explain(method: Explain) -> Explain:
    """:meth:`Channels.explain`, bound weakly: once its channels are gone, a link's own
    error stands."""
    ref = weakref.WeakMethod(method)

    def explain(
        mid: int, e: DDictManagerUnavailableError, place: tuple[str, str, int] | None
    ) -> DDictError:
        f = ref()
        return e if f is None else f(mid, e, place)

    return explain


#: Every dictionary's channels in this process (a forked child frees their locks: a
#: channel made by another thread of its parent holds one while it connects).
_CHANNELS: weakref.WeakSet[Channels] = weakref.WeakSet()


in_child(lambda: each(_CHANNELS, lambda c: c.forked()))  # (a subclass may add to it)


class Channels:
    """The channels of one attached dictionary, created on first use.

    Parameters
    ----------
    layout
        Where the managers are.
    """

    closed: bool
    #: Same-host reads straight from the shard (``ddict.local-read``); an observer
    #: that must never map a shard (the scheduler's dashboard) turns it off.
    direct_reads: bool = True

    def __init__(self, layout: Layout | None) -> None:
        self._layout = layout  # None: resolved on first use (see _resolve)
        self.closed = False
        self._channels: dict[int, Any] = {}
        #: Whether any channel made here is a TCP link's (the key lane's case: it looks
        #: no further where none is, see ``client/lane.py``).
        self.tcp = False
        #: Each manager's term as its requests carry it (shared with every link, updated
        #: in place when a layout is adopted; filled on first use, see :meth:`_link`).
        self._terms: dict[int, int] = {}
        self._pipelined = bool(config.get("transport.pipelined"))  # (see pipe_links)
        self._links: dict[tuple[str, ...], HostLink] = {}
        self._groups: dict[tuple[int, ...], list[tuple[HostLink, list[int]]]] = {}
        self._lock = threading.Lock()
        _CHANNELS.add(self)
        # A handle that is dropped (e.g. at the end of a task) releases its
        # connections and shard views, also without detach().
        self._finalizer = weakref.finalize(self, Channels._release, self._channels, self._links)
        self._host = host_id()
        self._parked_asked = 0.0  # (see _unpark)
        # What each link calls to explain a manager it cannot reach, and to follow one
        # that moved: weakly bound (the links must not keep these channels alive, see
        # _finalizer).
        self._explain = _weak_explain(self.explain)
        self._follow = _weakly(self.follow)
        self._settle = _weakly(self.settle)
        #: Longest pickled key a host accepts (checked here first, with a clear error).
        self.max_key_bytes = config.get_bytes("transport.max-key-bytes")
        #: Most keys whose routes a handle's router keeps (:class:`~..kernels.Router`).
        self.route_cache = int(config.get("transport.route-cache"))

    def __repr__(self) -> str:
        lay = self._layout
        what = f"{lay.name!r} managers={lay.num_managers}" if lay else "(not resolved yet)"
        return f"<{type(self).__name__} {what} closed={self.closed}>"

    @property
    def layout(self) -> Layout:
        """Where the managers are."""
        lay = self._layout
        if lay is None:
            lay = self._layout = self._resolve()
        return lay

    def _resolve(self) -> Layout:
        raise RuntimeError("these channels were made without a layout")

    @property
    def num_managers(self) -> int:
        return self.layout.num_managers

    def security(self) -> Any:
        """The TLS settings for TCP channels (a handle's core prefers its client's)."""
        return default_security()

    def explain(
        self, mid: int, e: DDictManagerUnavailableError, place: tuple[str, str, int] | None = None
    ) -> DDictError:
        """What a failure to reach manager ``mid`` at ``place`` (its host's ``(uds_path,
        tcp_host, tcp_port)``; ``None``: a peer that is no host of the dictionary's) should
        say: ``e`` (what this process saw), unless more is known (a client's core asks the
        orchestrator: the host is gone, and why, or the manager moved from ``place``)."""
        return e

    def current(self, deadline: float | None) -> Layout | None:
        """The orchestrator's layout now, once no move of this dictionary is under way
        (asked by :meth:`follow`); ``None``: no orchestrator to ask (a host process's
        connections, the dashboard's)."""
        return None

    def follow(
        self, mid: int, deadline: float | None, via: tuple[str, str, int] | None = None
    ) -> HostLink:
        """The link to manager ``mid``'s host now that it moved from where this process
        sent it an operation (``via``: that host's address, else where the layout this
        process uses has it).  The new layout is taken whole (other managers may have
        moved too): every channel of a manager that moved is made again on its next use.

        Raises
        ------
        DDictManagerMovedError
            Nobody can say where it went (no orchestrator here, or it has not moved).
        """
        before = self.layout.managers[mid]
        layout = self.current(deadline)
        now = None if layout is None else layout.managers[mid]
        if (
            layout is None
            or now is None
            or (now.address == (via or before.address) and now.term == before.term and not now.lost)
        ):
            raise DDictManagerMovedError(
                f"manager {mid} of {self.layout.name!r} moved from "
                f"{before.hostname} ({before.worker}), and where to "
                "is not known here"
            )
        self.adopt(layout)
        return self._host_link(layout.managers[mid])

    def settle(
        self,
        mid: int,
        deadline: float | None,
        since: float,
        via: tuple[str, str, int] | None = None,
    ) -> HostLink:
        """The link to send an operation on manager ``mid`` to again, after its host at
        ``via`` answered ``LEASE`` (first at ``since``): that host may not serve it now
        (its lease lapsed: it is cut off from the orchestrator, or its primaries fail
        over; or the manager waits for the orchestrator's word).  The orchestrator is
        asked where the manager is once its changes of this dictionary are done: a new
        place is taken at once; else, after :data:`SETTLE_POLL` s, the same host again.
        Waits until ``deadline``, else ``ddict.failover-timeout`` from ``since``.

        Raises
        ------
        DDictLeaseError
            No primary answered in that time.
        DDictManagerUnavailableError
            The manager is lost.
        """
        limit = (
            deadline
            if deadline is not None
            else since + (config.get_seconds("failover-timeout") or 0.0)
        )
        now = time.monotonic()
        before = self.layout.managers[mid]
        if now >= limit:
            raise DDictLeaseError(
                f"manager {mid} of {self.layout.name!r}: no primary answered "
                f"within {now - since:.1f} s: its host "
                f"{before.hostname} ({before.worker}) holds no lease for it "
                "and no replica took over (ddict.failover-timeout)"
            )
        layout = self.current(limit)
        if layout is not None and layout.epoch > self.layout.epoch:
            self.adopt(layout)
        now_at = self.layout.managers[mid]
        if now_at.lost:
            raise manager_lost(self.layout.name, now_at)
        if now_at.address != (via or before.address) or now_at.term != before.term:
            return self._host_link(now_at)
        time.sleep(max(0.0, min(SETTLE_POLL, limit - time.monotonic())))
        return self._host_link(self.layout.managers[mid])

    def adopt(self, layout: Layout) -> None:
        """Use ``layout`` from now on: the channels of managers that moved are dropped."""
        with self._lock:
            old, self._layout = self._layout, layout
            self._terms.update((m.manager_id, wire_term(m.term)) for m in layout.managers)
            gone = (
                []
                if old is None
                else [
                    self._channels.pop(m.manager_id)
                    for m in layout.managers
                    if m.manager_id in self._channels
                    and _place(m) != _place(old.managers[m.manager_id])
                ]
            )
            self._groups.clear()
        for ch in gone:
            ch.close()

    def is_local(self, info: ManagerInfo) -> bool:
        """Whether a manager shares this host (and so its /dev/shm)."""
        return info.host_id == self._host

    def channel(self, mid: int) -> Any:
        """Manager ``mid``'s channel, made on first use.  While timings are on
        (:mod:`.timing`) its ``call`` is timed: a handle's operations on one manager
        all pass here."""
        ch = self._channels.get(mid)
        if ch is not None:
            return TimedChannel(ch) if timing.on else ch
        self._unpark([mid])
        with self._lock:
            if self.closed:
                raise DDictClosedError("the DDict was destroyed or detached")
            ch = self._channels.get(mid)
            if ch is None:
                ch = self._channels[mid] = self._make_channel(self.layout.managers[mid])
        return TimedChannel(ch) if timing.on else ch

    def made(self, mid: int) -> Any:
        """Manager ``mid``'s channel if it was made already, else ``None``: what an event
        loop may use without waiting (making one may ask the orchestrator).  Never timed:
        the timed path reads through :meth:`channel`."""
        return None if self.closed else self._channels.get(mid)

    def _link(self, info: ManagerInfo, use_uds: bool, ssl_context: Any = None) -> HostLink:
        """The link to ``info``'s host process, shared by all managers it serves."""
        key = ("uds", info.uds_path) if use_uds else ("tcp", info.tcp_host, str(info.tcp_port))
        link = self._links.get(key)
        if link is None:
            lay = self.layout
            link = self._links[key] = HostLink(
                info,
                lay.uid,
                lay.secret,
                lay.name,
                use_uds=use_uds,
                ssl_context=ssl_context,
                max_value=value_limit(
                    lay.total_mem // lay.num_managers, config.get_bytes("transport.min-value-limit")
                ),
            )
            if not self._terms:
                self._terms.update((m.manager_id, wire_term(m.term)) for m in lay.managers)
            link.terms = self._terms
            link.explain = self._explain
            link.follow = functools.partial(self._follow, via=info.address)
            link.settle = functools.partial(self._settle, via=info.address)
        return link

    def _unpark(self, mids: list[int]) -> None:
        """Take the orchestrator's layout now if one of ``mids`` is parked here: a worker
        that joined its machine may serve it again (asked at most every
        :data:`ASK_PARKED` seconds; never with the lock held)."""
        now = time.monotonic()
        managers = self.layout.managers
        if now < self._parked_asked or not any(managers[m].parked for m in mids):
            return
        self._parked_asked = now + ASK_PARKED
        layout = self.current(now + (config.get_seconds("host.probe-timeout") or 5.0))
        if layout is not None and layout.epoch > self.layout.epoch:
            self.adopt(layout)

    def _uses_uds(self, info: ManagerInfo) -> bool:
        """Whether ``info``'s host process is reached over its Unix socket (same host)."""
        return (
            bool(config.get("local-transport"))
            and self.is_local(info)
            and os.path.exists(info.uds_path)
        )

    def _host_link(self, info: ManagerInfo) -> HostLink:
        """The link that reaches ``info``'s manager: its host's Unix socket or TCP (TLS)."""
        if info.lost:
            raise manager_lost(self.layout.name, info)
        if self._uses_uds(info):
            return self._link(info, use_uds=True)
        ssl_context = tls_context(self.security(), "client") if self.layout.tls else None
        return self._link(info, use_uds=False, ssl_context=ssl_context)

    def _make_channel(self, info: ManagerInfo) -> Any:
        link = self._host_link(info)
        sock = SocketChannel(link, info)
        if (
            link.kind == "uds"
            and self.direct_reads
            and config.get("local-read")
            and os.path.isdir(info.store_path)
        ):
            from .shared import SharedChannel  # (lmdb: only where a shard is read directly)

            capacity = self.layout.total_mem // self.layout.num_managers
            try:
                return SharedChannel(
                    sock,
                    info.store_path,
                    capacity,
                    self.layout.options,
                    bool(config.get("local-write")),
                )
            except Exception as e:  # e.g. no permission: reads go over the socket
                logger.info("ddict: direct reads of %s unavailable: %r", info.store_path, e)
        self.tcp = self.tcp or link.kind == "tcp"
        return sock

    def routes(self, mids: list[int]) -> list[tuple[HostLink, list[int]]]:
        """``mids`` grouped by the host link that reaches them (cached per manager list:
        a broadcast repeats the same one, and needs no channel, so no shard view)."""
        key = tuple(mids)
        groups = self._groups.get(key)
        if groups is None:
            self._unpark(mids)
            by_link: dict[HostLink, list[int]] = {}
            managers = self.layout.managers
            with self._lock:  # (links are made under it, as channels are)
                if self.closed:
                    raise DDictClosedError("the DDict was destroyed or detached")
                for m in mids:  # a lost manager raises here, before anything is sent
                    ch = self._channels.get(m)
                    link = ch.link if ch is not None else self._host_link(managers[m])
                    by_link.setdefault(link, []).append(m)
                groups = list(by_link.items())
                if len(self._groups) >= 64:
                    self._groups.clear()
                self._groups[key] = groups
        return groups

    def each(
        self, o: Operation, mids: list[int], progress: str = "", tree: bool = False
    ) -> list[Any]:
        """``o``'s result on every manager of ``mids``, in that order: a broadcast, one
        request per host process (:func:`.broadcast.each`)."""
        return broadcast.each(self, o, mids, progress, tree)

    def each_settled(self, o: Operation, mids: list[int]) -> list[Any]:
        """:meth:`each`, with each manager's error in its place instead of raised
        (:func:`.broadcast.each_settled`)."""
        return broadcast.each_settled(self, o, mids)

    def get_many(
        self,
        groups: dict[int, list[bytes]],
        chkpt: int,
        timeout: float | None,
        lend: bool | None = False,
        follows: int = 0,
        since: float = 0.0,
        absent: Any = None,
        began: float | None = None,
    ) -> dict[int, list[Any]]:
        """The frames of many keys, by manager (values where ``absent`` asks a shard on
        this host to decode them): one request per host process
        (:func:`.many_key_reads.get_many`)."""
        return many_key_reads.get_many(
            self, groups, chkpt, timeout, lend, follows, since, absent, began
        )

    def read_here(
        self,
        routes: list[tuple[int, bytes]],
        chkpt: int,
        absent: Any,
        lend: bool | None = False,
        made: bool = False,
    ) -> tuple[list[Any], list[int]] | Any:
        """``(values, marked)`` of ``routes`` when every manager's shard is read here, else
        ``NotImplemented`` (:func:`.many_key_reads.read_here`)."""
        return many_key_reads.read_here(self, routes, chkpt, absent, lend, made)

    async def get_many_async(
        self,
        groups: dict[int, list[bytes]],
        chkpt: int,
        timeout: float | None,
        lend: bool | None = False,
    ) -> dict[int, list[Any]]:
        """:meth:`get_many` from an event loop, pipelined where it can be
        (:func:`.many_key_reads.get_many_async`)."""
        return await many_key_reads.get_many_async(self, groups, chkpt, timeout, lend)

    def pipe_links(self, mids: Iterable[int]) -> dict[int, HostLink]:
        """The link of each of ``mids`` that an event loop's requests may be pipelined to
        (:mod:`.pipelined`): a manager reached by a socket alone, without TLS.  Not one
        whose shard is read here, and not one whose channel was not made yet (making
        it may ask the orchestrator, which an event loop must not wait for).  None with
        ``ddict.transport.pipelined`` false."""
        if self.closed or not self._pipelined:
            return {}
        chans, out = self._channels, {}
        for mid in mids:
            ch = chans.get(mid)
            if type(ch) is SocketChannel and ch.kind != "tls":
                out[mid] = ch.link
        return out

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._groups.clear()
        self._finalizer()

    def forked(self) -> None:
        """In a forked child (see :mod:`dask_ddict._forking`): the lock free again (a
        thread of the parent may have held it, making a channel); the links and views
        are forgotten by their own modules' handlers."""
        reinit_lock(self._lock)

    @staticmethod
    def _release(channels: dict[int, Any], links: dict[tuple[str, ...], HostLink]) -> None:
        chans, hosts = list(channels.values()), list(links.values())
        channels.clear()
        links.clear()
        for ch in chans:
            ch.close()
        for link in hosts:
            link.close()
