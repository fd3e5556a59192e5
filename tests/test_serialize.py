from __future__ import annotations

import threading

import numpy as np
import pytest

from dask_ddict._keys import dumps_key
from dask_ddict._serialize import (
    ALIGN,
    FRAME_BASE,
    aligned_empty,
    copy_frame,
    dumps_value,
    loads_value,
    older_frame,
)
from dask_ddict.errors import DDictSerializationError


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


@pytest.mark.parametrize(
    "value",
    [1, "s", b"bytes", None, (1, "a"), {"x": [1, 2]}, np.arange(7), np.zeros((3, 4), "f4")],
)
def test_value_round_trip(value):
    framed = dumps_value(value)
    out = loads_value(framed.join())
    if isinstance(value, np.ndarray):
        np.testing.assert_array_equal(out, value)
        assert out.dtype == value.dtype
    else:
        assert out == value
    assert framed.nbytes == len(framed.join())


def test_large_buffers_are_out_of_band_and_aligned():
    arrays = [np.arange(1000, dtype="f8"), np.ones(333, dtype="u1"), np.arange(5000, dtype="i4")]
    framed = dumps_value(arrays)
    buf = aligned_empty(framed.nbytes)
    buf[:] = framed.join()
    assert _addr(np.frombuffer(buf, np.uint8)) % ALIGN == FRAME_BASE
    out = loads_value(buf)
    for a, b in zip(arrays, out):
        np.testing.assert_array_equal(a, b)
        assert _addr(b) % ALIGN == 0
        assert np.shares_memory(b, np.frombuffer(buf, np.uint8))  # zero-copy view


def test_noncontiguous_array_round_trips():
    a = np.arange(100).reshape(10, 10)[:, ::3]
    np.testing.assert_array_equal(loads_value(dumps_value(a).join()), a)


def test_copy_frame_small_and_large():
    small = dumps_value(b"x" * 10).join()
    assert isinstance(copy_frame(memoryview(small)), bytes)
    big = dumps_value(np.arange(10_000.0)).join()
    cp = copy_frame(memoryview(big))
    np.testing.assert_array_equal(loads_value(cp), np.arange(10_000.0))


def test_unpicklable_value_names_its_type():
    with pytest.raises(DDictSerializationError, match="lock"):
        dumps_value(threading.Lock())


def test_unpicklable_key_names_its_type():
    with pytest.raises(DDictSerializationError, match="lock"):
        dumps_key(threading.Lock())


def test_lambda_values_fall_back_to_cloudpickle():
    f = loads_value(dumps_value(lambda x: x + 1).join())
    assert f(1) == 2


def test_key_identity_is_the_serialized_bytes():
    assert len({dumps_key(1), dumps_key(1.0), dumps_key(True)}) == 3
    assert dumps_key(("a", 1)) == dumps_key(("a", 1))


class JsonPickler:
    """A custom value pickler with the file interface."""

    def dump(self, obj, file):
        file.write(repr(obj).encode())

    def load(self, file):
        return eval(file.read().decode())  # test-only


def test_custom_value_pickler_and_mismatch():
    framed = dumps_value({"a": 1}, JsonPickler())
    assert loads_value(framed.join(), JsonPickler()) == {"a": 1}
    with pytest.raises(DDictSerializationError, match="custom value pickler"):
        loads_value(framed.join())


def test_custom_value_pickler_failure_is_wrapped():
    class Bad:
        def dump(self, obj, file):
            raise RuntimeError("nope")

        def load(self, file):
            return None

    with pytest.raises(DDictSerializationError, match="nope"):
        dumps_value(1, Bad())


def test_bytes_and_memoryviews_are_framed_raw_without_a_copy():
    """A bytes value is its own payload (FMT_BYTES: no pickle); a memoryview is stored as
    its bytes; bytes_view reads the payload as a view of the frame, loads_value as bytes."""
    from dask_ddict._serialize import FMT_BYTES, bytes_view

    data = np.arange(1 << 16, dtype="f8")
    framed = dumps_value(memoryview(data))
    assert any(p.obj is data for p in framed.parts if isinstance(p, memoryview))  # not copied
    frame = framed.join()
    assert frame[0] == FMT_BYTES and framed.nbytes == len(frame) == 16 + data.nbytes
    assert loads_value(frame) == data.tobytes() and type(loads_value(frame)) is bytes
    view = bytes_view(frame)
    assert isinstance(view, memoryview) and view.readonly and view.obj is frame
    assert view == data.tobytes()
    assert bytes_view(dumps_value(b"").join()) == b""
    assert bytes_view(dumps_value({"a": 1}).join()) == {"a": 1}  # other frames: the value
    with pytest.raises(DDictSerializationError, match="memoryview"):
        dumps_value(memoryview(np.zeros((4, 4))[:, ::2]))  # not contiguous


def test_a_noncontiguous_memoryview_is_refused_when_put():
    view = memoryview(b"abcdef")[::2]
    with pytest.raises(DDictSerializationError, match="C-contiguous"):
        dumps_value(view)
    assert loads_value(dumps_value(memoryview(b"abcdef")[1:4]).join()) == b"bcd"


def test_a_raw_bytes_frame_knows_its_older_pickled_form():
    """What a version before raw frames stored for b"..." (a pickle in band), so that
    wait_for matches a value restored from an older checkpoint."""
    import pickle
    import struct

    value = b"ready" * 3
    payload = pickle.dumps(value, 5)
    legacy = struct.pack("<BxxxIQ", 0, 0, len(payload)) + payload  # the old framing
    assert older_frame(dumps_value(value).join()) == legacy
    assert loads_value(legacy) == value
    assert older_frame(dumps_value("not bytes").join()) is None


def test_wait_for_matches_a_bytes_value_in_its_older_frame(tmp_path):
    from dask_ddict.shard.manager import Manager
    from dask_ddict.shard.store import ShardStore
    from dask_ddict.shard.working_set import WorkingSet
    from tests.support.manager_calls import k

    store = ShardStore(str(tmp_path / "shard"), 16 << 20)
    m = Manager(0, store, WorkingSet(store, 1))
    try:
        digest, kb = k("flag")
        new = dumps_value(b"ready").join()
        m.put(digest, kb, older_frame(new), 0, 1)  # as an older writer stored it
        m.wait_for(digest, 0, new, timeout=2)  # returns at once, no timeout
    finally:
        m.close()
