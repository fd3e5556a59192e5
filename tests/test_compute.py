"""Computing beside the data: ``filter`` (Dragon's), ``map_shards``, ``to_bag``.

One cluster for the module, two workers with one thread each: long-running
filter tasks must not need a thread each (they secede when they would wait), and
placement is checked against ``d.manager_workers``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from distributed import Client, get_worker

from dask_ddict import DDict, DDictTaskError
from dask_ddict.client.workers import scheduler_workers
from tests.support.cluster import local_cluster
from tests.support.polling import poll_for

N_MANAGERS = 8


@pytest.fixture(scope="module")
def client():
    with (
        local_cluster(2) as cl,
        Client(cl) as c,
    ):
        yield c


@pytest.fixture(scope="module")
def d(client):
    d = DDict(
        managers_per_worker=N_MANAGERS // 2, total_mem="256 MiB", working_set_size=2, client=client
    )
    d.update({f"k{i}": i for i in range(2000)})
    yield d
    d.destroy()


def _filter_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ddict-filter")]


def _scheduler_tasks(dask_scheduler: Any) -> list[str]:
    return [str(k) for k in dask_scheduler.tasks if "ddict-filter" in str(k)]


def _nothing_left(client: Client) -> None:
    """No filter task in the scheduler, no filter thread in any process (within seconds:
    a client releases the futures it dropped in its next batched message)."""
    poll_for(lambda: not client.run_on_scheduler(_scheduler_tasks), 10, "no filter task left", 0.05)
    assert client.run_on_scheduler(_scheduler_tasks) == []
    assert all(not ts for ts in client.processing().values())
    poll_for(
        lambda: not _filter_threads() and not any(client.run(_filter_threads).values()),
        10,
        "no filter thread left in any process",
        0.1,
    )
    assert _filter_threads() == []
    assert client.run(_filter_threads) == {w: [] for w in scheduler_workers(client)}


# -- filter --------------------------------------------------------------------------


def _where_and_keys(dd, out, tag):
    """Each manager: where it ran, how its handle reads, then its keys."""
    mid = dd._target
    out.put((tag, mid, get_worker().address, dd._core.channel(mid).kind))
    for k in dd.keys():
        out.put(k)


@pytest.mark.parametrize("fan_in", [5, 2])
def test_filter_gives_every_managers_results_from_beside_its_shard(d, client, fan_in):
    with d.filter(_where_and_keys, ("where",), branching_factor=fan_in) as results:
        got = list(results)
    where = [x for x in got if isinstance(x, tuple)]
    keys = [x for x in got if not isinstance(x, tuple)]
    assert sorted(keys) == sorted(d.keys()) and len(keys) == 2000
    assert sorted(mid for _, mid, _, _ in where) == list(range(N_MANAGERS))
    for _, mid, worker, kind in where:
        assert worker == d.manager_workers[mid]  # beside its shard
        assert kind == "shm"  # its reads come from the shard's shared memory
    _nothing_left(client)


def _sorted_values(dd, out):
    for v in sorted(dd.values()):
        out.put(v)


@pytest.mark.parametrize("fan_in", [5, 2])
def test_filter_merges_in_comparator_order(d, fan_in):
    with d.filter(
        _sorted_values, comparator=lambda x, y: x < y, branching_factor=fan_in
    ) as results:
        got = list(results)
    assert got == list(range(2000))
    with d.filter(_sorted_values_desc, comparator=lambda x, y: x > y) as results:
        assert list(results) == list(range(1999, -1, -1))


def _sorted_values_desc(dd, out):
    for v in sorted(dd.values(), reverse=True):
        out.put(v)


def _flood(dd, out, n):
    mid = dd._target
    for i in range(n):
        out.put((mid, i))
        if i % 64 == 0:
            dd["progress"] = i  # (the test reads how far each producer got)


def test_a_flood_streams_with_bounded_memory(d):
    n = 20_000  # per manager: many batches, many more than the window holds
    with d.filter(_flood, (n,), branching_factor=2) as results:
        first = next(results)
        time.sleep(1.0)  # producers run ahead only as far as their credit windows allow
        ahead = [d.manager(m).get("progress", 0) for m in range(N_MANAGERS)]
        rest = list(results)
    assert max(ahead) < 2_000, ahead  # window + batch per hop, not the whole result
    got = [first, *rest]
    assert len(got) == N_MANAGERS * n
    for m in range(N_MANAGERS):  # each manager's results arrive in its put order
        assert [i for mid, i in got if mid == m] == list(range(n))
    for m in range(N_MANAGERS):
        d.manager(m).pop("progress")


def _many_sorted(dd, out, n):
    for i in range(n):
        out.put((i, dd._target))


@pytest.mark.parametrize("fan_in", [N_MANAGERS, 2])
def test_leaves_blocked_on_credits_leave_the_pool_no_deadlock(d, fan_in):
    """Leaves run in the pool of one-thread workers until they would wait: each fills
    its credit window while the caller reads slowly, and must then give the thread to
    the next leaf (a comparator needs every leaf's first item before any result)."""
    n = 2_000  # per manager: far more than a window of batches
    with d.filter(
        _many_sorted, (n,), comparator=lambda x, y: x < y, branching_factor=fan_in
    ) as results:
        time.sleep(0.5)  # every leaf blocks on its credits meanwhile
        got = list(results)
    assert got == sorted((i, m) for i in range(n) for m in range(N_MANAGERS))


def _raises_on_3(dd, out):
    out.put(dd._target)
    if dd._target == 3:
        raise ValueError("boom on three")


def test_an_error_in_mgr_code_is_raised_naming_its_manager(d, client):
    with pytest.raises(DDictTaskError, match="manager 3.*ValueError: boom on three") as info:
        with d.filter(_raises_on_3, branching_factor=2) as results:
            list(results)
    assert info.value.manager_id == 3
    assert isinstance(info.value.__cause__, ValueError)
    _nothing_left(client)


def _forever(dd, out):
    dd["started"] = True
    i = 0
    try:
        while True:
            out.put(i)
            i += 1
    except EOFError:
        dd["saw-eof"] = i
        raise


def test_leaving_early_stops_every_task_and_leaves_nothing_running(d, client):
    with d.filter(_forever, branching_factor=3) as results:
        first = [next(results) for _ in range(10)]
    assert len(first) == 10
    started = [m for m in range(N_MANAGERS) if d.manager(m).pop("started", False)]
    assert started  # (tasks that had not started when the caller left never run mgr_code)
    for m in started:  # every producer was told: its put raised EOFError
        assert d.manager(m).pop("saw-eof") > 0
    _nothing_left(client)


def test_filter_arguments_are_checked(d):
    with pytest.raises(TypeError, match="mgr_code"):
        d.filter("not callable")
    with pytest.raises(TypeError, match="comparator"):
        d.filter(_forever, comparator=3)
    with pytest.raises(ValueError, match="branching_factor"):
        d.filter(_forever, branching_factor=1)
    with pytest.raises(TypeError, match="branching_factor"):
        d.filter(_forever, branching_factor=2.0)
    with pytest.raises(TypeError, match="func"):
        d.map_shards(None)


def test_filter_of_one_manager_and_at_a_checkpoint(d):
    one = d.manager(5)
    with one.filter(_where_and_keys, ("w",)) as results:
        got = list(results)
    assert got[0][1] == 5 and sorted(got[1:]) == sorted(one.keys())
    c = d.manager(0)
    c.checkpoint()  # a handle at checkpoint 1 sees what it writes there; d (at 0) does not
    key = next(iter(c.keys()))
    c[key] = "new"
    with c.filter(_values_of, (key,)) as results:
        assert list(results) == ["new"]
    with d.manager(0).filter(_values_of, (key,)) as results:
        assert list(results) == [int(key[1:])]


def _values_of(dd, out, key):
    out.put(dd[key])


# -- map_shards, to_bag --------------------------------------------------------------------


def _where(dd, scale=1):
    return dd._target, get_worker().address, len(dd) * scale


def test_map_shards_runs_one_task_per_manager_beside_it(d, client):
    futures = d.map_shards(_where, scale=2)
    got = client.gather(futures)
    assert [mid for mid, _, _ in got] == list(range(N_MANAGERS))
    assert [w for _, w, _ in got] == d.manager_workers
    assert sum(n for _, _, n in got) == 2 * len(d)


def _worker_of(part):
    return [(get_worker().address, len(part))]


def test_to_bag_reads_each_partition_beside_its_shard(d):
    bag = d.to_bag()
    assert bag.npartitions == N_MANAGERS
    assert dict(bag.compute()) == dict(d.items())
    assert bag.map(lambda kv: kv[1]).sum().compute() == sum(range(2000))
    assert sorted(d.to_bag("keys").compute()) == sorted(d.keys())
    assert sorted(d.to_bag("values").compute()) == list(range(2000))
    where = d.to_bag("keys").map_partitions(_worker_of).compute()
    assert [w for w, _ in where] == d.manager_workers
    assert [n for _, n in where] == [len(d.manager(m)) for m in range(N_MANAGERS)]
    with pytest.raises(ValueError, match="what"):
        d.to_bag("pairs")


def test_to_bag_reads_at_the_handles_checkpoint(d):
    c = d.manager(1)
    c.checkpoint()
    key = next(iter(c.keys()))
    c[key] = -1
    old, new = dict(d.manager(1).to_bag().compute()), dict(c.to_bag().compute())
    assert old[key] == int(key[1:]) and new[key] == -1


def _lent_or_copied(part, stores):
    """For each array of a partition: (read-only, a mapping of one of the shards
    ``stores``, a view of something)."""
    from dask_ddict import _memory

    files = {p + "/data.mdb" for p in stores}
    out = []
    for a in part:
        span = _memory.file_span(a.__array_interface__["data"][0])
        base = a
        while getattr(base, "base", None) is not None:  # (a view's chain ends at the shard's)
            base = base.base
        out.append((not a.flags.writeable, span is not None and span[3] in files, base is not a))
    return out


def test_to_bag_values_are_zero_copy_views_unless_copy(client):
    import numpy as np

    with DDict(managers_per_worker=2, total_mem="64 MiB", client=client) as e:
        e.update({f"a{i}": np.full(1 << 14, float(i)) for i in range(32)})
        stores = [m.store_path for m in e._core.layout.managers]
        lent = e.to_bag("values").map_partitions(_lent_or_copied, stores).compute()
        assert len(lent) == 32 and all(ro and inside and chained for ro, inside, chained in lent)
        copied = e.to_bag("values", copy=True).map_partitions(_lent_or_copied, stores).compute()
        assert len(copied) == 32 and not any(ro or inside for ro, inside, _ in copied)
        total = e.to_bag("values").map(np.sum).sum().compute()
        assert total == sum(i * (1 << 14) for i in range(32))
        items = dict(e.to_bag().compute())  # (sent here: copies of the views)
        assert items["a3"][0] == 3.0
        poll_for(  # the partitions are gone: so are their pins
            lambda: not any(s.pinned_views for s in e.stats), 10, "no pinned view", 0.1
        )
        assert [s.pinned_views for s in e.stats] == [0] * e.num_managers
        with pytest.raises(TypeError, match="copy"):
            e.to_bag("values", copy="no")


def test_a_leaf_leaves_the_pool_only_while_its_merge_task_has_not_started():
    """A leaf's join (begun as it starts) calls ``before_wait`` (the leaf secedes) only
    when it is not joined within ANSWER_SOON: its parent merge task has not started; it
    still joins it once the merge task starts."""
    import secrets

    from dask_ddict.filter.plan import Plan
    from dask_ddict.filter.receiving import Receiver
    from dask_ddict.filter.streams import ROOT, StreamLimits
    from dask_ddict.filter.tasks import Joining, join
    from dask_ddict.transport.sockets import shut

    limits = StreamLimits(64, 1 << 20, 2, 0.05, 5.0)
    token = secrets.token_bytes(32)
    parents = (2, 2, ROOT)  # leaves 0 and 1 under merge node 2
    root = Receiver("127.0.0.1", token, [2], 2, limits, parents)
    merge = Receiver("127.0.0.1", token, [0, 1], 2, limits)
    plan = Plan(token, root.address, parents, 2, limits)
    waited: list[int] = []
    up: list[object] = []
    starts = threading.Timer(0.3, lambda: up.append(join(plan, 2, merge.address)))
    starts.start()
    early = Joining(plan, 0).result(lambda: waited.append(0))  # (the merge starts later)
    starts.join(10.0)  # (the leaf can be joined before the merge's own join has returned)
    assert waited == [0] and early is not None and up
    joining = Joining(plan, 1)
    time.sleep(0.2)  # (a leaf's mgr_code runs meanwhile)
    late = joining.result(lambda: waited.append(1))
    assert waited == [0] and late is not None  # its merge task runs: no need to secede
    dropped = Joining(plan, 1)  # (a leaf that ends without its socket: closed for it)
    dropped.drop()
    for sock in (early, late, up[0]):
        shut(sock)
    root.close()
    merge.close()


def test_a_leaf_whose_merge_task_never_starts_fails_loudly():
    """The caller gives up on a merge node after ``connect-timeout``: its waiting leaf is
    told so (an ERROR frame) and fails its task, instead of taking it for the caller's
    leaving and ending quietly (which left the merge node, and the caller, waiting)."""
    import secrets

    from dask_ddict.filter.plan import Plan
    from dask_ddict.filter.receiving import Receiver
    from dask_ddict.filter.streams import ROOT, StreamLimits
    from dask_ddict.filter.tasks import join

    limits = StreamLimits(64, 1 << 20, 2, 0.05, 0.5)
    token = secrets.token_bytes(32)
    parents = (1, ROOT)  # leaf 0 under merge node 1, which never starts
    root = Receiver("127.0.0.1", token, [1], 1, limits, parents)
    try:
        with pytest.raises(DDictTaskError, match="merge node 1 did not start") as info:
            join(Plan(token, root.address, parents, 1, limits), 0, None)
        assert info.value.manager_id == 0
    finally:
        root.close()


def test_a_receiver_refuses_strangers_before_allocating_and_closes_their_connections():
    """A first frame that is not a HELLO of a sane size is refused before its claimed
    length is allocated; connections still being greeted close with the receiver."""
    import secrets
    import socket
    import struct

    from dask_ddict.filter.receiving import Receiver
    from dask_ddict.filter.streams import HELLO, StreamLimits

    limits = StreamLimits(64, 1 << 20, 2, 0.05, 30.0)
    receiver = Receiver("127.0.0.1", secrets.token_bytes(32), [0], 1, limits)
    try:
        with socket.create_connection(receiver.address, timeout=10) as s:
            s.sendall(struct.pack("!BQ", HELLO, 1 << 50))  # claims a petabyte
            assert s.recv(1) == b""  # closed at once (no MemoryError, no allocation)
        idle = [socket.create_connection(receiver.address, timeout=10) for _ in range(20)]
        time.sleep(0.2)  # (each is being greeted: it waits for a HELLO)
    finally:
        receiver.close()
    for s in idle:
        assert s.recv(1) == b""  # closed with the receiver, not after connect-timeout
        s.close()
    poll_for(
        lambda: not any(t.name.startswith("ddict-filter-greet") for t in threading.enumerate()),
        10,
        "no ddict-filter-greet thread",
        0.05,
    )


def test_the_schedulers_workers_are_asked_not_read_from_the_clients_cache(client):
    """``Client.scheduler_info()`` returns a cache that the client's periodic refresh
    (``_update_scheduler_info()``, totals only) leaves without workers at any moment: a
    worker looked up in it just then is missing (a state machine's step once failed so).
    :func:`scheduler_workers` asks the scheduler."""
    client.sync(client._update_scheduler_info)  # (what the periodic refresh does)
    assert client._scheduler_identity["workers"] == {}  # (the cache, just then)
    workers = client.run(lambda dask_worker: dask_worker.address)  # (each one answers)
    assert sorted(scheduler_workers(client)) == sorted(workers) and len(workers) == 2
