"""Quickstart: a DDict on an embedded local cluster.

Run with ``python examples/quickstart.py``.  ``DDict()`` with no Dask client
starts a LocalCluster with worker processes, owns it and closes it on
``destroy()``.  Each worker hosts a manager that keeps its shard of the keys
in shared memory; the client and tasks talk to the managers directly.
"""

from __future__ import annotations

import numpy as np
from distributed import get_worker

from dask_ddict import DDict


def train_step(d: DDict, rank: int) -> str:
    """A task: read shared parameters, write a result next to the data."""
    params = d["params"]  # a numpy array, fetched from whichever manager holds it
    d[("grad", rank)] = params * rank  # stored on the manager that owns this key
    d.fetch_add("steps")  # atomic counter shared by every task
    return get_worker().address


def main() -> None:
    with DDict(total_mem="256 MiB") as d:  # embedded cluster; destroyed on exit
        d["params"] = np.arange(1_000_000, dtype="f8")
        d["config"] = {"lr": 0.01, "layers": [64, 32]}

        client = d.client
        workers = client.gather(client.map(train_step, [d] * 8, range(8), pure=False))
        print(f"{len(d)} keys on {d.num_managers} managers; tasks ran on {sorted(set(workers))}")
        print("steps:", d["steps"], "| config:", d["config"])
        print("grad 3 sum:", d[("grad", 3)].sum())

        d.start_batch_put()  # streamed, one reply per manager at the end
        for i in range(10_000):
            d[f"sample-{i}"] = i
        d.end_batch_put()
        print("after batch put:", len(d), "keys")

        for s in d.stats:
            print(
                f"manager {s.manager_id} on {s.worker}: {s.num_keys} entries, "
                f"{s.total_used_bytes / 2**20:.1f} of {s.total_bytes / 2**20:.0f} MiB used"
            )


if __name__ == "__main__":  # worker processes are spawned: the guard is required
    main()
