"""The caller's side of a filter: the tree's root, submitting the tasks and merging.

:class:`Filter` (``with d.filter(...) as results``) listens, plans the tree
(:mod:`.plan`), submits the merge tasks and then the leaves (:mod:`.tasks`), and
merges its own children as the user iterates; :class:`AsyncFilter` is the same
from an asynchronous client, taking the results in a worker thread a batch at a
time.  The scheduler only places the tasks and never sees a result.

The handle a filter runs over (a :class:`~dask_ddict.DDict`) is not imported:
the client sits above this package and builds the filter.
"""

from __future__ import annotations

import logging
import pickle
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import distributed
from distributed.client import _wait
from distributed.comm import get_address_host
from distributed.utils import get_ip

from .. import config
from ..errors import DDictError, DDictTaskError
from ..threaded import in_thread
from ..transport.sockets import tls_context
from .plan import Plan, by_placement, map_placed, tree
from .receiving import IDLE, Receiver
from .streams import ROOT, TASK, TOKEN_BYTES, Failed, Failure, Stopped, StreamLimits
from .tasks import run_leaf, run_merge

logger = logging.getLogger(__name__)


def caller_host(client: distributed.Client) -> str:
    """The address of this process that the cluster's workers reach (the scheduler's route)."""
    try:
        return str(get_ip(get_address_host(client.scheduler.address)))
    except Exception:  # noqa: BLE001 - e.g. an inproc:// cluster: all in this process
        return "127.0.0.1"


class Filter:
    """``with d.filter(mgr_code, ...) as results: for x in results: ...``.

    Entering submits the tasks and returns the iterator of merged results;
    leaving (early or not, or with an error) closes every stream, waits for
    the tasks to end (each sees ``EOFError`` at its next put) and cancels what
    is left, so nothing keeps running.
    """

    def __init__(
        self,
        d: Any,  # the handle (a DDict)
        mgr_code: Callable[..., Any],
        mgr_code_args: Any,
        comparator: Callable[[Any, Any], bool] | None,
        branching_factor: int,
        placement: list[list[str] | None] | None,
    ) -> None:
        if not callable(mgr_code):
            raise TypeError(f"mgr_code must be callable, got {type(mgr_code).__name__}")
        if comparator is not None and not callable(comparator):
            raise TypeError(f"comparator must be callable or None, got {type(comparator).__name__}")
        if isinstance(branching_factor, bool) or not isinstance(branching_factor, int):
            raise TypeError(f"branching_factor must be an int, got {branching_factor!r}")
        if branching_factor < 2:
            raise ValueError(f"branching_factor must be >= 2, got {branching_factor}")
        self._d = d
        self._code = mgr_code
        self._args = tuple(mgr_code_args)
        self._cmp = comparator
        self._fan_in = branching_factor
        self._placement = placement
        self._receiver: Receiver | None = None
        self._futures: dict[int, distributed.Future] = {}
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._receiver is not None else "ready"
        return (
            f"<Filter {getattr(self._code, '__name__', self._code)!r} on "
            f"{len(self._d._managers())} managers fan-in={self._fan_in} {state}>"
        )

    def __enter__(self) -> Iterator[Any]:
        self._start()
        return self._results()

    def _start(self) -> None:
        """Listen, plan the tree and submit its tasks (no blocking call to the client:
        an asynchronous client's filter starts the same way)."""
        if self._receiver is not None:
            raise DDictError("a filter runs once: call d.filter(...) again", "INVALID_OPERATION")
        d = self._d
        if self._placement is None:
            self._placement = d._placement()
        client = d._core.client
        mids = d._managers()
        limits = StreamLimits.from_config()
        token = secrets.token_bytes(TOKEN_BYTES)
        targets = [(p or [""])[0] for p in self._placement]
        parents, merge_workers = tree([targets[i] for i in range(len(mids))], self._fan_in)
        tls = d._core.layout.tls  # (a TLS cluster: its certificates protect the streams too)
        self._receiver = receiver = Receiver(
            caller_host(client),
            token,
            [i for i, p in enumerate(parents) if p == ROOT],
            len(mids),
            limits,
            tuple(parents),
            ssl_context=tls_context(d._core.security(), "client", listen=True) if tls else None,
        )
        plan = Plan(token, receiver.address, tuple(parents), len(mids), limits, tls)
        tag = token[:4].hex()
        try:  # (merge tasks first and before the leaves: they leave the pool as they start)
            merges = {
                w: [len(mids) + j for j in nodes]
                for w, nodes in by_placement([[w] if w else None for w in merge_workers]).items()
            }
            self._futures.update(
                map_placed(
                    client,
                    run_merge,
                    merges,
                    lambda n: (plan, n, self._cmp),
                    lambda n: f"ddict-filter-{tag}-merge-{n}",
                    priority=1,
                )
            )
            self._futures.update(
                map_placed(
                    client,
                    run_leaf,
                    by_placement(self._placement),
                    lambda n: (d.manager(mids[n]), self._code, self._args, plan, n),
                    lambda n: f"ddict-filter-{tag}-manager-{mids[n]}",
                )
            )
            for node, fut in self._futures.items():
                fut.add_done_callback(lambda f, node=node: receiver.event(node, TASK, f))
        except BaseException:
            self._stop()
            raise
        self._mids = mids

    def _results(self, idle: bool = False) -> Iterator[Any]:
        """The merged results; with ``idle``, also :data:`IDLE` whenever no result is
        ready (the async iterator hands on its batch then)."""
        assert self._receiver is not None
        try:
            for item, blob in self._receiver.merged(self._cmp, lambda: self._closed, self._ended):
                if blob is not None:
                    yield pickle.loads(blob) if item is None else item
                elif idle:
                    yield IDLE
        except Failed as f:
            failure = f.failure
            if failure.manager_id is not None:  # a leaf's node number: its manager's id
                failure = Failure(
                    failure.node, self._mids[failure.manager_id], failure.text, failure.error
                )
            err = failure.exception()
            raise err from err.__cause__
        except Stopped:
            return

    def _ended(self, node: int, fut: distributed.Future) -> None:
        """A task ended: one that failed (not in ``mgr_code``: e.g. its worker) fails the filter."""
        if fut.status == "finished" or self._closed:
            return
        leaf = node < len(self._mids)
        where = f"manager {self._mids[node]}" if leaf else f"merge node {node}"
        cause = fut.exception() if fut.status == "error" else None
        err = DDictTaskError(
            f"filter: the task of {where} {fut.status}: {cause!r}",
            manager_id=self._mids[node] if leaf else None,
        )
        raise err from cause

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the streams; wait for the tasks to end, then cancel any left."""
        futures = self._stop()
        if futures:
            client = self._d._core.client
            try:
                client.sync(_wait, futures, timeout=config.get_seconds("compute.exit-timeout"))
            except TimeoutError:
                _still_running(futures)
            client.cancel(futures)

    def _stop(self) -> list[distributed.Future]:
        """Close the streams (the tasks see ``EOFError`` at their next put); the
        futures to wait for and cancel (none if already stopped)."""
        if self._closed:
            return []
        self._closed = True
        if self._receiver is not None:
            self._receiver.close()
        futures = list(self._futures.values())
        self._futures.clear()
        return futures


def _still_running(futures: list[distributed.Future]) -> None:
    logger.warning(
        "ddict filter: %d tasks still run %s after the caller left (a mgr_code "
        "that never puts again cannot be told); cancelling them",
        sum(not f.done() for f in futures),
        config.get("compute.exit-timeout"),
    )


class AsyncFilter:
    """``async with ad.filter(mgr_code, ...) as results: async for x in results: ...``.

    The same tree as :class:`Filter`, started from an asynchronous client.  The
    merged results are taken in a worker thread in batches (as many as are
    ready, up to :data:`ASYNC_BATCH`), so the event loop never blocks on a
    socket and a flood costs a thread hop per batch, not per result.
    """

    def __init__(self, f: Filter, workers: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        self._f = f
        self._workers = workers  # the scheduler's workers, read when the filter starts

    def __repr__(self) -> str:
        return "<Async" + repr(self._f)[1:]

    async def __aenter__(self) -> AsyncIterator[Any]:
        f = self._f
        if f._placement is None:
            f._placement = f._d._placement(await self._workers())
        f._start()
        return self._batches()

    def _batches(self) -> AsyncIterator[Any]:
        return in_thread(lambda: self._f._results(idle=True), ASYNC_BATCH, IDLE)

    async def __aexit__(self, *exc: object) -> None:
        futures = self._f._stop()
        if futures:
            client = self._f._d._core.client
            try:
                await client.sync(
                    _wait, futures, timeout=config.get_seconds("compute.exit-timeout")
                )
            except TimeoutError:
                _still_running(futures)
            await client.cancel(futures)


#: At most this many results per thread hop of :class:`AsyncFilter`.
ASYNC_BATCH = 1024
