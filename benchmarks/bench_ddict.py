"""DDict benchmark: one command, one table, ratios to a reference measured in the same run.

    python benchmarks/bench_ddict.py [--quick]

Measures, on a 2-worker LocalCluster (worker processes), sequential single-key
put/get of 100 B values (ops/s) and of 1 MiB / 64 MiB numpy arrays (MB/s):

* from the client process (same host: reads straight from the shard, writes
  over the Unix socket of the manager's host process),
* from a task on the manager's worker and from a task on the other worker
  (both same host: managers run in host processes beside the workers),
* over TCP (same-host paths disabled: what another host would see),

against redis-py doing the same operations (the reference column), and these
rows, each against the reference its reference column names:

* ``..., alternated with <peer>``: each row with a target (put/get 100 B over
  TCP; get 1 MiB from the client on the managers' host; get_many same host and
  over TCP; the batch of 20,000 new keys same host;
  host CPU per get/put; get 64 MiB over TCP, which is alternated only) measured again in five slices alternated with its
  peer's (``common.alternated``): the median of the five pairs' ratios, with the
  least and the most.  The single cells measure each side once, seconds apart,
  and carry the machine's drift between them into their ratio; the alternated
  rows are the ones a target reads.

* ``round trip 100 B (tcp)``: sequential round trips of a 1-byte request and a
  100 B answer between this process and a child over raw loopback TCP, one
  ``recv`` and one ``send`` each (the loopback row's child): the ceiling of any
  Python client and host here, against redis-py's get (what the 100 B TCP rows'
  ratios could reach with no work at all on either side).
* ``memcpy 64 MiB``: ``np.copyto`` between two warm 64 MiB buffers in this
  process (best of a few): the reference of the next two rows.
* ``get 64 MiB copy=False``: one ``d.manager(0).get(key, copy=False)`` of a
  64 MiB float64 array from the client (a zero-copy view; median of a few),
  in ms; ratio = that time / one memcpy (target <= 0.10).
* ``get 64 MiB (copying)``: ``d.manager(0)[key]`` from the client, MB/s (best
  of a few); ratio = fraction of memcpy's bandwidth (target >= 0.8).
* ``live bytes under a 32 MiB view``: a dictionary of one 512 MiB manager; a
  32 MiB value is read with ``copy=False`` and popped, 40 keys of 8 MiB are
  overwritten six times, then new 8 MiB keys are put until the shard is full;
  the live bytes then, against the room puts may fill (90 %) less the view
  (target about 1: a view costs its bytes, not the shard's garbage).
* ``get 64 MiB (tcp)``: the same get over TCP, MB/s, against loopback TCP: a child
  process sends 64 MiB messages over 127.0.0.1, this process ``recv_into`` a
  preallocated buffer; alternated, each slice the best of a few of each; target >= 0.8.
* ``get_many 1000 x 100 B``: keys/s of ``d.get_many(keys)``, 1,000 keys of
  100 B spread over both managers, from the client (same host) and over TCP,
  against redis-py ``r.mget`` of 1,000 keys.
  ``get_many 1000 x 100 B, copy=False`` is the same-host row read to lend (values under
  a page are copied, in the same walk of the shard).
  The client keeps the routes of keys it read before (``ddict.transport.route-cache``);
  ``get_many 1000 x 100 B, no routes kept`` is the same-host row with none kept (each
  key pickled and hashed on every read, as the first read of a key is).
* ``batch put 1000 x 100 B``: keys/s of ``start_batch_put()``, 1,000 puts,
  ``end_batch_put()`` on the whole dictionary, same host and over TCP, against
  a redis-py pipeline of 1,000 SETs (``transaction=False``).
* ``batch put 20,000 new keys x 100 B``: keys/s of one batch put of 20,000 keys never
  written before (new names each time, the dictionary cleared between, untimed), same
  host and over TCP, against a redis-py pipeline of as many SETs of new keys.
* ``host CPU per key of get_many 100 B (tcp)``: the same, per key of 1,000-key
  ``get_many`` requests, against redis-server's CPU per key of ``MGET``.
* ``host CPU per get/put 100 B (tcp)``: CPU time (user + system, psutil) the
  manager's host process (``d.stats[0].pid``) spends per 100 B get and per
  100 B put from ``d.manager(0)`` over TCP, over 10,000 operations each
  (30,000 without ``--quick``), against redis-server's CPU per GET/SET over as
  many redis-py calls; ratio = ours / redis-server's (target <= 1.0).  In
  brackets, the part spent in user space (the rest is the kernel's: the same
  three system calls per request for both, and the wake-ups).  The kernel
  counts CPU time in 10 ms ticks: +-1 us per operation at 10,000.  The rows
  ``alternated with redis-server`` measure the same in five slices of a fifth of
  the operations each, alternated with redis-server's (``common.alternated``), by the
  scheduler's exact count of each process's threads' time (user and system
  together): the median of the five pairs' ratios, with the least and the most.
* ``host CPU per fetch_add / pop 100 B (tcp)``: the same for ``fetch_add(key, 1)`` on
  1,000 counters and for ``pop`` of as many 100 B keys as operations, against
  redis-server's ``INCRBY`` and ``GETDEL`` (the at-most-once writes: each keeps its reply
  under its request id in the same transaction).
* ``p99 put 100 B``: the p99 latency of 100 B puts from the client while the
  manager's worker runs a CPU-bound pure-Python task on its thread (target:
  at most 2 ms; the manager's host process is not the worker).
* TLS: the 100 B and 1 MiB put/get over TCP with TLS on.

Rows needing an API not in this build yet (``get(..., copy=False)``) print
``n/a (not built)``.  When ``redis-server`` is on the PATH
it is started on a loopback port and redis-py (hiredis) does the same
operations; without it the redis cells are ``n/a``.  When a ``dragon``
launcher is found (``DDICT_BENCH_DRAGON``, else the PATH), ``bench_dragon.py``
runs Dragon's DDict on the 100 B rows in the same run.  Absolute numbers on
2-core VMs are noisy: read the ratios.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import _bench_refs as refs  # beside this script (sys.path[0])
import dask
import numpy as np
from common import (
    Row,
    alternated,
    best_of,
    items_per_second,
    p99,
    print_aligned,
    python_build,
    timed_cells,
)
from distributed import Client, LocalCluster

from dask_ddict import DDict, DDictFullError

SIZES = {"100 B": 100, "1 MiB": 1 << 20, "64 MiB": 64 << 20}
BIG = 64 << 20
KEYS = [f"k{i}" for i in range(1000)]  # the get_many / mget keys
NEW_KEYS = 20_000  # the keys of one batch put of new keys
DRAGON_ROWS = {"batch put 100 B": "batch put 1000 x 100 B"}  # bench_dragon's name -> ours
SAME, TCP = "client (same host)", "client (tcp, as from another host)"
PAIRS = 5  # slices of each side of an alternated row (common.alternated)


def _value(nbytes: int) -> Any:
    return b"x" * nbytes if nbytes < 1024 else np.ones(nbytes // 8, dtype="f8")


def run_ddict(d: DDict, nbytes: int, seconds: float) -> dict[str, float]:
    """put and get rates for one value size through handle ``d``."""
    v = _value(nbytes)
    n = 0
    keys = max(1, min(1000, (d.stats[0].total_bytes // 4) // max(nbytes, 1)))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 3:
        d[n % keys] = v
        n += 1
    put = n / (time.perf_counter() - t0)
    m = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or m < 3:
        d[m % min(n, keys)]
        m += 1
    get = m / (time.perf_counter() - t0)
    d.clear()
    return {"put": put, "get": get}


def run_batch(d: DDict, seconds: float) -> float:
    v = _value(100)

    def batch() -> None:
        d.start_batch_put()
        for i in range(1000):
            d[i] = v
        d.end_batch_put()

    keys_per_s = items_per_second(batch, 1000, seconds)
    d.clear()
    return keys_per_s


def fresh_batches_per_second(
    batch: Callable[[list[str]], None], reset: Callable[[], None], seconds: float
) -> float:
    """Keys/s of ``batch(keys)`` on :data:`NEW_KEYS` keys never written before (new names
    each time), repeated for ``seconds`` and at least 3 times; ``reset()`` empties the
    store between them, untimed."""
    took, n = 0.0, 0
    while took < seconds or n < 3:
        keys = [f"b{n}-{i}" for i in range(NEW_KEYS)]
        t0 = time.perf_counter()
        batch(keys)
        took += time.perf_counter() - t0
        n += 1
        reset()
    return n * NEW_KEYS / took


def run_fresh_batch(d: DDict, seconds: float) -> float:
    """Keys/s of one batch put of :data:`NEW_KEYS` new 100 B keys over ``d``'s managers."""
    v = _value(100)

    def batch(keys: list[str]) -> None:
        d.start_batch_put()
        for k in keys:
            d[k] = v
        d.end_batch_put()

    return fresh_batches_per_second(batch, d.clear, seconds)


def run_redis_fresh_pipeline(r: Any, seconds: float) -> float:
    """A redis-py pipeline (``transaction=False``) of :data:`NEW_KEYS` SETs of new keys."""
    v = b"x" * 100

    def pipeline(keys: list[str]) -> None:
        p = r.pipeline(transaction=False)
        for k in keys:
            p.set(k, v)
        p.execute()

    return fresh_batches_per_second(pipeline, r.flushall, seconds)


def has_copy_false() -> bool:
    """Whether ``DDict.get`` takes ``copy=`` (the zero-copy get) in this build."""
    return "copy" in inspect.signature(DDict.get).parameters


def run_get_many(d: DDict, seconds: float, copy: bool = True) -> float:
    """keys/s of ``d.get_many(KEYS, copy=copy)`` (1,000 keys of 100 B over all of ``d``'s
    managers)."""
    v = _value(100)
    d.start_batch_put()
    for k in KEYS:
        d[k] = v
    d.end_batch_put()
    assert len(d.get_many(KEYS, copy=copy)) == len(KEYS)
    keys_per_s = items_per_second(lambda: d.get_many(KEYS, copy=copy), len(KEYS), seconds)
    d.clear()
    return keys_per_s


def run_redis_mget(r: Any, seconds: float) -> float:
    r.mset({k: b"x" * 100 for k in KEYS})
    keys_per_s = items_per_second(lambda: r.mget(KEYS), len(KEYS), seconds)
    r.flushall()
    return keys_per_s


def _paths(where: str) -> Any:
    """The configuration ``where``'s rows run under: a channel picks its path when first
    used, so a same-host handle's managers first used here (inside the TCP block) must
    still be read on this host, not over TCP."""
    return dask.config.set({"ddict.local-transport": where != TCP})


def bulk_rows(c: Client, handles: dict[str, DDict], r: Any, secs: float) -> list[Row]:
    """get_many and batch put of 1,000 x 100 B through each handle, vs mget / a pipeline."""
    mget = run_redis_mget(r, secs) if r is not None else None
    pipe = run_redis_pipeline(r, secs) if r is not None else None
    rows = []
    for where, h in handles.items():
        with _paths(where):
            rate = run_get_many(h, secs)
        rows.append(
            (
                "get_many 1000 x 100 B",
                where,
                f"{rate:,.0f} keys/s",
                f"mget: {mget:,.0f} keys/s" if mget else "n/a",
                f"{rate / mget:.2f}x" if mget else "n/a",
            )
        )
    for where, h in handles.items():
        with _paths(where):
            rate = run_batch(h, secs)
        rows.append(
            (
                "batch put 1000 x 100 B",
                where,
                f"{rate:,.0f} keys/s",
                f"pipeline: {pipe:,.0f} keys/s" if pipe else "n/a",
                f"{rate / pipe:.2f}x" if pipe else "n/a",
            )
        )
    with _paths(SAME):  # (a read that lends: small values copied in the same walk)
        rate = run_get_many(handles[SAME], secs, copy=False)
    rows.append(
        (
            "get_many 1000 x 100 B, copy=False",
            SAME,
            f"{rate:,.0f} keys/s",
            f"mget: {mget:,.0f} keys/s" if mget else "n/a",
            f"{rate / mget:.2f}x" if mget else "n/a",
        )
    )
    # Every key routed anew, on this host.
    with _paths(SAME), dask.config.set({"ddict.transport.route-cache": 0}):
        cold = DDict.attach(handles[SAME].serialize(), client=c)
        try:
            rate = run_get_many(cold, secs)
        finally:
            cold.detach()
    rows.append(
        (
            "get_many 1000 x 100 B, no routes kept",
            SAME,
            f"{rate:,.0f} keys/s",
            f"mget: {mget:,.0f} keys/s" if mget else "n/a",
            f"{rate / mget:.2f}x" if mget else "n/a",
        )
    )
    fresh = run_redis_fresh_pipeline(r, secs) if r is not None else None
    for where, h in handles.items():
        with _paths(where):
            rate = run_fresh_batch(h, secs)
        rows.append(
            (
                f"batch put {NEW_KEYS:,} new keys x 100 B",
                where,
                f"{rate:,.0f} keys/s",
                f"pipeline: {fresh:,.0f} keys/s" if fresh else "n/a",
                f"{rate / fresh:.2f}x" if fresh else "n/a",
            )
        )
    if r is None:
        return rows
    t = max(2 * secs, 2.0) / PAIRS  # (the rows with targets, alternated with their peer)
    for what, where, ours, theirs, peer, target in (
        ("get_many 1000 x 100 B", SAME, run_get_many, run_redis_mget, "mget", ">= 3x"),
        ("get_many 1000 x 100 B", TCP, run_get_many, run_redis_mget, "mget", ">= 1.5x"),
        (
            f"batch put {NEW_KEYS:,} new keys x 100 B",
            SAME,
            run_fresh_batch,
            run_redis_fresh_pipeline,
            "pipeline",
            ">= 3x",
        ),
    ):
        rows.append(_alternated_row(what, where, handles[where], r, ours, theirs, peer, target, t))
    return rows


def _alternated_row(
    what: str,
    where: str,
    h: DDict,
    r: Any,
    ours: Callable[..., float],
    theirs: Callable[[Any, float], float],
    peer: str,
    target: str,
    t: float,
) -> Row:
    """Row ``what`` of ``ours(h, t)`` (keys/s through handle ``h``, from ``where``) and its
    ``peer``'s ``theirs(r, t)``, measured alternated (``common.alternated``)."""

    def mine() -> dict[str, float]:
        with _paths(where):
            return {"keys": ours(h, t)}

    med, ref, ratios = alternated(mine, lambda: {"keys": theirs(r, t)}, PAIRS)
    return (
        what,
        f"{where}, alternated with {peer}",
        f"{med['keys']:,.0f} keys/s",
        f"{peer}: {ref['keys']:,.0f} keys/s",
        _pairs_cell(ratios["keys"], "x", f"target {target}"),
    )


def _pairs_cell(ratio: tuple[float, float, float], unit: str, target: str) -> str:
    """An alternated row's result: the median of its pairs' ratios (``unit`` after it),
    the least and the most, and ``target`` if there is one."""
    mid, low, high = ratio
    return f"{mid:.2f}{unit} ({low:.2f}-{high:.2f} over {PAIRS} pairs{'; ' + target if target else ''})"


def big_get_rows(m0: DDict, reps: int) -> list[Row]:
    """memcpy of 64 MiB, and same-host gets of a 64 MiB array as a fraction of it."""
    mem = refs.memcpy_seconds(BIG, reps)
    ref_ms, ref_bw = f"memcpy: {mem * 1e3:.1f} ms", f"memcpy: {BIG / mem / 1e6:,.0f} MB/s"
    rows: list[Row] = [
        (
            "memcpy 64 MiB",
            "client process (np.copyto, warm buffers)",
            "-",
            f"{BIG / mem / 1e6:,.0f} MB/s ({mem * 1e3:.1f} ms)",
            "reference",
        )
    ]
    m0["big"] = _value(BIG)
    try:
        if has_copy_false():
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                view = m0.get("big", copy=False)
                times.append(time.perf_counter() - t0)
                assert view.nbytes == BIG, type(view)
                del view
            t = float(np.median(times))
            rows.append(
                (
                    "get 64 MiB copy=False",
                    SAME,
                    f"{t * 1e3:.3f} ms",
                    ref_ms,
                    f"{t / mem:.3f} of memcpy (target <= 0.10)",
                )
            )
        else:
            rows.append(
                (
                    "get 64 MiB copy=False",
                    SAME,
                    "n/a (not built)",
                    ref_ms,
                    "target <= 0.10 of memcpy",
                )
            )
        t = best_of(lambda: m0["big"], reps, budget=10.0)
        rows.append(
            (
                "get 64 MiB (copying)",
                SAME,
                f"{BIG / t / 1e6:,.0f} MB/s",
                ref_bw,
                f"{mem / t:.2f} of memcpy (target >= 0.8)",
            )
        )
    finally:
        del m0["big"]
    return rows


def view_room_row(c: Client) -> Row:
    """What a shard takes while a 32 MiB zero-copy view of it is held: one manager of
    512 MiB, the view's key popped, 40 keys of 8 MiB overwritten six times, then new 8 MiB
    keys until the shard is full.  Live bytes at the end over the room less the view."""
    held, size, capacity = 32 << 20, 8 << 20, 512 << 20
    with DDict(1, 1, total_mem=capacity, client=c) as d:
        m = d.manager(0)
        m["w"] = np.ones(held // 8)
        view = m.get("w", copy=False)
        m.pop("w")
        v = _value(size)
        try:
            for _ in range(6):
                for k in range(40):
                    m[f"k{k}"] = v
            for k in range(40, capacity // size):
                m[f"k{k}"] = v
        except DDictFullError:
            pass
        assert view.nbytes == held
        room = 0.9 * capacity - held  # (manager_pool_full_thresh 0.9, less the view)
        live = len(m) * size
    return (
        "live bytes under a 32 MiB view",
        "one 512 MiB shard, 240 overwrites of 8 MiB",
        f"{live >> 20} MiB",
        f"room less the view: {room / 2**20:.0f} MiB",
        f"{live / room:.2f} of it (target ~1: capacity - P - overhead)",
    )


def tcp_big_row(tcp0: DDict, reps: int) -> Row:
    """A 64 MiB get over TCP against loopback TCP's bandwidth, alternated with it
    (``common.alternated``: each slice the best of a few gets of each side)."""
    per = max(2, reps // 2)
    tcp0["big"] = _value(BIG)
    try:
        tcp0["big"]  # warm: the connection's buffers
        with refs.loopback(BIG) as wire:
            med, ref, ratios = alternated(
                lambda: {"get": BIG / best_of(lambda: tcp0["big"], per, budget=5.0)},
                lambda: {"get": BIG / best_of(wire, per, budget=5.0)},
                PAIRS,
            )
    finally:
        del tcp0["big"]
    return (
        "get 64 MiB (tcp)",
        f"{TCP}, alternated with loopback TCP",
        f"{med['get'] / 1e6:,.0f} MB/s",
        f"loopback TCP: {ref['get'] / 1e6:,.0f} MB/s",
        _pairs_cell(ratios["get"], " of loopback", "target >= 0.8"),
    )


def floor_row(base: dict[str, float] | None, secs: float) -> Row:
    """Sequential 100 B round trips between two Python processes over raw loopback TCP
    (one ``recv`` and one ``send`` each per request, nothing else): the ceiling of any
    Python client and host on this machine, against redis-py's get in the same run."""
    rate = refs.loopback_rate(100, max(secs, 0.5))
    ratio = f"{rate / base['get']:.2f}x: the most a Python pair reaches" if base else "n/a"
    return (
        "round trip 100 B (tcp)",
        "two Python processes, raw sockets",
        f"{rate:,.0f} ops/s",
        f"{base['get']:,.0f} ops/s" if base else "n/a",
        ratio,
    )


def _us(seconds: float, user: float | None = None) -> str:
    """Microseconds; with ``user``, the user-space part of them in brackets."""
    f = (lambda t: f"{t * 1e6:.0f}") if seconds >= 1e-5 else (lambda t: f"{t * 1e6:.2f}")
    return f"{f(seconds)} us" + ("" if user is None else f" (user {f(user)})")


def host_cpu_rows(tcp0: DDict, redis_ctx: Any, n: int) -> list[Row]:
    """CPU of the manager's host process per 100 B get/put over TCP, vs redis-server's."""
    pid = tcp0.stats[0].pid
    if not pid or pid == os.getpid():
        raise RuntimeError(f"stats gave pid {pid}, not the host process's")
    v = _value(100)

    def put(i: int) -> None:
        tcp0[i % 1000] = v

    ours = {
        "put": refs.cpu_per_op(pid, put, n, cap=60.0),
        "get": refs.cpu_per_op(pid, lambda i: tcp0[i % 1000], n, cap=60.0),
    }
    paired = None
    if redis_ctx:  # (the rows with a target: also in slices alternated with redis-server's)
        rpid, r = redis_ctx[0].pid, redis_ctx[1]
        cut = max(n // PAIRS, 1000)

        def slice_cpu(p: int, op: Callable[[int], Any]) -> float:
            return refs.cpu_per_op_exact(p, op, cut)

        paired = alternated(
            lambda: {"put": slice_cpu(pid, put), "get": slice_cpu(pid, lambda i: tcp0[i % 1000])},
            lambda: {
                "put": slice_cpu(rpid, lambda i: r.set(i % 1000, v)),
                "get": slice_cpu(rpid, lambda i: r.get(i % 1000)),
            },
            PAIRS,
        )
    tcp0.update({k: v for k in KEYS})  # (get_many: CPU per key, of 1,000-key requests)
    ours["key of get_many"] = _per_key(
        refs.cpu_per_op(pid, lambda i: tcp0.get_many(KEYS), max(n // 100, 10), cap=60.0)
    )
    tcp0.clear()
    ours["fetch_add"] = refs.cpu_per_op(pid, lambda i: tcp0.fetch_add(i % 1000, 1), n, cap=60.0)
    tcp0.clear()
    tcp0.update({i: v for i in range(n)})  # (each popped once)
    ours["pop"] = refs.cpu_per_op(pid, tcp0.pop, n, cap=60.0)
    tcp0.clear()
    theirs: dict[str, tuple[float, int, float]] = {}
    if redis_ctx:
        rpid, r = redis_ctx[0].pid, redis_ctx[1]
        theirs = {
            "put": refs.cpu_per_op(rpid, lambda i: r.set(i % 1000, v), n, cap=60.0),
            "get": refs.cpu_per_op(rpid, lambda i: r.get(i % 1000), n, cap=60.0),
        }
        r.mset({k: v for k in KEYS})
        theirs["key of get_many"] = _per_key(
            refs.cpu_per_op(rpid, lambda i: r.mget(KEYS), max(n // 100, 10), cap=60.0)
        )
        r.flushall()
        theirs["fetch_add"] = refs.cpu_per_op(rpid, lambda i: r.incrby(i % 1000, 1), n, cap=60.0)
        r.flushall()
        r.mset({i: v for i in range(n)})
        theirs["pop"] = refs.cpu_per_op(rpid, r.getdel, n, cap=60.0)
        r.flushall()
    rows = []
    if paired is not None:
        med, ref, ratios = paired
        for op, rop in (("get", "GET"), ("put", "SET")):
            rows.append(
                (
                    f"host CPU per {op} 100 B (tcp)",
                    "host process, alternated with redis-server",
                    _us(med[op]),
                    f"redis-server per {rop}: {_us(ref[op])}",
                    _pairs_cell(ratios[op], "", "target <= 1.0"),
                )
            )
    for op, rop, what, target in (
        ("get", "GET", "get 100 B", " (target <= 1.0)"),
        ("put", "SET", "put 100 B", " (target <= 1.0)"),
        ("key of get_many", "key of MGET", "key of get_many 100 B", ""),
        ("fetch_add", "INCRBY", "fetch_add", ""),
        ("pop", "GETDEL", "pop 100 B", ""),
    ):
        (cpu, done, user), base = ours[op], theirs.get(op)
        rows.append(
            (
                f"host CPU per {what} (tcp)",
                f"host process, {done:,} {op.split()[0]}s",
                _us(cpu, user),
                f"redis-server per {rop}: {_us(base[0], base[2])}" if base else "n/a",
                f"{cpu / base[0]:.2f}{target}" if base else "n/a",
            )
        )
    return rows


def _per_key(measured: tuple[float, int, float]) -> tuple[float, int, float]:
    """A 1,000-key request's CPU, per key."""
    cpu, done, user = measured
    return cpu / len(KEYS), done * len(KEYS), user / len(KEYS)


def task_bench(d: DDict, nbytes: int, seconds: float) -> dict[str, float]:
    return run_ddict(d, nbytes, seconds)


def spin(seconds: float) -> int:
    """A CPU-bound pure-Python task that holds its worker's GIL."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        n += sum(i * i for i in range(1000))
    return n


def put_latencies(d: DDict, seconds: float) -> list[float]:
    v = _value(100)
    out = []
    t_end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        d[i % 1000] = v
        out.append(time.perf_counter() - t0)
        i += 1
    d.clear()
    return out


def start_redis() -> tuple[Any, Any] | None:
    """A redis-server (see ``_bench_refs.start_redis``) and a redis-py client of it."""
    servers = refs.start_redis(1, "--proto-max-bulk-len", "1gb")
    if not servers:
        return None
    import redis

    proc, port, workdir = servers[0]
    proc.workdir = workdir
    return proc, redis.Redis(host="127.0.0.1", port=port)


def run_redis(r: Any, nbytes: int, seconds: float) -> dict[str, float]:
    v = b"x" * nbytes if nbytes < 1024 else np.ones(nbytes // 8).tobytes()
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 3:
        r.set(n % 1000, v)
        n += 1
    put = n / (time.perf_counter() - t0)
    m = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or m < 3:
        np.frombuffer(r.get(m % min(n, 1000)), np.uint8)
        m += 1
    get = m / (time.perf_counter() - t0)
    r.flushall()
    return {"put": put, "get": get}


def run_redis_pipeline(r: Any, seconds: float) -> float:
    v = b"x" * 100

    def pipeline() -> None:
        p = r.pipeline(transaction=False)
        for i in range(1000):
            p.set(i, v)
        p.execute()

    keys_per_s = items_per_second(pipeline, 1000, seconds)
    r.flushall()
    return keys_per_s


def run_dragon(seconds: float) -> dict[str, float] | None:
    """Dragon's figures for the 100 B rows, from ``bench_dragon.py`` under ``dragon``."""
    exe = os.environ.get("DDICT_BENCH_DRAGON") or shutil.which("dragon")
    if not exe:
        return None
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_dragon.py")
    workdir = tempfile.mkdtemp(prefix="ddict-bench-dragon-")
    try:
        out = subprocess.run(
            [exe, script, str(seconds)], cwd=workdir, capture_output=True, text=True, timeout=600
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"(Dragon run failed: {e!r})", file=sys.stderr)
        return None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    print(f"(Dragon run gave no result: {out.stderr[-500:]})", file=sys.stderr)
    return None


def tls_rows(
    secs: float, bases: dict[str, dict[str, float] | None]
) -> list[tuple[str, str, str, str, str]]:
    """TCP with TLS on (a cluster with the cluster's certificates, as across hosts); none
    where ``cryptography`` (which makes the certificates) is not installed."""
    from distributed import Security

    try:
        sec = Security.temporary()
    except ImportError as e:  # (a test extra, not a bench one)
        print(f"(no TLS rows: {e})", file=sys.stderr)
        return []
    rows = []
    with (
        LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0", security=sec) as cl,
        Client(cl, security=sec) as c,
        dask.config.set({"ddict.local-transport": False}),
    ):
        d = DDict(total_mem="1 GiB", client=c)
        for label in ("100 B", "1 MiB"):
            nbytes, base = SIZES[label], bases.get(label)
            r = run_ddict(d.manager(0), nbytes, secs)
            for op in ("put", "get"):
                ratio = f"{r[op] / base[op]:.2f}x" if base else "n/a"
                rows.append(
                    (
                        f"{op} {label}",
                        "client (tls, as from another host)",
                        fmt(nbytes, r[op]),
                        fmt(nbytes, base[op]) if base else "n/a",
                        ratio,
                    )
                )
        d.destroy()
    return rows


def fmt(nbytes: int, rate: float) -> str:
    if nbytes < 1024:
        return f"{rate:,.0f} ops/s"
    return f"{rate * nbytes / 1e6:,.0f} MB/s"


def cluster_rows(
    c: Client, d: DDict, redis_ctx: Any, bases: dict[str, Any], secs: float, reps: int, n_cpu: int
) -> list[Row]:
    """Every row measured on the 2-worker cluster (``bases`` gets redis-py's per size)."""
    rows: list[Row] = []
    r_py = redis_ctx[1] if redis_ctx else None
    m0 = d.manager(0)  # every key on manager 0, hosted by worker 0
    w0, w1 = d.manager_workers[0], d.manager_workers[1]
    for label, nbytes in SIZES.items():
        s = secs if nbytes < (64 << 20) else max(secs, 1.0)
        res = {
            SAME: run_ddict(m0, nbytes, s),
            "task on the manager's worker": c.submit(
                task_bench, m0, nbytes, s, workers=[w0], pure=False
            ).result(),
            "task, other worker (same host)": c.submit(
                task_bench, m0, nbytes, s, workers=[w1], pure=False
            ).result(),
        }
        t = max(2 * s, 2.0) / PAIRS  # (a slice of a row alternated with redis-py)
        paired: dict[str, tuple[Any, ...]] = {}
        if r_py is not None and label == "1 MiB":  # (get: the spec's 3x from this host)
            paired[SAME] = alternated(
                functools.partial(run_ddict, m0, nbytes, t),
                functools.partial(run_redis, r_py, nbytes, t),
                PAIRS,
            )
        with dask.config.set({"ddict.local-transport": False}):
            tcp = DDict.attach(d.serialize(), client=c)
            try:
                res[TCP] = run_ddict(tcp.manager(0), nbytes, s)
                if r_py is not None and label == "100 B":  # (the 1.5x over TCP)
                    paired[TCP] = alternated(
                        functools.partial(run_ddict, tcp.manager(0), nbytes, t),
                        functools.partial(run_redis, r_py, nbytes, t),
                        PAIRS,
                    )
            finally:
                tcp.detach()
        base = bases[label] = run_redis(r_py, nbytes, s) if r_py else None
        for where, r in res.items():
            for op in ("put", "get"):
                ratio = f"{r[op] / base[op]:.2f}x" if base else "n/a"
                rows.append(
                    (
                        f"{op} {label}",
                        where,
                        fmt(nbytes, r[op]),
                        fmt(nbytes, base[op]) if base else "n/a",
                        ratio,
                    )
                )
        for where, (med, ref, ratios) in paired.items():
            for op in ("put", "get"):
                target = {TCP: "target >= 1.5x", SAME: "target >= 3x" if op == "get" else ""}
                rows.append(
                    (
                        f"{op} {label}",
                        f"{where}, alternated with redis-py",
                        fmt(nbytes, med[op]),
                        fmt(nbytes, ref[op]),
                        _pairs_cell(ratios[op], "x", target[where]),
                    )
                )
    rows.append(floor_row(bases.get("100 B"), secs))
    rows += big_get_rows(m0, reps)
    rows.append(view_room_row(c))
    # channels pick their transport when first used: every TCP call stays in this block
    with dask.config.set({"ddict.local-transport": False}):
        tcp = DDict.attach(d.serialize(), client=c)
        try:
            rows.append(tcp_big_row(tcp.manager(0), reps))
            rows += bulk_rows(c, {SAME: d, TCP: tcp}, r_py, secs)
            rows += host_cpu_rows(tcp.manager(0), redis_ctx, n_cpu)
        finally:
            tcp.detach()
    busy = c.submit(spin, secs * 2 + 1, workers=[w0], pure=False)
    time.sleep(0.5)
    lat = put_latencies(m0, secs * 2)
    busy.result()
    rows.append(
        (
            "p99 put 100 B",
            "client, manager's worker CPU-bound",
            f"{p99(lat) * 1e3:.2f} ms",
            "n/a",
            "target <= 2 ms",
        )
    )
    return rows


def main() -> None:
    args, secs = timed_cells(__doc__)

    reps = 5 if args.quick else 10  # best-of / median counts of the 64 MiB rows
    n_cpu = 10_000 if args.quick else 30_000  # operations per host-CPU cell
    rows: list[Row] = []
    bases: dict[str, dict[str, float] | None] = {}
    redis_ctx = start_redis()
    try:
        with (
            LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cl,
            Client(cl) as c,
        ):
            d = DDict(total_mem="1 GiB", client=c, n_workers=2)
            try:
                rows += cluster_rows(c, d, redis_ctx, bases, secs, reps, n_cpu)
            finally:
                d.destroy()
        rows += tls_rows(secs, bases)
    finally:
        if redis_ctx:
            refs.stop_redis([(redis_ctx[0], 0, redis_ctx[0].workdir)])

    dragon = run_dragon(secs)
    if dragon:
        ours = {(r[0], r[1]): r[2] for r in rows}
        print("operation       | DDict (same host)  | Dragon DDict (same run) | ratio")
        print("-" * 72)
        for op, theirs in dragon.items():
            mine = ours.get((DRAGON_ROWS.get(op, op), SAME))
            if mine is None:
                continue
            value = float(mine.split()[0].replace(",", ""))
            print(f"{op:15} | {mine:18} | {theirs:>15,.0f} ops/s | {value / theirs:.1f}x")
        print()

    head = ("operation", "DDict client", "DDict", "reference (same run)", "ratio")
    print_aligned(head, rows)
    print(f"\n({python_build()}, {os.cpu_count()} cores, {secs:.1f} s per cell)")


if __name__ == "__main__":
    main()
