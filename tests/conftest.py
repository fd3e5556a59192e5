"""Fixtures: one real process cluster per session, fresh shards per test."""

from __future__ import annotations

import glob
import os
import time

import psutil
import pytest
from distributed import Client, LocalCluster
from hypothesis import settings

# No time limit per example: a fuzz test checks results, not speed (speed is the
# benchmarks'), and on two cores shared with a cluster an example can take a while.
settings.register_profile("ddict", deadline=None)
settings.load_profile("ddict")


def shm_entries() -> set[str]:
    return set(glob.glob("/dev/shm/ddict-*"))


def stop_process(p) -> None:  # noqa: ANN001
    """SIGSTOP ``p`` (a ``psutil.Process``) and wait until it is stopped (the signal is
    delivered asynchronously: a request sent at once may still be served, or a write
    caught half done, holding the shard's writer lock)."""
    p.suspend()
    deadline = time.monotonic() + 10
    while p.status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"process {p.pid} did not stop"
        time.sleep(0.001)


def shards(d) -> set[str]:  # noqa: ANN001
    """The shard directories of a DDict: tests inspect only the files they created."""
    return {m.store_path for m in d._core.layout.managers}


#: ``DDICT_TEST_TWO_HOSTS=1``: the session cluster spans two hosts (this one and a network
#: namespace, see ``twohost.py``), so dictionaries of the core tests span both.
TWO_HOSTS = os.environ.get("DDICT_TEST_TWO_HOSTS") == "1"


@pytest.fixture(scope="session")
def cluster():
    """A LocalCluster with two worker processes (real spawn, real shared memory)."""
    if TWO_HOSTS:
        import twohost

        with twohost.TwoHosts() as hosts, Client(hosts.scheduler_address) as c:
            c.wait_for_workers(2, timeout=90)
            yield hosts
        return
    with LocalCluster(
        n_workers=2, threads_per_worker=2, processes=True, dashboard_address=":0"
    ) as cl:
        yield cl


@pytest.fixture
def client(cluster):
    with Client(cluster.scheduler_address if TWO_HOSTS else cluster) as c:
        yield c


@pytest.fixture
def ddict(client):
    """A fresh two-manager dictionary, destroyed after the test."""
    from dask_ddict import DDict

    d = DDict(total_mem="64 MiB", client=client)
    yield d
    d.destroy()


@pytest.fixture
def tmp_store(tmp_path):
    """A shard store in a temp directory (unit tests need no cluster)."""
    from dask_ddict.shard.store import ShardStore

    st = ShardStore(str(tmp_path / "shard"), 16 << 20)
    yield st
    st.destroy()
    assert not os.path.exists(str(tmp_path / "shard"))


@pytest.fixture(scope="session")
def s3():
    """A real S3-compatible server (moto_server) on a loopback port."""
    from s3server import S3Server

    with S3Server() as server:
        yield server
