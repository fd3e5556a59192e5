"""Many keys per round trip: get_many, batches of puts, and gathered async gets.

Counted where it matters: how many requests reach the host processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import dask
import numpy as np
import psutil
import pytest
from distributed import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dask_ddict import AsyncDDict, DDict, DDictKeyError, DDictSerializationError
from dask_ddict.transport import ops, socket_client
from dask_ddict.transport.many_key_ops import GetMany, PutMany
from tests.support.processes import stop_process


def _tcp(d: DDict, client: Client) -> DDict:
    """A handle that reaches every manager over TCP (as another host would)."""
    with dask.config.set({"ddict.local-transport": False}):
        t = DDict.attach(d.serialize(), client=client)
        for m in range(d.num_managers):
            t._core.channel(m)
    return t


@pytest.fixture
def requests(monkeypatch):
    """Every request sent to a host process, as ``(operation class, manager ids)``."""
    sent: list[tuple[type, tuple[int, ...]]] = []
    call, send = (
        socket_client.HostLink.call,
        socket_client.HostLink.send,
    )  # (every request goes out by one)

    def note(o, mid):  # noqa: ANN001, ANN202
        mids = (
            tuple(g[0] for g in o.groups)
            if isinstance(o, GetMany)
            else tuple(sorted({r[0] for r in o.records}))
            if isinstance(o, (ops.BatchPut, PutMany))
            else (mid,)
        )
        sent.append((type(o), mids))

    monkeypatch.setattr(
        socket_client.HostLink, "call", lambda self, o, mid: note(o, mid) or call(self, o, mid)
    )
    monkeypatch.setattr(
        socket_client.HostLink,
        "send",
        lambda self, o, mid, *rest: note(o, mid) or send(self, o, mid, *rest),
    )
    return sent


@contextlib.contextmanager
def _stopped_hosts(d: DDict) -> Iterator[None]:
    """``d``'s host processes stopped (SIGSTOP) inside the block, resumed after it."""
    hosts = [psutil.Process(pid) for pid in {s.pid for s in d.stats}]
    try:
        for h in hosts:
            stop_process(h)
        yield
    finally:
        for h in hosts:
            h.resume()


def _hosts(d: DDict) -> int:
    return len({(m.tcp_host, m.tcp_port) for m in d._core.layout.managers})


def test_get_many_returns_values_in_key_order_with_one_request_per_host(client, requests):
    with DDict(total_mem="64 MiB", client=client, managers_per_worker=2) as d:
        keys = [f"k{i}" for i in range(1000)]
        d.update({k: i for i, k in enumerate(keys)})
        d["arr"] = np.arange(10_000)
        t = _tcp(d, client)
        for h in (d, t):
            requests.clear()
            got = h.get_many(keys + ["arr", "k3"])
            first = [r for r in requests if r[0] is GetMany]
            assert got[:1000] == list(range(1000)) and got[-1] == 3
            assert (got[1000] == np.arange(10_000)).all()
            assert h.get_many([]) == []
            assert h.get_many(iter(["k1", "nope", "k2"]), default=None) == [1, None, 2]
            with pytest.raises(DDictKeyError) as e:
                h.get_many(["k1", ("missing", 7)])
            assert e.value.key == ("missing", 7) and "missing" in str(e.value)
        # over TCP: one request per host process, each for all of its managers the keys are on
        assert len(first) == _hosts(d) and all(len(mids) == 2 for _, mids in first)
        t.detach()


def test_a_get_many_of_a_stopped_host_times_out_once(client):
    """A thousand keys on stopped hosts over TCP: one timeout for the call, within the
    timeout (plus its slack), counted from the call for every host; the connections
    serve the next call once the hosts go on."""
    from dask_ddict import DDictTimeoutError, config

    slack = config.get_seconds("transport.timeout-slack") or 0.0
    with DDict(total_mem="16 MiB", client=client) as d:
        n = 1000
        d.update({i: i for i in range(n)})
        with dask.config.set({"ddict.local-transport": False}):
            t = DDict.attach(d.serialize(), client=client, timeout=1)
            t.get_many(range(n))  # connected before the hosts stop (a handshake waits)
        with _stopped_hosts(d):
            t0 = time.monotonic()
            with pytest.raises(DDictTimeoutError):
                t.get_many(range(n))
            took = time.monotonic() - t0
        assert took < 1 + slack + 1.5
        assert t.get_many(range(n)) == list(range(n))
        t.detach()


def test_get_many_through_a_small_route_cache_reads_every_key_as_written(client):
    """Keys that a dict confuses (``1``, ``True``, ``1.0``) or that are equal to a kept
    ``str`` (a subclass) are each read as written, over a cache of 8 routes that
    forgets them all many times over (``ddict.transport.route-cache``), same host
    and over TCP; with none kept the answers are the same."""
    keys: list[Any] = [1, True, 1.0, "1", Label("1"), *(f"k{i}" for i in range(40))]
    with DDict(total_mem="16 MiB", client=client, managers_per_worker=2) as d:
        for i, k in enumerate(keys):
            d[k] = i
        for size in (8, 0):
            with dask.config.set({"ddict.transport.route-cache": size}):
                same = DDict.attach(d.serialize(), client=client)
                tcp = _tcp(d, client)
            for h in (same, tcp):
                for _ in range(3):
                    assert h.get_many(keys) == list(range(len(keys)))
                    assert h.get_many(keys[::-1]) == list(range(len(keys)))[::-1]
                router = h._routing()[0]
                assert router.cached == size and len(router._routes) <= size
                h.detach()


@pytest.mark.one_host
def test_a_get_many_over_a_shard_and_a_socket_at_once_reads_every_value(client):
    """One handle reads manager 0 from its shard (values decoded in the shard's snapshot)
    and manager 1 over TCP (frames, decoded after), in one ``get_many``: every value as
    written, absent keys as absent, the same with ``copy=False`` and a custom value
    pickler (never decoded in the snapshot), and after the values change."""
    values: list[Any] = [b"x" * 100, None, "text", [1, (2, 3)], np.arange(5000), 7, b""]
    keys = [f"k{i}" for i in range(60)]
    with DDict(total_mem="64 MiB", client=client) as d:
        want = {k: values[i % len(values)] for i, k in enumerate(keys)}
        d.update(want)
        h = DDict.attach(d.serialize(), client=client)
        h._core.channel(0)  # (a shard of this host: read in place)
        with dask.config.set({"ddict.local-transport": False}):
            h._core.channel(1)  # (the other over TCP, as from another host)
        assert {h._core.channel(0).kind, h._core.channel(1).kind} == {"shm", "tcp"}
        asked = [*keys, "missing", keys[3]]
        for copy in (True, False):
            got = h.get_many(asked, default="none", copy=copy)
            assert got[-2] == "none" and _same(got[-1], want[keys[3]])
            assert all(_same(g, want[k]) for g, k in zip(got, keys))
        d.update({k: ("new", k) for k in keys[:10]})
        assert h.get_many(keys[:10]) == [("new", k) for k in keys[:10]]
        p = h.pickler(value_pickler=pickle)  # (a handle's own pickler: decoded after)
        p.update({k: ("mine", k) for k in keys[:10]})
        assert p.get_many([*keys[:10], "missing"], default=0) == [
            *(("mine", k) for k in keys[:10]),
            0,
        ]
        h.detach()


def _same(a: Any, b: Any) -> bool:
    return bool((a == b).all()) if isinstance(b, np.ndarray) else a == b


class Label(str):
    """A key equal to a ``str`` that pickles as another class (so is another key)."""


@pytest.mark.one_host
def test_get_many_on_the_same_host_sends_nothing(client, requests):
    with DDict(total_mem="64 MiB", client=client, managers_per_worker=2) as d:
        d.update({i: i for i in range(100)})
        requests.clear()
        assert d.get_many(range(100)) == list(range(100))
        assert not [r for r in requests if r[0] is GetMany]


@pytest.mark.one_host
def test_a_same_host_get_many_reads_each_shard_in_place_or_leaves_it_to_the_request(
    client, monkeypatch
):
    """Every shard mapped here: each manager's values are written in the keys' order as
    its shard is walked (one ``place_many`` per manager, no request); absent keys give
    the default, or ``DDictKeyError`` naming the first absent one in the keys' order; a
    manager-directed handle reads its manager alone.  Where a shard declines (under
    ``wait_for_keys``: a reader may have to wait) the whole read takes the ``GetMany``
    path, and the values are the same."""
    from dask_ddict.transport.shared import SharedChannel

    placed: list[tuple[int, bool]] = []
    place = SharedChannel.place_many

    def spy(self, *args):  # noqa: ANN001, ANN002, ANN202
        done = place(self, *args)
        placed.append((self._mid, done))
        return done

    monkeypatch.setattr(SharedChannel, "place_many", spy)
    with DDict(total_mem="64 MiB", client=client, managers_per_worker=2) as d:
        want = {f"k{i}": (i, "v") if i % 3 else b"x" * i for i in range(300)}
        d.update(want)
        d.get_many(list(want))  # (the first read maps the shards; then they are read in place)
        placed.clear()
        asked = ["k7", "nope-1", *want, "nope-2"]
        got = d.get_many(asked, default=None)
        assert got == [want["k7"], None, *want.values(), None]
        assert sorted(placed) == [(m, True) for m in range(d.num_managers)]
        with pytest.raises(DDictKeyError, match="nope-1"):
            d.get_many(asked)
        m1 = d.manager(1)
        mine = [k for k in want if d.which_manager(k) == 1]
        placed.clear()
        assert m1.get_many([*mine, "k0" if d.which_manager("k0") != 1 else "zz"], "-") == [
            *(want[k] for k in mine),
            "-",
        ]
        assert placed == [(1, True)]
    with DDict(
        total_mem="32 MiB", client=client, wait_for_keys=True, working_set_size=2, timeout=30
    ) as w:
        w.pput("p", "persistent")
        w["a"] = 1
        w.get_many(["p", "a"])
        placed.clear()
        assert w.get_many(["p", "a"]) == ["persistent", 1]
        assert placed and not any(done for _, done in placed)  # (each declined: GetMany's)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    keys=st.lists(
        st.one_of(
            st.integers(-5, 40), st.text(max_size=3), st.tuples(st.integers(0, 3), st.booleans())
        ),
        max_size=60,
    )
)
def test_get_many_agrees_with_get_key_by_key(ddict, keys):
    ddict.update({k: [k, "v"] for k in keys[::2]})
    assert ddict.get_many(keys, default="absent") == [ddict.get(k, "absent") for k in keys]
    ddict.clear()


@pytest.mark.parametrize("per_host", [1, 3])
def test_a_tcp_get_many_of_one_or_several_managers_per_host_reads_every_value(client, per_host):
    """A host answers a many-key read in its compiled loop: the frames of one manager
    straight from its snapshot, those of several (whose snapshots end one another)
    through a copy; values of every size it answers there, and absent keys, in the keys'
    order."""
    with DDict(total_mem="64 MiB", managers_per_worker=per_host, client=client) as d:
        values = {f"k{i}": bytes([i % 251]) * (i * 37 % 3000) for i in range(300)}
        values.update({f"a{i}": np.full(i % 50 + 1, i) for i in range(100)})
        d.update(values)
        keys = [*values, "absent-1", *reversed(list(values)), "absent-2"]
        got = _tcp(d, client).get_many(keys, default=None)
        for k, v in zip(keys, got, strict=True):
            if isinstance(v, np.ndarray):
                assert (v == values[k]).all()
            else:
                assert v == values.get(k)


def test_get_many_under_wait_for_keys_waits_for_the_writer(client):
    with DDict(
        total_mem="32 MiB", client=client, wait_for_keys=True, working_set_size=2, timeout=30
    ) as d:
        d.pput("p", "persistent")
        d["a"] = 1
        d.checkpoint()  # a task gets the handle at checkpoint 1, and writes there
        fut = client.submit(lambda h: (time.sleep(0.5), h.__setitem__("a", 2)), d, pure=False)
        assert d.get_many(["p", "a"]) == ["persistent", 2]  # "a" waited for checkpoint 1
        fut.result()


def test_a_batch_is_one_request_per_host_per_flush(client, requests):
    with DDict(total_mem="64 MiB", client=client, managers_per_worker=2) as d:
        t = _tcp(d, client)
        requests.clear()
        t.start_batch_put()
        for i in range(200):
            t[i] = i
        t.end_batch_put()
        batches = [mids for kind, mids in requests if kind is ops.BatchPut]
        assert len(batches) == _hosts(d)  # 200 small puts: one flush, one request per host
        assert all(len(mids) == 2 for mids in batches)  # each carries both of its managers
        assert t.get_many(range(200)) == list(range(200)) and len(d) == 200
        t.detach()


@pytest.mark.one_host
def test_a_same_host_batch_is_committed_by_the_client_in_one_transaction_per_shard(
    client, requests
):
    with DDict(total_mem="64 MiB", client=client) as d:
        d.update({i: i for i in range(500)})
        assert not [r for r in requests if r[0] in (ops.BatchPut, ops.BatchEnd)]
        t = _tcp(d, client)
        assert t.get_many(range(500)) == list(range(500)) and len(t) == 500
        d.freeze()  # the client may not commit into a frozen shard: the managers refuse
        with pytest.raises(Exception, match="frozen"):
            d.update({"x": 1})
        d.unfreeze()
        d.checkpoint()  # beyond the window: the managers move it, so they get the batch
        d.update({"y": 2})
        assert [r for r in requests if r[0] is ops.BatchPut]
        assert d["y"] == 2
        t.detach()


def _calls(monkeypatch: pytest.MonkeyPatch, method: str) -> Counter[int]:
    """How many times ``DDict.<method>`` is called, by the length of its first argument."""
    calls: Counter[int] = Counter()
    real = getattr(DDict, method)

    def counted(self, items, *args):  # noqa: ANN001, ANN002, ANN202
        items = list(items)
        calls[len(items)] += 1
        return real(self, items, *args)

    monkeypatch.setattr(DDict, method, counted)
    return calls


@pytest.mark.one_host
def test_a_batch_keeps_the_order_of_its_puts_to_one_key(client):
    """A large value goes to the manager (no reply); a later small put of the same key
    must not be committed here before it: the last put of a batch wins."""
    with DDict(total_mem="64 MiB", client=client) as d:
        for _ in range(10):
            d.start_batch_put()
            d["k"] = np.zeros(12_800)  # 100 KiB: the manager's to apply
            d["k"] = "small"  # would be committed here, ahead of it
            d.end_batch_put()
            assert d["k"] == "small"


def test_asyncio_gather_over_a_thousand_gets_is_one_get_many(client, monkeypatch):
    calls = _calls(monkeypatch, "_many_async")

    async def main() -> None:
        async with Client(client.scheduler.address, asynchronous=True) as ac:
            ad = await AsyncDDict.create(total_mem="32 MiB", client=ac)
            await ad.update({i: i * i for i in range(1000)})
            got = await asyncio.gather(*(ad.get(i) for i in range(1000)), ad.get("nope", "dflt"))
            assert list(got) == [i * i for i in range(1000)] + ["dflt"]
            assert calls == {1001: 1}
            assert await ad[5] == 25
            with pytest.raises(DDictKeyError):
                await ad["nope"]
            bad = await asyncio.gather(ad.get(1), ad.get(threading.Lock()), return_exceptions=True)
            assert bad[0] == 1 and isinstance(bad[1], DDictSerializationError)  # only its get
            assert await ad.get_many([1, 2]) == [1, 4]
            await ad.destroy()

    asyncio.run(main())


def test_many_puts_are_one_request_per_host_each_acknowledged_on_its_own(client, requests):
    with DDict(total_mem="16 MiB", client=client, managers_per_worker=2) as d:
        t = _tcp(d, client)
        requests.clear()
        pairs = [(i, i * 10) for i in range(300)] + [("big", np.zeros(2 << 20)), ("after", 1)]
        errors = t._put_many(pairs)
        sent = [mids for kind, mids in requests if kind is PutMany]
        assert len(sent) == _hosts(d) and all(len(mids) == 2 for mids in sent)
        assert [i for i, e in enumerate(errors) if e is not None] == [300]  # only "big"
        assert "cannot fit" in str(errors[300])
        assert t.get_many([p[0] for p in pairs[:300]] + ["after"]) == [
            i * 10 for i in range(300)
        ] + [1]
        d.freeze()
        errors = t._put_many([(1, 1), (2, 2)])
        assert all(e is not None and "frozen" in str(e) for e in errors)
        errors = d._put_many([(1, 1), (2, 2)])  # same host: the shard refuses as well
        assert all(e is not None and "frozen" in str(e) for e in errors)
        d.unfreeze()
        assert d._put_many([(1, -1), (2, -2)]) == [None, None] and t.get_many([1, 2]) == [-1, -2]
        t.detach()


def test_asyncio_gather_over_a_thousand_puts_is_one_many_put(client, monkeypatch):
    calls = _calls(monkeypatch, "_put_many")

    async def main() -> None:
        async with Client(client.scheduler.address, asynchronous=True) as ac:
            ad = await AsyncDDict.create(total_mem="128 MiB", client=ac)
            await asyncio.gather(*(ad.put(i, -i) for i in range(1000)))
            assert calls == {1000: 1}
            assert await ad.get_many(range(1000)) == [-i for i in range(1000)]
            got = await asyncio.gather(
                ad.put("ok", 1),
                ad.put("big", np.zeros(16 << 20)),
                ad.pput("p", 2),
                return_exceptions=True,
            )
            assert got[0] is None and got[2] is None and "cannot fit" in str(got[1])
            assert await ad.get("ok") == 1 and await ad.get("p") == 2
            many = [np.full(1 << 20, i) for i in range(5)]  # 8 MiB each: 40 MiB together
            await asyncio.gather(*(ad.put(("m", i), v) for i, v in enumerate(many)))
            got = await ad.get_many([("m", i) for i in range(5)])
            assert all((g == i).all() for i, g in enumerate(got))
            await ad.destroy()

    asyncio.run(main())


def test_gathered_gets_of_a_stopped_host_time_out_once(client):
    """A batch of gets that fails for a reason of the host's fails once, within the
    timeout (plus its slack): not one timeout per key, one after another."""
    from dask_ddict import DDictTimeoutError, config

    slack = config.get_seconds("transport.timeout-slack") or 0.0
    with DDict(total_mem="16 MiB", client=client) as d:
        d.update({i: i for i in range(6)})
        with dask.config.set({"ddict.local-transport": False}):
            t = AsyncDDict(DDict.attach(d.serialize(), client=client, timeout=1))
            t.ddict.get_many(range(6))  # connected before the hosts stop (a handshake waits)

        async def main() -> list[Any]:
            return await asyncio.gather(*(t.get(i) for i in range(6)), return_exceptions=True)

        with _stopped_hosts(d):
            t0 = time.monotonic()
            got = asyncio.run(main())
            took = time.monotonic() - t0
        assert all(isinstance(g, DDictTimeoutError) for g in got), got
        assert took < 1 + slack + 1.5
        assert asyncio.run(t.get_many(range(6))) == list(range(6))
        t.detach()


def test_many_puts_are_cut_into_requests_a_host_takes():
    from dask_ddict._serialize import Framed
    from dask_ddict.client.bulk import _chunks

    def rec(i: int, n: int) -> tuple[int, bytes, bytes, Framed]:
        return i, bytes(16), b"k", Framed([bytes(n)], n)

    groups = [(0, [rec(0, 60), rec(1, 60)]), (1, [rec(2, 30), rec(3, 500), rec(4, 10)])]
    chunks = _chunks(groups, 100)
    assert [[(mid, [r[0] for r in rs]) for mid, rs in c] for c in chunks] == [
        [(0, [0])],
        [(0, [1]), (1, [2])],
        [(1, [3])],
        [(1, [4])],
    ]  # 500 B travels alone
    flat = [r[0] for c in chunks for _, rs in c for r in rs]
    assert flat == [0, 1, 2, 3, 4]  # every record once, in order
