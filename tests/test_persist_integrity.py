"""Checkpoints survive crashes during a persist and refuse damaged data.

Crash tests run the writer in a real process and SIGKILL it at named steps of
a persist, for each persister (``KINDS``: the zarr store and the directory of
files); damage tests flip, delete and overwrite real files of each.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from distributed import Client

from dask_ddict import DDict, DDictPersistCheckpointError
from dask_ddict._serialize import loads_value
from dask_ddict.persist import CheckpointPersister, Persister, ZarrPersister
from dask_ddict.persist.zarr_store import FORMAT
from tests.support import rotation
from tests.support.cluster import local_cluster
from tests.support.persisted import CHUNK, entries_of, generation, opened
from tests.support.polling import poll_for

CRASHER = Path(__file__).parent / "support" / "children" / "crash_persist.py"
#: The persisters every crash test runs against (``persister_class=`` names).
KINDS = ["zarr", "directory"]


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


def read_tags(store: CheckpointPersister, chkpt: int) -> set[int]:
    """The tags of a checkpoint's values: one tag means one complete write."""
    got = {k: loads_value(bytes(v)) for k, v, _ in store.read(chkpt)}
    assert set(got) == set(generation(0))
    return {int(t) for v in got.values() for t in np.unique(v)}


def crash(path: str, chkpt: int, count: int, at: str, nth: int = 1, kind: str = "zarr") -> int:
    args = [
        sys.executable,
        str(CRASHER),
        path,
        str(chkpt),
        str(count),
        at,
        str(nth),
        kind,
    ]
    return subprocess.run(args, capture_output=True, timeout=120).returncode


@pytest.mark.parametrize(
    "at,nth",
    [("chunk", 1), ("chunk", 3), ("arrays", 1), ("commit", 1), ("committed", 1), ("cleanup", 1)],
)
def test_killed_while_re_persisting_an_id_keeps_old_or_new(tmp_path, at, nth, kind):
    path = str(tmp_path)
    opened(kind, path).write(0, entries_of(generation(0)))
    assert crash(path, 0, -1, at, nth, kind) == -signal.SIGKILL
    store = opened(kind, path)
    assert store.ids() == [0]
    tags = read_tags(store, 0)
    # (a generation counts once recorded: killed before, it is not the checkpoint yet)
    assert tags == ({1} if at == "cleanup" else {0})  # never a mix, never none
    # The next persist of the id cleans up whatever the crash left.
    Persister(store, 1, -1).write_now(0, entries_of(generation(2)))
    assert read_tags(store, 0) == {2} and len(store.generations()) == 1


def test_a_re_persist_on_some_managers_only_leaves_the_previous_version_on_all(tmp_path, kind):
    """Checkpoint 0 persisted as version 1 by both managers, then again as version 2 by
    manager 1 only (manager 0's write cut short): both read version 1, never a mix.  Once
    manager 0 writes version 2 too, both read 2, and pruning leaves one generation each."""
    path = str(tmp_path)

    def store(m: int, step=lambda name: None) -> Any:
        return opened(kind, path, m, 2, step=step)

    for m in range(2):
        store(m).write(0, entries_of(generation(1)), version=1)
    store(1).write(0, entries_of(generation(2)), version=2)

    def cut(name: str) -> None:
        if name == "arrays":
            raise OSError("disk gone")

    with pytest.raises(OSError):
        store(0, cut).write(0, entries_of(generation(2)), version=2)
    assert [read_tags(store(m), 0) for m in range(2)] == [{1}, {1}]
    assert store(0).versions()[0].version == 1 and store(0).complete_ids() == [0]
    for m in range(2):
        store(m).prune()  # (nothing is replaced everywhere yet: both versions stay)
    assert len([g for g in store(1).generations() if g.committed]) == 2
    store(0).write(0, entries_of(generation(2)), version=2)
    assert [read_tags(store(m), 0) for m in range(2)] == [{2}, {2}]
    for m in range(2):
        store(m).prune()
        assert [(g.gen, g.version) for g in store(m).generations()] == [
            (max(g.gen for g in store(m).generations()), 2)
        ]
        assert store(m).ids() == [0]


def test_a_restore_removes_the_parts_of_versions_that_only_some_managers_persisted(tmp_path, kind):
    """Manager 1 persisted version 2 of checkpoint 0 (and checkpoint 1), manager 0's
    writes failed (a full disk): the checkpoint is still version 1.  A restore of 0 ends
    that history: manager 1's version-2 part and checkpoint 1 are removed (they would
    hold the room the next persists need), version 1 stays whole on both."""
    path = str(tmp_path)

    def store(m: int, step=lambda name: None) -> Any:
        return opened(kind, path, m, 2, step=step)

    def full(name: str) -> None:
        if name == "arrays":
            raise OSError(28, "No space left on device")

    for m in range(2):
        store(m).write(0, entries_of(generation(1)), version=1)
    store(1).write(0, entries_of(generation(2)), version=2)
    store(1).write(1, entries_of(generation(3)), version=2)
    for c in (0, 1):
        with pytest.raises(OSError):
            store(0, full).write(c, entries_of(generation(2)), version=2)
    assert [len(store(m).generations()) for m in range(2)] == [1, 3]  # (0's failed: gone)
    for m in range(2):
        Persister(store(m), 1, -1).discard_above(0)  # (what a restore of 0 does last)
    for m in range(2):
        s = store(m)
        assert [(g.chkpt, g.version) for g in s.generations()] == [(0, 1)]
        assert s.recorded() == {(0, 1)} and read_tags(s, 0) == {1}
    assert store(0).complete_ids() == [0]


@pytest.mark.parametrize("at", ["chunk", "commit", "committed", "rotate"])
def test_killed_during_rotation_keeps_the_newest_complete_checkpoint(tmp_path, at, kind):
    path = str(tmp_path)
    opened(kind, path).write(0, entries_of(generation(0)))
    assert crash(path, 1, 1, at, kind=kind) == -signal.SIGKILL  # persist_count=1: 1 replaces 0
    store = opened(kind, path)
    ids = store.ids()
    if at in ("chunk", "commit", "committed"):  # (1 counts once recorded)
        assert ids == [0] and read_tags(store, 0) == {0}
    else:
        assert ids == [1] and read_tags(store, 1) == {1}


def test_a_removal_cut_short_is_never_listed_and_is_finished_later(tmp_path, kind):
    """Rotation removes a checkpoint's commit before its data: a crash part-way
    through the data (a store deletes a directory file by file) leaves it unlisted."""
    path = str(tmp_path)
    opened(kind, path).write(0, entries_of(generation(0)))
    assert crash(path, 1, 1, "uncommitted", kind=kind) == -signal.SIGKILL  # (1 replaces 0)
    g0 = tmp_path / "d" / "manager_0" / "chkpt_0.g0"
    gone = (
        list((g0 / "values" / "c").iterdir())[:2]
        if kind == "zarr"
        else [g0 / "values", g0 / "keys"]
    )
    for f in gone:  # as far as the removal got
        f.unlink()
    store = opened(kind, path)
    assert store.ids() == [1] == store.complete_ids() and read_tags(store, 1) == {1}
    assert [(g.chkpt, g.committed) for g in store.generations()] == [(0, False), (1, True)]
    Persister(store, 1, 1).write_now(2, entries_of(generation(2)))
    assert store.ids() == [2] and not g0.exists()  # the next rotation finishes the removal


def test_a_torn_commit_falls_back_to_the_previous_copy(tmp_path, kind):
    path = str(tmp_path)
    opened(kind, path).write(0, entries_of(generation(0)))
    assert crash(path, 0, -1, "commit", kind=kind) == -signal.SIGKILL
    meta = (
        tmp_path
        / "d"
        / "manager_0"
        / "chkpt_0.g1"
        / ("zarr.json" if kind == "zarr" else "generation.json")
    )
    meta.write_bytes(meta.read_bytes()[:40])  # the commit's write cut short
    store = opened(kind, path)
    assert store.ids() == [0] and read_tags(store, 0) == {0}
    assert any(g.problem for g in store.generations())


# -- rotation across managers ----------------------------------------------------------


def _events(path: str, count: int, options: rotation.Options, kind: str) -> list[rotation.Event]:
    """Every step of the scenario, each chunk write but the first and last left out."""
    rotation.setup(path, count, options, kind)
    events = rotation.run(path, count, options, kind)
    chunks = [e for e in events if e[1] == "chunk"]
    skip = {e for e in chunks if e[2] != 1 and (e[0], e[1], e[2] + 1) in set(chunks)}
    return [e for e in events if e not in skip]


def crash_at_every_step(
    root: str, count: int, options: rotation.Options = None, kind: str = "zarr"
) -> None:
    """Two managers persist a new checkpoint at their own pace under persist_count=count;
    one is SIGKILLed at each step of each write and rotation in turn (chunks, arrays,
    commit, record, cleanup; unrecord, uncommit, remove) while the other goes on with
    its own persists.  After every crash the ids committed on both managers are not
    empty, each of them reads back whole on both, the commit record names only those,
    and the scenario run again from there (a restarted manager persists again) ends in
    the same state as without a crash."""
    events = _events(f"{root}/record", count, options, kind)
    names = {e[1] for e in events}
    assert {
        "chunk",
        "arrays",
        "commit",
        "committed",
        "recorded",
        "unrecorded",
        "uncommitted",
        "removed",
        "rotate",
    } <= names
    assert {rotation.OPS[e[0]][0] for e in events if e[1] == "rotate"} == {0, 1}  # both rotate
    cases = []
    for i, (op, step, nth) in enumerate(events):
        path = f"{root}/crash{i}"
        rotation.setup(path, count, options, kind)
        cases.append(f"{path} {count} {op} {step} {nth}\n")
    out = subprocess.run(
        [
            sys.executable,
            str(rotation.FORKER),
            json.dumps(options),
            kind,
        ],
        input="".join(cases),
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    ).stdout.split()
    assert out == [str(-signal.SIGKILL)] * len(events)
    n = count
    keep = list(range(n + 1 - count, n + 1))  # the newest `count` ids complete at the end
    for i, event in enumerate(events):
        path = f"{root}/crash{i}"
        stores = rotation.stores(path, options, kind)
        persisted = sorted(set.intersection(*(set(s.ids()) for s in stores)))
        assert persisted, f"killed at {event}: no checkpoint is restorable"
        for c in persisted:
            for s in stores:
                assert rotation.tags(s, c) == {c}, f"killed at {event}: checkpoint {c}"
        assert set(stores[0].complete_ids()) <= set(persisted), event
        rotation.run(path, count, options, kind)  # carry on: the crashed manager persists anew
        stores = rotation.stores(path, options, kind)
        assert [s.ids() for s in stores] == [keep + [n + 1], keep], event
        assert stores[0].complete_ids() == keep, event
        for s in stores:
            assert all(g.committed for g in s.generations()), event  # nothing left over
            assert len(s.generations()) == len(s.ids()), event


@pytest.mark.parametrize("count", [1, pytest.param(2, marks=pytest.mark.slow)])  # (each ~20 s)
def test_a_crash_at_any_step_of_any_manager_leaves_the_newest_complete_id_restorable(
    tmp_path, count, kind
):
    crash_at_every_step(str(tmp_path), count, kind=kind)


@pytest.mark.slow
@pytest.mark.timeout(900)  # (as its subprocess: every step on S3 took 384 s on 2 cores)
def test_the_same_on_an_object_store(s3):
    """S3 cannot rename or delete a prefix atomically: the same guarantees hold."""
    crash_at_every_step(f"{s3.bucket()}/steps", 1, s3.storage_options)


# -- damaged stores ------------------------------------------------------------------------


@pytest.fixture
def written(tmp_path):
    store = ZarrPersister(str(tmp_path), "d", 0, 1, chunk_bytes=CHUNK)
    store.write(3, entries_of(generation(0)))
    return store, tmp_path / "d" / "manager_0" / "chkpt_3.g0"


def refused(store: ZarrPersister, match: str) -> str:
    with pytest.raises(DDictPersistCheckpointError, match=match) as info:
        list(store.read(3))
    text = str(info.value)
    assert "checkpoint 3" in text and "manager 0" in text and store.path in text
    return text


def test_a_flipped_byte_in_a_value_chunk_is_refused(written):
    store, g = written
    chunk = g / "values" / "c" / "1"
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0x40
    chunk.write_bytes(bytes(raw))
    refused(store, "chunk 1 of values")


def test_a_missing_chunk_is_refused(written):
    store, g = written
    (g / "values" / "c" / "2").unlink()
    refused(store, "chunk 2 of values is missing")


def test_overwritten_offsets_are_refused(written):
    store, g = written
    arr = zarr.open_array(str(g / "value_offsets"), mode="r+")
    arr[3] = arr[3] + 8  # a valid chunk checksum, wrong content
    refused(store, "value_offsets.*checksum")


def test_garbage_checkpoint_metadata_is_refused(written):
    store, g = written
    (g / "zarr.json").write_bytes(b"\x00garbage{")
    text = refused(store, "not persisted")
    assert "unreadable" in text and "chkpt_3.g0" in text


def test_garbage_array_metadata_is_refused(written):
    store, g = written
    (g / "keys" / "zarr.json").write_text("[1, 2")
    refused(store, "cannot read it")


def test_garbage_manager_metadata_and_old_formats_are_refused(tmp_path, written):
    store, g = written
    meta = tmp_path / "d" / "manager_0" / "zarr.json"
    good = meta.read_text()
    meta.write_text("{not json")
    with pytest.raises(DDictPersistCheckpointError, match="manager 0 of 'd'.*unreadable"):
        ZarrPersister(str(tmp_path), "d", 0, 1)
    doc = json.loads(good)
    doc["attributes"]["format"] = "dask_ddict.checkpoint/1"
    meta.write_text(json.dumps(doc))
    with pytest.raises(DDictPersistCheckpointError, match=f"checkpoint/1.*{FORMAT}"):
        ZarrPersister(str(tmp_path), "d", 0, 1)
    doc["attributes"]["format"] = "dask_ddict.checkpoint/2"  # same key bytes, older frames
    meta.write_text(json.dumps(doc))
    ZarrPersister(str(tmp_path), "d", 0, 1, writable=False)  # read as it is
    ZarrPersister(str(tmp_path), "d", 0, 1)  # and, opened to write, marked as ours
    assert (
        json.loads(meta.read_text())["attributes"]["format"]
        == FORMAT
        == "dask_ddict.checkpoint/2.2"
    )


def test_a_store_path_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(DDictPersistCheckpointError, match="is a file"):
        ZarrPersister(str(f), "d", 0, 1)


@pytest.fixture
def written_files(tmp_path):
    """A checkpoint of the directory persister, and its generation's directory."""
    store = opened("directory", str(tmp_path))
    store.write(3, entries_of(generation(0)))
    return store, tmp_path / "d" / "manager_0" / "chkpt_3.g0"


def test_the_directory_persisters_damaged_files_are_refused(written_files):
    store, g = written_files
    assert read_tags(store, 3) == {0}
    values = g / "values"
    good = values.read_bytes()
    raw = bytearray(good)
    raw[CHUNK + 100] ^= 0x40
    values.write_bytes(bytes(raw))
    refused(store, "chunk 1 of values")
    values.write_bytes(good[: 3 * CHUNK])  # truncated: a write cut short, a full disk
    refused(store, "array shapes do not match")
    values.write_bytes(good)
    keys = g / "keys"
    keys.write_bytes(keys.read_bytes()[:-1])
    refused(store, "'keys' does not match its committed checksum")
    keys.unlink()
    refused(store, "cannot read it")
    (g / "generation.json").write_bytes(b"\x00garbage{")
    text = refused(store, "not persisted")
    assert "unreadable" in text and "chkpt_3.g0" in text


def test_the_directory_persister_refuses_a_file_a_url_and_another_format(tmp_path, written_files):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(DDictPersistCheckpointError, match="is a file"):
        opened("directory", str(f))
    with pytest.raises(DDictPersistCheckpointError, match="URL.*zarr"):
        opened("directory", "memory://somewhere")
    meta = tmp_path / "d" / "manager_0" / "manager.json"
    meta.write_text(
        json.dumps({**json.loads(meta.read_text()), "format": "dask_ddict.directory/0"})
    )
    with pytest.raises(DDictPersistCheckpointError, match="directory/0"):
        opened("directory", str(tmp_path))
    # a zarr persister does not take a directory persister's store for its own
    with pytest.raises(DDictPersistCheckpointError):
        list(ZarrPersister(str(tmp_path), "d", 0, 1, writable=False).read(3))


def test_restore_of_a_damaged_checkpoint_changes_nothing(client, tmp_path):
    path = str(tmp_path / "store")
    with DDict(
        total_mem="32 MiB", client=client, name="dmg", persist_path=path, working_set_size=2
    ) as d:
        big = np.arange(300_000, dtype="f8")
        d["big"] = big
        d["small"] = 1
        d.persist()
        d.sync()
        d["small"] = 2
        m = d.which_manager("big")
        chunks = tmp_path / "store" / "dmg" / f"manager_{m}" / "chkpt_0.g0" / "values" / "c"
        victim = chunks / "0"
        raw = bytearray(victim.read_bytes())
        raw[-10] ^= 1
        victim.write_bytes(bytes(raw))
        with pytest.raises(DDictPersistCheckpointError, match=f"manager {m}.*chunk 0 of values"):
            d.restore(0)
        np.testing.assert_array_equal(d["big"], big)  # the shard is as it was
        assert d["small"] == 2


def test_killing_the_host_while_it_persists_keeps_a_complete_checkpoint(tmp_path):
    """The hosting process dies mid-persist; restore yields the old or the new copy."""
    path = str(tmp_path / "store")
    with (
        local_cluster(1) as cl,
        Client(cl) as c,
    ):
        d = DDict(total_mem="1 GiB", client=c, name="crash", persist_path=path)
        for i in range(8):
            d[f"k{i}"] = np.full(8 << 20, 0, dtype="u1")
        d.persist()
        d.sync()
        for i in range(8):
            d[f"k{i}"] = np.full(8 << 20, 1, dtype="u1")
        d.persist()  # re-persists checkpoint 0 in the background ...
        time.sleep(0.05)
        os.kill(d.stats[0].pid, signal.SIGKILL)  # ... and its host dies

        def restored() -> bool:
            try:
                d.restore(0)
                return True
            except Exception:  # noqa: BLE001 - the host is restarting
                return False

        poll_for(restored, 30, "a restore of checkpoint 0 once the host restarted", 0.2)
        tags = {int(np.unique(d[f"k{i}"])[0]) for i in range(8)}
        assert tags in ({0}, {1})
        d.destroy()
