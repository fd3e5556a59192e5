"""Validation of DAP 0.10.0 dicts: one rank (:func:`validate`) and all ranks together
(:func:`validate_distribution`).

Stricter than the reference ``validator.py`` (of the protocol's repository,
enthought/distributed-array-protocol, release 0.10.0), which
never checks ``size``, accepts ``bool`` for ints, negative ranks and padding,
and knows nothing across ranks.  Every message names the rank (when known),
the dimension, the key and the value.

Readings of the text, documented in ``docs/guide/dap.md``:

* a cyclic rank that owns nothing may give any ``start >= size`` (the
  reference ``test_utils.py`` vector) besides ``proc_grid_rank * block_size``;
* the buffer's extent along every axis must equal the count its dimension
  dict implies, for every dist type, and ``__version__`` must be a full
  ``0.10.x`` string.  ``strict=False`` accepts what the reference validator
  accepts there: a cyclic or unstructured buffer longer than what the rank
  owns (its ``test_cyclic`` vector: 25 owned, a buffer of 50) and a
  ``"0.10"`` version.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import DAPValidationError
from .dims import buffer_shape, global_indices, normalize_dim, num_owned_indices

VERSION = "0.10.0"
_TOP = frozenset({"__version__", "buffer", "dim_data"})
_COMMON = ("dist_type", "size", "proc_grid_size", "proc_grid_rank")
_KEYS = {
    "b": ({"start", "stop"}, {"padding", "periodic"}),
    "c": ({"start"}, {"block_size"}),
    "u": ({"indices"}, {"one_to_one"}),
}
_VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")
_LOOSE_VERSION_RE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?$")
_INT_CODES = set("bBhHiIlLqQnN")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _buffer_view(buf: Any, rank: int | None) -> memoryview:
    try:
        return memoryview(buf)
    except TypeError:
        raise DAPValidationError(
            f"buffer of type {type(buf).__name__} does not support the buffer protocol "
            "(give a numpy array, memoryview, bytes or bytearray)",
            rank=rank,
            key="buffer",
        ) from None


def check_version(version: Any, rank: int | None = None, strict: bool = True) -> None:
    pattern = _VERSION_RE if strict else _LOOSE_VERSION_RE
    match = pattern.match(version) if isinstance(version, str) else None
    if match is None:
        raise DAPValidationError(
            f"__version__ {version!r:.40} is not a 'major.minor.patch' string such as {VERSION!r}",
            rank=rank,
            key="__version__",
        )
    major, minor = (int(x) for x in match.groups()[:2])
    if (major, minor) == (0, 9):
        raise DAPValidationError(
            f"__version__ {version!r} is the legacy 0.9 protocol; this reader speaks 0.10 "
            "(from_dap(..., strict=False) converts 0.9 dicts)",
            rank=rank,
            key="__version__",
        )
    if (major, minor) != (0, 10):
        raise DAPValidationError(
            f"__version__ {version!r} is not supported (0.10.x is)", rank=rank, key="__version__"
        )


def validate(dap: Mapping[str, Any], *, rank: int | None = None, strict: bool = True) -> None:
    """Check one rank's DAP dict against every rule of DAP 0.10.0 that one rank can show.

    ``strict=False`` accepts what the reference validator accepts beyond the
    text: cyclic and unstructured buffers longer than the rank owns, and a
    ``major.minor`` version.

    Raises
    ------
    DAPValidationError
        Naming the rank (``rank``, when given), dimension, key and value.
    """
    if not isinstance(dap, Mapping):
        raise DAPValidationError(f"a DAP dict must be a dict, got {type(dap).__name__}", rank=rank)
    keys = set(dap)
    if keys != _TOP:
        missing, extra = sorted(_TOP - keys), sorted(map(str, keys - _TOP))
        parts = ([f"missing keys {missing}"] if missing else []) + (
            [f"unknown keys {extra}"] if extra else []
        )
        raise DAPValidationError(
            "a DAP dict has exactly '__version__', 'buffer' and 'dim_data': " + ", ".join(parts),
            rank=rank,
        )
    check_version(dap["__version__"], rank, strict)
    view = _buffer_view(dap["buffer"], rank)
    dim_data = dap["dim_data"]
    if not isinstance(dim_data, tuple):
        raise DAPValidationError(
            f"dim_data must be a tuple of dimension dicts, got {type(dim_data).__name__}",
            rank=rank,
            key="dim_data",
        )
    if len(dim_data) != view.ndim:
        raise DAPValidationError(
            f"dim_data has {len(dim_data)} dimension dicts but the buffer has {view.ndim} "
            f"dimensions (shape {view.shape})",
            rank=rank,
            key="dim_data",
        )
    for i, dim in enumerate(dim_data):
        _check_dim(dim, (view.shape or ())[i], i, rank, strict)


def _check_dim(d: Any, shape_i: int, i: int, rank: int | None, strict: bool) -> None:
    def fail(msg: str, key: str | None = None) -> DAPValidationError:
        return DAPValidationError(msg, rank=rank, dim=i, key=key)

    if not isinstance(d, Mapping):
        raise fail(f"a dimension dict must be a dict, got {type(d).__name__}")
    if len(d) == 0:
        return  # the {} alias: an undistributed block axis as long as the buffer
    kind = d.get("dist_type")
    if kind == "n":
        raise fail(
            "dist_type 'n' is the legacy 0.9 protocol (0.10 uses 'b' with "
            "proc_grid_size 1 or {}); from_dap(..., strict=False) converts it",
            "dist_type",
        )
    if kind not in _KEYS:
        raise fail(f"dist_type must be 'b', 'c' or 'u', got {kind!r}", "dist_type")
    required, optional = _KEYS[kind]
    missing = [k for k in (*_COMMON, *sorted(required)) if k not in d]
    if missing:
        raise fail(f"missing keys {missing} for dist_type {kind!r}")
    unknown = sorted(map(str, set(d) - set(_COMMON) - required - optional))
    if unknown:
        raise fail(
            f"unknown keys {unknown} for dist_type {kind!r} "
            f"(allowed: {sorted(set(_COMMON) | required | optional)})"
        )
    int_keys = ["size", "proc_grid_size", "proc_grid_rank"] + (["start"] if kind != "u" else [])
    int_keys += ["stop"] if kind == "b" else []
    int_keys += ["block_size"] if "block_size" in d else []
    for k in int_keys:
        if not _is_int(d[k]):
            raise fail(f"must be a Python int, got {type(d[k]).__name__} {d[k]!r}", k)
    size, procs, prank = d["size"], d["proc_grid_size"], d["proc_grid_rank"]
    if size < 0:
        raise fail(f"size must be >= 0, got {size}", "size")
    if procs < 1:
        raise fail(f"proc_grid_size must be >= 1, got {procs}", "proc_grid_size")
    if not 0 <= prank < procs:
        raise fail(f"proc_grid_rank must be in [0, {procs}), got {prank}", "proc_grid_rank")
    if size == 0 and shape_i != 0:
        raise fail(
            f"size is 0, so the buffer must be empty along this axis (length {shape_i})", "size"
        )
    if kind == "b":
        _check_block(d, shape_i, fail)
    elif kind == "c":
        _check_cyclic(d, shape_i, fail, strict)
    else:
        _check_unstructured(d, shape_i, fail, strict)


def _check_block(d: Mapping[str, Any], shape_i: int, fail: Any) -> None:
    start, stop, size = d["start"], d["stop"], d["size"]
    procs, prank = d["proc_grid_size"], d["proc_grid_rank"]
    if start < 0:
        raise fail(f"start must be >= 0, got {start}", "start")
    if not start <= stop <= size:
        raise fail(
            f"need start <= stop <= size, got start={start}, stop={stop}, size={size}", "stop"
        )
    if stop - start != shape_i:
        raise fail(
            f"stop - start = {stop - start} but the buffer has {shape_i} elements along this axis",
            "stop",
        )
    if prank == 0 and start != 0:
        raise fail(f"the first rank of a block axis starts at 0, got start={start}", "start")
    if "padding" in d:
        pad = d["padding"]
        if not isinstance(pad, tuple) or len(pad) != 2:
            raise fail(f"padding must be a tuple of 2 ints, got {pad!r}", "padding")
        for v in pad:
            if not _is_int(v) or v < 0:
                raise fail(f"padding widths must be Python ints >= 0, got {pad!r}", "padding")
        if pad[0] + pad[1] > stop - start:
            raise fail(f"padding {pad} is wider than the buffer ({stop - start})", "padding")
    if "periodic" in d and not isinstance(d["periodic"], bool):
        raise fail(f"periodic must be a bool, got {d['periodic']!r}", "periodic")
    if procs == 1 and (start, stop) != (0, size):
        raise fail(
            f"a block axis on one process holds it all: need start=0, stop=size={size}, "
            f"got start={start}, stop={stop}",
            "stop",
        )


def _check_extent(owned: int, shape_i: int, fail: Any, strict: bool, key: str) -> None:
    """The buffer holds exactly what the rank owns (at least, when not strict)."""
    if shape_i < owned or (strict and shape_i != owned):
        raise fail(
            f"the rank owns {owned} indices along this axis but the buffer has {shape_i}", key
        )


def _check_cyclic(d: Mapping[str, Any], shape_i: int, fail: Any, strict: bool) -> None:
    start, size, prank = d["start"], d["size"], d["proc_grid_rank"]
    bs = d.get("block_size", 1)
    if bs < 1:
        raise fail(f"block_size must be >= 1, got {bs}", "block_size")
    if start < 0:
        raise fail(f"start must be >= 0, got {start}", "start")
    owned = num_owned_indices(d)
    if start != prank * bs and not (owned == 0 and start >= size):
        raise fail(
            f"start must be proc_grid_rank * block_size = {prank} * {bs} = {prank * bs}, "
            f"got {start}",
            "start",
        )
    if start >= size and shape_i != 0:
        raise fail(
            f"start = {start} >= size = {size}, so the buffer must be empty along this "
            f"axis (length {shape_i})",
            "start",
        )
    _check_extent(owned, shape_i, fail, strict, "start")


def _check_unstructured(d: Mapping[str, Any], shape_i: int, fail: Any, strict: bool) -> None:
    try:
        view = memoryview(d["indices"])
    except TypeError:
        raise fail(
            f"indices of type {type(d['indices']).__name__} does not support the buffer "
            "protocol (give a numpy integer array)",
            "indices",
        ) from None
    if view.format.lstrip("@=<>!") not in _INT_CODES or view.ndim != 1:
        raise fail(
            f"indices must be a 1-d buffer of integers, got format {view.format!r} "
            f"with {view.ndim} dimensions",
            "indices",
        )
    idx = np.asarray(view)
    if len(np.unique(idx)) != len(idx):
        raise fail("indices must be locally unique (a global index appears twice)", "indices")
    if "one_to_one" in d and not isinstance(d["one_to_one"], bool):
        raise fail(f"one_to_one must be a bool, got {d['one_to_one']!r}", "one_to_one")
    if len(idx) == 0 and shape_i != 0:
        raise fail(
            f"no indices, so the buffer must be empty along this axis (length {shape_i})", "indices"
        )
    _check_extent(len(idx), shape_i, fail, strict, "indices")


# -- across ranks -----------------------------------------------------------------------


def _rank_of(coords: tuple[int, ...], grid: tuple[int, ...]) -> int:
    return int(np.ravel_multi_index(coords, grid)) if grid else 0


def validate_distribution(daps: Sequence[Mapping[str, Any]]) -> None:
    """Check all ranks of one distributed array together (any order).

    Every rank must be valid on its own, and together: one complete row-major
    process grid (each coordinate once), equal dtypes and dimension counts,
    identical dimension dicts along each axis (padding aside), buffer lengths
    equal to what each rank owns, block axes that tile ``[0, size)`` with
    matching communication padding no wider than the neighbour, cyclic axes
    with one block size, and unstructured axes whose indices cover
    ``[0, size)`` (exactly once when ``one_to_one``).
    """
    daps = list(daps)
    if not daps:
        raise DAPValidationError("no DAP dicts given (a distribution has at least one rank)")
    for pos, dap in enumerate(daps):
        validate(dap, rank=pos)
    shapes = [buffer_shape(d["buffer"]) for d in daps]
    dims = [
        tuple(normalize_dim(dd, shapes[p][i]) for i, dd in enumerate(d["dim_data"]))
        for p, d in enumerate(daps)
    ]
    ndim = len(dims[0])
    for p, dd in enumerate(dims):
        if len(dd) != ndim:
            raise DAPValidationError(
                f"has {len(dd)} dimensions, rank 0 has {ndim}", rank=p, key="dim_data"
            )
    grid = tuple(dims[0][i]["proc_grid_size"] for i in range(ndim))
    sizes = tuple(dims[0][i]["size"] for i in range(ndim))
    for p, dd in enumerate(dims):
        for i in range(ndim):
            for key, want in (("proc_grid_size", grid[i]), ("size", sizes[i])):
                if dd[i][key] != want:
                    raise DAPValidationError(
                        f"{key} is {dd[i][key]} but another rank says {want}",
                        rank=p,
                        dim=i,
                        key=key,
                    )
    expected = int(np.prod(grid)) if grid else 1
    if len(daps) != expected:
        raise DAPValidationError(
            f"the process grid {grid} has {expected} ranks but {len(daps)} DAP dicts were given"
        )
    where: dict[tuple[int, ...], int] = {}
    for p, dd in enumerate(dims):
        coords = tuple(dd[i]["proc_grid_rank"] for i in range(ndim))
        if coords in where:
            raise DAPValidationError(
                f"grid coordinates {coords} (rank {_rank_of(coords, grid)}) appear twice "
                f"(entries {where[coords]} and {p})"
            )
        where[coords] = p
    ranks = {p: _rank_of(c, grid) for c, p in where.items()}
    dtypes = {np.asarray(memoryview(d["buffer"])).dtype for d in daps}
    if len(dtypes) > 1:
        raise DAPValidationError(f"buffers have different dtypes: {sorted(map(str, dtypes))}")
    for i in range(ndim):
        _check_axis(i, [(ranks[p], dims[p][i], shapes[p][i]) for p in range(len(daps))])


def _same_metadata(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    keys = (set(a) | set(b)) - {"padding"}
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if k == "indices":
            if not np.array_equal(np.asarray(va), np.asarray(vb)):
                return False
        elif va != vb:
            return False
    return True


def _check_axis(i: int, entries: list[tuple[int, dict[str, Any], int]]) -> None:
    by_grid: dict[int, tuple[int, dict[str, Any], int]] = {}
    for rank, d, n in entries:
        g = d["proc_grid_rank"]
        first = by_grid.setdefault(g, (rank, d, n))
        if not _same_metadata(first[1], d) or first[2] != n:
            raise DAPValidationError(
                f"differs from rank {first[0]}, which has the same proc_grid_rank {g} on this "
                "axis (dimension dicts must be identical along an axis, padding aside)",
                rank=rank,
                dim=i,
            )
        if d["dist_type"] != first[1]["dist_type"]:
            raise DAPValidationError("dist_type differs along the axis", rank=rank, dim=i)
    column = [by_grid[g] for g in sorted(by_grid)]
    kinds = {d["dist_type"] for _, d, _ in column}
    if len(kinds) > 1:
        raise DAPValidationError(f"mixes dist_types {sorted(kinds)} on one axis", dim=i)
    kind = kinds.pop()
    size = column[0][1]["size"]
    for rank, d, n in column:
        owned = num_owned_indices(d)
        if kind != "b" and n != owned:
            raise DAPValidationError(
                f"the rank owns {owned} indices but its buffer has {n} along this axis",
                rank=rank,
                dim=i,
            )
    if kind == "b":
        _check_block_tiling(i, column, size)
    elif kind == "c":
        bss = {d.get("block_size", 1) for _, d, _ in column}
        if len(bss) > 1:
            raise DAPValidationError(f"block_size differs along the axis: {sorted(bss)}", dim=i)
    else:
        _check_unstructured_cover(i, column, size)


def _check_block_tiling(i: int, column: list[tuple[int, dict[str, Any], int]], size: int) -> None:
    expect = 0
    for pos, (rank, d, _) in enumerate(column):
        owned = global_indices(d)
        lo = int(owned[0]) if len(owned) else d["start"] + (d["padding"][0] if pos > 0 else 0)
        if lo != expect:
            raise DAPValidationError(
                f"owns indices from {lo} but the previous rank stops at {expect} "
                "(block ranks must tile the axis without gaps or overlaps)",
                rank=rank,
                dim=i,
                key="start",
            )
        expect = lo + len(owned)
        if pos + 1 < len(column):
            nrank, nd, _ = column[pos + 1]
            right, left = d["padding"][1], nd["padding"][0]
            if right != left:
                raise DAPValidationError(
                    f"communication padding {right} on its high side does not match {left} on "
                    f"the low side of rank {nrank}",
                    rank=rank,
                    dim=i,
                    key="padding",
                )
            for width, neighbour, nrk in ((right, nd, nrank), (left, d, rank)):
                if width > num_owned_indices(neighbour):
                    raise DAPValidationError(
                        f"communication padding {width} is wider than the "
                        f"{num_owned_indices(neighbour)} indices its neighbour (rank {nrk}) owns",
                        rank=rank,
                        dim=i,
                        key="padding",
                    )
    if expect != size:
        raise DAPValidationError(
            f"block ranks own indices up to {expect} but size is {size}", dim=i, key="size"
        )


def _check_unstructured_cover(
    i: int, column: list[tuple[int, dict[str, Any], int]], size: int
) -> None:
    one_to_one = any(d.get("one_to_one", False) for _, d, _ in column)
    allidx = np.concatenate([global_indices(d) for _, d, _ in column]) if column else np.empty(0)
    if len(allidx) and (allidx.min() < 0 or allidx.max() >= size):
        bad = allidx[(allidx < 0) | (allidx >= size)][0]
        raise DAPValidationError(
            f"index {int(bad)} is outside [0, {size}) (negative and out-of-range unstructured "
            "indices have no meaning for an array)",
            dim=i,
            key="indices",
        )
    uniq = np.unique(allidx)
    if len(uniq) != size:
        missing = np.setdiff1d(np.arange(size), uniq)[:5].tolist()
        raise DAPValidationError(
            f"the ranks' indices cover {len(uniq)} of {size} global indices (missing {missing}...)",
            dim=i,
            key="indices",
        )
    if one_to_one and len(allidx) != size:
        raise DAPValidationError(
            "one_to_one is set but some global index appears on two ranks", dim=i, key="indices"
        )
