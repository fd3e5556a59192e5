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
