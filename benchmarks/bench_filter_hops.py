"""One hop of a filter's results between two processes: our stream socket vs Dask's comms.

    python benchmarks/bench_filter_hops.py [--quick]

Measures what the filter's worker-to-worker hops would gain or lose by riding
``distributed.comm`` (as Dask's P2P shuffle does) instead of the filter's own
stream socket (:mod:`dask_ddict.filter.streams`).  A child process (a task) sends
a result to this process (its parent), three ways, each the best of a few runs:

* ``filter stream``: the filter's own classes, a :class:`Sender` in the child and a
  :class:`Receiver` here, with the default batches and credit window (``ddict.compute.*``);
* ``dask comm, from threads``: ``distributed.comm`` TCP with the same batches and
  window, written and read as a task would (a task's thread hands each batch to its
  process's event loop and the parent's thread takes them from its loop), which is
  how a synchronous merge task would use Dask's comms;
* ``dask comm, loop only``: the same messages written and read by the event loops
  alone, with no credit window: the most Dask's comms can do, not reachable from a
  task's thread.

Two results: many small items (a float each, as ``d.filter`` sums give) and a few
large ones (1 MiB of bytes each).  Nothing here touches a cluster or a dictionary.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import pickle
import queue
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from common import print_aligned  # beside this script (sys.path[0])

from dask_ddict.filter.receiving import Receiver
from dask_ddict.filter.streams import HELLO, Sender, StreamLimits, hello, send_frame
from dask_ddict.transport.sockets import connect

WINDOW_LIMITS = StreamLimits(64, 1 << 20, 2, 0.05, 30.0)  # (the ddict.compute defaults)


def blobs(shape: str, n: int) -> list[bytes]:
    """The pickled items of a result: ``n`` floats, or ``n`` values of 1 MiB."""
    if shape == "small":
        return [pickle.dumps(float(i), protocol=5) for i in range(n)]
    return [pickle.dumps(bytes(1 << 20), protocol=5) for _ in range(n)]


def batches(items: list[bytes], limits: StreamLimits) -> list[list[bytes]]:
    """``items`` cut as a :class:`Sender` cuts them (items or bytes, whichever first)."""
    out: list[list[bytes]] = [[]]
    size = 0
    for b in items:
        out[-1].append(b)
        size += len(b)
        if len(out[-1]) >= limits.batch_items or size >= limits.batch_bytes:
            out.append([])
            size = 0
    return [b for b in out if b]


# -- the child (a task): sends one result -------------------------------------------------


def ready() -> None:
    import distributed.comm  # noqa: F401


def send_stream(address: tuple[str, int], token: bytes, shape: str, n: int) -> None:
    sock = connect(address, 30.0)
    send_frame(sock, HELLO, hello(token, 0, None))
    out = Sender(sock, WINDOW_LIMITS)
    for blob in blobs(shape, n):
        out.put_pickled(blob)
    out.end()
    out.close()


def send_comm(address: str, shape: str, n: int, threads: bool) -> None:
    from distributed.comm import connect as comm_connect

    msgs = [{"items": b} for b in batches(blobs(shape, n), WINDOW_LIMITS)]

    async def loop_only() -> None:
        comm = await comm_connect(address)
        for m in msgs:
            await comm.write(m)
        await comm.write({"end": True})
        await comm.read()  # (the parent has read everything)
        await comm.close()

    if not threads:
        asyncio.run(loop_only())
        return
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()

    def on_loop(call: Callable[..., Any], *args: Any) -> Any:  # (a task's thread waits)
        async def run() -> Any:
            return await call(*args)

        return asyncio.run_coroutine_threadsafe(run(), loop).result()

    comm = on_loop(comm_connect, address)
    credits = WINDOW_LIMITS.window
    for m in msgs:
        while credits == 0:
            credits += on_loop(comm.read)["credit"]
        on_loop(comm.write, m)
        credits -= 1
    on_loop(comm.write, {"end": True})
    while "done" not in on_loop(comm.read):
        pass
    on_loop(comm.close)
    loop.call_soon_threadsafe(loop.stop)


# -- the parent (this process): receives it -----------------------------------------------


def via_stream(pool: ProcessPoolExecutor, shape: str, n: int) -> float:
    token = secrets.token_bytes(32)
    receiver = Receiver("127.0.0.1", token, [0], 1, WINDOW_LIMITS)
    try:
        t0 = time.perf_counter()
        sent = pool.submit(send_stream, receiver.address, token, shape, n)
        got = sum(1 for _, blob in receiver.merged(None, lambda: False) if blob is not None)
        elapsed = time.perf_counter() - t0
        sent.result()
    finally:
        receiver.close()
    assert got == n, (got, n)
    return elapsed


def via_comm(pool: ProcessPoolExecutor, shape: str, n: int, threads: bool) -> float:
    from distributed.comm import listen

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    frames: queue.Queue[Any] = queue.Queue()
    ends: list[Any] = []

    async def handle(comm: Any) -> None:  # (on the loop: each batch handed to a thread)
        ends.append(comm)
        while True:
            msg = await comm.read()
            frames.put(msg)
            if "end" in msg:
                if not threads:
                    await comm.write({"done": True})
                return

    async def start() -> Any:
        listener = listen("tcp://127.0.0.1:0", handle)
        await listener.start()
        return listener

    listener = asyncio.run_coroutine_threadsafe(start(), loop).result()
    try:
        t0 = time.perf_counter()
        sent = pool.submit(send_comm, listener.contact_address, shape, n, threads)
        got = 0
        while True:
            msg = frames.get()
            if "end" in msg:
                break
            got += sum(1 for _ in msg["items"])
            if threads:  # (a batch consumed: its credit back, as the stream does)
                asyncio.run_coroutine_threadsafe(ends[0].write({"credit": 1}), loop)
        if threads:
            asyncio.run_coroutine_threadsafe(ends[0].write({"done": True}), loop).result()
        elapsed = time.perf_counter() - t0
        sent.result()
    finally:
        loop.call_soon_threadsafe(listener.stop)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
    assert got == n, (got, n)
    return elapsed


def best(run: Callable[[], float], reps: int) -> float:
    run()  # (warm-up)
    return min(run() for _ in range(reps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller results, fewer runs")
    args = parser.parse_args()
    shapes = {"small": 20_000 if args.quick else 100_000, "large": 16 if args.quick else 64}
    reps = 2 if args.quick else 3
    rows = []
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        pool.submit(ready).result()  # (the child started and imported everything)
        for shape, n in shapes.items():
            what = f"{n:,} floats" if shape == "small" else f"{n} x 1 MiB"
            mib = sum(map(len, blobs(shape, n))) / (1 << 20)
            for name, run in (
                ("filter stream", functools.partial(via_stream, pool, shape, n)),
                ("dask comm, from threads", functools.partial(via_comm, pool, shape, n, True)),
                ("dask comm, loop only", functools.partial(via_comm, pool, shape, n, False)),
            ):
                t = best(run, reps)
                rate = (
                    f"{n / t / 1e3:.0f} k items/s" if shape == "small" else f"{mib / t:.0f} MiB/s"
                )
                rows.append((what, name, f"{t * 1e3:.0f} ms", rate))
    print_aligned(("result", "hop", "best time", "throughput"), rows)


if __name__ == "__main__":
    main()
