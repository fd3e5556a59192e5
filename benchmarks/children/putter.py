"""A client process of ``bench_moves.py``'s latency rows (not the LocalCluster's
scheduler's, which runs the moves).

``putter.py <serialized handle> <manager>``: attaches, puts 100 B values to one manager
until a line on stdin gives the windows (JSON: ``"base" [a, b]``, ``"spans" [[a, b],
...]``, ``time.monotonic``), then prints the latencies of the puts that started in them.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from dask_ddict import DDict


def main(handle: str, manager: int) -> None:
    d = DDict.attach(handle, timeout=60)
    m = d.manager(manager)
    v = b"x" * 100
    for i in range(1000):
        m[("small", i)] = v
    windows: list[Any] = []
    threading.Thread(
        target=lambda: windows.append(json.loads(sys.stdin.readline())), daemon=True
    ).start()
    print("ready", flush=True)
    lat: list[tuple[float, float]] = []
    i = 0
    while not windows:
        t0 = time.monotonic()
        m[("small", i % 1000)] = v
        lat.append((t0, time.monotonic() - t0))
        i += 1
    w = windows[0]
    a, b = w["base"]
    print(
        json.dumps(
            {
                "without": [s for t, s in lat if a <= t <= b],
                "during": [[s for t, s in lat if x <= t <= y] for x, y in w["spans"]],
            }
        )
    )
    d.detach()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
