"""What a dictionary leaves on this host: its shard directories and /dev/shm entries.

Tests check that a dictionary cleans up after itself, and look only at the files it
made (other tests' dictionaries may be alive in the same session).
"""

from __future__ import annotations

import glob
from typing import Any


def shm_entries() -> set[str]:
    """Every dictionary's entry in /dev/shm on this host."""
    return set(glob.glob("/dev/shm/ddict-*"))


def shards(d: Any) -> set[str]:
    """The shard directories of a DDict ``d``."""
    return {m.store_path for m in d._core.layout.managers}


def snapshots(env: Any) -> list[tuple[int, int]]:
    """``(pid, transaction id)`` of each of an LMDB environment's reader slots that holds
    a snapshot (LMDB's reader table), sorted: a slot kept for a process's next snapshot
    (py-lmdb's spare transaction, reset) holds none."""
    rows = [line.split() for line in env.readers().splitlines()[1:]]
    return sorted((int(row[0]), int(row[2])) for row in rows if len(row) == 3 and row[2] != "-")


def slots_of(env: Any, pid: int) -> int:
    """How many of an LMDB environment's reader slots process ``pid`` holds (with a
    snapshot or kept for its next one)."""
    rows = [line.split() for line in env.readers().splitlines()[1:]]
    return sum(1 for row in rows if row and row[0] == str(pid))
