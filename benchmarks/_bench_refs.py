"""Reference measurements for ``bench_ddict.py`` (not DDict): memcpy, loopback TCP, CPU times.

Each one is bounded in time and leaves nothing behind (the loopback child is
reaped, its socket closed, also on errors).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from common import best_of  # beside this script (sys.path[0])


def memcpy_seconds(nbytes: int, reps: int) -> float:
    """Best time of ``np.copyto`` of ``nbytes`` between two warm (already written) buffers."""
    src = np.ones(nbytes // 8, dtype="f8")
    dst = np.zeros_like(src)
    np.copyto(dst, src)  # fault every page of both buffers in before timing
    return best_of(lambda: np.copyto(dst, src), reps, budget=5.0)


#: The child of loopback (see its docstring).
_CHILD = Path(__file__).parent / "children" / "loopback_child.py"


@contextlib.contextmanager
def loopback(nbytes: int) -> Iterator[Callable[[], None]]:
    """``one()``: a 1-byte request to a child process over 127.0.0.1 TCP, and its
    ``nbytes`` answer received with ``recv_into`` into a preallocated, warm buffer."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    lsock.settimeout(30)
    child = subprocess.Popen(
        [sys.executable, str(_CHILD), str(lsock.getsockname()[1]), str(nbytes)]
    )
    conn = None
    try:
        conn, _ = lsock.accept()
        conn.settimeout(30)  # every recv is bounded: a stuck child raises, not hangs
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(nbytes)
        view = memoryview(buf)
        sock = conn

        def one() -> None:
            sock.sendall(b"g")
            got = 0
            while got < nbytes:
                k = sock.recv_into(view[got:])
                if not k:
                    raise ConnectionError("loopback child closed the socket")
                got += k

        one()  # warm: the child's message is built, socket buffers grown
        yield one
    finally:
        if conn is not None:
            conn.close()  # the child's recv sees EOF and it exits
        lsock.close()
        reap(child)


def loopback_seconds(nbytes: int, reps: int) -> float:
    """Best time to receive one ``nbytes`` message over 127.0.0.1 TCP from a child process."""
    with loopback(nbytes) as one:
        return best_of(one, reps, budget=10.0)


def loopback_rate(nbytes: int, seconds: float) -> float:
    """Round trips per second of a 1-byte request and an ``nbytes`` answer between two
    Python processes over 127.0.0.1 TCP, one after the other: what any Python client
    and server doing one ``recv`` and one ``send`` each per request can reach at most."""
    with loopback(nbytes) as one:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or n < 3:
            one()
            n += 1
        return n / (time.perf_counter() - t0)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def cpu_per_op(pid: int, op: Callable[[int], Any], n: int, cap: float) -> tuple[float, int, float]:
    """CPU seconds process ``pid`` spends per call of ``op(i)``, over ``n`` calls made from
    here (fewer if ``cap`` seconds passed first), the number of calls made, and the
    part of those seconds spent in user space (the rest is the kernel's: system calls,
    wake-ups)."""
    proc = psutil.Process(pid)
    before = proc.cpu_times()
    t_end = time.perf_counter() + cap
    i = 0
    while i < n:
        op(i)
        i += 1
        if not i % 1000 and time.perf_counter() > t_end:
            break
    after = proc.cpu_times()
    user, system = after.user - before.user, after.system - before.system
    return (user + system) / i, i, user / i


def cpu_ns(pid: int) -> int:
    """Nanoseconds process ``pid``'s live threads have run so far (user and system), from
    the scheduler's own count (``/proc/PID/task/*/schedstat``): exact, where
    :func:`cpu_per_op`'s psutil figures come in the kernel's 10 ms ticks."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # (a thread that ended meanwhile)
    return total


def cpu_per_op_exact(pid: int, op: Callable[[int], Any], n: int) -> float:
    """CPU seconds (user and system) process ``pid`` spends per call of ``op(i)`` over
    ``n`` calls made from here, by :func:`cpu_ns`: a short slice's figure, exact."""
    before = cpu_ns(pid)
    for i in range(n):
        op(i)
    return (cpu_ns(pid) - before) * 1e-9 / n


def start_redis(k: int, *args: str) -> list[tuple[Any, int, str]]:
    """``k`` redis-servers on loopback ports (``args``: more of their options), each in
    a temporary directory, answering: [(Popen, port, dir)]; [] when ``redis-server`` is
    not on the PATH."""
    exe = shutil.which("redis-server")
    if exe is None:
        return []
    import redis

    servers = []
    try:
        for _ in range(k):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            workdir = tempfile.mkdtemp(prefix="ddict-bench-redis-")
            proc = subprocess.Popen(
                [
                    exe,
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    workdir,
                    *args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            servers.append((proc, port, workdir))
            r = redis.Redis(host="127.0.0.1", port=port)
            for _ in range(200):
                try:
                    r.ping()
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    time.sleep(0.05)
            else:
                raise RuntimeError(f"redis-server on port {port} did not answer in 10 s")
            r.close()
    except BaseException:
        stop_redis(servers)
        raise
    return servers


def stop_redis(servers: list[tuple[Any, int, str]]) -> None:
    for proc, _, workdir in servers:
        proc.terminate()
        reap(proc)
        shutil.rmtree(workdir, ignore_errors=True)


def reap(proc: Any) -> None:
    """Wait for child ``proc`` to exit (10 s, then it is killed)."""
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
