"""Persisting a 1 GiB checkpoint to zarr, next to ``dd`` writing 1 GiB to the same disk.

    python benchmarks/bench_persist.py [--gib 1] [--dir DIR]
    python benchmarks/bench_persist.py --restore [--gib 1]   # restores, also re-sharded

One manager holds 1 GiB (16 numpy arrays of 64 MiB) at checkpoint 0;
``d.persist(); d.sync()`` writes it to a zarr store in ``DIR`` (default: a
temp directory on the disk that holds ``$TMPDIR``).  ``dd`` writes the same
number of bytes to the same directory, once through the page cache (what the
persister does: no fsync) and once with ``conv=fdatasync``.  Rounds are
interleaved and each starts from a flushed page cache (``sync``), because a
disk's write speed depends on how much dirty data is already queued.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time

import dask
import numpy as np
from distributed import Client, LocalCluster

from dask_ddict import DDict


def warm_memory(nbytes: int) -> None:
    """Touch and free ``nbytes`` of memory, so the page cache gets warm pages.

    On VMs whose host backs guest memory lazily (and takes free memory back),
    a page the guest has not used lately costs a host fault: writes into the
    page cache then run at ~250 MB/s instead of GB/s, whichever program
    writes.  Warming before each timed write (persist and dd alike) measures
    the write path, not the hypervisor.
    """
    block = np.ones(nbytes // 8)
    del block


def dd(directory: str, nbytes: int, sync: bool) -> float:
    """MB/s of ``dd`` writing ``nbytes`` of zeros into ``directory``."""
    warm_memory(2 * nbytes)
    target = f"{directory}/dd.bin"
    cmd = ["dd", "if=/dev/zero", f"of={target}", "bs=64M", f"count={nbytes >> 26}"]
    if sync:
        cmd.append("conv=fdatasync")
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    elapsed = time.perf_counter() - t0
    subprocess.run(["rm", "-f", target], check=True)
    m = re.search(r"copied, ([0-9.]+) s", out.stderr)
    return nbytes / (float(m.group(1)) if m else elapsed) / 1e6


def persist_rate(client: Client, directory: str, nbytes: int) -> float:
    path = f"{directory}/store"
    d = DDict(
        total_mem=int(nbytes * 1.6) + (256 << 20), client=client, n_workers=1, persist_path=path
    )
    try:
        block = np.random.default_rng(0).random((64 << 20) // 8)
        d.start_batch_put()
        for i in range(nbytes >> 26):
            d[i] = block
        d.end_batch_put()
        d.sync()
        warm_memory(2 * nbytes)
        t0 = time.perf_counter()
        d.persist()
        d.sync()
        elapsed = time.perf_counter() - t0
        assert d.persisted_ids() == [0]
    finally:
        d.destroy()
        shutil.rmtree(path, ignore_errors=True)
    return nbytes / elapsed / 1e6


def restore_rates(client: Client, directory: str, nbytes: int) -> dict[str, float]:
    """MB/s of restoring a checkpoint persisted by 2 managers (one per worker): onto 2
    (each reads its own part) and onto 4 (re-sharded: each reads the keys it owns from
    both parts).  Timed from ``DDict(restore_from=0)`` until it returns (the store is in
    the page cache: this is the read path's speed, not the disk's)."""
    path = f"{directory}/restore"
    mem = int(nbytes * 1.6) + (256 << 20)
    d = DDict(total_mem=mem, client=client, name="bench-restore", persist_path=path)
    try:
        block = np.random.default_rng(0).random((16 << 20) // 8)
        d.update({i: block for i in range(nbytes >> 24)})
        d.persist()
        d.sync()
    finally:
        d.destroy()
    rates = {}
    try:
        for what, per_worker in (("restore_same", 1), ("restore_reshard", 2)):
            warm_memory(2 * nbytes)
            t0 = time.perf_counter()
            r = DDict(
                per_worker,
                total_mem=mem,
                client=client,
                name="bench-restore",
                persist_path=path,
                restore_from=0,
            )
            elapsed = time.perf_counter() - t0
            try:
                assert len(r) == nbytes >> 24 and r.num_managers == 2 * per_worker
            finally:
                r.destroy()
            rates[what] = nbytes / elapsed / 1e6
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument(
        "--restore",
        action="store_true",
        help="Only the restores: onto as many managers as persisted, and onto "
        "twice as many (re-sharded).",
    )
    args = ap.parse_args()
    if args.restore:
        restore_only(args)
        return
    nbytes = int(args.gib * (1 << 30)) >> 26 << 26
    directory = tempfile.mkdtemp(prefix="ddict-bench-persist-", dir=args.dir)
    results: dict[str, list[float]] = {k: [] for k in ("persist", "dd", "persist_fsync", "dd_sync")}
    try:
        for fsync in (False, True):
            # Workers take the configuration they start with.
            with (
                dask.config.set({"ddict.persist.fsync": fsync}),
                LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cl,
                Client(cl) as c,
            ):
                mine, theirs = ("persist_fsync", "dd_sync") if fsync else ("persist", "dd")
                for r in range(args.rounds):
                    # Interleaved, each from a flushed page cache: a disk's write speed
                    # depends on how much dirty data is already waiting.
                    for what in (mine, theirs) if r % 2 == 0 else (theirs, mine):
                        os.sync()
                        time.sleep(1.0)  # let the disk settle (deleted files, journal)
                        if what == mine:
                            results[what].append(persist_rate(c, directory, nbytes))
                        else:
                            results[what].append(dd(directory, nbytes, fsync))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    gib = nbytes / (1 << 30)
    print(f"{'operation':44} | {'MB/s':>8} | {'dd MB/s':>8} | ratio")
    print(
        f"{f'persist {gib:.2f} GiB checkpoint to zarr':44} | {med['persist']:8,.0f} | "
        f"{med['dd']:8,.0f} | {med['persist'] / med['dd']:.2f}x  (dd through the page cache)"
    )
    print(
        f"{f'persist {gib:.2f} GiB, fsync before commit':44} | {med['persist_fsync']:8,.0f} | "
        f"{med['dd_sync']:8,.0f} | {med['persist_fsync'] / med['dd_sync']:.2f}x  "
        "(dd conv=fdatasync)"
    )
    for k, v in results.items():
        print(f"  {k}: " + ", ".join(f"{x:,.0f}" for x in v))
    print(f"(medians of {args.rounds} interleaved rounds, same directory)")


def restore_only(args: argparse.Namespace) -> None:
    nbytes = int(args.gib * (1 << 30)) >> 24 << 24
    directory = tempfile.mkdtemp(prefix="ddict-bench-restore-", dir=args.dir)
    results: dict[str, list[float]] = {"restore_same": [], "restore_reshard": []}
    try:
        with (
            LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cl,
            Client(cl) as c,
        ):
            for _ in range(args.rounds):
                for k, v in restore_rates(c, directory, nbytes).items():
                    results[k].append(v)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    gib = nbytes / (1 << 30)
    for k, v in results.items():
        print(
            f"{k} {gib:.2f} GiB: median {statistics.median(v):,.0f} MB/s  ("
            + ", ".join(f"{x:,.0f}" for x in v)
            + ")"
        )


if __name__ == "__main__":
    main()
