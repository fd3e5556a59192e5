"""Typed use of the public API: ``tests/test_typing.py`` runs mypy on this file.

Not a test module (no ``test_`` prefix): it is only type-checked, never run.
"""

from __future__ import annotations

from typing import Any

import dask.bag
import numpy as np
from distributed import Client, Future

from dask_ddict import AsyncDDict, DDict, DDictManagerStats, Policy


def sync_use(client: Client) -> int:
    d = DDict(total_mem="64 MiB", client=client, timeout="10s", lifetime="cluster")
    d["x"] = np.arange(3)
    n: int = d.fetch_add("n", 1)
    stats: list[DDictManagerStats] = d.stats
    names: list[str] = DDict.list(client)
    view = d.get("x", copy=False)
    values: list[object] = d.get_many(["x", "n"], default=None, copy=False)
    pinned: int = stats[0].pinned_bytes
    waiting: int = stats[0].deferred_ops
    with d.filter(_shard_sums, (2,), comparator=lambda x, y: x < y, branching_factor=4) as res:
        total = sum(res)
    futures: list[Future] = d.map_shards(len)
    bag: dask.bag.Bag = d.to_bag("values", copy=True)
    d.destroy()
    return (
        n
        + len(stats)
        + len(names)
        + len(values)
        + pinned
        + len(view)
        + waiting
        + int(total)
        + len(futures)
        + bag.npartitions
    )


def dragon_use(client: Client) -> float:
    """A Dragon program's calls, with Dragon's names (issue 54)."""
    d = DDict(
        managers_per_node=2,
        n_nodes=1,
        total_mem=64 << 20,
        client=client,
        trace=False,
        streams_per_manager=5,
        policy=None,
        persister_class=None,
    )
    gpu = Policy(resources={"GPU": 1})
    DDict(
        policy=[gpu, Policy(host="node1")], managers_per_policy=2, orc_policy=gpu, client=client
    ).destroy()
    DDict(policy={gpu: 2}, client=client).destroy()
    before: int = d.fetch_add("n", val=2)
    d.sync(timeout=10)
    nodes: list[str] = d.manager_nodes
    d.profile_reset()
    mean: float = d.profile().operations["fetch_add"].mean
    d.destroy()
    return before + len(nodes) + mean


def _shard_sums(dd: DDict, out: Any, scale: int) -> None:
    for v in dd.values():
        out.put(scale * float(np.sum(v)))


async def async_use(client: Client) -> int:
    ad = await AsyncDDict.create(total_mem="64 MiB", client=client)
    await ad.put("k", 1)
    value = await ad.get("k", 0)
    many: list[object] = await ad.get_many(["k"], copy=False)
    length: int = await ad.length()
    keys: list[object] = await ad.keys()
    stats: list[DDictManagerStats] = await ad.stats()
    async with ad.filter(_shard_sums, (1,)) as results:
        sums = [x async for x in results]
    futures: list[Future] = await ad.map_shards(len)
    bag: dask.bag.Bag = await ad.to_bag(copy=False)
    await ad.destroy()
    return (
        length
        + len(keys)
        + len(stats)
        + int(value)
        + len(many)
        + len(sums)
        + len(futures)
        + bag.npartitions
    )
