"""bput along a tree of host processes (``ddict.broadcast``): the sender sends one
request, the hosts forward it; a host of the tree that fails is named in the error."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import dask
import pytest
from distributed import Client

from dask_ddict import DDict
from dask_ddict.errors import DDictError
from dask_ddict.transport import broadcast
from dask_ddict.transport.ops import FanOut, TreeOut
from dask_ddict.transport.socket_client import HostLink
from tests.support.cluster import local_cluster

TREE = {"ddict.broadcast.tree-above": 1, "ddict.broadcast.branching-factor": 1}


def _sent(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The operations this process sends to host processes from now on."""
    sent: list[Any] = []
    send = HostLink.send

    def spy(self: HostLink, o: Any, mid: int, start: float | None = None) -> Any:
        sent.append(o)
        return send(self, o, mid, start)

    monkeypatch.setattr(HostLink, "send", spy)
    return sent


def test_tree_of_shapes() -> None:
    class L:
        def __init__(self, i: int) -> None:
            self.info = type(
                "I", (), {"tcp_host": "h", "tcp_port": i, "hostname": "x", "worker": f"w{i}"}
            )()

    routes = [(L(i), [i]) for i in range(1, 14)]
    tree = broadcast.tree_of(routes, 3)  # type: ignore[arg-type]
    assert len(tree) == 3 and [t[1] for t in tree] == [(1,), (6,), (10,)]
    from dask_ddict.transport.ops import subtree_mids

    assert sorted(subtree_mids(tree)) == list(range(1, 14))  # every host once

    def depth(t: tuple[Any, ...]) -> int:
        return 1 + max((depth(c[2]) for c in t), default=0) if t else 0

    assert depth(tree) == 3  # (13 hosts below the root, fan-out 3)
    assert broadcast.tree_of([], 3) == ()


def test_bput_along_a_tree(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    d = DDict(3, total_mem="48 MiB", client=client)
    try:
        with dask.config.set(TREE):
            sent = _sent(monkeypatch)
            d.bput("cfg", {"a": 1})
            big = os.urandom(1 << 20)
            d.bput("big", big)
        assert [type(o) for o in sent] == [TreeOut, TreeOut]  # one request each, to the root
        assert sent[0].children and sent[0].children[0][1]  # the other host, forwarded to
        for m in range(d.num_managers):
            assert d.manager(m)["cfg"] == {"a": 1}
            assert d.manager(m)["big"] == big
        assert d.bget("big") == big and len(d) == 2 * d.num_managers
        sent.clear()
        with dask.config.set({"ddict.broadcast.tree-above": 8}):  # (2 hosts: one request each)
            d.bput("cfg", 2)
        assert [type(o) for o in sent] == [FanOut, FanOut]
        assert all(d.manager(m)["cfg"] == 2 for m in range(d.num_managers))
    finally:
        d.destroy()


def test_tree_bput_keeps_errors(client: Client) -> None:
    """A manager's refusal comes back through the tree as the linear path raises it."""
    d = DDict(2, total_mem="16 MiB", client=client)
    try:
        d.freeze()
        with dask.config.set(TREE), pytest.raises(DDictError) as info:
            d.bput("x", 1)
        assert info.value.code == "INVALID_OPERATION"
        d.unfreeze()
        with dask.config.set(TREE):
            d.bput("x", 1)
        assert all(d.manager(m)["x"] == 1 for m in range(d.num_managers))
    finally:
        d.destroy()


def _stopped_child(c: Client, kill: bool) -> tuple[DDict, BaseException | None, Any]:
    """bput along a tree whose child host stops, and dies if ``kill``, mid-bput."""
    d = DDict(2, total_mem="16 MiB", client=c, timeout=3)
    last = d.num_managers - 1
    info = d._core.layout.managers[last]
    assert info.worker != d._core.layout.managers[0].worker  # (the root's child)
    pid = d.stats[last].pid
    d.bput("before", 0)  # (connections open)
    os.kill(pid, signal.SIGSTOP)  # the child stops: the root waits for it
    got: list[BaseException] = []

    def bput() -> None:
        try:
            with dask.config.set(TREE):
                d.bput("x", b"v" * 100_000)
        except BaseException as e:  # noqa: BLE001
            got.append(e)

    t = threading.Thread(target=bput)
    t.start()
    time.sleep(1.0)
    if kill:
        os.kill(pid, signal.SIGKILL)  # ... and dies mid-bput
    t.join(60)
    assert not t.is_alive()
    if not kill:
        os.kill(pid, signal.SIGCONT)
    return d, got[0] if got else None, info


def test_tree_bput_names_a_stopped_host() -> None:
    """A host of the tree that does not answer in time: the error names it (not the
    root, which did), and the other managers hold the pair."""
    with (
        local_cluster(2) as cl,
        Client(cl) as c,
    ):
        d, e, info = _stopped_child(c, kill=False)
        assert isinstance(e, DDictError), e
        msg = str(e)
        assert f"worker {info.worker}" in msg and f":{info.tcp_port}" in msg, msg
        assert all(
            d.manager(m)["x"] == b"v" * 100_000
            for m in range(d.num_managers)
            if d._core.layout.managers[m].worker != info.worker
        )
        d.destroy()


def test_tree_bput_survives_a_killed_host() -> None:
    """A host of the tree killed mid-bput: its supervisor restarts it over its shards, the
    forwarding host's link sends again, and every manager holds the pair (or the error
    names the host)."""
    with (
        local_cluster(2) as cl,
        Client(cl) as c,
    ):
        d, e, info = _stopped_child(c, kill=True)
        if e is None:
            assert all(d.manager(m)["x"] == b"v" * 100_000 for m in range(d.num_managers))
        else:
            assert f"worker {info.worker}" in str(e), e
        d.destroy()


def test_tree_bput_on_a_tls_cluster() -> None:
    """On a TLS cluster a host forwards over TLS with the cluster's certificates."""
    from distributed.security import Security

    sec = Security.temporary()
    with (
        local_cluster(2, security=sec) as cl,
        Client(cl, security=sec) as c,
    ):
        d = DDict(2, total_mem="16 MiB", client=c)
        try:
            with dask.config.set(TREE):
                d.bput("k", b"tls" * 1000)
            assert all(d.manager(m)["k"] == b"tls" * 1000 for m in range(d.num_managers))
        finally:
            d.destroy()
