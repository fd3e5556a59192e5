"""Concurrency benchmark: P client processes at once, same host and over TCP, against Redis.

    python benchmarks/bench_concurrency.py [--quick] [--workers 2] [--clients 1,2,4]
                                           [--ops 20000] [--seconds 2]

A LocalCluster of W worker processes (``--workers``, default 2; one thread each)
and a ``DDict(managers_per_worker=1)`` on it: W managers in W host processes
(``python -m dask_ddict.host``).  For each P in ``--clients`` (default 1,2,4 on
this 2-core machine; e.g. ``--clients 1,4,8,12 --workers 8`` on a large one),
P client processes (``multiprocessing`` spawn) run these peers one after the
other, every phase of every peer starting in all P processes together (a
barrier), each process on keys of its own:

* ``same host``: ``DDict.attach(d.serialize())`` in the child with the default
  config (shard reads and writes straight from this host, Unix sockets);
* ``tcp``: the same with ``ddict.local-transport: False`` set (dask.config, in
  the child): every request over TCP, as from another host;
* ``1 redis``: one ``redis-server``; ``W redis``: W ``redis-server``s, the
  client picking each key's server by ``crc32(key) % W`` (redis-py with hiredis;
  ``get_many`` is one MGET per server, a batch one pipeline per server, each
  executed in turn).  Both only when ``redis-server`` is on the PATH, started
  on loopback ports in temporary directories and killed at the end.

The phases, in each client process:

* ``put``: N (``--ops``, default 20,000; ``--quick`` 5,000) sequential puts of
  100 B values (``d[k] = v`` / ``SET``), at most ``--cap`` seconds;
* ``get``: a get of each key just put (``d[k]`` / ``GET``);
* ``get_many``: ``d.get_many(keys)`` of 1,000 keys of 100 B (written before the
  timed phases) in a loop for ``--seconds`` (default 2; ``--quick`` 0.75) /
  MGET;
* ``batch``: ``start_batch_put()``, 1,000 puts of 100 B, ``end_batch_put()`` in
  a loop for ``--seconds`` / a pipeline of 1,000 SETs (``transaction=False``).

Each phase begins on the same keys at every P: the keys the largest group's other
clients would have written by then (their get_many keys, then their puts' before the
gets, their batches' before the batches) are written first, untimed, by the clients
there are (client ``j`` for ``j + P``, ``j + 2P``...), for every peer.  Without it a
group of 4 read a store 4 times as large as a group of 1, and a shard's B-tree costs
more per key as it grows (host CPU per key of a TCP ``get_many``, one client:
0.21-0.23 us on a store of one client's keys, 0.27-0.28 us on four's, the same as
four clients' on it).

Rows:

* ``<phase>, <transport>, P=<p>``: the aggregate rate (operations or keys over
  all P processes / the slowest process's time in the phase) and its ratio to
  the W-redis peer's in the same process group.  Notes: both Redis peers'
  rates, the count and the slowest time, the host processes' CPU per operation
  (``ours``) and the redis-servers' (``W redis``), and the client processes'
  own CPU per operation.  Target (issue 33), only in its cells: with 2 workers
  and 4 client processes, TCP put and get >= 1.5x of 2 redis-servers; with >= 8
  workers and >= 12 client processes, TCP put and get >= 1.5x and same-host put
  >= 2x of W redis-servers.  Other rows have no target ("-").
* ``host CPU per <phase>, <transport>``: user + system CPU (psutil) of the W
  host processes (their pids from ``d.stats``) over the phase, per operation
  (per key for get_many and batch), at the smallest and the largest P; target:
  the largest P's over the smallest's <= 1.2 ("host CPU per op must not grow
  with the number of clients").  Notes: every P's, and the redis-servers' CPU
  per operation over the same phase of their peers.  The kernel counts CPU in
  10 ms ticks; where the host processes spent under 50 ms in all at the
  smallest P (same-host reads and small writes do not go through them) the
  result is ``n/a``.  With one client on 2 cores, idle wake-ups inflate every
  process's CPU per operation: compare under load.

Results are one run each; absolute numbers on 2-core VMs are noisy.  A process
group that fails gives a ``FAILED`` row (trace on stderr) and the others run.
Everything is destroyed, closed and killed at the end; only loopback networking.
"""

from __future__ import annotations

# Only light imports here: every client process (spawn) imports this module again.
import argparse
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable
from typing import Any

from _bench_refs import start_redis, stop_redis  # beside this script
from common import Row, print_table, python_build, verdict

VALUE = b"x" * 100
MANY = 1000  # keys per get_many / batch
CHUNK = 500  # puts/gets between two looks at the clock
PHASES = ("put", "get", "get_many", "batch")
UNIT = {"put": "ops", "get": "ops", "get_many": "keys", "batch": "keys"}
REDIS_OP = {"put": "SET", "get": "GET", "get_many": "MGET key", "batch": "pipelined SET"}
SAME, TCP = "same host", "tcp"
SETUP_TIMEOUT = 180.0  # spawn + imports + attach on a loaded 2-core machine
CHILD_TIMEOUT = 1800.0  # a client process's every wait (the parent breaks the barrier sooner)


# -- the client processes ------------------------------------------------------------------

Ops = tuple[
    Callable[[str, bytes], Any],
    Callable[[str], Any],
    Callable[[list[str]], Any],
    Callable[[list[str], bytes], Any],
    Callable[[], Any],
]


def ddict_ops(serialized: str) -> Ops:
    """put, get, get_many, batch and close of a DDict handle attached in this process."""
    from dask_ddict import DDict

    d = DDict.attach(serialized, timeout=120)

    def batch(keys: list[str], v: bytes) -> None:
        d.start_batch_put()
        for k in keys:
            d[k] = v
        d.end_batch_put()

    return d.__setitem__, d.__getitem__, d.get_many, batch, d.detach


def redis_ops(ports: list[int]) -> Ops:
    """The same through redis-py: one server, or ``len(ports)`` with crc32 hashing."""
    import redis

    conns = [redis.Redis(host="127.0.0.1", port=p) for p in ports]
    n = len(conns)

    def close() -> None:
        for c in conns:
            c.close()

    if n == 1:
        r = conns[0]

        def batch1(keys: list[str], v: bytes) -> None:
            p = r.pipeline(transaction=False)
            for k in keys:
                p.set(k, v)
            p.execute()

        return r.set, r.get, r.mget, batch1, close

    def put(k: str, v: bytes) -> None:
        conns[zlib.crc32(k.encode()) % n].set(k, v)

    def get(k: str) -> Any:
        return conns[zlib.crc32(k.encode()) % n].get(k)

    def get_many(keys: list[str]) -> list[Any]:
        groups: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(zlib.crc32(k.encode()) % n, []).append(i)
        out: list[Any] = [None] * len(keys)
        for s, idx in groups.items():
            for i, v in zip(idx, conns[s].mget([keys[i] for i in idx])):
                out[i] = v
        return out

    def batch(keys: list[str], v: bytes) -> None:
        pipes = [c.pipeline(transaction=False) for c in conns]
        for k in keys:
            pipes[zlib.crc32(k.encode()) % n].set(k, v)
        for p in pipes:
            p.execute()

    return put, get, get_many, batch, close


def client_phases(
    j: int, ops: Ops, cfg: dict[str, Any], barrier: Any
) -> dict[str, tuple[int, float, float]]:
    """One peer's phases in client process ``j``: {phase: (ops, seconds, own CPU seconds)}."""
    put, get, get_many, batch, _ = ops
    v, n, cap, secs = VALUE, cfg["n"], cfg["cap"], cfg["seconds"]
    keys = [f"c{j}:{i}" for i in range(n)]
    mkeys = [f"c{j}:m{i}" for i in range(MANY)]
    bkeys = [f"c{j}:b{i}" for i in range(MANY)]
    # the clients of the largest group that this one lacks, filled in by j: each phase
    # begins on the keys it begins on there (a B-tree's cost per key grows with its keys)
    absent = range(j + cfg["p"], cfg["most"], cfg["p"])

    def fill(name: Callable[[int, int], str], count: int) -> None:
        for a in absent:
            for start in range(0, count, MANY):
                batch([name(a, i) for i in range(start, min(count, start + MANY))], v)

    batch(mkeys, v)  # (untimed: the get_many keys; every connection opened)
    assert get_many(mkeys)[-1] == v
    put(f"c{j}:warm", v)
    assert get(f"c{j}:warm") == v
    fill(lambda a, i: f"c{a}:m{i}", MANY)
    barrier.wait(CHILD_TIMEOUT)  # ready
    out = {}
    n_put = 0
    for ph in PHASES:
        if ph == "get":  # (what the absent clients' put phases left)
            fill(lambda a, i: f"c{a}:{i}", n_put)
        elif ph == "batch":  # (their batches' keys, there after their first batch)
            fill(lambda a, i: f"c{a}:b{i}", MANY)
        barrier.wait(CHILD_TIMEOUT)  # filled (untimed)
        barrier.wait(CHILD_TIMEOUT)  # start
        t0, c0 = time.perf_counter(), time.process_time()
        t_end = t0 + cap
        done = 0
        if ph == "put":
            while done < n:
                for k in keys[done : done + CHUNK]:
                    put(k, v)
                done = min(n, done + CHUNK)
                if time.perf_counter() > t_end:
                    break
            n_put = done
        elif ph == "get":
            got = v
            while done < n_put:
                for k in keys[done : done + CHUNK]:
                    got = get(k)
                done = min(n_put, done + CHUNK)
                if time.perf_counter() > t_end:
                    break
            assert got == v, got
        else:
            t_end = t0 + secs
            call = (lambda: get_many(mkeys)) if ph == "get_many" else (lambda: batch(bkeys, v))
            while True:  # at least one call, then until --seconds passed
                call()
                done += MANY
                if time.perf_counter() >= t_end:
                    break
        out[ph] = (done, time.perf_counter() - t0, time.process_time() - c0)
        barrier.wait(CHILD_TIMEOUT)  # done
    return out


def client_main(
    j: int, peers: list[tuple[str, str, Any, bool]], cfg: dict[str, Any], barrier: Any, results: Any
) -> None:
    """Client process ``j``: every peer's phases in turn; puts ("ok", j, {peer: phases})
    or ("error", j, trace) on ``results``."""
    try:
        import dask

        if any(kind == "ddict" for _, kind, _, _ in peers):
            # before any dask.config.set: a ``with`` that first made the ``ddict`` section
            # deletes it on exit, the defaults loaded at import with it
            import dask_ddict  # noqa: F401

        out = {}
        for name, kind, spec, local in peers:
            with dask.config.set({"ddict.local-transport": local}):
                ops = ddict_ops(spec) if kind == "ddict" else redis_ops(spec)
                try:
                    out[name] = client_phases(j, ops, cfg, barrier)
                finally:
                    ops[4]()
            barrier.wait(CHILD_TIMEOUT)  # the parent emptied the store
        results.put(("ok", j, out))
    except BaseException:  # noqa: BLE001 - reported to the parent, which breaks off
        barrier.abort()
        results.put(("error", j, traceback.format_exc()))


# -- the parent: one process group per P ----------------------------------------------------


class Cell:
    """One peer's phase in one process group, aggregated over its P processes."""

    def __init__(self, per_proc: list[tuple[int, float, float]], host_cpu: float) -> None:
        self.ops = sum(o for o, _, _ in per_proc)
        self.slowest = max(t for _, t, _ in per_proc)
        self.rate = self.ops / self.slowest if self.slowest > 0 else 0.0
        self.host_cpu = host_cpu
        self.host_us = host_cpu / self.ops * 1e6 if self.ops else float("nan")
        self.client_us = sum(c for _, _, c in per_proc) / self.ops * 1e6 if self.ops else 0.0


def cpu_seconds(procs: list[Any]) -> float:
    """User + system CPU seconds so far of the psutil processes ``procs`` (all threads)."""
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def run_group(
    p: int,
    peers: list[tuple[str, str, Any, bool, list[Any], Callable[[], None]]],
    cfg: dict[str, Any],
) -> dict[str, dict[str, Cell]]:
    """P client processes through every peer (name, kind, spec, local, server processes,
    emptying); {peer: {phase: Cell}}."""
    ctx = mp.get_context("spawn")  # (no fork of a process running a cluster's threads)
    barrier = ctx.Barrier(p + 1)
    results = ctx.Queue()
    child_peers = [(name, kind, spec, local) for name, kind, spec, local, _, _ in peers]
    procs = [
        ctx.Process(
            target=client_main, args=(j, child_peers, dict(cfg, p=p), barrier, results), daemon=True
        )
        for j in range(p)
    ]
    phase_timeout = cfg["cap"] + cfg["seconds"] + 120.0
    host: dict[str, dict[str, float]] = {}
    try:
        for pr in procs:
            pr.start()
        try:
            for name, _, _, _, servers, empty in peers:
                barrier.wait(SETUP_TIMEOUT)  # ready (set up, untimed)
                host[name] = {}
                for ph in PHASES:
                    barrier.wait(phase_timeout)  # filled (untimed: as long as a phase's writes)
                    c0 = cpu_seconds(servers)
                    barrier.wait(SETUP_TIMEOUT)  # start
                    barrier.wait(phase_timeout)  # done
                    host[name][ph] = cpu_seconds(servers) - c0
                empty()
                barrier.wait(SETUP_TIMEOUT)
            outs = [results.get(timeout=120) for _ in procs]
        except threading.BrokenBarrierError:
            barrier.abort()
            errors = []
            try:
                for _ in procs:
                    errors.append(results.get(timeout=10))
            except queue.Empty:
                pass
            msgs = sorted(
                (m[2] for m in errors if m[0] == "error"), key=lambda t: "BrokenBarrierError" in t
            )  # the cause first
            msgs = msgs or ["(no client process said why)"]
            raise RuntimeError(f"a client process failed:\n{msgs[0]}") from None
        failed = [m[2] for m in outs if m[0] == "error"]
        if failed:
            raise RuntimeError(f"a client process failed:\n{failed[0]}")
    finally:
        for pr in procs:
            pr.join(timeout=30)
            if pr.is_alive():
                pr.kill()
                pr.join(10)
        results.close()
        results.join_thread()
    cells: dict[str, dict[str, Cell]] = {}
    for name in host:
        cells[name] = {ph: Cell([m[2][name][ph] for m in outs], host[name][ph]) for ph in PHASES}
    return cells


# -- redis-servers -------------------------------------------------------------------------


# -- rows ----------------------------------------------------------------------------------


def rate_target(transport: str, ph: str, p: int, w: int) -> float | None:
    """Issue 33's minimum ratio to W redis-servers for this row, if it has one."""
    if ph not in ("put", "get"):
        return None
    if w == 2 and p == 4 and transport == TCP:
        return 1.5
    if w >= 8 and p >= 12:
        if transport == TCP:
            return 1.5
        if ph == "put":
            return 2.0
    return None


def rate_rows(
    cells: dict[int, dict[str, dict[str, Cell]]], w: int, rn: str | None, r1: str | None
) -> list[Row]:
    rows: list[Row] = []
    for transport in (SAME, TCP):
        for p, group in cells.items():
            for ph in PHASES:
                c, u = group[transport][ph], UNIT[ph]
                base = group[rn][ph] if rn else None
                ratio = c.rate / base.rate if base and base.rate else None
                value = f"{c.rate:,.0f} {u}/s" + (f" ({ratio:.2f}x {rn})" if ratio else "")
                want = rate_target(transport, ph, p, w)
                target = f">= {want:g}x {rn}" if want and rn else "-"
                result = verdict(ratio >= want) if want and ratio else "-"
                notes = []
                if rn and base:
                    notes.append(
                        f"{rn} (crc32 % {w}): {base.rate:,.0f}"
                        if w > 1
                        else f"{rn}: {base.rate:,.0f}"
                    )
                if r1 and r1 != rn:
                    notes.append(f"{r1}: {group[r1][ph].rate:,.0f} {u}/s")
                notes.append(f"{c.ops:,} {u}, slowest process {c.slowest:.2f} s")
                host = f"host CPU {c.host_us:.2f} us/{u[:-1]}"
                if base:
                    host += f" ({rn}: {base.host_us:.2f})"
                notes.append(host)
                notes.append(
                    f"client CPU {c.client_us:.1f} us/{u[:-1]}"
                    + (f" ({rn}: {base.client_us:.1f})" if base else "")
                )
                rows.append((f"{ph}, {transport}, P={p}", value, target, result, "; ".join(notes)))
    return rows


def cpu_rows(cells: dict[int, dict[str, dict[str, Cell]]], rn: str | None) -> list[Row]:
    rows: list[Row] = []
    ps = sorted(cells)
    lo, hi = ps[0], ps[-1]
    for transport in (SAME, TCP):
        for ph in PHASES:
            u = UNIT[ph][:-1]
            first, last = cells[lo][transport][ph], cells[hi][transport][ph]
            growth = last.host_us / first.host_us if first.host_us > 0 else float("inf")
            value = f"{first.host_us:.2f} -> {last.host_us:.2f} us/{u} (P={lo} -> {hi}" + (
                f": {growth:.2f}x)" if first.host_us > 0 else ")"
            )
            every = ", ".join(f"P={p}: {cells[p][transport][ph].host_us:.2f}" for p in ps)
            notes = [f"us per {u}, {every}"]
            if rn:
                theirs = ", ".join(f"P={p}: {cells[p][rn][ph].host_us:.2f}" for p in ps)
                notes.append(f"{rn} per {REDIS_OP[ph]}: {theirs}")
                if cells[hi][rn][ph].host_us > 0:
                    notes.append(
                        f"ours / {rn} at P={hi}: {last.host_us / cells[hi][rn][ph].host_us:.2f}x"
                    )
            if len(ps) < 2:
                result = "n/a"
                notes.append("one P only: nothing to compare")
            elif first.host_cpu < 0.05:
                result = "n/a"
                notes.append(
                    f"the host processes spent {first.host_cpu * 1e3:.0f} ms at P={lo}: "
                    "(mostly) off this path"
                )
            else:
                result = verdict(growth <= 1.2)
            rows.append(
                (
                    f"host CPU per {ph}, {transport}",
                    value,
                    f"<= 1.2x P={lo}'s" if len(ps) > 1 else "-",
                    result,
                    "; ".join(notes),
                )
            )
    return rows


# -- main ----------------------------------------------------------------------------------


def measure(
    args: argparse.Namespace, ps: list[int], cfg: dict[str, Any], rows: list[Row]
) -> tuple[dict[int, dict[str, dict[str, Cell]]], str | None, str | None]:
    """Every process group on one cluster and one dictionary (destroyed at the end)."""
    import psutil
    from distributed import Client, LocalCluster

    from dask_ddict import DDict

    w = args.workers
    # W managers; room for every key of the largest group (100 B values, LMDB overhead)
    total_mem = max(256 << 20, 4 * max(ps) * (cfg["n"] + 3 * MANY) * 1024)
    redis = start_redis(1 + w if w > 1 else 1)
    cells: dict[int, dict[str, dict[str, Cell]]] = {}
    rn = r1 = None
    try:
        with (
            LocalCluster(
                n_workers=w, threads_per_worker=1, processes=True, dashboard_address=":0"
            ) as cl,
            Client(cl) as c,
        ):
            d = DDict(
                managers_per_worker=1, n_workers=w, total_mem=total_mem, client=c, timeout=120
            )
            try:
                pids = sorted({s.pid for s in d.stats})
                assert len(pids) == w and os.getpid() not in pids, pids
                hosts = [psutil.Process(pid) for pid in pids]
                spec = d.serialize()
                peers: list[Any] = [
                    (SAME, "ddict", spec, True, hosts, d.clear),
                    (TCP, "ddict", spec, False, hosts, d.clear),
                ]
                if redis:
                    import redis as redis_py

                    def flusher(ports: list[int]) -> Callable[[], None]:
                        def flush() -> None:
                            for port in ports:
                                r = redis_py.Redis(host="127.0.0.1", port=port)
                                r.flushall()
                                r.close()

                        return flush

                    one = [redis[0]]
                    many = redis[1:] if w > 1 else one
                    r1, rn = "1 redis", f"{w} redis"
                    peers.append(
                        (
                            r1,
                            "redis",
                            [s[1] for s in one],
                            True,
                            [psutil.Process(s[0].pid) for s in one],
                            flusher([s[1] for s in one]),
                        )
                    )
                    if w > 1:
                        peers.append(
                            (
                                rn,
                                "redis",
                                [s[1] for s in many],
                                True,
                                [psutil.Process(s[0].pid) for s in many],
                                flusher([s[1] for s in many]),
                            )
                        )
                for p in ps:
                    t0 = time.perf_counter()
                    try:
                        cells[p] = run_group(p, peers, cfg)
                    except Exception as e:  # noqa: BLE001 - the other groups still run
                        traceback.print_exc()
                        rows.append(
                            (
                                f"process group P={p}",
                                "error",
                                "-",
                                "FAILED",
                                " ".join(str(e).split())[-300:],
                            )
                        )
                        d.clear()
                    print(f"(P={p}: {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
            finally:
                d.destroy()
    finally:
        stop_redis(redis)
    return cells, rn, r1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer operations, P in 1,4")
    ap.add_argument(
        "--workers",
        type=int,
        default=2,
        help="worker processes = host processes "
        "= managers = redis-servers of the hashed peer (default 2)",
    )
    ap.add_argument(
        "--clients",
        default=None,
        help="client process counts, comma-separated (default 1,2,4; --quick 1,4)",
    )
    ap.add_argument(
        "--ops",
        type=int,
        default=None,
        help="sequential puts, then gets, per client process (default 20000; --quick 5000)",
    )
    ap.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="seconds of get_many and of batch puts (default 2; --quick 0.75)",
    )
    ap.add_argument(
        "--cap",
        type=float,
        default=None,
        help="most seconds of a put or get phase (default 60; --quick 15)",
    )
    args = ap.parse_args()
    ps = sorted({int(x) for x in (args.clients or ("1,4" if args.quick else "1,2,4")).split(",")})
    if ps[0] < 1 or args.workers < 1:
        ap.error("--clients and --workers must be >= 1")
    cfg = {
        "n": max(MANY, args.ops or (5000 if args.quick else 20_000)),
        "seconds": args.seconds or (0.75 if args.quick else 2.0),
        "cap": args.cap or (15.0 if args.quick else 60.0),
        "most": ps[-1],
    }

    started = time.perf_counter()
    rows: list[Row] = []
    cells, rn, r1 = measure(args, ps, cfg, rows)
    if cells:
        rows = rate_rows(cells, args.workers, rn, r1) + cpu_rows(cells, rn) + rows
    if not rn:
        rows.append(("redis peers", "n/a", "-", "-", "redis-server is not on the PATH"))

    print_table(
        rows,
        f"\n({python_build()}, {os.cpu_count()} cores, {args.workers} workers, "
        f"P in {','.join(map(str, ps))}, {cfg['n']:,} puts/gets per process, "
        f"{cfg['seconds']:g} s per get_many/batch phase, "
        f"{time.perf_counter() - started:.0f} s in all{', --quick' if args.quick else ''})",
    )
    if any(r[3] == "FAILED" for r in rows):
        sys.exit(1)  # (a process group did not run to its end: its trace is on stderr)


if __name__ == "__main__":
    main()
