"""Operations issued together on an event loop travel together (:class:`~dask_ddict.AsyncDDict`).

``asyncio.gather(*(ad.get(k) for k in keys))`` must not cost a thousand
threads or a thousand sequential round trips.  Each ``await ad.get(...)``
joins the batch of its event-loop turn; at the end of the turn the batch is
read as one :meth:`~dask_ddict.DDict.get_many`: one request per host process,
written at once on the loop's own connections and answered while other
batches are in flight (:mod:`~dask_ddict.transport.pipelined`), and same-host
shards read directly: on the loop itself where every shard of the batch is mapped
here (microseconds), else in one worker thread.  A single get is a batch of one.

A key whose reader must wait (``wait_for_keys``, not yet written at the
reader's checkpoint) leaves the batch and waits in a thread of its own, so
it never holds up the others (whose writers may depend on them).  An error
that concerns one key (an unpicklable key, say) fails only that key's get;
any other (a host that does not answer in time) fails the batch's gets once.

Puts go the same way (:class:`PutBatcher`): the puts of one loop turn are
sent with one request per host process (:meth:`DDict._put_many`), and each
put gets its own acknowledgement or error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import DDictKeyError
from .reads import ABSENT, WAIT

if TYPE_CHECKING:
    from .handle import DDict

_Pending = list[tuple[Any, Any, "asyncio.Future[Any]"]]  # (key, default or value, future)


class _Batcher:
    """Operations of one asynchronous handle waiting for the end of their loop turn,
    by loop and by ``mode`` (operations of different modes travel apart)."""

    def __init__(self, d: DDict) -> None:
        self._d = d
        self._pending: dict[tuple[Any, Any], _Pending] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # (referenced while they run)

    def __repr__(self) -> str:
        pending = sum(len(p) for p in self._pending.values())
        return f"<{type(self).__name__} pending={pending}>"

    def _join(self, mode: Any, key: Any, arg: Any) -> asyncio.Future[Any]:
        """This turn's batch of ``mode`` takes ``(key, arg)``; its future is the answer.

        The batch's task starts on the loop's next turn, once every coroutine of this one
        has joined; it sends the batch and settles each future itself (no other hop).
        """
        loop = asyncio.get_running_loop()
        batch = self._pending.get((loop, mode))
        if batch is None:
            batch = self._pending[(loop, mode)] = []
            task = loop.create_task(self._turn(loop, mode))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        fut: asyncio.Future[Any] = loop.create_future()
        batch.append((key, arg, fut))
        return fut

    async def _turn(self, loop: asyncio.AbstractEventLoop, mode: Any) -> None:
        batch = self._pending.pop((loop, mode))
        try:
            answers = await self._send(batch, mode)
        except BaseException as e:  # the batch's failure is every operation's
            error = asyncio.CancelledError() if isinstance(e, asyncio.CancelledError) else e
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_exception(error)
            if not isinstance(e, Exception):
                raise
            return
        self._settle(loop, batch, mode, answers)

    async def _send(self, batch: _Pending, mode: Any) -> list[Any]:
        """One answer per operation of ``batch``."""
        raise NotImplementedError

    def _settle(
        self, loop: asyncio.AbstractEventLoop, batch: _Pending, mode: Any, answers: list[Any]
    ) -> None:
        raise NotImplementedError


class GetBatcher(_Batcher):
    """The gets of one asynchronous handle (mode: ``copy``).

    ``decode`` turns each frame into what a get gives (default: the value, see
    :meth:`DDict._many`; a read that must wait for its writer gives the value itself);
    :class:`~dask_ddict.DDictStore` reads raw bytes as views.
    """

    def __init__(self, d: DDict, decode: Callable[[Any], Any] | None = None) -> None:
        super().__init__(d)
        self._decode = decode

    async def get(self, key: Any, default: Any, copy: bool | None) -> Any:
        return await self._join(copy, key, default)

    async def _send(self, batch: _Pending, copy: bool | None) -> list[tuple[bool, Any]]:
        """``(ok, value or error)`` per get, with one ``get_many`` (pipelined to other
        hosts, see :meth:`DDict._many_async`).

        A key that cannot be routed (unpicklable, too long) fails its own get only;
        any other failure (a host that does not answer in time, a retired
        checkpoint, a closed dictionary) is the answer of every get of the batch,
        once: never a retry per key, each with its own timeout.
        """
        d = self._d
        out: list[tuple[bool, Any]] = []
        keys, routes = [], []
        for key, _, _ in batch:
            try:
                mid, digest, _ = d._route(key)
            except Exception as e:  # noqa: BLE001 - that key's own error
                out.append((False, e))
                continue
            out.append((True, None))
            keys.append(key)
            routes.append((mid, digest))
        values = iter(await d._many_async(keys, routes, copy, self._decode) if keys else ())
        return [(True, next(values)[1]) if ok else (ok, e) for ok, e in out]

    def _settle(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: _Pending,
        copy: bool | None,
        answers: list[tuple[bool, Any]],
    ) -> None:
        for (key, default, fut), (ok, got) in zip(batch, answers):
            if fut.done():
                continue  # (cancelled by its awaiter)
            if not ok:
                fut.set_exception(got)
            elif got is WAIT:  # waits alone: the others are not held up by its writer
                self._wait(loop, key, default, copy, fut)
            else:
                fut.set_result(default if got is ABSENT else got)

    def _wait(
        self,
        loop: asyncio.AbstractEventLoop,
        key: Any,
        default: Any,
        copy: bool | None,
        fut: asyncio.Future[Any],
    ) -> None:
        def read() -> Any:
            try:
                return self._d._get(key, None if copy is None else not copy)
            except DDictKeyError:
                return default

        task = loop.create_task(asyncio.to_thread(read))

        def done(t: asyncio.Task[Any]) -> None:
            if fut.done():
                return
            if t.cancelled():
                fut.cancel()
            elif t.exception() is not None:
                fut.set_exception(t.exception())  # type: ignore[arg-type]
            else:
                fut.set_result(t.result())

        task.add_done_callback(done)


class PutBatcher(_Batcher):
    """The puts of one asynchronous handle (mode: ``persistent``).

    ``direct_max``: the largest value a same-host shard takes from this process
    directly (see :meth:`DDict._put_many`; :class:`~dask_ddict.DDictStore` raises it
    for the chunks tasks write beside their shard).
    """

    def __init__(self, d: DDict, direct_max: int | None = None) -> None:
        super().__init__(d)
        self._direct_max = direct_max

    async def put(self, key: Any, value: Any, persistent: bool) -> None:
        await self._join(persistent, key, value)

    async def _send(self, batch: _Pending, persistent: bool) -> list[BaseException | None]:
        return await self._d._put_many_async(
            [(k, v) for k, v, _ in batch], persistent, self._direct_max
        )

    def _settle(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: _Pending,
        persistent: bool,
        answers: list[BaseException | None],
    ) -> None:
        for (_, _, fut), error in zip(batch, answers):
            if fut.done():
                continue
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)
