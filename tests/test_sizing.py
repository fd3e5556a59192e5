"""The memory warning at creation fires when shards really crowd out the workers, not on
every default ``LocalCluster`` (whose memory limits already add up to the whole machine)."""

from __future__ import annotations

import warnings

import dask
import psutil
import pytest
from distributed import Client

from dask_ddict import DDict
from dask_ddict.client.workers import scheduler_workers
from dask_ddict.cluster.sizing import HostMemory, memory_warnings, pause_fraction
from tests.support.cluster import local_cluster

GiB = 1 << 30


def _sizing_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, RuntimeWarning) and "DDict shards" in str(w.message)
    ]


def test_a_default_local_cluster_does_not_warn():
    with (
        local_cluster(2) as cl,
        Client(cl) as c,
    ):
        limits = sum(w["memory_limit"] for w in scheduler_workers(c).values())
        # What the old check compared: this alone made every dictionary warn.
        assert limits + (64 << 20) > psutil.virtual_memory().total
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            d = DDict(total_mem="64 MiB", client=c)
        try:
            assert _sizing_warnings(caught) == []
            assert "warnings" not in d._core.layout.extra
        finally:
            d.destroy()


def test_shards_that_leave_the_workers_too_little_warn():
    """A real over-commit, with nothing allocated: shards not reserved at creation
    (``ddict.store.reserve: false``) of half the available memory, beside a worker
    allowed all of it.  The worker would grow to 80 % of it before Dask pauses it."""
    available = psutil.virtual_memory().available
    with (
        dask.config.set({"ddict.store.reserve": False}),
        local_cluster(1, memory_limit=available) as cl,
        Client(cl) as c,
    ):
        with pytest.warns(RuntimeWarning) as caught:
            d = DDict(total_mem=available // 2, client=c)
        d.destroy()
    said = _sizing_warnings(list(caught))
    assert len(said) == 1, said
    assert "before Dask pauses them" in said[0] and "lower memory_limit or total_mem" in said[0]
    assert {w.filename for w in caught} == {__file__}  # shown at the user's line


def test_shards_larger_than_the_memory_warn():
    """Two unreserved shards, each of which fits alone (so creation succeeds), that together
    exceed the host's memory and (on a machine whose /dev/shm is its RAM) the tmpfs."""
    available = psutil.virtual_memory().available
    shm_free = psutil.disk_usage("/dev/shm").free
    each = int(0.6 * min(available, shm_free))
    with (
        dask.config.set({"ddict.store.reserve": False}),
        local_cluster(1, memory_limit="1 GiB") as cl,
        Client(cl) as c,
    ):
        with pytest.warns(RuntimeWarning) as caught:
            d = DDict(2, total_mem=2 * each, client=c)
        d.destroy()
    said = _sizing_warnings(list(caught))
    assert any("exceed the memory there is for them" in s for s in said), said
    assert any("shard directory" in s for s in said) == (2 * each > shm_free), said


def test_the_rule():
    """Each over-commit alone, and the setups that are not one (unit test of the rule)."""
    ok = HostMemory(
        "h",
        available=20 * GiB,
        shard_dir_free=12 * GiB,
        shard_bytes=1 * GiB,
        unbacked=0,
        growth=19 * GiB,
    )
    assert memory_warnings(ok) == []
    # Reserved shards that leave the workers' growth no room: it would fit without them.
    crowded = HostMemory(
        "h",
        available=10 * GiB,
        shard_dir_free=12 * GiB,
        shard_bytes=8 * GiB,
        unbacked=0,
        growth=15 * GiB,
    )
    assert ["before Dask pauses them" in s for s in memory_warnings(crowded)] == [True]
    # A host short of memory whatever the shards: not the dictionary's to report.
    busy = HostMemory(
        "h",
        available=2 * GiB,
        shard_dir_free=12 * GiB,
        shard_bytes=GiB // 4,
        unbacked=0,
        growth=15 * GiB,
    )
    assert memory_warnings(busy) == []
    # Unreserved shards beyond the memory and the shard directory.
    over = HostMemory(
        "h",
        available=10 * GiB,
        shard_dir_free=12 * GiB,
        shard_bytes=16 * GiB,
        unbacked=16 * GiB,
        growth=0,
    )
    said = memory_warnings(over)
    assert len(said) == 2 and "shard directory" in said[0] and "exceed the memory" in said[1]
    assert pause_fraction({"pause": 0.8, "terminate": 0.95}) == 0.8
    assert pause_fraction({"pause": False, "terminate": 0.95}) == 0.95
    assert pause_fraction({"pause": False, "terminate": False}) == 1.0
