"""DAP 0.10.0 helpers without dask: the reference repository's vectors, every
validation rule with its message, and the owned-count formula against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dask_dap import (
    DAPValidationError,
    global_indices,
    normalize_dim,
    num_owned_indices,
    validate,
    validate_distribution,
)

V = "0.10.0"


def dap(dim, buffer):
    return {"__version__": V, "buffer": buffer, "dim_data": (dim,)}


# -- the reference validator's vectors (tests/test_validator.py) -------------------------

VALID = {
    "block": (
        {
            "dist_type": "b",
            "size": 50,
            "proc_grid_size": 2,
            "proc_grid_rank": 0,
            "start": 0,
            "stop": 10,
        },
        np.ones(10),
    ),
    "cyclic": (
        {"dist_type": "c", "size": 50, "proc_grid_size": 2, "proc_grid_rank": 0, "start": 0},
        np.ones(50),
    ),
    "block_cyclic": (
        {
            "dist_type": "c",
            "size": 50,
            "proc_grid_size": 2,
            "proc_grid_rank": 1,
            "start": 5,
            "block_size": 5,
        },
        np.ones(50),
    ),
    "unstructured": (
        {
            "dist_type": "u",
            "size": 50,
            "proc_grid_size": 2,
            "proc_grid_rank": 1,
            "indices": np.array([1, 22, 44, 49, 9, 33, 21], dtype=np.uint32),
        },
        np.ones(7),
    ),
    "extra_process": (
        {"dist_type": "c", "size": 3, "proc_grid_size": 4, "proc_grid_rank": 0, "start": 0},
        b"a",
    ),
    "empty_process": (
        {"dist_type": "c", "size": 3, "proc_grid_size": 4, "proc_grid_rank": 3, "start": 3},
        b"",
    ),
    "empty_dict_alias": ({}, b""),
    "undistributed_padded_periodic": (
        {
            "dist_type": "b",
            "size": 10,
            "proc_grid_size": 1,
            "proc_grid_rank": 0,
            "start": 0,
            "stop": 10,
            "padding": (2, 2),
            "periodic": True,
        },
        np.ones(10),
    ),
}


#: Reference vectors valid only for the reference's lenient reading: a buffer of 50 for
#: the 25 indices the rank owns (the reference's tests/test_validator.py; docs/guide/dap.md).
LENIENT = {"cyclic", "block_cyclic"}


@pytest.mark.parametrize("name", sorted(VALID))
def test_reference_valid_vectors(name):
    dim, buf = VALID[name]
    validate(dap(dim, buf), strict=False)
    if name in LENIENT:
        with pytest.raises(
            DAPValidationError, match="owns 25 indices along this axis but the buffer has 50"
        ):
            validate(dap(dim, buf))
        validate(dap(dim, buf[:25]))  # what the rank owns: valid
    else:
        validate(dap(dim, buf))


def test_strict_extent_for_every_dist_type():
    """The buffer's extent equals the owned count along each axis, for b, c (any block) and u."""
    cases = [
        (
            {
                "dist_type": "b",
                "size": 10,
                "proc_grid_size": 2,
                "proc_grid_rank": 0,
                "start": 0,
                "stop": 5,
            },
            5,
        ),
        ({"dist_type": "c", "size": 10, "proc_grid_size": 3, "proc_grid_rank": 1, "start": 1}, 3),
        (
            {
                "dist_type": "c",
                "size": 10,
                "proc_grid_size": 2,
                "proc_grid_rank": 1,
                "start": 3,
                "block_size": 3,
            },
            4,
        ),
        (
            {
                "dist_type": "u",
                "size": 10,
                "proc_grid_size": 2,
                "proc_grid_rank": 0,
                "indices": np.array([7, 2, 4]),
            },
            3,
        ),
    ]
    for dim, owned in cases:
        validate(dap(dim, np.ones(owned)))
        for wrong in (owned - 1, owned + 1):
            with pytest.raises(DAPValidationError, match="buffer has|stop - start"):
                validate(dap(dim, np.ones(wrong)))


@pytest.mark.parametrize(
    "version", ["0.10", "0.10.", "v0.10.0", "0.10.0-rc1", "0.10.0.1", 0.1, "0.11.0", "1.10.0"]
)
def test_version_must_be_a_full_0_10_x_string(version):
    with pytest.raises(DAPValidationError, match="__version__"):
        validate({"__version__": version, "buffer": b"", "dim_data": ({},)})
    validate({"__version__": "0.10.7", "buffer": b"", "dim_data": ({},)})


INVALID = {
    "bad_dist_type": (
        {
            "dist_type": "q",
            "size": 50,
            "proc_grid_size": 2,
            "proc_grid_rank": 0,
            "start": 0,
            "stop": 51,
        },
        np.ones(51),
        "dist_type",
    ),
    "block_stop_gt_size": (
        {
            "dist_type": "b",
            "size": 50,
            "proc_grid_size": 2,
            "proc_grid_rank": 0,
            "start": 0,
            "stop": 51,
        },
        np.ones(51),
        "stop",
    ),
    "block_stop_lt_start": (
        {
            "dist_type": "b",
            "size": 50,
            "proc_grid_size": 2,
            "proc_grid_rank": 0,
            "start": 10,
            "stop": 9,
        },
        np.ones(0),
        "stop",
    ),
    "block_negative_start": (
        {
            "dist_type": "b",
            "size": 50,
            "proc_grid_size": 2,
            "proc_grid_rank": 0,
            "start": -1,
            "stop": 10,
        },
        np.ones(11),
        "start",
    ),
    "block_padding_not_ints": (
        {
            "dist_type": "b",
            "size": 50,
            "proc_grid_size": 2,
            "proc_grid_rank": 0,
            "start": 0,
            "stop": 10,
            "padding": ("a", "b"),
        },
        np.ones(10),
        "padding",
    ),
    "cyclic_negative_block_size": (
        {
            "dist_type": "c",
            "size": 100,
            "proc_grid_size": 3,
            "proc_grid_rank": 0,
            "start": 0,
            "block_size": -10,
        },
        np.ones(10),
        "block_size",
    ),
    "unstructured_list_indices": (
        {
            "dist_type": "u",
            "size": 100,
            "proc_grid_size": 2,
            "proc_grid_rank": 0,
            "indices": [1, 2, 3, 4],
        },
        np.ones(4),
        "indices",
    ),
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_reference_invalid_vectors(name):
    dim, buf, key = INVALID[name]
    with pytest.raises(DAPValidationError, match=f"key '{key}'"):
        validate(dap(dim, buf))


@pytest.mark.parametrize(
    "d,match",
    [
        ({"__version__": V, "dim_data": ()}, "missing keys \\['buffer'\\]"),
        ({"buffer": b"", "dim_data": ()}, "missing keys \\['__version__'\\]"),
        ({"__version__": V, "buffer": b""}, "missing keys \\['dim_data'\\]"),
        ({"__version__": V, "buffer": b"", "dim_data": (), "x": 1}, "unknown keys \\['x'\\]"),
        ({"__version__": V, "buffer": [1, 2], "dim_data": ({},)}, "buffer protocol"),
        ({"__version__": "v1.0.0alpha", "buffer": b"", "dim_data": ({},)}, "'major.minor.patch'"),
        ({"__version__": "0.9.0", "buffer": b"", "dim_data": ({},)}, "legacy 0.9"),
        ({"__version__": "1.0.0", "buffer": b"", "dim_data": ({},)}, "not supported"),
        ({"__version__": V, "buffer": b"", "dim_data": [{}]}, "tuple"),
        ({"__version__": V, "buffer": np.ones((2, 2)), "dim_data": ({},)}, "2 dimensions"),
        ("not a dict", "must be a dict"),
    ],
)
def test_top_level_rules(d, match):
    with pytest.raises(DAPValidationError, match=match):
        validate(d)


def B(**kw):
    base = {
        "dist_type": "b",
        "size": 10,
        "proc_grid_size": 2,
        "proc_grid_rank": 0,
        "start": 0,
        "stop": 5,
    }
    base.update(kw)
    return base


@pytest.mark.parametrize(
    "dim,buf,match",
    [
        ({"dist_type": "b"}, np.ones(1), "missing keys"),
        (B(extra=1), np.ones(5), "unknown keys \\['extra'\\]"),
        (B(size=np.int64(10)), np.ones(5), "key 'size': must be a Python int, got int64"),
        (B(size=True), np.ones(5), "key 'size': must be a Python int, got bool"),
        (B(size=-1), np.ones(5), "size must be >= 0"),
        (B(proc_grid_size=0), np.ones(5), "proc_grid_size must be >= 1"),
        (B(proc_grid_rank=2), np.ones(5), "key 'proc_grid_rank'"),
        (B(proc_grid_rank=-1), np.ones(5), "key 'proc_grid_rank'"),
        (B(stop=6), np.ones(5), "stop - start = 6 but the buffer has 5"),
        (B(start=1, stop=6), np.ones(5), "first rank of a block axis starts at 0"),
        (B(padding=[1, 1]), np.ones(5), "padding must be a tuple"),
        (B(padding=(1, -1)), np.ones(5), "padding widths must be Python ints >= 0"),
        (B(padding=(3, 3)), np.ones(5), "wider than the buffer"),
        (B(periodic=1), np.ones(5), "periodic must be a bool"),
        (B(proc_grid_size=1, stop=5), np.ones(5), "holds it all"),
        (B(size=0, stop=0), np.ones(0), None),
        (
            {"dist_type": "c", "size": 10, "proc_grid_size": 2, "proc_grid_rank": 1, "start": 0},
            np.ones(5),
            "start must be proc_grid_rank \\* block_size = 1 \\* 1 = 1, got 0",
        ),
        (
            {"dist_type": "c", "size": 10, "proc_grid_size": 2, "proc_grid_rank": 1, "start": 1},
            np.ones(4),
            "owns 5 indices along this axis but the buffer has 4",
        ),
        (
            {"dist_type": "c", "size": 0, "proc_grid_size": 2, "proc_grid_rank": 0, "start": 0},
            np.ones(1),
            "size is 0, so the buffer must be empty",
        ),
        (
            {
                "dist_type": "c",
                "size": 9,
                "proc_grid_size": 4,
                "proc_grid_rank": 3,
                "start": 9,
                "block_size": 5,
            },
            np.ones(0),
            None,
        ),  # reference utils vector: empty rank, start=size
        (
            {
                "dist_type": "u",
                "size": 5,
                "proc_grid_size": 1,
                "proc_grid_rank": 0,
                "indices": np.array([1, 1]),
            },
            np.ones(2),
            "locally unique",
        ),
        (
            {
                "dist_type": "u",
                "size": 5,
                "proc_grid_size": 1,
                "proc_grid_rank": 0,
                "indices": np.array([1.0, 2.0]),
            },
            np.ones(2),
            "1-d buffer of integers",
        ),
        (
            {
                "dist_type": "u",
                "size": 5,
                "proc_grid_size": 1,
                "proc_grid_rank": 0,
                "indices": np.array([1, 2]),
                "one_to_one": "yes",
            },
            np.ones(2),
            "one_to_one must be a bool",
        ),
        (
            {
                "dist_type": "u",
                "size": 5,
                "proc_grid_size": 1,
                "proc_grid_rank": 0,
                "indices": np.array([], dtype=int),
            },
            np.ones(1),
            "no indices, so the buffer must be empty",
        ),
        ({"dist_type": "n", "size": 5}, np.ones(5), "legacy 0.9"),
    ],
)
def test_dimension_rules(dim, buf, match):
    if match is None:
        validate(dap(dim, buf))
        return
    with pytest.raises(DAPValidationError, match=match) as info:
        validate(dap(dim, buf), rank=3)
    assert "rank 3, dimension 0" in str(info.value)
    assert isinstance(info.value, ValueError) and info.value.rank == 3 and info.value.dim == 0


# -- owned counts and global indices ----------------------------------------------------------


def brute_cyclic(size, procs, bs, rank):
    return [g for g in range(size) if (g // bs) % procs == rank]


def test_cyclic_owned_count_and_indices_match_brute_force():
    """Every (size, P, block_size) in 0..24 x 1..5 x 1..6 (the reference formula fails 434)."""
    for size, procs, bs in itertools.product(range(0, 25), range(1, 6), range(1, 7)):
        total = 0
        for r in range(procs):
            d = {
                "dist_type": "c",
                "size": size,
                "proc_grid_size": procs,
                "proc_grid_rank": r,
                "start": r * bs,
                "block_size": bs,
            }
            want = brute_cyclic(size, procs, bs, r)
            assert num_owned_indices(d) == len(want), (size, procs, bs, r)
            assert global_indices(d).tolist() == want
            total += len(want)
        assert total == size


def test_reference_utils_vectors():
    vectors = [
        (
            {
                "size": 50,
                "dist_type": "b",
                "proc_grid_rank": 0,
                "proc_grid_size": 10,
                "start": 0,
                "stop": 10,
            },
            10,
        ),
        (
            {
                "size": 50,
                "dist_type": "b",
                "proc_grid_rank": 7,
                "proc_grid_size": 10,
                "start": 30,
                "stop": 40,
            },
            10,
        ),
        (
            {
                "size": 100,
                "dist_type": "b",
                "proc_grid_rank": 0,
                "proc_grid_size": 10,
                "start": 0,
                "stop": 20,
                "padding": (3, 4),
            },
            16,
        ),
        (
            {
                "size": 100,
                "dist_type": "b",
                "proc_grid_rank": 9,
                "proc_grid_size": 10,
                "start": 80,
                "stop": 100,
                "padding": (3, 4),
            },
            17,
        ),
        (
            {
                "size": 100,
                "dist_type": "b",
                "proc_grid_rank": 3,
                "proc_grid_size": 10,
                "start": 50,
                "stop": 70,
                "padding": (3, 4),
            },
            13,
        ),
        (
            {
                "size": 100,
                "dist_type": "b",
                "proc_grid_rank": 0,
                "proc_grid_size": 1,
                "start": 0,
                "stop": 100,
                "padding": (3, 4),
            },
            100,
        ),
        (
            {
                "block_size": 1,
                "dist_type": "c",
                "proc_grid_rank": 0,
                "proc_grid_size": 4,
                "size": 9,
                "start": 0,
            },
            3,
        ),
        (
            {
                "block_size": 1,
                "dist_type": "c",
                "proc_grid_rank": 3,
                "proc_grid_size": 4,
                "size": 9,
                "start": 3,
            },
            2,
        ),
        (
            {
                "block_size": 2,
                "dist_type": "c",
                "proc_grid_rank": 0,
                "proc_grid_size": 4,
                "size": 9,
                "start": 0,
            },
            3,
        ),
        (
            {
                "block_size": 5,
                "dist_type": "c",
                "proc_grid_rank": 3,
                "proc_grid_size": 4,
                "size": 9,
                "start": 9,
            },
            0,
        ),
        (
            {
                "dist_type": "u",
                "indices": bytearray([4, 3, 2]),
                "proc_grid_rank": 1,
                "proc_grid_size": 2,
                "size": 5,
            },
            3,
        ),
    ]
    for d, n in vectors:
        assert num_owned_indices(d) == n, d


def test_the_reference_partial_block_bug_is_not_copied():
    # size 10, P 2, block_size 3: blocks [0-2]->0 [3-5]->1 [6-8]->0 [9]->1: (6, 4), not (7, 3).
    d = {"dist_type": "c", "size": 10, "proc_grid_size": 2, "block_size": 3}
    assert [num_owned_indices({**d, "proc_grid_rank": r, "start": 3 * r}) for r in (0, 1)] == [6, 4]


def test_padded_block_global_indices_and_alias():
    d = {
        "dist_type": "b",
        "size": 18,
        "proc_grid_size": 2,
        "proc_grid_rank": 1,
        "start": 8,
        "stop": 18,
        "padding": (1, 1),
    }
    assert global_indices(d).tolist() == list(range(9, 18))  # the halo cell 8 is not owned
    assert normalize_dim({}, 4) == {
        "dist_type": "b",
        "size": 4,
        "proc_grid_size": 1,
        "proc_grid_rank": 0,
        "start": 0,
        "stop": 4,
        "padding": (0, 0),
        "periodic": False,
    }
    assert (
        normalize_dim(
            {"dist_type": "c", "size": 3, "proc_grid_size": 1, "proc_grid_rank": 0, "start": 0}, 3
        )["block_size"]
        == 1
    )
    with pytest.raises(ValueError, match="normalize_dim"):
        num_owned_indices({})


# -- across ranks ----------------------------------------------------------------------------


def block_parts(chunks, padding=None):
    parts, start = [], 0
    size = sum(chunks)
    for r, n in enumerate(chunks):
        d = {
            "dist_type": "b",
            "size": size,
            "proc_grid_size": len(chunks),
            "proc_grid_rank": r,
            "start": start,
            "stop": start + n,
        }
        if padding:
            d["padding"] = padding[r]
        parts.append(dap(d, np.zeros(n)))
        start += n
    return parts


def test_distribution_rules():
    validate_distribution(block_parts([3, 0, 2]))  # an empty block in the middle
    with pytest.raises(DAPValidationError, match="3 ranks but 2 DAP dicts"):
        validate_distribution(block_parts([3, 2, 1])[:2])
    parts = block_parts([3, 2])
    parts[1] = parts[0]
    with pytest.raises(DAPValidationError, match="appear twice"):
        validate_distribution(parts)
    parts = block_parts([3, 2])
    parts[1]["buffer"] = np.zeros(2, dtype="f4")
    with pytest.raises(DAPValidationError, match="different dtypes"):
        validate_distribution(parts)
    parts = block_parts([3, 2])
    parts[1]["dim_data"][0].update(start=2, stop=4)  # overlaps rank 0
    with pytest.raises(
        DAPValidationError, match="rank 1, dimension 0, key 'start': owns indices from 2"
    ):
        validate_distribution(parts)
    parts = block_parts([3, 2])
    parts[1]["dim_data"][0]["size"] = 6
    with pytest.raises(DAPValidationError, match="key 'size'"):
        validate_distribution(parts)
    with pytest.raises(DAPValidationError, match="no DAP dicts"):
        validate_distribution([])


def test_padding_rules_across_ranks():
    # The protocol's table: boundary 4 / 0, communication widths 1, 2, 3.
    pads = [(4, 1), (1, 2), (2, 3), (3, 0)]
    owned = [6, 5, 5, 4]  # rank 0 owns its 4 boundary cells too
    parts, g = [], 0
    for r, (lo, hi) in enumerate(pads):
        cl = lo if r > 0 else 0
        cr = hi if r < 3 else 0
        d = {
            "dist_type": "b",
            "size": 20,
            "proc_grid_size": 4,
            "proc_grid_rank": r,
            "start": g - cl,
            "stop": g + owned[r] + cr,
            "padding": (lo, hi),
        }
        parts.append(dap(d, np.zeros(owned[r] + cl + cr)))
        g += owned[r]
    validate_distribution(parts)
    bad = [dict(p, dim_data=(dict(p["dim_data"][0]),)) for p in parts]
    bad[1]["dim_data"][0]["padding"] = (2, 2)
    bad[1]["dim_data"][0]["start"] -= 1
    bad[1]["buffer"] = np.zeros(len(bad[1]["buffer"]) + 1)
    with pytest.raises(
        DAPValidationError, match="communication padding 1 on its high side does not match 2"
    ):
        validate_distribution(bad)
    wide = block_parts([4, 1, 4], padding=[(0, 2), (2, 2), (2, 0)])
    for p, (s, e) in zip(wide, [(0, 6), (2, 7), (3, 9)]):
        p["dim_data"][0].update(start=s, stop=e)
        p["buffer"] = np.zeros(e - s)
    with pytest.raises(DAPValidationError, match="wider than the 1 indices its neighbour"):
        validate_distribution(wide)


def test_unstructured_cover_rules():
    def u(r, idx, n=3, o2o=False):
        return dap(
            {
                "dist_type": "u",
                "size": 4,
                "proc_grid_size": 2,
                "proc_grid_rank": r,
                "indices": np.array(idx),
                "one_to_one": o2o,
            },
            np.zeros(n),
        )

    validate_distribution([u(0, [0, 1, 2]), u(1, [1, 3, 2])])  # duplicates allowed
    with pytest.raises(DAPValidationError, match="cover 3 of 4"):
        validate_distribution([u(0, [0, 1, 2]), u(1, [1, 2, 0])])
    with pytest.raises(DAPValidationError, match="outside \\[0, 4\\)"):
        validate_distribution([u(0, [0, 1, -1]), u(1, [1, 3, 2])])
    with pytest.raises(DAPValidationError, match="one_to_one"):
        validate_distribution([u(0, [0, 1, 2], o2o=True), u(1, [1, 3, 2], o2o=True)])
    with pytest.raises(DAPValidationError, match="owns 3 indices along this axis but the buffer"):
        validate_distribution([u(0, [0, 1, 2], n=4), u(1, [1, 3, 2])])
