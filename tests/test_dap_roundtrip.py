"""Dask <-> DAP: the protocol's examples reproduced exactly, round trips for every
distribution on 1-, 2- and 3-d grids, property-based round trips, zero-copy import,
and the errors for what cannot be exported or imported."""

from __future__ import annotations

import itertools

import dask.array as da
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dask_dap import DAPValidationError, from_dap, to_dap, validate, validate_distribution

FULL = np.arange(32.0).reshape(4, 8)  # the 4 x 8 array of the protocol's examples


def B(size, procs, rank, start, stop, **kw):
    return {
        "dist_type": "b",
        "size": size,
        "proc_grid_size": procs,
        "proc_grid_rank": rank,
        "start": start,
        "stop": stop,
        **kw,
    }


def C(size, procs, rank, bs=1):
    return {
        "dist_type": "c",
        "size": size,
        "proc_grid_size": procs,
        "proc_grid_rank": rank,
        "start": rank * bs,
        "block_size": bs,
    }


# -- the examples of the protocol text (examples.rst / all_examples.rst), in 0.10 form ---------

EXAMPLES = {
    "block_nondist_4x1": (
        (1, 8),
        None,
        [
            ([[0, 1, 2, 3, 4, 5, 6, 7]], (B(4, 4, 0, 0, 1), B(8, 1, 0, 0, 8))),
            ([[8, 9, 10, 11, 12, 13, 14, 15]], (B(4, 4, 1, 1, 2), B(8, 1, 0, 0, 8))),
            ([[16, 17, 18, 19, 20, 21, 22, 23]], (B(4, 4, 2, 2, 3), B(8, 1, 0, 0, 8))),
            ([[24, 25, 26, 27, 28, 29, 30, 31]], (B(4, 4, 3, 3, 4), B(8, 1, 0, 0, 8))),
        ],
    ),
    "nondist_block_1x4": (
        (4, 2),
        None,
        [
            ([[0, 1], [8, 9], [16, 17], [24, 25]], (B(4, 1, 0, 0, 4), B(8, 4, 0, 0, 2))),
            ([[2, 3], [10, 11], [18, 19], [26, 27]], (B(4, 1, 0, 0, 4), B(8, 4, 1, 2, 4))),
            ([[4, 5], [12, 13], [20, 21], [28, 29]], (B(4, 1, 0, 0, 4), B(8, 4, 2, 4, 6))),
            ([[6, 7], [14, 15], [22, 23], [30, 31]], (B(4, 1, 0, 0, 4), B(8, 4, 3, 6, 8))),
        ],
    ),
    "block_block_2x2": (
        (2, 4),
        None,
        [
            ([[0, 1, 2, 3], [8, 9, 10, 11]], (B(4, 2, 0, 0, 2), B(8, 2, 0, 0, 4))),
            ([[4, 5, 6, 7], [12, 13, 14, 15]], (B(4, 2, 0, 0, 2), B(8, 2, 1, 4, 8))),
            ([[16, 17, 18, 19], [24, 25, 26, 27]], (B(4, 2, 1, 2, 4), B(8, 2, 0, 0, 4))),
            ([[20, 21, 22, 23], [28, 29, 30, 31]], (B(4, 2, 1, 2, 4), B(8, 2, 1, 4, 8))),
        ],
    ),
    "block_cyclic_2x2": (
        (2, 4),
        ("b", "c"),
        [
            ([[0, 2, 4, 6], [8, 10, 12, 14]], (B(4, 2, 0, 0, 2), C(8, 2, 0))),
            ([[1, 3, 5, 7], [9, 11, 13, 15]], (B(4, 2, 0, 0, 2), C(8, 2, 1))),
            ([[16, 18, 20, 22], [24, 26, 28, 30]], (B(4, 2, 1, 2, 4), C(8, 2, 0))),
            ([[17, 19, 21, 23], [25, 27, 29, 31]], (B(4, 2, 1, 2, 4), C(8, 2, 1))),
        ],
    ),
    "cyclic_cyclic_2x2": (
        (2, 4),
        ("c", "c"),
        [
            ([[0, 2, 4, 6], [16, 18, 20, 22]], (C(4, 2, 0), C(8, 2, 0))),
            ([[1, 3, 5, 7], [17, 19, 21, 23]], (C(4, 2, 0), C(8, 2, 1))),
            ([[8, 10, 12, 14], [24, 26, 28, 30]], (C(4, 2, 1), C(8, 2, 0))),
            ([[9, 11, 13, 15], [25, 27, 29, 31]], (C(4, 2, 1), C(8, 2, 1))),
        ],
    ),
    "blockcyclic2_blockcyclic2_2x2": (
        (2, 4),
        ({"dist_type": "c", "block_size": 2},) * 2,
        [
            ([[0, 1, 4, 5], [8, 9, 12, 13]], (C(4, 2, 0, 2), C(8, 2, 0, 2))),
            ([[2, 3, 6, 7], [10, 11, 14, 15]], (C(4, 2, 0, 2), C(8, 2, 1, 2))),
            ([[16, 17, 20, 21], [24, 25, 28, 29]], (C(4, 2, 1, 2), C(8, 2, 0, 2))),
            ([[18, 19, 22, 23], [26, 27, 30, 31]], (C(4, 2, 1, 2), C(8, 2, 1, 2))),
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_protocol_examples_exactly(name):
    chunks, dist, expected = EXAMPLES[name]
    parts = to_dap(da.from_array(FULL, chunks=chunks), dist=dist)
    assert len(parts) == len(expected)
    for part, (buf, dim_data) in zip(parts, expected):
        assert part["__version__"] == "0.10.0"
        assert set(part) == {"__version__", "buffer", "dim_data"}
        assert part["buffer"].tolist() == buf
        assert part["dim_data"] == dim_data
        assert type(part["dim_data"]) is tuple
        assert all(
            type(v) is int for d in part["dim_data"] for v in d.values() if not isinstance(v, str)
        )
        validate(part)
    validate_distribution(parts)
    np.testing.assert_array_equal(from_dap(parts).compute(), FULL)


def test_block_with_padding_example():
    a = np.arange(18.0)
    parts = to_dap(da.from_array(a, chunks=9), comm_padding=1, boundary_padding=1)
    assert [p["dim_data"] for p in parts] == [
        (B(18, 2, 0, 0, 10, padding=(1, 1)),),
        (B(18, 2, 1, 8, 18, padding=(1, 1)),),
    ]
    assert parts[0]["buffer"].tolist() == a[:10].tolist()
    assert parts[1]["buffer"].tolist() == a[8:].tolist()
    np.testing.assert_array_equal(from_dap(parts).compute(), a)


def test_padding_table_of_the_protocol():
    """4 ranks, boundary 4 | 0, communication widths 1, 2, 3 (a hand-made producer)."""
    pads = [(4, 1), (1, 2), (2, 3), (3, 0)]
    owned = [6, 5, 5, 4]
    g = np.arange(20.0)
    parts, start = [], 0
    for r, (lo, hi) in enumerate(pads):
        cl, cr = (lo if r else 0), (hi if r < 3 else 0)
        s, e = start - cl, start + owned[r] + cr
        parts.append(
            {
                "__version__": "0.10.0",
                "buffer": g[s:e],
                "dim_data": (B(20, 4, r, s, e, padding=(lo, hi)),),
            }
        )
        start += owned[r]
    x = from_dap(parts)
    assert x.chunks == (tuple(owned),)
    np.testing.assert_array_equal(x.compute(), g)


def test_all_examples_block_block_2x1_and_unstructured():
    a = np.random.default_rng(0).random((2, 10))
    parts = to_dap(da.from_array(a, chunks=(1, 10)))
    assert [p["dim_data"] for p in parts] == [
        (B(2, 2, 0, 0, 1), B(10, 1, 0, 0, 10)),
        (B(2, 2, 1, 1, 2), B(10, 1, 0, 0, 10)),
    ]
    assert parts[0]["buffer"].shape == (1, 10)  # the doc prints 1-d buffers; they are (1, 10)
    idx = [
        [19, 1, 0, 12, 2, 15, 4],
        [6, 13, 3],
        [10, 25, 5, 21, 7, 18, 11, 26, 29, 24, 23, 28, 14, 20, 9, 16, 27, 8, 17, 22],
    ]
    g = np.random.default_rng(1).random(30)
    uparts = [
        {
            "__version__": "0.10.0",
            "buffer": g[i],
            "dim_data": (
                {
                    "dist_type": "u",
                    "size": 30,
                    "proc_grid_size": 3,
                    "proc_grid_rank": r,
                    "indices": np.array(i),
                },
            ),
        }
        for r, i in enumerate(idx)
    ]
    np.testing.assert_array_equal(from_dap(uparts).compute(), g)
    out = to_dap(da.from_array(g, chunks=10), dist=[{"dist_type": "u", "indices": idx}])
    for p, i in zip(out, idx):
        np.testing.assert_array_equal(p["buffer"], g[i])
        assert p["dim_data"][0]["indices"].tolist() == i


# -- round trips ---------------------------------------------------------------------------

SPECS = [None, "c", {"dist_type": "c", "block_size": 2}, {"dist_type": "c", "block_size": 3}]


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_round_trip_every_distribution_combination(ndim):
    shape = (7, 5, 4)[:ndim]
    chunks = ((3, 4), (2, 0, 3), (4,))[:ndim]  # irregular, an empty block, one block
    a = np.random.default_rng(ndim).random(shape)
    x = da.from_array(a, chunks=chunks)
    for dist in itertools.product(SPECS, repeat=ndim):
        parts = to_dap(x, dist=list(dist))
        assert len(parts) == int(np.prod(x.numblocks))
        validate_distribution(parts)
        back = from_dap(parts[::-1])  # any order
        np.testing.assert_array_equal(back.compute(), a)


def test_round_trip_unstructured_and_padding_mixed():
    a = np.random.default_rng(3).random((6, 9))
    x = da.from_array(a, chunks=(3, (4, 5)))
    perm = np.random.default_rng(4).permutation(6)
    parts = to_dap(
        x,
        dist=[{"dist_type": "u", "indices": [perm[:2], perm[2:]]}, None],
        comm_padding=[0, 2],
        boundary_padding=[0, 1],
        periodic=[False, True],
    )
    assert parts[0]["dim_data"][1]["padding"] == (1, 2) and parts[0]["dim_data"][1]["periodic"]
    assert parts[1]["dim_data"][1] == B(9, 2, 1, 2, 9, padding=(2, 1), periodic=True)
    np.testing.assert_array_equal(from_dap(parts).compute(), a)


def test_scalar_padding_applies_to_the_block_axes_only():
    """The README's ``to_dap(x, comm_padding=1, dist=[None, "c"])``: DAP pads block axes
    only, so a scalar width (and periodic flag) is for every block axis, not an error."""
    x = da.from_array(FULL, chunks=(2, 4))
    parts = to_dap(x, comm_padding=1, boundary_padding=1, periodic=True, dist=[None, "c"])
    assert parts[0]["dim_data"] == (B(4, 2, 0, 0, 3, padding=(1, 1), periodic=True), C(8, 2, 0))
    assert parts[3]["dim_data"] == (B(4, 2, 1, 1, 4, padding=(1, 1), periodic=True), C(8, 2, 1))
    np.testing.assert_array_equal(parts[0]["buffer"], FULL[0:3, 0::2])
    validate_distribution(parts)
    np.testing.assert_array_equal(from_dap(parts).compute(), FULL)
    assert to_dap(x, comm_padding=[1, 0], dist=[None, "c"])[0]["dim_data"][0]["padding"] == (0, 1)
    with pytest.raises(ValueError, match="axis 1 is asked to be 'c'"):
        to_dap(x, comm_padding=[1, 1], dist=[None, "c"])  # explicit: taken as written
    with pytest.raises(ValueError, match="no axis of the export is a block axis"):
        to_dap(x, comm_padding=1, dist="c")


def test_zero_copy_import_and_shapes():
    parts = to_dap(da.from_array(FULL, chunks=(2, 4)), comm_padding=1)
    x = from_dap(parts)
    graph = x.__dask_graph__()
    for coords in itertools.product(range(2), range(2)):
        rank = coords[0] * 2 + coords[1]
        assert np.shares_memory(graph[(x.name, *coords)], parts[rank]["buffer"])
    parts[0]["buffer"][0, 0] = -1.0  # the producer writes: the dask array sees it
    assert x.compute()[0, 0] == -1.0


def test_zero_d_and_zero_size():
    z = from_dap(to_dap(da.from_array(np.array(3.5))))
    assert z.shape == () and z.compute() == 3.5
    empty = np.zeros((0, 3))
    parts = to_dap(da.from_array(empty, chunks=(1, 2)))
    assert from_dap(parts).shape == (0, 3)
    one = to_dap(da.zeros((4,), chunks=2), dist=["c"])
    assert [p["buffer"].tolist() for p in one] == [[0, 0], [0, 0]]


class Producer:
    """A third-party object exposing __distarray__ (like distarray's LocalArray)."""

    def __init__(self, d):
        self.d = d

    def __distarray__(self):
        return self.d


def test_import_from_distarray_objects_and_memoryviews():
    data = np.arange(6, dtype="i4")
    parts = [
        Producer(
            {
                "__version__": "0.10.0",
                "buffer": memoryview(data[:3]),
                "dim_data": (B(6, 2, 0, 0, 3),),
            }
        ),
        Producer({"__version__": "0.10.0", "buffer": data[3:], "dim_data": (B(6, 2, 1, 3, 6),)}),
    ]
    x = from_dap(parts)
    assert x.dtype == np.dtype("i4") and x.compute().tolist() == list(range(6))


def test_legacy_09_needs_strict_false():
    legacy = [
        {
            "__version__": "0.9.0",
            "buffer": FULL[:2],
            "dim_data": [B(4, 2, 0, 0, 2), {"dist_type": "n", "size": 8}],
        },
        {
            "__version__": "0.9.0",
            "buffer": FULL[2:],
            "dim_data": [B(4, 2, 1, 2, 4), {"dist_type": "n", "size": 8}],
        },
    ]
    with pytest.raises(DAPValidationError, match="legacy 0.9"):
        from_dap(legacy)
    np.testing.assert_array_equal(from_dap(legacy, strict=False).compute(), FULL)


# -- errors ---------------------------------------------------------------------------------


def test_export_errors_say_what_to_do():
    x = da.from_array(np.arange(10.0), chunks=5)
    unknown = x[x > 3]
    with pytest.raises(ValueError, match="compute_chunk_sizes"):
        to_dap(unknown)
    with pytest.raises(TypeError, match="object arrays"):
        to_dap(da.from_array(np.array([object()] * 2, dtype=object), chunks=1))
    with pytest.raises(ValueError, match="wider than block 1 \\(2 elements\\)"):
        to_dap(da.from_array(np.arange(7.0), chunks=(5, 2)), comm_padding=3)
    with pytest.raises(ValueError, match="padding and periodic apply to block axes"):
        to_dap(x, dist=["c"], comm_padding=1)
    with pytest.raises(ValueError, match="needs the indices"):
        to_dap(x, dist=["u"])
    with pytest.raises(ValueError, match="cover all 10"):
        to_dap(x, dist=[{"dist_type": "u", "indices": [[0, 1], [2]]}])
    with pytest.raises(ValueError, match="has 2 entries for a 1-d array"):
        to_dap(x, comm_padding=[1, 1])
    with pytest.raises(TypeError, match="dask array"):
        to_dap(np.arange(3))

    class Sparse:  # a chunk type without the buffer protocol (like sparse.COO)
        dtype = np.dtype("f8")
        ndim = 1

    weird = da.from_array(np.arange(4.0), chunks=2).map_blocks(lambda b: b, meta=np.empty(0))
    weird._meta = Sparse()
    with pytest.raises(TypeError, match="buffer protocol"):
        to_dap(weird)


def test_import_validates_first():
    parts = to_dap(da.from_array(FULL, chunks=(2, 4)))
    with pytest.raises(TypeError, match="one entry per rank, got a single dict"):
        from_dap(parts[0])  # one dict, not a list of them
    with pytest.raises(DAPValidationError, match="4 ranks but 3"):
        from_dap(parts[:3])
    bad = [dict(p) for p in parts]
    bad[2] = dict(bad[2], __version__="0.10")
    with pytest.raises(DAPValidationError, match="rank 2, key '__version__'.*major.minor.patch"):
        from_dap(bad)
    bad[2] = dict(bad[2], __version__="0.10.3")
    from_dap(bad)  # any 0.10.x
    bad[2] = dict(bad[2], dim_data=list(bad[2]["dim_data"]))
    with pytest.raises(DAPValidationError, match="rank 2, key 'dim_data'"):
        from_dap(bad)


# -- property-based --------------------------------------------------------------------------


@st.composite
def arrays_and_dists(draw):
    ndim = draw(st.integers(1, 3))
    chunks, dists = [], []
    for _ in range(ndim):
        blocks = draw(st.lists(st.integers(0, 5), min_size=1, max_size=4))
        if sum(blocks) == 0:
            blocks[0] = 1
        chunks.append(tuple(blocks))
        size = sum(blocks)
        kind = draw(st.sampled_from(["b", "c", "bc", "u"]))
        if kind == "b":
            dists.append(None)
        elif kind == "c":
            dists.append("c")
        elif kind == "bc":
            dists.append(
                {
                    "dist_type": "c",
                    "block_size": draw(st.integers(1, 4)),
                    "proc_grid_size": draw(st.integers(1, 4)),
                }
            )
        else:
            perm = draw(st.permutations(range(size)))
            cuts = sorted(draw(st.lists(st.integers(0, size), min_size=0, max_size=3)))
            pieces = np.split(np.array(perm, dtype=np.int64), cuts)
            dists.append({"dist_type": "u", "indices": pieces})
    return tuple(chunks), dists


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrays_and_dists())
def test_property_export_then_import_is_identity(case):
    chunks, dists = case
    shape = tuple(sum(c) for c in chunks)
    a = np.arange(int(np.prod(shape)), dtype="f8").reshape(shape)
    parts = to_dap(da.from_array(a, chunks=chunks), dist=dists)
    validate_distribution(parts)
    np.testing.assert_array_equal(from_dap(parts).compute(), a)


def test_cyclic_import_takes_the_reshape_path_when_sizes_allow():
    a = np.arange(48.0).reshape(12, 4)
    even = to_dap(da.from_array(a, chunks=(4, 4)), dist=[{"dist_type": "c", "block_size": 2}, None])
    x = from_dap(even)  # 12 = 3 ranks x 2 blocks x 2: a reshape and a transpose
    assert not any("take" in str(k) for k in x.__dask_graph__().layers)
    np.testing.assert_array_equal(x.compute(), a)
    # The source chunks do not matter (5, 5, 2 rows): 3 ranks and block_size 2 divide 12.
    other = to_dap(
        da.from_array(a, chunks=(5, 4)), dist=[{"dist_type": "c", "block_size": 2}, None]
    )
    np.testing.assert_array_equal(from_dap(other).compute(), a)
    odd = to_dap(da.from_array(a[:11], chunks=(4, 4)), dist=["c", None])  # 11 % 3: gather
    np.testing.assert_array_equal(from_dap(odd).compute(), a[:11])


def test_examples_on_3x1_and_1x3_grids():
    """The 0.10 text's 5 x 9 array on 3 x 1 and 1 x 3 grids ('n' written as 'b', P=1)."""
    full = np.arange(45.0).reshape(5, 9)
    rows = to_dap(da.from_array(full, chunks=((2, 2, 1), 9)))
    assert [p["dim_data"] for p in rows] == [
        (B(5, 3, 0, 0, 2), B(9, 1, 0, 0, 9)),
        (B(5, 3, 1, 2, 4), B(9, 1, 0, 0, 9)),
        (B(5, 3, 2, 4, 5), B(9, 1, 0, 0, 9)),
    ]
    assert rows[2]["buffer"].tolist() == [list(range(36, 45))]
    cols = to_dap(da.from_array(full, chunks=(5, 3)))
    assert [p["dim_data"][1] for p in cols] == [
        B(9, 3, 0, 0, 3),
        B(9, 3, 1, 3, 6),
        B(9, 3, 2, 6, 9),
    ]
    assert cols[1]["buffer"][:, 0].tolist() == [3, 12, 21, 30, 39]
    for parts in (rows, cols):
        np.testing.assert_array_equal(from_dap(parts).compute(), full)


def test_unstructured_duplicates_read_from_the_lowest_rank():
    g = np.arange(5.0) * 10
    idx = [np.array([4, 0, 2]), np.array([2, 1, 3])]  # index 2 on both ranks
    bufs = [g[idx[0]], g[idx[1]].copy()]
    bufs[1][0] = -1.0  # rank 1's copy of index 2 disagrees: rank 0 wins
    parts = [
        {
            "__version__": "0.10.0",
            "buffer": b,
            "dim_data": (
                {
                    "dist_type": "u",
                    "size": 5,
                    "proc_grid_size": 2,
                    "proc_grid_rank": r,
                    "indices": i,
                },
            ),
        }
        for r, (b, i) in enumerate(zip(bufs, idx))
    ]
    np.testing.assert_array_equal(from_dap(parts).compute(), g)


def test_cyclic_reshape_path_with_empty_blocks_elsewhere():
    """Found by hypothesis: an empty block on another axis broke dask's reshape."""
    a = np.arange(2.0).reshape(2, 1)
    parts = to_dap(da.from_array(a, chunks=((0, 2), (1, 0))), dist=["c", None])
    np.testing.assert_array_equal(from_dap(parts).compute(), a)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrays_and_dists(), st.data())
def test_property_padded_export_then_import_is_identity(case, data):
    chunks, dists = case
    comm, bound = [], []
    for c, dist in zip(chunks, dists):
        if dist is None:  # padding applies to block axes
            comm.append(data.draw(st.integers(0, min(c) if len(c) > 1 else 0)))
            bound.append(data.draw(st.integers(0, min(c[0], c[-1]) if len(c) > 1 else sum(c) // 2)))
        else:
            comm.append(0)
            bound.append(0)
    shape = tuple(sum(c) for c in chunks)
    a = np.arange(int(np.prod(shape)), dtype="f8").reshape(shape)
    parts = to_dap(
        da.from_array(a, chunks=chunks), dist=dists, comm_padding=comm, boundary_padding=bound
    )
    validate_distribution(parts)
    np.testing.assert_array_equal(from_dap(parts).compute(), a)
