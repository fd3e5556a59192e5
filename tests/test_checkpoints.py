"""Checkpoints on a real process cluster: persistence to zarr, restore, read-only
replay, warm restart, clone/copy/synchronize, and clients at different checkpoints."""

from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import pytest
import zarr
from distributed import wait

from dask_ddict import (
    DDict,
    DDictCheckpointSyncError,
    DDictError,
    DDictKeyError,
    DDictPersistCheckpointError,
    DDictSyncError,
    DDictTimeoutError,
)
from tests.support.shards import shards, shm_entries


def rounds(d: DDict, n: int, start: int = 0) -> None:
    """n checkpoints, each writing k<i> and overwriting "shared"."""
    for i in range(start, start + n):
        d[f"k{i}"] = np.full(4, i)
        d["shared"] = i
        d.checkpoint()


def state(d: DDict) -> dict:
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in d.items()}


# -- persistence ---------------------------------------------------------------------


def test_retiring_checkpoints_are_persisted_and_restored(client, tmp_path):
    path = str(tmp_path / "store")
    d = DDict(
        total_mem="32 MiB",
        client=client,
        name="p1",
        working_set_size=2,
        persist_freq=1,
        persist_count=-1,
        persist_path=path,
    )
    try:
        rounds(d, 6)  # puts at 0..5: each manager retires what falls out of its window
        d.sync()
        ids = d.persisted_ids()
        assert ids and ids == sorted(ids) and ids[0] == 0
        expected_at = {}
        for c in ids:
            expected_at[c] = {f"k{i}": [i] * 4 for i in range(c + 1)} | {"shared": c}
        d.restore(ids[-1])
        assert d.checkpoint_id == ids[-1]
        assert state(d) == expected_at[ids[-1]]
        d.restore(0)  # outside read-only mode newer checkpoints are discarded
        assert state(d) == expected_at[0]
        assert d.persisted_ids() == [0]
        with pytest.raises(DDictPersistCheckpointError):
            d.restore(3)
        # The history continues from 0: new writes retire and re-persist 0.
        d["new"] = 1
        d.checkpoint_id = 2
        for m in range(d.num_managers):  # every manager retires 0 again
            d.manager(m)[f"newer{m}"] = 2
        d.sync()
        d.checkpoint_id = 0
        d.restore(0)
        assert set(state(d)) == {"k0", "shared", "new"}
    finally:
        d.destroy()


def test_explicit_persist_and_restore_from_at_creation(client, tmp_path):
    path = str(tmp_path / "store")
    d = DDict(total_mem="32 MiB", client=client, name="p2", working_set_size=3, persist_path=path)
    try:
        with pytest.raises(DDictPersistCheckpointError):
            d.restore(0)
        rounds(d, 2)
        d.checkpoint_id = 1
        d.persist()  # checkpoint 1 now, although persist_freq=0
        d["after"] = "not persisted"
        d.sync()
        assert d.persisted_ids() == [1]
    finally:
        d.destroy()
    # A new dictionary of the same name starts from the persisted checkpoint.
    e = DDict(
        total_mem="32 MiB",
        client=client,
        name="p2",
        working_set_size=3,
        persist_path=path,
        restore_from=1,
    )
    try:
        assert e.checkpoint_id == 1
        assert state(e) == {"k0": [0] * 4, "k1": [1] * 4, "shared": 1}
        e.rollback()
        with pytest.raises(DDictCheckpointSyncError):
            len(e)  # the window starts at the restored checkpoint
    finally:
        e.destroy()
    with pytest.raises(DDictPersistCheckpointError):
        DDict(total_mem="32 MiB", client=client, name="p2", persist_path=path, restore_from=7)


def test_restore_without_a_persist_path_says_so(client):
    with DDict(total_mem="32 MiB", client=client) as d:
        d["k"] = 1
        with pytest.raises(DDictPersistCheckpointError, match="created without persist_path="):
            d.restore(0)
        assert d["k"] == 1


def test_a_checkpoint_restores_onto_any_number_of_managers(client, tmp_path):
    """Persisted by 4 managers, restored onto 3 (one worker), persisted again there, then
    restored onto 2: every key each time, ids and persisted_ids kept; at run time too."""
    path = str(tmp_path / "store")
    keys = [f"k{i}" for i in range(200)] + [(i, "t") for i in range(50)]
    d = DDict(
        total_mem="64 MiB",
        client=client,
        name="rs",
        working_set_size=2,
        managers_per_worker=2,
        persist_path=path,
    )
    try:
        assert d.num_managers == 4
        d.update({k: 0 for k in keys})
        d.persist()
        d.checkpoint()
        d.update({k: 1 for k in keys[::2]})
        d.persist()
        d.sync()
        assert d.persisted_ids() == [0, 1]
    finally:
        d.destroy()
    r = DDict(
        total_mem="48 MiB",
        client=client,
        name="rs",
        working_set_size=2,
        n_workers=1,
        managers_per_worker=3,
        persist_path=path,
        restore_from=1,
    )
    try:
        assert r.num_managers == 3 and r.checkpoint_id == 1 and len(r) == len(keys)
        assert {k: r[k] for k in keys} == {k: 1 - i % 2 for i, k in enumerate(keys)}
        assert r.persisted_ids() == [0, 1]
        r["new"] = "at 1, on 3 managers"
        r.persist()  # a new version of 1, written by 3 managers
        r.sync()
        assert r.persisted_ids() == [0, 1]
    finally:
        r.destroy()
    s = DDict(
        total_mem="32 MiB",
        client=client,
        name="rs",
        working_set_size=2,
        persist_path=path,
        restore_from=1,
    )
    try:
        assert s.num_managers == 2 and len(s) == len(keys) + 1 and s["new"] == "at 1, on 3 managers"
        s.restore(0)  # written by 4: re-sharded at run time too (and 1 discarded)
        assert len(s) == len(keys) and all(s[k] == 0 for k in keys) and "new" not in s
        assert s.persisted_ids() == [0]
    finally:
        s.destroy()


def test_read_only_replay(client, tmp_path):
    path = str(tmp_path / "store")
    d = DDict(
        total_mem="32 MiB",
        client=client,
        name="p3",
        persist_path=path,
        persist_freq=2,
        persist_count=-1,
    )
    try:
        rounds(d, 7)  # working_set_size=1: every put to c+1 retires c
        for m in range(d.num_managers):  # make every manager retire 0..6
            d.manager(m)["tick"] = 0
        d.sync()
        assert d.persisted_ids() == [0, 2, 4, 6]
    finally:
        d.destroy()
    r = DDict(
        total_mem="32 MiB",
        client=client,
        name="p3",
        persist_path=path,
        persist_freq=2,
        read_only=True,
        restore_from=2,
    )
    try:
        assert r.checkpoint_id == 2 and r["shared"] == 2
        with pytest.raises(DDictError) as info:
            r["x"] = 1
        assert info.value.code == "INVALID_OPERATION"
        with pytest.raises(DDictError):
            r.unfreeze()
        assert r.advance() == 4 and r["shared"] == 4 and len(r) == 6
        r.restore(0)  # jump back: read-only mode keeps every persisted checkpoint
        assert r["shared"] == 0 and r.persisted_ids() == [0, 2, 4, 6]
        r.restore(6)
        with pytest.raises(DDictPersistCheckpointError):
            r.advance()
    finally:
        r.destroy()


def test_wait_for_keys_persists_what_was_visible(client, tmp_path):
    """Non-persistent keys are deleted at retirement: they must be persisted first."""
    path = str(tmp_path / "store")
    d = DDict(
        total_mem="32 MiB",
        client=client,
        name="p4",
        n_workers=1,
        working_set_size=2,
        wait_for_keys=True,
        persist_freq=1,
        persist_count=-1,
        persist_path=path,
        timeout=20,
    )
    try:
        d.pput("const", "p")
        d["x"] = 0
        d.checkpoint()
        d["x"] = 1
        d.checkpoint()
        d["x"] = 2  # checkpoint 0 retires (x was re-written at 1); its x=0 is dropped
        d.sync()
        assert d.persisted_ids() == [0]
        d.restore(0)
        assert state(d) == {"const": "p", "x": 0}
    finally:
        d.destroy()


def test_zarr_store_is_plain_zarr(client, tmp_path):
    path = str(tmp_path / "store")
    with DDict(total_mem="32 MiB", client=client, name="p5", persist_path=path) as d:
        d["k"] = "v"
        d.persist()
        d.sync()
        root = zarr.open_group(path, mode="r")
        groups = sorted(n for n, _ in root["p5"].groups())
        assert groups == ["committed"] + [f"manager_{i}" for i in range(d.num_managers)]
        records = sorted(n for n, _ in root["p5/committed"].groups())  # the commit record
        m = d.which_manager("k")
        g = root[f"p5/manager_{m}/chkpt_0.g0"]
        assert g.attrs["committed"] is True and g.attrs["num_keys"] == 1
        version = g.attrs["version"]  # (one persist: the same on every manager)
        assert version > 0 and records == [
            f"chkpt_0.manager_{i}.g0.v{version:x}.n2" for i in range(d.num_managers)
        ]


# -- warm restart -------------------------------------------------------------------------


@pytest.mark.one_host
def test_restart_brings_back_every_checkpoint(client):
    d = DDict(total_mem="32 MiB", client=client, name="r1", working_set_size=3)
    rounds(d, 4)  # checkpoints 0..3; window [1, 3] (or less on lazy managers)
    d["extra"] = "at 4"
    views = {}
    for c in range(2, 5):
        d.checkpoint_id = c
        views[c] = state(d)
    d.destroy(allow_restart=True)
    assert shards(d) <= shm_entries()  # the shards stayed
    # listed as `dask ddict list` shows it: not live any more, kept for restart
    assert "r1" not in DDict.list(client) and "r1" in DDict.list(client, kept=True)
    with pytest.raises(TypeError, match="kept must be True or False"):
        DDict.list(client, kept="yes")
    with pytest.raises(DDictError, match="no DDict named"):
        DDict(total_mem="32 MiB", client=client, name="nope", restart=True)
    with pytest.raises(ValueError, match="managers"):
        DDict(
            total_mem="32 MiB",
            client=client,
            name="r1",
            restart=True,
            n_workers=1,
            working_set_size=3,
        )
    with pytest.raises(ValueError, match="working_set_size"):
        DDict(total_mem="32 MiB", client=client, name="r1", restart=True, working_set_size=2)
    with pytest.raises(ValueError, match="restart needs the name"):
        DDict(total_mem="32 MiB", client=client, restart=True)
    r = DDict(total_mem="32 MiB", client=client, name="r1", restart=True, working_set_size=3)
    try:
        assert r.empty_managers == []
        assert r.checkpoint_id == 0  # a new handle starts at 0, as in Dragon
        with pytest.raises(DDictCheckpointSyncError):
            r["extra"]  # (0 has retired: the restored window is [2, 4])
        r.sync_to_newest_checkpoint()  # how a program continues from the newest
        assert r.checkpoint_id == 4
        for c, view in views.items():
            r.checkpoint_id = c
            assert state(r) == view
        r.checkpoint_id = 4
        r["after"] = 1  # fully usable
    finally:
        r.destroy()
    assert not ((shards(d) | shards(r)) & shm_entries())


@pytest.mark.one_host
def test_restart_after_worker_processes_restart_and_empty_managers(client):
    d = DDict(total_mem="32 MiB", client=client, name="r2")
    twin = DDict(total_mem="32 MiB", client=client, name="r2twin")
    made = [d, twin]
    try:
        for i in range(20):
            d[i] = i * i
        d.clone([twin.serialize()])
        stores = [m.store_path for m in d._core.layout.managers]
        d.destroy(allow_restart=True)
        twin.destroy(allow_restart=True)
        client.restart()  # new worker processes, same host
        shutil.rmtree(stores[1])  # manager 1's shard is gone
        r = DDict(total_mem="32 MiB", client=client, name="r2", restart=True)
        t = DDict(total_mem="32 MiB", client=client, name="r2twin", restart=True)
        made += [r, t]
        assert r.empty_managers == [1] and t.empty_managers == []
        assert set(r.keys()) == {i for i in range(20) if r.which_manager(i) == 0}
        DDict.synchronize_ddicts([r.serialize(), t.serialize()])
        assert dict(r.items()) == {i: i * i for i in range(20)}
        with pytest.raises(DDictSyncError):
            DDict.synchronize_ddicts([r.serialize(), r.serialize()])  # manager 1 empty in both
        r.destroy()
        t.destroy()
    finally:
        for x in made:
            x.destroy()
    assert not (set().union(*map(shards, made)) & shm_entries())


# -- clone and copy -------------------------------------------------------------------------


def test_clone_and_copy_replicate_every_checkpoint(client):
    d = DDict(total_mem="32 MiB", client=client, working_set_size=2)
    e = DDict(total_mem="32 MiB", client=client, working_set_size=2)
    other = DDict(total_mem="32 MiB", client=client, working_set_size=2, n_workers=1)
    try:
        rounds(d, 3)
        e["junk"] = 1
        d.clone([e.serialize()])
        for c in (1, 2, 3):
            d.checkpoint_id = e.checkpoint_id = c
            assert state(e) == state(d)
        f = d.copy("copied")
        try:
            assert f.get_name() == "copied" and f.checkpoint_id == d.checkpoint_id
            assert f.manager_workers == d.manager_workers
            assert state(f) == state(d)
            f["only_in_copy"] = 1
            assert "only_in_copy" not in d
        finally:
            f.destroy()
        with pytest.raises(DDictError, match="managers"):
            d.clone([other.serialize()])
        with pytest.raises(DDictError, match="creator"):
            DDict.attach(d.serialize()).copy()
    finally:
        for x in (d, e, other):
            x.destroy()


# -- clients at different checkpoints --------------------------------------------------------


def test_blocked_reader_released_by_writer_task(client):
    with DDict(
        total_mem="32 MiB", client=client, working_set_size=2, wait_for_keys=True, timeout=30
    ) as d:

        def reader(h, key):
            return h[key]

        def writer(h, key):
            time.sleep(0.5)
            h[key] = "written"

        fut = client.submit(reader, d, "late", pure=False)
        time.sleep(0.3)
        assert not fut.done()
        client.submit(writer, d, "late", pure=False).result()
        assert fut.result(timeout=30) == "written"
        d2 = DDict.attach(d.serialize(), timeout=0.3)
        with pytest.raises(DDictTimeoutError, match="'never' at checkpoint 0.*no writer"):
            d2["never"]  # the error names the key and what it waited for
        assert "never" not in d  # in never blocks


def test_deferred_writer_until_retirement_possible(client):
    """wait_for_keys: a put at a new checkpoint waits until the oldest can retire."""
    with DDict(
        total_mem="32 MiB",
        client=client,
        n_workers=1,
        working_set_size=2,
        wait_for_keys=True,
        timeout=30,
    ) as d:
        d["a"] = 0
        d["b"] = 0
        d.checkpoint()
        d["a"] = 1  # b not re-written at 1: checkpoint 0 cannot retire yet
        late = DDict.attach(d.serialize(), timeout=30)
        late.checkpoint_id = 2
        done = threading.Event()
        errors = []

        def put_at_2():
            try:
                late["a"] = 2
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)
            done.set()

        threading.Thread(target=put_at_2).start()
        assert not done.wait(0.5)  # deferred
        d["b"] = 1  # now every key of 0 is re-written at 1: 0 retires
        assert done.wait(20) and not errors
        d.checkpoint_id = 0
        for op in (
            lambda: d["a"],
            lambda: "a" in d,
            lambda: len(d),
            lambda: d.pop("a"),
            lambda: d.__setitem__("a", 9),
            lambda: list(d.keys()),
            d.clear,
        ):
            with pytest.raises(DDictCheckpointSyncError):
                op()
        hurried = DDict.attach(d.serialize(), timeout=0.3)
        hurried.checkpoint_id = 3
        with pytest.raises(DDictTimeoutError):
            hurried["a"] = 3  # "b" is not re-written at 2: 1 cannot retire


def test_wait_for_writers(client):
    with DDict(
        total_mem="32 MiB",
        client=client,
        n_workers=1,
        working_set_size=2,
        wait_for_writers=True,
        timeout=30,
    ) as d:
        w1 = DDict.attach(d.serialize(), timeout=30)
        w2 = DDict.attach(d.serialize(), timeout=0.5)
        w1["x"] = 1
        w2["y"] = 1  # both wrote into 0
        w1.checkpoint()
        w1["x"] = 2  # 1 is in the window: no retirement needed
        w1.checkpoint()
        hurried = DDict.attach(d.serialize(), timeout=0.5)
        hurried.checkpoint_id = 2
        with pytest.raises(DDictTimeoutError):
            hurried["x"] = 3  # 0 cannot retire: w2 has not moved on
        w2.checkpoint()
        w2["y"] = 2  # w2 moved on: 0 may retire
        w1["x"] = 3
        assert w1["x"] == 3 and w2["y"] == 2


def test_tasks_each_at_their_own_checkpoint(client):
    d = DDict(total_mem="32 MiB", client=client, working_set_size=4)

    def run(h, c):
        h.checkpoint_id = c
        h[f"t{c}"] = c
        return h[f"t{c}"]

    try:
        futs = [client.submit(run, d, c, pure=False) for c in range(4)]
        wait(futs)
        assert [f.result() for f in futs] == [0, 1, 2, 3]
        for c in range(4):  # a reader at c sees what was written at c and before
            d.checkpoint_id = c
            assert len(d) == c + 1 and set(d.keys()) == {f"t{i}" for i in range(c + 1)}
        d.checkpoint_id = 1
        with pytest.raises(DDictKeyError):
            d["t2"]
    finally:
        d.destroy()


def test_multiple_restarts(client):
    d = DDict(total_mem="32 MiB", client=client, name="r3", working_set_size=2)
    mine = shards(d)
    d["a"] = 0
    for i in range(3):
        d.destroy(allow_restart=True)
        d = DDict(total_mem="32 MiB", client=client, name="r3", working_set_size=2, restart=True)
        assert shards(d) == mine  # the same shards, re-attached
        assert d["a"] == i and d.empty_managers == []
        d["a"] = i + 1
    d.destroy()
    assert not (mine & shm_entries())


def test_only_retired_checkpoints_reach_the_store(client, tmp_path):
    """Dragon: 17 put+checkpoint rounds with wss=2, freq=1, count=-1 persist exactly 0..14."""
    d = DDict(
        total_mem="32 MiB",
        client=client,
        n_workers=1,
        working_set_size=2,
        persist_freq=1,
        persist_count=-1,
        persist_path=str(tmp_path / "s"),
    )
    try:
        for i in range(17):
            d["k"] = i
            d.checkpoint()
        d.sync()
        assert d.persisted_ids() == list(range(15))
    finally:
        d.destroy()  # a destroy does not persist the in-memory window
    e = DDict(
        total_mem="32 MiB",
        client=client,
        n_workers=1,
        name=d.get_name(),
        persist_path=str(tmp_path / "s"),
        restore_from=14,
    )
    try:
        assert e["k"] == 14 and e.persisted_ids() == list(range(15))
    finally:
        e.destroy()


def test_progress_bars_follow_the_managers_when_asked(client, tmp_path, capsys):
    """``ddict.progress``: bars for persist/sync/restore/clone when on, nothing when off."""
    import dask

    with DDict(
        total_mem="16 MiB", client=client, persist_path=str(tmp_path / "s"), name="bars"
    ) as d:
        d["k"] = 1
        with dask.config.set({"ddict.progress": False}):
            d.persist()
            d.sync()
        assert "manager/s" not in capsys.readouterr().err  # no bar
        with dask.config.set({"ddict.progress": True}):
            d.restore(0)
            with DDict(total_mem="16 MiB", client=client) as other:
                d.clone([other.serialize()])
                assert other["k"] == 1
        err = capsys.readouterr().err
        assert "restore 0" in err and f"copy into {other.get_name()}" in err
        assert f"0/{d.num_managers} " in err and "manager/s" in err  # a bar over the managers
