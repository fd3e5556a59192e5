"""Computing beside the data: one command, one table, ratios to a plain scan in the same run.

    python benchmarks/bench_compute.py [--quick]

Puts 1 GiB of values (1 MiB float64 arrays; 128 MiB with ``--quick``) into a
dictionary of 16 managers on a 2-worker LocalCluster (worker processes, one
thread each), then sums every value three ways:

* ``local scan (reference)``: two plain processes (one per worker, no Dask),
  each attached with ``DDict.attach`` and scanning the same managers as that
  worker hosts, ``sum(v.sum() for v in dd.values())`` per manager: the
  fastest a parallel scan of every shard on this machine gets.
* ``filter``: ``d.filter(code)``, ``code`` putting ``v.sum()`` of each value
  (one small result per value, merged up the tree to this process).
* ``to_bag().map().sum()``: ``d.to_bag("values").map(np.sum).sum().compute()``.

Each cell is the best of a few runs after a warm-up.  Beside the time and its
ratio to the reference (target <= 1.5), the table reports the bytes that
crossed a socket during the run:

* ``DDict sockets``: bytes every process (this one and the workers) received
  from a manager's host process over a socket (Unix or TCP): values read
  without the shard's shared memory (target: 0; counted by wrapping the key
  path's connection reads in each process, for this benchmark only);
* ``Dask transfers``: bytes the workers fetched from one another (a partition
  read on one worker and used on another would count here);
* ``results``: what reached this process (per run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

import numpy as np
from common import print_aligned  # beside this script (sys.path[0])
from distributed import Client, LocalCluster

from dask_ddict import DDict

VALUE = 1 << 20
MANAGERS = 16
RESULTS = {
    "local scan (reference)": "2 floats",
    "filter": "{n} floats, streamed",
    "to_bag().map().sum()": "1 float",
}


# -- counting bytes that crossed a socket (installed in every process) ----------------------


def count_socket_bytes() -> None:
    """Wrap the key path's connection reads to count what arrives over sockets.

    (The count lives on the wrapped class: these functions travel to the
    workers by value, with copies of this module's globals.)
    """
    from dask_ddict.transport import bounded_connection, socket_client

    conn: Any = bounded_connection.BoundedConnection
    if "_bench_received" in vars(conn):
        return
    conn._bench_received = count = [0]
    recv_into, recv, reply = conn.recv_into, conn.recv, socket_client.receive_reply

    def counted_recv_into(self: Any, buf: Any, n: int = 0) -> int:
        k = recv_into(self, buf, n)
        count[0] += k
        return k

    def counted_recv(self: Any, n: int) -> bytes:
        data = recv(self, n)
        count[0] += len(data)
        return data

    def counted_reply(sock: Any, buf: Any, got: int, *args: Any) -> Any:
        answer = reply(sock, buf, got, *args)  # (a small reply, received in the link)
        count[0] += answer[-1] - got
        return answer

    conn.recv_into, conn.recv = counted_recv_into, counted_recv
    socket_client.receive_reply = counted_reply


def received() -> int:
    from dask_ddict.transport.bounded_connection import BoundedConnection

    return int(vars(BoundedConnection).get("_bench_received", [0])[0])


def transfers(dask_worker: Any) -> int:
    return int(sum(e.get("total", 0) for e in dask_worker.transfer_incoming_log))


def socket_bytes(c: Client) -> tuple[int, int]:
    """(DDict socket bytes of all processes, Dask transfer bytes of the workers)."""
    return received() + sum(c.run(received).values()), sum(c.run(transfers).values())


# -- the three scans -------------------------------------------------------------------------


def scan_managers(serialized: str, mids: list[int]) -> float:
    """The reference: a plain process scanning its managers, no Dask."""
    count_socket_bytes()
    d = DDict.attach(serialized)
    total = 0.0
    for m in mids:
        total += sum(float(v.sum()) for v in d.manager(m).values())
    d.detach()
    return total


def sums(dd: DDict, out: Any) -> None:
    for v in dd.values():
        out.put(float(v.sum()))


def best(call: Callable[[], float], reps: int) -> tuple[float, float]:
    """(best seconds, the result) of ``reps`` runs of ``call`` after one warm-up."""
    result = call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        got = call()
        times.append(time.perf_counter() - t0)
        assert abs(got - result) <= 1e-6 * abs(result), (got, result)
    return min(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="128 MiB instead of 1 GiB, fewer runs")
    args = ap.parse_args()
    total = (128 << 20) if args.quick else (1 << 30)
    reps = 2 if args.quick else 3
    n_values = total // VALUE
    rows: list[tuple[str, str, str, str, str, str]] = []
    count_socket_bytes()
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cl,
        Client(cl) as c,
    ):
        c.run(count_socket_bytes)
        d = DDict(
            managers_per_worker=MANAGERS // 2,
            total_mem=int(total * (3 if args.quick else 2)),
            client=c,
        )
        try:
            rng = np.random.default_rng(0)
            for i in range(0, n_values, 64):
                d.update({f"v{j}": rng.random(VALUE // 8) for j in range(i, min(n_values, i + 64))})
            by_worker: dict[str, list[int]] = {}
            for m, w in enumerate(d.manager_workers):
                by_worker.setdefault(w, []).append(m)
            s = d.serialize()
            with ProcessPoolExecutor(len(by_worker), mp_context=get_context("spawn")) as pool:

                def local() -> float:
                    return sum(pool.map(scan_managers, [s] * len(by_worker), by_worker.values()))

                def filtered() -> float:
                    with d.filter(sums) as results:
                        return sum(results)

                def bag() -> float:
                    return float(d.to_bag("values").map(np.sum).sum().compute())

                ref = None
                for name, call in (
                    ("local scan (reference)", local),
                    ("filter", filtered),
                    ("to_bag().map().sum()", bag),
                ):
                    before = socket_bytes(c)
                    secs, _ = best(call, reps)
                    after = socket_bytes(c)
                    ref = ref or secs
                    rows.append(
                        (
                            name,
                            f"{secs:.3f} s",
                            f"{secs / ref:.2f}x",
                            f"{after[0] - before[0]:,} B",
                            f"{after[1] - before[1]:,} B",
                            RESULTS[name].format(n=n_values),
                        )
                    )
        finally:
            d.destroy()
    head = (
        "operation",
        "time (best)",
        "vs local scan",
        "DDict sockets",
        "Dask transfers",
        "results",
    )
    print(f"{total >> 20} MiB of {VALUE >> 10} KiB values in {MANAGERS} managers, 2 workers")
    print_aligned(head, rows)
    print(
        "\n(targets: filter and to_bag at most 1.5x the local scan, 0 B over DDict sockets "
        "and Dask transfers)"
    )
    print(
        f"(python {sys.version.split()[0]}, {os.cpu_count()} cores, best of {reps} after a "
        "warm-up; bytes over all runs of a row)"
    )


if __name__ == "__main__":
    main()
