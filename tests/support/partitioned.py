"""A replicated dictionary on the machines of ``tests/support/machines.py``, and writers that keep count.

Shared by ``test_partitions.py`` (what must hold) and ``benchmarks/bench_partitions.py``
(how long clients wait).  The dictionary spreads two managers on each of ``s``, ``a``
and ``b``, each with a replica on another machine; :func:`hot_manager` is one whose
primary is on ``b`` and whose replica is on ``a`` (or the other way round, as the
placement fell: the callers name the two machines as it says).  :class:`Writers` are
processes on machine ``c`` that put keys on every manager in turn (or each in a thread
of its own) and ``fetch_add`` a counter of the hot one, recording every operation
(acknowledged or not, when it began and ended);
:func:`check` is what must hold of them afterwards.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable
from typing import Any

from distributed import Client

from dask_ddict import DDict
from dask_ddict.client.workers import scheduler_workers
from dask_ddict.layout import ManagerInfo
from tests.support.machines import Machines
from tests.support.polling import poll_for

_WRITER = """
import json, os, sys, threading, time
from distributed import Client
from dask_ddict import DDict
address, name, tag, hot, stop, alone = sys.argv[1:7]
hot, said = int(hot), threading.Lock()

def say(record):
    line = json.dumps(record) + "\\n"
    with said:
        sys.stdout.write(line)
        sys.stdout.flush()

def write(d, ms, step):
    i = 0
    while not os.path.exists(stop):
        m, k = ms[i % len(ms)], i * step + ms[0]  # (k: unique over the threads)
        for op in ("put", "add"):
            if op == "add" and m != hot:
                continue
            t = time.time()
            try:
                if op == "put":
                    d.manager(m)[(tag, k)] = k
                    got = k
                else:
                    got = d.manager(hot).fetch_add(("hot", tag[:-1]), 1)
                say([op, m, k, got, t, time.time(), ""])
            except Exception as e:
                say([op, m, k, None, t, time.time(), repr(e)])
        i += 1

with Client(address, timeout=30) as c:
    d = DDict.from_name(name, client=c, timeout=30)
    n = d.num_managers
    say(["ready"])
    if alone == "1":  # (a thread per manager: one that waits holds up no other)
        threads = [threading.Thread(target=write, args=(d, [m], n)) for m in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:  # (one thread, the managers in turn)
        write(d, list(range(n)), 1)
"""

#: A record of one operation: ``[writer, op ("put", "add"), manager, i, its result (None if
#: it failed), began, ended (time.time()), its error ("" if none)]``.
Record = list[Any]


def wait(what: str, ready: Callable[[], bool], bound: float = 60.0) -> None:
    poll_for(ready, bound, what, 0.2)


def hosts_ready(c: Client, n: int, bound: float = 120.0) -> None:
    """Wait until ``n`` workers run and each one's ddict host answers (a worker registers
    before its nanny's host is up: a dictionary created then places nothing there)."""
    from distributed.core import rpc

    from dask_ddict.client.core import install_orchestrator

    install_orchestrator(c)
    c.wait_for_workers(n, timeout=bound)

    async def answers(nanny: str) -> bool:
        async with rpc(nanny) as r:
            return isinstance(await r.ddict_host_info(), dict)

    def ready() -> bool:
        infos = scheduler_workers(c).values()
        try:
            return len(infos) >= n and all(
                i.get("status") == "running" and c.sync(answers, i["nanny"]) for i in infos
            )
        except Exception:  # noqa: BLE001 - not yet
            return False

    wait("every worker's ddict host", ready, bound)


def where(c: Client, d: DDict) -> tuple[dict[str, str], dict[int, list[str]]]:
    """(worker -> machine, manager -> the workers of its replicas)."""
    machine_of = {
        w: info["name"].removeprefix("worker-") for w, info in scheduler_workers(c).items()
    }
    reps = {
        int(k): list(v) for k, v in c.sync(c.scheduler.ddict_replicas, name=d.get_name()).items()
    }
    return machine_of, reps


def settled(c: Client, d: DDict, bound: float = 90.0) -> None:
    """Every manager serves, with its replica on another machine (repairs done)."""
    seen: list[Any] = []

    def served() -> bool:
        machine_of, reps = where(c, d)
        layout = d._core.fresh(force=True)
        seen[:] = [layout.managers, reps]
        return all(
            not m.lost
            and len(reps.get(m.manager_id, ())) == 1
            and machine_of.get(reps[m.manager_id][0]) != machine_of.get(m.worker)
            for m in layout.managers
        )

    poll_for(served, bound, lambda: f"every manager served and replicated: {seen}", 0.3)


def hot_manager(c: Client, d: DDict) -> tuple[int, str, str]:
    """A manager whose primary is on ``b`` and whose replica is on ``a``, else one the
    other way round: ``(manager, its primary's machine, its replica's)``."""
    machine_of, reps = where(c, d)
    pairs = [
        (m.manager_id, machine_of[m.worker], machine_of[reps[m.manager_id][0]])
        for m in d._core.layout.managers
    ]
    for primary, replica in (("b", "a"), ("a", "b")):
        for mid, p, r in pairs:
            if (p, r) == (primary, replica):
                return mid, p, r
    raise AssertionError(f"no manager with its primary and its replica on a and b: {pairs}")


def primary_of(d: DDict, mid: int) -> ManagerInfo:
    return d._core.fresh(force=True).managers[mid]


class Writers:
    """Writer processes on machine ``c`` (see the module docstring) and what they did."""

    def __init__(
        self, ms: Machines, d: DDict, hot: int, run: str, n: int = 2, alone: bool = False
    ) -> None:
        self.run, self.ms = run, ms
        self.stop = ms.tmp / f"stop-{d.get_name()}-{run}"
        self.procs = [
            ms.popen(
                "c",
                _WRITER,
                ms.scheduler_address,
                d.get_name(),
                f"{run}{j}",
                str(hot),
                str(self.stop),
                str(int(alone)),
                name=f"writer-{run}{j}",
            )
            for j in range(n)
        ]
        self.outs: list[list[str]] = [[] for _ in self.procs]
        self.readers = [
            threading.Thread(target=_read, args=(p, out), daemon=True)
            for p, out in zip(self.procs, self.outs)
        ]
        for t in self.readers:  # (a writer never waits for a full pipe)
            t.start()
        for j, out in enumerate(self.outs):  # (connected, attached: writing)
            wait(f"writer {run}{j}", lambda out=out: bool(out) or self.procs[j].poll() is not None)
            assert json.loads(out[0] if out else "null") == ["ready"], ms.log(f"writer-{run}{j}")

    def acknowledged(self, op: str, after: float) -> bool:
        """Whether a writer has an ``op`` acknowledged that ended after ``after`` (now)."""
        return any(
            r[0] == op and r[5] > after and not r[6]
            for out in self.outs
            for r in map(json.loads, out[1:])
        )

    def join(self) -> list[Record]:
        """Stop them; every operation they did (:data:`Record`)."""
        self.stop.touch()
        records = []
        for j, (p, t, out) in enumerate(zip(self.procs, self.readers, self.outs)):
            assert p.wait(180) == 0, self.ms.log(f"writer-{self.run}{j}")
            t.join(60)
            records += [[f"{self.run}{j}", *json.loads(line)] for line in out[1:]]
        return records


def _read(p: subprocess.Popen[str], out: list[str]) -> None:
    assert p.stdout is not None
    for line in p.stdout:
        if line.strip():
            out.append(line)


def check(d: DDict, hot: int, run: str, records: list[Record], converged: float) -> None:
    """Every acknowledged put reads back; the counter's acknowledged old values differ (two
    primaries answering at once would hand out the same ones), and its value counts no
    more increments than were sent; every operation begun after ``converged`` (a time:
    once every client should have found the one primary) was acknowledged."""
    puts = [r for r in records if r[1] == "put" and not r[7]]
    adds = [r[4] for r in records if r[1] == "add" and not r[7]]
    failed = [r for r in records if r[7]]
    assert puts and adds
    for tag, _, m, i, _, _, _, _ in puts:
        assert d.manager(m)[(tag, i)] == i, (tag, m, i)
    assert len(adds) == len(set(adds)), "two primaries acknowledged increments at once"
    total = d.manager(hot)[("hot", run)]
    gaps = sorted(set(range(total)) - set(adds))  # (increments applied, not acknowledged)
    assert max(adds) < total <= len(adds) + sum(r[1] == "add" for r in failed), (
        gaps,
        [
            r
            for r in records
            if r[1] == "add" and r[4] is not None and any(abs(r[4] - g) <= 2 for g in gaps)
        ],
        failed[:10],
    )
    late = [r for r in records if r[5] > converged]
    assert late and not [r for r in late if r[7]], [r for r in late if r[7]][:5]
