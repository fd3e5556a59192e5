"""Futures-like lifetime: a dictionary goes with the clients that hold it."""

from __future__ import annotations

import os
import signal
import time

import dask.config
import pytest
from distributed import Client

from dask_ddict import DDict, DDictClosedError
from dask_ddict.cluster.lifetime import Holders
from tests.support.piped import PipeProcess

# -- the pure structure -------------------------------------------------------------


class Clock:
    """``call_later`` by hand: tests fire the timers they mean to."""

    def __init__(self) -> None:
        self.pending: list[tuple[float, object, list[bool]]] = []

    def call_later(self, seconds: float, callback):  # noqa: ANN001, ANN201
        cancelled = [False]
        self.pending.append((seconds, callback, cancelled))

        class Handle:
            def cancel(self) -> None:
                cancelled[0] = True

        return Handle()

    def fire(self) -> None:
        pending, self.pending = self.pending, []
        for _, callback, cancelled in pending:
            if not cancelled[0]:
                callback()


@pytest.fixture
def holders():
    clock, released = Clock(), []
    h = Holders(lambda name, uid: released.append((name, uid)), clock.call_later, lambda: 2.0)
    return h, clock, released


def test_released_after_the_grace_when_the_creator_leaves(holders):
    h, clock, released = holders
    h.created("a", "uid-a", "c1")
    h.created("b", "uid-b", "c2")
    h.client_left("c1")
    assert h.release_pending("a") and not h.release_pending("b")
    assert [s for s, _, _ in clock.pending] == [2.0]
    clock.fire()
    assert released == [("a", "uid-a")] and h.holders("a") == []
    h.client_left("c1")  # leaving twice schedules nothing
    assert clock.pending == []


def test_a_client_back_within_the_grace_keeps_it(holders):
    h, clock, released = holders
    h.created("a", "uid-a", "c1")
    h.client_left("c1")
    h.client_came_back("c1")
    clock.fire()
    assert released == [] and h.holders("a") == ["c1"]
    h.client_left("c1")  # and a later departure starts a new grace
    clock.fire()
    assert released == [("a", "uid-a")]


def test_every_holder_must_leave(holders):
    h, clock, released = holders
    h.created("a", "uid-a", "c1")
    h.attached("a", "c2")
    h.client_left("c1")
    clock.fire()
    assert released == [] and h.holders("a") == ["c2"]
    h.client_left("c2")
    h.attached("a", "c3")  # attaching during the grace cancels the release
    clock.fire()
    assert released == []
    h.client_left("c3")
    clock.fire()
    assert released == [("a", "uid-a")]


def test_destroyed_or_cluster_lifetime_dicts_are_never_released(holders):
    h, clock, released = holders
    h.created("a", "uid-a", "c1")
    h.client_left("c1")
    h.forget("a")  # destroyed during its grace
    clock.fire()
    h.attached("cluster-dict", "c1")  # never created with lifetime="client": not tracked
    h.client_left("c1")
    clock.fire()
    assert released == [] and "pending_releases=[]" in repr(h)


# -- on a cluster ----------------------------------------------------------------------

_CREATOR = """
import os
from distributed import Client
from dask_ddict import DDict
client = Client({address!r})
d = DDict(total_mem="32 MiB", client=client, lifetime={lifetime!r})
d["written"] = "by the creator"
def handle(_):
    return d.serialize(), [m.store_path for m in d._core.layout.managers]
"""


def _creator(cluster, lifetime: str) -> tuple[PipeProcess, str, list[str]]:
    proc = PipeProcess(_CREATOR.format(address=cluster.scheduler_address, lifetime=lifetime))
    serialized, paths = proc.call(None)
    return proc, serialized, paths


def _kill(proc: PipeProcess) -> None:
    os.kill(proc.proc.pid, signal.SIGKILL)
    proc.proc.wait(30)


def _gone_within(client: Client, name: str, paths: list[str], seconds: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if name not in DDict.list(client) and not any(os.path.exists(p) for p in paths):
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"{name} still registered or its shards {paths} still exist")


def test_a_killed_creators_dict_is_released_and_its_shards_freed(cluster, client):
    with dask.config.set({"ddict.lifetime-grace-period": "1s"}):
        proc, serialized, paths = _creator(cluster, "client")
        d = DDict.attach(serialized, client=client)  # attaching by handle does not hold it
        assert d["written"] == "by the creator" and d.lifetime == "client"
        name = d.get_name()
        assert all(os.path.exists(p) for p in paths)
        _kill(proc)
        took = _gone_within(client, name, paths, 15)
    assert 0.9 <= took < 10, took
    with pytest.raises(DDictClosedError):
        d["written"]


def test_a_cluster_lifetime_dict_outlives_its_creator(cluster, client):
    with dask.config.set({"ddict.lifetime-grace-period": "0.2s"}):
        proc, serialized, paths = _creator(cluster, "cluster")
        _kill(proc)
        time.sleep(1.5)
        d = DDict.attach(serialized, client=client)
        try:
            assert d.get_name() in DDict.list(client) and d.lifetime == "cluster"
            assert d["written"] == "by the creator"
        finally:
            d.destroy()
    assert not any(os.path.exists(p) for p in paths)


def test_a_client_that_attached_by_name_holds_it(cluster, client):
    with dask.config.set({"ddict.lifetime-grace-period": "0.5s"}):
        proc, serialized, paths = _creator(cluster, "client")
        name = DDict.attach(serialized, client=client).get_name()
        with Client(cluster) as other:
            d = DDict.from_name(name, other)
            _kill(proc)
            time.sleep(1.5)
            assert d["written"] == "by the creator"  # `other` holds it
            d.detach()
        _gone_within(client, name, paths, 15)  # ...until `other` leaves too


def test_lifetime_is_checked(client):
    with pytest.raises(ValueError, match="lifetime must be one of 'client', 'cluster'"):
        DDict(total_mem="32 MiB", client=client, lifetime="forever")
    with dask.config.set({"ddict.lifetime": "cluster"}):
        d = DDict(total_mem="32 MiB", client=client)
    copy = d.copy()  # a copy keeps its source's lifetime
    try:
        assert d.lifetime == "cluster" and copy.lifetime == "cluster"
    finally:
        copy.destroy()
        d.destroy()
