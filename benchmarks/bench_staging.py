"""Staging a zarr store into a DDict next to copying it with dask.array.

    python benchmarks/bench_staging.py [--quick] [--gib 2] [--chunk-mib 8] [--rounds 3]

A float32 zarr store of ``--gib`` GiB (default 2; ``--quick``: 0.25 GiB, one round),
zarr's default codecs (zstd: the chunks compress a little, as real data does), in a
fresh directory on the local disk, is loaded into a DDict whose managers sit beside
the 2 workers of a LocalCluster (one thread each), two ways, rounds interleaved, each
into a new dictionary (untimed):

* ``copy``: ``da.from_zarr(src).to_zarr(DDictStore(d))``, the way a Dask user copies
  a store (every chunk decoded and encoded again);
* ``stage``: ``dask_ddict.stage(src, d).wait()`` (objects copied as they are).

Both end with every chunk in the dictionary; the source's pages are in the page cache
after the first (untimed) pass, so the disk is not what is timed.  The table gives the
best GB/s (of the source's array bytes) of the rounds and the ratio stage / copy
(target >= 0.8); every round's figure follows.  A sample of chunks read through both
stores is compared with the source.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import dask.array as da
import numpy as np
import zarr
from distributed import Client, LocalCluster

from dask_ddict import DDict, DDictStore, stage

TARGET = 0.8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="0.25 GiB, one round")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    gib, rounds = (0.25, 1) if args.quick else (args.gib, args.rounds)
    side = args.chunk_mib << 20 >> 2  # float32 items per chunk
    n = (int(gib * (1 << 30)) >> 2) // side * side
    nbytes = n * 4
    src = tempfile.mkdtemp(prefix="ddict-bench-staging-")
    times: dict[str, list[float]] = {"copy": [], "stage": []}
    try:
        with (
            LocalCluster(
                n_workers=2, threads_per_worker=1, dashboard_address=":0", memory_limit="4 GiB"
            ) as cl,
            Client(cl) as client,
        ):
            x = da.random.default_rng(0).random(n, chunks=side, dtype="f4")
            x.to_zarr(src, component="x")
            sample = zarr.open_array(src, path="x", mode="r")[: side * 2]
            mem = f"{int(1.6 * nbytes / (1 << 20)) + 256} MiB"  # (each manager: its half, and room)

            def fresh() -> DDict:
                return DDict(1, total_mem=mem, client=client, timeout=600)

            def copy(d: DDict) -> DDictStore:
                store = DDictStore(d)
                da.from_zarr(src, component="x").to_zarr(store, component="x")
                return store

            def staged(d: DDict) -> DDictStore:
                store = stage(src, d)
                store.wait()
                return store

            for fn in (copy, staged):  # warm-up: the page cache too
                d = fresh()
                fn(d)
                d.destroy()
            for _ in range(rounds):
                for name, fn in [("copy", copy), ("stage", staged)]:
                    d = fresh()
                    t0 = time.perf_counter()
                    store = fn(d)
                    times[name].append(time.perf_counter() - t0)
                    got = zarr.open_array(store, path="x", mode="r")[: side * 2]
                    np.testing.assert_array_equal(got, sample)
                    d.destroy()
    finally:
        shutil.rmtree(src, ignore_errors=True)
    best = {k: nbytes / min(v) / 1e9 for k, v in times.items()}
    ratio = best["stage"] / best["copy"]
    print(
        f"{gib:g} GiB float32, {args.chunk_mib} MiB chunks, 2 workers x 1 thread, best of {rounds}"
    )
    print(f"{'copy (from_zarr.to_zarr)':28} {best['copy']:6.2f} GB/s")
    print(f"{'stage':28} {best['stage']:6.2f} GB/s")
    verdict = "met" if ratio >= TARGET else "MISSED"
    print(f"stage / copy: {ratio:.2f} (target >= {TARGET}: {verdict})")
    for k, v in times.items():
        print(f"  {k}: " + ", ".join(f"{nbytes / t / 1e9:.2f}" for t in v) + " GB/s")


if __name__ == "__main__":
    main()
