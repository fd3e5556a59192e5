"""What every benchmark shares: its rows, their verdicts, percentiles, best-of timing and
the printed table.

A benchmark's result is a table whose rows are ``measurement | value | target | result
| notes`` (:data:`Row`); ``result`` is a :func:`verdict` against the row's target.
Written once here so that every ``bench_*.py`` prints the same shape and says "met" or
"MISSED" the same way (the README's tables are copied from them).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: One row of a benchmark's table: measurement, value, target, result, notes.
Row = tuple[str, str, str, str, str]


def verdict(ok: bool) -> str:
    """A row's result: its target ``met``, or ``MISSED`` (capitals: seen at a glance)."""
    return "met" if ok else "MISSED"


def p99(samples: Sequence[float]) -> float:
    """The 99th percentile of ``samples`` (NaN if there are none)."""
    return float(np.percentile(np.asarray(samples), 99)) if len(samples) else float("nan")


def best_of(fn: Callable[[], Any], reps: int, budget: float) -> float:
    """The shortest of ``reps`` timed calls of ``fn`` (fewer once ``budget`` seconds passed,
    at least one)."""
    best = float("inf")
    t_end = time.perf_counter() + budget
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
        del out  # freed after the clock stopped
        if time.perf_counter() > t_end:
            break
    return best


def python_build() -> str:
    """The interpreter and which kernels dask_ddict runs, for a table's last line:
    ``python 3.11.7, compiled kernels`` (``dask_ddict.kernels``; ``DASK_DDICT__COMPILED=false``
    runs the pure-Python ones, to compare)."""
    from dask_ddict import kernels

    how = "compiled kernels" if kernels.COMPILED else "pure-Python kernels"
    return f"python {sys.version.split()[0]}, {how}"


def print_aligned(
    head: Sequence[str], rows: Sequence[Sequence[Any]], pad_last: bool = True
) -> None:
    """``head`` and ``rows`` as columns joined by `` | ``, a rule under the head; every
    column padded to its widest cell (the last one too unless ``pad_last`` is false)."""
    n = len(head) if pad_last else len(head) - 1
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(n)]

    def cells(r: Sequence[Any]) -> str:
        padded = " | ".join(str(x).ljust(w) for x, w in zip(r[:n], widths))
        return padded if pad_last else padded + " | " + str(r[n])

    line = cells(head)
    print(line)
    print("-" * len(line))
    for r in rows:
        print(cells(r))


def print_table(rows: Sequence[Row], tail: str) -> None:
    """The rows ``measurement | value | target | result | notes``, aligned, then ``tail``."""
    print_aligned(("measurement", "value", "target", "result", "notes"), rows, pad_last=False)
    print(tail)


def items_per_second(call: Callable[[], object], per_call: int, seconds: float) -> float:
    """Items per second of ``call()`` (``per_call`` items each), repeated for ``seconds``
    and at least 3 times."""
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 3:
        call()
        n += 1
    return n * per_call / (time.perf_counter() - t0)


def alternated(
    ours: Callable[[], dict[str, float]],
    theirs: Callable[[], dict[str, float]],
    pairs: int = 5,
) -> tuple[dict[str, float], dict[str, float], dict[str, tuple[float, float, float]]]:
    """``ours()`` and ``theirs()`` (each measures one slice: a figure per operation, a
    rate or a cost) run in turn, ``pairs`` times: each side's median figure per
    operation, and per operation the median, least and most of the pairs' ratios
    (ours / theirs).

    Why in turn: on a shared 2-core VM the machine's speed drifts over seconds (other
    processes, the hypervisor's neighbours), by a fifth between runs of the same
    build; two cells measured seconds apart carry that drift whole into their ratio,
    two slices measured back to back share it, and the ratio cancels it."""
    mine = []
    other = []
    for _ in range(pairs):
        mine.append(ours())
        other.append(theirs())
    med = {op: float(np.median([m[op] for m in mine])) for op in mine[0]}
    ref = {op: float(np.median([o[op] for o in other])) for op in mine[0]}
    ratios = {}
    for op in mine[0]:
        r = [m[op] / o[op] for m, o in zip(mine, other)]
        ratios[op] = (float(np.median(r)), min(r), max(r))
    return med, ref, ratios


def timed_cells(doc: str | None) -> tuple[argparse.Namespace, float]:
    """The command line of a benchmark whose cells each run for a time (``--quick``,
    ``--seconds``; ``doc``: its help): the arguments, and the seconds of a cell."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter runs (noisier)")
    ap.add_argument("--seconds", type=float, default=None)
    args = ap.parse_args()
    return args, args.seconds or (0.5 if args.quick else 2.0)
