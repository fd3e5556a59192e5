"""Distributed arrays resident in a DDict: each rank's DAP section kept beside the data.

The split follows the DAPHNE project's distributed runtime: the
coordinator (this process) distributes or broadcasts, asks the workers to
compute on their local sections, and collects; the workers only ever see
their own section, and what is already in place is never sent again.

* :func:`to_ddict` stores every block as one DAP dict, **in the manager of the
  worker that already holds the block**: the storing task depends only on its
  block, so it runs there, and the section key carries its manager id as its
  hash (``dask_ddict``'s custom placement), so the put is an in-process call.
  The array's metadata (shape, dtype, every rank's ``dim_data`` and manager)
  is broadcast to every manager (``bput``), so any process reads it from its
  nearest manager.
* :meth:`DDictArray.map_blocks` runs a function on each section on the worker
  hosting its manager and stores the result beside it, under a new name.
* :meth:`DDictArray.to_dask` reads sections with tasks pinned to those
  workers: a read is an in-process call there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import dask
import dask.array as da
import markupsafe
import numpy as np

from .export import _blocks, _make_dap, buffers_array, plan, rank_dim_data
from .ingest import assemble, to_global_order
from .layout import AxisLayout, layouts_from_ranks
from .protocol.dims import owned_slice
from .protocol.validate import VERSION

_META = "dask_dap.array"


@dataclass(frozen=True)
class SectionKey:
    """The DDict key of one rank's section; its hash is the manager that holds it."""

    array: str
    rank: int
    manager: int
    #: An int is hashed alike in every process: dask_ddict's hash-seed check need not warn.
    ddict_stable_hash: ClassVar[bool] = True

    def __hash__(self) -> int:  # dask_ddict places user-hashed keys on hash(k) % n
        return self.manager


def _meta_key(name: str) -> tuple[str, str]:
    return (_META, name)


def _choose_manager(ddict: Any, rank: int) -> int:
    """The manager in this worker process, else one on this host, else by rank."""
    mid = ddict.local_manager
    return mid if mid is not None else rank % ddict.num_managers


def _store_section(
    block: Any, ddict: Any, name: str, rank: int, dim_data: tuple[dict[str, Any], ...]
) -> int:
    """Runs where ``block`` is: put its DAP dict into the nearest manager."""
    mid = _choose_manager(ddict, rank)
    ddict[SectionKey(name, rank, mid)] = _make_dap(block, dim_data)
    return mid


def _load_owned(ddict: Any, key: SectionKey, slices: tuple[slice, ...]) -> np.ndarray:
    return np.asarray(ddict[key]["buffer"])[slices]


def _map_section(
    ddict: Any,
    fn: Callable[[np.ndarray], Any],
    src: SectionKey,
    dst: str,
    slices: tuple[slice, ...],
    dims: tuple[dict[str, Any], ...],
) -> str:
    """Runs on the worker hosting ``src``'s manager: compute and store beside it."""
    section = ddict[src]
    owned = np.asarray(section["buffer"])[slices]
    out = np.asarray(fn(owned))
    if out.shape != owned.shape:
        raise ValueError(
            f"map_blocks: fn changed the shape of rank {src.rank}'s section from {owned.shape} "
            f"to {out.shape}; DDictArray.map_blocks keeps the distribution"
        )
    ddict[SectionKey(dst, src.rank, src.manager)] = {
        "__version__": VERSION,
        "buffer": out,
        "dim_data": dims,
    }
    return out.dtype.str


def _unpadded(dim: dict[str, Any]) -> dict[str, Any]:
    """A block dimension dict of the owned cells only (what map_blocks results hold)."""
    if dim["dist_type"] != "b" or "padding" not in dim:
        return dict(dim)
    s = owned_slice(dim)
    out = {k: v for k, v in dim.items() if k != "padding"}
    out["start"], out["stop"] = dim["start"] + s.start, dim["start"] + s.stop
    return out


class DDictArray:
    """A distributed array whose sections live in a DDict (one DAP dict per rank).

    Get one from :func:`to_ddict` or :meth:`DDictArray.load`.
    """

    def __init__(self, ddict: Any, name: str, meta: dict[str, Any]) -> None:
        self.ddict = ddict
        self.name = name
        self._meta = meta

    def __repr__(self) -> str:
        return (
            f"<DDictArray {self.name!r} shape={self.shape} dtype={self.dtype} "
            f"ranks={len(self._meta['managers'])}>"
        )

    def _repr_html_(self) -> str:
        """Jupyter's view: shape, dtype, distribution, where each rank lives, and the DDict."""
        from dask_ddict.display import render

        axes = [
            ", ".join(
                f"{k}={v}" for k, v in d.items() if k in ("dist_type", "size", "proc_grid_size")
            )
            for d in (self._meta["dim_data"][0] if self._meta["dim_data"] else ())
        ]
        ranks = [(r, m, self.ddict.manager_workers[m]) for r, m in enumerate(self.managers)]
        return render(
            "ddict_array.html.j2",
            package="dask_dap",
            a=self,
            axes=axes,
            ranks=ranks,
            nbytes=int(np.prod(self.shape)) * self.dtype.itemsize,
            ddict_html=markupsafe.Markup(self.ddict._repr_html_()),
        )

    @classmethod
    def load(cls, ddict: Any, name: str) -> DDictArray:
        """Attach to an array stored earlier (metadata from the nearest manager)."""
        try:
            meta = ddict.bget(_meta_key(name))
        except KeyError:
            raise KeyError(f"no DDictArray named {name!r} in {ddict!r}") from None
        return cls(ddict, name, meta)

    # -- metadata --------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._meta["shape"])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._meta["dtype"])

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(self._meta["grid"])

    @property
    def dim_data(self) -> list[tuple[dict[str, Any], ...]]:
        """Every rank's ``dim_data``, in rank order."""
        return [tuple(dict(d) for d in dd) for dd in self._meta["dim_data"]]

    @property
    def managers(self) -> list[int]:
        """The manager holding each rank's section."""
        return list(self._meta["managers"])

    def _layouts(self) -> list[AxisLayout]:
        coords = list(np.ndindex(*self.grid)) if self.grid else [()]
        return layouts_from_ranks(dict(zip(coords, self._meta["dim_data"])), self.grid)

    @property
    def chunks(self) -> tuple[tuple[int, ...], ...]:
        """Owned cells per rank along each axis (the chunks of :meth:`to_dask` before reordering)."""
        return tuple(lay.owned for lay in self._layouts())

    def _key(self, rank: int) -> SectionKey:
        return SectionKey(self.name, rank, self._meta["managers"][rank])

    def _worker(self, rank: int) -> str:
        return self.ddict.manager_workers[self._meta["managers"][rank]]

    # -- data ------------------------------------------------------------------------

    def sections(self) -> list[dict[str, Any]]:
        """Every rank's DAP dict, in rank order (read through the DDict)."""
        return [self.ddict[self._key(r)] for r in range(len(self._meta["managers"]))]

    def to_dask(self) -> da.Array:
        """A dask array whose tasks read each section on the worker that hosts it."""
        coords = list(np.ndindex(*self.grid)) if self.grid else [()]
        layouts = self._layouts()
        blocks = {}
        for rank, c in enumerate(coords):
            slices = tuple(owned_slice(d) for d in self._meta["dim_data"][rank])
            shape = tuple(layouts[i].owned[g] for i, g in enumerate(c))
            with dask.annotate(workers=[self._worker(rank)], allow_other_workers=True):
                task = dask.delayed(_load_owned, pure=True)(
                    self.ddict,
                    self._key(rank),
                    slices,
                    dask_key_name=f"ddict-section-{self.name}-{rank}",
                )
            blocks[c] = da.from_delayed(task, shape, dtype=self.dtype)
        return to_global_order(assemble(blocks, self.grid), layouts)

    def map_blocks(
        self, fn: Callable[[np.ndarray], Any], name: str | None = None, client: Any = None
    ) -> DDictArray:
        """Apply ``fn`` to every section where it lives; store each result beside it.

        ``fn`` takes a rank's owned cells (padding removed) and returns an
        array of the same shape.  Returns the new array (name ``name``,
        default ``"<name>-<fn name>"``); nothing but the function and the
        results' dtypes crosses the network.
        """
        if client is None:
            from distributed import get_client

            client = get_client()
        new = name or f"{self.name}-{getattr(fn, '__name__', 'map')}"
        tasks = []
        for rank in range(len(self._meta["managers"])):
            dims = self._meta["dim_data"][rank]
            slices = tuple(owned_slice(d) for d in dims)
            out_dims = tuple(_unpadded(d) for d in dims)
            tasks.append(
                client.submit(
                    _map_section,
                    self.ddict,
                    fn,
                    self._key(rank),
                    new,
                    slices,
                    out_dims,
                    workers=[self._worker(rank)],
                    allow_other_workers=True,
                    pure=False,
                )
            )
        dtypes = client.gather(tasks)
        meta = dict(self._meta)
        meta["dim_data"] = [tuple(_unpadded(d) for d in dd) for dd in self._meta["dim_data"]]
        meta["dtype"] = (
            np.result_type(*[np.dtype(t) for t in dtypes]).str if dtypes else meta["dtype"]
        )
        self.ddict.bput(_meta_key(new), meta)
        return DDictArray(self.ddict, new, meta)

    def delete(self) -> None:
        """Remove the sections and the metadata from the DDict."""
        for rank in range(len(self._meta["managers"])):
            self.ddict.pop(self._key(rank), None)
        for m in range(self.ddict.num_managers):
            self.ddict.manager(m).pop(_meta_key(self.name), None)


def to_ddict(
    x: da.Array, ddict: Any, name: str, client: Any = None, **dap_options: Any
) -> DDictArray:
    """Store every block of ``x`` as a DAP section in the manager beside it.

    ``dap_options`` (``comm_padding``, ``dist``, ...) are :func:`~dask_dap.to_dap`'s.
    Shows Dask's progress bar when ``ddict.progress`` says so.
    """
    from dask_ddict.progress import compute

    if client is None:
        from distributed import get_client

        client = get_client()
    layouts = plan(x, **dap_options)
    y = buffers_array(x, layouts)
    coords, blocks = _blocks(y)
    store = dask.delayed(_store_section, pure=False)
    tasks = [
        store(b, ddict, name, r, rank_dim_data(layouts, c))
        for r, (c, b) in enumerate(zip(coords, blocks))
    ]
    managers = [int(m) for m in compute(tasks, client)]
    meta = {
        "shape": [int(s) for s in x.shape],
        "dtype": x.dtype.str,
        "grid": [lay.procs for lay in layouts],
        "dim_data": [rank_dim_data(layouts, c) for c in coords],
        "managers": managers,
    }
    ddict.bput(_meta_key(name), meta)
    return DDictArray(ddict, name, meta)


def from_ddict(ddict: Any, name: str) -> da.Array:
    """The dask array of a :class:`DDictArray` stored under ``name``."""
    return DDictArray.load(ddict, name).to_dask()
