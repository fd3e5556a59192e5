"""Batch puts and broadcasts: many pairs in one stream, one pair on every manager,
and freezing every manager (a base of :class:`~dask_ddict.DDict`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from .._hashing import key_digest
from .._keys import dumps_key
from .._serialize import Framed, loads_value
from ..arguments import check_bool
from ..errors import (
    DDictError,
    DDictFullError,
    DDictKeyError,
    DDictLeaseError,
    Status,
    raise_for_status,
)
from ..transport.many_key_ops import PutMany
from ..transport.ops import Freeze, Get, Put, Unfreeze
from ..transport.pipelined import Unpipeable, exchange_all, time_left
from ..transport.routing import failed
from .base import HandleBase
from .batch import BatchPut
from .core import HandleCore


class Bulk(HandleBase):
    """Batch puts, ``bput``/``bget`` and ``freeze`` of a handle."""

    def start_batch_put(self, persist: bool = False) -> None:
        """Stream the following puts without per-put replies (until :meth:`end_batch_put`)."""
        self._check()
        self._no_batch("start_batch_put()")
        self._batch = BatchPut(
            check_bool("persist", persist), self._core.channel, self._client_id, self._core.full
        )

    def end_batch_put(self) -> None:
        """Send what is buffered and raise the first error any manager saw."""
        self._check()
        b = self._batch
        if b is None:
            raise DDictError("end_batch_put() without start_batch_put()", "INVALID_OPERATION")
        self._batch = None
        b.end()

    def bput(self, key: Any, value: Any) -> None:
        """Store a copy of the pair on every manager (read it with :meth:`bget`).

        One request per host process, or, above ``ddict.broadcast.tree-above`` hosts,
        one request that the hosts forward along a tree of fan-out
        ``ddict.broadcast.branching-factor`` (see ``docs/design/transport.md``, "bput
        along a tree")."""
        if self._batch is not None and self._batch.persist:
            raise DDictError("bput inside a persistent batch", "INVALID_OPERATION")
        self._check()
        kb = dumps_key(key, self._kp)
        digest = key_digest(kb)
        every = list(range(self._core.layout.num_managers))
        if self._batch is not None:
            with self._batch:
                framed = self._framed(None, kb, value)
                for mid in every:
                    self._batch.add(mid, digest, kb, framed, self._chkpt)
        else:  # one request per host process, all hosts at once
            self._core.each(
                Put(
                    digest,
                    kb,
                    self._framed(None, kb, value),
                    self._chkpt,
                    self._client_id,
                    False,
                    self._timeout,
                ),
                every,
                tree=True,
            )  # (along a tree of hosts past ddict.broadcast.tree-above)

    def bget(self, key: Any) -> Any:
        """Read a broadcast value from this handle's main manager."""
        self._check()
        kb = dumps_key(key, self._kp)
        mid = self._target if self._target is not None else self.main_manager
        try:
            frame = self._core.channel(mid).call(Get(key_digest(kb), self._chkpt, self._timeout))
        except DDictKeyError:
            raise DDictKeyError(key) from None
        return loads_value(frame, self._vp)

    def _put_many(
        self, pairs: list[tuple[Any, Any]], persistent: bool = False, direct_max: int | None = None
    ) -> list[BaseException | None]:
        """Put every pair with one request per host process (same-host shards: committed
        here, one transaction each); each pair's error, or ``None``.  What
        :class:`~dask_ddict.AsyncDDict` sends (:meth:`_put_many_async`) for the puts of
        one event-loop turn.  ``direct_max``: the largest value committed here (default:
        the same-host channel's, see
        :meth:`~dask_ddict.transport.shared.SharedChannel.put_batch`).

        A manager puts its pairs in order until one fails; that pair gets the error,
        and the pairs after it are put one by one (each then says its own error).
        """
        if self._batch is not None:  # (inside a batch: each put joins it)
            return [_error_of(self._put, k, v, persistent) for k, v in pairs]
        core, chkpt = self._core, self._chkpt
        out, groups = self._put_groups(pairs)
        alone: list[int] = []  # pairs put one by one
        remote: dict[Any, list[_Group]] = {}
        for mid, recs in groups.items():
            ch = core.channel(mid)
            done = 0
            if ch.kind == "shm" and not persistent:
                try:
                    done, error = ch.put_batch([r[1:] for r in recs], chkpt, direct_max)
                except Exception as e:  # noqa: BLE001 - nothing of this group was committed
                    done, error = 0, e
                    alone += [r[0] for r in recs[1:]]
                if error is not None:
                    out[recs[done][0]] = _named(core, error, mid)
                    alone += [r[0] for r in recs[done + 1 :]]
                    continue
            if done < len(recs):
                remote.setdefault(ch.link, []).append((mid, recs[done:]))
        pending = []
        began = time.monotonic()  # (every host's time counts from here)
        for link, chunk, op in self._put_requests(remote, persistent):
            try:
                answer = link.send(op, chunk[0][0], began)
            except Exception as e:  # noqa: BLE001 - (connecting, too large) its pairs'
                answer = failed(e)
            pending.append((chunk, op, answer))
        for chunk, op, answer in pending:
            try:
                got: tuple[int, Any] | BaseException = answer()
            except Exception as e:  # noqa: BLE001 - the request failed: all its pairs
                got = e
            alone += self._put_answered(out, chunk, op, got)
        for i in sorted(alone):
            out[i] = _error_of(self._put, *pairs[i], persistent)
        return out

    async def _put_many_async(
        self, pairs: list[tuple[Any, Any]], persistent: bool = False, direct_max: int | None = None
    ) -> list[BaseException | None]:
        """:meth:`_put_many` from an event loop: one pipelined request per host process
        where the managers' links allow (see :meth:`~dask_ddict.transport.channels.
        Channels.pipe_links`); the rest, and what the pipes cannot send, by
        :meth:`_put_many` in a worker thread (a put again has the same effect)."""
        if self._batch is not None:
            return await asyncio.to_thread(self._put_many, pairs, persistent, direct_max)
        began = time.monotonic()
        out, groups = self._put_groups(pairs)
        links = self._core.pipe_links(groups)

        def put_many(h: Bulk, indices: list[int]) -> None:  # (in a worker thread)
            for i, e in zip(
                indices, h._put_many([pairs[i] for i in indices], persistent, direct_max)
            ):
                out[i] = e

        # The others' (same-host shards, TLS, ...) in a worker thread meanwhile.
        aside = [r[0] for mid, recs in groups.items() if mid not in links for r in recs]
        side = asyncio.ensure_future(asyncio.to_thread(put_many, self, aside)) if aside else None
        try:
            remote: dict[Any, list[_Group]] = {}
            for mid, link in links.items():
                remote.setdefault(link, []).append((mid, groups[mid]))
            requests = self._put_requests(remote, persistent)
            got = await exchange_all([(link, op, chunk[0][0]) for link, chunk, op in requests])
            again: list[int] = []  # what the pipes could not send
            alone: list[int] = []  # after the first put a manager refused: one by one
            for (_, chunk, op), answer in zip(requests, got):
                if isinstance(answer, Unpipeable):
                    again += [r[0] for _, recs in chunk for r in recs]
                else:
                    alone += self._put_answered(out, chunk, op, answer)
            if side is not None:
                await side
        except asyncio.CancelledError:
            if side is not None:
                side.cancel()
            raise
        if again or alone:
            late = self  # (or the same handle, in the operation's time left)
            if self._timeout is not None:
                late = self._derive()
                late._timeout = time_left(self._timeout, began)

            def rest() -> None:
                put_many(late, sorted(again))
                for i in sorted(alone):
                    out[i] = _error_of(late._put, *pairs[i], persistent)

            await asyncio.to_thread(rest)
        return out

    def _put_groups(
        self, pairs: list[tuple[Any, Any]]
    ) -> tuple[list[BaseException | None], dict[int, list[_Record]]]:
        """Each pair's error so far (one that cannot be routed or pickled), and the
        others' records ``(index, digest, key, frame)`` by manager."""
        out: list[BaseException | None] = [None] * len(pairs)
        groups: dict[int, list[_Record]] = {}
        for i, (k, v) in enumerate(pairs):
            try:
                mid, digest, kb = self._route(k)
                groups.setdefault(mid, []).append((i, digest, kb, self._framed(mid, kb, v)))
            except Exception as e:  # noqa: BLE001 - this pair's
                out[i] = e
        return out, groups

    def _put_requests(
        self, remote: dict[Any, list[_Group]], persistent: bool
    ) -> list[tuple[Any, list[_Group], PutMany]]:
        """``(link, chunk, request)`` for the records of ``remote`` (by link): requests
        that stay within a host's limit (:data:`PUT_MANY_BYTES`)."""
        return [
            (
                link,
                chunk,
                PutMany(
                    [(mid, *r[1:]) for mid, recs in chunk for r in recs],
                    self._chkpt,
                    self._client_id,
                    persistent,
                    self._timeout,
                ),
            )
            for link, gs in remote.items()
            for chunk in _chunks(gs, PUT_MANY_BYTES)
        ]

    def _put_answered(
        self,
        out: list[BaseException | None],
        chunk: list[_Group],
        op: PutMany,
        answer: tuple[int, Any] | BaseException,
    ) -> list[int]:
        """Record the ``answer`` to ``op`` (or its failure) for the pairs of ``chunk`` in
        ``out``; the pairs to put one by one (after the first one a manager refused)."""
        core = self._core
        alone: list[int] = []
        if isinstance(answer, DDictLeaseError):  # (the host may not serve them now: each put
            return [r[0] for _, recs in chunk for r in recs]  # waits for its primary)
        if isinstance(answer, BaseException):  # the request failed: all its pairs
            for mid, recs in chunk:
                for r in recs:
                    out[r[0]] = _named(core, answer, mid)
            return alone
        recs_of = dict(chunk)
        for mid, done, status, msg in op.result(*answer):
            recs = recs_of[mid]
            if status == _MOVED or status == _LEASE:  # (the manager left that host, or it
                alone += [r[0] for r in recs[done:]]  # may not serve it now: each put follows)
            elif status:
                out[recs[done][0]] = _named(core, _error(status, msg), mid)
                alone += [r[0] for r in recs[done + 1 :]]
        return alone

    def freeze(self) -> None:
        """Make every manager read-only: writes raise ``DDictError`` (INVALID_OPERATION)."""
        self._core.each(Freeze(), self._managers())

    def unfreeze(self) -> None:
        self._core.each(Unfreeze(), self._managers())

    @property
    def is_frozen(self) -> bool:
        """Whether every manager is frozen (asks each one, as :attr:`stats` does).

        A property, as in Dragon and the spec; :class:`~dask_ddict.AsyncDDict`
        spells it ``await ad.is_frozen()``, like its other properties that ask
        the managers (``stats()``, ``dstats()``, ``moves()``).
        """
        return all(s.frozen for s in self.stats)


def _error(status: int, msg: bytes) -> BaseException:
    """The exception a manager's ``(status, message)`` stands for."""
    try:
        raise_for_status(status, msg.decode(errors="replace"))
    except BaseException as e:  # noqa: BLE001 - (built by the one wire -> exception mapping)
        return e


def _named(core: HandleCore, e: BaseException, mid: int) -> BaseException:
    """A full shard's error naming its dictionary and manager (as a single put's does)."""
    return core.full(e, mid) if isinstance(e, DDictFullError) else e


def _error_of(put: Callable[..., None], *args: Any) -> BaseException | None:
    try:
        put(*args)
    except Exception as e:  # noqa: BLE001 - this pair's
        return e
    return None


_MOVED = int(Status.MOVED)
_LEASE = int(Status.LEASE)

#: Most bytes of values in one many-put request (a host takes at most its shard's size).
PUT_MANY_BYTES = 16 << 20

_Record = tuple[int, bytes, bytes, Framed]  # (index of the pair, digest, key, frame)
_Group = tuple[int, list[_Record]]


def _chunks(groups: list[_Group], most: int) -> list[list[_Group]]:
    """``groups`` (manager, records) cut into requests of at most ``most`` bytes of values,
    in order; a record bigger than that travels alone."""
    out: list[list[_Group]] = [[]]
    size = 0
    for mid, recs in groups:
        for r in recs:
            n = r[3].nbytes + len(r[2])
            if size and size + n > most:
                out.append([])
                size = 0
            chunk = out[-1]
            if chunk and chunk[-1][0] == mid:
                chunk[-1][1].append(r)
            else:
                chunk.append((mid, [r]))
            size += n
    return [c for c in out if c]
