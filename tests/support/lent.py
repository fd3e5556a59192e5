"""Whether an array a read returned is the shard's own pages (lent), not a copy, and
how many pages of a mapping this process has resident.

Zero-copy reads on the manager's host map the shard's file; tests check that a view
is such a mapping by asking which file its memory belongs to, and what a read touched
by this process's resident pages of the shard's map (``/proc/self/smaps``).
"""

from __future__ import annotations

import numpy as np

from dask_ddict import DDict, _memory


def in_shard(d: DDict, key: object, arr: np.ndarray) -> bool:
    """Whether ``arr``'s memory is a mapping of ``key``'s shard (its lent pages, not a
    private copy of them)."""
    store = d._core.layout.managers[d.which_manager(key)].store_path
    span = _memory.file_span(arr.__array_interface__["data"][0])
    return span is not None and span[3] == store + "/data.mdb"


def resident_kib(lo: int, hi: int) -> int:
    """This process's resident KiB (``smaps``' Rss) of its mappings in ``[lo, hi)``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # (a mapping's first line: lo-hi perms ...)
                a, b = (int(x, 16) for x in head[0].split("-"))
                inside = a < hi and lo < b
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total
