"""Writers for the elastic and fault tests: client threads and tasks that put and
``fetch_add`` while the cluster changes shape or a host process is killed, and the
check that nothing they were told was written is lost (shared by the moves', the
replicas' and the key lanes' tests)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from distributed import Client

from dask_ddict import DDict
from tests.support.polling import poll_for


def write_until(
    d: DDict, tag: str, stop: threading.Event | Any, bound: float = 60.0
) -> tuple[dict[Any, int], int]:
    """Put ``(tag, i) -> i`` and fetch_add ``("count", tag)`` until ``stop``; return the
    acknowledged puts and increments (an exception is a failure of the test)."""
    acked: dict[Any, int] = {}
    adds = 0
    end = time.monotonic() + bound
    i = 0
    while not stop() and time.monotonic() < end:
        d[(tag, i % 200)] = i
        acked[(tag, i % 200)] = i
        d.fetch_add(("count", tag), 1)
        adds += 1
        i += 1
    return acked, adds


def task_writer(d: DDict, tag: str) -> tuple[dict[Any, int], int]:
    return write_until(d, tag, lambda: "stop" in d)


def check_writes(d: DDict, results: list[tuple[dict[Any, int], int]], tags: list[str]) -> None:
    for (acked, adds), tag in zip(results, tags):
        assert adds > 0
        for k, v in acked.items():
            assert d[k] == v, (k, v)
        assert d[("count", tag)] == adds
    for m in range(d.num_managers):  # every manager takes new puts
        d.manager(m)[("after", m)] = m
        assert d.manager(m)[("after", m)] == m


def wait_gone(d: DDict, worker: str, bound: float = 60.0) -> None:
    """Wait until no manager is hosted for ``worker`` (its nanny closes after the
    retirement returns, and moves its managers then)."""
    poll_for(
        lambda: worker not in d._core.fresh(force=True).manager_workers,
        bound,
        f"no manager left on {worker}",
        0.2,
    )


def with_writers(c: Client, d: DDict, stay: list[str], change: Any) -> None:
    """Run 2 client threads and 2 tasks (on ``stay`` workers) writing while ``change()``."""
    stop = threading.Event()
    results: list[Any] = [None, None]
    threads = [
        threading.Thread(
            target=lambda j=j: results.__setitem__(j, write_until(d, f"t{j}", stop.is_set))
        )
        for j in range(2)
    ]
    for t in threads:
        t.start()
    futures = [
        c.submit(task_writer, d, f"task{j}", workers=[stay[j % len(stay)]], pure=False)
        for j in range(2)
    ]
    time.sleep(1.0)
    change()
    time.sleep(1.0)
    stop.set()
    d["stop"] = True
    for t in threads:
        t.join(90)
    task_results = c.gather(futures)
    check_writes(d, [*results, *task_results], ["t0", "t1", "task0", "task1"])


def under_a_host_kill(d: DDict, step: Callable[[int], None], done: list[list[Any]]) -> None:
    """Three threads call ``step(i)`` (which adds to ``done[i]``) while the host process
    of manager 0 is SIGKILLed, once each did 50, and restarted; they stop once each did
    50 more after it.  None of them failed."""
    host = d.stats[0].pid
    stop = threading.Event()
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            while not stop.is_set() and len(done[i]) < 100_000:
                step(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(done))]
    for t in threads:
        t.start()
    try:
        poll_for(lambda: min(len(x) for x in done) > 50, 30, "the threads under way")
        os.kill(host, signal.SIGKILL)
        poll_for(lambda: d.stats[0].pid != host, 60, "the host restarted")
        at = [len(x) for x in done]
        poll_for(
            lambda: all(len(x) > a + 50 for x, a in zip(done, at, strict=True)) or errors,
            30,
            "the threads after the restart",
        )
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert errors == []
