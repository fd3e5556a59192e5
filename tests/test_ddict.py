"""The DDict API on a real process cluster (spec sections: dict protocol, bulk,
handles, locality, errors, lifecycle)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest

from dask_ddict import (
    DDict,
    DDictClosedError,
    DDictError,
    DDictFullError,
    DDictKeyError,
    DDictManagerStats,
    DDictSerializationError,
    DDictTimeoutError,
)
from dask_ddict.client.workers import scheduler_workers


def test_basic_put_get_types(ddict):
    values = {
        "str": "value",
        1: np.arange(10),
        (1, "t"): {"nested": [1, 2]},
        b"bytes": None,
        2.5: np.ones((100, 100), dtype="f4"),
    }
    for k, v in values.items():
        ddict[k] = v
    for k, v in values.items():
        got = ddict[k]
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(got, v)
            assert got.dtype == v.dtype
        else:
            assert got == v
    assert len(ddict) == len(values)


def test_key_identity_by_bytes(ddict):
    ddict[1] = "int"
    ddict[1.0] = "float"
    ddict[True] = "bool"
    assert (ddict[1], ddict[1.0], ddict[True]) == ("int", "float", "bool")
    assert len(ddict) == 3


def test_missing_key_errors(ddict):
    with pytest.raises(DDictKeyError) as info:
        ddict[123]
    assert isinstance(info.value, KeyError)
    assert info.value.key == 123
    assert "123" in str(info.value) and info.value.code == "KEY_NOT_FOUND"
    assert ddict.get(123) is None
    assert ddict.get(123, "d") == "d"
    assert 123 not in ddict
    with pytest.raises(DDictKeyError):
        del ddict[123]
    assert ddict.pop(123, None) is None  # Dragon raises here; we do not
    assert ddict.pop(123, 7) == 7
    with pytest.raises(KeyError):
        ddict.pop(123)


def test_pop_del_contains(ddict):
    ddict["a"] = 1
    ddict["b"] = 2
    assert "a" in ddict
    assert ddict.pop("a") == 1
    assert "a" not in ddict
    del ddict["b"]
    assert len(ddict) == 0


def test_views_and_iteration(ddict):
    data = {f"k{i}": i for i in range(300)}
    ddict.update(data)
    assert len(ddict) == 300
    assert sorted(ddict.keys()) == sorted(data)
    assert sorted(ddict.values()) == sorted(data.values())
    assert dict(ddict.items()) == data
    assert set(iter(ddict)) == set(data)
    assert "k5" in ddict.keys() and len(ddict.values()) == 300
    it = iter(ddict.keys())
    first = next(it)
    del it  # breaking out early is clean: the dict stays usable
    assert first in data and ddict["k7"] == 7
    with pytest.raises(NotImplementedError):
        reversed(ddict.keys())


def test_views_page_through_many_items(ddict, monkeypatch):
    import dask

    ddict.update({i: i for i in range(50)})
    with dask.config.set({"ddict.iteration.page-items": 7}):
        assert sorted(ddict.keys()) == list(range(50))


def test_iteration_starts_with_one_broadcast_of_first_pages(client):
    """Over many managers the first pages come in one request per host (each manager a
    share of one page), then each manager's rest page by page: every item once,
    empty managers answered from their counts, and large values still stream."""
    import dask

    from dask_ddict import DDict
    from dask_ddict.transport.channels import Channels

    d = DDict(managers_per_worker=8, total_mem="64 MiB", client=client)
    try:
        d.update({i: i for i in range(40)})
        d.update({f"big{i}": np.ones(50_000) * i for i in range(3)})  # over a page's share
        calls: list[str] = []
        each = Channels.each

        def counted(self, o, mids, progress=""):
            calls.append(type(o).__name__)
            return each(self, o, mids, progress)

        with (
            dask.config.set(
                {"ddict.iteration.page-items": 4, "ddict.iteration.page-bytes": "64 KiB"}
            ),
            pytest.MonkeyPatch.context() as mp,
        ):
            mp.setattr(Channels, "each", counted)
            it = iter(d.items())
            next(it)
            assert calls == ["Page"]  # the first item: one broadcast
            items = [next(iter(d.items()))] and dict(d.items())
        assert sorted(k for k in items if isinstance(k, int)) == list(range(40))
        assert all(items[f"big{i}"][0] == i for i in range(3))
        d.clear()
        assert list(d.keys()) == [] and list(d.values()) == []
    finally:
        d.destroy()


def test_clear(ddict):
    ddict.update({i: i for i in range(20)})
    ddict.clear()
    assert len(ddict) == 0


def test_update_kwargs_and_popitem(ddict):
    ddict.update([("x", 1)], y=2)
    assert (ddict["x"], ddict["y"]) == (1, 2)
    assert sorted([ddict.popitem(), ddict.popitem()]) == [("x", 1), ("y", 2)]
    with pytest.raises(KeyError):
        ddict.popitem()


def test_fetch_add(ddict):
    assert ddict.fetch_add("n") == 0
    assert ddict.fetch_add("n", 5) == 1
    assert ddict["n"] == 6
    ddict["s"] = "text"
    with pytest.raises(DDictError, match="int"):
        ddict.fetch_add("s")


def test_fetch_add_is_atomic_across_tasks(client, ddict):
    def bump(d, n):
        for _ in range(n):
            d.fetch_add("counter")
        return True

    client.gather(client.map(bump, [ddict] * 6, [50] * 6, pure=False))
    assert ddict["counter"] == 300


def test_wait_for_and_timeouts(client, ddict):
    ddict["flag"] = 0
    ddict.wait_for("flag", 0, timeout=1)  # already equal: returns at once
    t0 = time.monotonic()
    with pytest.raises(DDictTimeoutError) as info:
        ddict.wait_for("flag", 1, timeout=0.5)
    assert isinstance(info.value, TimeoutError)
    assert 0.4 < time.monotonic() - t0 < 5
    # the message names the key waited on (the manager sees only its digest)
    assert "wait_for('flag')" in str(info.value) and "0.5 s" in str(info.value)
    assert info.value.code == "TIMEOUT"

    def setter(d):
        time.sleep(0.5)
        d["flag"] = 1

    fut = client.submit(setter, ddict, pure=False)
    ddict.wait_for("flag", 1, timeout=30)
    fut.result()


def test_checkpoint_ids_are_client_side(ddict):
    assert ddict.checkpoint_id == 0
    ddict.checkpoint()
    ddict.checkpoint()
    assert ddict.checkpoint_id == 2
    ddict.rollback()
    assert ddict.checkpoint_id == 1
    ddict.checkpoint_id = 0
    ddict.rollback()
    assert ddict.checkpoint_id == 0
    with pytest.raises(ValueError):
        ddict.checkpoint_id = -1
    ddict["a"] = 1
    ddict.checkpoint_id = 5
    ddict["a"] = 2  # working_set_size=1: checkpoint 0 retires
    ddict.checkpoint_id = 0
    with pytest.raises(DDictError) as info:
        ddict["a"]
    assert info.value.code == "CHECKPOINT_RETIRED"
    ddict.sync_to_newest_checkpoint()
    assert ddict.checkpoint_id == 5 and ddict["a"] == 2


def test_versioned_reads_with_working_set(client):
    with DDict(total_mem="32 MiB", working_set_size=3, client=client) as d:
        d["k"] = "c0"
        d.checkpoint()
        d["k"] = "c1"
        d.rollback()
        assert d["k"] == "c0"
        d.checkpoint()
        assert d["k"] == "c1"


def test_batch_put(ddict):
    ddict.start_batch_put()
    for i in range(2000):
        ddict[i] = i * 2
    with pytest.raises(DDictError) as info:
        ddict.checkpoint()
    assert info.value.code == "INVALID_OPERATION"
    with pytest.raises(DDictError):
        ddict.pput("p", 1)  # persistence mismatch
    ddict.end_batch_put()
    assert len(ddict) == 2000 and ddict[1999] == 3998
    with pytest.raises(DDictError):
        ddict.end_batch_put()  # not started


def test_batch_put_errors_surface_at_end(client):
    with DDict(total_mem="4 MiB", n_workers=1, client=client) as d:
        d.start_batch_put()
        d["ok"] = 1
        d["big"] = np.zeros(8 << 20, dtype="u1")
        with pytest.raises(DDictFullError):
            d.end_batch_put()
        assert d["ok"] == 1 and "big" not in d
        d["after"] = 2  # still usable
        assert d["after"] == 2


def test_bput_bget(ddict):
    ddict.bput("shared", {"cfg": 1})
    for m in range(ddict.num_managers):
        assert ddict.manager(m)["shared"] == {"cfg": 1}
    assert ddict.bget("shared") == {"cfg": 1}
    assert len(ddict) == ddict.num_managers  # one copy per manager


def test_freeze(ddict):
    ddict["a"] = 1
    ddict.freeze()
    assert ddict.is_frozen
    for op in (
        lambda: ddict.__setitem__("b", 1),
        lambda: ddict.pop("a"),
        lambda: ddict.clear(),
        lambda: ddict.fetch_add("n"),
        lambda: ddict.bput("x", 1),
        lambda: ddict.pput("c", 1),
    ):
        with pytest.raises(DDictError) as info:
            op()
        assert info.value.code == "INVALID_OPERATION"
    assert ddict["a"] == 1
    ddict.unfreeze()
    ddict["b"] = 2
    assert not ddict.is_frozen


def test_full_pool_and_recovery(client):
    with DDict(total_mem="4 MiB", n_workers=1, client=client) as d:
        d["small"] = 1
        with pytest.raises(DDictFullError):
            d["big"] = np.zeros(8 << 20, dtype="u1")
        assert "big" not in d and d["small"] == 1
        stored = 0
        with pytest.raises(DDictFullError):
            for i in range(100):
                d[i] = np.zeros(100_000, dtype="u1")
                stored += 1
        assert 10 < stored < 100
        assert len(d) == stored + 1
        d.clear()  # deletes work on a full shard
        d["again"] = np.zeros(100_000, dtype="u1")


def test_unpicklable_value_stores_nothing(ddict):
    import threading

    with pytest.raises(DDictSerializationError, match="lock"):
        ddict["k"] = threading.Lock()
    assert "k" not in ddict and len(ddict) == 0


@dataclass(frozen=True)
class OnManager:
    manager: int
    ddict_stable_hash: ClassVar[bool] = True  # an int: the same hash in every process

    def __hash__(self) -> int:
        return self.manager


def test_which_manager_and_custom_hash(ddict):
    assert ddict.which_manager(OnManager(1)) == 1
    assert ddict.which_manager(OnManager(2)) == 0
    ddict[OnManager(1)] = "x"
    assert ddict.manager(1)[OnManager(1)] == "x"
    assert len(ddict.manager(1)) == 1 and len(ddict.manager(0)) == 0
    counts = [0, 0]
    for i in range(200):
        counts[ddict.which_manager(f"k{i}")] += 1
    assert min(counts) > 50


def test_manager_handles(ddict):
    m0 = ddict.manager(0)
    m0["k"] = 1  # stored on manager 0 regardless of its hash
    assert m0["k"] == 1
    assert len(m0) == 1 and len(ddict.manager(1)) == 0
    assert list(m0.keys()) == ["k"]
    assert [s.manager_id for s in m0.stats] == [0]
    with pytest.raises(DDictError) as info:
        ddict.manager(5)
    assert info.value.code == "INVALID_ARGUMENT"


class ReprPickler:
    def dumps(self, obj):
        return repr(obj).encode()

    def loads(self, data):
        return eval(data.decode())

    def dump(self, obj, file):
        file.write(repr(obj).encode())

    def load(self, file):
        return eval(file.read().decode())


def test_custom_picklers(ddict):
    p = ReprPickler()
    with ddict.pickler(p, p) as dp:
        dp["key"] = [1, 2, 3]
        assert dp["key"] == [1, 2, 3]
        assert list(dp.keys()) == ["key"]
        assert "key" in dp
    assert "key" not in ddict  # the default pickler makes other key bytes
    assert not ddict._core.closed  # leaving the derived handle only detached


def test_stats(ddict):
    ddict.update({i: bytes(1000) for i in range(50)})
    stats = ddict.stats
    assert [s.manager_id for s in stats] == [0, 1]
    assert all(isinstance(s, DDictManagerStats) for s in stats)
    assert sum(s.num_keys for s in stats) == 50
    for s in stats:
        assert s.total_bytes == (64 << 20) // 2
        assert 0 < s.total_used_bytes <= s.total_bytes
        assert s.pool_free_space == s.total_bytes - s.total_used_bytes
        assert 0 < s.pool_utilization < 1
        assert s.worker in ddict.manager_workers
    assert set(ddict.dstats) == {0, 1}


@pytest.mark.one_host
def test_locality(ddict):
    assert ddict.local_managers == [0, 1]  # all on this machine
    assert ddict.local_manager in (0, 1)
    assert ddict.main_manager in (0, 1)
    ddict.update({i: i for i in range(10)})
    assert sorted(ddict.local_keys()) == list(range(10))
    assert ddict.local_len() == 10
    assert sorted(ddict.local_values()) == list(range(10))
    assert len(dict(ddict.local_items())) == 10


@pytest.mark.one_host
def test_tasks_use_the_same_host_path(client, ddict):
    """Managers live in host processes beside the workers: every task on the host reads
    the shard directly and writes over the host's Unix socket; its local manager is
    the one hosted for its own worker."""
    ddict["from_client"] = np.arange(5)

    def task(d, i):
        d[("task", i)] = i
        m = d.which_manager(("task", i))
        me = __import__("distributed").get_worker().address
        return (
            int(d["from_client"].sum()),
            d._core.channel(m).kind,
            d.manager_workers[d.local_manager] == me,
        )

    results = client.gather(client.map(task, [ddict] * 8, range(8), pure=False))
    assert all(r[0] == 10 for r in results)
    assert {kind for _, kind, _ in results} == {"shm"}  # shm: direct reads, socket writes
    assert all(own for _, _, own in results)
    assert {ddict[("task", i)] for i in range(8)} == set(range(8))


def test_handle_pickles_with_checkpoint(ddict):
    ddict.checkpoint_id = 3
    h = pickle.loads(pickle.dumps(ddict))
    assert h.checkpoint_id == 3 and h.get_name() == ddict.get_name()
    h["x"] = 1
    assert ddict["x"] == 1
    h.detach()
    with pytest.raises(DDictClosedError):
        h["x"]
    assert ddict["x"] == 1  # detaching another handle leaves the dict alive


def test_serialize_attach_from_another_process(ddict):
    ddict["hello"] = "world"
    code = (
        "import sys; from dask_ddict import DDict;"
        "d = DDict.attach(sys.argv[1]); print(d['hello']); d['child'] = 42; d.detach()"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, ddict.serialize()], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "world"
    assert ddict["child"] == 42


def test_concurrent_client_processes(ddict):
    code = """
import sys, numpy as np
from dask_ddict import DDict
d = DDict.attach(sys.argv[1]); me = int(sys.argv[2])
for i in range(200):
    d[(me, i)] = np.full(1000, me * 1000 + i)
for other in range(3):
    for i in range(200):
        v = d.get((other, i))
        if v is not None:
            assert (v == other * 1000 + i).all(), "torn value"
d.detach()
print("ok")
"""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, ddict.serialize(), str(me)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me in range(3)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.strip() == "ok"
    assert len(ddict) == 600
    for me in range(3):
        assert (ddict[(me, 199)] == me * 1000 + 199).all()


def test_destroy_is_idempotent_and_closes(client):
    d = DDict(total_mem="16 MiB", client=client)
    d["a"] = 1
    h = d.manager(0)
    d.destroy()
    d.destroy()
    for op in (lambda: d["a"], lambda: d.__setitem__("a", 1), lambda: len(d), lambda: h["a"]):
        with pytest.raises(DDictClosedError):
            op()


def test_context_manager_destroys(client):
    with DDict(total_mem="16 MiB", client=client, name="ctx-test") as d:
        d["a"] = 1
        assert d.get_name() == "ctx-test"
    with pytest.raises(DDictClosedError):
        d["a"]
    assert "ctx-test" not in client.sync(client.scheduler.ddict_list)


def test_duplicate_name_rejected(client):
    with DDict(total_mem="16 MiB", client=client, name="dup") as d:
        with pytest.raises(DDictError, match="already exists"):
            DDict(total_mem="16 MiB", client=client, name="dup")
        d["still"] = "works"


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"working_set_size": 0}, ValueError),
        ({"working_set_size": 1, "wait_for_keys": True}, ValueError),
        ({"working_set_size": 1, "wait_for_writers": True}, ValueError),
        ({"persist_freq": -1}, ValueError),
        ({"persist_count": -2}, ValueError),
        ({"persist_freq": 1}, ValueError),
        ({"read_only": True}, ValueError),
        ({"read_only": True, "name": "x"}, ValueError),
        ({"restore_from": 1}, ValueError),
        ({"restart": True}, ValueError),
        ({"total_mem": "lots"}, ValueError),
        ({"total_mem": 1.5}, TypeError),
        ({"managers_per_worker": 0}, ValueError),
        ({"n_workers": 5}, ValueError),
        ({"timeout": -1}, ValueError),
        ({"manager_pool_full_thresh": 2}, ValueError),
        ({"workers": ["tcp://1.2.3.4:5"]}, ValueError),
    ],
)
def test_constructor_validation(client, kwargs, exc):
    with pytest.raises(exc):
        DDict(client=client, **kwargs)


def test_managers_per_worker_and_workers(client):
    workers = sorted(scheduler_workers(client))
    with DDict(managers_per_worker=2, workers=workers[:1], total_mem="32 MiB", client=client) as d:
        assert d.num_managers == 2
        assert d.manager_workers == [workers[0], workers[0]]
        d.update({i: i for i in range(20)})
        assert len(d) == 20


@pytest.mark.one_host
def test_no_shared_memory_left(client):
    from tests.support.shards import shards, shm_entries

    d = DDict(total_mem="16 MiB", client=client)
    d["a"] = 1
    mine = shards(d)
    assert len(mine) == d.num_managers and mine <= shm_entries()
    d.destroy()
    assert not (mine & shm_entries())


@pytest.mark.one_host
def test_same_host_reads_come_from_the_shard(client):
    """The client process reads straight from the managers' shards (no round trip)."""
    from dask_ddict import DDictCheckpointSyncError

    with DDict(
        total_mem="512 MiB", client=client, working_set_size=2, wait_for_keys=True, timeout=30
    ) as d:
        assert {d._core.channel(m).kind for m in range(d.num_managers)} == {"shm"}
        big = np.random.default_rng(0).random(4 << 20)  # 32 MiB
        d.pput("big", big)
        got = d["big"]  # read-your-writes: the put committed before it returned
        np.testing.assert_array_equal(got, big)
        assert got.ctypes.data % 64 == 0  # aligned private copy
        d.pput("big", big * 2)
        np.testing.assert_array_equal(got, big)  # an earlier result never changes
        assert "nope" not in d
        d["np"] = 1  # non-persistent under wait_for_keys
        d.checkpoint()
        assert "np" not in d  # not visible at checkpoint 1 (Dragon's rule), from the shard

        def writer(h):
            import time

            time.sleep(0.5)
            h.checkpoint_id = 1
            h["np"] = 2

        fut = client.submit(writer, d, pure=False)
        assert d["np"] == 2  # not in the shard yet: the read waited at the manager
        fut.result()
        d.checkpoint_id = 2
        d["np"] = 3  # "np" was re-written at 1, so 0 retires on its manager
        d.checkpoint_id = 0
        m = d.which_manager("np")
        with pytest.raises(DDictCheckpointSyncError):
            d.manager(m)["np"]


@pytest.mark.one_host
def test_direct_reads_can_be_disabled(client):
    import dask

    with dask.config.set({"ddict.local-read": False}):
        with DDict(total_mem="32 MiB", client=client) as d:
            d["k"] = 1
            assert d["k"] == 1 and {d._core.channel(m).kind for m in range(2)} == {"uds"}


@pytest.mark.one_host
def test_direct_reads_stop_when_the_dictionary_is_destroyed(client):
    d = DDict(total_mem="32 MiB", client=client)
    d["k"] = 1
    other = DDict.attach(d.serialize())
    assert other["k"] == 1 and other._core.channel(d.which_manager("k")).kind == "shm"
    d.destroy()
    with pytest.raises(DDictClosedError):
        other["k"]  # never stale data from a removed shard, and closed means closed
    with pytest.raises(DDictClosedError):
        other["new"] = 1  # the write path (the host's socket) says so too
    other.detach()


@pytest.mark.one_host
def test_a_shard_this_process_manages_is_read_over_its_socket(client):
    from dask_ddict.transport.mapped import _ENVS, forget

    with DDict(total_mem="32 MiB", client=client) as d:
        d["k"] = 1
        m = d.which_manager("k")
        path = d._core.layout.managers[m].store_path
        assert d._core.channel(m).kind == "shm" and d["k"] == 1
        forget(path)  # what a restart placing the manager in this process does
        time.sleep(0.1)  # (past the channel's retry interval)
        d["k"] = 2
        assert d["k"] == 2 and "k" in d  # over the socket, never mapped here again
        assert d._core.channel(m).kind == "uds" and path not in _ENVS


def test_a_host_that_cannot_be_reached_fails_the_broadcast_with_its_own_error(client):
    """A request that cannot even be sent (connecting failed) is raised as it was, once
    the other hosts' answers are read; the links stay usable."""
    from dask_ddict import DDictManagerUnavailableError
    from dask_ddict.transport.socket_client import HostLink

    d = DDict(managers_per_worker=2, total_mem="32 MiB", client=client)  # 4 managers
    try:
        d.update({i: i for i in range(10)})
        send = HostLink.send
        hosts = {link for link, _ in d._core.routes(list(range(d.num_managers)))}
        unreachable = next(iter(hosts))

        def failing(self, o, mid, *rest):
            if self is unreachable:
                raise DDictManagerUnavailableError(f"manager {mid} is unreachable (test)")
            return send(self, o, mid, *rest)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(HostLink, "send", failing)
            with pytest.raises(DDictManagerUnavailableError, match=r"unreachable \(test\)"):
                len(d)
        assert len(d) == 10 and sum(s.num_keys for s in d.stats) == 10
    finally:
        d.destroy()
