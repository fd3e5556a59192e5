"""Pickled handles are O(1): a reference, resolved once per process on first use."""

from __future__ import annotations

import os
import pickle
import time

import numpy as np
import pytest
from distributed import get_worker

from dask_ddict import DDict, DDictClosedError


def _fetches_after_use(d: DDict, i: int) -> tuple[str, int]:
    from dask_ddict.client import layouts

    d[("task", i)] = i  # first use: the layout is resolved here, in the task's thread
    return get_worker().address, layouts.fetches


def test_a_pickled_handle_does_not_grow_with_the_managers(client):
    small = DDict(1, total_mem="32 MiB", client=client)
    big = DDict(32, total_mem="128 MiB", client=client)
    try:
        sizes = [len(pickle.dumps(d)) for d in (small, big)]
        assert big.num_managers == 32 * small.num_managers
        assert sizes[0] == sizes[1] - (len(big.get_name()) - len(small.get_name()))
        assert max(sizes) <= 1024 + len(big.get_name())
        assert big._core.layout.secret not in pickle.dumps(big).decode("latin-1")
    finally:
        small.destroy()
        big.destroy()


def test_many_tasks_cause_one_fetch_per_process(client, ddict):
    before = dict(
        client.run(lambda: __import__("dask_ddict.client.layouts", fromlist=["x"]).fetches)
    )
    futures = client.map(_fetches_after_use, [ddict] * 1000, range(1000), pure=False)
    after = {}
    for address, fetches in client.gather(futures):
        after[address] = max(after.get(address, 0), fetches)
    for address, fetches in after.items():
        assert fetches - before[address] <= 1, (address, fetches, before[address])
    assert len(ddict) == 1000


def test_an_unpickled_handle_of_a_destroyed_dict_is_closed(client):
    d = DDict(total_mem="32 MiB", client=client, name="gone-soon")
    blob = pickle.dumps(d)
    d.destroy()
    h = pickle.loads(blob)  # nothing is sent while unpickling...
    assert "attaches on first use" in repr(h)
    with pytest.raises(DDictClosedError):
        h["k"]  # ...and the first use says what happened
    again = DDict(total_mem="32 MiB", client=client, name="gone-soon")  # the name, reused
    try:
        from dask_ddict.client import layouts

        layouts.forget(pickle.loads(blob)._core.ref.uid)  # as in a fresh process
        with pytest.raises(DDictClosedError, match="new dictionary"):
            pickle.loads(blob)["k"]
    finally:
        again.destroy()


@pytest.mark.one_host  # (shard views: this host's managers)
def test_shard_views_are_bounded_and_the_rest_read_over_sockets(client):
    """A process maps at most ``ddict.transport.max-shard-views`` shards: managers beyond
    that are read over their host's socket, with the same results."""
    import dask.config

    from dask_ddict.transport import mapped

    d = DDict(8, total_mem="64 MiB", client=client)  # 16 managers, all on this host
    try:
        with dask.config.set({"ddict.transport.max-shard-views": len(mapped._ENVS) + 4}):
            h = DDict.attach(d.serialize(), client=client)
            for m in range(h.num_managers):
                h.manager(m)[("k", m)] = m
            assert [h.manager(m)[("k", m)] for m in range(h.num_managers)] == list(range(16))
            kinds = [h._core.channel(m).kind for m in range(h.num_managers)]
        assert kinds.count("shm") == 4 and kinds.count("uds") == 12, kinds
        assert len(h) == 16
        h.detach()
    finally:
        d.destroy()


@pytest.mark.one_host  # (shard views: this host's managers)
def test_idle_shard_views_rotate_to_the_managers_in_use(client):
    """At the bound, a view idle for ``shard-view-idle`` is taken, least recently used
    first, for a manager in use; its old channel reads over its socket meanwhile and
    maps its shard again once a view is idle.  Never more views than the bound."""
    import dask.config

    from dask_ddict.transport import mapped

    d = DDict(4, total_mem="32 MiB", client=client)  # 8 managers, all on this host
    try:
        with dask.config.set(
            {
                "ddict.transport.max-shard-views": len(mapped._ENVS) + 2,
                "ddict.transport.shard-view-idle": "50 ms",
            }
        ):
            bound = len(mapped._ENVS) + 2
            h = DDict.attach(d.serialize(), client=client)
            for m in range(4):
                h.manager(m)[("k", m)] = m
            kinds = lambda: [h._core.channel(m).kind for m in range(4)]  # noqa: E731
            assert kinds() == ["shm", "shm", "uds", "uds"]
            time.sleep(0.12)  # views of 0 and 1 idle; 2's channel past its retry interval
            h.manager(1)[("k", 1)]  # 1 is in use again: 0 is the least recently used
            assert h.manager(2)[("k", 2)] == 2
            # 2 took an idle view (0's, or an older one of this process), 1 kept its own
            assert kinds()[1:3] == ["shm", "shm"] and len(mapped._ENVS) <= bound
            assert h.manager(0)[("k", 0)] == 0
            time.sleep(0.12)
            for m in range(4):  # every value, whichever way each channel reads now
                assert h.manager(m)[("k", m)] == m
                assert len(mapped._ENVS) <= bound
            h.detach()
    finally:
        d.destroy()


def test_a_view_in_use_is_never_taken(tmp_path, monkeypatch):
    """Rotation takes only idle views with no operation inside (closing one under a
    reader would unmap pages it reads)."""
    import dask.config
    import lmdb

    from dask_ddict.shard.store import ShardStore
    from dask_ddict.transport import mapped, shared

    paths = [str(tmp_path / f"s{i}") for i in range(2)]
    for p in paths:
        ShardStore(p, 1 << 20).close()
    monkeypatch.setattr(mapped, "_ENVS", {})  # (this process's other views aside)
    with dask.config.set(
        {"ddict.transport.max-shard-views": 1, "ddict.transport.shard-view-idle": "0 s"}
    ):
        first = mapped._acquire(paths[0], 1 << 20)
        first.active = 1  # an operation is inside it
        try:
            with pytest.raises(mapped.ViewLimit):
                mapped._acquire(paths[1], 1 << 20)
            first.active = 0
            second = mapped._acquire(paths[1], 1 << 20)  # now it may be taken
            assert first.evicted and not second.evicted
            second.active = 1  # its last channel closes while a read is inside...
            mapped._release(paths[1], second)
            with second.store.read() as txn:  # ...so the read may go on
                assert second.store.entries(txn) == 0
            shared.SharedChannel._exit(second)  # the last one out closes it
            with pytest.raises(lmdb.Error):  # closed
                second.store.read()
        finally:
            mapped._release(paths[0], first)
    assert not set(paths) & set(mapped._ENVS)


@pytest.mark.one_host  # (shard views: this host's managers)
@pytest.mark.parametrize("per_worker", [128, pytest.param(1024, marks=pytest.mark.slow)])
def test_a_client_touching_many_managers_holds_at_most_128_more_descriptors(client, per_worker):
    """Default configuration: views and sockets together stay within 128 descriptors
    whatever the number of managers (256, and 2,048 with --runslow; views rotate,
    sockets are pooled), and every value still reads back, whichever way each manager
    is read now."""
    from dask_ddict import config

    assert (
        2 * int(config.get("transport.max-shard-views"))
        + int(config.get("transport.kept-connections"))
        <= 128
    )
    d = DDict(per_worker, total_mem=f"{2 * per_worker} MiB", client=client)  # 2 workers
    try:
        h = DDict.attach(d.serialize(), client=client)
        before = len(os.listdir("/proc/self/fd"))
        big = np.arange(16_384, dtype=np.float64)  # 128 KiB: through the host's socket
        for m in range(h.num_managers):
            h.manager(m)[("k", m)] = m
            h.manager(m)[("big", m)] = big + m
        for m in range(h.num_managers):
            assert h.manager(m)[("k", m)] == m
            assert (h.manager(m)[("big", m)] == big + m).all()
        grown = len(os.listdir("/proc/self/fd")) - before
        assert grown <= 128, grown
        assert len(h) == 2 * h.num_managers
        h.detach()
    finally:
        d.destroy()
