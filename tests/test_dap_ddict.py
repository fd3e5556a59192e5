"""Arrays resident in a DDict: sections stored beside their blocks, computed in place."""

from __future__ import annotations

import dask.array as da
import numpy as np
import pytest
from distributed import futures_of, wait

from dask_dap import DDictArray, from_ddict, to_dap, to_ddict
from dask_dap.resident import SectionKey


def test_sections_are_stored_beside_their_blocks(client, ddict):
    x = client.persist(da.random.default_rng(1).random((8, 6), chunks=(2, 3)))
    wait(x)
    home = {f.key: next(iter(client.who_has([f])[f.key])) for f in futures_of(x)}
    arr = to_ddict(x, ddict, "field")
    assert arr.shape == (8, 6) and arr.grid == (4, 2) and arr.chunks == ((2, 2, 2, 2), (3, 3))
    for rank, (i, j) in enumerate(np.ndindex(4, 2)):
        manager = arr.managers[rank]
        assert ddict.manager_workers[manager] == home[(x.name, i, j)]  # stored where it was
        assert ddict.which_manager(SectionKey("field", rank, manager)) == manager
    sections = arr.sections()
    expected = to_dap(x)
    for s, e in zip(sections, expected):
        np.testing.assert_array_equal(s["buffer"], e["buffer"])
        assert s["dim_data"] == e["dim_data"]
    np.testing.assert_array_equal(arr.to_dask().compute(), x.compute())
    np.testing.assert_array_equal(from_ddict(ddict, "field").compute(), x.compute())
    again = DDictArray.load(ddict, "field")
    assert again.dim_data == arr.dim_data and again.managers == arr.managers
    html = again._repr_html_()  # Jupyter: shape, dtype, where each rank lives, its DDict
    assert "shape (8, 6)" in html and "float64" in html and "384 B" in html
    assert html.count("<code>tcp://") == 8 + 2 and ddict.get_name() in html


def test_map_blocks_runs_where_sections_live(client, ddict):
    a = np.arange(24.0).reshape(4, 6)
    arr = to_ddict(da.from_array(a, chunks=(2, 3)), ddict, "a", comm_padding=[1, 0])
    log = ddict  # the function records where it ran, in the DDict itself

    def double(block):
        from distributed import get_worker

        log[("ran-on", float(block.flat[0]))] = get_worker().address
        return block * 2

    doubled = arr.map_blocks(double, name="a2")
    assert doubled.name == "a2" and doubled.managers == arr.managers
    np.testing.assert_array_equal(doubled.to_dask().compute(), a * 2)
    for rank, dd in enumerate(arr.dim_data):
        first = float(a[dd[0]["start"] + (1 if dd[0]["proc_grid_rank"] else 0), dd[1]["start"]])
        assert ddict[("ran-on", first)] == ddict.manager_workers[arr.managers[rank]]
    assert all("padding" not in d for dd in doubled.dim_data for d in dd)
    with pytest.raises(ValueError, match="changed the shape"):
        arr.map_blocks(lambda b: b[:1], name="bad")
    arr.delete()
    with pytest.raises(KeyError):
        DDictArray.load(ddict, "a")


def test_cyclic_resident_array(client, ddict):
    a = np.arange(30.0).reshape(10, 3)
    arr = to_ddict(
        da.from_array(a, chunks=(5, 3)),
        ddict,
        "cyc",
        dist=[{"dist_type": "c", "block_size": 2}, None],
    )
    assert arr.dim_data[1][0]["start"] == 2
    np.testing.assert_array_equal(arr.to_dask().compute(), a)
    np.testing.assert_array_equal(arr.map_blocks(np.negative).to_dask().compute(), -a)


def test_from_ddict_by_name_and_after_a_restore(client, tmp_path):
    """docs/guide/dap.md's example: an array stored and transformed in place, read back by name,
    persisted, and read again from a new dictionary restored from the checkpoint."""
    import uuid

    from dask_ddict import DDict

    store, name = str(tmp_path / "arrays.zarr"), f"fields-{uuid.uuid4().hex[:6]}"
    x = client.persist(da.random.default_rng(2).random((64, 48), chunks=(16, 24)))
    d = DDict(total_mem="64 MiB", client=client, name=name, persist_path=store)
    arr = to_ddict(x, d, "field")
    arr.map_blocks(np.sqrt)  # stored beside each section as "field-sqrt"
    np.testing.assert_allclose(from_ddict(d, "field-sqrt").compute(), np.sqrt(x.compute()))
    d.persist()  # the handle's checkpoint (0), on every manager
    d.sync()
    d.destroy()
    d = DDict(total_mem="64 MiB", client=client, name=name, persist_path=store, restore_from=0)
    try:
        np.testing.assert_array_equal(from_ddict(d, "field").compute(), x.compute())
        np.testing.assert_allclose(from_ddict(d, "field-sqrt").compute(), np.sqrt(x.compute()))
    finally:
        d.destroy()
