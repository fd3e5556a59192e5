"""Dead workers, TLS clusters, the embedded cluster, and cleanup on shutdown."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import textwrap

import dask
import numpy as np
from distributed import Client, Security

from dask_ddict import AsyncDDict, DDict
from dask_ddict.transport.protocol import HELLO, HELLO_MAGIC
from tests.support.cluster import local_cluster
from tests.support.polling import poll_for
from tests.support.shards import shm_entries


def test_dead_worker_is_a_non_event():
    """SIGKILL of a hosting worker: its nanny restarts it, the host process serves on."""
    with (
        local_cluster(2) as cl,
        Client(cl) as c,
    ):
        d = DDict(total_mem="16 MiB", client=c)
        keys = {m: next(k for k in range(1000) if d.which_manager(k) == m) for m in (0, 1)}
        for k in keys.values():
            d[k] = k
        victim = d.manager_workers[1]
        c.run(os._exit, 1, workers=[victim], on_error="ignore")  # abrupt death
        assert d[keys[1]] == keys[1] and d[keys[0]] == keys[0]  # no exception, nothing lost
        d[keys[1]] = "after"
        assert d[keys[1]] == "after"
        mine = {m.store_path for m in d._core.layout.managers}
        d.destroy()
        assert not (mine & shm_entries())  # only this test's shards are inspected


def test_tls_cluster_uses_tls_tcp():
    sec = Security.temporary()
    with (
        local_cluster(1, security=sec) as cl,
        Client(cl, security=sec) as c,
    ):
        assert cl.scheduler_address.startswith("tls://")
        with dask.config.set({"ddict.local-transport": False}):
            d = DDict(total_mem="16 MiB", client=c)
            try:
                d["a"] = np.arange(100_000)
                assert (d["a"] == np.arange(100_000)).all()
                assert d._core.channel(0).kind == "tls"
                _refuses_peers_without_certificates(d._core.layout.managers[0])
                ad = AsyncDDict(d)  # (its batches go by the blocking TLS connections)

                async def main() -> None:
                    await asyncio.gather(*(ad.put(i, i) for i in range(50)))
                    assert await asyncio.gather(*(ad.get(i) for i in range(50))) == list(range(50))
                    assert not d._core.channel(0).link.pipes  # never a plain pipe

                asyncio.run(main())
            finally:
                d.destroy()


def _sorted_keys(dd, out) -> None:  # noqa: ANN001
    for k in sorted(dd.keys()):
        out.put(k)


def test_a_filter_on_a_tls_cluster_streams_over_tls():
    """Every stream of a filter is TLS with the cluster's certificates (leaf to merge task
    to caller); a plain TCP peer gets nothing from the caller's end."""
    sec = Security.temporary()
    with (
        local_cluster(2, security=sec) as cl,
        Client(cl, security=sec) as c,
    ):
        with dask.config.set({"ddict.local-transport": False}):
            d = DDict(total_mem="32 MiB", managers_per_worker=3, client=c)
            try:
                d.update({i: i for i in range(300)})
                f = d.filter(_sorted_keys, comparator=lambda x, y: x < y, branching_factor=2)
                with f as results:
                    root = f._receiver.address
                    with socket.create_connection(root, timeout=10) as plain:  # no TLS: refused
                        plain.sendall(b"\x01" + bytes(64))
                        plain.settimeout(10)
                        try:
                            got = plain.recv(1)
                        except (ConnectionError, TimeoutError):
                            got = b""
                        assert got == b""
                    assert list(results) == list(range(300))
                    children = list(f._receiver._socks.values())
                    assert children and all(isinstance(x, ssl.SSLSocket) for x in children)
            finally:
                d.destroy()


def _refuses_peers_without_certificates(info) -> None:  # noqa: ANN001
    """Plain TCP, and TLS without a client certificate: the host never answers the HELLO."""
    hello = HELLO.pack(HELLO_MAGIC, b"u" * 16) + bytes(32)
    no_cert = ssl.create_default_context()
    no_cert.check_hostname, no_cert.verify_mode = False, ssl.CERT_NONE
    for wrap in (lambda s: s, lambda s: no_cert.wrap_socket(s)):
        answer = b""
        try:
            with wrap(socket.create_connection((info.tcp_host, info.tcp_port), timeout=10)) as s:
                s.sendall(hello)
                answer = s.recv(1)
        except (ssl.SSLError, ConnectionError, TimeoutError):
            pass
        assert answer == b"", answer  # refused: no PROVE, no UNKNOWN, nothing


def test_plain_tcp_path():
    with (
        local_cluster(1) as cl,
        Client(cl) as c,
        dask.config.set({"ddict.local-transport": False}),
    ):
        with DDict(total_mem="16 MiB", client=c) as d:
            d["k"] = "v"
            assert d["k"] == "v" and d._core.channel(0).kind == "tcp"


def test_embedded_cluster_is_owned_and_closed():
    d = DDict(total_mem="16 MiB")
    cluster = d._core.cluster
    assert cluster is not None and d.num_managers >= 1
    d["x"] = [1, 2]
    assert d["x"] == [1, 2]
    mine = {m.store_path for m in d._core.layout.managers}
    assert mine <= shm_entries()
    d.destroy()
    assert cluster.status.name == "closed"
    assert not (mine & shm_entries())


def test_an_embedded_dict_left_undestroyed_ends_its_script_quietly(tmp_path):
    """A script that ends without ``destroy()``: one line says what happened to the keys
    (before: ~124 lines of tracebacks from nanny plugins that met the interpreter's
    thread pools shut down), exit code 0, and nothing left in shared memory or among the
    socket directories."""
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent("""
        from dask_ddict import DDict
        if __name__ == "__main__":
            d = DDict(total_mem="32 MiB", name="forgotten")
            d["a"] = 1
            print(d["a"], flush=True)
    """)
    )
    shards = tempfile.mkdtemp(prefix="test-embedded-", dir="/dev/shm")
    sockets = tempfile.mkdtemp(prefix="ddsock-")  # (short: Unix socket paths are)
    env = {
        **os.environ,
        "DASK_DDICT__STORE__DIRECTORY": shards,
        "DASK_DDICT__TRANSPORT__SOCKET_DIR": sockets,
    }
    try:
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["1"]
        # (a loaded machine may add Dask's own "event loop was unresponsive" warnings)
        assert "Traceback" not in done.stderr and " - ERROR - " not in done.stderr, done.stderr
        said = [line for line in done.stderr.splitlines() if "ddict" in line.lower()]
        assert len(said) == 1, done.stderr
        assert "'forgotten' was not destroyed; its keys are dropped" in said[0]
        poll_for(  # (a host process that outlived a slow close removes its own)
            lambda: not os.listdir(shards) and not os.listdir(sockets),
            30,
            lambda: (os.listdir(shards), os.listdir(sockets), done.stderr),
            0.2,
        )
    finally:
        shutil.rmtree(shards, ignore_errors=True)
        shutil.rmtree(sockets, ignore_errors=True)


def test_cluster_shutdown_removes_shards():
    cl = local_cluster(2)
    c = Client(cl)
    d = DDict(total_mem="16 MiB", client=c)
    d["a"] = 1
    lay = d._core.layout
    mine = {m.store_path for m in lay.managers}
    sockets = {os.path.dirname(m.uds_path) for m in lay.managers}
    assert len(mine & shm_entries()) == 2 and all(os.path.isdir(p) for p in sockets)
    c.close()
    cl.close()  # no destroy(): the nannies' plugins stop the host processes
    assert not (mine & shm_entries())
    assert not any(os.path.exists(p) for p in sockets)


def test_preload_installs_orchestrator():
    from distributed import Scheduler

    import dask_ddict

    async def main():
        async with Scheduler(dashboard_address=":0", preload=["dask_ddict"]) as s:
            assert "ddict" in s.plugins
            assert "ddict_create" in s.handlers

    import asyncio

    asyncio.run(main())
    assert callable(dask_ddict.dask_setup)
