"""The host's server alone: its operation table behind real sockets, a real shard, no cluster.

A :class:`HostServer` serves one :class:`Manager` over a Unix socket and TCP; the
client side is the real :class:`HostLink`/:class:`SocketChannel`, so every
operation makes the full trip: encode, dispatch through ``HANDLERS``, reply,
decode, and errors come back typed.
"""

from __future__ import annotations

import os
import secrets
import socket

import pytest

from dask_ddict._hashing import key_digest
from dask_ddict._keys import dumps_key
from dask_ddict._serialize import dumps_value, loads_value
from dask_ddict.errors import DDictClosedError, DDictError, DDictKeyError
from dask_ddict.host.server import HostedDict, HostServer
from dask_ddict.layout import ManagerInfo
from dask_ddict.shard.manager import Manager
from dask_ddict.shard.store import ShardStore
from dask_ddict.shard.working_set import WorkingSet
from dask_ddict.transport.links import HostLink, SocketChannel


@pytest.fixture
def served(tmp_path):
    uid, secret = secrets.token_hex(16), secrets.token_hex(32)
    store = ShardStore(str(tmp_path / "shard"), 16 << 20)
    hosted = HostedDict(uid, "srv", secret)
    hosted.managers[3] = Manager(3, store, WorkingSet(store, 1))
    uds = socket.socket(socket.AF_UNIX)
    path = str(tmp_path / "host.sock")
    uds.bind(path)
    uds.listen(16)
    tcp = socket.create_server(("127.0.0.1", 0))
    closed: set[bytes] = set()
    dicts = {hosted.key: hosted}
    server = HostServer(uds, tcp, dicts, closed)
    server.start()
    info = ManagerInfo(3, "w", "h", "h:b", os.getpid(), path, "127.0.0.1",
                       tcp.getsockname()[1], str(tmp_path / "shard"))  # fmt: skip
    links = []

    def channel(use_uds: bool, auth: str = secret) -> SocketChannel:
        link = HostLink(info, uid, auth, "srv", use_uds=use_uds)
        links.append(link)
        return SocketChannel(link, info)

    yield channel, dicts, closed
    for link in links:
        link.close()
    server.close()
    hosted.managers[3].close()


@pytest.mark.parametrize("use_uds", [True, False])
def test_every_table_operation_round_trips(served, use_uds):
    channel, _, _ = served
    ch = channel(use_uds)
    kb = dumps_key("k")
    d = key_digest(kb)
    ch.put(d, kb, dumps_value([1, 2]), 0, 1, False, None)
    assert loads_value(ch.get(d, 0, None)) == [1, 2]
    assert ch.contains(d, 0) and ch.length(0) == 1
    assert loads_value(ch.fetch_add(*map(key_digest, [dumps_key("n")]), dumps_key("n"), 0, 1, 4,
                                    None)) == 0  # fmt: skip
    items, _, more = ch.page(0, None, 3, 10)
    assert len(items) == 2 and not more
    assert ch.stats()["manager_id"] == 3
    assert loads_value(ch.pop(d, 0, 1, None)) == [1, 2]
    with pytest.raises(DDictKeyError):
        ch.get(d, 0, None)
    ch.freeze()
    with pytest.raises(DDictError, match="frozen"):
        ch.put(d, kb, dumps_value(1), 0, 1, False, None)
    ch.unfreeze()
    with pytest.raises(DDictError, match="unknown manager call"):
        ch.admin("close")


def test_a_wrong_secret_is_refused_over_tcp_and_a_closed_dict_says_so(served):
    channel, dicts, closed = served
    with pytest.raises(DDictError):
        channel(False, auth="0" * 64).length(0)
    assert channel(True).length(0) == 0
    (key,) = dicts
    hosted = dicts.pop(key)  # what the host process does when a dictionary is destroyed
    closed.add(key)
    with pytest.raises(DDictClosedError):
        channel(True).length(0)
    dicts[key] = hosted  # (for the fixture's teardown)
