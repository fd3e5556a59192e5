"""Partitions: how long a replicated dictionary's clients wait while the network is cut.

    sudo python benchmarks/bench_partitions.py [--lease 4] [--margin 0.5]

The machines of ``tests/support/machines.py`` (root, ``ip``, ``unshare``, ``nsenter``): ``s`` runs
the scheduler and a worker, ``a`` and ``b`` a worker each, ``c`` two writer processes
(``tests/support/partitioned.py``) that put keys on every manager of a ``replicas=1``
dictionary in turn and ``fetch_add`` a counter of ``M``, whose primary is on ``b`` and
whose replica is on ``a`` (or the other way round, as the placement fell: the names
below follow ``M``).  Each partition is healed once the change it causes is done
(``M`` served elsewhere, a replica dropped), or once the orchestrator suspects ``b``;
then every acknowledged write must read back and no increment may be handed out twice
(``partitioned.check``).  The settings are the shipped ones (``ddict.lease.*`` from the
command line; ``ddict.replica.timeout`` 10 s, ``ddict.host.probe-timeout`` 3 s).

Reported per partition: when the change came (seconds after the cut); and, for the
operations begun while the network was cut, by class of manager (``M``; those whose
primary was cut from the scheduler; those one of whose replicas was cut off from them;
the others, whose primary and replicas were on one side with the scheduler): how many,
the longest, and their 99th percentile.  Each writer writes each manager from a thread of its own, so a
manager that waits holds up no other.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Any

from common import print_table  # beside this script (sys.path[0])
from distributed import Client

from dask_ddict import DDict


def _tests() -> Any:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    if root not in sys.path:
        sys.path.insert(0, root)  # (the repository: tests.support)
    return (
        importlib.import_module("tests.support.partitioned"),
        importlib.import_module("tests.support.machines"),
    )


def _revoked(dask_scheduler: Any) -> list[str]:
    return sorted(dask_scheduler.plugins["ddict"].leases.revoked)


#: The classes of managers, in the order of the table.
CLASSES = ("M", "primary cut from s", "replica cut off", "the others")


def _classes(
    c: Client, d: Any, part: Any, hot: int, cut: list[tuple[str, str]], s: str
) -> dict[int, str]:
    """Each manager's class (:data:`CLASSES`): ``M``; one whose primary's machine is cut
    from the scheduler's (``s``); one with a replica on the other side of ``cut`` from its
    primary; the others (their primary and replicas on one side, with the scheduler)."""
    machine_of, reps = part.where(c, d)
    apart = {frozenset(pair) for pair in cut}
    out = {}
    for m in d._core.layout.managers:
        primary = machine_of[m.worker]
        if m.manager_id == hot:
            out[m.manager_id] = CLASSES[0]
        elif frozenset((primary, s)) in apart:
            out[m.manager_id] = CLASSES[1]
        elif any(frozenset((primary, machine_of[r])) in apart for r in reps[m.manager_id]):
            out[m.manager_id] = CLASSES[2]
        else:
            out[m.manager_id] = CLASSES[3]
    return out


def run(
    ms: Any, part: Any, c: Client, name: str, cut: list[tuple[str, str]], until: Any
) -> list[tuple[str, str, str, str, str]]:
    d = DDict(
        managers_per_worker=2,
        total_mem="96 MiB",
        client=c,
        replicas=1,
        timeout=60,
        lifetime="cluster",
    )
    try:
        part.settled(c, d)
        hot, p, r = part.hot_manager(c, d)
        cut = [
            (
                p if one == "b" else r if one == "a" else one,
                p if other == "b" else r if other == "a" else other,
            )
            for one, other in cut
        ]
        classes = _classes(c, d, part, hot, cut, "s")
        writers = part.Writers(ms, d, hot, "w", alone=True)
        time.sleep(2.0)
        began = time.time()
        for one, other in cut:
            ms.cut(one, other)
        part.wait("the change the partition makes", until(c, d, hot), 120.0)
        changed = time.time() - began
        time.sleep(1.0)
        ms.heal()
        healed = time.time()
        time.sleep(6.0)
        records = writers.join()
        part.check(d, hot, "w", records, healed + 5.0)
    finally:
        ms.heal()
        d.destroy()
    rows = [(f"{name}: the change", f"{changed:.1f} s after the cut", "-", "-", "")]
    for kind in CLASSES:
        during = sorted(
            r[6] - r[5] for r in records if began <= r[5] <= healed and classes[r[2]] == kind
        )
        if during:
            rows.append(
                (
                    f"{name}: {kind}",
                    f"longest {during[-1]:.2f} s",
                    f"p99 {1e3 * during[int(0.99 * (len(during) - 1))]:.1f} ms",
                    "-",
                    f"{len(during)} operations begun while cut",
                )
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lease", default="4", help="ddict.lease.duration (seconds)")
    ap.add_argument("--margin", default="0.5", help="ddict.lease.margin (seconds)")
    args = ap.parse_args()
    part, machines = _tests()
    why = importlib.import_module("tests.support.twohost").unavailable()
    if why is not None:
        sys.exit(f"the machines fixture cannot run here: {why}")
    env = {
        "DASK_DDICT__LEASE__DURATION": f"{args.lease}s",
        "DASK_DDICT__LEASE__MARGIN": f"{args.margin}s",
    }

    def failed_over(c: Client, d: Any, hot: int) -> Any:
        first = part.primary_of(d, hot).supervisor
        return lambda: part.primary_of(d, hot).supervisor != first

    def dropped(c: Client, d: Any, hot: int) -> Any:
        first = part.where(c, d)[1][hot]
        return lambda: part.where(c, d)[1][hot] != first

    def suspected(c: Client, d: Any, hot: int) -> Any:
        sup = part.primary_of(d, hot).supervisor
        return lambda: sup in c.run_on_scheduler(_revoked)

    s = machines.S
    cases = [
        ("b cut from s and a, not its clients", [("b", s), ("b", "a")], failed_over),
        ("b cut from s only", [("b", s)], failed_over),
        ("a (M's replica) cut from b", [("a", "b")], dropped),
        ("s cut from everyone", [(s, "a"), (s, "b"), (s, "c")], suspected),
    ]
    rows = []
    with machines.Machines(env=env) as ms, Client(ms.scheduler_address, timeout=60) as c:
        part.hosts_ready(c, 3)
        for name, cut, until in cases:
            rows += run(ms, part, c, name, cut, until)
    print_table(
        rows,
        f"\n(lease {args.lease} s, margin {args.margin} s; python "
        f"{sys.version.split()[0]}, {os.cpu_count()} cores; every acknowledged "
        "write read back, no increment handed out twice)",
    )


if __name__ == "__main__":
    main()
