"""Zero-copy reads against copies, by value: what lending a value costs on the manager's host.

    python benchmarks/bench_lending.py [--quick] [--seconds 1.0]

A 1-worker LocalCluster (worker processes) and a DDict of one manager; from the client
(on the manager's host), for each kind of value:

* ``get_many``: keys/s of ``d.get_many(keys)`` (copies) and of
  ``d.get_many(keys, copy=False)`` (lends what is worth lending: arrays of a page or
  more, raw bytes of 64 KiB or more; copies the rest in the same walk of the shard);
* ``get``: the same for single ``d.get(key, copy=...)`` calls;

and the ratio of lending to copying.  A lent value costs a mapping of its own (an
``mmap``, the first touch of its page, an ``munmap``), so it pays once a copy costs more:
from about 64 KiB here.  No target: the table says where lending starts to pay.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from common import items_per_second, print_aligned, python_build, timed_cells
from distributed import Client, LocalCluster

from dask_ddict import DDict

#: The values read, and how many keys of each (about 64 MiB at most, for the larger ones).
VALUES: dict[str, tuple[Any, int]] = {
    "100 B bytes": (b"x" * 100, 1000),
    "100 B array": (np.ones(12), 1000),
    "8 KiB array": (np.ones(1 << 10), 1000),
    "64 KiB array": (np.ones(1 << 13), 500),
    "1 MiB array": (np.ones(1 << 17), 50),
}


def rows_for(d: DDict, label: str, value: Any, nkeys: int, seconds: float) -> list[tuple[str, ...]]:
    keys = [f"{label}-{i}" for i in range(nkeys)]
    d.update({k: value for k in keys})
    try:
        rows = []
        for what, read in (
            ("get_many", lambda copy: (lambda: d.get_many(keys, copy=copy), nkeys)),
            ("get", lambda copy: (lambda: [d.get(k, copy=copy) for k in keys], nkeys)),
        ):
            copied = items_per_second(*read(True), seconds)
            lent = items_per_second(*read(False), seconds)
            rows.append(
                (f"{what} {label}", f"{copied:,.0f}/s", f"{lent:,.0f}/s", f"{lent / copied:.2f}x")
            )
        return rows
    finally:
        d.clear()


def main() -> None:
    _, seconds = timed_cells(__doc__)
    rows: list[tuple[str, ...]] = []
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cl,
        Client(cl) as c,
        DDict(total_mem="1 GiB", client=c, n_workers=1) as d,
    ):
        for label, (value, nkeys) in VALUES.items():
            rows += rows_for(d, label, value, nkeys, seconds)
    print_aligned(("read (same host)", "copy=True", "copy=False", "lent / copied"), rows)
    print(f"\n({python_build()}, {os.cpu_count()} cores, {seconds:.1f} s per cell)")


if __name__ == "__main__":
    main()
