"""Persist a checkpoint and SIGKILL this process at a named step of it.

``crash_persist.py <path> <chkpt> <count> <step> <nth> <kind>``: the persister of
``kind`` at ``path`` writes :func:`~tests.support.persisted.generation` 1 as checkpoint
``chkpt`` under ``persist_count=count``, and this process kills itself the ``nth`` time
the persist reaches ``step`` (``tests/test_persist_integrity.py`` then reads what is
left).  A process of its own, so that the kill is a real one: nothing flushed or
closed after it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # (the repository: tests.support)

from dask_ddict.persist import Persister  # noqa: E402
from tests.support.persisted import entries_of, generation, opened  # noqa: E402


def main(path: str, chkpt: int, count: int, at: str, nth: int, kind: str) -> None:
    seen: dict[str, int] = {}

    def step(name: str) -> None:
        seen[name] = seen.get(name, 0) + 1
        if name == at and seen[name] == nth:
            os.kill(os.getpid(), signal.SIGKILL)

    store = opened(kind, path, step=step)
    Persister(store, 1, count).write_now(chkpt, entries_of(generation(1)))


if __name__ == "__main__":
    path, chkpt, count, at, nth, kind = sys.argv[1:7]
    main(path, int(chkpt), int(count), at, int(nth), kind)
