"""Two managers persisting into one store, killed at any step (tests/test_persist_integrity.py).

The scenario is what a dictionary of two managers does when its managers
persist a new checkpoint at their own pace under ``persist_count``:
manager 0 commits checkpoint ``n``, manager 1 commits ``n``, manager 0
commits ``n + 1`` (:data:`OPS`).  Each write and each rotation goes through
its named steps; a test records them all, then kills a manager at each one in
turn while the other carries on.

Importing this module starts no thread, so a process can import it once and
fork a child per crash (see :data:`FORKER`).
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dask_ddict._serialize import dumps_value, loads_value
from dask_ddict.persist import CheckpointPersister, Persister, persister_for
from dask_ddict.shard.store import PERSISTENT

CHUNK = 1 << 14
NAME = "d"
MANAGERS = 2
#: (persist of the scenario, step name, how many times it reached it): where to kill.
Event = tuple[int, str, int]
#: fsspec options of a URL store (None for a local directory).
Options = dict[str, Any] | None


def content(chkpt: int) -> dict[bytes, Any]:
    """Checkpoint ``chkpt``'s keys, every value tagged with the id."""
    return {f"k{i}".encode(): np.full(1000 + 300 * i, chkpt, dtype="i4") for i in range(8)}


def entries(chkpt: int) -> Callable[[], Iterator[tuple[bytes, bytes, int]]]:
    frames = {k: dumps_value(v).join() for k, v in content(chkpt).items()}
    return lambda: ((k, f, PERSISTENT) for k, f in frames.items())


def tags(store: CheckpointPersister, chkpt: int) -> set[int]:
    """The tags of a persisted checkpoint's values (raises if it cannot be read whole)."""
    got = {k: loads_value(bytes(v)) for k, v, _ in store.read(chkpt)}
    assert set(got) == set(content(0)), f"keys of {chkpt} on manager {store.manager_id}"
    return {int(t) for v in got.values() for t in np.unique(v)}


def store(path: str, m: int, options: Options = None, kind: str = "zarr", **kw: Any) -> Any:
    """Manager ``m``'s persister of ``kind`` (a persister's name) at ``path`` (a directory,
    or a URL with fsspec ``options``)."""
    return persister_for(kind)(
        path, NAME, m, MANAGERS, chunk_bytes=CHUNK, storage_options=options, **kw
    )


def stores(path: str, options: Options = None, kind: str = "zarr") -> list[Any]:
    return [store(path, m, options, kind) for m in range(MANAGERS)]


def setup(path: str, count: int, options: Options = None, kind: str = "zarr") -> int:
    """Checkpoints ``0 .. count - 1`` persisted on both managers; returns the next id."""
    for s in stores(path, options, kind):
        for c in range(count):
            Persister(s, 1, count).write_now(c, entries(c))
    return count


#: The scenario: (manager, checkpoint id - n) of each persist, in order.
OPS = ((0, 0), (1, 0), (0, 1))


def run_op(
    path: str,
    count: int,
    op: int,
    kill_at: tuple[str, int] | None = None,
    options: Options = None,
    kind: str = "zarr",
) -> list[Event]:
    """One persist of the scenario (a fresh process's manager, as after a restart);
    every step reached, in order (SIGKILL at ``kill_at``: step name, nth time)."""
    seen: Counter[str] = Counter()
    events: list[Event] = []
    m, offset = OPS[op]

    def step(name: str) -> None:
        seen[name] += 1
        events.append((op, name, seen[name]))
        if (name, seen[name]) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    Persister(store(path, m, options, kind, step=step), 1, count).write_now(
        count + offset, entries(count + offset)
    )
    return events


def run(path: str, count: int, options: Options = None, kind: str = "zarr") -> list[Event]:
    """The whole scenario in this process; every step reached, in order."""
    return [e for op in range(len(OPS)) for e in run_op(path, count, op, None, options, kind)]


#: The script that runs the scenario once per crash, a fresh interpreter forking a child
#: per persist: ``python FORKER <options as JSON> <kind>`` (see its docstring).
FORKER = Path(__file__).parent / "children" / "fork_crashes.py"
