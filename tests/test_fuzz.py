"""Fuzzing every input surface: each bad input gets a typed error, and nothing breaks.

Surfaces and budgets (default run, derandomized; ``--runslow`` tries ten times as many):

* DAP dicts (``validate``): 400 mutated and generated dicts;
* keys, values and picklers on a live dictionary: 150;
* method arguments on a live dictionary: 150;
* zarr checkpoint stores with mutated bytes: 150.

Constructor arguments (400) and serialized handles (200) are in
``test_arguments.py``, keys across hash seeds (300) in ``test_keys.py``.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from dask_dap import DAPValidationError, validate
from dask_dap.protocol.dims import num_owned_indices
from dask_ddict import DDictError, DDictPersistCheckpointError
from dask_ddict._serialize import dumps_value, loads_value
from dask_ddict.persist import ZarrPersister
from dask_ddict.shard.store import PERSISTENT
from tests.support.fuzz import fuzz
from tests.support.garbage import garbage

# -- DAP dicts -------------------------------------------------------------------------------

small = st.integers(-3, 12)
dim_values = {
    "dist_type": st.sampled_from(["b", "c", "u", "n", "x", None]),
    "size": small,
    "proc_grid_size": small,
    "proc_grid_rank": small,
    "start": small,
    "stop": small,
    "block_size": small,
    "padding": st.one_of(st.tuples(small, small), st.lists(small, max_size=3), small),
    "periodic": st.one_of(st.booleans(), small),
    "one_to_one": st.one_of(st.booleans(), small),
    "indices": st.one_of(
        st.lists(small, max_size=6).map(np.array),
        st.lists(small, max_size=3),
        st.just(np.zeros(2, "f4")),
    ),
}
dims = st.one_of(
    st.just({}),
    st.fixed_dictionaries({}, optional=dim_values),
    st.fixed_dictionaries(
        {
            k: dim_values[k]
            for k in ("dist_type", "size", "proc_grid_size", "proc_grid_rank", "start", "stop")
        }
    ),
    garbage,
)
versions = st.one_of(st.sampled_from(["0.10.0", "0.10.4", "0.10", "0.9.0", "1.0.0"]), garbage)
buffers = st.one_of(
    st.integers(0, 12).map(np.ones),
    st.tuples(st.integers(0, 4), st.integers(0, 4)).map(np.ones),
    st.binary(max_size=6),
    garbage,
)


@st.composite
def dap_dicts(draw):
    d = {
        "__version__": draw(versions),
        "buffer": draw(buffers),
        "dim_data": tuple(draw(st.lists(dims, max_size=3))),
    }
    if draw(st.booleans()):
        d["dim_data"] = list(d["dim_data"])
    for k in draw(
        st.sets(st.sampled_from(["__version__", "buffer", "dim_data", "extra"]), max_size=1)
    ):
        if k == "extra":
            d[k] = 1
        else:
            del d[k]
    return d


@fuzz(400)
@given(dap_dicts())
def test_dap_dicts_are_valid_or_refused_with_a_named_reason(d):
    try:
        validate(d)
    except DAPValidationError as e:
        assert str(e)
        return
    # Accepted: every axis holds exactly what its dimension dict says this rank owns.
    shape = memoryview(d["buffer"]).shape
    assert d["__version__"].startswith("0.10.") and d["__version__"].count(".") == 2
    for i, dim in enumerate(d["dim_data"]):
        if dim:
            owned = (
                dim["stop"] - dim["start"] if dim["dist_type"] == "b" else num_owned_indices(dim)
            )
            assert shape[i] == owned


# -- keys, values and picklers -----------------------------------------------------------------


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("no")


class BadKeyPickler:
    def __init__(self, out):
        self.out = out

    def dumps(self, key):
        if isinstance(self.out, Exception):
            raise self.out
        return self.out

    def loads(self, data):
        return data


class BadValuePickler:
    def __init__(self, mode):
        self.mode = mode

    def dump(self, obj, file):
        if self.mode == "raise":
            raise ValueError("dump failed")
        file.write(b"x" if self.mode == "ok" else self.mode)

    def load(self, file):
        return file.read()


def same(got, want) -> bool:
    """Whether a value read back is the one written (for the kinds ``values`` makes)."""
    if isinstance(want, np.ndarray):
        return np.array_equal(got, want)
    if isinstance(want, float) and want != want:
        return got != got
    if isinstance(want, io.BytesIO):
        return got.getvalue() == want.getvalue()
    if type(want) is object or callable(want):
        return type(got) is type(want) or callable(got)
    return type(got) is type(want) and got == want


values = st.one_of(
    garbage,
    st.just(Unpicklable()),
    st.just(lambda x: x),
    st.just(np.arange(5)),
    st.just(io.BytesIO(b"x")),
)
key_outputs = st.one_of(garbage, st.just(ValueError("boom")), st.just(bytearray(b"k")))
value_modes = st.sampled_from(["ok", "raise", "str"])
TYPED = (TypeError, ValueError, DDictError)


@fuzz(150)
@given(
    key=st.one_of(garbage, st.just(Unpicklable()), st.just(lambda: 1)),
    value=values,
    kout=key_outputs,
    vmode=value_modes,
)
def test_keys_values_and_picklers_round_trip_or_fail_typed(ddict, key, value, kout, vmode):
    if not ddict.get("sentinel"):
        ddict["sentinel"] = "kept"
    try:
        ddict[key] = value
    except TYPED:
        pass
    else:
        assert same(ddict[key], value)
    h = ddict.pickler(key_pickler=BadKeyPickler(kout), value_pickler=BadValuePickler(vmode))
    try:
        h["k"] = value
        assert h["k"] == b"x"
    except TYPED:
        pass
    finally:
        h.detach()
    assert ddict["sentinel"] == "kept"


# -- method arguments ------------------------------------------------------------------------


@fuzz(150)
@given(
    method=st.sampled_from(
        [
            "fetch_add",
            "checkpoint_id",
            "wait_for",
            "manager",
            "restore",
            "pickler",
            "attach",
            "get",
            "pop",
        ]
    ),
    arg=garbage,
)
def test_method_arguments_are_checked(ddict, method, arg):
    from dask_ddict import DDict

    n = "counter\x00"  # a key no generated argument is
    if n not in ddict:
        ddict[n] = 1
    calls = {
        "fetch_add": lambda: ddict.fetch_add(n, arg),
        "checkpoint_id": lambda: setattr(ddict, "checkpoint_id", arg),
        "wait_for": lambda: ddict.wait_for(n, ddict[n], timeout=arg),
        "manager": lambda: ddict.manager(arg).detach(),
        "restore": lambda: ddict.restore(arg),
        "pickler": lambda: ddict.pickler(key_pickler=arg).detach(),
        "attach": lambda: DDict.attach(arg).detach(),
        "get": lambda: ddict.get(arg, None),
        "pop": lambda: ddict.pop(arg, None),
    }
    before = ddict.fetch_add(n, 0)
    try:
        calls[method]()
    except TYPED:
        pass
    ddict.checkpoint_id = 0
    after = ddict.fetch_add(n, 0)
    if method == "fetch_add" and after != before:
        assert after == before + arg  # a valid increment was applied once
        ddict[n] = before
    else:
        assert after == before


# -- zarr stores -----------------------------------------------------------------------------


def _content() -> dict:
    return {f"k{i}".encode(): np.arange(400 * (i + 1), dtype="i4") for i in range(6)}


class Files(dict):
    """File name -> bytes (a short repr: hypothesis prints its arguments)."""

    def __repr__(self) -> str:
        return f"<Files {sorted(self)}>"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A written store (bytes of every file), to mutate copies of."""
    root = tmp_path_factory.mktemp("pristine")
    frames = {k: dumps_value(v).join() for k, v in _content().items()}
    ZarrPersister(str(root), "d", 0, 1, chunk_bytes=4096).write(
        0, lambda: ((k, f, PERSISTENT) for k, f in frames.items())
    )
    files = Files()
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            files[os.path.relpath(p, root)] = open(p, "rb").read()  # noqa: SIM115
    return files


@fuzz(150)
@given(data=st.data())
def test_mutated_stores_never_give_a_wrong_value(pristine, tmp_path_factory, data):
    root = tmp_path_factory.mktemp("mutated")
    names = sorted(pristine)
    victim = data.draw(st.sampled_from(names))
    action = data.draw(st.sampled_from(["flip", "truncate", "delete", "append", "zero"]))
    for name, raw in pristine.items():
        if name == victim:
            if action == "delete":
                continue
            buf = bytearray(raw)
            if action == "flip" and buf:
                pos = data.draw(st.integers(0, len(buf) - 1))
                buf[pos] ^= data.draw(st.integers(1, 255))
            elif action == "truncate":
                buf = buf[: data.draw(st.integers(0, max(0, len(buf) - 1)))]
            elif action == "append":
                buf += b"\x00"
            elif action == "zero":
                buf = bytearray(len(buf))
            raw = bytes(buf)
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
    want = _content()
    try:
        store = ZarrPersister(str(root), "d", 0, 1, chunk_bytes=4096)
        got = {k: loads_value(bytes(v)) for k, v, _ in store.read(0)}
    except DDictPersistCheckpointError as e:
        assert "manager 0" in str(e)
        event(f"{action} {os.path.dirname(victim) or '/'}: refused")
        return
    event(f"{action} {os.path.dirname(victim) or '/'}: read intact")
    # Read without an error: then it must be exactly what was written.
    assert set(got) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v)
