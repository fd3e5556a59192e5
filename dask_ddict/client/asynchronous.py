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
- key operations run the synchronous handle's code in a worker thread
  (:func:`asyncio.to_thread`), so the event loop never blocks, even on a
  ``wait_for_keys`` read that waits for a writer.

``ad.ddict`` is the synchronous handle underneath; pickling an ``AsyncDDict``
(e.g. as a ``client.submit`` argument) gives the task a synchronous
``DDict``, because task functions are synchronous.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

from distributed import Client

from ..arguments import check_timeout
from ..layout import Layout
from ..stats import DDictManagerStats
from .core import MISSING as _MISSING
from .core import _Core
from .creation import create_request
from .handle import DDict, initial_checkpoint


class AsyncDDict:
    """An asyncio handle on a distributed dictionary.

    Create one with ``await AsyncDDict.create(..., client=async_client)``
    (same arguments as :class:`DDict`), or attach with
    :meth:`AsyncDDict.attach` (no message is sent).  Every key operation is a
    coroutine; checkpoint moves (:meth:`checkpoint`, :meth:`rollback`,
    :attr:`checkpoint_id`) send no message and are plain methods.

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

    @classmethod
    async def create(
        cls,
        managers_per_worker: int | None = None,
        n_workers: int | None = None,
        total_mem: int | str | None = None,
        *,
        client: Client,
        timeout: float | None = None,
        name: str = "",
        restart: bool = False,
        manager_pool_full_thresh: float | None = None,
        workers: list[str] | None = None,
        **checkpoint_options: Any,
    ) -> AsyncDDict:
        """Create a dictionary from an ``asynchronous=True`` client.

        Takes :class:`DDict`'s arguments; ``client`` is required (an embedded
        cluster would have to be started synchronously).
        """
        if not isinstance(client, Client) or not client.asynchronous:
            raise TypeError("AsyncDDict.create needs client=<a Client(asynchronous=True)>")
        timeout = check_timeout(timeout)
        request = create_request(
            managers_per_worker, n_workers, total_mem, name=name, timeout=timeout,
            restart=restart, manager_pool_full_thresh=manager_pool_full_thresh,
            workers=workers, **checkpoint_options,
        )  # fmt: skip
        from ..cluster.scheduler_plugin import DDictSchedulerPlugin

        await client.register_plugin(DDictSchedulerPlugin())
        layout_d = await client.scheduler.ddict_create(**request, client=client.id)
        core = _Core(Layout.from_dict(layout_d), client)
        h = DDict._from_core(core, creator=True, chkpt=0, timeout=timeout)
        await asyncio.to_thread(initial_checkpoint, h, request)
        return cls(h, client)

    @classmethod
    def attach(cls, serialized: str, *, timeout: float | None = None,
               client: Client | None = None) -> AsyncDDict:  # fmt: skip
        """Attach from :meth:`serialize`'s string (no message is sent)."""
        return cls(DDict.attach(serialized, timeout=timeout, client=client), client)

    @property
    def ddict(self) -> DDict:
        """The synchronous handle underneath (share its checkpoint and client id)."""
        return self._d

    def __reduce__(self) -> Any:
        return self._d.__reduce__()

    def __repr__(self) -> str:
        return "<Async" + repr(self._d)[1:]

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

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
        client = self._client or core.client
        await client.scheduler.ddict_destroy(
            name=core.layout.name, uid=core.layout.uid, allow_restart=allow_restart
        )

    async def __aenter__(self) -> AsyncDDict:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._d._creator:
            await self.destroy()
        else:
            self.detach()

    # -- the dict protocol ----------------------------------------------------------

    async def put(self, key: Any, value: Any) -> None:
        """``d[key] = value``."""
        await self._run(self._d.__setitem__, key, value)

    async def pput(self, key: Any, value: Any) -> None:
        await self._run(self._d.pput, key, value)

    def __getitem__(self, key: Any) -> Any:
        """``await ad[key]``: the value, or ``DDictKeyError``."""
        return self._run(self._d.__getitem__, key)

    async def get(self, key: Any, default: Any = None) -> Any:
        return await self._run(self._d.get, key, default)

    async def contains(self, key: Any) -> bool:
        return await self._run(self._d.__contains__, key)

    async def pop(self, key: Any, default: Any = _MISSING) -> Any:
        return await self._run(self._d.pop, key, default)

    async def delete(self, key: Any) -> None:
        """``del d[key]``."""
        await self._run(self._d.__delitem__, key)

    async def length(self) -> int:
        """``len(d)`` at this handle's checkpoint."""
        return await self._run(self._d.__len__)

    async def clear(self) -> None:
        await self._run(self._d.clear)

    async def update(self, other: Mapping[Any, Any] | Any = (), **kwargs: Any) -> None:
        await self._run(lambda: self._d.update(other, **kwargs))

    async def fetch_add(self, key: Any, n: int = 1) -> int:
        return await self._run(self._d.fetch_add, key, n)

    async def wait_for(self, key: Any, value: Any, timeout: float | None = _MISSING) -> None:
        await self._run(self._d.wait_for, key, value, timeout)

    def which_manager(self, key: Any) -> int:
        return self._d.which_manager(key)

    async def keys(self) -> list[Any]:
        return await self._run(lambda: list(self._d.keys()))

    async def values(self) -> list[Any]:
        return await self._run(lambda: list(self._d.values()))

    async def items(self) -> list[tuple[Any, Any]]:
        return await self._run(lambda: list(self._d.items()))

    async def __aiter__(self) -> AsyncIterator[Any]:
        """``async for k in ad``: keys streamed page by page (one thread hop per page)."""
        it = iter(self._d.keys())
        page = 256

        def chunk() -> list[Any]:
            out = []
            for k in it:
                out.append(k)
                if len(out) == page:
                    break
            return out

        while True:
            keys = await self._run(chunk)
            for k in keys:
                yield k
            if len(keys) < page:
                return

    # -- checkpoints (no messages, except sync_to_newest_checkpoint) -------------------

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

    async def sync_to_newest_checkpoint(self) -> None:
        await self._run(self._d.sync_to_newest_checkpoint)

    # -- persistence -------------------------------------------------------------------

    async def persist(self) -> None:
        await self._run(self._d.persist)

    async def persisted_ids(self) -> list[int]:
        return await self._run(self._d.persisted_ids)

    async def sync(self) -> None:
        await self._run(self._d.sync)

    async def restore(self, chkpt: int) -> None:
        await self._run(self._d.restore, chkpt)

    async def advance(self) -> int:
        return await self._run(self._d.advance)

    # -- batch, broadcast, freeze --------------------------------------------------------

    def start_batch_put(self, persist: bool = False) -> None:
        self._d.start_batch_put(persist)

    async def end_batch_put(self) -> None:
        await self._run(self._d.end_batch_put)

    async def bput(self, key: Any, value: Any) -> None:
        await self._run(self._d.bput, key, value)

    async def bget(self, key: Any) -> Any:
        return await self._run(self._d.bget, key)

    async def freeze(self) -> None:
        await self._run(self._d.freeze)

    async def unfreeze(self) -> None:
        await self._run(self._d.unfreeze)

    async def is_frozen(self) -> bool:
        return await self._run(lambda: self._d.is_frozen)

    # -- handles, locality, introspection ----------------------------------------------

    def manager(self, manager_id: int) -> AsyncDDict:
        return AsyncDDict(self._d.manager(manager_id), self._client)

    def pickler(self, key_pickler: Any = None, value_pickler: Any = None) -> AsyncDDict:
        return AsyncDDict(self._d.pickler(key_pickler, value_pickler), self._client)

    async def stats(self) -> list[DDictManagerStats]:
        return await self._run(lambda: self._d.stats)

    async def dstats(self) -> dict[int, DDictManagerStats]:
        return await self._run(lambda: self._d.dstats)

    def __getattr__(self, name: str) -> Any:
        # Plain properties that send no message (num_managers, manager_workers,
        # local_managers, main_manager, timeout, wait_for_keys, ...).
        if name in _PASSTHROUGH:
            return getattr(self._d, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


_PASSTHROUGH = frozenset(
    {
        "num_managers", "manager_workers", "local_managers", "local_manager", "main_manager",
        "empty_managers", "timeout", "wait_for_keys", "wait_for_writers", "working_set_size",
    }
)  # fmt: skip
