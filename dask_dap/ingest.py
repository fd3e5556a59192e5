"""DAP -> Dask: any producer's ranks as one dask array.

``from_dap`` takes every rank's DAP dict (or an object with ``__distarray__``,
or a future of either), validates them together and builds a dask array:

* on block axes each rank's owned part (communication padding sliced off, a
  view) is a chunk: the graph holds the producer's buffers themselves, so no
  byte is copied (``da.from_array`` would copy);
* cyclic and unstructured axes are first laid out in rank order and then
  permuted into global order with ``take`` (for unstructured indices that
  appear on several ranks, the lowest rank's copy is used);
* futures stay where they are: only each rank's metadata travels, and the
  graph's tasks slice the buffers on the workers that hold them.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import dask
import dask.array as da
import numpy as np
from dask.highlevelgraph import HighLevelGraph

from .errors import DAPValidationError
from .layout import AxisLayout, layouts_from_ranks, take_along
from .protocol.dims import buffer_shape, normalize_dim, owned_slice
from .protocol.validate import VERSION, validate_distribution


def resolve_part(part: Any) -> Any:
    """A DAP dict from a dict or a ``__distarray__`` producer (futures pass through)."""
    if isinstance(part, Mapping):
        return part
    if hasattr(part, "__distarray__"):
        return part.__distarray__()
    return part


def upgrade_legacy(dap: Mapping[str, Any]) -> dict[str, Any]:
    """A DAP 0.9 dict (or a sloppy 0.10 one) in strict 0.10 form.

    ``'n'`` dimensions become undistributed block dimensions; lists become
    tuples and numpy integers Python ints.  Used by ``from_dap(strict=False)``.
    """
    shape = buffer_shape(dap["buffer"])
    dims = []
    for i, d in enumerate(dap.get("dim_data", ())):
        d = {k: (int(v) if isinstance(v, np.integer) else v) for k, v in dict(d).items()}
        if d.get("dist_type") == "n":
            d = {
                "dist_type": "b",
                "size": int(shape[i]),
                "proc_grid_size": 1,
                "proc_grid_rank": 0,
                "start": 0,
                "stop": int(shape[i]),
            }
        if "padding" in d:
            d["padding"] = tuple(int(v) for v in d["padding"])
        dims.append(d)
    return {"__version__": VERSION, "buffer": dap["buffer"], "dim_data": tuple(dims)}


def _remote_meta(dap: Any, strict: bool) -> dict[str, Any]:
    """Run on the worker holding a DAP dict: what the client needs, without the buffer."""
    dap = resolve_part(dap)
    if not strict:
        dap = upgrade_legacy(dap)
    arr = np.asarray(memoryview(dap["buffer"]))
    return {
        "__version__": dap["__version__"],
        "dim_data": dap["dim_data"],
        "shape": arr.shape,
        "dtype": arr.dtype.str,
    }


def _stub(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A DAP dict whose buffer has the right shape and dtype but no memory (for validation)."""
    shape = tuple(meta["shape"])
    buf = np.lib.stride_tricks.as_strided(
        np.zeros(1, dtype=meta["dtype"]), shape=shape, strides=(0,) * len(shape), writeable=False
    )
    return {"__version__": meta["__version__"], "buffer": buf, "dim_data": meta["dim_data"]}


def _owned(buffer: Any, slices: tuple[slice, ...]) -> np.ndarray:
    return np.asarray(memoryview(buffer) if not isinstance(buffer, np.ndarray) else buffer)[slices]


def _buffer_of(dap: Any) -> Any:
    return resolve_part(dap)["buffer"]


def from_dap(parts: Sequence[Any], *, strict: bool = True, name: str | None = None) -> da.Array:
    """A dask array from every rank of a DAP distribution (any order).

    Parameters
    ----------
    parts
        One entry per rank: DAP dicts, objects with ``__distarray__()``, or
        ``distributed`` futures resolving to either.
    strict
        Reject legacy (0.9) and sloppy dicts (lists for tuples, numpy ints);
        with ``strict=False`` they are converted first.

    Raises
    ------
    DAPValidationError
        When the ranks do not form a valid DAP 0.10 distribution.
    """
    if isinstance(parts, (Mapping, str, bytes)) or hasattr(parts, "__distarray__"):
        raise TypeError(
            f"from_dap takes a list with one entry per rank, got a single "
            f"{type(parts).__name__} (for one rank, pass [it])"
        )
    parts = [resolve_part(p) for p in parts]
    if not parts:
        raise DAPValidationError("no DAP parts given")
    remote = [not isinstance(p, Mapping) for p in parts]
    if any(remote):
        from distributed import get_client

        client = get_client()
        futs = [
            client.submit(_remote_meta, p, strict, pure=False) if r else None
            for p, r in zip(parts, remote)
        ]
        metas = client.gather([f for f in futs if f is not None])
        it = iter(metas)
        locals_ = [
            _stub(next(it)) if r else (p if strict else upgrade_legacy(p))
            for p, r in zip(parts, remote)
        ]
    else:
        locals_ = [p if strict else upgrade_legacy(p) for p in parts]
    validate_distribution(locals_)

    shapes = [buffer_shape(d["buffer"]) for d in locals_]
    dims = [
        tuple(normalize_dim(dd, shapes[p][i]) for i, dd in enumerate(d["dim_data"]))
        for p, d in enumerate(locals_)
    ]
    ndim = len(dims[0])
    dtype = np.asarray(memoryview(locals_[0]["buffer"])).dtype
    by_coords = {
        tuple(dd[i]["proc_grid_rank"] for i in range(ndim)): p for p, dd in enumerate(dims)
    }
    grid = tuple(dims[0][i]["proc_grid_size"] for i in range(ndim))
    layouts = layouts_from_ranks({c: dims[p] for c, p in by_coords.items()}, grid)

    chunks = tuple(lay.owned for lay in layouts)
    blocks = {}
    for coords, p in by_coords.items():
        slices = tuple(owned_slice(dims[p][i]) for i in range(ndim))
        if remote[p]:
            shape = tuple(chunks[i][c] for i, c in enumerate(coords))
            task = dask.delayed(_owned)(dask.delayed(_buffer_of)(parts[p]), slices)
            blocks[coords] = da.from_delayed(task, shape, dtype=dtype)
        else:
            blocks[coords] = _owned(locals_[p]["buffer"], slices)
    if any(remote):
        x = assemble(blocks, grid)
    else:
        # The graph holds the producer's buffers (views of them): nothing is copied.
        name = name or f"from-dap-{uuid.uuid4().hex}"
        dsk: dict[Any, Any] = {(name, *coords): b for coords, b in blocks.items()}
        graph = HighLevelGraph.from_collections(name, dsk, dependencies=[])
        x = da.Array(graph, name, chunks, dtype=dtype, meta=np.empty((0,) * ndim, dtype=dtype))
    return to_global_order(x, layouts)


def assemble(blocks: dict[tuple[int, ...], Any], grid: tuple[int, ...]) -> da.Array:
    """One dask array from per-coordinate dask blocks (C-order grid)."""
    return da.block(_nest(blocks, grid)) if grid else blocks[()]


def _nest(
    blocks: dict[tuple[int, ...], Any], grid: tuple[int, ...], prefix: tuple[int, ...] = ()
) -> Any:
    """Blocks as nested lists in C order (what ``da.block`` takes)."""
    if len(prefix) == len(grid):
        return blocks[prefix]
    return [_nest(blocks, grid, prefix + (g,)) for g in range(grid[len(prefix)])]


def to_global_order(x: da.Array, layouts: list[AxisLayout]) -> da.Array:
    """Permute cyclic and unstructured axes from rank order into global order."""
    for i, lay in enumerate(layouts):
        if lay.order is None:
            continue
        fast = _cyclic_by_reshape(x, lay, i)
        if fast is not None:
            x = fast
            continue
        _, first = np.unique(lay.order, return_index=True)  # lowest rank's copy of each index
        if np.array_equal(first, np.arange(len(first))):
            continue  # already in global order (e.g. one rank)
        x = take_along(x, first, i)
    return x


def _cyclic_by_reshape(x: da.Array, lay: AxisLayout, axis: int) -> da.Array | None:
    """The cheap path for a cyclic axis whose ranks all own ``nb`` whole blocks.

    When ``size % (P * block_size) == 0`` rank order is ``(P, nb, bs)`` and global
    order is ``(nb, P, bs)``: a reshape and a transpose, no gather by index.
    """
    d0 = lay.dims[0]
    procs, size = lay.procs, d0["size"]
    if d0["dist_type"] != "c" or procs < 2 or size == 0:
        return None
    bs = d0.get("block_size", 1)
    if size % (procs * bs):
        return None
    nb = size // (procs * bs)
    pre, post = x.shape[:axis], x.shape[axis + 1 :]
    empty = {
        i: tuple(c for c in cs if c) or (0,)
        for i, cs in enumerate(x.chunks)
        if i != axis and 0 in cs and len(cs) > 1
    }
    if empty:  # dask's reshape cannot carry empty blocks along
        x = x.rechunk(empty)
    if x.chunks[axis] != (nb * bs,) * procs:
        x = x.rechunk({axis: (nb * bs,) * procs})
    split = x.reshape(pre + (procs, nb, bs) + post)
    swapped = da.moveaxis(split, axis, axis + 1)  # (P, nb, bs) -> (nb, P, bs)
    return swapped.reshape(pre + (size,) + post)
