"""One dimension dictionary: defaults, owned counts and global indices.

A rank's dimension dict describes which global indices of one axis its buffer
holds.  The formulas follow the protocol text, not the reference
``utils.py``, whose block-cyclic count credits the trailing partial block to
rank 0 (it belongs to rank ``nblocks % P``; see ``docs/guide/dap.md``, Validation).

Ownership along a padded block axis: communication padding duplicates a
neighbour's cells and is not owned; boundary padding (the outer pads of the
first and last rank) is part of the global index space and is owned.
``periodic`` is metadata only (DAP 0.10 and its ``utils.py``: the outer pads
are boundary padding even on a periodic axis).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

_DEFAULTS: dict[str, dict[str, Any]] = {
    "b": {"padding": (0, 0), "periodic": False},
    "c": {"block_size": 1},
    "u": {"one_to_one": False},
}


def buffer_shape(buffer: Any) -> tuple[int, ...]:
    """The shape of anything with the buffer protocol (a 0-d buffer has shape ``()``)."""
    return tuple(memoryview(buffer).shape or ())


def normalize_dim(dim: Mapping[str, Any], shape_i: int) -> dict[str, Any]:
    """A complete dimension dict: the ``{}`` alias expanded and the optional keys filled.

    ``shape_i`` is the buffer's length along this axis (what ``{}`` refers to).
    Sequences become tuples (``padding``) and ``indices`` a numpy array; values
    are not otherwise checked (see :func:`~dask_dap.validate`).
    """
    if len(dim) == 0:
        return {
            "dist_type": "b",
            "size": shape_i,
            "proc_grid_size": 1,
            "proc_grid_rank": 0,
            "start": 0,
            "stop": shape_i,
            "padding": (0, 0),
            "periodic": False,
        }
    out = dict(dim)
    for k, v in _DEFAULTS.get(str(out.get("dist_type")), {}).items():
        out.setdefault(k, v)
    if "padding" in out and not isinstance(out["padding"], tuple):
        out["padding"] = tuple(out["padding"])
    if "indices" in out and not isinstance(out["indices"], np.ndarray):
        out["indices"] = np.asarray(memoryview(out["indices"]))
    return out


def _padding(dim: Mapping[str, Any]) -> tuple[int, int]:
    pad = dim.get("padding", (0, 0))
    return int(pad[0]), int(pad[1])


def owned_slice(dim: Mapping[str, Any]) -> slice:
    """The part of this rank's buffer that it owns (communication padding removed)."""
    if dim.get("dist_type", "b") != "b" or len(dim) == 0:
        return slice(0, num_owned_indices(dim) if len(dim) else None)
    lo, hi = _padding(dim)
    rank, procs = dim["proc_grid_rank"], dim["proc_grid_size"]
    cl = lo if rank > 0 else 0
    cr = hi if rank < procs - 1 else 0
    return slice(cl, dim["stop"] - dim["start"] - cr)


def num_owned_indices(dim: Mapping[str, Any]) -> int:
    """How many global indices of this axis the rank owns (padding excluded).

    Summed over the ranks of an axis this is the axis ``size``.
    """
    if len(dim) == 0:
        raise ValueError("the {} alias needs the buffer shape: normalize_dim(dim, shape_i) first")
    kind = dim["dist_type"]
    if kind == "b":
        s = owned_slice(dim)
        return max(0, s.stop - s.start)
    if kind == "c":
        size, procs, rank = dim["size"], dim["proc_grid_size"], dim["proc_grid_rank"]
        bs = dim.get("block_size", 1)
        nblocks, partial = divmod(size, bs)
        full = (nblocks - 1 - rank) // procs + 1  # whole blocks dealt to this rank
        return full * bs + (partial if rank == nblocks % procs else 0)
    if kind == "u":
        return len(np.asarray(memoryview(dim["indices"])).reshape(-1))
    raise ValueError(f"unknown dist_type {kind!r}")


def global_indices(dim: Mapping[str, Any]) -> np.ndarray:
    """The global indices this rank owns along the axis, in local-buffer order."""
    if len(dim) == 0:
        raise ValueError("the {} alias needs the buffer shape: normalize_dim(dim, shape_i) first")
    kind = dim["dist_type"]
    if kind == "b":
        s = owned_slice(dim)
        return np.arange(dim["start"] + s.start, dim["start"] + s.stop, dtype=np.int64)
    if kind == "c":
        procs, rank = dim["proc_grid_size"], dim["proc_grid_rank"]
        bs = dim.get("block_size", 1)
        n = num_owned_indices(dim)
        local = np.arange(n, dtype=np.int64)
        return ((local // bs) * procs + rank) * bs + local % bs
    if kind == "u":
        return np.asarray(memoryview(dim["indices"])).astype(np.int64, copy=False).reshape(-1)
    raise ValueError(f"unknown dist_type {kind!r}")
