"""Dragon's DDict on the same operations as bench_ddict.py (run under Dragon's launcher).

    dragon benchmarks/bench_dragon.py [seconds]

Prints one JSON line: sequential put/get of 100 B values (ops/s) and batch put
(ops/s) from one client, on a 2-manager DDict of 256 MiB, as
``bench_ddict.py`` does for ``dask_ddict``.  ``bench_ddict.py`` runs it when a
``dragon`` launcher is found (``DDICT_BENCH_DRAGON`` or the PATH).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time

import dragon  # noqa: F401  (installs Dragon's multiprocessing start method)
from dragon.data.ddict import DDict


def rate(fn, seconds: float) -> float:
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 3:
        fn(n)
        n += 1
    return n / (time.perf_counter() - t0)


def batch(d, v, seconds: float) -> float:
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or n == 0:
        d.start_batch_put()
        for i in range(1000):
            d[i] = v
        d.end_batch_put()
        n += 1000
    return n / (time.perf_counter() - t0)


if __name__ == "__main__":
    mp.set_start_method("dragon")
    secs = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    d = DDict(2, 1, 256 * 1024 * 1024)
    v = b"x" * 100
    for i in range(100):
        d[i] = v
    out = {
        "put 100 B": rate(lambda n: d.__setitem__(n % 100, v), secs),
        "get 100 B": rate(lambda n: d[n % 100], secs),
        "batch put 100 B": batch(d, v, secs),
    }
    print(json.dumps(out), flush=True)
    d.destroy()
