"""How a dictionary's costs grow with its manager count: one command, one table.

    python benchmarks/bench_scale.py [--managers 8,128,512] [--workers 2]

For each manager count (spread over ``--workers`` workers of a LocalCluster,
served by one host process per worker) it creates a dictionary and reports:

* create and destroy time;
* the pickled size of a handle (what every task that takes ``d`` carries);
* warm broadcast times, median of repeated calls: ``len``, ``stats``, ``clear``,
  ``sync_to_newest_checkpoint``, the first key of an iteration, ``bput``, ``bget``,
  ``persisted_ids`` (one ``FanOut`` request per host process, hosts at once);
* the file descriptors this client opened by touching every manager (shard views,
  at most ``ddict.transport.max-shard-views``, and sockets);
* at the largest count, ``--clients PxN``: P processes, each N clients that unpickle a
  handle and put once: time per client, layout fetches, orchestrator calls and growth;
* the orchestrator's side: the bytes of the dictionary's entry in its registry (per
  manager), its bytes per Dask client holding a dictionary (``from_name``),
  its handler calls during all the broadcasts plus 200 puts and gets (must be 0),
  and its ``ddict_attach`` calls while 1,000 tasks use a pickled handle (at most
  one per worker process).

The ratio column divides each broadcast time by its time at the smallest
manager count (target: at most 5x from 8 to 512 managers).

``--tree 8,16`` (host counts; 0: none) compares ``bput`` of a 1 MiB value (``--tree-bytes``)
to ``--tree-managers`` managers (256) sent one request per host (the linear fan-out)
and along a tree of hosts (``ddict.broadcast``, each ``--tree-fans`` branching factor):
for each host count, a ``LocalCluster`` of that many workers, each with its host process,
and the median of ``--repeat`` warm calls of each, interleaved.

``--leases 1000x10`` (host processes x primaries each) simulates the lease renewals of
that many host processes of a replicated dictionary (``ddict.lease.duration`` of
``--lease-seconds``, a renewal every half of it): the orchestrator's registry holds
a dictionary of hosts x primaries managers, each with a replica, on fake supervisors,
and processes of this machine send each host's renewal (``ddict_lease``, with its
report of primaries and terms) on its own connection, as host processes do.  It
reports the scheduler's CPU for them (its process's CPU time over the window, less the
same window without renewals: a ``LocalCluster`` runs the scheduler in this process,
which only waits meanwhile) and the renewals' round trips.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from distributed import Client, LocalCluster

from dask_ddict import DDict
from dask_ddict.host.lease import RENEW

BROADCASTS: dict[str, Callable[[DDict], Any]] = {
    "len": len,
    "stats": lambda d: d.stats,
    "clear": lambda d: d.clear(),
    "sync": lambda d: d.sync_to_newest_checkpoint(),
    "first key": lambda d: next(iter(d.keys()), None),
    "bput": lambda d: d.bput("shared", 1),
    "bget": lambda d: d.bget("shared"),
    "persisted_ids": lambda d: d.persisted_ids(),
}


def median_ms(fn: Callable[[], Any], n: int) -> float:
    fn()  # warm: connections open
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _calls(dask_scheduler: Any) -> dict[str, int]:
    return dict(dask_scheduler.plugins["ddict"].calls)


def _registry_bytes(dask_scheduler: Any, name: str) -> int:
    return len(pickle.dumps(dask_scheduler.plugins["ddict"].dicts[name].to_dict()))


def _use(d: DDict, i: int) -> None:
    d[("task", i)] = i


def _clients(blob: bytes, n: int) -> tuple[int, float, int]:
    """In another process: ``n`` clients attach from a pickled handle and put once."""
    from dask_ddict.client import layouts

    start = time.perf_counter()
    for i in range(n):
        h = pickle.loads(blob)
        h[("client", os.getpid(), i)] = i
        h.detach()
    return n, time.perf_counter() - start, layouts.fetches


def measure_clients(client: Client, d: DDict, processes: int, per_process: int) -> dict[str, float]:
    """``processes`` x ``per_process`` clients attach and put; the orchestrator's view."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    blob = pickle.dumps(d)
    calls, registry = client.run_on_scheduler(_calls), client.run_on_scheduler(_registry_all)
    ctx = multiprocessing.get_context("spawn")
    start = time.perf_counter()
    with ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        done = list(pool.map(_clients, [blob] * processes, [per_process] * processes))
    wall = time.perf_counter() - start
    after = client.run_on_scheduler(_calls)
    return {
        "clients": sum(n for n, _, _ in done),
        "processes": processes,
        "wall_s": wall,
        "attach_put_ms": 1e3 * sum(t for _, t, _ in done) / sum(n for n, _, _ in done),
        "fetches": sum(f for _, _, f in done),
        "scheduler_calls": sum(after.values()) - sum(calls.values()),
        "registry_growth_bytes": client.run_on_scheduler(_registry_all) - registry,
        "keys": len(d),
    }


def _holders_bytes(dask_scheduler: Any) -> int:
    h = dask_scheduler.plugins["ddict"].holders
    return len(pickle.dumps((h._uids, h._holders, h._departed)))


def measure_holders(client: Client, k: int) -> float:
    """Orchestrator bytes per Dask client that holds a dictionary (``from_name``): the
    one thing it keeps per connected client (a pickled handle adds nothing)."""
    d = DDict(1, total_mem="8 MiB", client=client)  # lifetime="client": it has holders
    before = client.run_on_scheduler(_holders_bytes)
    others = [Client(client.scheduler.address, set_as_default=False) for _ in range(k)]
    try:
        handles = [DDict.from_name(d.get_name(), client=c) for c in others]
        grown = client.run_on_scheduler(_holders_bytes) - before
        for h in handles:
            h.detach()
    finally:
        for c in others:
            c.close()
        d.destroy()
    return grown / k


def _registry_all(dask_scheduler: Any) -> int:
    plugin = dask_scheduler.plugins["ddict"]
    return len(pickle.dumps({n: lay.to_dict() for n, lay in plugin.dicts.items()}))


def measure(
    client: Client,
    managers: int,
    workers: int,
    repeat: int,
    max_managers: int = 0,
    clients: tuple[int, int] | None = None,
) -> dict[str, float]:
    per_worker = max(1, managers // workers)
    start = time.perf_counter()
    d = DDict(
        per_worker, total_mem=f"{2 * per_worker * workers} MiB", client=client, lifetime="cluster"
    )
    row: dict[str, float] = {
        "managers": d.num_managers,
        "create_s": time.perf_counter() - start,
        "handle_bytes": len(pickle.dumps(d)),
    }
    row["registry_bytes"] = client.run_on_scheduler(_registry_bytes, name=d.get_name())
    fds = len(os.listdir("/proc/self/fd"))  # (a LocalCluster's nannies live here too)
    before = client.run_on_scheduler(_calls)
    for name, fn in BROADCASTS.items():
        row[name] = median_ms(lambda fn=fn: fn(d), repeat)  # type: ignore[misc]
    for i in range(100):
        d[i] = d.get(i, i)
    row["scheduler_calls_ops"] = sum(client.run_on_scheduler(_calls).values()) - sum(
        before.values()
    )
    before = client.run_on_scheduler(_calls)
    client.gather(client.map(_use, [d] * 1000, range(1000), pure=False))
    row["attach_calls_1000_tasks"] = client.run_on_scheduler(_calls).get(
        "ddict_attach", 0
    ) - before.get("ddict_attach", 0)
    for m in range(d.num_managers):  # touch every manager: the views and sockets it opens
        d.manager(m).get(("absent", m))
    row["fds"] = len(os.listdir("/proc/self/fd")) - fds
    if managers == max_managers and clients and clients[0] > 0:
        row.update({f"clients_{k}": v for k, v in measure_clients(client, d, *clients).items()})
    start = time.perf_counter()
    d.destroy()
    row["destroy_s"] = time.perf_counter() - start
    return row


def measure_tree(
    hosts: int, managers: int, nbytes: int, fans: list[int], repeat: int
) -> dict[str, float]:
    """``bput`` of ``nbytes`` to ``managers`` managers on ``hosts`` host processes: the
    linear fan-out's median time, and the tree's for each branching factor (ms)."""
    import dask

    value = os.urandom(nbytes)
    with (
        LocalCluster(n_workers=hosts, threads_per_worker=1, dashboard_address=":0") as cl,
        Client(cl) as c,
    ):
        per = max(1, managers // hosts)
        d = DDict(
            per,
            total_mem=f"{max(64, 4 * per * hosts * -(-nbytes >> 20))} MiB",
            client=c,
            lifetime="cluster",
        )
        try:
            configs = {"linear": {"ddict.broadcast.branching-factor": 0}}
            for fan in fans:
                configs[f"tree {fan}"] = {
                    "ddict.broadcast.branching-factor": fan,
                    "ddict.broadcast.tree-above": 1,
                }
            times: dict[str, list[float]] = {k: [] for k in configs}
            for conf in configs.values():  # warm: connections, forwarding links
                with dask.config.set(conf):
                    d.bput("tree", value)
            for _ in range(repeat):  # interleaved: each way sees the same machine
                for name, conf in configs.items():
                    with dask.config.set(conf):
                        start = time.perf_counter()
                        d.bput("tree", value)
                        times[name].append(time.perf_counter() - start)
            assert all(d.manager(m)["tree"] == value for m in (0, d.num_managers - 1))
            row: dict[str, float] = {"hosts": hosts, "managers": d.num_managers}
            row.update({k: statistics.median(v) * 1e3 for k, v in times.items()})
            return row
        finally:
            d.destroy()


def _fake_dictionary(dask_scheduler: Any, hosts: int, per_host: int) -> str:
    """Register a replicated dictionary of ``hosts * per_host`` managers on fake
    supervisors (each manager's replica on the next host): what renewals are checked
    against.  Its name."""
    from dask_ddict.cluster.replicas import Replica
    from dask_ddict.layout import Layout, ManagerInfo
    from dask_ddict.options import DDictOptions

    plugin = dask_scheduler.plugins["ddict"]

    def sup(h: int) -> str:
        return f"tcp://fake-{h}:1"

    managers = tuple(
        ManagerInfo(
            m,
            sup(m // per_host),
            f"h{m // per_host}",
            f"m{m // per_host}",
            1,
            f"/s{m // per_host}",
            "127.0.0.1",
            1,
            f"/d{m}",
            supervisor=sup(m // per_host),
        )
        for m in range(hosts * per_host)
    )
    layout = Layout("leases", "ab" * 16, "x", False, DDictOptions(replicas=1), managers, 1 << 30)
    plugin.dicts[layout.name] = layout
    placed = plugin.elastic.replicas.of(layout.name)
    for m in managers:
        h = (m.manager_id // per_host + 1) % hosts
        placed[m.manager_id] = [Replica(m.manager_id, sup(h), sup(h), f"m{h}", {})]
    return layout.name


def _drop_fake(dask_scheduler: Any, name: str) -> None:
    plugin = dask_scheduler.plugins["ddict"]
    plugin.dicts.pop(name, None)
    plugin.elastic.replicas.forget(name)
    for sup in [s for s in plugin.leases.held if s.startswith("tcp://fake-")]:
        plugin.leases.forget(sup)  # (no fake host is suspected once they stop)


def _cpu(dask_scheduler: Any) -> float:
    return time.process_time()


def _renewing(
    address: str, first: int, hosts: int, per_host: int, period: float, seconds: float
) -> list[float]:
    """In another process: hosts ``first .. first + hosts`` renew every ``period`` for
    ``seconds``, each on a connection of its own; the renewals' round trips (s)."""
    import asyncio
    import random

    from distributed.core import rpc

    async def host(h: int, trips: list[float], end: float) -> None:
        r = rpc(address)
        report = {
            "serving": [["ab" * 16, h * per_host + i, 0] for i in range(per_host)],
            "doubts": [],
            "aside": [],
        }
        await asyncio.sleep(random.random() * period)
        try:
            while time.monotonic() < end:
                t = time.perf_counter()
                said = await r.ddict_lease(supervisor=f"tcp://fake-{h}:1", report=report)
                trips.append(time.perf_counter() - t)
                assert said["lease"] > 0 and len(said["confirmed"]) == per_host, said
                await asyncio.sleep(period)
        finally:
            await r.close_rpc()

    async def run() -> list[float]:
        trips: list[float] = []
        end = time.monotonic() + seconds
        await asyncio.gather(*(host(h, trips, end) for h in range(first, first + hosts)))
        return trips

    return asyncio.run(run())


def measure_leases(
    client: Client,
    hosts: int,
    per_host: int,
    duration: float,
    seconds: float = 20.0,
    processes: int = 4,
) -> dict[str, float]:
    """The scheduler's CPU for ``hosts`` host processes' lease renewals (see ``--leases``)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    name = client.run_on_scheduler(_fake_dictionary, hosts=hosts, per_host=per_host)
    try:
        before = client.run_on_scheduler(_cpu)
        time.sleep(seconds)
        idle = client.run_on_scheduler(_cpu) - before
        ctx = multiprocessing.get_context("spawn")
        share = -(-hosts // processes)
        with ProcessPoolExecutor(processes, mp_context=ctx) as pool:
            futures = [
                pool.submit(
                    _renewing,
                    client.scheduler.address,
                    first,
                    min(share, hosts - first),
                    per_host,
                    duration / RENEW,
                    seconds,
                )
                for first in range(0, hosts, share)
            ]
            time.sleep(duration / RENEW + 1.0)  # (every host connected and renewing)
            before = client.run_on_scheduler(_cpu)
            time.sleep(seconds - duration / RENEW - 2.0)
            busy = client.run_on_scheduler(_cpu) - before
            trips = sorted(t for f in futures for t in f.result())
    finally:
        client.run_on_scheduler(_drop_fake, name=name)
    window = seconds - duration / RENEW - 2.0
    rate = len(trips) / (seconds - duration / RENEW / 2)  # (they begin within the first period)
    cpu = busy / window - idle / seconds
    return {
        "hosts": hosts,
        "managers": hosts * per_host,
        "duration": duration,
        "renewals_per_s": rate,
        "cpu_share": cpu,
        "us_per_renewal": 1e6 * cpu / rate,
        "p50_ms": 1e3 * trips[len(trips) // 2],
        "p99_ms": 1e3 * trips[int(len(trips) * 0.99)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--managers", default="8,128,512", help="comma-separated manager counts")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=11)
    ap.add_argument(
        "--clients",
        default="4x250",
        help="processes x clients per process, attaching at the largest count",
    )
    ap.add_argument(
        "--leases",
        default="1000x10",
        help="host processes x primaries each, renewing leases (0: none)",
    )
    ap.add_argument(
        "--lease-seconds", default="10,5", help="comma-separated lease durations to simulate"
    )
    ap.add_argument(
        "--tree", default="0", help="comma-separated host counts for bput tree vs linear (0: none)"
    )
    ap.add_argument("--tree-managers", type=int, default=256)
    ap.add_argument("--tree-bytes", type=int, default=1 << 20)
    ap.add_argument("--tree-fans", default="2,4", help="comma-separated branching factors")
    ap.add_argument("--tree-only", action="store_true", help="only the --tree rows")
    args = ap.parse_args()
    trees = [int(h) for h in args.tree.split(",") if int(h) > 0]
    fans = [int(f) for f in args.tree_fans.split(",")]
    tree_rows = [
        measure_tree(h, args.tree_managers, args.tree_bytes, fans, args.repeat) for h in trees
    ]
    for r in tree_rows:
        best = min(r[f"tree {f}"] for f in fans)
        print(
            f"bput of {args.tree_bytes} B to {r['managers']:.0f} managers on "
            f"{r['hosts']:.0f} host processes: linear {r['linear']:.1f} ms; "
            + ", ".join(
                f"tree (branching {f}) {r[f'tree {f}']:.1f} ms "
                f"({r[f'tree {f}'] / r['linear']:.2f}x)"
                for f in fans
            )
            + f"; best {best / r['linear']:.2f}x linear (median of {args.repeat})"
        )
    if args.tree_only:
        return
    counts = [int(n) for n in args.managers.split(",")]
    with (
        LocalCluster(n_workers=args.workers, threads_per_worker=1, dashboard_address=":0") as cl,
        Client(cl) as c,
    ):
        procs, per = (int(x) for x in args.clients.split("x"))
        rows = [measure(c, n, args.workers, args.repeat, max(counts), (procs, per)) for n in counts]
        per_holder = measure_holders(c, 10)
        hosts, primaries = (int(x) for x in args.leases.split("x"))
        leases = (
            [measure_leases(c, hosts, primaries, float(s)) for s in args.lease_seconds.split(",")]
            if hosts
            else []
        )
    base = rows[0]
    head = [
        "managers",
        "create s",
        "destroy s",
        "handle B",
        "registry B",
        "sched calls/ops",
        "attach calls/1000 tasks",
        "client fds",
        *[f"{b} ms (x)" for b in BROADCASTS],
    ]
    table = [
        [
            f"{r['managers']:.0f}",
            f"{r['create_s']:.2f}",
            f"{r['destroy_s']:.2f}",
            f"{r['handle_bytes']:.0f}",
            f"{r['registry_bytes']:.0f}",
            f"{r['scheduler_calls_ops']:.0f}",
            f"{r['attach_calls_1000_tasks']:.0f}",
            f"{r['fds']:.0f}",
            *[f"{r[b]:.2f} ({r[b] / base[b]:.1f}x)" for b in BROADCASTS],
        ]
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *table)]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-+-".join("-" * w for w in widths))
    for line in table:
        print(" | ".join(x.ljust(w) for x, w in zip(line, widths)))
    last = rows[-1]
    if "clients_clients" in last:
        print(
            f"\n{last['clients_clients']:.0f} clients from {last['clients_processes']:.0f} "
            f"processes attached from a pickled handle and put once each, "
            f"{last['managers']:.0f} managers: {last['clients_attach_put_ms']:.2f} ms per "
            f"client, {last['clients_wall_s']:.1f} s in all; layouts fetched "
            f"{last['clients_fetches']:.0f}, orchestrator calls "
            f"{last['clients_scheduler_calls']:.0f}, registry growth "
            f"{last['clients_registry_growth_bytes']:.0f} B; keys now {last['clients_keys']:.0f}"
        )
    print(
        f"\nOrchestrator memory: {last['registry_bytes'] / last['managers']:.0f} B per manager "
        f"in its dictionary's registry entry; {per_holder:.0f} B per Dask client holding a "
        "dictionary (from_name; 10 clients); 0 B per process or task using a pickled handle"
    )
    for r in leases:
        print(
            f"\nLease renewals of {r['hosts']:.0f} host processes ({r['managers']:.0f} "
            f"managers), a {r['duration']:g} s lease: {r['renewals_per_s']:.0f} renewals/s "
            f"cost the scheduler {100 * r['cpu_share']:.1f}% of a core "
            f"({r['us_per_renewal']:.0f} us each); round trip p50 {r['p50_ms']:.1f} ms, "
            f"p99 {r['p99_ms']:.1f} ms"
        )
    print(
        f"\n({args.workers} workers, python {sys.version.split()[0]}, {os.cpu_count()} cores, "
        f"median of {args.repeat})"
    )


if __name__ == "__main__":
    main()
