"""Broadcasts: one operation on many managers, one request per host process.

``len(d)``, ``d.stats``, ``clear``, ``persist`` and the other calls on every manager
send one :class:`~.ops.FanOut` to each host process (the host runs the operation on
each of its managers and answers for all of them), to every host before any answer is
read: the hosts work at once, and the calling thread collects their answers (no
thread per host, so no hand-off and no contention for the GIL).  A broadcast costs
about one round trip plus the busiest host's work, not a round trip per manager.

Above ``ddict.broadcast.tree-above`` host processes, a broadcast that asks for it
(``bput``) sends one :class:`~.ops.TreeOut` to the first host instead, which forwards
it along a tree of the hosts (:func:`tree_of`, served by
:mod:`dask_ddict.host.forward`).

Managers that moved while the broadcast was under way (their hosts answered
``MOVED``, or were gone and the orchestrator knows where they went) and managers
whose host may not serve them now (``LEASE``) are sent the operation again, host by
host, where the dictionary's channels say they are now (:class:`~.routing.Routing`).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any

from .. import config
from ..errors import (
    DDictClosedError,
    DDictError,
    DDictLeaseError,
    DDictManagerMovedError,
    Status,
    error_for_status,
    raise_for_status,
    wire_error,
)
from ..progress import track
from . import timing
from .operation import Operation
from .ops import FanOut, TreeOut
from .routing import MOST_FOLLOWS, Routing, failed
from .socket_client import HostLink

_MOVED = int(Status.MOVED)
_LEASE = int(Status.LEASE)

#: What a broadcast gathered: each manager's result, a failure that cost whole hosts'
#: answers, and each manager's error (status and message) in place of its result.
Gathered = tuple[dict[int, Any], BaseException | None, dict[int, tuple[int, bytes]]]


def each(
    routing: Routing, o: Operation, mids: list[int], progress: str = "", tree: bool = False
) -> list[Any]:
    """``o``'s result on every manager of ``mids``, in that order.

    The first manager's error (in ``mids`` order) is raised, as a loop over the
    managers would, once every host has answered.  With ``progress``, a bar follows
    the hosts' answers.  ``tree``: along a tree of the hosts above
    ``ddict.broadcast.tree-above`` of them, of fan-out ``ddict.broadcast.branching-factor``
    (see the module's doc); what follows a move is sent again host by host.
    """
    if len(mids) <= 1:
        return [routing.channel(m).call(o) for m in mids]
    if timing.on:  # (one operation, however many hosts it goes to)
        return timing.timed(
            f"{timing.name_of(o)} (broadcast)", _each, routing, o, mids, progress, tree
        )
    return _each(routing, o, mids, progress, tree)


def _each(
    routing: Routing, o: Operation, mids: list[int], progress: str, tree: bool = False
) -> list[Any]:
    """:func:`each` on several managers."""
    results, failure, errors = _following(routing, o, mids, progress, tree=tree)
    if failure is not None:
        raise failure
    if errors:
        code, data = errors[next(m for m in mids if m in errors)]
        raise_for_status(code, data.decode(errors="replace"))
    return [results[m] for m in mids]


def each_settled(routing: Routing, o: Operation, mids: list[int]) -> list[Any]:
    """:func:`each`, with each manager's error in its place instead of raised (a host
    that did not answer: its error for each of its managers), for observers that show
    every manager, answering or not (the dashboard, the metrics)."""
    results, failure, errors = _following(routing, o, mids, "", settle=True)
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
    routing: Routing,
    o: Operation,
    mids: list[int],
    progress: str,
    *,
    settle: bool = False,
    tree: bool = False,
) -> Gathered:
    """:func:`_broadcast`, sent again to the managers that moved meanwhile (their hosts
    answered ``MOVED``, or were gone and the orchestrator knows where they went), where
    they are now."""
    sent = routing.layout
    results, failure, errors = _broadcast(routing, o, mids, progress, settle=settle, tree=tree)
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
                routing.follow(moved[0], None, sent.managers[moved[0]].address)
            else:
                since = since or time.monotonic()
                routing.settle(waiting[0], None, since, sent.managers[waiting[0]].address)
        except DDictError:
            break
        if gone or lapsed:
            failure = None
        sent = routing.layout
        again, fail, errs = _broadcast(routing, o, moved + waiting, "", settle=settle)
        for m in moved + waiting:
            errors.pop(m, None)
        results.update(again)
        errors.update(errs)
        failure = failure or fail
    return results, failure, errors


def _broadcast(
    routing: Routing,
    o: Operation,
    mids: list[int],
    progress: str,
    *,
    settle: bool = False,
    tree: bool = False,
) -> Gathered:
    """Send ``o`` to every host of ``mids`` and read every answer: the results, a
    failure that cost whole hosts' answers, and managers' errors (``settle``: a
    failed host's managers each get its error)."""
    if routing.closed:
        raise DDictClosedError("the DDict was destroyed or detached")
    results: dict[int, Any] = {}
    errors: dict[int, tuple[int, bytes]] = {}
    result = o.result
    failure: BaseException | None = None

    began = time.monotonic()  # (every host's time counts from here)
    if tree:
        routes = routing.routes(mids)
        fan = int(config.get("broadcast.branching-factor") or 0)
        if fan >= 1 and len(routes) > max(1, int(config.get("broadcast.tree-above") or 0)):
            return _tree(o, routes, fan, began, settle)

    def sent(link: HostLink, ms: list[int]) -> Callable[[], tuple[int, Any]]:
        try:
            return link.send(o if len(ms) == 1 else FanOut(o, tuple(ms)), ms[0], began)
        except Exception as e:  # (connecting): raised as the collection would raise it
            return failed(e)

    pending = [(ms, sent(link, ms)) for link, ms in routing.routes(mids)]
    for ms, answer in track(pending, progress, len(pending), unit="host") if progress else pending:
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
    o: Operation,
    routes: list[tuple[HostLink, list[int]]],
    fan: int,
    began: float,
    settle: bool,
) -> Gathered:
    """:func:`_broadcast` along a tree: one request to the first host of ``routes``,
    whose subtrees (of at most ``fan`` children each, see :func:`tree_of`) each host
    forwards before it serves its own managers (:mod:`dask_ddict.host.forward`).  A
    host of the tree that failed answers for every manager below it, with its
    error, which names it; the root's own failure is :func:`_broadcast`'s."""
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
