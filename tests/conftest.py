"""Fixtures: one real process cluster per session, fresh shards per test."""

from __future__ import annotations

import os

import pytest
from distributed import Client
from hypothesis import settings

from tests.support.cluster import local_cluster
from tests.support.twohost import TWO_HOSTS

# No time limit per example: a fuzz test checks results, not speed (speed is the
# benchmarks'), and on two cores shared with a cluster an example can take a while.
settings.register_profile("ddict", deadline=None)
settings.load_profile("ddict")


@pytest.fixture(scope="session")
def cluster():
    """A LocalCluster with two worker processes (real spawn, real shared memory)."""
    if TWO_HOSTS:
        from tests.support.twohost import TwoHosts

        with TwoHosts() as hosts, Client(hosts.scheduler_address) as c:
            c.wait_for_workers(2, timeout=90)
            yield hosts
        return
    with local_cluster(2, threads_per_worker=2) as cl:
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
    from tests.support.s3server import S3Server

    with S3Server() as server:
        yield server
