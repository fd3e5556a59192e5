"""Handles of a dictionary that reach its managers a particular way.

On the managers' host a handle reads the shard itself; a test of the host processes'
serving loop (or of what it counts) needs a handle whose every request goes there over
TCP, as a client on another host would.
"""

from __future__ import annotations

import dask

from dask_ddict import DDict


def over_tcp(d: DDict) -> DDict:
    """A handle that reaches every manager of ``d`` over TCP, already connected."""
    with dask.config.set({"ddict.local-transport": False}):
        h = DDict.attach(d.serialize(), timeout=d.timeout)
        for m in range(h.num_managers):
            h._core.channel(m)
    return h
