"""Reading many keys at once: ``get_many``, from a thread and from an event loop.

One :class:`~.many_key_ops.GetMany` request per host process, all sent before any
answer is read (the hosts work at once); managers on this host are read from their
shards meanwhile.  From an event loop (:func:`get_many_async`) the requests to hosts
reached by socket are pipelined on the loop's own connections (:mod:`.pipelined`),
and the rest go by :func:`get_many` in a worker thread.  Managers that moved while
the read was under way are read again where the dictionary's channels say they are
now (:class:`~.routing.Routing`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .. import kernels
from ..errors import DDictError, DDictLeaseError, DDictManagerMovedError
from . import timing
from .many_key_ops import GetMany
from .pipelined import Unpipeable, exchange_all, time_left
from .routing import MOST_FOLLOWS, Routing, failed
from .socket_client import HostLink


def get_many(
    routing: Routing,
    groups: dict[int, list[bytes]],
    chkpt: int,
    timeout: float | None,
    lend: bool | None = False,
    follows: int = 0,
    since: float = 0.0,
    absent: Any = None,
    began: float | None = None,
) -> dict[int, list[Any]]:
    """The frames of many keys, by manager (``groups``: each manager's digests).

    A frame is ``None`` for an absent key, ``False`` for one whose reader must wait.
    ``absent``: see :class:`~.many_key_ops.GetMany` (a shard read on this host may then
    answer its values, decoded, as a :class:`~dask_ddict.kernels.Decoded` list; so does
    a host's answer, decoded where it is received).
    The first failure is raised once every host answered.  ``follows`` and ``since``:
    the moves followed so far, and since when the read waits for a primary (see
    :meth:`~.channels.Channels.settle`).  ``began``: when the operation's time began, if
    before (the key lane's, which sent it first: :class:`~dask_ddict.kernels.Resend`).
    """
    if timing.on:  # (one operation, however many hosts it goes to)
        return timing.timed(
            "get_many",
            _get_many,
            routing,
            groups,
            chkpt,
            timeout,
            lend,
            follows,
            since,
            absent,
            began,
        )
    return _get_many(routing, groups, chkpt, timeout, lend, follows, since, absent, began)


def _get_many(
    routing: Routing,
    groups: dict[int, list[bytes]],
    chkpt: int,
    timeout: float | None,
    lend: bool | None,
    follows: int,
    since: float,
    absent: Any,
    began: float | None = None,
) -> dict[int, list[Any]]:
    """:func:`get_many`'s work."""
    out: dict[int, list[Any]] = {}
    sent = routing.layout
    local: list[tuple[Any, int, list[bytes]]] = []
    remote: dict[HostLink, list[tuple[int, list[bytes]]]] = {}
    for mid, digests in groups.items():
        ch = routing.channel(mid)
        if ch.kind == "shm":
            local.append((ch, mid, digests))
        else:
            remote.setdefault(ch.link, []).append((mid, digests))
    pending = []
    began = time.monotonic() if began is None else began  # (every host's from here)
    for link, gs in remote.items():
        op = GetMany(tuple(gs), chkpt, timeout, lend, absent)
        try:
            answer = link.send(op, gs[0][0], began)
        except Exception as e:  # (connecting): raised with the answers
            answer = failed(e)
        pending.append((op, answer))
    failure: BaseException | None = None
    for ch, mid, digests in local:
        try:
            out[mid] = ch.call(GetMany(((mid, digests),), chkpt, timeout, lend, absent))[0]
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
                routing.settle(
                    first,
                    None if timeout is None else began + timeout,
                    since,
                    sent.managers[first].address,
                )
            else:
                routing.follow(first, None, sent.managers[first].address)
        except DDictError:
            raise failure from None
        out.update(
            routing.get_many(
                rest, chkpt, timeout, lend, follows + (not lapsed), since, absent, began
            )
        )
        return out
    if failure is not None:
        raise failure
    return out


def read_here(
    routing: Routing,
    routes: list[tuple[int, bytes]],
    chkpt: int,
    absent: Any,
    lend: bool | None = False,
    made: bool = False,
) -> tuple[list[Any], list[int]] | Any:
    """``(values, marked)`` of keys routed ``routes`` when every manager of them is read
    on this host (``absent`` for an absent key, ``marked``: their indices), else
    ``NotImplemented``: :func:`get_many`'s reads of shards mapped here, each manager's
    values written in the keys' order as they are walked
    (:meth:`~.shared.SharedChannel.place_many`), with no list of a manager's values to
    take apart, no operation and no reply per manager.  A manager reached by socket, or
    one whose shard declines (see ``place_many``; ``lend``: the read's, as
    :class:`~.many_key_ops.GetMany` takes it), leaves every key to :func:`get_many`;
    so does, with ``made`` (an event loop's read, which must not wait), a manager whose
    channel was not made yet."""
    if timing.on:  # (the timed path's: one operation, timed as such)
        return NotImplemented
    groups = kernels.group_positions(routes)
    chans = []
    for mid in groups:  # (every manager first: none is read for a batch left to get_many)
        ch = routing.made(mid) if made else routing.channel(mid)
        if ch is None or ch.kind != "shm":
            return NotImplemented
        chans.append(ch)
    out = [absent] * len(routes)
    for ch, (digests, positions) in zip(chans, groups.values(), strict=True):
        if not ch.place_many(digests, positions, out, chkpt, absent, lend):
            return NotImplemented
    return out, kernels.marked(out, absent)


async def get_many_async(
    routing: Routing,
    groups: dict[int, list[bytes]],
    chkpt: int,
    timeout: float | None,
    lend: bool | None = False,
) -> dict[int, list[Any]]:
    """:func:`get_many` from an event loop: one pipelined request per host process
    where :meth:`~.channels.Channels.pipe_links` allows, the rest by the channels'
    ``get_many`` in a worker thread (meanwhile), and so is whatever the pipes cannot
    send (a moved manager, a broken connection: :class:`~.pipelined.Unpipeable`)."""
    began = time.monotonic()
    links = routing.pipe_links(groups)
    out: dict[int, list[Any]] = {}
    rest = {m: g for m, g in groups.items() if m not in links}
    aside = (
        asyncio.ensure_future(asyncio.to_thread(routing.get_many, rest, chkpt, timeout, lend))
        if rest
        else None
    )
    failure: BaseException | None = None
    try:
        by_link: dict[HostLink, list[tuple[int, list[bytes]]]] = {}
        for mid, link in links.items():
            by_link.setdefault(link, []).append((mid, groups[mid]))
        ops = [GetMany(tuple(gs), chkpt, timeout, lend) for gs in by_link.values()]
        got = await exchange_all([(link, op, op.groups[0][0]) for link, op in zip(by_link, ops)])
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
                    routing.get_many, left, chkpt, time_left(timeout, began), lend
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
