"""Staging a zarr store into a DDict (``dask_ddict.stage``): real zarr stores on disk, the
test cluster's loader tasks, reads during and after loading."""

from __future__ import annotations

import shutil

import dask.array as da
import numpy as np
import pytest
import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import LocalStore

from dask_ddict import DDict, DDictError, DDictStore, StagedStore, stage
from dask_ddict.stores.staging import STAGING, _record, plan
from tests.support.cluster import local_cluster


def test_the_plan_puts_each_object_with_its_managers_worker_metadata_first():
    keys = [
        ("x/c/0", 0),
        ("x/zarr.json", 1),
        ("x/c/1", 1),
        ("x/c/2", 2),
        ("zarr.json", 0),
        ("x/c/3", 0),
    ]
    workers = {"a": [0, 1], "b": [2]}
    loaders = plan(keys, workers, 4)  # (2 per worker)
    assert sorted(k for _, ks in loaders for k in ks) == sorted(k for k, _ in keys)
    on_a = [ks for w, ks in loaders if w == "a"]
    assert len(on_a) == 2 and [ks for w, ks in loaders if w == "b"] == [["x/c/2"]]
    assert {ks[0] for ks in on_a} == {"x/zarr.json", "zarr.json"}  # (first: metadata)
    assert len(plan(keys, workers, 1)) == 2  # (one per worker at least)
    assert plan([], workers, 4) == []


@pytest.fixture
def source(tmp_path):
    """A zarr store on disk: a group with a 2-D array (100 chunks) and attributes."""
    path = str(tmp_path / "src.zarr")
    root = zarr.open_group(path, mode="w")
    root.attrs["title"] = "staged"
    arr = root.create_array("x", shape=(200, 300), chunks=(20, 30), dtype="f8")
    arr[:] = np.arange(200 * 300, dtype="f8").reshape(200, 300)
    return path, arr[:]


def test_a_staged_store_reads_right_while_loading_and_from_the_dictionary_after(
    client, tmp_path, source
):
    path, data = source
    d = DDict(total_mem="64 MiB", client=client)
    try:
        staged = stage(path, d, prefix="ds", nloaders=3)
        assert isinstance(staged, StagedStore) and staged.read_only
        np.testing.assert_array_equal(zarr.open_array(staged, path="x", mode="r")[:], data)
        staged.wait(timeout=60)
        assert staged.is_loaded() and staged.loaded() == (staged.total, staged.total)
        assert staged.total == 102  # (100 chunks, two zarr.json)
        assert sum(isinstance(k, str) and k.startswith("ds/") for k in d.keys()) == 102
        assert [k for k in d.keys() if not isinstance(k, str)] and all(
            k[0] == STAGING for k in d.keys() if not isinstance(k, str)
        )  # (the records)
        shutil.rmtree(path)  # the source is never read again
        x = da.from_zarr(staged, component="x")
        np.testing.assert_array_equal(x.compute(), data)
        assert zarr.open_group(staged, mode="r").attrs["title"] == "staged"
        plain = staged.done()  # the dictionary's own store: writable
        assert isinstance(plain, DDictStore) and not plain.read_only
        zarr.open_array(plain, path="x", mode="r+")[0, 0] = -1.0
        assert zarr.open_array(DDictStore(d, prefix="ds"), path="x", mode="r")[0, 0] == -1.0
    finally:
        d.destroy()


def test_reads_fall_through_to_the_source_for_what_is_not_loaded(client, source):
    """A staged store whose loaders loaded nothing, then half: every read is right, each
    from where the object is."""
    path, data = source
    d = DDict(total_mem="64 MiB", client=client)
    try:
        staged = StagedStore(d, path, token="none", loaders=1, total=102)
        assert not staged.is_loaded() and staged.loaded() == (0, 102)
        np.testing.assert_array_equal(zarr.open_array(staged, path="x", mode="r")[:], data)
        assert zarr.open_array(staged, path="x", mode="r")[:].sum() == data.sum()
        src = LocalStore(path, read_only=True)
        target = DDictStore(d)
        half = sorted(sync(_keys(src)))[::2]
        for k in half:  # (half of the objects in the dictionary, as a loader leaves them)
            target.set_sync(k, sync(src.get(k, default_buffer_prototype())))
        np.testing.assert_array_equal(zarr.open_array(staged, path="x", mode="r")[:], data)
        assert sorted(sync(_keys(staged))) == sorted(sync(_keys(src)))
        with pytest.raises(ValueError):  # (read-only while loading)
            zarr.open_array(staged, path="x", mode="r+")[0, 0] = 1.0
        with pytest.raises(DDictError, match="still loading"):
            staged.with_read_only(False)
    finally:
        d.destroy()


def test_a_read_that_misses_as_the_last_loader_finishes_reads_the_dictionary_again(client, source):
    """A read that misses in the dictionary and then finds every loader finished (the
    object was loaded between the two) answers the object, read from the dictionary
    again: "loaded" says the dictionary has everything now, not when the read looked."""
    path, _ = source
    d = DDict(total_mem="64 MiB", client=client)
    key = "x/zarr.json"
    want = sync(LocalStore(path, read_only=True).get(key, default_buffer_prototype()))
    try:
        for read in ("get", "get_sync"):
            d.clear()
            staged = StagedStore(d, path, token=f"race-{read}", loaders=1, total=1)
            looked = staged._from_source

            def loaded_meanwhile(staged=staged, looked=looked, read=read):
                DDictStore(d).set_sync(key, want)  # (the loader's last object, and its end)
                d[_record(f"race-{read}", 0)] = (1, 1, True, None)
                staged._looked = 0.0  # (the records are read now)
                return looked()

            staged._from_source = loaded_meanwhile  # type: ignore[method-assign]
            proto = default_buffer_prototype()
            got = (
                sync(staged.get(key, proto))
                if read == "get"
                else staged.get_sync(key, prototype=proto)
            )
            assert got is not None and got.to_bytes() == want.to_bytes(), read
            assert staged.is_loaded()
    finally:
        d.destroy()


async def _keys(store) -> list[str]:
    return [k async for k in store.list()]


def test_a_staged_store_pickles_to_tasks_and_xarray_reads_it(client, tmp_path):
    xr = pytest.importorskip("xarray")
    path = str(tmp_path / "ds.zarr")
    ds = xr.Dataset(
        {"t": (("time", "x"), np.random.default_rng(1).random((48, 10)))},
        coords={"time": np.arange(48), "x": np.arange(10) * 0.5},
        attrs={"source": "bench"},
    )
    ds.chunk({"time": 12}).to_zarr(path, consolidated=True)
    d = DDict(total_mem="64 MiB", client=client)
    try:
        staged = stage(path, d)
        # a task reads through a pickled staged store (loaded or not)
        total = client.submit(
            lambda s: float(zarr.open_array(s, path="t", mode="r")[:].sum()), staged
        ).result(timeout=60)
        assert total == pytest.approx(float(ds["t"].sum()))
        staged.wait(timeout=60)
        back = xr.open_zarr(staged, consolidated=True)
        xr.testing.assert_identical(back.load(), ds)
    finally:
        d.destroy()


def test_bad_arguments_are_refused_naming_them(client, tmp_path, source):
    path, _ = source
    d = DDict(total_mem="32 MiB", client=client)
    try:
        with pytest.raises(FileNotFoundError, match="no such directory"):
            stage(str(tmp_path / "absent"), d)
        with pytest.raises(ValueError, match="nloaders"):
            stage(path, d, nloaders=0)
        with pytest.raises(TypeError, match="prefix"):
            stage(path, d, prefix=3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="ddict"):
            stage(path, {})  # type: ignore[arg-type]
        assert len(d) == 0  # (nothing was loaded by a refused call)
    finally:
        d.destroy()


def test_a_dictionary_that_fills_fails_the_staging_naming_it_and_reads_stay_right(client, tmp_path):
    """The loaders fill the dictionary (a shard refuses the next object): ``wait()`` and
    ``is_loaded()`` raise naming it, and every read is still right (from the source)."""
    path = str(tmp_path / "big.zarr")
    data = np.random.default_rng(2).random(3_000_000)  # 24 MB, hardly compressible
    zarr.create_array(path, shape=data.shape, chunks=(250_000,), dtype="f8")[:] = data
    d = DDict(total_mem="8 MiB", client=client)
    try:
        staged = stage(path, d)
        with pytest.raises(DDictError, match="full|room"):
            staged.wait(timeout=60)
        with pytest.raises(DDictError, match="staging .* failed: DDictFullError"):
            staged.is_loaded()
        np.testing.assert_array_equal(zarr.open_array(staged, mode="r")[:], data)
    finally:
        d.destroy()


def test_a_store_on_s3_is_staged_with_its_storage_options(client, s3):
    """An object store (a real S3 server on loopback): the loaders read it with the
    ``storage_options`` given, and the dictionary then holds every object."""
    from zarr.storage import FsspecStore

    url = f"{s3.bucket()}/src.zarr"
    data = np.arange(40_000, dtype="i4").reshape(200, 200)
    remote = FsspecStore.from_url(url, storage_options=s3.storage_options)
    zarr.create_array(remote, shape=data.shape, chunks=(50, 50), dtype="i4")[:] = data
    d = DDict(total_mem="32 MiB", client=client)
    try:
        staged = stage(url, d, storage_options=s3.storage_options, wait=True)
        assert staged.is_loaded() and staged.total == 17  # (16 chunks, zarr.json)
        np.testing.assert_array_equal(zarr.open_array(DDictStore(d), mode="r")[:], data)
        np.testing.assert_array_equal(zarr.open_array(staged, mode="r")[:], data)
    finally:
        d.destroy()


def test_a_worker_killed_while_its_loaders_run_loses_nothing(tmp_path):
    """A loader's worker is SIGKILLed as the staging starts: Dask runs its loaders again
    (elsewhere or on the restarted worker), and everything is loaded, right."""
    import os
    import signal

    from distributed import Client

    path = str(tmp_path / "src.zarr")
    data = np.random.default_rng(3).random((400, 2000))
    zarr.create_array(path, shape=data.shape, chunks=(20, 2000), dtype="f8")[:] = data
    with (
        local_cluster(2) as cl,
        Client(cl) as c,
    ):
        d = DDict(total_mem="64 MiB", client=c, timeout=60)
        try:
            victim = d.manager_workers[0]
            pid = c.run(os.getpid, workers=[victim])[victim]
            staged = stage(path, d)
            os.kill(pid, signal.SIGKILL)
            staged.wait(timeout=90)
            assert staged.loaded() == (21, 21)
            assert sum(isinstance(k, str) for k in d.keys()) == 21
            np.testing.assert_array_equal(zarr.open_array(DDictStore(d), mode="r")[:], data)
        finally:
            d.destroy()
