"""AsyncDDict: the asyncio twin of :class:`~dask_ddict.DDict`.

Why a twin class and not awaitable methods on ``DDict``: ``d[k] = v`` and
``len(d)`` cannot be awaited, and a method that sometimes returns a coroutine
is a trap.  So ``DDict`` is always synchronous and ``AsyncDDict`` is always
asynchronous, with the same names where Python allows it
(``await ad.put(k, v)`` for ``d[k] = v``, ``await ad.length()`` for
``len(d)``).

The design follows zarr-python 3 the other way round: the synchronous handle
is the core (its key path is a blocking socket used from the calling thread,
which is what makes it fast), and the async twin is thin:

- control (create, destroy) goes through the asynchronous Dask client:
  ``await client.scheduler.ddict_create(...)``;
- gets (and puts) awaited together (``asyncio.gather`` over a thousand) share
  one :meth:`~dask_ddict.DDict.get_many` (one many-put): one request per host
  (:mod:`.coalesce`), not a thread and a round trip each.  Those to other hosts
  are written on the loop's own connections, several in flight on each and
  answered by tag (:mod:`~dask_ddict.transport.pipelined`): no thread at all;
- every other key operation (and what a pipe cannot send: same-host shards,
  TLS, a moved manager) runs the synchronous handle's code in a worker thread
  (:func:`asyncio.to_thread`), so the event loop never blocks, even on a
  ``wait_for_keys`` read that waits for a writer.

``ad.ddict`` is the synchronous handle underneath; pickling an ``AsyncDDict``
(e.g. as a ``client.submit`` argument) gives the task a synchronous
``DDict``, because task functions are synchronous.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from dask.typing import no_default
from distributed import Client, Future

from ..arguments import Timeout, check_bool, check_timeout
from ..errors import DDictKeyError
from ..filter import AsyncFilter, Filter
from ..stats import DDictManagerStats
from ..threaded import in_thread
from ..transport.timing import Profile
from .coalesce import GetBatcher, PutBatcher
from .core import HandleCore, install_orchestrator
from .creation import (
    check_keywords,
    create_request,
    created_layout,
    initial_checkpoint,
    trace_logging,
)
from .handle import CREATE_ARGUMENTS, CREATE_SIGNATURE, DDict
from .layouts import forget, layout_reply
from .workers import scheduler_workers_async

if TYPE_CHECKING:
    import dask.bag

_NO_DEFAULT: Any = object()
P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


def _awaitable(
    call: Callable[Concatenate[DDict, P], R],
) -> Callable[Concatenate[AsyncDDict, P], Coroutine[Any, Any, R]]:
    """``async def method(self, ...)``: ``call(sync_handle, ...)`` in a worker thread.

    Typed through ``ParamSpec``: each coroutine has its synchronous twin's
    signature, so ``await ad.get(k)`` type-checks like ``d.get(k)``.
    """

    async def method(self: AsyncDDict, *args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(call, self._d, *args, **kwargs)

    name = call.__name__  # the DDict method (``_keys`` stands for ``keys()``)
    method.__sync__ = name if name.startswith("__") else name.lstrip("_")  # type: ignore[attr-defined]
    return method


def _as_list(view: Callable[[DDict], Iterable[T]]) -> Callable[[DDict], list[T]]:
    """``keys()`` and the other views, materialized in the worker thread."""

    def listed(d: DDict) -> list[T]:
        return list(view(d))

    listed.__name__ = view.__name__
    return listed


# DDict's properties that ask the managers, as calls for the table below.
def _is_frozen(d: DDict) -> bool:
    return d.is_frozen


def _stats(d: DDict) -> list[DDictManagerStats]:
    return d.stats


def _dstats(d: DDict) -> dict[int, DDictManagerStats]:
    return d.dstats


def _moves(d: DDict) -> list[dict[str, Any]]:
    return d.moves


class AsyncDDict:
    """An asyncio handle on a distributed dictionary.

    Create one with ``await AsyncDDict.create(..., client=async_client)``
    (same arguments as :class:`DDict`), or attach with
    :meth:`AsyncDDict.attach` (no message is sent).  Every key operation is a
    coroutine; checkpoint moves (:meth:`checkpoint`, :meth:`rollback`,
    :attr:`checkpoint_id`) send no message and are plain methods.

    One rule for :class:`DDict`'s properties: those answered in this process
    (:attr:`checkpoint_id`, ``num_managers``, ``timeout``, ...) stay
    attributes, and those that ask the managers (``is_frozen``, ``stats``,
    ``dstats``, ``moves``) are coroutine methods here, ``await ad.is_frozen()``
    as ``await ad.stats()``: an attribute cannot be awaited, and one that
    blocked the event loop for a round trip would be a trap.

    Examples
    --------
    >>> async with Client(cluster, asynchronous=True) as client:   # doctest: +SKIP
    ...     ad = await AsyncDDict.create(total_mem="64 MiB", client=client)
    ...     await ad.put("x", 1)
    ...     assert await ad.get("x") == 1
    ...     await ad.destroy()
    """

    def __init__(self, ddict: DDict, client: Client | None = None) -> None:
        self._d = ddict
        self._client = client
        self._gets = GetBatcher(ddict)
        self._puts = PutBatcher(ddict)

    @classmethod
    async def create(cls, *args: Any, client: Client, **kwargs: Any) -> AsyncDDict:
        """Create a dictionary from an ``asynchronous=True`` client.

        Takes :class:`DDict`'s arguments (bound to its signature, their one
        declaration); ``client`` is required (an embedded cluster would have to
        be started synchronously).
        """
        if not isinstance(client, Client) or not client.asynchronous:
            raise TypeError("AsyncDDict.create needs client=<a Client(asynchronous=True)>")
        check_keywords("AsyncDDict.create", kwargs, CREATE_ARGUMENTS)
        bound = CREATE_SIGNATURE.bind(None, *args, **kwargs)
        bound.apply_defaults()
        given = {k: v for k, v in bound.arguments.items() if k in CREATE_ARGUMENTS}
        timeout = check_timeout(given["timeout"])
        request = create_request(given)
        trace_logging(given["trace"])  # (before the request: the creation is logged too)
        await install_orchestrator(client)
        core = HandleCore(
            created_layout(await client.scheduler.ddict_create(**request, client=client.id)), client
        )
        h = DDict._from_core(core, creator=True, chkpt=0, timeout=timeout)
        await asyncio.to_thread(initial_checkpoint, h, request)
        return cls(h, client)

    @classmethod
    def attach(
        cls,
        serialized: str,
        *,
        timeout: Timeout = no_default,
        client: Client | None = None,
        trace: bool = False,
    ) -> AsyncDDict:
        """Attach from :meth:`serialize`'s string (no message is sent)."""
        return cls(DDict.attach(serialized, timeout=timeout, client=client, trace=trace), client)

    @classmethod
    async def from_name(
        cls, name: str, client: Client, *, timeout: Timeout = no_default
    ) -> AsyncDDict:
        """Attach to the dictionary named ``name`` on ``client``'s cluster."""
        await install_orchestrator(client)
        layout = layout_reply(await client.scheduler.ddict_attach(name=name, client=client.id))
        h = DDict._from_core(
            HandleCore(layout, client), creator=False, chkpt=0, timeout=check_timeout(timeout)
        )
        return cls(h, client)

    @staticmethod
    async def list(client: Client, *, kept: bool = False) -> list[str]:
        """Names of the dictionaries on ``client``'s cluster, sorted; ``kept=True``: those
        kept for restart instead (see :meth:`DDict.list <dask_ddict.DDict.list>`)."""
        check_bool("kept", kept)
        await install_orchestrator(client)
        call = client.scheduler.ddict_list_kept if kept else client.scheduler.ddict_list
        return list(await call())

    @property
    def ddict(self) -> DDict:
        """The synchronous handle underneath (share its checkpoint and client id)."""
        return self._d

    def __reduce__(self) -> Any:
        return self._d.__reduce__()

    def __repr__(self) -> str:
        return "<Async" + repr(self._d)[1:]

    def __getitem__(self, key: Any) -> Any:
        """``await ad[key]`` (batched with the gets of the same loop turn, see :meth:`get`)."""
        return self._item(key)

    async def _item(self, key: Any) -> Any:
        got = await self._gets.get(key, _NO_DEFAULT, None)
        if got is _NO_DEFAULT:
            raise DDictKeyError(key)
        return got

    async def put(self, key: Any, value: Any) -> None:
        """Awaitable ``d[key] = value``.

        Puts awaited in the same event-loop turn are sent together: one request
        per host process, each put acknowledged (or failed) on its own
        (:mod:`~dask_ddict.client.coalesce`).
        """
        await self._puts.put(key, value, False)

    async def pput(self, key: Any, value: Any) -> None:
        """Awaitable :meth:`DDict.pput` (sent together as :meth:`put`)."""
        await self._puts.put(key, value, True)

    async def get(self, key: Any, default: Any = None, copy: bool | None = None) -> Any:
        """Awaitable :meth:`DDict.get`.

        Gets awaited in the same event-loop turn (``asyncio.gather`` over many)
        are read together with one :meth:`DDict.get_many`: one request per host
        process, pipelined on the loop's connections to other hosts
        (:mod:`~dask_ddict.client.coalesce`).
        """
        return await self._gets.get(key, default, copy)

    # -- lifecycle ----------------------------------------------------------------

    def serialize(self) -> str:
        return self._d.serialize()

    def get_name(self) -> str:
        return self._d.get_name()

    def detach(self) -> None:
        self._d.detach()

    async def destroy(self, allow_restart: bool = False) -> None:
        """Remove every manager and its shard; idempotent."""
        core = self._d._core
        if core.closed:
            return
        core.close()
        forget(core.ref.uid)
        client = self._client or core.client
        await client.scheduler.ddict_destroy(
            name=core.ref.name, uid=core.ref.uid, allow_restart=allow_restart
        )

    async def __aenter__(self) -> AsyncDDict:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._d._creator:
            await self.destroy()
        else:
            self.detach()

    # -- what sends no message: plain methods ----------------------------------------------

    def which_manager(self, key: Any) -> int:
        return self._d.which_manager(key)

    @property
    def checkpoint_id(self) -> int:
        return self._d.checkpoint_id

    @checkpoint_id.setter
    def checkpoint_id(self, value: int) -> None:
        self._d.checkpoint_id = value

    def checkpoint(self) -> None:
        self._d.checkpoint()

    def rollback(self) -> None:
        self._d.rollback()

    def start_batch_put(self, persist: bool = False) -> None:
        self._d.start_batch_put(persist)

    def manager(self, manager_id: int) -> AsyncDDict:
        return AsyncDDict(self._d.manager(manager_id), self._client)

    def pickler(self, key_pickler: Any = None, value_pickler: Any = None) -> AsyncDDict:
        return AsyncDDict(self._d.pickler(key_pickler, value_pickler), self._client)

    def profile(self) -> Profile:
        """:meth:`DDict.profile` (this process's timings: no message is sent).  The
        requests an event loop pipelines itself (gets and puts gathered in one loop
        turn, to other hosts) are not timed; those sent from worker threads are."""
        return self._d.profile()

    def profile_reset(self, enable: bool = True) -> None:
        """:meth:`DDict.profile_reset` (this process's timings: no message is sent)."""
        self._d.profile_reset(enable)

    # -- computing beside the shards (the asynchronous client places the tasks) ------------

    async def _workers(self) -> dict[str, Any]:
        """The scheduler's workers (an asynchronous client caches none of them), read
        with the orchestrator's layout now (managers move; the handle's
        :meth:`~dask_ddict.client.core.HandleCore.fresh` must not wait on the loop)."""
        client = self._client or self._d._core.client
        workers, _ = await asyncio.gather(
            scheduler_workers_async(client), self._d._core.fresh_async()
        )
        return workers

    async def map_shards(
        self,
        func: Callable[..., Any],
        *args: Any,
        **kwargs: Any,
    ) -> builtins.list[Future]:
        """Awaitable :meth:`DDict.map_shards`: one future per manager, placed beside it."""
        self._d._check()  # (before asking the scheduler anything)
        return self._d._map_shards(func, args, kwargs, await self._workers())

    async def to_bag(self, what: str = "items", copy: bool = False) -> dask.bag.Bag:
        """Awaitable :meth:`DDict.to_bag` (compute it with ``await client.compute(...)``)."""
        self._d._check()
        client = self._client or self._d._core.client
        scatters = self._d._bag_scatters(what, await self._workers(), copy)
        return self._d._bag(
            what,
            copy,
            [
                (idx, await client.scatter(handles, workers=workers, hash=False))
                for idx, handles, workers in scatters
            ],
        )

    def filter(
        self,
        mgr_code: Callable[..., Any],
        mgr_code_args: tuple[Any, ...] = (),
        comparator: Callable[[Any, Any], bool] | None = None,
        branching_factor: int = 5,
    ) -> AsyncFilter:
        """:meth:`DDict.filter` for ``async with ad.filter(...) as results: async for x in
        results``: the same tree of tasks, results taken in a thread, a batch per hop."""
        self._d._check()
        return AsyncFilter(
            Filter(self._d, mgr_code, mgr_code_args, comparator, branching_factor, None),
            self._workers,
        )

    def __aiter__(self) -> AsyncIterator[Any]:
        """``async for k in ad``: keys streamed page by page (one thread hop per page)."""
        return in_thread(self._d.keys, 256)

    # -- the async face, declared once: every operation that talks to a manager -----
    # ``put``/``length``/... are the names of what DDict spells with operators
    # (``d[k] = v``, ``len(d)``, ...); views come back as lists.
    get_many = _awaitable(DDict.get_many)
    contains = _awaitable(DDict.__contains__)
    pop = _awaitable(DDict.pop)
    delete = _awaitable(DDict.__delitem__)
    length = _awaitable(DDict.__len__)
    clear = _awaitable(DDict.clear)
    update = _awaitable(DDict.update)
    setdefault = _awaitable(DDict.setdefault)
    popitem = _awaitable(DDict.popitem)
    fetch_add = _awaitable(DDict.fetch_add)
    wait_for = _awaitable(DDict.wait_for)
    keys = _awaitable(_as_list(DDict.keys))
    values = _awaitable(_as_list(DDict.values))
    items = _awaitable(_as_list(DDict.items))
    sync_to_newest_checkpoint = _awaitable(DDict.sync_to_newest_checkpoint)
    persist = _awaitable(DDict.persist)
    persisted_ids = _awaitable(DDict.persisted_ids)
    sync = _awaitable(DDict.sync)
    restore = _awaitable(DDict.restore)
    advance = _awaitable(DDict.advance)
    end_batch_put = _awaitable(DDict.end_batch_put)
    bput = _awaitable(DDict.bput)
    bget = _awaitable(DDict.bget)
    freeze = _awaitable(DDict.freeze)
    unfreeze = _awaitable(DDict.unfreeze)
    is_frozen = _awaitable(_is_frozen)
    stats = _awaitable(_stats)
    dstats = _awaitable(_dstats)
    local_keys = _awaitable(_as_list(DDict.local_keys))
    local_values = _awaitable(_as_list(DDict.local_values))
    local_items = _awaitable(_as_list(DDict.local_items))
    local_len = _awaitable(DDict.local_len)
    clone = _awaitable(DDict.clone)
    rebalance = _awaitable(DDict.rebalance)
    moves = _awaitable(_moves)

    def __getattr__(self, name: str) -> Any:
        # Plain properties that send no message (num_managers, manager_workers (Dragon's
        # manager_nodes), local_managers, main_manager, timeout, wait_for_keys, ...).
        if name in _PASSTHROUGH:
            return getattr(self._d, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


#: The names of the generated coroutines (``put``, ``get``, ...), set below the class.
AWAITABLE: tuple[str, ...] = tuple(
    name for name, value in vars(AsyncDDict).items() if hasattr(value, "__sync__")
)
for _name in AWAITABLE:
    _method = vars(AsyncDDict)[_name]
    _method.__name__, _method.__qualname__ = _name, f"AsyncDDict.{_name}"
    _method.__doc__ = f"Awaitable :meth:`DDict.{_method.__sync__}` (run in a worker thread)."
    if isinstance(getattr(DDict, _method.__sync__, None), property):  # (see the class's rule)
        _method.__doc__ = (
            f"Awaitable :attr:`DDict.{_method.__sync__}` (a property there, which "
            "asks the managers; run in a worker thread)."
        )

_PASSTHROUGH = frozenset(
    {
        "num_managers",
        "manager_workers",
        "manager_nodes",
        "local_managers",
        "local_manager",
        "main_manager",
        "empty_managers",
        "timeout",
        "lifetime",
        "wait_for_keys",
        "wait_for_writers",
        "working_set_size",
    }
)
