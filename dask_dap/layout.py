"""How a dask array's blocks map onto DAP ranks: one axis at a time.

A dask array is a tensor product of 1-D distributions (its per-axis
``chunks``), and so is a DAP distribution ("identical dim_data along an
axis").  :class:`AxisLayout` is the 1-D part: for one axis, the dimension dict
of every grid rank and, when the distribution is not in global order (cyclic,
unstructured), the permutation between global order and rank order.  Pure
data: unit-tested without dask.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import DAPValidationError
from .protocol.dims import global_indices, num_owned_indices


@dataclass(frozen=True)
class AxisLayout:
    """One axis of a distribution.

    Attributes
    ----------
    dims
        The dimension dict of each grid rank along the axis (rank order).
    owned
        Indices each grid rank owns (its chunk length without padding).
    comm
        Communication padding width (block axes only).
    order
        Global index at each position of the rank-order concatenation, or
        ``None`` when that is already global order (block axes).
    """

    dims: tuple[dict[str, Any], ...]
    owned: tuple[int, ...]
    comm: int = 0
    order: np.ndarray | None = None

    @property
    def kind(self) -> str:
        return str(self.dims[0]["dist_type"])

    @property
    def procs(self) -> int:
        return len(self.dims)


def _per_axis(value: Any, ndim: int, name: str) -> tuple[Any, ...]:
    if isinstance(value, (list, tuple)):
        if len(value) != ndim:
            raise ValueError(f"{name} has {len(value)} entries for a {ndim}-d array")
        return tuple(value)
    return (value,) * ndim


def _check_width(v: Any, name: str, axis: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"{name} for axis {axis} must be an int >= 0, got {v!r}")
    return int(v)


def is_block_spec(spec: Any) -> bool:
    """Whether one entry of ``to_dap(dist=...)`` keeps the axis a block axis."""
    if spec is None or (isinstance(spec, str) and spec == "b"):
        return True
    return isinstance(spec, Mapping) and spec.get("dist_type") == "b"


def on_block_axes(
    value: Any, per_axis: Sequence[Any], block: Sequence[bool], name: str, off: Any
) -> tuple[Any, ...]:
    """``per_axis`` with a scalar ``value`` kept on the block axes only.

    DAP 0.10 has ``padding`` and ``periodic`` on block (``'b'``) dimensions
    only, so a single ``comm_padding=1`` next to ``dist=[None, "c"]`` means
    "on every block axis": the cyclic axis gets none (``off``) instead of the
    export being refused.  A per-axis sequence is taken as written, so a
    nonzero entry for a cyclic or unstructured axis is still an error (in
    :func:`axis_from_spec`), and so is a scalar when no axis is a block axis:
    the padding asked for would be silently dropped everywhere.
    """
    if isinstance(value, (list, tuple)) or not any(per_axis):
        return tuple(per_axis)
    if block and not any(block):
        raise ValueError(
            f"padding and periodic apply to block axes; {name}={value!r} is asked for but "
            "no axis of the export is a block axis (dist has no None or 'b' entry)"
        )
    return tuple(v if b else off for v, b in zip(per_axis, block))


def block_axis(
    chunks: Sequence[int],
    *,
    comm: int = 0,
    boundary: int = 0,
    periodic: bool = False,
    axis: int = 0,
) -> AxisLayout:
    """A block axis with these owned chunk lengths, padded as asked."""
    procs = len(chunks)
    size = int(sum(chunks))
    if procs > 1 and comm:
        for r, n in enumerate(chunks):
            if n < comm:
                raise ValueError(
                    f"comm_padding={comm} on axis {axis} is wider than block {r} "
                    f"({n} elements): a halo can only hold a neighbour's own cells. "
                    "Rechunk to blocks of at least that size first (no silent rechunking)"
                )
    if boundary:
        edges = [0, procs - 1]
        for r in set(edges):
            limit = chunks[r] if procs > 1 else size / 2
            if boundary > limit:
                raise ValueError(
                    f"boundary_padding={boundary} on axis {axis} is wider than the edge "
                    f"block {r} ({chunks[r]} elements)"
                )
    pad = bool(comm or boundary)
    dims = []
    offset = 0
    for r, n in enumerate(chunks):
        cl = comm if r > 0 else 0
        cr = comm if r < procs - 1 else 0
        d: dict[str, Any] = {
            "dist_type": "b",
            "size": size,
            "proc_grid_size": procs,
            "proc_grid_rank": r,
            "start": offset - cl,
            "stop": offset + int(n) + cr,
        }
        if pad:
            d["padding"] = (comm if r > 0 else boundary, comm if r < procs - 1 else boundary)
        if periodic:
            d["periodic"] = True
        dims.append(d)
        offset += int(n)
    return AxisLayout(tuple(dims), tuple(int(n) for n in chunks), comm)


def cyclic_axis(size: int, procs: int, block_size: int = 1) -> AxisLayout:
    """A cyclic (``block_size == 1``) or block-cyclic axis."""
    if procs < 1:
        raise ValueError(f"a cyclic axis needs proc_grid_size >= 1, got {procs}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    dims = tuple(
        {
            "dist_type": "c",
            "size": int(size),
            "proc_grid_size": int(procs),
            "proc_grid_rank": r,
            "start": r * int(block_size),
            "block_size": int(block_size),
        }
        for r in range(procs)
    )
    owned = tuple(num_owned_indices(d) for d in dims)
    order = np.concatenate([global_indices(d) for d in dims]) if size else np.empty(0, np.int64)
    return AxisLayout(dims, owned, 0, order)


def unstructured_axis(size: int, indices: Sequence[Any], one_to_one: bool = True) -> AxisLayout:
    """An unstructured axis: ``indices[r]`` are the global indices of grid rank ``r``."""
    arrays = [np.asarray(ix, dtype=np.int64).reshape(-1) for ix in indices]
    if not arrays:
        raise ValueError("an unstructured axis needs one index array per rank")
    allidx = np.concatenate(arrays)
    if len(allidx) and (allidx.min() < 0 or allidx.max() >= size):
        raise ValueError(f"unstructured indices must lie in [0, {size})")
    if len(np.unique(allidx)) != size:
        raise ValueError(f"unstructured indices must cover all {size} global indices")
    if one_to_one and len(allidx) != size:
        raise ValueError("one_to_one indices may not repeat a global index across ranks")
    for r, a in enumerate(arrays):
        if len(np.unique(a)) != len(a):
            raise ValueError(f"the indices of rank {r} repeat a global index")
    dims = tuple(
        {
            "dist_type": "u",
            "size": int(size),
            "proc_grid_size": len(arrays),
            "proc_grid_rank": r,
            "indices": a,
            "one_to_one": bool(one_to_one),
        }
        for r, a in enumerate(arrays)
    )
    return AxisLayout(dims, tuple(len(a) for a in arrays), 0, allidx)


def axis_from_spec(
    spec: Any, chunks: Sequence[int], *, comm: int, boundary: int, periodic: bool, axis: int
) -> AxisLayout:
    """The layout asked for by one entry of ``to_dap(dist=...)``.

    ``None`` or ``"b"``: the array's own blocks.  ``"c"`` or
    ``{"dist_type": "c", "block_size": k, "proc_grid_size": P}``: (block-)cyclic
    over ``P`` ranks (default: as many as the axis has blocks).
    ``{"dist_type": "u", "indices": [...]}``: unstructured, one index array per rank.
    """
    size = int(sum(chunks))
    if is_block_spec(spec):
        return block_axis(chunks, comm=comm, boundary=boundary, periodic=periodic, axis=axis)
    if comm or boundary or periodic:
        raise ValueError(
            f"padding and periodic apply to block axes; axis {axis} is asked to be {spec!r}"
        )
    if spec == "c":
        spec = {"dist_type": "c"}
    if spec == "u":
        raise ValueError(
            f"axis {axis}: 'u' needs the indices: {{'dist_type': 'u', 'indices': [...]}}"
        )
    if not isinstance(spec, Mapping) or spec.get("dist_type") not in ("c", "u"):
        raise ValueError(
            f"dist entry for axis {axis} must be None, 'b', 'c' or a dict with dist_type "
            f"'b', 'c' or 'u', got {spec!r}"
        )
    if spec["dist_type"] == "c":
        unknown = set(spec) - {"dist_type", "block_size", "proc_grid_size"}
        if unknown:
            raise ValueError(f"axis {axis}: unknown keys {sorted(unknown)} for a cyclic axis")
        return cyclic_axis(
            size, int(spec.get("proc_grid_size", len(chunks))), int(spec.get("block_size", 1))
        )
    unknown = set(spec) - {"dist_type", "indices", "one_to_one"}
    if unknown:
        raise ValueError(f"axis {axis}: unknown keys {sorted(unknown)} for an unstructured axis")
    if "indices" not in spec:
        raise ValueError(f"axis {axis}: an unstructured axis needs 'indices' (one array per rank)")
    return unstructured_axis(size, spec["indices"], bool(spec.get("one_to_one", True)))


def layouts_from_ranks(
    dim_data: Mapping[tuple[int, ...], Sequence[Mapping[str, Any]]], grid: Sequence[int]
) -> list[AxisLayout]:
    """Axis layouts of a distribution given each rank's ``dim_data`` by grid coordinates.

    Dimension dicts are identical along an axis, so axis ``i`` is read from the
    ranks at coordinates ``(0, .., g, .., 0)``.
    """
    columns = [
        [dim_data[tuple(g if a == i else 0 for a in range(len(grid)))][i] for g in range(procs)]
        for i, procs in enumerate(grid)
    ]
    return layouts_from_dims(columns)


def layouts_from_dims(dims_by_axis: Sequence[Sequence[Mapping[str, Any]]]) -> list[AxisLayout]:
    """Axis layouts of an imported distribution (one dim dict per grid rank per axis)."""
    out = []
    for i, column in enumerate(dims_by_axis):
        dims = tuple(dict(d) for d in column)
        owned = tuple(num_owned_indices(d) for d in dims)
        kind = dims[0]["dist_type"]
        if kind == "b":
            out.append(AxisLayout(dims, owned))
            continue
        order = np.concatenate([global_indices(d) for d in dims]) if dims else np.empty(0, np.int64)
        if len(order) and (order.min() < 0 or order.max() >= dims[0]["size"]):
            raise DAPValidationError("indices outside [0, size)", dim=i, key="indices")
        out.append(AxisLayout(dims, owned, 0, order))
    return out


def take_along(x: Any, positions: np.ndarray, axis: int) -> Any:
    """``da.take`` that tolerates empty chunks (dask's ``take`` fails on them)."""
    import dask.array as da

    chunks = x.chunks[axis]
    if 0 in chunks and len(chunks) > 1:
        kept = tuple(c for c in chunks if c)
        x = x.rechunk({axis: kept or (0,)})
    return da.take(x, positions, axis=axis)
