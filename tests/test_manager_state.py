"""A manager's lock and the state its plain requests are checked against, as the compiled
plain server reads them (``kernels.ManagerLock``, ``ManagerState``, ``WindowState``,
``StoreState``, and the other ``*State`` bases).

The lock must be ``threading.Lock`` to every Python caller (the manager's conditions,
its deferred operations and moves use it as one), and the state bases must leave the
Python classes as they were: each field is the attribute, read and written by Python
code and by the server alike, never shadowed by a copy in an instance's ``__dict__``.
"""

from __future__ import annotations

import inspect
import os
import signal
import socket
import threading
import time
import weakref
from types import SimpleNamespace
from typing import Any

import pytest

from dask_ddict import _forking, kernels
from dask_ddict._serialize import Scratch
from dask_ddict.host.hosted import HostedDict
from dask_ddict.host.lease import LeaseKeeper
from dask_ddict.host.loop import Connection
from dask_ddict.kernels import pure
from dask_ddict.options import DDictOptions
from dask_ddict.shard.generations import Generations, path_for
from dask_ddict.shard.manager import Manager
from dask_ddict.shard.store import ShardStore
from dask_ddict.shard.working_set import WorkingSet
from dask_ddict.transport import mapped
from dask_ddict.transport.protocol import Reader
from dask_ddict.transport.shared import SharedChannel

try:
    from dask_ddict.kernels import _compiled
except ImportError:  # (a machine without a compiler: test_kernels says so)
    _compiled = None

#: The locks: threading.Lock (the pure set's) and the compiled one where it was built.
LOCKS: list[Any] = [pure.ManagerLock] + ([] if _compiled is None else [_compiled.ManagerLock])


def _outcome(call: Any) -> Any:
    """What ``call()`` gave: its result, or its error's type (their messages change
    between Python versions)."""
    try:
        return ("ok", call())
    except Exception as e:
        return type(e)


def test_the_compiled_lock_answers_as_threading_lock():
    """The same calls, in the same order, give the same results and errors."""
    if _compiled is None:
        pytest.skip("no compiled set here (test_kernels says whether one must be built)")
    calls = [
        lambda lk: lk.locked(),
        lambda lk: lk.acquire(),
        lambda lk: lk.locked(),
        lambda lk: lk.acquire(False),
        lambda lk: lk.acquire(blocking=False),
        lambda lk: lk.acquire(timeout=0),
        lambda lk: lk.acquire(True, 0.01),
        lambda lk: lk.acquire(False, 1),  # (a timeout for a non-blocking call)
        lambda lk: lk.acquire(True, -2),  # (a negative timeout)
        lambda lk: lk.acquire(True, 1e300),  # (too large)
        lambda lk: lk.release(),
        lambda lk: lk.release(),  # (released twice)
        lambda lk: lk.locked(),
        lambda lk: lk.acquire(timeout=0.01),
        lambda lk: lk.__exit__(None, None, None),
        lambda lk: lk.__enter__(),
        lambda lk: lk.__exit__(None, None, None),
        lambda lk: weakref.ref(lk)() is lk,
    ]
    theirs, ours = threading.Lock(), _compiled.ManagerLock()
    assert [_outcome(lambda: c(ours)) for c in calls] == [
        _outcome(lambda: c(theirs)) for c in calls
    ]


@pytest.mark.parametrize("make", LOCKS)
def test_a_forked_child_has_it_free_whoever_held_it(make):
    """``_forking.reinit_lock`` (what a forked child does with the idle connections'
    pool's lock): a lock that a thread of the parent held at the fork is free in the
    child, and works there as a lock; the parent's is held still."""
    lock = make()
    held, go = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            go.wait(30)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(30)
        pid = os.fork()
        if pid == 0:  # (the child: no Python error may escape into the test runner)
            try:
                _forking.reinit_lock(lock)
                ok = not lock.locked() and lock.acquire(False) and not lock.acquire(False)
                lock.release()
                os._exit(0 if ok and not lock.locked() else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert lock.locked()  # (the parent's thread holds it still)
    finally:
        go.set()
        t.join(30)
    assert not lock.locked()


@pytest.mark.parametrize("make", LOCKS)
def test_a_condition_over_it_waits_and_wakes(make):
    """``threading.Condition`` over the lock (the manager's ``_cond``, a deferred
    operation's ``wake``): a waiter releases it while it waits and has it again when
    notified; a timed wait that nobody notifies ends, holding it."""
    lock = make()
    cond = threading.Condition(lock)
    ready, notified, got = threading.Event(), [False], []

    def waiter() -> None:
        with cond:
            ready.set()
            woke = cond.wait_for(lambda: notified[0], timeout=30)
            got.append((woke, lock.locked()))

    t = threading.Thread(target=waiter)
    t.start()
    assert ready.wait(30)
    with cond:  # (taken once the waiter waits: its wait released it)
        notified[0] = True
        cond.notify_all()
    t.join(30)
    assert not t.is_alive() and got == [(True, True)]
    with cond:
        assert cond.wait(0.01) is False and lock.locked()
    assert not lock.locked()


@pytest.mark.parametrize("make", LOCKS)
def test_another_thread_may_release_it_and_a_blocked_taker_goes_on(make):
    """As ``threading.Lock`` allows: a lock taken by one thread is released by another,
    and a thread blocked taking it takes it then; a timed take that it never gets ends
    after its timeout, not holding it."""
    lock = make()
    lock.acquire()
    t0 = time.monotonic()
    assert lock.acquire(timeout=0.05) is False
    assert time.monotonic() - t0 >= 0.045
    took = threading.Event()

    def taker() -> None:
        lock.acquire()  # (blocked until the releaser releases it)
        took.set()

    t = threading.Thread(target=taker)
    t.start()
    releaser = threading.Thread(target=lock.release)
    time.sleep(0.05)
    assert not took.is_set()
    releaser.start()
    releaser.join(30)
    assert took.wait(30) and lock.locked()
    t.join(30)
    lock.release()
    assert not lock.locked()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals")
@pytest.mark.parametrize("make", LOCKS)
def test_a_signal_handler_runs_while_it_waits(make):
    """A blocked take lets the main thread's signal handlers run (Ctrl-C stops a process
    waiting for a manager): a handler that raises ends the take with its error, not
    holding the lock; one that returns lets the take wait on, and take it."""
    lock = make()
    lock.acquire()
    ran: list[int] = []

    class Stop(Exception):
        pass

    def stop(signum: int, frame: Any) -> None:
        raise Stop

    def note(signum: int, frame: Any) -> None:
        ran.append(signum)

    old = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Stop):
            lock.acquire(timeout=30)
        assert lock.locked()  # (still the first taker's)
        signal.signal(signal.SIGALRM, note)
        threading.Timer(0.3, lock.release).start()
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        assert lock.acquire(timeout=30) is True
        assert ran == [signal.SIGALRM]
        lock.release()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _fields(base: type) -> list[str]:
    """The compiled base's fields (its attributes that are C fields)."""
    return [n for n, v in vars(base).items() if inspect.isgetsetdescriptor(v)]


def test_the_state_bases_hold_the_fields_the_python_classes_use(tmp_path):
    """Each field of a base is the attribute of the real object: set by its Python code,
    read back through the base's field (no copy in ``__dict__``, no slot or class
    attribute of a subclass or mixin shadowing it), and a write from Python is what the
    field then holds.  The pure bases' slots, where they have any, are not shadowed
    either."""
    store = ShardStore(str(tmp_path / "shard"), 16 << 20)
    ws = WorkingSet(store, 2, wait_for_writers=True)
    m = Manager(7, store, ws)
    gens = Generations(path_for(str(tmp_path), "ab" * 16), 2, create=True)
    hosted = HostedDict("ab" * 16, "d", "secret", gens)
    lease = LeaseKeeper("tcp://127.0.0.1:9", "tcp://127.0.0.1:9", None, None, None)  # type: ignore[arg-type]
    a, b = socket.socketpair()
    path = str(tmp_path / "shard")
    view = mapped._View(store)  # (a view of the test's own store: never closed here)
    mapped._MANAGED[path] = None  # (the channel maps no view of its own: opened here)
    try:
        channel = _channel_without_a_host(path, store.capacity)
        reader = Reader(a, 64)
        conn = Connection(a, hosted, reader, Scratch(64), hosted.served.connection())
        objs = {
            "ViewState": view,
            "SharedState": channel,
            "ManagerState": m,
            "WindowState": ws,
            "StoreState": store,
            "ReaderState": reader,
            "ConnectionState": conn,
            "HostedState": hosted,
            "LeaseState": lease,
            "DeferredState": m._deferred,
            "GenerationsState": gens,
        }
        assert set(objs) == {n for n in pure.__all__ if n.endswith("State")}
        b.sendall(b"x" * 100)  # (the reader's own methods, over its base's fields)
        assert bytes(reader.read(100)) == b"x" * 100 and len(reader._buf) >= 100
        assert reader._pos == reader._end == 100 and not hasattr(reader, "__dict__")
        assert (conn.reader, conn.plain, hosted.managers, hosted.lease) == (reader, None, {}, None)
        assert (lease.required, lease.until) == (True, 0.0)
        assert m._deferred.waiting == [] and len(gens.words) == 2
        assert (view.store, view.evicted, view.closed, view.active) == (store, False, False, 0)
        assert (channel._view, channel._seen, channel._size, channel._wfk) == (
            None,
            (-1, 0, False),
            1,
            False,
        )
        assert (channel._closed, channel._alive_until, channel._orphans) == (False, 0.0, [])
        if not kernels.COMPILED:  # (empty bases, but the slots of some)
            for name, obj in objs.items():
                base = getattr(pure, name)
                assert base in type(obj).__mro__
                for f in base.__slots__:
                    assert inspect.getattr_static(type(obj), f) is vars(base)[f], (name, f)
            return
        assert _compiled is not None
        for name, obj in objs.items():
            base = getattr(_compiled, name)
            fields = _fields(base)
            assert fields and isinstance(obj, base)
            for f in fields:
                assert f not in getattr(obj, "__dict__", {}), (name, f)
                assert inspect.getattr_static(type(obj), f) is vars(base)[f], (name, f)
        assert (m.store, m.working_set, m.closed, m.frozen) == (store, ws, False, False)
        assert (ws.size, ws.newest, ws.wait_for_writers, ws.wait_for_keys) == (2, 1, True, False)
        assert store.capacity == 16 << 20 and store.full_thresh == 0.9 and not store.indexed
        assert type(m._mutex) is _compiled.ManagerLock
        m.frozen, ws.newest, store._used_estimate = True, 9, 1234
        assert (m.frozen, ws.newest, store._used_estimate) == (True, 9, 1234)
        m.frozen, ws.newest = False, 1
        hosted.leased, lease.until = True, 5.5
        assert (hosted.leased, lease.until) == (True, 5.5)
        view.evicted, channel._seen, channel._alive_until = True, (3, 1, True), 2.5
        assert (view.evicted, channel._seen, channel._alive_until) == (True, (3, 1, True), 2.5)
    finally:
        mapped._MANAGED.pop(path, None)
        a.close()
        b.close()
        m.close()
        gens.close()
    assert m.closed


def _channel_without_a_host(path: str, capacity: int) -> SharedChannel:
    """A same-host channel of manager 7 whose socket is a stand-in (its fields are what
    is checked: it never serves)."""
    sock = SimpleNamespace(
        info=SimpleNamespace(manager_id=7, uds_path="/nowhere/sock"),
        link=SimpleNamespace(generations=lambda: None, lease_word=lambda: None),
        close=lambda: None,
    )
    return SharedChannel(sock, path, capacity, DDictOptions(), True)  # type: ignore[arg-type]
