"""A restore that cannot be done says what was looked for, where, and what is there, and
writes nothing: the store and the path are exactly as they were (real cluster, real
zarr stores on disk)."""

from __future__ import annotations

import os

import pytest

from dask_ddict import DDict, DDictPersistCheckpointError
from dask_ddict.persist import persister_for
from dask_ddict.persist.restorable import check_restorable


def tree(root) -> dict[str, int]:
    """Every file and directory under ``root`` with its size (a directory: -1)."""
    out = {}
    for d, dirs, files in os.walk(root):
        out.update({os.path.join(d, n): -1 for n in dirs})
        out.update({os.path.join(d, n): os.path.getsize(os.path.join(d, n)) for n in files})
    return out


@pytest.fixture
def persisted(client, tmp_path):
    """A store holding dictionary 'real', checkpoint 0 persisted on both managers."""
    store = str(tmp_path / "s.zarr")
    d = DDict(total_mem="64 MiB", client=client, name="real", persist_path=store)
    d["a"] = 1
    d.persist()
    d.sync()
    d.destroy()
    return store


@pytest.mark.parametrize("case", ["wrong name", "missing checkpoint", "missing path"])
def test_a_failed_restore_from_names_store_and_name_and_writes_nothing(
    client, tmp_path, persisted, case
):
    before = tree(tmp_path)
    name, path, chkpt = "real", persisted, 0
    if case == "wrong name":
        name = "wrong"
    elif case == "missing checkpoint":
        chkpt = 5
    else:
        path = str(tmp_path / "missing.zarr")
    with pytest.raises(DDictPersistCheckpointError) as e:
        DDict(total_mem="64 MiB", client=client, name=name, persist_path=path, restore_from=chkpt)
    text = str(e.value)
    assert f"restore_from={chkpt} of {name!r}" in text and repr(path) in text
    if case == "wrong name":
        assert "holds no dictionary named 'wrong' (it holds: 'real')" in text
    elif case == "missing checkpoint":
        assert "checkpoint 5 is not persisted" in text and "[0]" in text
    else:
        assert "does not exist" in text
    assert tree(tmp_path) == before  # no group, no skeleton, no file
    assert "wrong" not in [n for n, _ in __import__("zarr").open_group(persisted).groups()]
    assert not os.path.exists(tmp_path / "missing.zarr")
    again = DDict(
        total_mem="64 MiB", client=client, name="real", persist_path=persisted, restore_from=0
    )
    try:
        assert again["a"] == 1  # the store still restores
    finally:
        again.destroy()


def test_a_failed_restore_of_a_handle_names_the_store_and_changes_nothing(
    client, tmp_path, persisted
):
    d = DDict(
        total_mem="64 MiB", client=client, name="real", persist_path=persisted, restore_from=0
    )
    try:
        d["b"] = 2
        before = tree(tmp_path)
        with pytest.raises(
            DDictPersistCheckpointError,
            match=r"restore\(7\) of .real.*s\.zarr.*\[0\]\); nothing was changed",
        ):
            d.restore(7)
        assert tree(tmp_path) == before and d["b"] == 2 and d.checkpoint_id == 0
    finally:
        d.destroy()


@pytest.mark.parametrize("kind", ["zarr", "directory"])
def test_check_restorable_reads_only(tmp_path, kind):
    """Without a cluster, for each persister: an empty directory, a damaged zarr store
    (another persister's, for the directory one), a file, nothing."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "zarr.json").write_text("{not json")
    before = tree(tmp_path)
    junk = "not a readable zarr store" if kind == "zarr" else "is a zarr store"
    for path, says in [
        (tmp_path / "plain", "holds no dictionary named 'd' .it holds: none."),
        (tmp_path / "junk", junk),
        (tmp_path / "file", "does not exist"),
        (tmp_path / "nothing", "does not exist"),
    ]:
        with pytest.raises(DDictPersistCheckpointError, match=says):
            check_restorable(persister_for(kind), str(path), "d", 0, 2, 0)
    assert tree(tmp_path) == before
