"""Typed use of the public API: ``tests/test_typing.py`` runs mypy on this file.

Not a test module (no ``test_`` prefix): it is only type-checked, never run.
"""

from __future__ import annotations

import numpy as np
from distributed import Client

from dask_ddict import AsyncDDict, DDict, DDictManagerStats


def sync_use(client: Client) -> int:
    d = DDict(total_mem="64 MiB", client=client, timeout="10s", lifetime="cluster")
    d["x"] = np.arange(3)
    n: int = d.fetch_add("n", 1)
    stats: list[DDictManagerStats] = d.stats
    names: list[str] = DDict.list(client)
    view = d.get("x", copy=False)
    values: list[object] = d.get_many(["x", "n"], default=None, copy=False)
    pinned: int = stats[0].pinned_bytes
    d.destroy()
    return n + len(stats) + len(names) + len(values) + pinned + len(view)


async def async_use(client: Client) -> int:
    ad = await AsyncDDict.create(total_mem="64 MiB", client=client)
    await ad.put("k", 1)
    value = await ad.get("k", 0)
    many: list[object] = await ad.get_many(["k"], copy=False)
    length: int = await ad.length()
    keys: list[object] = await ad.keys()
    stats: list[DDictManagerStats] = await ad.stats()
    await ad.destroy()
    return length + len(keys) + len(stats) + int(value) + len(many)
