"""DDictStore next to zarr's LocalStore on /dev/shm: a dask array written and read from tasks.

    python benchmarks/bench_zarr_store.py [--quick] [--gib 2] [--chunk-mib 32] [--rounds 3]

A float64 dask array of ``--gib`` GiB (default 2; ``--quick``: 0.25 GiB, one
round) is computed and persisted on a LocalCluster of 2 worker processes
(one thread each), then, from tasks on both workers:

* ``write``: ``x.to_zarr(store, component=...)``: each task writes the chunk
  it holds;
* ``read``: ``da.from_zarr(store, ...)`` persisted on the workers (each task
  reads one chunk into worker memory).

``store`` is a :class:`~dask_ddict.DDictStore` over a DDict whose two managers
sit beside the two workers, and zarr's ``LocalStore`` in a fresh directory on
``/dev/shm`` (the same memory the shards live in), in the same run, rounds
interleaved; chunks are not compressed (``compressors=None``) so that the
store, not the codec, is timed.  An untimed round on a small array warms both
up (imports and first connections in the workers).  Each round starts empty (a new dictionary, a
new directory; untimed), and the /dev/shm directory is removed at the end.  The table
gives the best GB/s of the rounds (on a shared 2-core machine other work only
slows a round down) and the ratio DDictStore / LocalStore (targets: reads
>= 1.0, writes >= 0.8); every round's figure follows.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable

import dask.array as da
import zarr
from distributed import Client, LocalCluster, wait
from zarr.storage import LocalStore

from dask_ddict import DDict, DDictStore

TARGETS = {"write": 0.8, "read": 1.0}


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def one_round(
    client: Client, x: da.Array, store: zarr.abc.store.Store, name: str
) -> tuple[float, float]:
    """Seconds to write ``x`` to ``store`` from tasks, then to read it back into the workers."""
    t_write = timed(lambda: x.to_zarr(store, component=name, compressors=None))

    held = []

    def read() -> None:
        held.append(client.persist(da.from_zarr(store, component=name)))
        wait(held[-1])

    t_read = timed(read)
    held.clear()  # (released untimed)
    return t_write, t_read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="0.25 GiB, one round")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--chunk-mib", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    gib, rounds = (0.25, 1) if args.quick else (args.gib, args.rounds)
    chunk = args.chunk_mib << 20 >> 3  # float64 items per chunk
    n = (int(gib * (1 << 30)) >> 3) // chunk * chunk
    nbytes = n * 8
    shm = tempfile.mkdtemp(prefix="ddict-bench-localstore-", dir="/dev/shm")
    times: dict[tuple[str, str], list[float]] = {}
    try:
        with (
            LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cl,
            Client(cl) as client,
        ):
            x = client.persist(da.random.default_rng(0).random(n, chunks=chunk))
            wait(x)
            # Untimed warm-up of both stores (imports, first connections in the workers).
            small = x[: 4 * (1 << 17)].rechunk(1 << 17)
            d = DDict(total_mem="64 MiB", client=client)
            one_round(client, small, DDictStore(d), "warm")
            d.destroy()
            one_round(client, small, LocalStore(shm), "warm")
            shutil.rmtree(f"{shm}/warm")
            for r in range(rounds):
                for label in ("DDictStore", "LocalStore")[:: 1 if r % 2 == 0 else -1]:
                    # Each round starts empty: a new dictionary, a new directory.
                    if label == "DDictStore":
                        d = DDict(total_mem=int(nbytes * 1.25) + (256 << 20), client=client)
                        w, rd = one_round(client, x, DDictStore(d), "x")
                        d.destroy()
                    else:
                        w, rd = one_round(client, x, LocalStore(shm), f"x{r}")
                        shutil.rmtree(f"{shm}/x{r}")
                    times.setdefault((label, "write"), []).append(w)
                    times.setdefault((label, "read"), []).append(rd)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    gb = nbytes / 1e9
    print(
        f"array: {nbytes / (1 << 30):.2f} GiB float64, {n // chunk} chunks of "
        f"{args.chunk_mib} MiB, 2 workers x 1 thread, uncompressed, {rounds} round(s)"
    )
    print(
        f"{'operation':8} | {'DDictStore GB/s':>15} | {'LocalStore /dev/shm GB/s':>24} | "
        f"{'ratio':>6} | target"
    )
    for op in ("write", "read"):
        ours = gb / min(times[("DDictStore", op)])
        theirs = gb / min(times[("LocalStore", op)])
        ratio = ours / theirs
        verdict = "met" if ratio >= TARGETS[op] else "MISSED"
        print(
            f"{op:8} | {ours:15.2f} | {theirs:24.2f} | {ratio:5.2f}x | >= {TARGETS[op]}x {verdict}"
        )
    for (label, op), ts in sorted(times.items()):
        print(f"  {label} {op}: " + ", ".join(f"{gb / t:.2f}" for t in ts) + " GB/s")


if __name__ == "__main__":
    main()
