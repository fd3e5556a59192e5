"""Computing beside the data: ``filter``, ``map_shards`` and ``to_bag`` (a base of DDict).

Each runs code in Dask tasks placed on the worker that hosts each manager, so
that the task's handle (``d.manager(i)`` at the caller's checkpoint) reads its
shard from shared memory: no value crosses a socket.  Any Dask cluster works,
across hosts too; the scheduler only places the tasks.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self

from dask.utils import funcname
from distributed import Future
from distributed.comm import get_address_host

from ..arguments import check_bool
from ..filter import Filter
from ..filter.plan import by_placement, map_placed
from ..layout import Layout
from ..transport.protocol import WANT_ITEMS, WANT_KEYS, WANT_VALUES
from .base import HandleBase
from .workers import scheduler_workers

if TYPE_CHECKING:
    import dask.bag

_WANT = {"items": WANT_ITEMS, "keys": WANT_KEYS, "values": WANT_VALUES}


def placement(layout: Layout, workers: dict[str, Any]) -> list[list[str] | None]:
    """Where each manager's tasks run: ``[its worker]``; if that worker is gone, the
    worker its nanny restarted, else the workers on its host; else anywhere (``None``).

    ``workers`` is the scheduler's view (``scheduler_workers(client)``).
    """
    by_nanny = {info.get("nanny"): addr for addr, info in workers.items() if info.get("nanny")}
    by_host: dict[str, list[str]] = defaultdict(list)
    for addr in sorted(workers):
        by_host[get_address_host(addr)].append(addr)
    out: list[list[str] | None] = []
    for m in layout.managers:
        if m.worker in workers:
            out.append([m.worker])
        elif m.supervisor in by_nanny:
            out.append([by_nanny[m.supervisor]])
        else:
            out.append(by_host.get(get_address_host(m.worker)) or None)
    return out


def call_on_shard(
    func: Callable[..., Any], dd: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A :meth:`Compute.map_shards` task (the user's keywords never meet ``submit``'s)."""
    return func(dd, *args, **kwargs)


def read_shard(dd: Any, want: int, copy: bool = True) -> list[Any]:
    """A :meth:`Compute.to_bag` partition: the manager's items, keys or values.

    ``dd`` is directed to its manager, whose shard this task's host maps: the
    scan pages through the shard's snapshots in this process (no socket).
    ``copy=False``: values are lent from the shard (read-only numpy arrays, as
    ``dd.get(k, copy=False)``), held for as long as the partition lives.
    """
    got = dd._iter(dd._managers(), want, lend=not copy)
    if want == WANT_ITEMS:
        return list(got)
    return [k for k, _ in got] if want == WANT_KEYS else [v for _, v in got]


class Compute(HandleBase):
    """``filter``, ``map_shards``, ``to_bag``: tasks beside their shards."""

    def _placement(self, workers: dict[str, Any] | None = None) -> list[list[str] | None]:
        """:func:`placement` of this handle's managers, from the scheduler's ``workers``
        (read here if not given: an asynchronous client's caller reads it first)."""
        if workers is None:
            workers = scheduler_workers(self._core.client)
        everywhere = placement(self._core.fresh(), workers)
        return [everywhere[m] for m in self._managers()]

    def filter(
        self,
        mgr_code: Callable[..., Any],
        mgr_code_args: tuple[Any, ...] = (),
        comparator: Callable[[Any, Any], bool] | None = None,
        branching_factor: int = 5,
    ) -> Filter:
        """Run ``mgr_code`` beside every shard and stream its results back (Dragon's filter).

        ``mgr_code(dd, out_queue, *mgr_code_args)`` runs once per manager, in a Dask
        task on the worker hosting it, with ``dd`` a handle directed to that manager
        at this handle's checkpoint (its reads come from the shard, on its host) and
        ``out_queue.put(x)`` sending ``x`` to this process.  Results are merged up a
        tree of tasks of fan-in at most ``branching_factor``: in ``comparator``
        order (``comparator(x, y)`` true: ``x`` comes first; each manager must put
        its results in that order), else as they come.  They stream, with memory
        bounded by a few batches per task (``ddict.compute.*``).

        Use it as a context manager::

            with d.filter(code, (arg,), comparator=lambda x, y: x < y) as results:
                for x in results:
                    ...

        An exception in ``mgr_code`` is raised here as
        :class:`~dask_ddict.DDictTaskError` naming the manager (its ``__cause__``
        is the original).  Leaving the ``with`` block early stops the tasks:
        ``out_queue.put`` raises ``EOFError`` in them, and the tasks are waited
        for (``ddict.compute.exit-timeout``), then cancelled.
        """
        self._check()
        return Filter(
            self, mgr_code, mgr_code_args, comparator, branching_factor, None
        )  # (placed when it starts)

    def map_shards(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Future]:
        """``func(d.manager(i), *args, **kwargs)`` in a task beside each manager's shard.

        One Dask future per manager, in manager order; each task is placed on the
        worker hosting its manager (see :func:`placement`), so the handle's reads
        come from the shard's shared memory.  The handles are at this handle's
        checkpoint.
        """
        return self._map_shards(func, args, kwargs, None)

    def _map_shards(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        workers: dict[str, Any] | None,
    ) -> list[Future]:
        self._check()
        if not callable(func):
            raise TypeError(f"func must be callable, got {type(func).__name__}")
        client = self._core.client
        where = self._placement(workers)
        tag = uuid.uuid4().hex[:8]
        name = funcname(func)
        mids = self._managers()
        futures = map_placed(
            client,
            call_on_shard,
            by_placement(where),
            lambda i: (func, self.manager(mids[i]), args, kwargs),
            lambda i: f"{name}-shard-{mids[i]}-{tag}",
        )
        return [futures[i] for i in range(len(mids))]

    def to_bag(self, what: str = "items", copy: bool = False) -> dask.bag.Bag:
        """A ``dask.bag.Bag`` of the dictionary: one partition per manager.

        ``what``: ``"items"`` (``(key, value)`` pairs, the default), ``"keys"`` or
        ``"values"``.  Each partition is read lazily, at this handle's checkpoint,
        by a task beside its shard: the partition's task depends on the manager's
        handle, which this call places on the worker hosting the manager, and
        Dask runs a task where its dependencies are (the read then fuses with
        what the bag maps over it).  Compute it on the dictionary's cluster.

        ``copy=False`` (the default): values read beside their shard are
        zero-copy, as with ``get(copy=False)``: numpy arrays are read-only views
        of the shard, which hold its pages only while the partition lives (a
        bag's steps make new objects; map a copy to change one in place).
        ``copy=True``: every value is a private, writeable copy.
        """
        scatters = self._bag_scatters(what, None, copy)
        return self._bag(
            what,
            copy,
            [
                (idx, self._core.client.scatter(handles, workers=workers, hash=False))
                for idx, handles, workers in scatters
            ],
        )

    def _bag_scatters(
        self,
        what: str,
        workers: dict[str, Any] | None,
        copy: bool,
    ) -> list[tuple[list[int], list[Self], list[str] | None]]:
        """What :meth:`to_bag` scatters: ``(partitions, their handles, onto which
        workers)`` per placement (checks ``what`` and ``copy`` first)."""
        self._check()
        if what not in _WANT:
            raise ValueError(f"what must be 'items', 'keys' or 'values', got {what!r}")
        check_bool("copy", copy)
        mids = self._managers()
        return [
            (idx, [self.manager(mids[i]) for i in idx], list(g) or None)
            for g, idx in by_placement(self._placement(workers)).items()
        ]

    def _bag(
        self, what: str, copy: bool, scattered: list[tuple[list[int], list[Future]]]
    ) -> dask.bag.Bag:
        """The bag over the scattered handles: partition ``i`` reads handle ``i``'s shard."""
        import dask.bag as db
        from dask.highlevelgraph import HighLevelGraph

        handles: dict[int, Future] = {}
        for idx, futures in scattered:
            handles.update(zip(idx, futures))
        name = f"ddict-{what}-{self._core.name}-{uuid.uuid4().hex[:8]}"
        dsk: dict[Any, Any] = {
            (name, i): (read_shard, h, _WANT[what], copy) for i, h in sorted(handles.items())
        }
        graph = HighLevelGraph.from_collections(name, dsk, dependencies=())
        return db.Bag(graph, name, len(handles))
