"""dask_dap on a real process cluster: exported sections stay where their blocks are,
imports from futures move only metadata, and zarr round trips on disk."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
import zarr
from distributed import futures_of, wait

from dask_dap import (
    DAPValidationError,
    from_dap,
    from_zarr,
    read_dap_layout,
    to_dap,
    to_dap_futures,
    to_ddict,
    to_zarr,
)


def _where(client, futures):
    who = client.who_has(futures)
    return [tuple(who[f.key]) for f in futures]


def test_to_dap_futures_stay_on_the_blocks_workers(client):
    x = da.random.default_rng(0).random((8, 6), chunks=(2, 3))
    x = client.persist(x)
    wait(x)
    blocks = futures_of(x)
    block_home = {f.key: tuple(client.who_has([f])[f.key]) for f in blocks}
    assert len({w for ws in block_home.values() for w in ws}) == 2  # spread over both workers

    futs = to_dap_futures(x, client)
    wait(futs)
    homes = _where(client, futs)
    ordered = [block_home[(x.name, i, j)] for i in range(4) for j in range(2)]
    assert homes == ordered  # each rank's dict was built where its block lives
    metas = client.gather([client.submit(lambda d: d["dim_data"], f) for f in futs])
    assert metas[3][0]["proc_grid_rank"] == 1 and metas[3][1]["proc_grid_rank"] == 1

    # Import from the futures: only metadata comes here; the data stays put.
    y = from_dap(futs)
    np.testing.assert_array_equal(y.compute(), x.compute())
    persisted = client.persist(y)
    wait(persisted)
    homes_y = [
        tuple(client.who_has([f])[f.key])
        for f in sorted(futures_of(persisted), key=lambda f: f.key)
    ]
    assert set(w for ws in homes_y for w in ws) == set(w for ws in homes for w in ws)


def test_to_dap_futures_with_padding_and_cyclic(client):
    a = np.arange(40.0).reshape(5, 8)
    x = da.from_array(a, chunks=(3, 4))
    futs = to_dap_futures(x, client, comm_padding=[1, 0], dist=[None, "c"])
    parts = client.gather(futs)
    local = to_dap(x, comm_padding=[1, 0], dist=[None, "c"])
    assert len(parts) == len(local) == 4
    for p, q in zip(parts, local):
        np.testing.assert_array_equal(p["buffer"], q["buffer"])
        assert p["dim_data"] == q["dim_data"]
    np.testing.assert_array_equal(from_dap(futs).compute(), a)


def test_from_dap_futures_validates_remotely(client):
    good = to_dap(da.from_array(np.arange(6.0), chunks=3))
    bad = dict(good[1], dim_data=({**good[1]["dim_data"][0], "start": 2},))
    futs = client.scatter([good[0], bad])
    with pytest.raises(DAPValidationError):
        from_dap(futs)


def test_zarr_round_trips(tmp_path):
    a = np.random.default_rng(5).random((7, 9))
    x = da.from_array(a, chunks=((3, 4), (2, 7)))  # irregular: zarr chunks differ, dask's kept
    path = str(tmp_path / "a.zarr")
    to_zarr(x, path, comm_padding=[1, 0])
    y = from_zarr(path)
    assert y.chunks == x.chunks
    np.testing.assert_array_equal(y.compute(), a)
    np.testing.assert_array_equal(zarr.open_array(path, mode="r")[:], a)  # plain zarr reads it
    layout = read_dap_layout(path)
    assert len(layout) == 4 and layout[1][0]["padding"] == (0, 1)
    assert to_dap(x, comm_padding=[1, 0])[3]["dim_data"] == layout[3]

    regular = da.from_array(a, chunks=(4, 3))
    to_zarr(regular, str(tmp_path / "g.zarr"), path="arr", dist=["c", None])
    arr = zarr.open_array(str(tmp_path / "g.zarr"), path="arr", mode="r")
    assert arr.chunks == (4, 3)  # dask chunks preserved as zarr chunks
    assert read_dap_layout(str(tmp_path / "g.zarr"), "arr")[0][0]["dist_type"] == "c"
    with pytest.raises(Exception):  # noqa: B017 (zarr's own error type varies by version)
        to_zarr(regular, str(tmp_path / "g.zarr"), path="arr")  # exists, no overwrite
    to_zarr(regular, str(tmp_path / "g.zarr"), path="arr", overwrite=True)

    parts = to_dap(
        da.from_array(a, chunks=(3, 3)), dist=[{"dist_type": "c", "block_size": 2}, None]
    )
    to_zarr(parts, str(tmp_path / "p.zarr"))
    np.testing.assert_array_equal(from_zarr(str(tmp_path / "p.zarr")).compute(), a)
    stored = read_dap_layout(str(tmp_path / "p.zarr"))
    assert [dd[0]["start"] for dd in stored] == [p["dim_data"][0]["start"] for p in parts]

    zarr.create_array(str(tmp_path / "plain.zarr"), shape=(2,), dtype="f8")
    with pytest.raises(DAPValidationError, match="no DAP layout"):
        from_zarr(str(tmp_path / "plain.zarr"))


def test_to_zarr_compute_false_writes_when_computed(client, tmp_path):
    a = np.arange(48.0).reshape(6, 8)
    path = str(tmp_path / "lazy.zarr")
    stored = to_zarr(da.from_array(a, chunks=(3, 4)), path, compute=False)
    assert dask.is_dask_collection(stored)
    assert read_dap_layout(path)[0][0]["dist_type"] == "b"  # the layout is there already...
    np.testing.assert_array_equal(zarr.open_array(path, mode="r")[:], 0)  # ...the data is not
    stored.compute()
    np.testing.assert_array_equal(from_zarr(path).compute(), a)
    with pytest.raises(TypeError, match="compute must be True or False"):
        to_zarr(da.from_array(a), str(tmp_path / "x.zarr"), compute="no")


def test_to_zarr_and_to_ddict_show_dasks_progress(client, ddict, tmp_path, capsys):
    x = da.from_array(np.arange(64.0).reshape(8, 8), chunks=(4, 4))
    with dask.config.set({"ddict.progress": True}):
        to_zarr(x, str(tmp_path / "shown.zarr"))
        shown = capsys.readouterr()
        to_ddict(x, ddict, "shown")
        shown_ddict = capsys.readouterr()
    with dask.config.set({"ddict.progress": False}):
        to_zarr(x, str(tmp_path / "quiet.zarr"))
    quiet = capsys.readouterr()
    assert "100% Completed" in shown.out + shown.err
    assert "100% Completed" in shown_ddict.out + shown_ddict.err
    assert "Completed" not in quiet.out + quiet.err
    np.testing.assert_array_equal(from_zarr(str(tmp_path / "shown.zarr")).compute(), x.compute())
