"""Export and import a block-distributed array as DAP, with and without moving data.

    python benchmarks/bench_dap.py [--gib 4] [--workers 2]

A float64 array of ``--gib`` GiB, 8 row blocks, persisted on a LocalCluster of
worker processes.  Four timings:

* export, data moves: ``to_dap(x)`` (every buffer comes to this process);
* import, data moves: ``from_dap(parts)`` and persisting it back on the cluster;
* export in place: ``to_dap_futures(x)`` (each rank's dict built where its block is);
* import in place: ``from_dap(futures)`` (metadata only) and persisting it
  (each chunk sliced on the worker that holds it).
"""

from __future__ import annotations

import argparse
import time

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster, wait

from dask_dap import from_dap, to_dap, to_dap_futures


def timed(fn):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    cols = 1 << 14
    rows = int(args.gib * (1 << 30) / 8 / cols) // 8 * 8
    nbytes = rows * cols * 8
    with (
        LocalCluster(
            n_workers=args.workers, threads_per_worker=1, dashboard_address=":0", memory_limit=0
        ) as cl,
        Client(cl) as client,
    ):
        x = client.persist(da.random.default_rng(0).random((rows, cols), chunks=(rows // 8, cols)))
        wait(x)
        total = float(x.sum().compute())

        parts, t_export = timed(lambda: to_dap(x))

        def import_moving(parts=parts):  # type: ignore[no-untyped-def]
            wait(client.persist(from_dap(parts)))

        _, t_import = timed(import_moving)
        del parts, import_moving

        def export_inplace():  # type: ignore[no-untyped-def]
            futures = to_dap_futures(x, client)
            wait(futures)
            return futures

        def import_inplace():  # type: ignore[no-untyped-def]
            z = client.persist(from_dap(futs))
            wait(z)
            return z

        futs, t_export_inplace = timed(export_inplace)
        z, t_import_inplace = timed(import_inplace)
        assert np.isclose(float(z.sum().compute()), total)

    gb = nbytes / 1e9
    print(f"array: {nbytes / (1 << 30):.2f} GiB float64, 8 blocks, {args.workers} workers")
    print(f"{'step':34} | {'seconds':>8} | GB/s")
    for label, t in (
        ("export to_dap (data to client)", t_export),
        ("import from_dap + persist (moves)", t_import),
        ("export to_dap_futures (in place)", t_export_inplace),
        ("import from futures + persist", t_import_inplace),
    ):
        print(f"{label:34} | {t:8.2f} | {gb / t:6.2f}")


if __name__ == "__main__":
    main()
