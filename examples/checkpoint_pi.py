"""Estimate pi with clients that synchronize through DDict checkpoints (Dragon's π demo).

    python examples/checkpoint_pi.py [--clients 8] [--iterations 6] [--store DIR]

Every client is a Dask task.  At each checkpoint it throws random points at the
unit square, writes its running hit ratio into its checkpoint, reads every other
client's ratio *at the same checkpoint* and moves to the next checkpoint.  The
dictionary has ``working_set_size=4`` and ``wait_for_keys=True``: a read of a
ratio that is not written yet blocks until its writer gets there, and a fast
client cannot run more than a few checkpoints ahead of the slowest, because the
oldest checkpoint retires only once every client has re-written its key.  So
the clients stay in step with no barrier and no scheduler in the loop.

Retiring checkpoints are persisted to a zarr store.  The second phase plays a
restart: a *new* dictionary restores the newest persisted checkpoint
(``restore_from``) and the clients carry on from the running counts they kept
there (``pput``: persistent keys survive retirement), so the estimate keeps
converging instead of starting over.

Which checkpoints end up in the store, e.g. ``[0, 1, 5]`` after the 6 checkpoints
0..5 of phase 1:

* ``persist_freq=1`` persists a checkpoint *when it retires*, i.e. when the window
  of the newest ``working_set_size=4`` checkpoints moves past it.  Writing
  checkpoint 5 moves the window to [2, 5], so 0 and 1 retired and were persisted;
* 2, 3 and 4 are still in the window: they never retired, so nothing persisted
  them (and nothing needs them: the restart starts from the newest);
* 5, the newest, would retire only once a later checkpoint is written.  The
  restart needs it, so ``d.persist()`` writes it explicitly before the dictionary
  is destroyed.  ``persist_count=-1`` keeps every persisted id.

Without ``--scheduler`` it runs on an embedded local cluster.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import numpy as np
from distributed import Client, LocalCluster, rejoin, secede

from dask_ddict import DDict


def simulate(
    d: DDict, cid: int, n_clients: int, start: int, iterations: int, points: int
) -> list[float]:
    """One client: ``iterations`` checkpoints from ``start``; returns its estimates."""
    secede()  # a long, blocking task: give the worker its thread back
    try:
        d.checkpoint_id = start
        rng = np.random.default_rng([cid, start])
        key = ("counts", cid)
        # `in` never blocks (a read of a missing key would wait for its writer).
        hits, total = d[key] if key in d else (0, 0)  # carried over a restore
        estimates = []
        for _ in range(iterations):
            xy = rng.random((points, 2))
            hits += int(np.count_nonzero((xy * xy).sum(axis=1) <= 1.0))
            total += points
            d.pput(key, (hits, total))  # persistent: survives retirement
            d[("ratio", cid)] = hits / total  # non-persistent: re-written at each checkpoint
            ratios = [d[("ratio", j)] for j in range(n_clients)]  # blocks until all wrote
            estimates.append(4.0 * float(np.mean(ratios)))
            d.checkpoint()
        return estimates
    finally:
        rejoin()


def run_phase(client: Client, d: DDict, args: argparse.Namespace, start: int) -> float:
    t0 = time.perf_counter()
    futures = [
        client.submit(
            simulate, d, cid, args.clients, start, args.iterations, args.points, pure=False
        )
        for cid in range(args.clients)
    ]
    results = client.gather(futures)
    for step in range(args.iterations):
        ests = {round(r[step], 12) for r in results}
        assert len(ests) == 1, "clients at one checkpoint must see the same ratios"
        print(f"  checkpoint {start + step:3d}: pi ~ {results[0][step]:.6f}")
    print(
        f"  {args.clients} clients x {args.iterations} checkpoints in "
        f"{time.perf_counter() - t0:.2f} s"
    )
    return results[0][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=6, help="checkpoints per phase")
    ap.add_argument("--points", type=int, default=200_000, help="points per client per checkpoint")
    ap.add_argument("--store", default=None, help="zarr store (default: a temporary directory)")
    ap.add_argument("--scheduler", default=None, help="address of an existing cluster")
    args = ap.parse_args()

    store = args.store or tempfile.mkdtemp(prefix="ddict-pi-") + "/checkpoints.zarr"
    opts = dict(
        working_set_size=4,
        wait_for_keys=True,
        persist_freq=1,
        persist_count=-1,
        persist_path=store,
        name="pi",
        timeout=120,
    )
    cluster = None
    if args.scheduler:
        client = Client(args.scheduler)
    else:
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0")
        client = Client(cluster)
    try:
        print(f"phase 1: {args.clients} clients, checkpoints persisted to {store}")
        d = DDict(total_mem="64 MiB", client=client, **opts)
        run_phase(client, d, args, start=0)
        d.checkpoint_id = args.iterations - 1
        d.persist()  # the newest checkpoint too (retiring ones are persisted already)
        d.sync()
        saved = d.persisted_ids()
        newest = saved[-1]
        retired = [k for k in saved if k <= newest - opts["working_set_size"]]
        print(
            f"  persisted checkpoints: {saved}: {retired or 'none'} retired from the window "
            f"of the newest {opts['working_set_size']} (persist_freq=1), {newest} by "
            "d.persist() (the newest, for the restart); the others are still in the window"
        )
        d.destroy()  # the dictionary is gone; the zarr store stays

        print(f"phase 2: a new dictionary restored from checkpoint {newest}")
        d = DDict(total_mem="64 MiB", client=client, restore_from=newest, **opts)
        hits = [d[("counts", c)] for c in range(args.clients)]
        print(f"  restored {sum(h for h, _ in hits):,} hits of {sum(t for _, t in hits):,} points")
        estimate = run_phase(client, d, args, start=newest + 1)
        d.destroy()
        print(f"pi ~ {estimate:.6f} (error {abs(estimate - np.pi):.2e})")
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
        if args.store is None:
            shutil.rmtree(store.rsplit("/", 1)[0], ignore_errors=True)


if __name__ == "__main__":
    main()
