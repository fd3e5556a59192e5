"""This process's timings of the operations it sends, by operation (``d.profile()``).

Dragon's client keeps a ``TimeKeeper`` whose report (``d.profile()``, Dragon 0.13.2)
says where its operations spend their time.  Here the report is, for each
operation this process sends (``get``, ``put``, a broadcast such as ``len`` as
one), how many, their total and mean time, and the p50, p99 and longest, the
percentiles from a bounded reservoir of samples (:data:`RESERVOIR` per operation,
each sample kept with the same chance: a long run's percentiles are its own, not
its first seconds').

Timings are off unless asked for (``d.profile_reset()``, or ``ddict.profile: true``
for every process from its start): the key path then pays one read of :data:`on`
per operation and nothing else (``docs/guide/operations.md``, "A process's own
timings", says what each costs).  They are taken where an operation leaves the handle
(:meth:`~.channels.Channels.channel`, ``each``, ``get_many``): an operation timed
inside another (``get_many``'s reads of the shards on this host, which go through
their channels) counts once, as the outer one.

Timings are the process's, not one handle's (Dragon keeps them per client
object): every handle of the process, and every thread, adds to the same table.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .. import config
from .._forking import in_child, reinit_lock
from .operation import Operation

R = TypeVar("R")

#: Whether operations are timed now (read on the key path: one module attribute).
on: bool = bool(config.get("profile"))
#: Samples kept per operation for its percentiles.
RESERVOIR = 1024


class _Times:
    """One operation's running totals and its reservoir of samples."""

    __slots__ = ("count", "total", "most", "samples")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.most = 0.0
        self.samples: list[float] = []


class _Inside(threading.local):
    busy = False  # an operation of this thread is being timed


_table: dict[str, _Times] = {}
_lock = threading.Lock()


def _forked() -> None:
    reinit_lock(_lock)
    _table.clear()  # (the parent's timings are the parent's)


in_child(_forked)
_inside = _Inside()
_random = random.Random().random
_clock = time.perf_counter
_since = time.monotonic()
_names: dict[type, str] = {}  # an operation's class: its name in the report


def timed(name: str, fn: Callable[..., R], *args: Any) -> R:
    """``fn(*args)``, its time added to operation ``name``'s (unless this thread is
    timing an operation already: the outer one counts, once)."""
    inside = _inside
    if inside.busy:
        return fn(*args)
    inside.busy = True
    start = _clock()
    try:
        return fn(*args)
    finally:
        seconds = _clock() - start
        inside.busy = False
        _record(name, seconds)


def _record(name: str, seconds: float) -> None:
    with _lock:
        t = _table.get(name)
        if t is None:
            t = _table[name] = _Times()
        t.count += 1
        t.total += seconds
        if seconds > t.most:
            t.most = seconds
        if len(t.samples) < RESERVOIR:
            t.samples.append(seconds)
        else:  # (reservoir sampling: each of the count samples kept with the same chance)
            i = int(_random() * t.count)
            if i < RESERVOIR:
                t.samples[i] = seconds


def name_of(o: Operation) -> str:
    """``o``'s name in the report: its wire operation's, in lower case (``get``)."""
    name = _names.get(type(o))
    if name is None:
        name = _names[type(o)] = o.op.name.lower()
    return name


def reset(enable: bool) -> None:
    """Forget every timing; from now on operations are timed (``enable``) or not."""
    global on, _since
    with _lock:
        _table.clear()
        _since = time.monotonic()
        on = enable


class TimedChannel:
    """A channel whose operations are timed: what
    :meth:`~.channels.Channels.channel` gives while timings are on (anything but
    ``call`` is the channel's own)."""

    __slots__ = ("_ch",)

    def __init__(self, ch: Any) -> None:
        self._ch = ch

    def call(self, o: Operation) -> Any:
        return timed(name_of(o), self._ch.call, o)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ch, name)

    def __repr__(self) -> str:
        return f"<timed {self._ch!r}>"


@dataclass(frozen=True)
class OperationTimes:
    """One operation's timings, in seconds (p50 and p99 from the reservoir)."""

    count: int
    total: float
    mean: float
    p50: float
    p99: float
    max: float


@dataclass(frozen=True)
class Profile:
    """This process's timings of its operations (what ``d.profile()`` returns).

    ``str()`` of it is a table, one row per operation, in microseconds (as
    Dragon's report is printed); ``operations`` holds the numbers.
    """

    enabled: bool
    seconds: float  # since the timings were last reset
    pid: int
    operations: dict[str, OperationTimes]

    def __str__(self) -> str:
        head = (
            f"DDict client timings of process {self.pid} over {self.seconds:.1f} s "
            f"({'on' if self.enabled else 'off'})"
        )
        if not self.operations:
            hint = (
                "" if self.enabled else ": d.profile_reset() (or ddict.profile: true) turns them on"
            )
            return f"{head}: no operation timed{hint}"
        cols = ("operation", "count", "total s", "mean us", "p50 us", "p99 us", "max us")
        rows = [cols] + [
            (
                name,
                f"{t.count}",
                f"{t.total:.3f}",
                f"{t.mean * 1e6:.1f}",
                f"{t.p50 * 1e6:.1f}",
                f"{t.p99 * 1e6:.1f}",
                f"{t.max * 1e6:.1f}",
            )
            for name, t in sorted(self.operations.items(), key=lambda kv: -kv[1].total)
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
        lines = [
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
            for r in rows
        ]
        return "\n".join([head + ":", *lines])


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report() -> Profile:
    """The timings so far (a copy: later operations do not change it)."""
    with _lock:
        taken = {name: (t.count, t.total, t.most, sorted(t.samples)) for name, t in _table.items()}
        seconds = time.monotonic() - _since
    return Profile(
        on,
        seconds,
        os.getpid(),
        {
            name: OperationTimes(
                count, total, total / count, _quantile(s, 0.5), _quantile(s, 0.99), most
            )
            for name, (count, total, most, s) in taken.items()
        },
    )
