"""Choosing and caching the channel to each manager of a dictionary.

:class:`Connections` turns a :class:`~dask_ddict.layout.Layout` into one
channel per manager, picked once per manager:

* same host (same ``/dev/shm``): a :class:`~dask_ddict.transport.shared.SharedChannel`,
  reading the shard directly and writing through the host's Unix socket
  (or only the socket, when direct reads are off or not permitted);
* another host: a :class:`~dask_ddict.transport.links.SocketChannel` over
  TCP, with TLS when the cluster uses it.

Channels to managers of one host process share one
:class:`~dask_ddict.transport.links.HostLink`.  Clients use it (through the
handle's core) and so do host processes, which pull shards from other
managers for replication; neither needs the other.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from .. import config
from ..errors import (
    DDictClosedError,
    DDictError,
    DDictLeaseError,
    DDictManagerMovedError,
    DDictManagerUnavailableError,
    Status,
    error_for_status,
    manager_lost,
    raise_for_status,
    wire_error,
)
from ..layout import Layout, ManagerInfo, host_id, wire_term
from ..progress import track
from . import timing
from .links import Explain, HostLink, SocketChannel
from .many import GetMany
from .operation import Operation
from .ops import FanOut, TreeOut
from .pipelined import Unpipeable, exchange_all, time_left
from .protocol import value_limit
from .timing import TimedChannel

logger = logging.getLogger(__name__)


def _reraise(e: BaseException) -> NoReturn:
    raise e


#: Seconds between two questions to the orchestrator about a parked manager.
ASK_PARKED = 0.5
#: How many moves one operation follows (a manager that moves again while it is followed).
MOST_FOLLOWS = 8
#: Seconds between two questions to the orchestrator of an operation that waits for a
#: replicated manager's primary (its host answered ``LEASE``).
SETTLE_POLL = 0.2
_MOVED = int(Status.MOVED)
_LEASE = int(Status.LEASE)


def _place(info: ManagerInfo) -> tuple[Any, ...]:
    """Where a manager is served: equal iff the same host process serves the same shard."""
    return (*info.address, info.store_path, info.lost)


_DEFAULT_SECURITY: Any = None


def set_default_security(security: Any) -> None:
    """TLS certificates for processes with neither a client nor a worker (host processes)."""
    global _DEFAULT_SECURITY
    _DEFAULT_SECURITY = security


def default_security() -> Any:
    """This process's TLS settings: set by its host process, else its worker's or client's."""
    import distributed

    if _DEFAULT_SECURITY is not None:
        return _DEFAULT_SECURITY
    try:
        return distributed.get_worker().security
    except ValueError:
        pass
    try:
        return distributed.get_client().security
    except ValueError:
        return distributed.Security()


def _answers(
    payload: Any,
    result: Callable[[int, Any], Any],
    results: dict[int, Any],
    errors: dict[int, tuple[int, bytes]],
) -> None:
    """A broadcast's answer, one entry per manager: each result, or its error."""
    for mid, status, ival, data in pickle.loads(payload):
        if status:
            errors[mid] = (status, data)
        else:
            results[mid] = result(ival, data)


class Connections:
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
        #: Each manager's term as its requests carry it (shared with every link, updated
        #: in place when a layout is adopted; filled on first use, see :meth:`_link`).
        self._terms: dict[int, int] = {}
        self._pipelined = bool(config.get("transport.pipelined"))  # (see pipe_links)
        self._links: dict[tuple[str, ...], HostLink] = {}
        self._groups: dict[tuple[int, ...], list[tuple[HostLink, list[int]]]] = {}
        self._lock = threading.Lock()
        # A handle that is dropped (e.g. at the end of a task) releases its
        # connections and shard views, also without detach().
        self._finalizer = weakref.finalize(self, Connections._release, self._channels, self._links)
        self._host = host_id()
        self._parked_asked = 0.0  # (see _unparked)
        # What each link calls to explain a manager it cannot reach: weakly bound (the
        # links must not keep these connections alive, see _finalizer).
        ref = weakref.WeakMethod(self.explain)
        self._explain: Explain = lambda mid, e, place: (
            e if (f := ref()) is None else f(mid, e, place)
        )
        follow = weakref.WeakMethod(self.follow)
        self._follow: Callable[..., HostLink] = lambda mid, d, via=None: (
            _reraise(DDictClosedError("the DDict was detached"))
            if (f := follow()) is None
            else f(mid, d, via)
        )
        settle = weakref.WeakMethod(self.settle)
        self._settle: Callable[..., HostLink] = lambda mid, d, since, via=None: (
            _reraise(DDictClosedError("the DDict was detached"))
            if (f := settle()) is None
            else f(mid, d, since, via)
        )
        #: Longest pickled key a host accepts (checked here first, with a clear error).
        self.max_key_bytes = config.get_bytes("transport.max-key-bytes")

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
        raise RuntimeError("these connections were made without a layout")

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
        ssl_context = None
        if self.layout.tls:
            ssl_context = self.security().get_connection_args("client")["ssl_context"]
            if ssl_context is None:
                raise DDictError(
                    "the cluster requires TLS but this process has no client certificate "
                    "(configure distributed.comm.tls or pass a client with security=)",
                    "INVALID_OPERATION",
                )
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
            from .shared import (
                SharedChannel,  # lmdb: only where a shard is read directly
            )

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
        return sock

    def _routes(self, mids: list[int]) -> list[tuple[HostLink, list[int]]]:
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
        """``o``'s result on every manager of ``mids``, in that order (a broadcast).

        One request per host process (:class:`~.ops.FanOut`: the host runs ``o``
        on each of its managers), sent to every host before any answer is read:
        the hosts work at once, and this thread collects their answers (no
        thread per host, so no hand-off and no contention for the GIL).  A
        broadcast costs about one round trip plus the busiest host's work.  The
        first manager's error (in ``mids`` order) is raised, as a loop over the
        managers would, once every host has answered.  With ``progress``, a bar
        follows the hosts' answers.

        ``tree``: above ``ddict.broadcast.tree-above`` host processes, send one request
        (:class:`~.ops.TreeOut`) to the first host, which forwards it along a tree of
        the hosts of fan-out ``ddict.broadcast.branching-factor`` (see
        :meth:`_tree`); what follows a move is sent again host by host.
        """
        if len(mids) <= 1:
            return [self.channel(m).call(o) for m in mids]
        if timing.on:  # (one operation, however many hosts it goes to)
            return timing.timed(
                f"{timing.name_of(o)} (broadcast)", self._each, o, mids, progress, tree
            )
        return self._each(o, mids, progress, tree)

    def _each(self, o: Operation, mids: list[int], progress: str, tree: bool = False) -> list[Any]:
        """:meth:`each` on several managers."""
        results, failure, errors = self._following(o, mids, progress, tree=tree)
        if failure is not None:
            raise failure
        if errors:
            code, data = errors[next(m for m in mids if m in errors)]
            raise_for_status(code, data.decode(errors="replace"))
        return [results[m] for m in mids]

    def each_settled(self, o: Operation, mids: list[int]) -> list[Any]:
        """:meth:`each`, with each manager's error in its place instead of raised (a
        host that did not answer: its error for each of its managers), for observers
        that show every manager, answering or not (the dashboard, the metrics)."""
        results, failure, errors = self._following(o, mids, "", settle=True)
        out: list[Any] = []
        for m in mids:
            if m in results:
                out.append(results[m])
            elif m in errors:
                out.append(error_for_status(errors[m][0], errors[m][1].decode(errors="replace")))
            else:
                out.append(failure or DDictError(f"manager {m}: no answer", "INTERNAL"))
        return out

    def _following(
        self,
        o: Operation,
        mids: list[int],
        progress: str,
        *,
        settle: bool = False,
        tree: bool = False,
    ) -> tuple[dict[int, Any], BaseException | None, dict[int, tuple[int, bytes]]]:
        """:meth:`_broadcast`, sent again to the managers that moved meanwhile (their
        hosts answered ``MOVED``, or were gone and the orchestrator knows where they
        went), where they are now."""
        sent = self.layout
        results, failure, errors = self._broadcast(o, mids, progress, settle=settle, tree=tree)
        follows, since = 0, 0.0
        while follows < MOST_FOLLOWS:
            # (a host gone whose managers moved, or a host that may not serve them now)
            gone, lapsed = type(failure) is DDictManagerMovedError, type(failure) is DDictLeaseError
            moved = [
                m
                for m in mids
                if m not in results and (errors[m][0] == _MOVED if m in errors else gone)
            ]
            waiting = [
                m
                for m in mids
                if m not in results and (errors[m][0] == _LEASE if m in errors else lapsed)
            ]
            if not moved and not waiting:
                break
            try:
                if moved:
                    follows += 1
                    self.follow(moved[0], None, sent.managers[moved[0]].address)
                else:
                    since = since or time.monotonic()
                    self.settle(waiting[0], None, since, sent.managers[waiting[0]].address)
            except DDictError:
                break
            if gone or lapsed:
                failure = None
            sent = self.layout
            again, fail, errs = self._broadcast(o, moved + waiting, "", settle=settle)
            for m in moved + waiting:
                errors.pop(m, None)
            results.update(again)
            errors.update(errs)
            failure = failure or fail
        return results, failure, errors

    def _broadcast(
        self,
        o: Operation,
        mids: list[int],
        progress: str,
        *,
        settle: bool = False,
        tree: bool = False,
    ) -> tuple[dict[int, Any], BaseException | None, dict[int, tuple[int, bytes]]]:
        """Send ``o`` to every host of ``mids`` and read every answer: the results, a
        failure that cost whole hosts' answers, and managers' errors (``settle``: a
        failed host's managers each get its error)."""
        if self.closed:
            raise DDictClosedError("the DDict was destroyed or detached")
        results: dict[int, Any] = {}
        errors: dict[int, tuple[int, bytes]] = {}
        result = o.result
        failure: BaseException | None = None

        began = time.monotonic()  # (every host's time counts from here)
        if tree:
            routes = self._routes(mids)
            fan = int(config.get("broadcast.branching-factor") or 0)
            if fan >= 1 and len(routes) > max(1, int(config.get("broadcast.tree-above") or 0)):
                return self._tree(o, routes, fan, began, settle)

        def sent(link: HostLink, ms: list[int]) -> Callable[[], tuple[int, Any]]:
            try:
                return link.send(o if len(ms) == 1 else FanOut(o, tuple(ms)), ms[0], began)
            except Exception as e:  # (connecting): raised as the collection would raise it
                return functools.partial(_reraise, e)

        pending = [(ms, sent(link, ms)) for link, ms in self._routes(mids)]
        for ms, answer in (
            track(pending, progress, len(pending), unit="host") if progress else pending
        ):
            try:
                if len(ms) == 1:  # one manager on this host: its own answer
                    results[ms[0]] = result(*answer())
                    continue
                _, payload = answer()
            except DDictError as e:
                if len(ms) > 1 and not settle:
                    failure = failure or e
                    continue
                status, msg = wire_error(e)
                errors.update((m, (int(status), msg)) for m in ms)
                continue
            except BaseException as e:  # the other answers are still read: links stay usable
                failure = failure or e
                continue
            _answers(payload, result, results, errors)
        return results, failure, errors

    def _tree(
        self,
        o: Operation,
        routes: list[tuple[HostLink, list[int]]],
        fan: int,
        began: float,
        settle: bool,
    ) -> tuple[dict[int, Any], BaseException | None, dict[int, tuple[int, bytes]]]:
        """:meth:`_broadcast` along a tree: one request to the first host of ``routes``,
        whose subtrees (of at most ``fan`` children each, see :func:`tree_of`) each host
        forwards before it serves its own managers (:mod:`dask_ddict.host.forward`).  A
        host of the tree that failed answers for every manager below it, with its
        error, which names it; the root's own failure is :meth:`_broadcast`'s."""
        results: dict[int, Any] = {}
        errors: dict[int, tuple[int, bytes]] = {}
        (link, ms), rest = routes[0], routes[1:]
        op = TreeOut(o, tuple(ms), tree_of(rest, fan))
        try:
            _, payload = link.send(op, ms[0], began)()
        except BaseException as e:  # (as a host's failure in _broadcast)
            every = [m for _, g in routes for m in g]
            if isinstance(e, DDictError) and settle:
                status, msg = wire_error(e)
                errors.update((m, (int(status), msg)) for m in every)
                return results, None, errors
            return results, e, errors
        _answers(payload, o.result, results, errors)
        return results, None, errors

    def get_many(
        self,
        groups: dict[int, list[bytes]],
        chkpt: int,
        timeout: float | None,
        lend: bool | None = False,
        follows: int = 0,
        since: float = 0.0,
    ) -> dict[int, list[Any]]:
        """The frames of many keys, by manager (:class:`~.many.GetMany`).

        One request per host process, all sent before any answer is read (the
        hosts work at once); managers on this host are read from their shards
        meanwhile.  A frame is ``None`` for an absent key, ``False`` for one whose
        reader must wait.  The first failure is raised once every host answered.
        """
        if timing.on:  # (one operation, however many hosts it goes to)
            return timing.timed(
                "get_many", self._get_many, groups, chkpt, timeout, lend, follows, since
            )
        return self._get_many(groups, chkpt, timeout, lend, follows, since)

    def _get_many(
        self,
        groups: dict[int, list[bytes]],
        chkpt: int,
        timeout: float | None,
        lend: bool | None,
        follows: int,
        since: float,
    ) -> dict[int, list[Any]]:
        """:meth:`get_many`'s work."""
        out: dict[int, list[Any]] = {}
        sent = self.layout
        local: list[tuple[Any, int, list[bytes]]] = []
        remote: dict[HostLink, list[tuple[int, list[bytes]]]] = {}
        for mid, digests in groups.items():
            ch = self.channel(mid)
            if ch.kind == "shm":
                local.append((ch, mid, digests))
            else:
                remote.setdefault(ch.link, []).append((mid, digests))
        pending = []
        began = time.monotonic()  # (every host's time counts from here)
        for link, gs in remote.items():
            op = GetMany(tuple(gs), chkpt, timeout, lend)
            try:
                answer = link.send(op, gs[0][0], began)
            except Exception as e:  # (connecting): raised with the answers
                answer = functools.partial(_reraise, e)
            pending.append((op, answer))
        failure: BaseException | None = None
        for ch, mid, digests in local:
            try:
                out[mid] = ch.call(GetMany(((mid, digests),), chkpt, timeout, lend))[0]
            except BaseException as e:  # the hosts' answers are still read: links stay usable
                failure = failure or e
        for op, answer in pending:
            try:
                for (mid, _), frames in zip(op.groups, op.result(*answer())):
                    out[mid] = frames
            except BaseException as e:
                failure = failure or e
        if (
            isinstance(failure, DDictError)
            and follows < MOST_FOLLOWS
            and type(failure) in (DDictManagerMovedError, DDictLeaseError)
        ):
            rest = {m: g for m, g in groups.items() if m not in out}
            lapsed = type(failure) is DDictLeaseError
            try:
                first = next(iter(rest))
                if lapsed:  # (a host that may not serve them now: asked again after a wait)
                    since = since or time.monotonic()
                    self.settle(
                        first,
                        None if timeout is None else began + timeout,
                        since,
                        sent.managers[first].address,
                    )
                else:
                    self.follow(first, None, sent.managers[first].address)
            except DDictError:
                raise failure from None
            out.update(self.get_many(rest, chkpt, timeout, lend, follows + (not lapsed), since))
            return out
        if failure is not None:
            raise failure
        return out

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

    async def get_many_async(
        self,
        groups: dict[int, list[bytes]],
        chkpt: int,
        timeout: float | None,
        lend: bool | None = False,
    ) -> dict[int, list[Any]]:
        """:meth:`get_many` from an event loop: one pipelined request per host process
        where :meth:`pipe_links` allows, the rest by :meth:`get_many` in a worker thread
        (meanwhile), and so is whatever the pipes cannot send (a moved manager, a
        broken connection: :class:`~.pipelined.Unpipeable`)."""
        began = time.monotonic()
        links = self.pipe_links(groups)
        out: dict[int, list[Any]] = {}
        rest = {m: g for m, g in groups.items() if m not in links}
        aside = (
            asyncio.ensure_future(asyncio.to_thread(self.get_many, rest, chkpt, timeout, lend))
            if rest
            else None
        )
        failure: BaseException | None = None
        try:
            by_link: dict[HostLink, list[tuple[int, list[bytes]]]] = {}
            for mid, link in links.items():
                by_link.setdefault(link, []).append((mid, groups[mid]))
            ops = [GetMany(tuple(gs), chkpt, timeout, lend) for gs in by_link.values()]
            got = await exchange_all(
                [(link, op, op.groups[0][0]) for link, op in zip(by_link, ops)]
            )
            for op, answer in zip(ops, got):
                if isinstance(answer, Unpipeable):
                    continue
                if isinstance(answer, BaseException):
                    failure = failure or answer
                    continue
                for (mid, _), frames in zip(op.groups, op.result(*answer)):
                    out[mid] = frames
            if aside is not None:
                out.update(await aside)
            left = {m: g for m, g in groups.items() if m not in out and m in links}
            if left and failure is None:  # (sent again, in the operation's time left)
                out.update(
                    await asyncio.to_thread(
                        self.get_many, left, chkpt, time_left(timeout, began), lend
                    )
                )
        except asyncio.CancelledError:
            if aside is not None:
                aside.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - (the first failure is raised)
            failure = failure or e
        if failure is not None:
            raise failure
        return out

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._groups.clear()
        self._finalizer()

    @staticmethod
    def _release(channels: dict[int, Any], links: dict[tuple[str, ...], HostLink]) -> None:
        chans, hosts = list(channels.values()), list(links.values())
        channels.clear()
        links.clear()
        for ch in chans:
            ch.close()
        for link in hosts:
            link.close()


def tree_of(routes: list[tuple[HostLink, list[int]]], fan: int) -> tuple[Any, ...]:
    """The subtrees of a tree broadcast's root over the hosts of ``routes`` (each
    ``(link, managers)``): at most ``fan`` subtrees of near-equal size, each rooted at
    its first host, built the same way below (depth about log_fan of the hosts)."""
    if not routes:
        return ()
    n = min(fan, len(routes))
    size, extra = divmod(len(routes), n)
    out, i = [], 0
    for k in range(n):
        part = routes[i : i + size + (k < extra)]
        i += len(part)
        (link, ms), below = part[0], part[1:]
        info = link.info
        out.append(
            (
                (info.tcp_host, info.tcp_port, info.hostname, info.worker),
                tuple(ms),
                tree_of(below, fan),
            )
        )
    return tuple(out)
