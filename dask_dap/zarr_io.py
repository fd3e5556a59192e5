"""Distributed arrays in zarr (3.1): the data as a plain zarr array, the DAP layout as attributes.

The array is stored in global order, so ``zarr.open_array`` reads it with no
knowledge of DAP.  The ``"dap"`` attribute keeps the distribution: each rank's
``dim_data`` (indices as lists) in rank order, and the dask chunks.  Zarr 3.1
has one chunk shape per array; when the dask chunks are irregular the data
is written with the largest chunk per axis (blocks are re-cut on write, never
two writers on one zarr chunk) and ``from_zarr`` reads it back with the
original chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dask.array as da
import numpy as np
import zarr

from .errors import DAPValidationError
from .export import plan, rank_dim_data
from .ingest import from_dap, resolve_part
from .protocol.validate import VERSION

_ATTR = "dap"


def _jsonable(dim: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in dim.items():
        if isinstance(v, np.ndarray):
            v = [int(i) for i in v]
        elif isinstance(v, tuple):
            v = list(v)
        out[k] = v
    return out


def _from_json(dim: dict[str, Any]) -> dict[str, Any]:
    out = dict(dim)
    if "padding" in out:
        out["padding"] = tuple(out["padding"])
    if "indices" in out:
        out["indices"] = np.asarray(out["indices"], dtype=np.int64)
    return out


def to_zarr(
    x_or_parts: da.Array | Sequence[Any],
    store: Any,
    *,
    path: str | None = None,
    overwrite: bool = False,
    compute: bool = True,
    **dap_options: Any,
) -> Any:
    """Write a dask array (or DAP parts) and its DAP layout to a zarr store.

    Parameters
    ----------
    x_or_parts
        A dask array, or the DAP parts (one dict per rank) of any producer.
    store, path
        The zarr store (a path, URL or zarr store object) and the array's path in it.
    overwrite
        Replace an existing array at ``path``.
    compute
        Write now and return the ``zarr.Array`` (with Dask's progress bar when
        ``ddict.progress`` says so).  ``False``: create the array and its layout
        attribute now, and return the dask collection that writes the data when
        computed, as ``dask.array.to_zarr(..., compute=False)`` does.
    **dap_options
        ``comm_padding``, ``dist``, ...: the layout to record for a dask array,
        as :func:`~dask_dap.to_dap` takes them.
    """
    if not isinstance(compute, bool):
        raise TypeError(f"compute must be True or False, got {compute!r:.80}")
    if isinstance(x_or_parts, da.Array):
        x = x_or_parts
        layouts = plan(x, **dap_options)
        coords = list(np.ndindex(*[lay.procs for lay in layouts]))
        dim_datas = [rank_dim_data(layouts, c) for c in coords]
    else:
        parts = list(x_or_parts)
        if dap_options:
            raise TypeError("layout options apply to dask arrays; DAP parts carry their own")
        x = from_dap(parts)
        dicts = [resolve_part(p) for p in parts]
        order = sorted(
            range(len(dicts)),
            key=lambda i: tuple(d.get("proc_grid_rank", 0) for d in dicts[i]["dim_data"]),
        )
        dim_datas = [tuple(dict(d) for d in dicts[i]["dim_data"]) for i in order]
    if any(np.isnan(c) for axis in x.chunks for c in axis):
        raise ValueError("unknown chunk sizes: call x.compute_chunk_sizes() first")
    zchunks = tuple(max(max(c), 1) for c in x.chunks) if x.ndim else ()
    regular = all(all(n == zc for n in c[:-1]) and c[-1] <= zc for c, zc in zip(x.chunks, zchunks))
    y = x if regular else x.rechunk(zchunks)
    arr = zarr.create_array(
        store,
        name=path,
        shape=x.shape,
        dtype=x.dtype,
        chunks=zchunks if zchunks else "auto",
        overwrite=overwrite,
        fill_value=0,
    )
    arr.attrs[_ATTR] = {
        "version": VERSION,
        "chunks": [list(map(int, c)) for c in x.chunks],
        "dim_data": [[_jsonable(d) for d in dd] for dd in dim_datas],
    }
    target: Any = arr  # a zarr array takes dask's block writes (``__setitem__``)
    stored = da.store(y, target, lock=False, compute=False)
    if not compute:
        return stored
    from dask_ddict.progress import compute as compute_with_progress

    compute_with_progress(stored)
    return arr


def _open(store: Any, path: str | None) -> zarr.Array:
    node = zarr.open(store, mode="r", path=path) if path else zarr.open(store, mode="r")
    if not isinstance(node, zarr.Array):
        raise ValueError(f"{store!r} at {path!r} is a group, not an array")
    if _ATTR not in node.attrs:
        raise DAPValidationError(f"{store!r} at {path!r} has no DAP layout (attribute {_ATTR!r})")
    return node


def read_dap_layout(store: Any, path: str | None = None) -> list[tuple[dict[str, Any], ...]]:
    """The stored layout: each rank's ``dim_data`` tuple, in rank order."""
    meta: Any = _open(store, path).attrs[_ATTR]  # the JSON that to_zarr wrote
    return [tuple(_from_json(d) for d in dd) for dd in meta["dim_data"]]


def from_zarr(store: Any, path: str | None = None) -> da.Array:
    """The array written by :func:`to_zarr`, with the chunks it was written from."""
    arr = _open(store, path)
    meta: Any = arr.attrs[_ATTR]
    chunks = tuple(tuple(c) for c in meta["chunks"])
    return da.from_zarr(arr, chunks=chunks if chunks else ())
