"""Managers outlive their Dask worker: host processes, supervision, faults (issue 10).

Every test here kills, stops or starves real processes and then checks that
no acknowledged write was lost and that errors name what happened.  Each test
looks only at the files it created.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import dask
import numpy as np
import psutil
import pytest
from distributed import Client, LocalCluster

from dask_ddict import (
    DDict,
    DDictClosedError,
    DDictError,
    DDictFullError,
    DDictManagerUnavailableError,
    DDictTimeoutError,
)
from dask_ddict.client.core import ASK_EVERY
from dask_ddict.client.workers import scheduler_workers
from dask_ddict.transport.shared import ALIVE_CHECK
from tests.support.cluster import local_cluster
from tests.support.handles import over_tcp
from tests.support.polling import poll_for
from tests.support.processes import stop_process
from tests.support.shards import shards, shm_entries


def _supervisor(cluster: LocalCluster, d: DDict, mid: int):  # noqa: ANN202
    """The HostSupervisor (in a nanny of ``cluster``) that serves manager ``mid``."""
    sup = d._core.layout.managers[mid].supervisor
    for nanny in cluster.workers.values():
        if nanny.address == sup:
            return nanny.plugins["ddict"].supervisor
    raise LookupError(sup)


def _keys_on(d: DDict, mid: int, n: int, tag: str = "") -> list[tuple[str, int]]:
    out, i = [], 0
    while len(out) < n:
        if d.which_manager((tag, i)) == mid:
            out.append((tag, i))
        i += 1
    return out


@contextlib.contextmanager
def _external_worker(
    cl: LocalCluster, c: Client, tmp_path: Any
) -> Iterator[tuple[subprocess.Popen[bytes], set[str]]]:
    """A nanny and worker of ``cl``'s scheduler in a process (and session) of their own:
    killing that process kills the supervisor of its host.  Yields the process and its
    worker's address (in a set); whatever is left of it is ended after."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distributed.cli.dask_worker",
            cl.scheduler_address,
            "--nthreads",
            "1",
            "--no-dashboard",
            "--local-directory",
            str(tmp_path),
        ],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        c.wait_for_workers(len(cl.workers) + 1, timeout=60)
        yield (
            proc,
            {
                w
                for w, info in scheduler_workers(c).items()
                if info["nanny"] not in {n.address for n in cl.workers.values()}
            },
        )
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # whatever is left of that host
        except ProcessLookupError:
            pass


def _writers(
    d: DDict, n: int, stop: threading.Event
) -> tuple[list[list[int]], list[BaseException], list[threading.Thread]]:
    """``n`` threads putting ``(i, k) -> k`` until ``stop``; what each had acknowledged.

    Odd-numbered threads write over TCP (through the host process), even ones
    through the same-host path (small puts committed in the shard directly).
    """
    acked: list[list[int]] = [[] for _ in range(n)]
    errors: list[BaseException] = []
    tcp = over_tcp(d)

    def run(i: int) -> None:
        h = tcp if i % 2 else d
        k = 0
        while not stop.is_set() and k < 200_000:
            try:
                h[(i, k)] = k
            except BaseException as e:  # noqa: BLE001 - the test reports every failure
                errors.append(e)
                return
            acked[i].append(k)
            k += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return acked, errors, threads


def _check_acked(d: DDict, acked: list[list[int]]) -> int:
    held = dict(d.items())
    n = 0
    for i, ks in enumerate(acked):
        for k in ks:
            assert held.get((i, k)) == k, f"acknowledged write ({i}, {k}) lost"
            n += 1
    return n


def test_worker_sigkill_during_writes_loses_no_acknowledged_write():
    with (
        local_cluster(2) as cl,
        Client(cl) as c,
    ):
        d = DDict(managers_per_worker=2, total_mem="128 MiB", client=c)
        stop = threading.Event()
        acked, errors, threads = _writers(d, 4, stop)
        time.sleep(0.8)
        victim = d.manager_workers[0]
        pid = c.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)
        time.sleep(1.5)
        stop.set()
        for t in threads:
            t.join(60)
        assert errors == []  # no writer saw an exception
        assert _check_acked(d, acked) > 100
        c.wait_for_workers(2, timeout=60)
        assert victim not in scheduler_workers(c)  # the worker really restarted

        def read_back(h: DDict, acked: list[list[int]]) -> bool:
            return all(h[(i, ks[-1])] == ks[-1] for i, ks in enumerate(acked) if ks)

        assert c.submit(read_back, d, acked, pure=False).result()
        mine = shards(d)
        d.destroy()
        assert not (mine & shm_entries())


def test_host_process_sigkill_is_restarted_and_counts_stay_exact():
    with (
        local_cluster(2) as cl,
        Client(cl) as c,
    ):
        d = DDict(total_mem="64 MiB", client=c)
        m = d.which_manager("n")
        host_pid = d.stats[m].pid
        stop = threading.Event()
        adds = [0, 0]
        errors: list[BaseException] = []

        def adder(i: int) -> None:
            while not stop.is_set():
                try:
                    d.fetch_add("n", 1)
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)
                    return
                adds[i] += 1

        adders = [threading.Thread(target=adder, args=(i,)) for i in range(2)]
        for t in adders:
            t.start()
        acked, werrors, writers = _writers(d, 2, stop)
        time.sleep(0.8)
        os.kill(host_pid, signal.SIGKILL)
        time.sleep(2.5)
        stop.set()
        for t in adders + writers:
            t.join(60)
        assert errors == [] and werrors == []
        assert d["n"] == sum(adds) > 0  # every acknowledged add counted exactly once
        assert _check_acked(d, acked) > 100
        assert d.stats[m].pid != host_pid  # a new host process serves the same shard
        assert _supervisor(cl, d, m).restart_count == 1
        d.destroy()


def test_client_restart_with_a_live_dict():
    with (
        local_cluster(2) as cl,
        Client(cl) as c,
    ):
        d = DDict(total_mem="32 MiB", client=c, working_set_size=2)
        d.update({i: np.full(10, i) for i in range(50)})
        d.checkpoint()
        d["at1"] = "one"
        pids = {s.pid for s in d.stats}
        c.restart()
        assert {s.pid for s in d.stats} == pids  # the host processes never noticed
        assert all((d[i] == i).all() for i in range(50)) and d["at1"] == "one"

        def task(h: DDict) -> int:
            h["from_task"] = h.local_manager
            return len(h)

        assert c.submit(task, d, pure=False).result() == 52
        # the orchestrator follows the restarted workers (locality), losing nothing
        layout = c.sync(c.scheduler.ddict_attach, name=d.get_name())
        assert {m["worker"] for m in layout["managers"]} <= set(scheduler_workers(c))
        assert not any(m["lost"] for m in layout["managers"])
        d.destroy()


def test_a_destroyed_dict_is_closed_in_every_process(client):
    d = DDict(total_mem="32 MiB", client=client)
    d["k"] = 1
    s = d.serialize()
    same_host = DDict.attach(s)
    assert same_host["k"] == 1
    import dask

    with dask.config.set({"ddict.local-transport": False}):
        over_tcp = DDict.attach(s)
        assert over_tcp["k"] == 1
    d.destroy()
    for h in (same_host, over_tcp):
        with pytest.raises(DDictClosedError):
            h["k"]
        with pytest.raises(DDictClosedError):
            h["k"] = 2
    code = textwrap.dedent(f"""
        from dask_ddict import DDict, DDictClosedError
        h = DDict.attach({s!r})
        try:
            h["k"] = 3
        except DDictClosedError as e:
            print("closed:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "closed:" in out.stdout, out.stderr

    def in_task(h: DDict) -> str:
        try:
            h["k"]
        except DDictClosedError:
            return "closed"
        return "open"

    assert client.submit(in_task, same_host, pure=False).result() == "closed"


def test_timeouts_hold_against_a_frozen_host(client):
    from dask_ddict import config

    slack = config.get_seconds("transport.timeout-slack")
    d = DDict(total_mem="32 MiB", client=client, timeout=1)
    tcp = over_tcp(d)
    big = np.ones(20_000)  # too big to be committed by the client: goes to the host
    try:
        d["k"] = 0
        m = d.which_manager("k")
        for h in (d, tcp):
            h["k"] = big  # connected before the host stops (a handshake would time out too)
        host = psutil.Process(d.stats[m].pid)
        stop_process(host)
        try:
            for h, value in ((d, big), (tcp, 1)):
                t0 = time.monotonic()
                with pytest.raises(DDictTimeoutError, match="may or may not have been applied"):
                    h["k"] = value
                assert time.monotonic() - t0 < 1 + slack + 0.5
            got = d["k"]  # reads need no host; the timed-out writes may or may not be in
            assert got == 1 if isinstance(got, int) else (got == big).all()
            d["k"] = 5  # nor do small puts in the window: the client commits them itself
        finally:
            host.resume()
        # the resumed host may still apply the writes that timed out ("may or may not")
        got = tcp["k"]
        assert got in (1, 5) if isinstance(got, int) else (got == big).all()
        d["k"] = big
        assert (tcp["k"] == big).all()
    finally:
        tcp.detach()
        d.destroy()


def test_a_handles_timeout_bounds_its_broadcasts_to_frozen_hosts(client):
    """len, stats, iteration and sync_to_newest_checkpoint wait for the hosts' answers
    at most the handle's timeout (plus its slack), whatever the number of hosts."""
    from dask_ddict import config

    slack = config.get_seconds("transport.timeout-slack")
    d = DDict(total_mem="32 MiB", client=client, timeout=1)
    tcp = over_tcp(d)
    try:
        d.update({i: i for i in range(20)})
        assert len(tcp) == 20 and len(tcp.stats) == 2 and len(list(tcp.keys())) == 20
        hosts = [psutil.Process(pid) for pid in {s.pid for s in d.stats}]
        for host in hosts:
            stop_process(host)
        try:
            for what in (
                len,
                lambda h: h.stats,
                lambda h: list(h.keys()),
                lambda h: h.sync_to_newest_checkpoint(),
            ):
                t0 = time.monotonic()
                with pytest.raises(DDictTimeoutError):
                    what(tcp)
                assert time.monotonic() - t0 < 1 + slack + 0.5, what
        finally:
            for host in hosts:
                host.resume()
        assert len(tcp) == 20
    finally:
        tcp.detach()
        d.destroy()


def test_a_finite_timeout_bounds_connecting_to_a_frozen_host(client):
    """A handle that never reached the host yet: its timeout bounds the connection and
    the handshake too (the kernel queues the connection; the stopped host never answers)."""
    from dask_ddict import config

    slack = config.get_seconds("transport.timeout-slack")
    d = DDict(total_mem="32 MiB", client=client, timeout=1)
    big = np.ones(32_768)  # 256 KiB: through the host, whatever the path
    try:
        d["k"] = 0
        fresh = [DDict.attach(d.serialize(), timeout=1), over_tcp(d)]  # nothing connected
        host = psutil.Process(d.stats[d.which_manager("k")].pid)
        stop_process(host)
        try:
            for h in fresh:
                t0 = time.monotonic()
                with pytest.raises(DDictTimeoutError, match="nothing was sent"):
                    h["k"] = big
                assert time.monotonic() - t0 < 1 + slack + 0.5
        finally:
            host.resume()
        for h in fresh:
            h["k"] = big
            assert (h["k"] == big).all()
            h.detach()
    finally:
        d.destroy()


def test_without_a_timeout_a_stopped_host_is_waited_for_in_every_phase():
    """``timeout=None`` never raises a timeout: puts of 256 KiB to a stopped host process,
    from handles that must still connect (connect and handshake) and from connected ones
    (request and answer), over its Unix socket and over TCP, wait for longer than every
    internal timeout (set low here, the host's handshake timeout included), then
    complete when it resumes."""
    import dask

    low = {
        "ddict.transport.alive-check": "50 ms",
        "ddict.transport.handshake-timeout": "200 ms",  # (read by the host process)
        "ddict.transport.timeout-slack": "50 ms",
    }
    with (
        dask.config.set(low),
        local_cluster(1) as cl,
        Client(cl) as c,
    ):
        d = DDict(total_mem="16 MiB", client=c, timeout=None)
        connected = [DDict.attach(d.serialize(), timeout=None), over_tcp(d)]
        for h in connected:
            h["warm"] = np.zeros(32_768)  # a connection to the host, kept for the next put
        fresh = [DDict.attach(d.serialize(), timeout=None), over_tcp(d)]  # none yet
        handles = connected + fresh
        errors: list[BaseException] = []

        def put(h: DDict, i: int) -> None:
            try:
                h[("stopped", i)] = np.full(32_768, float(i))  # 256 KiB
            except BaseException as e:  # noqa: BLE001 - the test reports it
                errors.append(e)

        host = psutil.Process(d.stats[0].pid)
        stop_process(host)
        try:
            threads = [threading.Thread(target=put, args=(h, i)) for i, h in enumerate(handles)]
            for t in threads:
                t.start()
            time.sleep(1.0)  # longer than every internal timeout above, 5x the longest
            assert not errors, errors
            assert all(t.is_alive() for t in threads)  # still waiting
        finally:
            host.resume()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        for i in range(len(handles)):
            assert (d[("stopped", i)] == float(i)).all()
        for h in handles:
            h.detach()
        d.destroy()


def test_a_shard_directory_too_small_is_an_error_at_creation(client):
    import glob
    import uuid

    name = f"toobig{uuid.uuid4().hex[:8]}"
    with pytest.raises(DDictFullError, match=r"cannot hold a \d+-byte shard"):
        DDict(total_mem="4000 GiB", client=client, name=name)
    assert not glob.glob(f"/dev/shm/ddict-{name}-*")  # nothing left behind
    with DDict(total_mem="16 MiB", client=client) as d:  # and the cluster is fine
        d["k"] = 1
        assert d["k"] == 1


def test_small_worker_memory_limits_do_not_count_shard_pages():
    """1.2 GiB of dict on workers limited to 600 MiB: no pause, no restart, nothing lost."""
    with (
        local_cluster(2, memory_limit="600MiB") as cl,
        Client(cl) as c,
    ):
        d = DDict(total_mem="3 GiB", client=c)
        workers = set(scheduler_workers(c))
        block = np.ones(1 << 17)  # 1 MiB
        for i in range(1200):
            d[i] = block
        time.sleep(1)
        assert set(scheduler_workers(c)) == workers  # nobody was restarted
        statuses = c.run(lambda dask_worker: dask_worker.status.name)
        assert set(statuses.values()) == {"running"}  # nobody paused
        assert sum(s.num_keys for s in d.stats) == 1200
        assert all(d[i][0] == 1.0 for i in range(0, 1200, 97))
        d.destroy()


def test_host_processes_start_without_the_nannys_malloc_trim_threshold(client):
    """The nanny sets MALLOC_TRIM_THRESHOLD_ for its worker, which fixes glibc's mmap
    threshold: the host process (its sibling, started from it) runs without it, so a
    large reply's buffer is reused rather than mapped and faulted in each time."""
    d = DDict(total_mem="32 MiB", client=client)
    try:
        workers = client.run(
            lambda: (os.environ.get("MALLOC_TRIM_THRESHOLD_"), os.environ.get("PATH"))
        )
        assert {trim for trim, _ in workers.values()} == {"65536"}  # (the nanny's setting)
        for pid in {s.pid for s in d.stats}:
            env = psutil.Process(pid).environ()
            assert "MALLOC_TRIM_THRESHOLD_" not in env
            assert env.get("PATH") in {path for _, path in workers.values()}  # (kept)
    finally:
        d.destroy()


def test_host_environ_sets_and_removes_variables():
    from dask_ddict.host.environ import PACKAGE_ROOT, host_environ

    base = {"MALLOC_TRIM_THRESHOLD_": "65536", "KEEP": "1", "PYTHONPATH": "/elsewhere"}
    env = host_environ(base, {"MALLOC_TRIM_THRESHOLD_": None, "ABSENT": None, "ADDED": 2})
    assert env == {
        "KEEP": "1",
        "ADDED": "2",
        "PYTHONPATH": PACKAGE_ROOT + os.pathsep + "/elsewhere",
    }
    assert base["MALLOC_TRIM_THRESHOLD_"] == "65536"  # (the supervisor's own is untouched)
    assert host_environ({}, {})["PYTHONPATH"] == PACKAGE_ROOT
    with pytest.raises(TypeError, match="ddict.host.environ"):
        host_environ(base, ["MALLOC_TRIM_THRESHOLD_"])  # type: ignore[arg-type]


def test_host_loss_gives_clear_errors_and_the_rest_works(tmp_path):
    with (
        local_cluster(1) as cl,
        Client(cl) as c,
    ):
        with _external_worker(cl, c, tmp_path) as (proc, external):
            d = DDict(total_mem="32 MiB", client=c)
            lost = next(m.manager_id for m in d._core.layout.managers if m.worker in external)
            kept = 1 - lost
            k_lost, k_kept = _keys_on(d, lost, 1)[0], _keys_on(d, kept, 1)[0]
            d[k_lost], d[k_kept] = "lost", "kept"
            host_pid = d.stats[lost].pid
            lost_shard = d._core.layout.managers[lost].store_path
            os.kill(proc.pid, signal.SIGKILL)  # the nanny: its worker and host follow it
            proc.wait(30)
            t0 = time.monotonic()
            # A same-host client checks that a shard's supervisor lives at most every
            # ALIVE_CHECK seconds: the loss is known to it after that.
            time.sleep(2 * ALIVE_CHECK)
            with pytest.raises(DDictManagerUnavailableError, match=f"manager {lost}"):
                d[k_lost] = "again"  # the listener is gone with its supervisor: refused
            with pytest.raises(DDictManagerUnavailableError, match=f"manager {lost}"):
                d[k_lost]
            assert time.monotonic() - t0 < 5  # as soon as the loss is known
            assert d[k_kept] == "kept"  # the rest of the dict works
            d[k_kept] = "still"
            deadline = time.monotonic() + 30
            poll_for(lambda: not psutil.pid_exists(host_pid), 30, "the host process to end", 0.1)
            assert not psutil.pid_exists(host_pid)  # no orphan: it saw its supervisor go
            assert not os.path.exists(lost_shard)  # and removed its shard
            # repair: restart on the hosts that are left, then fill the lost manager
            while external & set(scheduler_workers(c)) and time.monotonic() < deadline:
                time.sleep(0.1)  # the scheduler notices the worker's end too
            twin = DDict(managers_per_worker=2, total_mem="32 MiB", client=c)
            twin[k_lost], twin[k_kept] = "lost", "kept"
            name = d.get_name()
            d.destroy(allow_restart=True)
            r = DDict(managers_per_worker=2, total_mem="32 MiB", client=c, name=name, restart=True)
            assert r.empty_managers == [lost] and r[k_kept] == "still"
            DDict.synchronize_ddicts([r.serialize(), twin.serialize()])
            assert r[k_lost] == "lost"
            r.destroy()
            twin.destroy()


def test_a_stopped_host_whose_supervisor_ended_is_gone_not_waited_for(tmp_path):
    """A stopped host process and a dead one look alike from a socket (the stopped one
    still holds the listener: connections queue).  A same-host client without a
    timeout tells them apart by the host's supervisor: gone, it raises
    ``DDictManagerUnavailableError`` within ``alive-check``, instead of waiting forever."""
    import dask

    with (
        dask.config.set({"ddict.transport.alive-check": "100 ms"}),
        local_cluster(1) as cl,
        Client(cl) as c,
    ):
        with _external_worker(cl, c, tmp_path) as (proc, external):
            d = DDict(total_mem="32 MiB", client=c, timeout=None)
            lost = next(m.manager_id for m in d._core.layout.managers if m.worker in external)
            key = _keys_on(d, lost, 1)[0]
            host = psutil.Process(d.stats[lost].pid)
            stop_process(host)
            try:
                os.kill(proc.pid, signal.SIGKILL)  # its supervisor (in the nanny)
                proc.wait(30)
                t0 = time.monotonic()
                # (its supervisor's end, seen here, or the orchestrator's word that its
                # host is gone, when that came first)
                with pytest.raises(DDictManagerUnavailableError, match="supervisor|is gone"):
                    d[key] = np.ones(32_768)  # connects into the stopped host's backlog
                assert time.monotonic() - t0 < 3
            finally:
                host.resume()  # it sees its supervisor gone and ends
            d.destroy()


def test_killing_a_script_with_an_embedded_cluster_leaves_nothing(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys, time
        from dask_ddict import DDict
        if __name__ == "__main__":
            d = DDict(total_mem="16 MiB")
            d["x"] = 1
            lay = d._core.layout
            print(" ".join(m.store_path for m in lay.managers), flush=True)
            print(" ".join(os.path.dirname(m.uds_path) for m in lay.managers), flush=True)
            print(" ".join(str(s.pid) for s in d.stats), flush=True)
            time.sleep(600)
    """)
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        stores = proc.stdout.readline().split()
        sockets = proc.stdout.readline().split()
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert stores and all(os.path.isdir(p) for p in stores + sockets)
        os.kill(proc.pid, signal.SIGKILL)  # the script, with the nannies in it
        proc.wait(30)
        poll_for(
            lambda: (
                not any(os.path.exists(p) for p in stores + sockets)
                and not any(map(psutil.pid_exists, pids))
            ),
            30,
            "the shards and sockets removed, the processes ended",
            0.2,
        )
        assert not any(os.path.exists(p) for p in stores + sockets)
        assert not any(map(psutil.pid_exists, pids))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # whatever of the cluster is left
        except ProcessLookupError:
            pass


def _resources(pid: int) -> tuple[int, int, int]:
    p = psutil.Process(pid)
    maps = sum(1 for _ in open(f"/proc/{pid}/maps"))
    return p.num_fds(), p.num_threads(), maps


@pytest.mark.parametrize("cycles", [100])  # (a leak of one fd or map a cycle shows)
def test_create_destroy_cycles_keep_resources_flat(client, cycles):
    def read(h: DDict) -> int:
        return int(h["k"].sum())

    def cycle() -> list[int]:
        with DDict(total_mem="4 MiB", client=client) as d:
            d["k"] = np.arange(1000)
            assert d["k"].sum() == 499500
            assert client.submit(read, d, pure=False).result() == 499500  # a task's handle
            return sorted({s.pid for s in d.stats})

    hosts = cycle()
    for _ in range(3):
        cycle()  # warm up (thread pools, buffers)
    workers = list(client.run(os.getpid).values())
    before = {p: _resources(p) for p in [os.getpid(), *hosts, *workers]}
    for _ in range(cycles):
        assert cycle() == hosts
    after = {p: _resources(p) for p in before}
    for p in before:
        fds, threads, maps = (a - b for a, b in zip(after[p], before[p]))
        assert fds <= 4 and threads <= 2 and maps <= 16, (p, before[p], after[p])


def test_batches_across_a_host_restart():
    """An open batch's state lives in the shard: what the host stored before it died
    counts; what it never got makes end_batch_put say so.  (Batches the manager
    applies: this client commits none itself.)"""
    with (
        local_cluster(1) as cl,
        Client(cl) as c,
        dask.config.set({"ddict.local-write": False}),
    ):
        d = DDict(total_mem="32 MiB", client=c)
        sup = _supervisor(cl, d, 0)
        d.start_batch_put()
        for i in range(100):
            d[i] = i
        d._batch.flush_all()
        assert len(d.manager(0)) == 100  # same connection: the batch message was applied
        os.kill(d.stats[0].pid, signal.SIGKILL)
        d.end_batch_put()  # retried at the new host process, which finds the batch's state
        assert sup.restart_count == 1 and len(d) == 100

        d.start_batch_put()
        for i in range(100, 200):
            d[i] = i
        old = d.stats[0].pid
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while sup.restart_count < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        d._batch.flush_all()  # into the dead process's connection
        with pytest.raises(DDictError, match="may or may not have been applied"):
            d.end_batch_put()
        d.update({i: i for i in range(200)})  # the dict works; the batch can be re-run
        assert len(d) == 200
        d.destroy()


def test_frozen_state_survives_a_host_restart():
    with (
        local_cluster(1) as cl,
        Client(cl) as c,
    ):
        d = DDict(total_mem="32 MiB", client=c)
        d["k"] = 1
        d.freeze()
        os.kill(d.stats[0].pid, signal.SIGKILL)
        with pytest.raises(DDictError, match="frozen"):
            d["k"] = 2
        assert d.is_frozen and d["k"] == 1
        d.unfreeze()
        d["k"] = 2
        assert d["k"] == 2
        d.destroy()


def _rss() -> int:
    return psutil.Process().memory_info().rss


def test_readers_do_not_keep_shard_pages(client):
    """A process that reads 1 GiB through the shards and drops it stays small."""
    with DDict(total_mem="1400 MiB", client=client) as d:
        block = np.ones((4 << 20) // 8)  # 4 MiB
        for i in range(256):  # 1 GiB
            d[i] = block
        assert d._core.channel(d.which_manager(0)).kind == "shm"
        rss0 = _rss()
        for i in range(256):
            x = d[i]
            assert x[-1] == 1.0
            del x
        assert _rss() - rss0 < 128 << 20

        def read_all(h: DDict) -> int:
            rss0 = _rss()
            for i in range(256):
                h[i]
            return _rss() - rss0

        assert client.submit(read_all, d, pure=False).result() < 128 << 20
        d.clear()
        d.update({i: bytes(2000) for i in range(60_000)})  # small values: 120 MB
        rss0 = _rss()
        for i in range(60_000):
            d[i]
        assert _rss() - rss0 < 96 << 20


def test_an_idle_dict_uses_no_cpu(client):
    with DDict(total_mem="16 MiB", client=client) as d:
        d["k"] = 1
        hosts = [psutil.Process(s.pid) for s in d.stats]
        time.sleep(0.5)
        before = sum(sum(p.cpu_times()[:2]) for p in hosts)
        time.sleep(2)
        after = sum(sum(p.cpu_times()[:2]) for p in hosts)
        assert after - before < 0.05


def test_workers_without_a_nanny_supervise_their_own_host():
    with (
        local_cluster(1, processes=False) as cl,
        Client(cl) as c,
    ):
        d = DDict(total_mem="16 MiB", client=c)
        lay = d._core.layout.managers[0]
        assert lay.supervisor == lay.worker  # the worker itself supervises
        d["k"] = np.arange(10)
        assert (d["k"] == np.arange(10)).all()
        host = psutil.Process(d.stats[0].pid)
        assert host.pid != os.getpid()  # a process of its own, even for an in-process worker
        mine = shards(d)
        d.destroy()
        assert not (mine & shm_entries())
    assert not host.is_running() or host.status() == psutil.STATUS_ZOMBIE


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_small_tmpfs_shard_directory_is_refused_at_creation(tmp_path):
    """A shard directory smaller than total_mem: a clear error when the dict is created,
    never a bus error on a later write, and nothing left behind."""
    import dask

    mnt = tmp_path / "small-shm"
    mnt.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m,mode=1777", "tmpfs", str(mnt)], check=True
    )
    try:
        with (
            dask.config.set({"ddict.store.directory": str(mnt)}),
            local_cluster(1) as cl,
            Client(cl) as c,
        ):
            with pytest.raises(
                DDictFullError,
                match=rf"cannot hold a \d+-byte shard: \d+ bytes of free space in {mnt}",
            ):  # noqa: E501
                DDict(total_mem="64 MiB", client=c)
            assert os.listdir(mnt) == []
            d = DDict(total_mem="16 MiB", client=c)  # what fits is reserved whole
            assert len(os.listdir(mnt)) == 1
            with pytest.raises(DDictFullError):
                for i in range(100):
                    d[i] = np.ones(1 << 15)  # 256 KiB values until the shard is full
            assert d[0][0] == 1.0  # full is an error, the dict stays usable
            d.destroy()
            assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_host_that_keeps_dying_is_given_up_and_reported_at_once():
    import dask

    with (
        local_cluster(1) as cl,
        Client(cl) as c,
    ):
        d = DDict(total_mem="16 MiB", client=c)
        d["k"] = np.ones(20_000)  # a value that goes through the host
        mine = shards(d)
        with dask.config.set({"ddict.host.max-restarts": 0}):  # read by the nanny's supervisor
            os.kill(d.stats[0].pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            sup = _supervisor(cl, d, 0)
            while sup._uds is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            t0 = time.monotonic()
            with pytest.raises(DDictManagerUnavailableError, match="manager 0"):
                d["k"] = np.zeros(20_000)  # refused: not left waiting in a backlog
            assert time.monotonic() - t0 < 5
            # The supervisor tells the orchestrator it gave up; from then on the error says so.
            name = d.get_name()
            while (
                time.monotonic() < deadline
                and not c.sync(c.scheduler.ddict_attach, name=name)["managers"][0]["lost"]
            ):
                time.sleep(0.05)
            time.sleep(ASK_EVERY)  # (the handle asked the orchestrator at the put above)
            said = (
                f"manager 0 of DDict '{name}' is unavailable: .* is gone: its host process "
                r"died too often \(1 time within .* supervisor gave up"
            )
            with pytest.raises(DDictManagerUnavailableError, match=said):
                d["k"] = np.zeros(20_000)
        d.destroy()
        assert not (mine & shm_entries())
