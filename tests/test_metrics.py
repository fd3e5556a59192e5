"""The scheduler's ``/metrics``: ``dask_ddict_*`` series per dictionary and manager.

Scraped over HTTP from a real cluster and parsed with ``prometheus_client``'s own
parser; one module cluster, since two tests stop or kill a host process of it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import dask
import psutil
import pytest
from distributed import Client, LocalCluster
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from dask_ddict import DDict
from dask_ddict.cluster import metrics
from dask_ddict.stats import FIELDS, DDictManagerStats
from tests.support.cluster import local_cluster
from tests.support.handles import over_tcp  # every request goes to the host processes
from tests.support.polling import poll_for

Scrape = list[Sample]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    # Collections at most every 0.2 s (the scheduler runs in this process: it reads these).
    with (
        dask.config.set({"ddict.dashboard.refresh": "0.2 s"}),
        local_cluster(2) as cl,
    ):
        yield cl


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster) as c:
        yield c


def _scrape(cluster: LocalCluster) -> Scrape:
    url = cluster.dashboard_link.rsplit("/", 1)[0] + "/metrics"
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def _values(scrape: Scrape, name: str, ddict: str, **labels: str) -> dict[int, float]:
    """``name``'s samples of dictionary ``ddict`` (and ``labels``), by manager id."""
    return {
        int(s.labels["manager"]): s.value
        for s in scrape
        if s.name == name
        and s.labels.get("ddict") == ddict
        and all(s.labels.get(k) == v for k, v in labels.items())
    }


def _until(cluster: LocalCluster, ok: Callable[[Scrape], bool], what: str) -> Scrape:
    """Scrape until ``ok`` (a scrape shows the snapshot that the one before started)."""
    last: list[Scrape] = []

    def scraped() -> bool:
        last[:] = [_scrape(cluster)]
        return ok(last[0])

    poll_for(scraped, 30, lambda: f"{what}: {[s for s in last[0] if 'ddict' in s.name]}", 0.1)
    return last[0]


def _gets(scrape: Scrape, name: str) -> float:
    return sum(_values(scrape, "dask_ddict_operations_served_total", name, op="get").values())


def test_two_dictionaries_their_managers_and_counts(cluster: LocalCluster, client: Client) -> None:
    a = DDict(name="metrics-a", total_mem="64 MiB", client=client)
    b = DDict(name="metrics-b", total_mem="32 MiB", managers_per_worker=2, client=client)
    try:
        for i in range(50):
            a[i] = i
        b.update({f"k{i}": bytes(100) for i in range(20)})
        b.checkpoint()
        b["later"] = 1  # at checkpoint 1
        assert [a[i] for i in range(10)] == list(range(10))  # same host: read from the shards
        tcp = over_tcp(a)
        assert [tcp[i] for i in range(10)] == list(range(10))  # ten gets the hosts serve

        def listed(s: Scrape) -> bool:
            return (
                sum(_values(s, "dask_ddict_keys", "metrics-a").values()) == 50
                and sum(_values(s, "dask_ddict_keys", "metrics-b").values()) == 21
                and _gets(s, "metrics-a") >= 10
            )

        scrape = _until(cluster, listed, "listed both dictionaries")
        assert {s.labels["ddict"] for s in scrape if s.name == "dask_ddict_manager_up"} >= {
            "metrics-a",
            "metrics-b",
        }
        for name, d in (("metrics-a", a), ("metrics-b", b)):
            mids = range(d.num_managers)
            assert _values(scrape, "dask_ddict_manager_up", name) == {m: 1.0 for m in mids}
            capacity = _values(scrape, "dask_ddict_capacity_bytes", name)
            assert capacity == {m: d.stats[m].total_bytes for m in mids}
            assert all(c > 0 for c in capacity.values())
            assert all(v > 0 for v in _values(scrape, "dask_ddict_used_bytes", name).values())
            workers = {
                int(s.labels["manager"]): s.labels["worker"]
                for s in scrape
                if s.name == "dask_ddict_keys" and s.labels["ddict"] == name
            }
            assert workers == dict(enumerate(d.manager_workers))
            assert _values(scrape, "dask_ddict_host_restarts_total", name) == {m: 0 for m in mids}
            assert _values(scrape, "dask_ddict_persisted_checkpoint", name) == {}  # none persisted
        newest = _values(scrape, "dask_ddict_newest_checkpoint", "metrics-b")
        assert newest[b.which_manager("later")] == 1.0
        assert _values(scrape, "dask_ddict_newest_checkpoint", "metrics-a") == {0: 0.0, 1: 0.0}
        assert _gets(scrape, "metrics-a") == 10  # the same-host handle's reads never reach them
        assert _gets(scrape, "metrics-b") == 0
        age = [s.value for s in scrape if s.name == "dask_ddict_snapshot_age_seconds"]
        assert len(age) == 1 and 0 <= age[0] < 30

        # More gets: the counters grow by exactly as many, in /metrics and in d.stats
        # (whose broadcast answer the host keeps only while nothing else was served).
        before = {m: s.ops_served.get("get", 0) for m, s in enumerate(tcp.stats)}
        assert sum(before.values()) == 10 and tcp.stats[0].host_restarts == 0
        for i in range(30):
            tcp[i]
        after = {m: s.ops_served.get("get", 0) for m, s in enumerate(tcp.stats)}
        assert sum(after.values()) == 40
        assert all(
            after[m] - before[m] == sum(tcp.which_manager(i) == m for i in range(30))
            for m in (0, 1)
        )
        scrape = _until(cluster, lambda s: _gets(s, "metrics-a") >= 40, "counted 30 more gets")
        assert _gets(scrape, "metrics-a") == 40
        assert _values(scrape, "dask_ddict_operations_served_total", "metrics-a", op="get") == after
        tcp.detach()

        # A broadcast counts once for each manager (b has two on each host: one request
        # per host), a get_many once for each manager it reaches.  d.stats is a broadcast
        # whose answer a host keeps while its shards are unchanged: not past other requests.
        tcp = over_tcp(b)
        tcp.checkpoint_id = b.checkpoint_id  # (1: checkpoint 0 retired where "later" went)
        assert all("len" not in s.ops_served for s in tcp.stats)
        assert len(tcp) == 21 and len(tcp) == 21
        assert [s.ops_served["len"] for s in tcp.stats] == [2] * 4
        assert tcp.get_many([f"k{i}" for i in range(5)]) == [bytes(100)] * 5
        reached = {b.which_manager(f"k{i}") for i in range(5)}
        ops = "dask_ddict_operations_served_total"
        scrape = _until(
            cluster,
            lambda s: sum(_values(s, ops, "metrics-b", op="len").values()) >= 8,
            "counted the broadcasts",
        )
        assert _values(scrape, ops, "metrics-b", op="len") == {m: 2 for m in range(4)}
        assert _values(scrape, ops, "metrics-b", op="get_many") == {m: 1 for m in reached}
        tcp.detach()
    finally:
        a.destroy()
        b.destroy()
    gone = _until(
        cluster,
        lambda s: not _values(s, "dask_ddict_manager_up", "metrics-a"),
        "dropped a destroyed dictionary",
    )
    assert not _values(gone, "dask_ddict_keys", "metrics-b")


def _host(d: DDict, mid: int) -> psutil.Process:
    return psutil.Process(d.stats[mid].pid)


def test_an_unreachable_manager_is_down_and_the_rest_still_reported(
    cluster: LocalCluster, client: Client
) -> None:
    d = DDict(name="metrics-stopped", total_mem="64 MiB", client=client)
    try:
        d.update({i: i for i in range(40)})
        host = _host(d, 1)
        _until(
            cluster,
            lambda s: _values(s, "dask_ddict_manager_up", d.get_name()) == {0: 1.0, 1: 1.0},
            "saw both managers up",
        )
        host.suspend()  # manager 1 accepts connections but never answers
        try:
            scrape = _until(
                cluster,
                lambda s: _values(s, "dask_ddict_manager_up", d.get_name()) == {0: 1.0, 1: 0.0},
                "marked the stopped manager down",
            )
        finally:
            host.resume()
        keys = _values(scrape, "dask_ddict_keys", d.get_name())
        assert keys == {0: sum(d.which_manager(i) == 0 for i in range(40))}  # only the live one
        assert 1 not in _values(scrape, "dask_ddict_capacity_bytes", d.get_name())
        _until(
            cluster,
            lambda s: _values(s, "dask_ddict_manager_up", d.get_name()) == {0: 1.0, 1: 1.0},
            "saw the resumed manager up again",
        )
    finally:
        d.destroy()


def test_a_restarted_host_is_counted_and_its_shard_reported(
    cluster: LocalCluster, client: Client
) -> None:
    d = DDict(name="metrics-restarted", total_mem="64 MiB", client=client)
    try:
        d.update({i: i for i in range(40)})
        name = d.get_name()
        scrape = _until(
            cluster,
            lambda s: len(_values(s, "dask_ddict_keys", name)) == 2,
            "reported both managers",
        )
        restarts = _values(scrape, "dask_ddict_host_restarts_total", name)
        keys = _values(scrape, "dask_ddict_keys", name)
        old = d.stats[0].pid
        os.kill(old, signal.SIGKILL)  # its supervisor starts a new host over the same shard

        def restarted(s: Scrape) -> bool:
            return _values(s, "dask_ddict_host_restarts_total", name).get(0) == restarts[0] + 1

        scrape = _until(cluster, restarted, "counted the restart")
        assert _values(scrape, "dask_ddict_host_restarts_total", name)[1] == restarts[1]
        assert _values(scrape, "dask_ddict_manager_up", name) == {0: 1.0, 1: 1.0}
        assert _values(scrape, "dask_ddict_keys", name) == keys  # the shard lived on
        assert d.stats[0].pid != old and d.stats[0].host_restarts == restarts[0] + 1
    finally:
        d.destroy()


# -- without a cluster ------------------------------------------------------------------


def test_an_older_managers_stats_record_gets_the_new_fields_defaults() -> None:
    old = tuple(range(len(FIELDS) - 4))  # from before ops_served, host_restarts, persisted_ids
    s = DDictManagerStats.from_record(old)  # and replicas
    assert (s.deferred_ops, s.ops_served, s.host_restarts, s.persisted_ids, s.replicas) == (
        old[-1],
        {},
        0,
        (),
        0,
    )
    t = DDictManagerStats.from_record(old)
    assert s.ops_served is not t.ops_served  # each its own dict
    assert DDictManagerStats.from_dict({"manager_id": 3}).ops_served == {}


def test_without_prometheus_client_the_plugin_registers_nothing(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # (import fails)
    before, loop = list(metrics._started), asyncio.new_event_loop()
    try:
        assert metrics.register(_Data("absent"), loop) is None
    finally:
        loop.close()
    assert metrics._started == before
    metrics.unregister(None)  # what the plugin's close does then: nothing


class _Data:
    """What a collector reads of DashboardData."""

    def __init__(self, name: str) -> None:
        self.name, self.refreshed = name, 0

    def refresh(self) -> None:
        self.refreshed += 1

    def latest(self) -> tuple[list[dict[str, Any]], float]:
        row = {"manager_id": 0, "worker": "tcp://w:1", "hostname": "h", "num_keys": None}
        return [{"name": self.name, "managers": [row]}], 0.5


def _registered() -> set[str]:
    """The dictionaries on /metrics now (collecting this package's collector alone)."""
    ours = REGISTRY.restricted_registry(["dask_ddict_manager_up"])
    return {
        s.labels["ddict"]
        for f in ours.collect()
        for s in f.samples
        if s.name == "dask_ddict_manager_up"
    }


def test_the_last_started_scheduler_is_reported_and_the_one_before_comes_back() -> None:
    loop = asyncio.new_event_loop()
    first = second = None
    try:
        first = metrics.register(_Data("first"), loop)
        assert _registered() == {"first"}
        second = metrics.register(_Data("second"), loop)
        assert _registered() == {"second"}  # (names registered twice: the registry refuses)
        metrics.unregister(second)
        assert _registered() == {"first"}
        metrics.unregister(second)  # twice: nothing happens
        metrics.unregister(first)
        assert not {"first", "second"} & _registered()
        loop.run_until_complete(asyncio.sleep(0))  # the scrapes asked for refreshes
        assert first._data.refreshed == 2 and second._data.refreshed == 1
    finally:
        metrics.unregister(second)
        metrics.unregister(first)
        loop.close()
