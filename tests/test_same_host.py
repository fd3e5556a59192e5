"""Same-host clients: shard reads and small in-window puts with no round trip."""

from __future__ import annotations

import threading
import time

import dask
import numpy as np
import pytest

from dask_ddict import DDict, DDictCheckpointSyncError, DDictError, DDictFullError


def _over_socket(d: DDict) -> DDict:
    with dask.config.set({"ddict.local-read": False}):
        h = DDict.attach(d.serialize())
        h._core.channel(0)  # channels are chosen when first used
        h._core.channel(1)
    return h


def test_direct_puts_are_seen_by_the_manager(client):
    with DDict(total_mem="32 MiB", client=client, working_set_size=2) as d:
        assert d._core.channel(0)._direct
        sock = _over_socket(d)
        assert {sock._core.channel(m).kind for m in range(2)} == {"uds"}
        d.update({i: i for i in range(20)})  # batch: through the managers
        for i in range(20):
            d[i] = -i  # direct
        assert all(sock[i] == -i for i in range(20)) and len(sock) == 20
        d.checkpoint()
        d["new"] = 1  # checkpoint 1 is in the window [0, 1]: direct as well
        sock.checkpoint_id = 1
        assert sock["new"] == 1 and sock[3] == -3
        d.checkpoint_id = 2  # beyond the window: the manager moves it
        d["moved"] = 2
        assert d.stats[d.which_manager("moved")].newest_checkpoint == 2
        d.checkpoint_id = 0
        with pytest.raises(DDictCheckpointSyncError):
            d.manager(d.which_manager("moved"))["x"] = 0  # retired, also for a direct put
        sock.detach()


def test_a_waiter_at_the_manager_gets_puts_sent_there(client):
    with DDict(total_mem="32 MiB", client=client) as d:
        done = threading.Event()

        def wait() -> None:
            d.wait_for("flag", True, timeout=20)
            done.set()

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.5)  # the waiter is registered in the shard
        t0 = time.monotonic()
        d["flag"] = True  # would be direct, but a waiter needs the manager to see it
        assert done.wait(5) and time.monotonic() - t0 < 5
        t.join()
        d["after"] = 1  # no waiter left: direct again
        assert d["after"] == 1


def test_direct_puts_respect_freeze_and_fullness(client):
    with DDict(total_mem="8 MiB", client=client, n_workers=1) as d:
        d["k"] = 1
        d.freeze()
        with pytest.raises(DDictError, match="frozen"):
            d["k"] = 2
        d.unfreeze()
        with pytest.raises(DDictFullError):
            for i in range(10_000):
                d[i] = np.ones(1000)  # 8 KB values: direct puts until the shard is full
        assert len(d) > 100
        d.clear()
        d["k"] = 3
        assert d["k"] == 3


def test_direct_writes_can_be_disabled(client):
    with dask.config.set({"ddict.local-write": False}):
        with DDict(total_mem="16 MiB", client=client) as d:
            d["k"] = 1
            assert not d._core.channel(d.which_manager("k"))._direct and d["k"] == 1


def test_tasks_write_directly_too(client):
    with DDict(total_mem="32 MiB", client=client) as d:

        def task(h: DDict, i: int) -> bool:
            h[("t", i)] = i
            return h._core.channel(h.which_manager(("t", i)))._direct

        assert all(client.gather(client.map(task, [d] * 8, range(8), pure=False)))
        assert sorted(d[("t", i)] for i in range(8)) == list(range(8))
