"""Whether an array a read returned is the shard's own pages (lent), not a copy.

Zero-copy reads on the manager's host map the shard's file; tests check that a view
is such a mapping by asking which file its memory belongs to.
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
