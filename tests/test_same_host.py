"""Same-host clients: shard reads and small in-window puts with no round trip."""

from __future__ import annotations

import os
import threading
import time

import dask
import numpy as np
import pytest

from dask_ddict import DDict, DDictCheckpointSyncError, DDictError, DDictFullError
from dask_ddict._serialize import Taken
from dask_ddict.client.lane import LANE
from dask_ddict.shard.generations import path_for
from dask_ddict.transport import shared


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
        for m in range(d.num_managers):  # (the hosts known alive: the lane's case)
            d._core.channel(m)._alive_until = time.monotonic() + 60
        assert LANE.put(d, "flag", True, False) is NotImplemented  # (the commit refuses it)
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


@pytest.mark.one_host  # (shard views: this host's managers)
def test_every_acknowledged_direct_put_is_in_the_next_broadcast(client):
    """Hosts keep broadcast answers (``len``, ``stats``, first pages) while their
    managers' generation words stay; a client's direct put changes its manager's word
    before it returns, so the next broadcast counts it: nothing acknowledged is missed."""
    d = DDict(managers_per_worker=4, total_mem="32 MiB", client=client)  # 8 managers
    try:
        assert d._core.channel(0).kind == "shm"
        for i in range(40):
            d[("k", i)] = i  # committed by this process into the shard
            assert len(d) == i + 1
            assert sum(s.num_keys for s in d.stats) == i + 1
            if i % 8 == 0:
                assert sorted(k[1] for k in d.keys()) == list(range(i + 1))

        def task(n):
            d[("task", n)] = n  # a task's direct put, on a worker
            return len(d)

        assert client.submit(task, 1, pure=False).result() == 41
        assert len(d) == 41 and ("task", 1) in set(d.keys())
        d.clear()
        assert len(d) == 0 and next(iter(d.keys()), None) is None
        words = {
            path_for(os.path.dirname(m.uds_path), d._core.layout.uid)
            for m in d._core.layout.managers
        }
        assert len(words) == 2 and all(os.path.exists(w) for w in words)  # one per host process
    finally:
        d.destroy()
    assert not any(os.path.exists(w) for w in words)  # removed with the dictionary


def test_raw_bytes_read_on_the_managers_host_are_the_values_bytes(client, monkeypatch):
    """A same-host get of raw bytes copies a large value once, straight into the ``bytes``
    it returns (``_serialize.Taken``): each size around the thresholds (a small frame,
    the touched pages' ``PRELOADED``, 1 MiB) reads back as exact ``bytes`` equal to what
    was put, the first read and again, through ``get``, ``get(copy=...)``, a handle with
    a value pickler (raw bytes are the same under any), ``bget``, and over the socket."""

    class Pickler:
        @staticmethod
        def dump(obj, f):
            f.write(repr(obj).encode())

        @staticmethod
        def load(f):
            return eval(f.read())  # noqa: S307 - the test's own values

    taken: list[int] = []

    def counted(value):
        taken.append(len(value))
        return Taken(value)

    monkeypatch.setattr(shared, "Taken", counted)
    sizes = [0, 4000, 4200, (64 << 10) - 100, (64 << 10) + 100, (1 << 20) + 7]
    values = {n: os.urandom(n) for n in sizes}
    with DDict(total_mem="64 MiB", client=client) as d:
        d.update(values)
        d.bput("b", values[sizes[-1]])
        sock = _over_socket(d)
        picky = d.pickler(value_pickler=Pickler)
        for _ in range(2):
            for n, v in values.items():
                for got in (d[n], d.get(n, copy=True), d.get(n, copy=False), picky[n], sock[n]):
                    assert type(got) is bytes and got == v, n
            assert d.bget("b") == values[sizes[-1]]
        picky["obj"] = {"a": 1}  # (its frame no raw bytes: the pickler's to decode)
        assert picky["obj"] == {"a": 1}
        sock.detach()
    # (d[n], get(copy=True) and the pickler's handle's read of each value past a small
    # frame, twice; the small frame and the socket's reads are decoded as before)
    assert len(taken) >= 2 * 3 * 4 and min(taken) >= 4200, taken
