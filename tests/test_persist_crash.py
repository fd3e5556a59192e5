"""Persisted checkpoints are restorable as a whole after a real crash, and stores are
where the user put them (real clusters, real host processes killed with SIGKILL)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from distributed import Client

from dask_ddict import DDict, DDictPersistCheckpointError
from dask_ddict.cli import ddict as cli
from dask_ddict.persist import ZarrPersister
from tests.support.cluster import local_cluster
from tests.support.polling import poll_for

#: Values of a checkpoint: large enough that persisting one takes a while, so that a
#: host process can be killed in the middle of it.
VALUE = 4 << 20


@pytest.fixture(scope="module")
def crash_client():
    """A cluster of its own: these tests kill its host processes."""
    with (
        local_cluster(2, threads_per_worker=2) as cl,
        Client(cl) as c,
    ):
        yield c


def keys_on(d: DDict, mid: int, n: int) -> list[str]:
    """``n`` keys that manager ``mid`` holds."""
    out: list[str] = []
    i = 0
    while len(out) < n:
        if d.which_manager(f"k{i}") == mid:
            out.append(f"k{i}")
        i += 1
    return out


def value(tag: int) -> np.ndarray:
    return np.full(VALUE, tag % 251, dtype="u1")


def tag_of(v: np.ndarray) -> int:
    (t,) = np.unique(v)
    return int(t)


def wait_for(what: str, ready: Callable[[], bool], seconds: float = 60) -> None:
    poll_for(ready, seconds, what, 0.001)


def retry(
    call: Callable[[], object], seconds: float = 60, quietly: type[Exception] | None = None
) -> object:
    """``call()`` while a killed host process is being restarted (an error of type
    ``quietly`` is raised at once: what the test waits for)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - the host is restarting
            if time.monotonic() > deadline or (quietly is not None and isinstance(e, quietly)):
                raise
            time.sleep(0.2)


@dataclass(frozen=True)
class Place:
    """Where a test persists: a local directory, or a bucket of a real S3 server."""

    path: str
    storage_options: dict[str, Any] | None = None

    def ids(self, name: str, mid: int) -> list[int]:
        return ZarrPersister(
            self.path, name, mid, 2, writable=False, storage_options=self.storage_options
        ).ids()

    def started(self, name: str, mid: int, chkpt: int, gen: int = 0) -> Callable[[], bool]:
        """Whether manager ``mid`` has begun writing generation ``gen`` of ``chkpt``."""
        group = f"{self.path}/{name}/manager_{mid}/chkpt_{chkpt}.g{gen}"
        if self.storage_options is None:
            return lambda: os.path.isdir(group)
        import s3fs

        fs = s3fs.S3FileSystem(
            skip_instance_cache=True, use_listings_cache=False, **self.storage_options
        )
        return lambda: bool(fs.exists(f"{group}/zarr.json"))


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])  # (s3: ~13 s)
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    if request.param == "local":
        return Place(str(tmp_path / "ckpt.zarr"))
    s3 = request.getfixturevalue("s3")
    return Place(f"{s3.bucket()}/ckpt.zarr", s3.storage_options)


def test_sigkill_of_a_host_mid_persist_keeps_the_previous_checkpoint_and_sync_redoes_it(
    crash_client, place
):
    """Issue 21's defect, and issue 30's: persist_count=1, two managers, the host of
    manager 0 killed while it persists checkpoint 1.  Manager 1 commits 1 but keeps 0,
    so 0 stays restorable as a whole while 1 is not complete.  The restarted host
    process persists 1 again (it is still in the window), so sync() is true when it
    returns: 1 is committed on both, rotation drops 0, and restoring 1 brings back every
    key."""
    name = "crash-mid-persist"
    store = dict(persist_path=place.path, storage_options=place.storage_options)
    d = DDict(
        total_mem="512 MiB",
        client=crash_client,
        name=name,
        persist_count=1,
        working_set_size=2,
        lifetime="cluster",
        **store,
    )
    assert d.num_managers == 2 and len(set(d.manager_workers)) == 2
    keys = {m: keys_on(d, m, 12) for m in range(2)}
    for m in range(2):
        for k in keys[m]:
            d[k] = value(0)
    d.persist()
    d.sync()
    d.checkpoint()
    for m in range(2):
        for k in keys[m]:
            d[k] = value(1)
    host = d.stats[0].pid
    d.persist()
    wait_for("manager 0 to start persisting checkpoint 1", place.started(name, 0, 1))
    os.kill(host, signal.SIGKILL)
    wait_for("manager 1 to commit checkpoint 1", lambda: 1 in place.ids(name, 1))
    assert place.ids(name, 1) == [0, 1]  # 0 kept: 1 is not complete yet
    retry(d.sync)  # the supervisor restarts the host, which persists 1 again
    assert d.stats[0].pid != host
    assert d.persisted_ids() == [1]
    assert place.ids(name, 0) == [1] == place.ids(name, 1)  # sync() rotates every manager
    d.destroy()

    r = DDict(
        total_mem="512 MiB",
        client=crash_client,
        name=name,
        persist_count=1,
        working_set_size=2,
        restore_from=1,
        **store,
    )
    try:
        got = {k: tag_of(r[k]) for m in range(2) for k in keys[m]}
        assert got == {k: 1 for m in range(2) for k in keys[m]}  # every key, all of 1
    finally:
        r.destroy()


def test_a_re_persist_cut_short_by_a_host_kill_restores_as_one_version(crash_client, tmp_path):
    """Issue 51's defect: checkpoint 0 persisted, written again (and new keys), persisted
    again under the same id, the host of manager 0 SIGKILLed while it writes.  Manager 1
    committed the new version, manager 0 not: both still read the first one (never
    manager 0's first and manager 1's second).  The restarted host writes the new version
    again (0 is still in the window) and sync() waits for it: a restore then brings back
    the second version on every manager, every key."""
    name = "crash-re-persist"
    path = str(tmp_path / "again.zarr")
    d = DDict(
        total_mem="512 MiB",
        client=crash_client,
        name=name,
        persist_path=path,
        working_set_size=2,
        lifetime="cluster",
        timeout=60,
    )
    keys = {m: keys_on(d, m, 12) for m in range(2)}
    first = [k for m in range(2) for k in keys[m][:6]]
    try:
        for k in first:
            d[k] = value(0)
        d.persist()
        d.sync()
        for m in range(2):
            for k in keys[m]:
                d[k] = value(1)  # the same checkpoint 0: changed, and 12 more keys
        host = d.stats[0].pid
        d.persist()
        wait_for("manager 0 to start writing 0 again", Place(path).started(name, 0, 0, gen=1))
        os.kill(host, signal.SIGKILL)
        wait_for(
            "manager 1 to commit its part",
            lambda: (
                len(
                    [
                        g
                        for g in ZarrPersister(path, name, 1, 2, writable=False).generations()
                        if g.committed
                    ]
                )
                == 2
            ),
        )
        for m in range(2):  # one version on both: the first
            got = [k for k, _, _ in ZarrPersister(path, name, m, 2, writable=False).read(0)]
            assert len(got) == 6, (m, len(got))
        retry(d.sync)  # the restarted host writes its part of the second version again
        assert d.stats[0].pid != host and d.persisted_ids() == [0]
        for m in range(2):  # ... and sync() removed the first version on both
            assert len(ZarrPersister(path, name, m, 2, writable=False).generations()) == 1
    finally:
        d.destroy()
    r = DDict(
        total_mem="512 MiB",
        client=crash_client,
        name=name,
        persist_path=path,
        working_set_size=2,
        restore_from=0,
    )
    try:
        assert len(r) == 24
        assert {k: tag_of(r[k]) for m in range(2) for k in keys[m]} == {
            k: 1 for m in range(2) for k in keys[m]
        }
    finally:
        r.destroy()


def test_a_persist_that_cannot_be_redone_makes_sync_raise_naming_it(crash_client, tmp_path):
    """wait_for_keys: retiring checkpoint 0 drops its versions, so once its host process
    dies while persisting it, 0 cannot be read again.  sync() raises naming checkpoint
    0, manager 0 and why, every time, never a silent success; a later checkpoint
    committed on that manager ends the report."""
    store = tmp_path / "lost.zarr"
    name = "crash-lost"
    d = DDict(
        total_mem="512 MiB",
        client=crash_client,
        name=name,
        persist_path=str(store),
        persist_freq=1,
        persist_count=-1,
        working_set_size=2,
        wait_for_keys=True,
        lifetime="cluster",
        timeout=60,
    )
    keys = keys_on(d, 0, 12) + keys_on(d, 1, 12)
    try:
        for c in range(2):  # every key at 0 and 1 (non-persistent): 0 may retire
            d.checkpoint_id = c
            for k in keys:
                d[k] = value(c)
        host = d.stats[0].pid
        d.checkpoint_id = 2
        d[keys[0]] = value(2)  # retires 0 on manager 0: persisted in the background
        wait_for(
            "manager 0 to start persisting checkpoint 0", Place(str(store)).started(name, 0, 0)
        )
        os.kill(host, signal.SIGKILL)
        for _ in range(2):  # said again: reading the failures changes nothing
            with pytest.raises(DDictPersistCheckpointError) as e:
                retry(d.sync, quietly=DDictPersistCheckpointError)
            text = str(e.value)
            assert "checkpoint 0 on manager 0:" in text and "died" in text and "retired" in text
        assert 0 not in d.persisted_ids()
        for k in keys:  # retire 1 everywhere: committed on manager 0, it ends the report
            d[k] = value(2)
        d.checkpoint_id = 3
        for k in keys:
            d[k] = value(3)
        d.sync()
        assert 1 in d.persisted_ids()
    finally:
        d.destroy()


def test_automatic_persistence_from_several_writers_survives_a_host_kill(crash_client, tmp_path):
    """persist_freq=1, persist_count=1: tasks in both worker processes and this process
    write every checkpoint; the host of manager 0 dies while it persists a retiring one.
    The newest id in persisted_ids() restores with every key of that checkpoint."""
    store = tmp_path / "auto.zarr"
    name = "crash-auto"
    d = DDict(
        total_mem="512 MiB",
        client=crash_client,
        name=name,
        persist_path=str(store),
        persist_freq=1,
        persist_count=1,
        working_set_size=2,
        lifetime="cluster",
    )
    keys = keys_on(d, 0, 6) + keys_on(d, 1, 6)
    writers = [keys[i::3] for i in range(3)]  # two tasks and this process

    def write(h: DDict, chkpt: int, mine: list[str]) -> None:
        h.checkpoint_id = chkpt
        for k in mine:
            h[k] = value(chkpt)

    host = d.stats[0].pid
    killed = False
    for c in range(7):
        futures = crash_client.map(write, [d, d], [c, c], writers[:2], pure=False)
        write(d, c, writers[2])
        if c == 4:  # writing 4 retires 2: kill manager 0 while it persists it
            wait_for(
                "manager 0 to start persisting checkpoint 2", Place(str(store)).started(name, 0, 2)
            )
            os.kill(host, signal.SIGKILL)
            killed = True
        crash_client.gather(futures)
    assert killed
    retry(d.sync)
    ids = d.persisted_ids()
    assert ids and ids[-1] == 4  # 5 retired 3 and 6 retired 4, on both managers
    for m in range(2):  # after sync(), every manager keeps the newest complete id only
        assert Place(str(store)).ids(name, m) == [ids[-1]]
    d.destroy()
    r = DDict(
        total_mem="512 MiB",
        client=crash_client,
        name=name,
        persist_path=str(store),
        working_set_size=2,
        restore_from=ids[-1],
    )
    try:
        assert {k: tag_of(r[k]) for k in keys} == {k: ids[-1] for k in keys}
    finally:
        r.destroy()


def test_a_relative_persist_path_is_the_callers(client, tmp_path, monkeypatch):
    """Persisted from a directory other than the workers', restored in a new cluster, and
    read by the CLI, all through the same relative path."""
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    name = "relative"
    with DDict(total_mem="32 MiB", client=client, name=name, persist_path="ckpt.zarr") as d:
        assert d._core.layout.options.persist_path == str(project / "ckpt.zarr")
        for i in range(20):
            d[i] = np.arange(i + 1)
        d.persist()
        d.sync()
        assert d.persisted_ids() == [0]
    assert (project / "ckpt.zarr" / name / "manager_0" / "chkpt_0.g0").is_dir()
    with (
        local_cluster(1) as cl,
        Client(cl) as c,
    ):
        with DDict(
            2, total_mem="32 MiB", client=c, name=name, persist_path="ckpt.zarr", restore_from=0
        ) as r:
            assert all(np.array_equal(r[i], np.arange(i + 1)) for i in range(20))
        runner = CliRunner()
        out = runner.invoke(cli, ["inspect", "ckpt.zarr"], catch_exceptions=False).output
        assert f"{name}: 2 managers" in out and out.count("checksums ok") == 2
        res = runner.invoke(
            cli,
            [
                "restore",
                "ckpt.zarr",
                "--name",
                name,
                "--total-mem",
                "32 MiB",
                "--scheduler",
                cl.scheduler_address,
            ],
            catch_exceptions=False,
        )
        assert res.exit_code == 0 and res.output.startswith("ddict3:"), res.output
        r = DDict.from_name(name, c)
        try:
            assert all(np.array_equal(r[i], np.arange(i + 1)) for i in range(20))
        finally:
            r.destroy()


def test_storage_options_reach_the_store_and_nothing_else(crash_client, s3):
    """Credentials go to the host processes' filesystem, not into handles, reprs or logs;
    copy() persists with them too; bad ones are refused before anything is created."""
    import base64
    import pickle
    import secrets

    secret = secrets.token_hex(16)
    options = {**s3.storage_options, "key": f"AKIA{secret[:8].upper()}", "secret": secret}
    url = f"{s3.bucket()}/ckpt.zarr"
    before = DDict.list(crash_client)
    with pytest.raises(TypeError, match="storage_options must be a dict"):
        DDict(total_mem="32 MiB", client=crash_client, persist_path=url, storage_options=[1])
    with pytest.raises(ValueError, match="storage_options.*local directory"):
        DDict(
            total_mem="32 MiB",
            client=crash_client,
            persist_path="ckpt.zarr",
            storage_options=options,
        )
    assert DDict.list(crash_client) == before
    d = DDict(
        total_mem="32 MiB",
        client=crash_client,
        name="creds",
        persist_path=url,
        storage_options=options,
    )
    try:
        d["a"] = np.arange(10)
        d.persist()
        d.sync()
        assert d.persisted_ids() == [0]
        c = d.copy("creds-copy")  # the creator's handle keeps the options for copy()
        try:
            c.persist()
            c.sync()
            assert c.persisted_ids() == [0]
        finally:
            c.destroy()
        assert any("creds-copy/manager_1/chkpt_0.g0" in k for k in s3.keys(url))
        s = d.serialize()
        texts = [
            s,
            base64.urlsafe_b64decode(s[7:].rpartition(".")[0]).decode(),
            repr(d),
            repr(d._core.layout),
            str(pickle.dumps(d)),
            d._repr_html_(),
        ]
        logs = [crash_client.get_scheduler_logs(), crash_client.get_worker_logs()]
        assert not any(secret in t for t in texts + [repr(logs)])
    finally:
        d.destroy()
    r = DDict(
        total_mem="32 MiB",
        client=crash_client,
        name="creds",
        persist_path=url,
        storage_options=options,
        restore_from=0,
    )
    try:
        np.testing.assert_array_equal(r["a"], np.arange(10))
    finally:
        r.destroy()
