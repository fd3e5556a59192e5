"""AsyncDDict under many coroutines: pipelined requests against the thread per batch and
``redis.asyncio``.

    python benchmarks/bench_async.py [--quick] [--workers 2] [--coroutines 1,16,128]
                                     [--ops 400]

A LocalCluster of W worker processes (``--workers``, default 2; one thread each)
and a ``DDict(managers_per_worker=1)`` on it.  One client process (``multiprocessing``
spawn: no scheduler or worker threads beside it) runs, for each C in
``--coroutines`` (default 1,16,128), C coroutines at once on one ``asyncio`` loop,
each doing ``--ops`` (default 400; ``--quick`` 150) sequential awaited puts of 100 B
values to keys of its own, then gets of them, for each peer in turn:

* ``pipelined``: ``AsyncDDict`` reaching every manager over TCP (as from another
  host: ``ddict.local-transport: False``), with the default
  ``ddict.transport.pipelined: True``: the batch of each loop turn written at once on
  the loop's own connections, answers matched by tag
  (:mod:`dask_ddict.transport.pipelined`);
* ``threads``: the same with ``ddict.transport.pipelined: False``: each batch is sent
  from a worker thread over the blocking connections (the design before pipelining);
* ``same host``: ``AsyncDDict`` with the default config (shard reads and writes from
  this host, in a worker thread per batch);
* ``redis.asyncio``: W ``redis-server``s (redis-py with hiredis), the client picking
  each key's server by ``crc32(key) % W``, one ``redis.asyncio.Redis`` per server (its
  pool opens a connection per coroutine in flight).  Only when ``redis-server`` is on
  the PATH; started on loopback ports in temporary directories, killed at the end.

Rows: ``async <put|get>, <peer>, C=<c>``: operations per second over all C
coroutines, the ratio to ``redis.asyncio``'s in the same run, and the client
process's CPU per operation (user + system, ``os.times``).  There is no target in
the issues for these rows (ratios only).  One run each; 2-core VMs are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from _bench_refs import start_redis, stop_redis  # beside this script
from common import Row, print_table

VALUE = b"x" * 100
PEERS = ("pipelined", "threads", "same host", "redis.asyncio")


async def _rates(
    put: Callable[[str, bytes], Awaitable[Any]],
    get: Callable[[str], Awaitable[Any]],
    c: int,
    n: int,
    tag: str,
) -> dict[str, tuple[float, float]]:
    """``{"put"|"get": (ops/s, client CPU s per op)}`` of C coroutines doing n each."""

    async def one(w: int, op: str) -> None:
        for i in range(n):
            key = f"{tag}:{w}:{i}"
            if op == "put":
                await put(key, VALUE)
            else:
                got = await get(key)
                assert got == VALUE, (key, got)

    out = {}
    for op in ("put", "get"):
        t0, c0 = time.perf_counter(), os.times()
        await asyncio.gather(*(one(w, op) for w in range(c)))
        dt, c1 = time.perf_counter() - t0, os.times()
        cpu = max(0.0, c1.user + c1.system - c0.user - c0.system)  # (10 ms ticks: -0.0 once)
        out[op] = (c * n / dt, cpu / (c * n))
    return out


def child(serialized: str, ports: list[int], cs: list[int], n: int, results: Any) -> None:
    """The client process: every peer at every C (results: ``(peer, c, rates)``)."""
    import dask.config

    from dask_ddict import AsyncDDict, DDict

    def handle(cfg: dict[str, Any]) -> AsyncDDict:
        with dask.config.set(cfg):
            d = DDict.attach(serialized, timeout=120)
            for m in range(d.num_managers):
                d._core.channel(m)  # (made now, as a long-running client's are)
        return AsyncDDict(d)

    async def run() -> None:
        peers: dict[str, Any] = {
            "pipelined": handle({"ddict.local-transport": False}),
            "threads": handle({"ddict.local-transport": False, "ddict.transport.pipelined": False}),
            "same host": handle({}),
        }
        if ports:
            import redis.asyncio as ra

            servers = [
                ra.Redis(host="127.0.0.1", port=p, max_connections=max(cs) + 8) for p in ports
            ]

            def server(k: str) -> Any:
                return servers[zlib.crc32(k.encode()) % len(servers)]

            peers["redis.asyncio"] = (lambda k, v: server(k).set(k, v), lambda k: server(k).get(k))
        for c in cs:
            for name, p in peers.items():
                put, get = (p.put, p.get) if isinstance(p, AsyncDDict) else p
                results.put((name, c, await _rates(put, get, c, n, f"{name}:{c}")))
        for p in peers.values():
            if isinstance(p, AsyncDDict):
                p.detach()
        if ports:
            for s in servers:
                await s.aclose()

    asyncio.run(run())


def rows_of(got: dict[tuple[str, int], dict[str, tuple[float, float]]], cs: list[int]) -> list[Row]:
    rows: list[Row] = []
    for op in ("put", "get"):
        for c in cs:
            ref = got.get(("redis.asyncio", c), {}).get(op)
            for name in PEERS:
                rate = got.get((name, c), {}).get(op)
                if rate is None:
                    continue
                ratio = f"{rate[0] / ref[0]:.2f}x redis.asyncio" if ref else "-"
                rows.append(
                    (
                        f"async {op}, {name}, C={c}",
                        f"{rate[0]:,.0f} ops/s",
                        "-",
                        ratio if name != "redis.asyncio" else "-",
                        f"client CPU {rate[1] * 1e6:.0f} us/op",
                    )
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer operations")
    ap.add_argument(
        "--workers",
        type=int,
        default=2,
        help="workers = host processes = managers = redis-servers (default 2)",
    )
    ap.add_argument("--coroutines", default="1,16,128", help="C, comma-separated")
    ap.add_argument(
        "--ops",
        type=int,
        default=None,
        help="puts, then gets, per coroutine (default 400; --quick 150)",
    )
    args = ap.parse_args()
    cs = sorted({int(x) for x in args.coroutines.split(",")})
    n = args.ops or (150 if args.quick else 400)
    if cs[0] < 1 or args.workers < 1 or n < 1:
        ap.error("--coroutines, --workers and --ops must be >= 1")

    from distributed import Client, LocalCluster

    from dask_ddict import DDict

    started = time.perf_counter()
    servers = start_redis(args.workers)
    got: dict[tuple[str, int], dict[str, tuple[float, float]]] = {}
    try:
        with (
            LocalCluster(
                n_workers=args.workers, threads_per_worker=1, dashboard_address=":0"
            ) as cl,
            Client(cl) as client,
        ):
            d = DDict(managers_per_worker=1, total_mem=f"{64 * args.workers} MiB", client=client)
            try:
                ctx = mp.get_context("spawn")
                results = ctx.Queue()
                p = ctx.Process(
                    target=child, args=(d.serialize(), [s[1] for s in servers], cs, n, results)
                )
                p.start()
                deadline = time.monotonic() + 1800
                while len(got) < len(cs) * (len(PEERS) - (not servers)):
                    if not p.is_alive() and results.empty():
                        break
                    try:
                        name, c, rates = results.get(timeout=max(1, deadline - time.monotonic()))
                    except Exception:  # noqa: BLE001 - (its trace is on stderr)
                        break
                    got[(name, c)] = rates
                p.join(60)
                if p.is_alive():
                    p.kill()
            finally:
                d.destroy()
    finally:
        stop_redis(servers)
    rows = rows_of(got, cs)
    if not servers:
        rows.append(("redis.asyncio", "n/a", "-", "-", "redis-server is not on the PATH"))
    print_table(
        rows,
        f"\n(python {sys.version.split()[0]}, {os.cpu_count()} cores, "
        f"{args.workers} workers, C in {','.join(map(str, cs))}, {n} puts and gets per "
        f"coroutine, {time.perf_counter() - started:.0f} s in all"
        f"{', --quick' if args.quick else ''})",
    )
    if len(got) < len(cs) * (len(PEERS) - (not servers)):
        print("FAILED: the client process did not finish (its trace is on stderr)")
        sys.exit(1)


if __name__ == "__main__":
    main()
