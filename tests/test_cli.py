"""``dask ddict``: the command line, through click's runner, against the test cluster."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner

from dask_ddict import DDict, DDictError
from dask_ddict.cli import ddict as cli
from tests.support.cluster import local_cluster


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_list_stats_and_destroy(client):
    address = client.scheduler.address
    d = DDict(total_mem="16 MiB", client=client, name="cli-one")
    d["k"] = 1
    code, out = run("list", "--scheduler", address)
    assert code == 0 and "cli-one" in out.split()
    code, out = run("stats", "cli-one", "--scheduler", address)
    lines = out.strip().splitlines()
    assert code == 0 and lines[0].split()[:3] == ["manager", "host", "keys"]
    assert len(lines) == 1 + d.num_managers and sum(int(x.split()[2]) for x in lines[1:]) == 1
    code, out = run("destroy", "cli-one", "--scheduler", address)
    assert code == 0 and "destroyed cli-one" in out
    assert "cli-one" not in DDict.list(client)
    code, out = run("destroy", "cli-one", "--scheduler", address)
    assert code != 0 and "no DDict named 'cli-one'" in out


def _files(root) -> dict[str, tuple[int, int]]:  # noqa: ANN001
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize("kind", ["zarr", "directory"])
def test_inspect_then_restore_a_store(client, tmp_path, kind):
    """Of either persister's (the commands tell them apart)."""
    store = str(tmp_path / "store.zarr")
    with DDict(
        total_mem="16 MiB", client=client, name="cli-two", persist_path=store, persister_class=kind
    ) as d:
        d["a"] = np.arange(1000)
        d.persist()
        d.sync()
    before = _files(tmp_path)
    code, out = run("inspect", store)
    assert code == 0 and out.count("checksums ok") == 2 and "cli-two: 2 managers" in out
    assert _files(tmp_path) == before  # inspecting writes nothing
    code, out = run(
        "restore",
        store,
        "--name",
        "cli-two",
        "--total-mem",
        "16 MiB",
        "--scheduler",
        client.scheduler.address,
    )
    assert code == 0 and out.startswith("ddict3:")
    restored = DDict.from_name("cli-two", client)
    try:
        np.testing.assert_array_equal(restored["a"], np.arange(1000))
    finally:
        restored.detach()
        run("destroy", "cli-two", "--scheduler", client.scheduler.address)
    code, out = run(
        "restore",
        store,
        "--name",
        "cli-two",
        "--total-mem",
        "24 MiB",
        "--managers-per-worker",
        "3",
        "--scheduler",
        client.scheduler.address,
    )
    assert code == 0, out  # written by 2 managers, restored onto 6
    restored = DDict.from_name("cli-two", client)
    try:
        assert restored.num_managers == 6 and len(restored) == 1
        np.testing.assert_array_equal(restored["a"], np.arange(1000))
    finally:
        restored.detach()
        run("destroy", "cli-two", "--scheduler", client.scheduler.address)
    chunk = next(
        (tmp_path / "store.zarr" / "cli-two").glob(
            "manager_*/chkpt_0.g0/values" + ("/c/0" if kind == "zarr" else "")
        )
    )
    raw = bytearray(chunk.read_bytes())
    raw[0] ^= 1
    chunk.write_bytes(bytes(raw))
    code, out = run("inspect", store)
    assert code == 1 and "DAMAGED" in out and "1 damaged" in out


def test_no_scheduler_is_a_usage_error_and_python_m_runs_it(monkeypatch):
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS", raising=False)
    result = CliRunner().invoke(cli, ["list"])
    assert result.exit_code == 2 and "no scheduler" in result.output
    out = subprocess.run(
        [sys.executable, "-m", "dask_ddict", "--help"], capture_output=True, text=True, check=True
    )
    assert "inspect" in out.stdout and "restore" in out.stdout


def test_list_on_a_cluster_without_dictionaries_says_so():
    """A cluster that never had a dictionary (no scheduler plugin yet) answers, too."""
    from distributed import Client

    with local_cluster(0, processes=False) as cl:
        code, out = run("list", "--scheduler", cl.scheduler_address)
        assert code == 0 and out.strip() == f"no dictionaries on {cl.scheduler_address}"
        with Client(cl) as c:
            assert DDict.list(c) == []
            with pytest.raises(DDictError, match="no DDict named 'nope'"):
                DDict.from_name("nope", c)


@pytest.mark.parametrize("command", [["list"], ["stats", "x"], ["destroy", "x"]])
def test_an_unreachable_scheduler_is_one_line_and_quick(command):
    """Nothing listens at the address: one line that names it, a non-zero exit, within
    --timeout (not Dask's 60-line traceback after its connect timeout)."""
    address = "tcp://127.0.0.1:1"
    t0 = time.monotonic()
    result = CliRunner().invoke(cli, [*command, "--scheduler", address, "--timeout", "0.5 s"])
    assert time.monotonic() - t0 < 5
    assert result.exit_code == 1 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"Error: cannot reach the scheduler at {address}"
    )


def test_an_unreachable_scheduler_from_the_shell_is_one_line_on_stderr():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dask_ddict",
            "list",
            "--scheduler",
            "tcp://127.0.0.1:1",
            "--timeout",
            "1s",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.splitlines() == [
        "Error: cannot reach the scheduler at tcp://127.0.0.1:1: Timed out trying to connect "
        "to tcp://127.0.0.1:1 after 1 s"
    ]
    bad = CliRunner().invoke(cli, ["list", "--scheduler", "tcp://127.0.0.1:1", "--timeout", "x"])
    assert bad.exit_code == 2 and "timeout 'x' is not a duration" in bad.stderr


def test_create_with_replicas_then_stats_and_destroy(client):
    address = client.scheduler.address
    code, out = run(
        "create", "cli-rep", "--total-mem", "32 MiB", "--replicas", "1", "--scheduler", address
    )
    assert code == 0 and out.startswith("ddict3:"), out
    d = DDict.attach(out.strip())
    try:
        d["k"] = 1
        assert d.lifetime == "cluster" and [s.replicas for s in d.stats] == [1] * d.num_managers
        code, out = run("stats", "cli-rep", "--scheduler", address)
        assert code == 0 and "short of replicas" not in out
        code, out = run("create", "cli-bad", "--replicas", "-1", "--scheduler", address)
        assert code != 0 and "replicas" in out
    finally:
        d.destroy()
