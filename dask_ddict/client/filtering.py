"""``DDict.filter``: Dragon's filter as Dask tasks beside the shards, merged up a tree.

One task per manager (a *leaf*) runs ``mgr_code(dd, out_queue, *args)`` on the
worker that hosts the manager, so ``dd``'s reads come from the shard itself.
Its results stream to its parent: a *merge task* (fan-in at most
``branching_factor``, placed on the worker most of its children run on), or
the caller, which is the tree's root and merges its own children as the user
iterates.  Every hop is a socket between two processes (:mod:`.streams`) with a
credit window, so memory stays bounded by a few batches per task; the
scheduler only places the tasks and never sees a result.

Tasks that stream for long would hold worker threads: a merge task leaves its
worker's thread pool (:func:`distributed.secede`) as it starts, and a leaf just
before it would first wait (see :func:`run_leaf`), so a filter of any number of
managers runs on workers with one thread each, and a worker's leaves scan one
at a time per thread until they wait.
"""

from __future__ import annotations

import logging
import math
import pickle
import secrets
import ssl
import threading
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import distributed
from distributed.client import _wait
from distributed.comm import get_address_host
from distributed.utils import get_ip

from .. import config
from ..errors import DDictError, DDictTaskError
from .hub import IDLE, Hub
from .streams import (
    ERROR,
    HELLO,
    PARENT,
    ROOT,
    TASK,
    TOKEN_BYTES,
    Failed,
    Failure,
    Limits,
    Sender,
    Stopped,
    _close,
    connect,
    hello,
    recv_frame,
    send_frame,
    tls_context,
)
from .threaded import in_thread

#: A DDict handle (not imported: the handle imports this module).
DDict = Any

logger = logging.getLogger(__name__)

#: Seconds a leaf waits in its worker's thread pool, at its first flush, for its join
#: to its parent (begun as it started) to end; then it secedes (a merge task that has
#: not started yet: the caller can say where it listens only once it runs).
ANSWER_SOON = 0.01


@dataclass(frozen=True)
class Plan:
    """What every task of one filter knows: the tree, and how to reach the caller."""

    token: bytes = field(repr=False)  # proves a connection belongs to this filter
    root: tuple[str, int]
    #: The parent of each node: nodes ``0 .. leaves-1`` are the managers' tasks, the
    #: rest merge tasks; :data:`~.streams.ROOT` is the caller.
    parents: tuple[int, ...]
    leaves: int
    limits: Limits
    tls: bool = False  # the cluster's TLS: every stream is TLS, with its certificates

    def ssl_context(self, listen: bool) -> ssl.SSLContext | None:
        """A task's TLS context (``None`` without TLS); in the task's own thread."""
        if not self.tls:
            return None
        return tls_context(distributed.get_worker().security, "worker", listen)

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]


def tree(workers: list[str], fan_in: int) -> tuple[list[int], list[str]]:
    """``(parent of each node, worker of each merge node)`` for leaves on ``workers``.

    Leaves are grouped by worker, so the first merges happen beside the shards
    and only merged results travel further; each level has as few merge nodes
    as the fan-in allows, evenly filled.
    """
    n = len(workers)
    parents = [ROOT] * n
    where = dict(enumerate(workers))
    level = sorted(range(n), key=lambda i: (workers[i], i))
    while len(level) > fan_in:
        groups = math.ceil(len(level) / fan_in)
        size = math.ceil(len(level) / groups)
        nxt = []
        for g in range(0, len(level), size):
            node = len(parents)
            parents.append(ROOT)
            members = level[g : g + size]
            for m in members:
                parents[m] = node
            where[node] = Counter(where[m] for m in members).most_common(1)[0][0]
            nxt.append(node)
        level = nxt
    return parents, [where[i] for i in range(n, len(parents))]


#: Seconds a task waits for the caller's answer beyond ``connect-timeout``, which is how
#: long the caller waits for the task's parent merge task to start: so the caller's
#: word that it gave up (an ``ERROR``) arrives before the task's own timeout.
ANSWER_GRACE = 5.0


def _join(
    plan: Plan,
    node: int,
    address: tuple[str, int] | None,
    ssl_context: ssl.SSLContext | None = None,
) -> Any:
    """A socket to ``node``'s parent: asked of the caller, which may be the parent;
    ``None`` if the caller has left (a task that starts late has nothing to do)."""
    timeout = plan.limits.connect_timeout
    leaf = node if node < plan.leaves else None  # (a leaf's node number is its manager's)
    try:
        sock = connect(plan.root, timeout, ssl_context)
        send_frame(sock, HELLO, hello(plan.token, node, address))
        sock.settimeout(timeout + ANSWER_GRACE)  # (the caller gives up first, and says so)
        kind, payload = recv_frame(sock)
        if kind == ERROR:  # the caller gave up on this node's parent: it fails, loudly
            _close(sock)
            raise DDictTaskError(
                f"filter: node {node} cannot join its parent: {payload.decode(errors='replace')}",
                manager_id=leaf,
            )
        if kind != PARENT:
            _close(sock)
            raise EOFError(f"unexpected frame {kind}")
        if payload:
            _close(sock)
            host, port = payload.decode().rsplit("|", 1)
            sock = connect((host, int(port)), timeout, ssl_context)
            send_frame(sock, HELLO, hello(plan.token, node, None))
    except (ConnectionError, EOFError) as e:  # the caller has left (refused, reset): nothing to do
        logger.debug("ddict filter: node %d starts after its caller left (%r)", node, e)
        return None
    except OSError as e:
        raise DDictTaskError(
            f"filter: node {node} cannot reach its parent (the caller at "
            f"{plan.root[0]}:{plan.root[1]} left, or is unreachable): {e}",
            manager_id=leaf,
        ) from e
    sock.settimeout(None)
    return sock


class _Joining:
    """A leaf's join to its parent (:func:`_join`), in a thread of its own while
    ``mgr_code`` runs: the leaf's first flush then finds it joined."""

    def __init__(self, plan: Plan, node: int, ssl_context: ssl.SSLContext | None = None) -> None:
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._sock: Any = None
        self.error: BaseException | None = None
        self._taken = self._dropped = False
        threading.Thread(
            target=self._run,
            args=(plan, node, ssl_context),
            daemon=True,
            name=f"ddict-filter-join-{node}",
        ).start()

    def _run(self, plan: Plan, node: int, ssl_context: ssl.SSLContext | None) -> None:
        try:
            sock = _join(plan, node, None, ssl_context)
        except BaseException as e:  # noqa: BLE001 - raised in the leaf, at its first flush
            sock, self.error = None, e
        with self._lock:
            self._sock = sock
            self._done.set()
            if not self._dropped:
                return
        if sock is not None:  # (the leaf ended without it)
            _close(sock)

    def result(self, before_wait: Callable[[], None] | None) -> Any:
        """The socket (``None``: the caller has left); ``before_wait`` is called if it
        is not there within :data:`ANSWER_SOON` (its parent has not started yet)."""
        if not self._done.wait(ANSWER_SOON):
            if before_wait is not None:
                before_wait()
            self._done.wait()
        self._taken = True
        if self.error is not None:
            raise self.error
        return self._sock

    def drop(self) -> None:
        """The leaf ends: a socket it never took is closed (now, or once joined)."""
        with self._lock:
            self._dropped = True
            sock = self._sock if self._done.is_set() and not self._taken else None
        if sock is not None:
            _close(sock)


def run_leaf(
    dd: DDict, mgr_code: Callable[..., Any], args: tuple[Any, ...], plan: Plan, node: int
) -> None:
    """A manager's task: ``mgr_code(dd, out_queue, *args)``, its results sent up.

    It runs in its worker's thread pool, so a worker's leaves scan one after
    another per thread, and leaves the pool (once) only just before it would
    wait: for its parent merge task to say where it listens (one that has not
    started yet: holding the only thread while waiting for it would deadlock),
    or for a credit.  It joins its parent in a thread while ``mgr_code`` runs,
    and takes the socket at its first flush: a leaf whose results fit its
    credit window never leaves the pool (merge tasks start first).
    """
    seceded = False

    def leave_pool() -> None:
        nonlocal seceded
        if not seceded:
            seceded = True
            distributed.secede()

    joining = _Joining(plan, node, plan.ssl_context(listen=False))
    out = Sender(
        None,
        plan.limits,
        lambda: joining.result(None if plan.parents[node] == ROOT else leave_pool),
        leave_pool,
    )
    try:
        mgr_code(dd, out, *args)
        out.end()
    except EOFError as e:
        if not out.left:  # mgr_code's own EOFError, not the caller's leaving
            out.fail(Failure.of(node, node, e))
    except Exception as e:  # noqa: BLE001 - raised in the caller, naming the manager
        out.fail(Failure.of(node, node, e))
        if out.left and joining.error is not None:
            raise joining.error from None  # (its parent unreachable: the task fails instead)
    finally:
        out.close()
        joining.drop()


def run_merge(plan: Plan, node: int, comparator: Callable[[Any, Any], bool] | None) -> None:
    """A merge task: its children's results, merged, sent up."""
    distributed.secede()
    host = get_address_host(distributed.get_worker().address)
    hub = Hub(
        host,
        plan.token,
        plan.children(node),
        plan.leaves,
        plan.limits,
        ssl_context=plan.ssl_context(listen=True),
    )
    sock = None
    try:
        sock = _join(plan, node, hub.address, plan.ssl_context(listen=False))
        if sock is None:
            return
        out = Sender(sock, plan.limits)
        try:
            for _, blob in hub.merged(comparator, out.gone):
                if blob is None:  # (IDLE: its children have nothing yet)
                    out.flush()
                else:
                    out.put_pickled(blob)
            out.end()
        except (EOFError, Stopped):
            pass  # the caller left
        except Failed as f:
            out.fail(f.failure)
        except Exception as e:  # noqa: BLE001 - e.g. the comparator raised
            out.fail(Failure.of(node, None, e))
    finally:
        hub.close()
        if sock is not None:
            _close(sock)


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
        d: DDict,
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
        self._hub: Hub | None = None
        self._futures: dict[int, distributed.Future] = {}
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._hub is not None else "ready"
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
        if self._hub is not None:
            raise DDictError("a filter runs once: call d.filter(...) again", "INVALID_OPERATION")
        d = self._d
        if self._placement is None:
            self._placement = d._placement()
        client = d._core.client
        mids = d._managers()
        limits = Limits.from_config()
        token = secrets.token_bytes(TOKEN_BYTES)
        targets = [(p or [""])[0] for p in self._placement]
        parents, merge_workers = tree([targets[i] for i in range(len(mids))], self._fan_in)
        tls = d._core.layout.tls  # (a TLS cluster: its certificates protect the streams too)
        self._hub = hub = Hub(
            caller_host(client),
            token,
            [i for i, p in enumerate(parents) if p == ROOT],
            len(mids),
            limits,
            tuple(parents),
            ssl_context=tls_context(d._core.security(), "client", listen=True) if tls else None,
        )
        plan = Plan(token, hub.address, tuple(parents), len(mids), limits, tls)
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
                fut.add_done_callback(lambda f, node=node: hub.event(node, TASK, f))
        except BaseException:
            self._stop()
            raise
        self._mids = mids

    def _results(self, idle: bool = False) -> Iterator[Any]:
        """The merged results; with ``idle``, also :data:`IDLE` whenever no result is
        ready (the async iterator hands on its batch then)."""
        assert self._hub is not None
        try:
            for item, blob in self._hub.merged(self._cmp, lambda: self._closed, self._ended):
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
        if self._hub is not None:
            self._hub.close()
        futures = list(self._futures.values())
        self._futures.clear()
        return futures


def by_placement(where: list[list[str] | None]) -> dict[tuple[str, ...], list[int]]:
    """The indices of ``where`` grouped by placement (``()``: anywhere), in order."""
    out: dict[tuple[str, ...], list[int]] = {}
    for i, w in enumerate(where):
        out.setdefault(tuple(w or ()), []).append(i)
    return out


def map_placed(
    client: distributed.Client,
    fn: Callable[..., Any],
    placed: dict[tuple[str, ...], list[int]],
    args: Callable[[int], tuple[Any, ...]],
    key: Callable[[int], str],
    **kwargs: Any,
) -> dict[int, distributed.Future]:
    """``fn(*args(node))`` per node, one ``client.map`` (one message to the scheduler)
    per placement (the workers it may run on; ``()``: anywhere)."""
    out: dict[int, distributed.Future] = {}
    for where, nodes in placed.items():
        columns = list(zip(*(args(n) for n in nodes)))
        futures = client.map(
            fn,
            *columns,
            key=[key(n) for n in nodes],
            workers=list(where) or None,
            allow_other_workers=bool(where),
            pure=False,
            **kwargs,
        )
        out.update(zip(nodes, futures))
    return out


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
