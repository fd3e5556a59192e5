"""DDict benchmark: one command, one table, ratios to redis-py in the same run.

    python benchmarks/bench_ddict.py [--quick]

Measures, on a 2-worker LocalCluster (worker processes), sequential single-key
put/get of 100 B values (ops/s) and of 1 MiB / 64 MiB numpy arrays (MB/s):

* from the client process (same host: reads straight from the shard, writes
  over the Unix socket of the manager's host process),
* from a task on the manager's worker and from a task on the other worker
  (both same host: managers run in host processes beside the workers),
* over TCP (same-host paths disabled: what another host would see),

plus batch put of 100 B values, and the p99 latency of 100 B puts from the
client while the manager's worker runs a CPU-bound pure-Python task on its
thread (target: at most 2 ms; the manager's host process is not the worker).  When ``redis-server`` is on the PATH it is
started on a loopback port and redis-py (hiredis) does the same operations
(and a pipeline of 1000 SETs for the batch row); the last column is the ratio.
When a ``dragon`` launcher is found (``DDICT_BENCH_DRAGON``, else the PATH),
``bench_dragon.py`` runs Dragon's DDict on the 100 B rows in the same run.
Absolute numbers on 2-core VMs are noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import dask
import numpy as np
from distributed import Client, LocalCluster

from dask_ddict import DDict

SIZES = {"100 B": 100, "1 MiB": 1 << 20, "64 MiB": 64 << 20}


def _value(nbytes: int) -> Any:
    return b"x" * nbytes if nbytes < 1024 else np.ones(nbytes // 8, dtype="f8")


def run_ddict(d: DDict, nbytes: int, seconds: float) -> dict[str, float]:
    """put and get rates for one value size through handle ``d``."""
    v = _value(nbytes)
    n = 0
    keys = max(1, min(1000, (d.stats[0].total_bytes // 4) // max(nbytes, 1)))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 3:
        d[n % keys] = v
        n += 1
    put = n / (time.perf_counter() - t0)
    m = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or m < 3:
        d[m % min(n, keys)]
        m += 1
    get = m / (time.perf_counter() - t0)
    d.clear()
    return {"put": put, "get": get}


def run_batch(d: DDict, seconds: float) -> float:
    v = _value(100)
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        d.start_batch_put()
        for i in range(1000):
            d[i] = v
        d.end_batch_put()
        n += 1000
    rate = n / (time.perf_counter() - t0)
    d.clear()
    return rate


def task_bench(d: DDict, nbytes: int, seconds: float) -> dict[str, float]:
    return run_ddict(d, nbytes, seconds)


def spin(seconds: float) -> int:
    """A CPU-bound pure-Python task that holds its worker's GIL."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n += sum(i * i for i in range(1000))
    return n


def put_latencies(d: DDict, seconds: float) -> list[float]:
    v = _value(100)
    out = []
    t_end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        d[i % 1000] = v
        out.append(time.perf_counter() - t0)
        i += 1
    d.clear()
    return out


def p99(samples: list[float]) -> float:
    return float(np.percentile(np.asarray(samples), 99))


def start_redis() -> tuple[Any, Any] | None:
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    import redis

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    workdir = tempfile.mkdtemp(prefix="ddict-bench-redis-")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir, "--proto-max-bulk-len", "1gb"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    r = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(100):
        try:
            r.ping()
            break
        except Exception:
            time.sleep(0.05)
    proc.workdir = workdir  # type: ignore[attr-defined]
    return proc, r


def run_redis(r: Any, nbytes: int, seconds: float) -> dict[str, float]:
    v = b"x" * nbytes if nbytes < 1024 else np.ones(nbytes // 8).tobytes()
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 3:
        r.set(n % 1000, v)
        n += 1
    put = n / (time.perf_counter() - t0)
    m = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or m < 3:
        np.frombuffer(r.get(m % min(n, 1000)), np.uint8)
        m += 1
    get = m / (time.perf_counter() - t0)
    r.flushall()
    return {"put": put, "get": get}


def run_redis_pipeline(r: Any, seconds: float) -> float:
    v = b"x" * 100
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        p = r.pipeline(transaction=False)
        for i in range(1000):
            p.set(i, v)
        p.execute()
        n += 1000
    rate = n / (time.perf_counter() - t0)
    r.flushall()
    return rate


def run_dragon(seconds: float) -> dict[str, float] | None:
    """Dragon's figures for the 100 B rows, from ``bench_dragon.py`` under ``dragon``."""
    exe = os.environ.get("DDICT_BENCH_DRAGON") or shutil.which("dragon")
    if not exe:
        return None
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_dragon.py")
    workdir = tempfile.mkdtemp(prefix="ddict-bench-dragon-")
    try:
        out = subprocess.run([exe, script, str(seconds)], cwd=workdir, capture_output=True,
                             text=True, timeout=600)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"(Dragon run failed: {e!r})", file=sys.stderr)
        return None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    print(f"(Dragon run gave no result: {out.stderr[-500:]})", file=sys.stderr)
    return None


def tls_rows(secs: float, bases: dict[str, dict[str, float] | None]
             ) -> list[tuple[str, str, str, str, str]]:  # fmt: skip
    """TCP with TLS on (a cluster with the cluster's certificates, as across hosts)."""
    from distributed import Security

    sec = Security.temporary()
    rows = []
    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0",
                      security=sec) as cl, Client(cl, security=sec) as c, \
            dask.config.set({"ddict.local-transport": False}):  # fmt: skip
        d = DDict(total_mem="1 GiB", client=c)
        for label in ("100 B", "1 MiB"):
            nbytes, base = SIZES[label], bases.get(label)
            r = run_ddict(d.manager(0), nbytes, secs)
            for op in ("put", "get"):
                ratio = f"{r[op] / base[op]:.2f}x" if base else "n/a"
                rows.append((f"{op} {label}", "client (tls, as from another host)",
                             fmt(nbytes, r[op]), fmt(nbytes, base[op]) if base else "n/a",
                             ratio))  # fmt: skip
        d.destroy()
    return rows


def fmt(nbytes: int, rate: float) -> str:
    if nbytes < 1024:
        return f"{rate:,.0f} ops/s"
    return f"{rate * nbytes / 1e6:,.0f} MB/s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter runs (noisier)")
    ap.add_argument("--seconds", type=float, default=None)
    args = ap.parse_args()
    secs = args.seconds or (0.5 if args.quick else 2.0)

    rows: list[tuple[str, str, str, str, str]] = []
    bases: dict[str, dict[str, float] | None] = {}
    redis_ctx = start_redis()
    try:
        with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cl, \
                Client(cl) as c:  # fmt: skip
            d = DDict(total_mem="1 GiB", client=c, n_workers=2)
            m0 = d.manager(0)  # every key on manager 0, hosted by worker 0
            w0, w1 = d.manager_workers[0], d.manager_workers[1]
            for label, nbytes in SIZES.items():
                s = secs if nbytes < (64 << 20) else max(secs, 1.0)
                res = {
                    "client (same host)": run_ddict(m0, nbytes, s),
                    "task on the manager's worker": c.submit(
                        task_bench, m0, nbytes, s, workers=[w0], pure=False).result(),
                    "task, other worker (same host)": c.submit(
                        task_bench, m0, nbytes, s, workers=[w1], pure=False).result(),
                }  # fmt: skip
                with dask.config.set({"ddict.local-transport": False}):
                    tcp = DDict.attach(d.serialize(), client=c).manager(0)
                    res["client (tcp, as from another host)"] = run_ddict(tcp, nbytes, s)
                base = bases[label] = run_redis(redis_ctx[1], nbytes, s) if redis_ctx else None
                for where, r in res.items():
                    for op in ("put", "get"):
                        ratio = f"{r[op] / base[op]:.2f}x" if base else "n/a"
                        rows.append((f"{op} {label}", where, fmt(nbytes, r[op]),
                                     fmt(nbytes, base[op]) if base else "n/a", ratio))  # fmt: skip
            batch = run_batch(d, secs)
            pipe = run_redis_pipeline(redis_ctx[1], secs) if redis_ctx else None
            rows.append(("batch put 100 B", "client (same host)", fmt(100, batch),
                         fmt(100, pipe) if pipe else "n/a",
                         f"{batch / pipe:.2f}x" if pipe else "n/a"))  # fmt: skip
            busy = c.submit(spin, secs * 2 + 1, workers=[w0], pure=False)
            time.sleep(0.5)
            lat = put_latencies(m0, secs * 2)
            busy.result()
            rows.append(("p99 put 100 B", "client, manager's worker CPU-bound",
                         f"{p99(lat) * 1e3:.2f} ms", "n/a", "target <= 2 ms"))  # fmt: skip
            d.destroy()
        rows += tls_rows(secs, bases)
    finally:
        if redis_ctx:
            redis_ctx[0].terminate()
            redis_ctx[0].wait()
            shutil.rmtree(redis_ctx[0].workdir, ignore_errors=True)

    dragon = run_dragon(secs)
    if dragon:
        ours = {(r[0], r[1]): r[2] for r in rows}
        print("operation       | DDict (same host)  | Dragon DDict (same run) | ratio")
        print("-" * 72)
        for op, theirs in dragon.items():
            mine = ours.get((op, "client (same host)"))
            if mine is None:
                continue
            value = float(mine.split()[0].replace(",", ""))
            print(f"{op:15} | {mine:18} | {theirs:>15,.0f} ops/s | {value / theirs:.1f}x")
        print()

    head = ("operation", "DDict client", "DDict", "redis-py (same run)", "ratio")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(5)]
    line = " | ".join(h.ljust(w) for h, w in zip(head, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        print(" | ".join(str(x).ljust(w) for x, w in zip(r, widths)))
    print(f"\n(python {sys.version.split()[0]}, {os.cpu_count()} cores, {secs:.1f} s per cell)")


if __name__ == "__main__":
    main()
