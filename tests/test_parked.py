"""Parked and kept shards whose cluster is gone: swept by the next host, listed and
removed by ``dask ddict parked``.

A real script process holds a ``LocalCluster`` whose only worker left (so its managers
are parked in shared memory), and is SIGKILLed: its scheduler dies with it, and with
it the only registry that could ever serve those shards again.  Every test keeps its
shards in a shard directory of its own (``ddict.store.directory``), so it sees and
removes only what it made.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

import dask
import pytest
from click.testing import CliRunner
from distributed import Client

from dask_ddict import DDict
from dask_ddict.cli import ddict as cli
from dask_ddict.host import hygiene
from tests.support.cluster import local_cluster
from tests.support.polling import poll_for

#: A script that parks the managers of each dictionary named on its command line (its
#: only worker leaves), prints their shard paths, and waits to be killed.
PARKING = textwrap.dedent("""
    import sys, time
    from distributed import Client, LocalCluster
    from dask_ddict import DDict
    if __name__ == "__main__":
        cl = LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0",
                          memory_limit="1GiB")
        c = Client(cl)
        dicts = [DDict(managers_per_worker=2, total_mem="16 MiB", client=c, name=n,
                       timeout=30) for n in sys.argv[1:]]
        for d in dicts:
            d.update({i: i for i in range(100)})
        paths = [m.store_path for d in dicts for m in d._core.layout.managers]
        cl.scale(0)
        deadline = time.monotonic() + 60
        while not all(m.parked for d in dicts for m in d._core.fresh(force=True).managers):
            assert time.monotonic() < deadline, "not parked"
            time.sleep(0.2)
        print(" ".join(paths), flush=True)
        time.sleep(600)
""")


@pytest.fixture
def shard_dir() -> Iterator[str]:
    """A shard directory of this test's own, in shared memory."""
    path = tempfile.mkdtemp(prefix="test-parked-", dir="/dev/shm")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def parking_script(
    tmp_path,
    shard_dir: str,  # noqa: ANN001
    *names: str,
) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """A script process whose dictionaries ``names`` are parked in ``shard_dir``, and
    their shard paths; whatever is left of its session is killed at the end."""
    script = tmp_path / "parking.py"
    script.write_text(PARKING)
    env = {**os.environ, "DASK_DDICT__STORE__DIRECTORY": shard_dir}
    proc = subprocess.Popen(
        [sys.executable, str(script), *names],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        paths = proc.stdout.readline().split()
        assert len(paths) == 2 * len(names), "the script did not park its managers"
        yield proc, paths
    finally:
        kill(proc)


def kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the script (a crash), then whatever of its session is left (its process
    group), all but multiprocessing's resource tracker: once the others are gone it
    unlinks the semaphores they leave in /dev/shm, and exits (killed with them, it
    left six ``sem.mp-*`` files per script)."""
    import psutil

    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)
    left = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if os.getpgid(p.pid) == proc.pid:
                left.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    trackers = [p for p in left if "resource_tracker" in " ".join(p.info["cmdline"] or ())]
    for p in left:
        if p not in trackers:
            with contextlib.suppress(psutil.Error):
                p.kill()
    psutil.wait_procs(left, timeout=20)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # (a tracker that did not end: bounded)
    except ProcessLookupError:
        pass


def marker(path: str) -> dict:
    with open(os.path.join(path, hygiene.KEPT)) as f:
        return json.load(f)


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_a_killed_scripts_parked_shards_are_swept_by_the_next_host(tmp_path, shard_dir):
    """Parked shards of a SIGKILLed script are removed by the next host process on the
    machine; those of a live cluster stay, and so do shards kept for a restart by a live
    scheduler (which then restarts from them)."""
    with (
        dask.config.set({"ddict.store.directory": shard_dir}),
        local_cluster(1, memory_limit="1GiB") as cl,
        Client(cl) as c,
    ):
        kept = DDict(managers_per_worker=1, total_mem="16 MiB", client=c, name="kept-here")
        kept["k"] = "v"
        kept_paths = [m.store_path for m in kept._core.layout.managers]
        kept.destroy(allow_restart=True)
        assert [marker(p)["why"] for p in kept_paths] == ["restart"]
        assert marker(kept_paths[0])["scheduler"] == cl.scheduler_address

        with parking_script(tmp_path, shard_dir, "swept") as (proc, parked):
            said = [marker(p) for p in parked]
            assert all(m["why"] == "parked" and m["name"] == "swept" for m in said)
            assert all(m["scheduler"] not in ("", cl.scheduler_address) for m in said)
            # Its cluster lives: the sweep a starting host runs keeps everything.
            assert hygiene.sweep_kept(shard_dir) == []
            assert all(os.path.isdir(p) for p in parked + kept_paths)
            kill(proc)
            assert all(os.path.isdir(p) for p in parked)  # (kept, until a host sweeps)

        cl.scale(2)  # the next host processes on this machine start, and sweep
        c.wait_for_workers(2, timeout=60)
        poll_for(
            lambda: not any(os.path.exists(p) for p in parked),
            30,
            lambda: f"the parked shards swept: {os.listdir(shard_dir)}",
            0.2,
        )
        assert all(os.path.isdir(p) for p in kept_paths)  # its scheduler lives and keeps it
        again = DDict(
            n_workers=1,
            managers_per_worker=1,
            total_mem="16 MiB",
            client=c,
            name="kept-here",
            restart=True,
        )
        try:
            assert again["k"] == "v"
        finally:
            again.destroy()
    assert os.listdir(shard_dir) == []


def test_dask_ddict_parked_lists_and_removes(tmp_path, shard_dir):
    """``dask ddict parked`` lists the parked shards with their dictionary, manager,
    bytes and whether their cluster is alive; ``--remove`` removes those whose cluster
    is gone, ``--force NAME`` any of dictionary NAME."""
    code, out = run("parked", "--directory", shard_dir)
    assert code == 0 and out.strip() == f"no parked or kept shards in {shard_dir}"
    with parking_script(tmp_path, shard_dir, "cli-a", "cli-b") as (proc, paths):
        code, out = run("parked", "--directory", shard_dir)
        lines = out.strip().splitlines()
        assert code == 0 and lines[0].split()[:5] == [
            "dictionary",
            "manager",
            "kept",
            "bytes",
            "cluster",
        ]
        rows = sorted(line.split() for line in lines[1:])
        assert [(r[0], r[1], r[2], r[4]) for r in rows] == [
            ("cli-a", "0", "parked", "alive"),
            ("cli-a", "1", "parked", "alive"),
            ("cli-b", "0", "parked", "alive"),
            ("cli-b", "1", "parked", "alive"),
        ]
        assert all(int(r[3]) >= 8 << 20 for r in rows)  # (a 8 MiB shard's pages, reserved)
        assert sorted(r[-1] for r in rows) == sorted(paths)

        code, out = run("parked", "--directory", shard_dir, "--remove")
        assert code == 0 and "removed 0 shard(s)" in out  # its cluster lives
        assert all(os.path.isdir(p) for p in paths)
        code, out = run("parked", "--directory", shard_dir, "--force", "cli-a")
        a_paths = [p for p in paths if "/ddict-cli-a-" in p]
        assert code == 0 and "removed 2 shard(s)" in out
        assert not any(map(os.path.exists, a_paths))

        kill(proc)
        b_paths = sorted(set(paths) - set(a_paths))
        code, out = run("parked", "--directory", shard_dir)
        rows = sorted(line.split() for line in out.strip().splitlines()[1:])
        assert [(r[0], r[4], r[-1]) for r in rows] == [("cli-b", "gone", p) for p in b_paths]
        code, out = run("parked", "--directory", shard_dir, "--remove")
        assert code == 0 and "removed 2 shard(s)" in out
        assert all(f"removed {p}" in out for p in b_paths)
    assert os.listdir(shard_dir) == []
    code, out = run("parked", "--directory", shard_dir)
    assert out.strip() == f"no parked or kept shards in {shard_dir}"


def test_a_live_scheduler_that_does_not_keep_a_shard_lets_it_go(client, tmp_path):
    """A scheduler that answers at the recorded address but does not keep the shard (a
    later one at that address, or one that destroyed the dictionary meanwhile): no
    registry will ever serve it again, so it goes; one it keeps stays."""
    from dask_ddict.layout import host_id

    address = client.scheduler.address
    d = DDict(total_mem="16 MiB", client=client, name="kept-by-session")
    try:
        base = str(tmp_path)
        paths = [os.path.join(base, f"ddict-{n}-0-0123456789abcdef") for n in ("a", "b")]
        for path, uid in zip(paths, ["f" * 32, d._core.layout.uid]):
            os.mkdir(path)
            hygiene.release(hygiene.claim(path))
            hygiene.mark_kept(
                path,
                record={
                    "why": "parked",
                    "uid": uid,
                    "manager": 0,
                    "scheduler": address,
                    "host_id": host_id(),
                },
            )
        assert hygiene.keeper_states(hygiene.kept_shards(base)) == {
            paths[0]: hygiene.GONE,
            paths[1]: hygiene.ALIVE,
        }
        assert [s.path for s in hygiene.sweep_kept(base)] == [paths[0]]
        assert os.path.isdir(paths[1])
    finally:
        d.destroy()


def test_an_in_process_keeper_is_its_process(tmp_path):
    """A shard kept by a scheduler inside a process (no address: an in-process cluster)
    lives as long as that very process (pid and start time: a reused pid is another)."""
    from dask_ddict.layout import host_id

    base = str(tmp_path)
    paths = []
    for i, pid in enumerate(
        [
            os.getpid(),
            subprocess.run(  # (a process that has ended)
                [sys.executable, "-c", "import os; print(os.getpid())"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip(),
        ]
    ):
        path = os.path.join(base, f"ddict-inproc-{i}-0123456789abcdef")
        os.mkdir(path)
        hygiene.release(hygiene.claim(path))
        hygiene.mark_kept(
            path,
            record={
                "why": "parked",
                "name": "inproc",
                "manager": i,
                "uid": "u",
                "scheduler": "",
                "pid": int(pid),
                "started": hygiene._started(os.getpid()),
                "host_id": host_id(),
            },
        )
        paths.append(path)
    states = hygiene.keeper_states(hygiene.kept_shards(base))
    assert states == {paths[0]: hygiene.ALIVE, paths[1]: hygiene.GONE}
    assert [s.path for s in hygiene.sweep_kept(base)] == [paths[1]]
    assert os.path.isdir(paths[0]) and not os.path.exists(paths[1])


def test_a_marker_that_names_no_keeper_is_never_swept(tmp_path):
    """A kept shard whose marker names nobody (written by an older version) stays: its
    keeper cannot be told, and a parked manager must not be lost while its cluster may
    live.  ``--force`` removes it."""
    base = str(tmp_path)
    path = os.path.join(base, "ddict-old-3-0123456789abcdef")
    os.mkdir(path)
    hygiene.release(hygiene.claim(path))
    hygiene.mark_kept(path)
    (shard,) = hygiene.kept_shards(base)
    assert (shard.name, shard.manager, shard.why, shard.keeper) == ("old", 3, "", "unknown")
    assert hygiene.keeper_states([shard]) == {path: hygiene.UNKNOWN}
    assert hygiene.sweep_kept(base) == [] and os.path.isdir(path)
    hygiene.mark_kept(path)  # (marking again keeps what a marker says)
    code, out = run("parked", "--directory", base, "--remove")
    assert code == 0 and "unknown" in out and os.path.isdir(path)
    code, out = run("parked", "--directory", base, "--force", "old")
    assert code == 0 and f"removed {path}" in out and not os.path.exists(path)
