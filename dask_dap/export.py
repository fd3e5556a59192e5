"""Dask -> DAP: every block of a dask array as one rank's DAP dict.

One dask block is one DAP rank; the process grid is ``x.numblocks`` and ranks
are row-major (C order) over block coordinates, exactly MPI's Cartesian
convention.  The export first builds a dask array whose blocks *are* the DAP
buffers:

* block axes keep the array's chunks; communication padding is
  ``da.overlap.overlap(..., boundary='none', allow_rechunk=False)`` (internal
  edges grow by the halo, outer edges do not, which is DAP 0.10's layout), and a
  halo wider than a neighbouring block is an error, never a silent rechunk;
* cyclic and unstructured axes are gathered into rank order (``take``) and
  chunked by what each rank owns.

:func:`to_dap` computes those blocks here; :func:`to_dap_futures` builds each
rank's dict on the worker that holds its block and leaves it there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dask
import dask.array as da
import numpy as np

from .layout import (
    AxisLayout,
    _check_width,
    _per_axis,
    axis_from_spec,
    is_block_spec,
    on_block_axes,
    take_along,
)
from .protocol.validate import VERSION


def _check_exportable(x: Any) -> da.Array:
    if not isinstance(x, da.Array):
        raise TypeError(f"to_dap needs a dask array, got {type(x).__name__} (use da.asarray)")
    if any(np.isnan(c) for axis in x.chunks for c in axis):
        raise ValueError(
            "the array has unknown chunk sizes (NaN), so its blocks cannot be described: "
            "call x.compute_chunk_sizes() first"
        )
    if x.dtype == object:
        raise TypeError("object arrays have no buffer to share: convert to a numeric dtype first")
    meta = getattr(x, "_meta", None)
    if meta is not None and type(meta) is not np.ndarray and not isinstance(meta, np.ndarray):
        raise TypeError(
            f"the blocks are {type(meta).__module__}.{type(meta).__name__}, which do not "
            "expose the buffer protocol: convert them, e.g. x.map_blocks(np.asarray)"
        )
    return x


def plan(
    x: da.Array,
    *,
    comm_padding: int | Sequence[int] = 0,
    boundary_padding: int | Sequence[int] = 0,
    periodic: bool | Sequence[bool] = False,
    dist: Sequence[Any] | None = None,
) -> list[AxisLayout]:
    """The layout of every axis of the export (validated, nothing computed)."""
    x = _check_exportable(x)
    nd = x.ndim
    specs = _per_axis(dist, nd, "dist")  # one entry per axis, or one for every axis
    block = [is_block_spec(s) for s in specs]
    widths = {
        name: [_check_width(v, name, i) for i, v in enumerate(_per_axis(value, nd, name))]
        for name, value in (("comm_padding", comm_padding), ("boundary_padding", boundary_padding))
    }
    # a scalar width or periodic flag is for every block axis (DAP pads 'b' axes only)
    comm = on_block_axes(comm_padding, widths["comm_padding"], block, "comm_padding", 0)
    bound = on_block_axes(
        boundary_padding, widths["boundary_padding"], block, "boundary_padding", 0
    )
    flags = [bool(v) for v in _per_axis(periodic, nd, "periodic")]
    per = on_block_axes(periodic, flags, block, "periodic", False)
    return [
        axis_from_spec(
            specs[i], x.chunks[i], comm=comm[i], boundary=bound[i], periodic=bool(per[i]), axis=i
        )
        for i in range(nd)
    ]


def buffers_array(x: da.Array, layouts: list[AxisLayout]) -> da.Array:
    """A dask array whose blocks are exactly the ranks' DAP buffers."""
    y = x
    for i, lay in enumerate(layouts):
        if lay.order is not None:
            y = take_along(y, lay.order, i)
            y = y.rechunk({i: lay.owned})
    depth = {i: lay.comm for i, lay in enumerate(layouts) if lay.comm and lay.procs > 1}
    if depth:
        y = da.overlap.overlap(
            y, depth=depth, boundary={i: "none" for i in depth}, allow_rechunk=False
        )
    return y


def rank_dim_data(layouts: list[AxisLayout], coords: tuple[int, ...]) -> tuple[dict[str, Any], ...]:
    """``dim_data`` of the rank at grid ``coords`` (fresh dicts, Python ints, tuples)."""
    return tuple(dict(layouts[i].dims[c]) for i, c in enumerate(coords))


def _make_dap(block: Any, dim_data: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    buf = np.asarray(block)
    if not (buf.flags.c_contiguous or buf.flags.f_contiguous):
        buf = np.ascontiguousarray(buf)
    return {"__version__": VERSION, "buffer": buf, "dim_data": dim_data}


def _blocks(y: da.Array) -> tuple[list[tuple[int, ...]], list[Any]]:
    delayed = y.to_delayed()
    coords = [tuple(int(c) for c in idx) for idx in np.ndindex(*delayed.shape)]
    return coords, [delayed[c] for c in coords]


def to_dap(
    x: da.Array,
    *,
    comm_padding: int | Sequence[int] = 0,
    boundary_padding: int | Sequence[int] = 0,
    periodic: bool | Sequence[bool] = False,
    dist: Sequence[Any] | None = None,
) -> list[dict[str, Any]]:
    """One DAP dict per block, in rank (row-major) order, with the buffers computed here.

    Parameters
    ----------
    x
        The dask array (known chunk sizes, numeric dtype, numpy blocks).
    comm_padding, boundary_padding
        Halo width between blocks and boundary width at the array's edges, an
        int or one per axis.  Buffers include the neighbours' halo cells.
        DAP pads block axes only: an int applies to every block axis (those
        ``dist`` leaves ``None``/``"b"``), while a per-axis sequence must
        give 0 for cyclic and unstructured axes.
    periodic
        Marks block axes as periodic (metadata); a bool marks every block axis.
    dist
        Per axis: ``None``/``"b"`` (the array's blocks), ``"c"`` or
        ``{"dist_type": "c", "block_size": k, "proc_grid_size": P}``, or
        ``{"dist_type": "u", "indices": [...]}``; the export redistributes.

    Examples
    --------
    >>> x = da.arange(32.0, chunks=16).reshape(4, 8).rechunk((2, 4))   # doctest: +SKIP
    >>> parts = to_dap(x)                       # 4 ranks on a 2 x 2 grid
    >>> parts[1]["dim_data"][1]["start"]        # rank (0, 1): columns 4..8
    4
    >>> parts = to_dap(x, comm_padding=1, dist=[None, "c"])   # halo on axis 0 only
    """
    layouts = plan(
        x,
        comm_padding=comm_padding,
        boundary_padding=boundary_padding,
        periodic=periodic,
        dist=dist,
    )
    y = buffers_array(x, layouts)
    coords, blocks = _blocks(y)
    computed = dask.compute(*blocks) if blocks else ()
    return [_make_dap(b, rank_dim_data(layouts, c)) for c, b in zip(coords, computed)]


def to_dap_futures(
    x: da.Array,
    client: Any = None,
    *,
    comm_padding: int | Sequence[int] = 0,
    boundary_padding: int | Sequence[int] = 0,
    periodic: bool | Sequence[bool] = False,
    dist: Sequence[Any] | None = None,
) -> list[Any]:
    """Like :func:`to_dap`, but each rank's dict is built and kept on a worker.

    Each dict is made by a task that depends only on its block, so it runs on
    the worker that holds the block (persisted blocks are neither recomputed
    nor moved).  Returns futures in rank order.
    """
    if client is None:
        from distributed import get_client

        client = get_client()
    layouts = plan(
        x,
        comm_padding=comm_padding,
        boundary_padding=boundary_padding,
        periodic=periodic,
        dist=dist,
    )
    y = buffers_array(x, layouts)
    coords, blocks = _blocks(y)
    make = dask.delayed(_make_dap, pure=True)
    tasks = [make(b, rank_dim_data(layouts, c)) for c, b in zip(coords, blocks)]
    return list(client.compute(tasks))
