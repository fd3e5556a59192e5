"""AsyncDDict with an ``asynchronous=True`` client on a real process cluster."""

from __future__ import annotations

import asyncio
import contextlib
import time

import dask
import numpy as np
import pytest
from distributed import Client

from dask_ddict import AsyncDDict, DDict, DDictClosedError, DDictKeyError, DDictTimeoutError
from tests.support.threads import count_to_thread


def run(cluster, body):
    async def main():
        async with Client(cluster.scheduler_address, asynchronous=True) as client:
            return await body(client)

    return asyncio.run(main())


def test_async_dict_protocol(cluster):
    async def body(client):
        ad = await AsyncDDict.create(total_mem="32 MiB", client=client)
        assert ad.num_managers == 2
        await ad.put("a", np.arange(5))
        await ad.pput(("t", 1), {"x": 1})
        assert (await ad["a"]).tolist() == [0, 1, 2, 3, 4]
        assert await ad.get("missing", 7) == 7
        with pytest.raises(DDictKeyError):
            await ad["missing"]
        assert await ad.contains(("t", 1))
        assert await ad.length() == 2
        await ad.update({i: i * i for i in range(50)})
        assert sorted(k for k in await ad.keys() if isinstance(k, int)) == list(range(50))
        seen = [k async for k in ad]
        assert len(seen) == 52
        assert await ad.pop(3) == 9
        assert await ad.pop(3, None) is None
        await ad.delete(4)
        assert await ad.fetch_add("n", 5) == 0 and await ad.fetch_add("n") == 5
        await ad.bput("b", "everywhere")
        assert await ad.bget("b") == "everywhere"
        stats = await ad.stats()
        assert [s.manager_id for s in stats] == [0, 1]
        assert sum(s.num_keys for s in stats) == await ad.length()
        one = ad.manager(1)
        assert await one.length() == stats[1].num_keys
        await ad.freeze()
        assert await ad.is_frozen()
        await ad.unfreeze()
        await ad.clear()
        assert await ad.length() == 0
        await ad.destroy()
        await ad.destroy()  # idempotent
        with pytest.raises(DDictClosedError):
            await ad.put("x", 1)

    run(cluster, body)


def test_async_does_not_block_the_loop(cluster):
    """A wait_for in a thread lets other coroutines (and a task's write) proceed."""

    def writer(d):
        d["flag"] = "go"

    async def body(client):
        async with await AsyncDDict.create(total_mem="32 MiB", client=client, timeout=30) as ad:
            waiter = asyncio.create_task(ad.wait_for("flag", "go"))
            ticks = 0
            for _ in range(5):
                await asyncio.sleep(0.01)
                ticks += 1
            assert ticks == 5 and not waiter.done()
            # Pickling the async handle gives the task a synchronous DDict.
            await client.submit(writer, ad, pure=False)
            await asyncio.wait_for(waiter, 30)
            assert await ad["flag"] == "go"
            with pytest.raises(DDictTimeoutError):
                await ad.wait_for("flag", "never", timeout=0.2)

    run(cluster, body)


def test_async_attach_and_batch(cluster, client):
    d = DDict(total_mem="32 MiB", client=client)
    try:
        s = d.serialize()

        async def body(aclient):
            ad = AsyncDDict.attach(s, client=aclient)
            ad.start_batch_put()
            for i in range(100):
                await ad.put(i, str(i))
            await ad.end_batch_put()
            ad.checkpoint()
            assert ad.checkpoint_id == 1
            ad.rollback()
            assert isinstance(ad.ddict, DDict)
            ad.detach()
            assert d.get_name() in await AsyncDDict.list(aclient)
            named = await AsyncDDict.from_name(d.get_name(), aclient)
            assert await named.length() == 100
            named.detach()
            return True

        assert run(client.cluster, body)
        assert len(d) == 100 and d[42] == "42"
    finally:
        d.destroy()


def test_async_errors(cluster, client):
    with pytest.raises(TypeError, match="asynchronous"):
        asyncio.run(AsyncDDict.create(client=client))

    async def body(aclient):
        with pytest.raises(ValueError, match="working_set_size"):
            await AsyncDDict.create(client=aclient, working_set_size=0)
        with pytest.raises(
            TypeError,
            match=r"AsyncDDict.create\(\) got an unexpected keyword "
            "argument 'total_memory'; did you mean 'total_mem'",
        ):
            await AsyncDDict.create(client=aclient, total_memory="64 MiB")
        with pytest.raises(TypeError, match="AsyncDDict"):
            DDict(client=aclient)

    run(cluster, body)


def test_async_persistence_and_restart(cluster, tmp_path):
    path = str(tmp_path / "store")

    async def body(client):
        ad = await AsyncDDict.create(
            total_mem="32 MiB", client=client, name="async-p", working_set_size=2, persist_path=path
        )
        await ad.put("k", 1)
        await ad.persist()
        await ad.sync()
        assert await ad.persisted_ids() == [0]
        await ad.put("k", 2)
        await ad.restore(0)
        assert await ad["k"] == 1
        await ad.destroy(allow_restart=True)
        assert "async-p" in await AsyncDDict.list(client, kept=True)
        assert "async-p" not in await AsyncDDict.list(client)
        again = await AsyncDDict.create(
            total_mem="32 MiB",
            client=client,
            name="async-p",
            working_set_size=2,
            restart=True,
            persist_path=path,
        )
        assert again.empty_managers == [] and await again["k"] == 1
        await again.destroy()

    run(cluster, body)


def test_the_async_face_covers_every_operation_of_the_sync_handle():
    """The twin is generated from one table: every public DDict operation has its
    AsyncDDict counterpart (a coroutine where it talks to a manager)."""
    import inspect

    from dask_ddict import DDict
    from dask_ddict.client.asynchronous import _PASSTHROUGH, AWAITABLE

    operators = {
        "__setitem__": "put",
        "__getitem__": "__getitem__",
        "__contains__": "contains",
        "__delitem__": "delete",
        "__len__": "length",
        "__iter__": "__aiter__",
        "__enter__": "__aenter__",
        "__exit__": "__aexit__",
    }
    public = {n for n in dir(DDict) if not n.startswith("_")} | set(operators)
    # class-level, or returning a new synchronous creator's handle, or the client itself:
    sync_only = {"attach", "synchronize_ddicts", "copy", "client", "popitem"}
    for name in sorted(public - sync_only):
        twin = operators.get(name, name)
        assert hasattr(AsyncDDict, twin) or twin in _PASSTHROUGH, name
    written = ("put", "pput", "get")  # (batched per loop turn: coroutines of their own)
    assert len(AWAITABLE) + len(written) >= 35
    for name in (*AWAITABLE, *written):
        assert inspect.iscoroutinefunction(getattr(AsyncDDict, name)), name


def test_ddict_properties_have_one_spelling_on_the_async_face():
    """A DDict property answered in this process stays an attribute of AsyncDDict; one
    that asks the managers (``is_frozen``, as ``stats``) is a coroutine method there,
    and its docstring says it stands for a property, not a method."""
    import inspect

    from dask_ddict import DDict
    from dask_ddict.client.asynchronous import _PASSTHROUGH, AWAITABLE

    props = {
        n
        for n in dir(DDict)
        if not n.startswith("_") and isinstance(inspect.getattr_static(DDict, n), property)
    }
    asking = props & set(AWAITABLE)
    assert {"is_frozen", "stats", "dstats", "moves"} <= asking
    for name in props - {"client"}:  # (the async handle's client is its own)
        if name in asking:
            assert inspect.iscoroutinefunction(getattr(AsyncDDict, name)), name
            assert f":attr:`DDict.{name}` (a property there" in getattr(AsyncDDict, name).__doc__
        else:
            assert name in _PASSTHROUGH or isinstance(
                inspect.getattr_static(AsyncDDict, name), property
            ), name
    assert "is_frozen()" in AsyncDDict.__doc__ and "AsyncDDict" in DDict.is_frozen.__doc__


def _keys_of(dd, out, tag):
    for k in dd.keys():
        out.put((tag, k))


def _sorted_keys(dd, out):
    for k in sorted(dd.keys()):
        out.put(k)


def _boom(dd, out):
    out.put("one")
    raise ValueError("boom in mgr_code")


def _forever(dd, out):
    i = 0
    while True:  # ends with EOFError once the caller has left
        out.put(i)
        i += 1


def test_async_computing_beside_the_shards(cluster):
    """filter (async with / async for), map_shards and to_bag from an asynchronous client.

    None of them blocks the event loop: the handle's layout is asked by awaiting (a
    blocking ask from the loop's own thread would wait out ``host.probe-timeout``
    at each call, as it once did)."""
    import time

    from distributed import get_worker

    from dask_ddict import DDictTaskError

    async def body(client):
        ad = await AsyncDDict.create(total_mem="32 MiB", client=client)
        began = time.monotonic()
        try:
            await ad.update({i: i for i in range(500)})
            async with ad.filter(_keys_of, ("k",)) as results:
                got = [x async for x in results]
            assert sorted(k for _, k in got) == list(range(500))
            async with ad.filter(_sorted_keys, comparator=lambda x, y: x < y) as res:
                ordered = [k async for k in res]
            assert ordered == list(range(500))  # the managers' sorted keys, merged
            with pytest.raises(DDictTaskError, match="boom in mgr_code") as info:
                async with ad.filter(_boom) as results:
                    [x async for x in results]
            assert info.value.manager_id in range(ad.num_managers)
            async with ad.filter(_forever) as results:
                async for x in results:
                    if x >= 3000:
                        break  # leaving early: the tasks stop, nothing runs on
            assert not any((await client.processing()).values())

            futures = await ad.map_shards(lambda dd: (get_worker().address, len(dd)))
            where = await client.gather(futures)
            assert [w for w, _ in where] == ad.manager_workers and sum(n for _, n in where) == 500
            bag = await ad.to_bag("values")
            assert await client.compute(bag.sum()) == sum(range(500))
            assert time.monotonic() - began < PROBE  # (six computations, no probe waited)
        finally:
            await ad.destroy()

    with dask.config.set({"ddict.host.probe-timeout": f"{PROBE}s"}):
        run(cluster, body)


PROBE = 30  # seconds: host.probe-timeout while an asynchronous client computes


def test_async_create_with_replicas(cluster):
    async def body(client):
        ad = await AsyncDDict.create(total_mem="32 MiB", client=client, replicas=1)
        try:
            await ad.put("a", 1)
            assert await ad["a"] == 1
            assert [s.replicas for s in await ad.stats()] == [1] * ad.num_managers
        finally:
            await ad.destroy()

    run(cluster, body)


@pytest.mark.one_host
def test_async_gets_of_shards_mapped_here_are_read_on_the_loop(cluster, monkeypatch):
    """Gets awaited together whose shards are all mapped here are read on the event loop
    itself (one ``place_many`` per manager, no worker thread, no request), the values
    those of the sync handle; a read that may lend (``copy=None`` of a frozen dictionary,
    ``copy=False``) and one whose channels are not made yet go the other way, with the
    same answers; a ``copy`` that is not a bool is refused by name."""
    from dask_ddict.transport.shared import SharedChannel

    placed: list[tuple[int, object, bool]] = []
    place = SharedChannel.place_many

    def spy(self, digests, positions, out, chkpt, absent, lend=False):  # noqa: ANN001, ANN202
        done = place(self, digests, positions, out, chkpt, absent, lend)
        placed.append((self._mid, lend, done))
        return done

    monkeypatch.setattr(SharedChannel, "place_many", spy)
    threads = count_to_thread(monkeypatch)

    async def body(client):
        async with await AsyncDDict.create(total_mem="32 MiB", client=client) as ad:
            want = {f"k{i}": (i, "v") if i % 3 else np.arange(i) for i in range(60)}
            await ad.update(want)
            fresh = AsyncDDict.attach(ad.serialize(), client=client)  # (no channel made yet)
            try:
                first = next(k for k in want if fresh.which_manager(k) == 0)
                await fresh.get(first)  # (manager 0's channel made, in a worker thread)
                placed.clear()
                asked = [first, *want, "nope"]
                got = await asyncio.gather(*(fresh.get(k, "-") for k in asked))
                assert got[-1] == "-" and len(got) == len(want) + 2
                assert placed == []  # (manager 1's not made: none read here, not even 0's)
            finally:
                fresh.detach()
            await asyncio.gather(*(ad.get(k) for k in want))  # (maps the shards here)
            placed.clear()
            threads.clear()
            keys = ["nope-1", *want, "nope-2"]
            got = await asyncio.gather(*(ad.get(k, None) for k in keys))
            assert got[0] is None and got[-1] is None
            for k, v in zip(want, got[1:-1], strict=True):
                assert (v == want[k]).all() if isinstance(v, np.ndarray) else v == want[k]
            assert sorted(placed) == [(m, None, True) for m in range(ad.num_managers)]
            assert not threads, threads  # (read on the loop: no worker thread)
            with pytest.raises(DDictKeyError, match="nope-1"):
                await ad["nope-1"]
            placed.clear()
            assert (await ad.get("k3", copy=True)).tolist() == [0, 1, 2]
            assert placed and all(lend is False and done for _, lend, done in placed)
            placed.clear()
            assert (await ad.get("k3", copy=False)).tolist() == [0, 1, 2]
            assert not placed  # (lends: GetMany's, in a worker thread)
            await ad.freeze()
            placed.clear()
            frozen = await ad.get("k3")
            assert frozen.tolist() == [0, 1, 2] and not frozen.flags.writeable  # (lent)
            assert placed and not any(done for _, _, done in placed)  # (declined)
            await ad.unfreeze()
            with pytest.raises(TypeError, match="copy"):
                await ad.get("k3", copy="yes")

    run(cluster, body)


def test_an_unavailable_manager_never_holds_the_loop_up(cluster, monkeypatch):
    """A same-host get whose manager is unavailable (its supervisor gone, of a replicated
    dictionary: the explanation waits up to ``failover-timeout`` for a replica to take
    over) declines on the loop at once and is explained in a worker thread: the loop
    keeps turning meanwhile, and the explanation is waited for once."""
    import os

    async def ticking(stop, gaps):  # noqa: ANN001, ANN202
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async def body(client):
        ad = await AsyncDDict.create(total_mem="32 MiB", client=client, replicas=1)
        try:
            await ad.put("a", 1)
            assert await ad.get("a") == 1  # (its channels made: the loop reads the shard)
            real = os.kill

            def gone(pid, sig):  # noqa: ANN001, ANN202
                if sig == 0:
                    raise ProcessLookupError(pid)
                return real(pid, sig)

            monkeypatch.setattr(os, "kill", gone)  # (every supervisor "ended")
            stop, gaps = asyncio.Event(), []
            ticker = asyncio.create_task(ticking(stop, gaps))
            await asyncio.sleep(0.05)
            began = time.perf_counter()
            with dask.config.set({"ddict.failover-timeout": "2 s"}):
                with contextlib.suppress(Exception):  # (unavailable, or read after all)
                    await ad.get("a")
            took = time.perf_counter() - began
            stop.set()
            await ticker
            monkeypatch.setattr(os, "kill", real)
            assert max(gaps) < 1.0, f"the loop stood still for {max(gaps):.2f} s"
            assert took < 3.5, f"explained twice: {took:.2f} s"
        finally:
            await ad.destroy()

    run(cluster, body)
