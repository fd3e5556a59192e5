"""DDictStore: a DDict as a zarr v3 store, on the session's real cluster.

zarr's own conformance suite (``zarr.testing.store.StoreTests``, async: run by
pytest-asyncio in strict mode, marked here only) and its hypothesis state
machine; then the stack: dask.array and xarray round trips, tasks writing
their chunks on the manager's host, checkpoints and persistence.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import pickle
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
import pytest_asyncio
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import cpu, default_buffer_prototype
from zarr.storage import LocalStore, MemoryStore
from zarr.storage._utils import _normalize_byte_range_index
from zarr.testing.stateful import ZarrStoreStateMachine
from zarr.testing.store import StoreTests

from dask_ddict import AsyncDDict, DDict, DDictSerializationError, DDictStore
from dask_ddict.stores.names import byte_slice, children, dir_base, store_names
from tests.support.threads import count_to_thread

_ids = itertools.count()
#: Keys of the same dictionary that are not any store's: listing must skip them.
FOREIGN = {42: "an int key", ("tuple", 1): b"bytes under a tuple key", b"bytes-key": b"x"}


@pytest.fixture(scope="module")
def zd(cluster):
    """One dictionary for the module (a store's namespace is its prefix)."""
    from distributed import Client

    from tests.support.twohost import TWO_HOSTS

    with Client(cluster.scheduler_address if TWO_HOSTS else cluster) as c:
        d = DDict(total_mem="256 MiB", client=c)
        yield d
        d.destroy()


def _fresh(zd: DDict, prefix: str) -> dict[str, Any]:
    if not prefix:
        zd.clear()
    zd.update(FOREIGN)
    zd["elsewhere/zarr.json"] = b"{}"  # (another store's key: ignored unless prefix is "")
    return {"ddict": zd, "prefix": prefix}


def _asyncio_marked(cls: type) -> type:
    """Mark the suite's coroutine tests (only those) for pytest-asyncio's strict mode."""
    for name in dir(cls):
        f = getattr(cls, name)
        if name.startswith("test_") and inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def test(*args: Any, __f: Any = f, **kwargs: Any) -> None:
                await __f(*args, **kwargs)

            setattr(cls, name, pytest.mark.asyncio(test))
    return cls


@_asyncio_marked
class TestDDictStore(StoreTests[DDictStore, cpu.Buffer]):
    """zarr's suite on a store whose prefix is unique per test (the namespace of one store)."""

    store_cls = DDictStore
    buffer_cls = cpu.Buffer

    @pytest.fixture
    def store_kwargs(self, zd: DDict) -> dict[str, Any]:
        return _fresh(zd, f"suite{next(_ids)}/")

    # (strict mode: async fixtures are pytest-asyncio's; the suite's plain ones are not run)
    @pytest_asyncio.fixture
    async def store(self, open_kwargs: dict[str, Any]) -> DDictStore:
        return await self.store_cls.open(**open_kwargs)

    @pytest_asyncio.fixture
    async def store_not_open(self, store_kwargs: dict[str, Any]) -> DDictStore:
        return self.store_cls(**store_kwargs)

    async def set(self, store: DDictStore, key: str, value: cpu.Buffer) -> None:
        # Straight into the dictionary: what a user's d[k] = b"..." writes.
        await asyncio.to_thread(store.ddict.__setitem__, store.prefix + key, value.to_bytes())

    async def get(self, store: DDictStore, key: str) -> cpu.Buffer:
        raw = await asyncio.to_thread(store.ddict.__getitem__, store.prefix + key)
        assert type(raw) is bytes  # the dictionary holds plain bytes
        return self.buffer_cls.from_bytes(raw)

    def test_store_repr(self, store: DDictStore) -> None:
        text = repr(store)
        assert text.startswith("<DDictStore ") and repr(store.prefix) in text
        assert str(store) == f"ddict://{store.ddict.get_name()}/{store.prefix}"

    def test_store_supports_writes(self, store: DDictStore) -> None:
        assert store.supports_writes

    def test_store_supports_listing(self, store: DDictStore) -> None:
        assert store.supports_listing


class TestDDictStoreNoPrefix(TestDDictStore):
    """The same suite with ``prefix=""``: the whole dictionary's str keys are the store's."""

    @pytest.fixture
    def store_kwargs(self, zd: DDict) -> dict[str, Any]:
        kwargs = _fresh(zd, "")
        zd.pop("elsewhere/zarr.json")  # (with no prefix every str key is the store's)
        return kwargs


def test_zarr_store_state_machine(zd):
    """zarr's hypothesis state machine: random sets, gets, deletes, clears and listings."""
    kwargs = _fresh(zd, f"machine{next(_ids)}/")

    def machine() -> ZarrStoreStateMachine:
        return ZarrStoreStateMachine(DDictStore(**kwargs))

    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=8,
            stateful_step_count=8,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert zd[42] == "an int key"  # clear() removed only the store's keys


# -- the pure helpers ------------------------------------------------------------------

_ranges = st.one_of(
    st.none(),
    st.tuples(st.integers(0, 40), st.integers(0, 40)).map(
        lambda t: RangeByteRequest(min(t), max(t))
    ),
    st.integers(0, 40).map(OffsetByteRequest),
    st.integers(0, 40).map(SuffixByteRequest),
)


@given(data=st.binary(max_size=32), byte_range=_ranges)
def test_byte_slice_is_zarrs_local_store_semantics(data, byte_range):
    got = bytes(byte_slice(memoryview(data), byte_range))
    if isinstance(byte_range, SuffixByteRequest):  # (LocalStore's: a suffix past the start is all)
        assert got == data[max(0, len(data) - byte_range.suffix) :]
    else:
        start, stop = _normalize_byte_range_index(cpu.Buffer.from_bytes(data), byte_range)
        assert got == data[start:stop]


def test_names_skip_foreign_keys_and_children_are_unique():
    keys = [42, ("a/x",), b"p/a", "p/a/zarr.json", "p/a/c/0", "p/a/c/1", "p/b", "q/a", "p"]
    assert list(store_names(keys, "p/", "")) == ["a/zarr.json", "a/c/0", "a/c/1", "b"]
    assert list(store_names(keys, "p/", "a/")) == ["a/zarr.json", "a/c/0", "a/c/1"]
    assert dir_base("") == dir_base("/") == "" and dir_base("a/b/") == dir_base("a/b") == "a/b/"
    names = store_names(keys, "p/", "a/")
    assert list(children(names, "a/")) == ["zarr.json", "c"]


# -- arguments -------------------------------------------------------------------------

_not_str = st.one_of(st.integers(), st.binary(), st.none(), st.lists(st.text(), max_size=2))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(bad=_not_str)
def test_bad_arguments_raise_typed_errors_naming_them(zd, bad):
    with pytest.raises(TypeError, match="prefix"):
        DDictStore(zd, prefix=bad)
    with pytest.raises(TypeError, match="ddict"):
        DDictStore(bad)
    if not isinstance(bad, bool):
        with pytest.raises(TypeError, match="read_only"):
            DDictStore(zd, read_only=bad)
    store = DDictStore(zd, prefix="args/")
    proto = default_buffer_prototype()
    with pytest.raises(TypeError, match="key"):
        store.get_sync(bad, prototype=proto)
    with pytest.raises(TypeError, match="key"):
        zarr.core.sync.sync(store.get(bad, proto))
    with pytest.raises(TypeError, match="value"):
        zarr.core.sync.sync(store.set("k", bad))
    with pytest.raises(TypeError, match="byte_range"):
        store.get_sync("k", prototype=proto, byte_range=(0, 2))


def test_custom_pickler_handles_and_non_bytes_values_are_refused(zd):
    with pytest.raises(ValueError, match="ddict"):
        DDictStore(zd.pickler(value_pickler=pickle))
    zd["mixed/zarr.json"] = {"not": "bytes"}
    store = DDictStore(zd, prefix="mixed/")
    with pytest.raises(TypeError, match="not bytes"):
        store.get_sync("zarr.json")
    zd.pop("mixed/zarr.json")


def _listed(store: DDictStore) -> list[str]:
    async def names() -> list[str]:
        return [k async for k in store.list()]

    return sorted(zarr.core.sync.sync(names()))


def test_a_prefix_is_a_directory_and_clear_keeps_to_it(zd):
    """``prefix="run1"`` is ``"run1/"``: it never takes ``run10/...`` for its own."""
    zd["run10/zarr.json"] = b"{}"
    zd["run1/zarr.json"] = b"{}"
    store = DDictStore(zd, prefix="run1")
    assert store.prefix == "run1/" and _listed(store) == ["zarr.json"]
    zarr.core.sync.sync(store.clear())
    assert "run10/zarr.json" in zd and "run1/zarr.json" not in zd
    zd.pop("run10/zarr.json")


def test_keys_of_a_custom_key_pickler_are_skipped_by_listing(zd):
    class Upper:
        @staticmethod
        def dumps(key):
            return key.upper().encode()

        @staticmethod
        def loads(data):
            return bytes(data).decode().lower()

    zd.pickler(key_pickler=Upper)["custom/odd"] = b"v"  # key bytes that are not a pickle
    zd["custom/zarr.json"] = b"{}"
    store = DDictStore(zd, prefix="custom/")
    assert _listed(store) == ["zarr.json"]  # no error: the odd key is not the store's
    assert not zarr.core.sync.sync(store.is_empty(""))
    zd.pickler(key_pickler=Upper).pop("custom/odd")
    zd.pop("custom/zarr.json")


# -- the dictionary and the store see each other ---------------------------------------------


def test_keys_are_the_dictionarys_str_keys_and_values_bytes(zd):
    store = DDictStore(zd, prefix="both/")
    g = zarr.create_group(store, zarr_format=3, attributes={"title": "t"})
    raw = zd["both/zarr.json"]
    assert type(raw) is bytes and b'"node_type": "group"' in raw and b'"title"' in raw
    zd["both/sub/zarr.json"] = b'{"zarr_format": 3, "node_type": "group", "attributes": {}}'
    assert "sub" in list(g.group_keys())  # written to the dict, seen by the store
    # A memoryview is stored as its bytes (no pickle), and reads back as bytes.
    big = np.arange(1 << 16, dtype="u1")
    zd["both/raw"] = memoryview(big)
    assert zd["both/raw"] == big.tobytes()
    assert (
        bytes(store.get_sync("raw", byte_range=RangeByteRequest(3, 9)).to_bytes())
        == big[3:9].tobytes()
    )
    zarr.core.sync.sync(store.delete_dir(""))
    assert not any(type(k) is str and k.startswith("both/") for k in zd)


def test_equality_pickling_and_modes(zd, client):
    store = DDictStore(zd, prefix="eq/")
    assert store == DDictStore(AsyncDDict(zd), prefix="eq/")
    assert store != DDictStore(zd, prefix="eq2/")
    assert store != store.with_read_only(True) and store.with_read_only(True).read_only
    other = zd.manager(0)
    assert DDictStore(other, prefix="eq/") != store  # (one manager's keys only)
    at1 = DDict.attach(zd.serialize(), client=client)
    at1.checkpoint_id = zd.checkpoint_id + 1
    assert DDictStore(at1, prefix="eq/") != store  # (another checkpoint: other data)
    blob = pickle.dumps(store)
    assert pickle.loads(blob) == store
    # By reference: no more than the handle's own reference, whatever the managers.
    assert len(blob) < len(pickle.dumps(zd)) + 200
    assert b"tcp://" not in blob.replace(zd._core.ref.scheduler.encode(), b"")


# -- byte ranges, cut where the value lives -------------------------------------------------


def _attached(d: DDict, client: Any, **settings: Any) -> DDict:
    """A handle of ``d`` whose channels are made under ``ddict.<settings>``."""
    with dask.config.set({f"ddict.{k}": v for k, v in settings.items()}):
        h = DDict.attach(d.serialize(), client=client)
        for m in range(d.num_managers):
            h._core.channel(m)
    return h


@pytest.fixture
def paths(zd, client):
    """The three ways to a value: its shard beside this process, the host process's Unix
    socket (direct reads off), TCP (as from another host)."""
    handles = {
        "shm": zd,
        "uds": _attached(zd, client, **{"local-read": False}),
        "tcp": _attached(zd, client, **{"local-transport": False}),
    }
    for kind, h in handles.items():
        assert {h._core.channel(m).kind for m in range(h.num_managers)} == {kind}
    yield handles
    for h in handles.values():
        if h is not zd:
            h.detach()


@pytest.fixture
def wire(monkeypatch):
    """Every request this process sends a host process: ``(operation, bytes of its reply)``."""
    from dask_ddict.transport import socket_client

    sent: list[tuple[str, int]] = []
    call, send = (
        socket_client.HostLink.call,
        socket_client.HostLink.send,
    )  # (every request goes out by one)

    def note(o, got):  # noqa: ANN001, ANN202
        sent.append((type(o).__name__, 0 if got[1] is None else memoryview(got[1]).nbytes))
        return got

    def sending(self, o, *rest):  # noqa: ANN001, ANN002, ANN202
        answer = send(self, o, *rest)
        return lambda: note(o, answer())

    monkeypatch.setattr(
        socket_client.HostLink, "call", lambda self, o, mid: note(o, call(self, o, mid))
    )
    monkeypatch.setattr(socket_client.HostLink, "send", sending)
    return sent


_proto = default_buffer_prototype()
_SIZES = (0, 1, 7, 300, 70_000)  # (70 000: past the sizes copied and received as bytes)


def _value(n: int) -> bytes:
    return np.random.default_rng(n).integers(0, 256, n, dtype="u1").tobytes()


def _zarrs(local: LocalStore, n: int, byte_range: Any) -> bytes:
    """What zarr's own stores read: ``MemoryStore``'s bytes, but ``LocalStore``'s for a
    suffix longer than the value (the whole value; ``MemoryStore`` wraps around)."""
    data = _value(n)
    if isinstance(byte_range, SuffixByteRequest) and byte_range.suffix > n:
        got = zarr.core.sync.sync(local.get(f"v{n}", _proto, byte_range))
    else:
        mem = MemoryStore({"v": cpu.Buffer.from_bytes(data)})
        got = zarr.core.sync.sync(mem.get("v", _proto, byte_range))
    return got.to_bytes()


def _any_range(n: int) -> st.SearchStrategy[Any]:
    """Any request of zarr's, in and around a value of ``n`` bytes (negative bounds too)."""
    bound = st.integers(-(n + 3), n + 3) | st.sampled_from([0, n, n + 1, 1 << 40, -(1 << 40)])
    return st.one_of(
        st.tuples(bound, bound).map(lambda t: RangeByteRequest(*t)),
        bound.map(OffsetByteRequest),
        bound.map(SuffixByteRequest),
    )


@pytest.mark.one_host
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_byte_ranges_read_what_zarrs_own_stores_read_on_every_path(zd, paths, tmp_path, data):
    prefix = "ranges/"
    local = LocalStore(str(tmp_path))
    for n in _SIZES:
        if not (tmp_path / f"v{n}").exists():
            (tmp_path / f"v{n}").write_bytes(_value(n))
            zd[f"{prefix}v{n}"] = _value(n)
    n = data.draw(st.sampled_from(_SIZES))
    byte_range = data.draw(_any_range(n))
    expected = _zarrs(local, n, byte_range)
    for kind, h in paths.items():
        store = DDictStore(h, prefix=prefix)
        got = store.get_sync(f"v{n}", byte_range=byte_range)
        assert got.to_bytes() == expected, (kind, n, byte_range)
        got = zarr.core.sync.sync(store.get(f"v{n}", _proto, byte_range))
        assert got.to_bytes() == expected, (kind, n, byte_range)
        assert zarr.core.sync.sync(store.getsize(f"v{n}")) == n, kind


@pytest.mark.one_host
def test_a_byte_range_moves_its_bytes_only_and_getsize_none(zd, paths, wire, monkeypatch):
    """Beside the shard nothing is sent and only the range is copied out of it; over a
    socket one ``GetRange`` brings the range back (or, for ``getsize``, nothing of the
    value)."""
    from dask_ddict.transport import mapped

    copied: list[int] = []
    real = mapped._View.copy
    monkeypatch.setattr(
        mapped._View,
        "copy",
        lambda self, frame, part=None: (
            copied.append((frame if part is None else part).nbytes) or real(self, frame, part)
        ),
    )  # (what is copied)
    value = _value(1 << 20)
    zd["moved/v"] = value
    for kind, h in paths.items():
        store = DDictStore(h, prefix="moved/")
        wire.clear()
        copied.clear()
        got = zarr.core.sync.sync(store.get("v", _proto, RangeByteRequest(1000, 1100)))
        assert got.to_bytes() == value[1000:1100]
        assert store.get_sync("v", byte_range=SuffixByteRequest(5)).to_bytes() == value[-5:]
        assert zarr.core.sync.sync(store.getsize("v")) == 1 << 20
        expected = [] if kind == "shm" else [("GetRange", 100), ("GetRange", 5), ("GetRange", 0)]
        assert wire == expected, kind
        assert copied == ([100, 5, 0] if kind == "shm" else []), kind
    zd.pop("moved/v")


@pytest.mark.one_host
def test_a_byte_range_of_a_shard_mapped_here_is_read_on_the_event_loop(
    zd, paths, client, monkeypatch
):
    """A byte range, and ``getsize``, of a value whose shard is mapped here, through a
    channel made already, is read on the event loop itself as zarr awaits it (a part's
    copy, where a worker thread's round trip costs more than the read); a value that is
    not raw bytes, a handle whose channel is not made yet, and every read through a
    socket go to a worker thread, with the same answers."""
    threads = count_to_thread(monkeypatch)
    value = _value(70_000)
    zd["loop/v"] = value
    zd["loop/ba"] = bytearray(b"0123456789")  # (pickled: read whole, and cut here)
    fresh = DDict.attach(zd.serialize(), client=client)  # (no channel made yet)
    try:
        for kind, h in {**paths, "fresh": fresh}.items():
            store = DDictStore(h, prefix="loop/")
            threads.clear()
            got = zarr.core.sync.sync(store.get("v", _proto, RangeByteRequest(10, 20)))
            assert got.to_bytes() == value[10:20], kind
            assert zarr.core.sync.sync(store.getsize("v")) == len(value), kind
            assert zarr.core.sync.sync(store.get("nope", _proto, OffsetByteRequest(1))) is None
            assert (not threads) == (kind == "shm"), (kind, threads)
            threads.clear()
            got = zarr.core.sync.sync(store.get("ba", _proto, RangeByteRequest(2, 5)))
            assert got.to_bytes() == b"234" and len(threads) == 1, kind
    finally:
        fresh.detach()
    zd.pop("loop/v")
    zd.pop("loop/ba")


@pytest.mark.one_host
def test_a_byte_range_of_a_value_that_is_not_raw_bytes(zd, paths):
    """The value's host refuses to cut a pickled value (typed), and the store reads it
    whole: a ``bytearray`` (bytes-like, pickled) is cut here, anything else is no store
    value (``TypeError``, as a whole read says); an absent key is ``None``."""
    zd["pickled/ba"] = bytearray(b"0123456789")
    zd["pickled/obj"] = {"not": "bytes"}
    for h in paths.values():
        with pytest.raises(DDictSerializationError, match="not raw bytes"):
            h._get_range("pickled/ba", 0, 2)
        store = DDictStore(h, prefix="pickled/")
        assert store.get_sync("ba", byte_range=RangeByteRequest(2, 5)).to_bytes() == b"234"
        assert zarr.core.sync.sync(store.getsize("ba")) == 10
        with pytest.raises(TypeError, match="not bytes"):
            store.get_sync("obj", byte_range=OffsetByteRequest(1))
        with pytest.raises(TypeError, match="not bytes"):
            zarr.core.sync.sync(store.getsize("obj"))
        assert store.get_sync("absent", byte_range=OffsetByteRequest(1)) is None
        with pytest.raises(FileNotFoundError):
            zarr.core.sync.sync(store.getsize("absent"))
    zd.pop("pickled/ba")
    zd.pop("pickled/obj")


#: A sharded array: one 16 MiB shard of 64 inner chunks of 256 KiB (incompressible).
_SHARD, _INNER = 1 << 21, 1 << 15  # (float64 elements)


def _sharded(store: DDictStore) -> np.ndarray:
    x = np.random.default_rng(3).random(_SHARD)
    z = zarr.create_array(
        store,
        name="s",
        shape=x.shape,
        shards=(_SHARD,),
        chunks=(_INNER,),
        dtype="f8",
        compressors=None,
    )
    z[:] = x
    return x


@pytest.mark.one_host
def test_one_inner_chunk_of_a_shard_moves_the_chunk_not_the_shard(zd, paths, wire):
    store = DDictStore(zd, prefix=f"sharded{next(_ids)}/")
    x = _sharded(store)
    assert len(zd[store.prefix + "s/c/0"]) > _SHARD * 8  # one value: the whole shard
    inner = _INNER * 8
    for kind, h in paths.items():
        z = zarr.open_array(DDictStore(h, prefix=store.prefix), path="s", mode="r")
        wire.clear()
        np.testing.assert_array_equal(z[5 * _INNER : 6 * _INNER], x[5 * _INNER : 6 * _INNER])
        moved = sum(n for _, n in wire)
        if kind == "shm":
            assert wire == [], wire  # (read from the shard: nothing sent)
        else:  # the shard's index (a suffix) and the chunk: a little over one inner chunk
            assert [op for op, _ in wire] == ["GetRange", "GetRange"], wire
            assert inner <= moved < inner + 4096, (moved, inner)
    zarr.core.sync.sync(store.delete_dir(""))


# -- the stack: dask.array and xarray ------------------------------------------------------


def test_dask_array_round_trip_from_tasks(zd, client):
    x = da.random.default_rng(1).random((400, 300), chunks=(100, 75))
    store = DDictStore(zd, prefix=f"dask{next(_ids)}/")
    x.to_zarr(store, component="x", compute=True)  # (each task writes its own chunk)
    assert sum(1 for k in zd if type(k) is str and k.startswith(store.prefix + "x/c/")) == 16
    y = da.from_zarr(store, component="x")
    assert y.chunks == x.chunks
    np.testing.assert_array_equal(y.compute(), x.compute())
    # The store travelled to the tasks: read there too, by handle.
    got = client.submit(
        lambda s: float(zarr.open_array(s, path="x", mode="r")[:].sum()), store
    ).result()
    assert got == pytest.approx(float(x.sum().compute()))


def _count_requests() -> None:
    """In a worker: count the requests its handles send to host processes."""
    from dask_ddict.transport import socket_client

    socket_client._COUNTED = {}  # type: ignore[attr-defined]
    socket_client.HostLink._real = (socket_client.HostLink.call, socket_client.HostLink.send)  # type: ignore[attr-defined]

    def counted(real):  # (every request goes out by call or send)
        def request(self, o, *rest):
            name = type(o).__name__
            socket_client._COUNTED[name] = socket_client._COUNTED.get(name, 0) + 1  # type: ignore[attr-defined]
            return real(self, o, *rest)

        return request

    socket_client.HostLink.call, socket_client.HostLink.send = map(
        counted, socket_client.HostLink._real
    )


def _counted() -> dict[str, int]:
    from dask_ddict.transport import socket_client

    socket_client.HostLink.call, socket_client.HostLink.send = socket_client.HostLink._real  # type: ignore[attr-defined]
    return socket_client._COUNTED  # type: ignore[attr-defined]


@pytest.mark.one_host
def test_chunks_are_written_and_read_on_the_managers_host_without_a_request(zd, client):
    """Tasks on the manager's host commit their chunks into the shard and read them from
    it: no request reaches a host process (SharedChannel, the shard path)."""
    store = DDictStore(zd, prefix=f"local{next(_ids)}/")
    x = da.random.default_rng(0).random(1 << 16, chunks=1 << 14)  # 4 incompressible 128 KiB
    client.run(_count_requests)
    try:
        x.to_zarr(store, component="x")
        y = da.from_zarr(store, component="x").compute()
        np.testing.assert_array_equal(y, x.compute())
    finally:
        counts = client.run(_counted)
    assert len(counts) == 2 and all(c == {} for c in counts.values()), counts
    kinds = client.run(_channel_kinds, store)
    assert all(k == ["shm"] for k in kinds.values()), kinds
    # (the counter counts: over ddict.zarr-store.direct-write-max a chunk goes to its manager)
    client.run(_count_requests)
    client.run(_direct_write_max, "64 KiB")
    try:
        x.to_zarr(store, component="again")
    finally:
        client.run(_direct_write_max, None)
        counts = client.run(_counted)
    assert sum(c.get("PutMany", 0) for c in counts.values()) == 4, counts


def _write_in_task(store: DDictStore) -> int:
    """In a task: write 256 MiB of chunks through ``store``; the growth of this process's
    resident shared memory (pages of the shards it wrote through its mappings)."""
    shmem = _shmem
    z = zarr.create_array(
        store, name="rss", shape=(1 << 25,), chunks=(1 << 22,), dtype="f8", compressors=None
    )
    before = shmem()
    rng = np.random.default_rng(0)
    for i in range(8):
        z[i << 22 : (i + 1) << 22] = rng.random(1 << 22)
    return shmem() - before


def _read_in_task(store: DDictStore) -> int:
    """In a task: read the 256 MiB array back four times (its chunks lent zero-copy from
    the shards); the growth of the process's resident shared memory."""
    before = _shmem()
    z = zarr.open_array(store, path="rss", mode="r")
    for _ in range(4):
        for i in range(8):
            assert z[i << 22 : (i + 1) << 22][-1] >= 0
    return _shmem() - before


def _shmem() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssShmem"))


def test_chunks_written_and_read_from_a_task_leave_its_resident_set(client):
    """A task's direct writes map shard pages into it, and so do its reads of lent chunks;
    they are given back every 96 MiB, so Dask's memory monitor does not see the shards
    in the worker."""
    with DDict(total_mem="768 MiB", client=client) as d:
        grown = client.submit(_write_in_task, DDictStore(d)).result()
        assert grown < 160 << 20, grown >> 20
        assert zarr.open_array(DDictStore(d), path="rss", mode="r")[-1] > 0
        grown = client.submit(_read_in_task, DDictStore(d), pure=False).result()
        assert grown < 160 << 20, grown >> 20


def _direct_write_max(value: str | None) -> None:
    import dask

    from dask_ddict import config

    dask.config.set({"ddict.zarr-store.direct-write-max": value or "256 MiB"})
    assert config.get_bytes("zarr-store.direct-write-max") in (64 << 10, 256 << 20)


def _channel_kinds(store: DDictStore) -> list[str]:
    d = store.ddict
    return sorted({d._core.channel(m).kind for m in range(d.num_managers)})


def test_xarray_round_trip_with_coordinates_attributes_and_consolidated_metadata(zd, monkeypatch):
    xr = pytest.importorskip("xarray")
    ds = xr.Dataset(
        {
            "t": (("time", "x"), np.arange(24.0).reshape(6, 4), {"units": "K"}),
            "flag": (("x",), np.array([1, 0, 1, 1], dtype="i2")),
        },
        coords={"time": np.arange(6), "x": [10.0, 20.0, 30.0, 40.0], "label": ("x", list("abcd"))},
        attrs={"title": "ddict", "version": 3},
    ).chunk({"time": 3})
    store = DDictStore(zd, prefix=f"xr{next(_ids)}/")
    ds.to_zarr(store, consolidated=True, zarr_format=3)
    assert b"consolidated_metadata" in zd[store.prefix + "zarr.json"]

    # Consolidated metadata opens the dataset without listing the dictionary at all.
    def no_listing(self, prefix):
        raise AssertionError("listed")

    monkeypatch.setattr(DDictStore, "list_dir", no_listing)
    back = xr.open_zarr(store, consolidated=True)
    xr.testing.assert_identical(back.compute(), ds.compute())
    assert back.attrs == {"title": "ddict", "version": 3} and back["t"].attrs["units"] == "K"
    monkeypatch.undo()
    again = xr.open_zarr(store, consolidated=False)  # (this one lists)
    xr.testing.assert_identical(again.compute(), ds.compute())


# -- checkpoints and persistence --------------------------------------------------------


def test_a_store_at_checkpoint_k_reads_the_arrays_as_of_k(client):
    with DDict(total_mem="64 MiB", client=client, working_set_size=2) as d:
        store = DDictStore(d)
        z = zarr.create_array(store, name="a", shape=(8,), chunks=(4,), dtype="i8")
        z[:] = np.arange(8)
        d.checkpoint()  # the store's handle moves on: writes now go to checkpoint 1
        zarr.open_array(DDictStore(d), path="a")[:4] = -1
        old = DDict.attach(d.serialize(), client=client)  # a handle at checkpoint 0
        np.testing.assert_array_equal(
            zarr.open_array(DDictStore(old), path="a", mode="r")[:], np.arange(8)
        )
        np.testing.assert_array_equal(
            zarr.open_array(DDictStore(d), path="a", mode="r")[:], [-1] * 4 + [4, 5, 6, 7]
        )
        old.detach()


def test_a_persisted_and_restored_dictionary_brings_its_arrays_back(client, tmp_path):
    path, name = str(tmp_path / "ckpt"), f"zarr-persist-{next(_ids)}"
    x = np.random.default_rng(0).random((50, 40))
    with DDict(total_mem="64 MiB", client=client, name=name, persist_path=path) as d:
        da.from_array(x, chunks=(25, 20)).to_zarr(DDictStore(d, prefix="p/"), component="x")
        d.persist()
        d.sync()
        assert d.persisted_ids() == [0]
    with DDict(
        total_mem="64 MiB", client=client, name=name, persist_path=path, restore_from=0
    ) as e:
        np.testing.assert_array_equal(da.from_zarr(DDictStore(e, prefix="p/"), "x").compute(), x)
