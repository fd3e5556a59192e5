"""Channel selection (transport/channels.py) and the lifetime of a handle's core."""

from __future__ import annotations

import gc
import weakref

import dask

from dask_ddict import DDict
from dask_ddict.transport.channels import Channels
from dask_ddict.transport.ops import Contains
from dask_ddict.transport.shared import SharedChannel
from dask_ddict.transport.socket_client import SocketChannel


def test_same_host_channels_read_the_shard_unless_told_not_to(ddict):
    ddict["k"] = 1
    conns = Channels(ddict._core.layout)
    try:
        assert isinstance(conns.channel(0), SharedChannel)
        assert conns.channel(0) is conns.channel(0)  # created once
    finally:
        conns.close()
    with dask.config.set({"ddict.local-read": False}):
        conns = Channels(ddict._core.layout)
        try:
            ch = conns.channel(ddict.which_manager("k"))
            assert type(ch) is SocketChannel
            assert ch.call(Contains(ddict._route("k")[1], 0))
        finally:
            conns.close()


def test_a_dropped_handle_is_freed_at_once_not_by_the_cyclic_gc(ddict):
    """Its finalizer closes channels; run from the cyclic GC it could fire anywhere,
    e.g. inside another channel's open (a deadlock found in a create/destroy soak)."""
    gc.disable()
    try:
        h = DDict.attach(ddict.serialize())
        h.start_batch_put()
        h["a"] = 1
        h.end_batch_put()
        assert h["a"] == 1
        core = weakref.ref(h._core)
        del h
        assert core() is None
    finally:
        gc.enable()


def _use_in_task(d) -> list[str]:  # noqa: ANN001
    import pickle
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            h = pickle.loads(pickle.dumps(d))  # what a task does with a handle argument
            h["t"] = h["k"]
            del h
            gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


def test_tasks_that_unpickle_handles_leave_no_unclosed_sockets(ddict, client):
    ddict["k"] = 1
    assert client.submit(_use_in_task, ddict, pure=False).result() == []
    assert ddict["t"] == 1
