"""Errors that say what happened and what to do (issue 30, item 6).

* an operation on a manager whose host is gone names the host, why it is gone and the
  way back, never "destroyed" (the dictionary is not);
* every operation of a destroyed or detached handle raises ``DDictClosedError``;
* a ``str`` or ``bytes`` where an iterable of keys is meant is refused, not split;
* ``fetch_add`` returns the value before the addition.
"""

from __future__ import annotations

import asyncio
import inspect
import random
from collections.abc import Callable, Iterator
from typing import Any

import dask.config
import pytest
from distributed import Client, LocalCluster

from dask_ddict import (
    AsyncDDict,
    DDict,
    DDictClosedError,
    DDictManagerUnavailableError,
)
from dask_ddict.arguments import check_keys
from dask_ddict.client.asynchronous import _PASSTHROUGH
from tests.support.cluster import local_cluster

# -- a manager whose host is gone -------------------------------------------------------


def _lose(how: str, cl: LocalCluster, c: Client, d: DDict, mid: int) -> str:
    """Take manager ``mid``'s host away ``how``; what the error must say about why."""
    info = d._core.layout.managers[mid]
    nanny = next(n for n in cl.workers.values() if n.address == info.supervisor)
    if how == "retired":  # the scheduler retires the worker, then its nanny closes
        c.retire_workers([info.worker], close_workers=False)
    c.sync(nanny.close)
    return {"retired": "its worker was retired", "closed": "its nanny closed"}[how]


@pytest.mark.parametrize("how", ["closed", "retired"])
def test_a_lost_host_is_named_with_why_and_the_remedy_never_destroyed(how):
    """Three workers, the dictionary spread over them; one worker's host goes.  Reads
    (same host: from the shard itself), writes and broadcasts on its manager say which
    manager, which host, why, and how to recreate it, from the first operation on, and
    keep saying it; the other managers work on.  (Its managers would move away first:
    ``ddict.move.on-retire`` is off here, as for a host lost with them.)"""
    with (
        dask.config.set({"ddict.move.on-retire": False}),
        local_cluster(3) as cl,
        Client(cl) as c,
    ):
        d = DDict(total_mem="48 MiB", client=c, name="r")
        keys = {m: next(k for k in range(1000) if d.which_manager(k) == m) for m in range(3)}
        for k in keys.values():
            d[k] = k
        info = d._core.layout.managers[0]
        assert d._core.channel(0).kind == "shm"  # a same-host reader maps the shard
        why = _lose(how, cl, c, d, 0)
        ops: list[Callable[[], Any]] = [
            lambda: d[keys[0]],
            lambda: d.__setitem__(keys[0], 5),
            lambda: keys[0] in d,
            lambda: len(d),
        ]
        for op in ops * 2:  # the first error and the later ones say the same
            with pytest.raises(DDictManagerUnavailableError) as e:
                op()
            text = str(e.value)
            assert text.startswith(
                f"manager 0 of DDict 'r' is unavailable: its host "
                f"{info.hostname} (worker {info.worker}) is gone: {why}."
            )
            assert "DDict(..., name='r', restart=True)" in text and "restore" in text
            assert "destroyed" not in text and "Errno" not in text
        assert [d[keys[m]] for m in (1, 2)] == [keys[1], keys[2]]  # the rest works
        other = DDict.from_name("r", c)  # a handle attached after the loss says it too
        with pytest.raises(DDictManagerUnavailableError, match=f"gone: {why}"):
            other[keys[0]]
        other.detach()
        d.destroy()
        with pytest.raises(DDictClosedError, match="destroyed"):  # destroyed is destroyed
            d[keys[1]]


# -- closed handles -----------------------------------------------------------------------

#: What each public name is called with (a property: read; ``name=``: assigned).
ARGS: dict[str, tuple[Any, ...]] = {
    "__contains__": ("k",),
    "__delitem__": ("k",),
    "__getitem__": ("k",),
    "__setitem__": ("k", 1),
    "__eq__": ({},),
    "bget": ("k",),
    "bput": ("k", 1),
    "clone": ([],),
    "copy": ("copied",),
    "fetch_add": ("k",),
    "filter": (print,),
    "get": ("k",),
    "get_many": (["k"],),
    "manager": (0,),
    "map_shards": (print,),
    "pop": ("k",),
    "pput": ("k", 1),
    "put": ("k", 1),
    "restore": (0,),
    "setdefault": ("k",),
    "update": ({"k": 1},),
    "wait_for": ("k", 1),
    "which_manager": ("k",),
    "contains": ("k",),
    "delete": ("k",),
}

#: What keeps working on a closed handle, and why: saying what it is, and closing again.
KEEP = {
    "__repr__",  # says "closed"
    "get_name",  # the name is the handle's, known without the dictionary
    "destroy",
    "detach",  # idempotent
    "__enter__",
    "__exit__",
    "__aenter__",
    "__aexit__",  # (leaving closes: idempotent)
    "ddict",  # AsyncDDict's synchronous handle, itself closed
}

_NOT_PUBLIC = {"__init__", "__getattr__", "__init_subclass__", "__class_getitem__"}


def public_names(cls: type) -> list[str]:
    """Every public name of a handle class: its methods and properties, the dunders its
    own classes define (``d[k]``, ``len(d)``, ...), and for :class:`AsyncDDict` the
    properties it passes through.  Class and static methods are no handle's operations."""
    names = {n for n in dir(cls) if not n.startswith("_")}
    for klass in cls.__mro__:
        if klass.__module__.startswith("dask_ddict"):
            names |= {
                n
                for n, v in vars(klass).items()
                if n.startswith("__") and n.endswith("__") and callable(v)
            }
    if cls is AsyncDDict:
        names |= _PASSTHROUGH
    static = {
        n
        for n in names
        if isinstance(inspect.getattr_static(cls, n, None), (staticmethod, classmethod))
    }
    return sorted(names - static - _NOT_PUBLIC)


def _is_property(cls: type, name: str) -> bool:
    return isinstance(inspect.getattr_static(cls, name, None), property) or name in _PASSTHROUGH


def _call(h: Any, name: str) -> Any:
    if name.endswith("="):
        setattr(h, name[:-1], 3)
        return None
    if _is_property(type(h), name):
        return getattr(h, name)
    return getattr(h, name)(*ARGS.get(name, ()))


def _consume(result: Any) -> None:
    """Use what an operation returned as a caller would (iterate it, enter it)."""
    if hasattr(result, "__enter__") and not isinstance(result, (DDict, AsyncDDict)):
        with result as it:
            list(it)
    elif isinstance(result, Iterator):
        list(result)


def _wrong(name: str, error: BaseException | None) -> list[str]:
    """What went wrong when a closed handle's ``name`` was used: nothing if it raised
    ``DDictClosedError``."""
    if isinstance(error, DDictClosedError):
        return []
    return [f"{name}: " + ("no error" if error is None else f"{type(error).__name__}: {error}")]


def _closed_handles(client: Client) -> Iterator[tuple[str, DDict]]:
    """A destroyed creator's handle, a detached attached one, a detached derived one."""
    d = DDict(total_mem="16 MiB", client=client)
    d["k"] = 1
    attached = DDict.attach(d.serialize(), client=client)
    derived = d.manager(0)
    attached.detach()
    derived.detach()
    yield "detached", attached
    yield "detached derived", derived
    d.destroy()
    yield "destroyed", d


def _cases(cls: type) -> list[str]:
    names = [n for n in public_names(cls) if n not in KEEP]
    return names + [
        f"{n}="
        for n in names
        if _is_property(cls, n) and getattr(inspect.getattr_static(cls, n, None), "fset", None)
    ]


def test_every_public_name_is_listed():
    """A new public method must be added to ARGS (if it takes arguments) or to KEEP."""
    for cls in (DDict, AsyncDDict):
        names = set(public_names(cls))
        assert {"checkpoint", "rollback", "serialize", "num_managers"} <= names
        for name in names - KEEP:
            if _is_property(cls, name):
                continue
            fn = getattr(cls, name)
            required = [
                p
                for p in list(inspect.signature(fn).parameters.values())[1:]
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ]
            assert not required or name in ARGS, f"{cls.__name__}.{name}: add it to ARGS"


def test_every_operation_of_a_closed_handle_raises_closed(client):
    cases = _cases(DDict)
    assert "checkpoint_id=" in cases and "checkpoint" in cases
    for state, h in _closed_handles(client):
        quiet: list[str] = []
        for name in cases:
            try:
                _consume(_call(h, name))
                error = None
            except Exception as e:  # noqa: BLE001 - judged below
                error = e
            quiet += _wrong(name, error)
        assert quiet == [], f"on a {state} handle"
        assert ("detached" if state == "detached derived" else "closed") in repr(h)
        assert h.get_name()
        h.detach()
        h.destroy()  # idempotent


def test_every_operation_of_a_closed_async_handle_raises_closed(cluster):
    cases = _cases(AsyncDDict)
    assert {"put", "length", "checkpoint_id="} <= set(cases)

    async def body() -> list[str]:
        async with Client(cluster.scheduler_address, asynchronous=True) as client:
            ad = await AsyncDDict.create(total_mem="16 MiB", client=client)
            await ad.put("k", 1)
            await ad.destroy()
            quiet: list[str] = []
            for name in cases:
                try:
                    got = _call(ad, name)
                    if inspect.isawaitable(got):
                        got = await got
                    if hasattr(got, "__aiter__"):
                        got = [x async for x in got]
                    if hasattr(got, "__aenter__"):
                        async with got as it:
                            got = [x async for x in it]
                    error = None
                except Exception as e:  # noqa: BLE001 - judged below
                    error = e
                quiet += _wrong(name, error)
            await ad.destroy()  # idempotent
            assert "closed" in repr(ad)
            return quiet

    assert asyncio.run(body()) == []


# -- keys where an iterable of keys is meant ------------------------------------------------


@pytest.mark.parametrize("keys", ["abc", "", "k", b"abc", b"", bytearray(b"ab"), memoryview(b"ab")])
def test_check_keys_refuses_text_and_bytes(keys):
    with pytest.raises(
        TypeError,
        match=r"^keys must be an iterable of keys, not a "
        f"{type(keys).__name__}",
    ) as e:
        check_keys("keys", keys)
    assert "[" in str(e.value)  # says how to pass one key: in a list


@pytest.mark.parametrize(
    "keys", [["abc"], ("a", "b"), {"a": 1}, {b"x"}, range(3), (k for k in "ab"), iter([]), [b"abc"]]
)
def test_check_keys_takes_iterables_of_keys(keys):
    assert check_keys("keys", keys) is keys


def test_check_keys_refuses_exactly_text_and_bytes_of_any_kind():
    """Random values of many kinds (and subclasses of str and bytes): refused exactly
    when they iterate over their own characters or bytes, always naming the argument."""
    rng = random.Random(30)

    class Name(str):
        pass

    class Blob(bytes):
        pass

    def text() -> str:
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(6)))

    makers: list[Callable[[], Any]] = [
        text,
        lambda: text().encode(),
        lambda: bytearray(text().encode()),
        lambda: memoryview(text().encode()),
        lambda: Name(text()),
        lambda: Blob(b"x" * 3),
        lambda: [text() for _ in range(3)],
        lambda: tuple(text().encode()),
        lambda: {text(): 1},
        lambda: {text()},
        lambda: iter(text()),
        lambda: range(4),
        lambda: rng.randrange(10),  # not iterable at all: the method's own error, later
    ]
    for _ in range(300):
        value = rng.choice(makers)()
        arg = rng.choice(["keys", "clone_list", "other"])
        if isinstance(value, (str, bytes, bytearray, memoryview)):
            with pytest.raises(TypeError, match=f"^{arg} must be an iterable of "):
                check_keys(arg, value)
        else:
            assert check_keys(arg, value) is value


@pytest.mark.parametrize("call", ["get_many", "update", "async get_many", "async update"])
@pytest.mark.parametrize("keys", ["abc", b"abc"])
def test_bulk_methods_refuse_a_string_of_keys(cluster, client, call, keys):
    """``get_many("abc")`` would look up 'a', 'b', 'c'; ``update("ab")`` would fail
    on a pair of its own: both name the argument instead."""
    d = DDict(total_mem="16 MiB", client=client)
    try:
        for k in ("a", "b", "c", "abc", 97):
            d[k] = 1
        name = call.split()[-1]
        arg = "keys" if name == "get_many" else "other"
        if call.startswith("async"):

            async def body() -> None:
                async with Client(cluster.scheduler_address, asynchronous=True) as ac:
                    ad = AsyncDDict(DDict.attach(d.serialize(), client=ac), ac)
                    await getattr(ad, name)(keys)

            run: Callable[[], Any] = lambda: asyncio.run(body())
        else:
            run = lambda: getattr(d, name)(keys)
        with pytest.raises(TypeError, match=f"^{arg} must be an iterable of"):
            run()
        assert len(d) == 5  # nothing was put
    finally:
        d.destroy()


# -- fetch_add ---------------------------------------------------------------------------


def test_fetch_add_returns_the_value_before_the_addition(ddict):
    assert ddict.fetch_add("n", 5) == 0  # absent: starts at 0
    assert ddict["n"] == 5
    assert ddict.fetch_add("n", -2) == 5
    assert ddict.fetch_add("n") == 3 and ddict["n"] == 4
    assert "previous value" in DDict.fetch_add.__doc__
