"""``persister_class=``: the zarr store and the directory of files behind one interface, and
Dragon's persister names, on a real cluster (the persisters' crash tests, without a
cluster: ``tests/test_persist_integrity.py``)."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

from dask_ddict import DDict, DDictError
from dask_ddict.persist import (
    CheckpointPersister,
    DAOSCheckpointPersister,
    DirectoryPersister,
    NULLCheckpointPersister,
    PosixCheckpointPersister,
    ZarrPersister,
    persister_for,
    persister_name,
)

KINDS = {"zarr": ZarrPersister, "directory": DirectoryPersister}


def _files(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


@pytest.mark.parametrize("kind", KINDS)
def test_a_dictionary_persists_rotates_and_restores_through_either_persister(
    client, tmp_path, kind
):
    path = str(tmp_path / "store")
    d = DDict(
        2,
        total_mem="64 MiB",
        client=client,
        name=f"p-{kind}",
        persist_path=path,
        persist_freq=1,
        persist_count=2,
        persister_class=KINDS[kind],
    )
    try:
        for c in range(5):  # each checkpoint retires (working set 1) and persists
            d.update({f"k{i}": np.full(1000 + i, c) for i in range(20)})
            d.checkpoint()
        d.sync()
        assert d.persisted_ids() == [2, 3]  # (persist_count=2 keeps the newest two)
        files = _files(path)
        if kind == "directory":  # plain files: no zarr metadata anywhere
            assert "dask_ddict.json" in files and not any("zarr.json" in f for f in files)
            assert any(f.endswith("generation.json") for f in files)
        else:
            assert "zarr.json" in files and not any("generation.json" in f for f in files)
        d.restore(2)
        assert int(d["k5"][0]) == 2 and len(d) == 20
    finally:
        d.destroy()
    # a new dictionary starts from a persisted checkpoint, onto another number of managers
    e = DDict(
        3,
        total_mem="64 MiB",
        client=client,
        name=f"p-{kind}",
        persist_path=path,
        restore_from=2,
        persister_class=kind,
    )
    try:
        assert {k: int(e[k][0]) for k in e.keys()} == {f"k{i}": 2 for i in range(20)}
    finally:
        e.destroy()
    # each persister reads its own stores only, and says what it found
    other = "directory" if kind == "zarr" else "zarr"
    with pytest.raises(Exception, match="persister_class=(None|DirectoryPersister)"):
        DDict(
            total_mem="32 MiB",
            client=client,
            name=f"p-{kind}",
            persist_path=path,
            restore_from=2,
            persister_class=other,
        )


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
@pytest.mark.parametrize("kind", KINDS)
def test_a_persist_that_fills_the_disk_fails_naming_it_and_keeps_the_last_checkpoint(
    client, tmp_path, kind
):
    """Each persister, mid-checkpoint, on a file system that fills: ``sync()`` raises
    naming the full disk, the previous checkpoint stays the persisted one and restores
    whole, and a persist that fits afterwards succeeds."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    try:
        d = DDict(
            1,
            total_mem="64 MiB",
            client=client,
            name=f"full-{kind}",
            persist_path=str(mnt / "store"),
            persister_class=kind,
            working_set_size=2,
        )
        try:
            d.update({f"k{i}": np.full(100_000, 1, dtype="u1") for i in range(10)})  # 1 MB
            d.persist()
            d.sync()
            assert d.persisted_ids() == [0]
            d.update({f"k{i}": np.full(1_000_000, 2, dtype="u1") for i in range(10)})  # 10 MB
            d.persist()
            with pytest.raises(DDictError, match="No space left|ENOSPC|errno 28"):
                d.sync()
            assert d.persisted_ids() == [0]
            d.restore(0)
            assert {int(d[f"k{i}"][0]) for i in range(10)} == {1}
            assert all(d[f"k{i}"].size == 100_000 for i in range(10))
            d.update({f"k{i}": np.full(200_000, 3, dtype="u1") for i in range(10)})  # 2 MB
            d.persist()
            d.sync()
            d.restore(0)
            assert {int(d[f"k{i}"][0]) for i in range(10)} == {3}
        finally:
            d.destroy()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_dragons_persister_names_mean_what_they_did(client, tmp_path, monkeypatch):
    # PosixCheckpointPersister: plain files; without persist_path, the current directory
    monkeypatch.chdir(tmp_path)
    d = DDict(
        total_mem="32 MiB",
        client=client,
        name="posix",
        persist_freq=1,
        persister_class=PosixCheckpointPersister,
    )
    try:
        d["a"] = 1
        d.persist()
        d.sync()
        assert d.persisted_ids() == [0]
        assert (tmp_path / "dask_ddict.json").exists() and (tmp_path / "posix").is_dir()
    finally:
        d.destroy()
    # NULLCheckpointPersister: nothing persisted, and persist_freq refused, as in Dragon
    with pytest.raises(ValueError, match="NULLCheckpointPersister.*persist_freq"):
        DDict(
            total_mem="32 MiB",
            client=client,
            persist_freq=1,
            persister_class=NULLCheckpointPersister,
        )
    n = DDict(total_mem="32 MiB", client=client, persister_class=NULLCheckpointPersister)
    try:
        n["a"] = 1
        assert n.persisted_ids() == []
    finally:
        n.destroy()
    with pytest.raises(ValueError, match="DAOS.*persist_path.*s3://.*DirectoryPersister"):
        DDict(total_mem="32 MiB", client=client, persister_class=DAOSCheckpointPersister)


class _Local(ZarrPersister):
    pass


def test_a_persister_class_is_named_for_the_workers_or_refused_saying_why():
    assert persister_name(None) == persister_name(ZarrPersister) == "zarr"
    assert persister_name(PosixCheckpointPersister) == persister_name("directory") == "directory"
    assert persister_name(NULLCheckpointPersister) == "null"
    assert persister_name(_Local) == "test_persisters:_Local"  # (importable by the hosts)
    assert persister_for("test_persisters:_Local") is _Local
    assert persister_for("directory") is DirectoryPersister

    class Inner(ZarrPersister):
        pass

    with pytest.raises(ValueError, match="import"):
        persister_name(Inner)
    with pytest.raises(TypeError, match="persister_class"):
        persister_name(dict)
    with pytest.raises(ValueError, match="persister_class='posix'.*'zarr'"):
        persister_name("posix")
    assert issubclass(DirectoryPersister, CheckpointPersister)


def test_the_directory_persister_takes_no_url(client):
    with pytest.raises(ValueError, match="persist_path 's3://b/x' is a URL"):
        DDict(
            total_mem="32 MiB",
            client=client,
            persist_path="s3://b/x",
            persist_freq=1,
            persister_class=DirectoryPersister,
        )
