"""A handle in a forked child: it shares nothing of its parent's key path.

``multiprocessing``'s fork context (Linux's default; a PyTorch ``DataLoader``'s workers)
copies the process with its handles.  Each test forks a real child of a process that
used a real dictionary (pooled connections, mapped shards, lent values), has both use
it at once, and checks every answer on both sides and what the child leaves behind.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import dask
import numpy as np
import pytest

from dask_ddict import DDict, kernels
from dask_ddict.errors import DDictError
from dask_ddict.transport import lending, mapped
from tests.support.forked import _CHILD_TIMEOUT, _in_child, answer_of
from tests.support.lent import in_shard
from tests.support.shards import snapshots


def _wrong(d: DDict, prefix: str, n: int, rounds: int) -> list[int]:
    """The keys of ``prefix`` whose value read back is not what was written."""
    return [i for _ in range(rounds) for i in range(n) if d.get(f"{prefix}{i}") != (prefix, i)]


def _store_of(d: DDict, key: Any) -> str:
    return d._core.layout.managers[d.which_manager(key)].store_path


def _remaps() -> bool:
    """Whether a forked child maps its parent's shards anew (the compiled kernels, with
    lmdb's engine), rather than reading them over their hosts' sockets."""
    if not kernels.COMPILED:
        return False
    from dask_ddict.kernels import _compiled

    return _compiled.engine_refusal() is None


@pytest.mark.parametrize("transport", ["uds", "tcp"])
def test_a_forked_child_reads_on_connections_of_its_own(client, transport):
    """Over sockets, a child that wrote its requests on its parent's pooled connections
    could read the parent's replies as its own, and the parent the child's."""
    settings = {"ddict.local-read": False, "ddict.local-transport": transport == "uds"}
    with dask.config.set(settings):
        with DDict(total_mem="64 MiB", client=client, timeout=20) as d:
            n = 200
            for prefix in "pc":
                for i in range(n):
                    d[f"{prefix}{i}"] = (prefix, i)
            assert _wrong(d, "p", n, 1) == []  # (the pool holds warm connections now)
            answer, p = _in_child(lambda: _wrong(d, "c", n, 5))
            mine = _wrong(d, "p", n, 5)
            theirs = answer()
            assert (mine, theirs) == ([], [])
            assert p.exitcode == 0
            d["after"] = 1  # the parent's connections still work
            assert d["after"] == 1


def test_a_forked_child_exits_without_touching_the_embedded_cluster():
    """A child's exit ran the embedded cluster's exit hook: it destroyed its parent's
    dictionary and waited for worker processes that were not its own.  And the child is
    a writer of its own, and says why it cannot reach the scheduler rather than wait for
    its parent's client forever."""
    with dask.config.set({"ddict.embedded.n-workers": 1}):
        d = DDict(total_mem="32 MiB")
    try:
        d["k"] = np.arange(10)
        m = d.manager(0)  # (a derived handle: the same writer as d)
        ids = (d._client_id, m._client_id)

        def child() -> list[Any]:
            seen = [int(d["k"].sum()), d._client_id, m._client_id]
            try:
                d.destroy()  # (closes the child's handle, and asks the scheduler)
                return [*seen, "destroyed"]
            except DDictError as e:
                return [*seen, str(e)]

        answer, p = _in_child(child)
        started = time.monotonic()
        total, mine, derived, said = answer()
        assert f"in process {os.getpid()}, which forked this one" in said
        # (a writer of its own, as a handle made there: wait_for_writers counts it apart)
        assert total == 45 and mine == derived and mine not in ids
        assert (d._client_id, m._client_id) == ids
        assert p.exitcode == 0 and time.monotonic() - started < 20
        assert int(d["k"].sum()) == 45  # not destroyed
        d["k2"] = 2
        assert d["k2"] == 2
    finally:
        d.destroy()


one_host = pytest.mark.one_host


@one_host
def test_a_value_lent_to_the_parent_is_copied_once_before_it_forks(client):
    """A lent value maps the shard's pages, kept unchanged by the parent's snapshot,
    which may end as soon as the fork returns: the parent copies what it lends before
    the fork (its views stay as they are, at the same addresses), the child shares that
    copy, and the child lends from snapshots of its own."""
    with DDict(total_mem="64 MiB", client=client) as d:
        a = np.arange(1 << 18, dtype="f8")  # 2 MiB
        d["a"] = a
        held = [d.get("a", copy=False)]
        assert in_shard(d, "a", held[0])

        def child() -> list[Any]:
            v = held.pop()
            said = [in_shard(d, "a", v), bool((v == a).all())]
            w = d.get("a", copy=False)
            said += [in_shard(d, "a", w), bool((w == a).all()), sorted(mapped._INHERITED)]
            del v, w
            gc.collect()
            return said

        answer, p = _in_child(child)
        *said, inherited = answer()
        assert said == [False, True, _remaps(), True]
        assert inherited == ([] if _remaps() else [_store_of(d, "a")])
        assert p.exitcode == 0
        assert not in_shard(d, "a", held[0]) and (held[0] == a).all()
        for i in range(6):
            d["a"] = a + i + 1
        assert (held[0] == a).all() and (d["a"] == a + 6).all()


@one_host
def test_a_child_forked_inside_a_lending_read_keeps_no_shard_descriptor(client):
    """A lending read holds the shard's file open while it maps values, in a snapshot; a
    child forked meanwhile (by another thread) must not keep its copy of that descriptor,
    count the parent's lent bytes or views as its own, nor end the parent's snapshot
    (its reader slot is shared memory)."""
    with DDict(total_mem="64 MiB", client=client) as d:
        d["a"] = np.arange(1 << 16, dtype="f8")
        mid, digest, _ = d._route("a")
        ch = d._core.channel(mid)
        view = ch._enter()
        assert view is not None
        try:
            with ch._reading(view, True) as (txn, out):
                v = out(ch._visible(view.store, digest, 0, txn, whole=False).frame)
                assert in_shard(d, "a", v)
                before = bytes(v)
                fd = view.lender.current.file[1]

                data = os.stat(_store_of(d, "a") + "/data.mdb")
                reading = snapshots(view.store.env)
                assert os.getpid() in [pid for pid, _ in reading]

                def child() -> list[Any]:
                    try:
                        held = os.path.samestat(os.fstat(fd), data)
                    except OSError:
                        held = False
                    gc.collect()
                    return [held, lending.lent_bytes(), len(mapped._ENVS), in_shard(d, "a", v)]

                answer, _ = _in_child(child)
                assert answer() == [False, 0, 0, False]
                assert os.path.samestat(os.fstat(fd), data)  # open until the read ends
                assert snapshots(view.store.env) == reading  # the child ended none of them
        finally:
            ch._exit(view)
        assert bytes(v) == before


@one_host
def test_a_child_forked_while_another_thread_reads_and_writes_the_shard(client):
    """py-lmdb counts the operations inside an environment; a child forked while a
    thread of its parent was inside one would wait forever for that thread to leave (it
    does not exist in the child) if it closed its copy of the environment: it reads that
    shard over the socket instead."""
    with DDict(total_mem="64 MiB", client=client) as d:
        d["x"] = np.zeros(1 << 14)
        stop, errors = threading.Event(), []

        def busy() -> None:
            i = 0
            while not stop.is_set():
                try:
                    d["x"] = np.full(1 << 14, i)
                    got = d["x"]
                    if got[0] != got[-1]:
                        errors.append(f"torn read {got[0]} {got[-1]}")
                except Exception as e:  # noqa: BLE001 - (said by the assertion below)
                    errors.append(repr(e))
                i += 1

        thread = threading.Thread(target=busy)
        thread.start()
        try:
            for _ in range(4):
                answer, p = _in_child(lambda: [float(d["x"].sum()) >= 0, d.get("y", 7)])
                assert answer() == [True, 7]
                assert p.exitcode == 0
        finally:
            stop.set()
            thread.join()
        assert errors == []


@one_host
def test_a_child_forked_inside_a_write_of_the_parent_reads_over_the_socket(client):
    """The deterministic case of the test above: a thread of the parent inside a write
    transaction of the shard (a same-host put copying a large value) at the fork."""
    with DDict(total_mem="64 MiB", client=client) as d:
        d["x"] = 1
        mid = d.which_manager("x")
        view = d._core.channel(mid)._enter()
        assert view is not None
        inside, leave = threading.Event(), threading.Event()

        def writer() -> None:
            with view.store.env.begin(write=True):
                inside.set()
                leave.wait(_CHILD_TIMEOUT)

        thread = threading.Thread(target=writer)
        thread.start()
        try:
            assert inside.wait(10)
            answer, p = _in_child(lambda: [d["x"], sorted(mapped._INHERITED)])
            assert answer() == [1, [_store_of(d, "x")]]
            assert p.exitcode == 0
        finally:
            leave.set()
            thread.join()
            d._core.channel(mid)._exit(view)


@one_host
def test_a_value_lent_as_the_parent_forks_is_copied_by_the_child(client, monkeypatch):
    """The parent copies what it lends before the fork; a value it could not copy (lent
    by another thread meanwhile: here, the parent's copy is skipped) is copied by the
    child as the fork returns, so that it never changes there."""
    with DDict(total_mem="64 MiB", client=client) as d:
        a = np.arange(1 << 16, dtype="f8")
        d["a"] = a
        v = d.get("a", copy=False)
        monkeypatch.setattr(lending.Lender, "_swap_out", lambda self: (0, 0, []))
        answer, _ = _in_child(lambda: [in_shard(d, "a", v), bool((v == a).all())])
        assert answer() == [False, True]
        assert in_shard(d, "a", v)  # (the parent's own is still lent)


def test_a_forked_child_of_a_lazy_handle_does_not_reach_the_parents_client(client):
    """A handle attached without ``client=`` finds its Dask client when it needs one; in
    a forked child it must not find the parent's (whose event loop does not run there)."""
    with DDict(total_mem="32 MiB", client=client) as d:
        e = DDict.attach(d.serialize())
        e["k"] = 1

        def child() -> list[Any]:
            started = time.monotonic()
            try:
                e.destroy()
                said = "destroyed"
            except DDictError as err:
                said = str(err)
            return [said, time.monotonic() - started < 5]

        said, quick = answer_of(child)
        assert "which forked this one" in said and quick
        assert d["k"] == 1


def test_a_batch_open_in_the_parent_is_its_own_in_the_child(client):
    """An open batch put is the parent's: its puts (buffered, or sent under its id) are
    the parent's to end; the child's handle holds a batch of its own."""
    with DDict(total_mem="64 MiB", client=client) as d:
        d.start_batch_put()
        for i in range(50):
            d[f"p{i}"] = i
        for i in range(64):  # (past ddict.batch.flush-bytes: some sent under its id)
            d[f"big{i}"] = b"x" * (4 << 10)

        def child() -> list[Any]:
            for i in range(50):
                d[f"c{i}"] = i
            d.end_batch_put()
            return [d[f"c{i}"] for i in range(50)]

        assert answer_of(child) == list(range(50))
        for i in range(50, 100):
            d[f"p{i}"] = i
        d.end_batch_put()
        assert d.get_many([f"p{i}" for i in range(100)]) == list(range(100))
        assert d.get_many([f"c{i}" for i in range(50)]) == list(range(50))
        assert len(d) == 214


def test_a_child_forked_with_commits_behind_its_parents_batch(client):
    """A parent forks while its same-host batch's flushes are being committed behind it
    (``ddict.batch.commit-behind``): the child has no commit thread of the parent's and
    does not wait for the parent's commits; its own batch starts a thread of its own.
    Both batches land whole."""
    small = {"ddict.batch.flush-bytes": "2 KiB", "ddict.local-transport": True}
    with dask.config.set(small), DDict(total_mem="64 MiB", client=client) as d:
        d.start_batch_put()
        for i in range(2000):
            d[f"p{i}"] = i

        def child() -> list[Any]:
            before = kernels.commits_behind()
            assert not any(f"c{i}" in d for i in range(20))  # (its shards mapped anew)
            for i in range(2000):
                d[f"c{i}"] = i
            d.end_batch_put()
            gc.collect()  # (the parent's commits, as copied: dropped without a wait)
            committed = kernels.commits_behind()[0] - before[0]
            return [d.get_many([f"c{i}" for i in range(2000)]), committed > 0]

        got, counted = answer_of(child)
        assert got == list(range(2000)) and counted == kernels.COMPILED
        d.end_batch_put()
        assert d.get_many([f"p{i}" for i in range(2000)]) == list(range(2000))
        assert len(d) == 4000
