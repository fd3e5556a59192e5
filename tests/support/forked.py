"""Work in a forked child of the test process (``multiprocessing``'s fork context, as a
PyTorch ``DataLoader`` forks its workers), and what it answered."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

_FORK = mp.get_context("fork")
#: A child's work is short: one that runs this long is stuck.
_CHILD_TIMEOUT = 60.0  # (seconds)


def _in_child(work: Callable[[], Any]) -> tuple[Callable[[], Any], Any]:
    """Start ``work`` in a forked child; returns what waits for its answer (what it
    returned, or its exception's repr) and the child process."""
    here, there = _FORK.Pipe(duplex=False)

    def run() -> None:
        try:
            there.send(work())
        except BaseException as e:  # (said to the parent, which fails the test)
            there.send(f"child raised {e!r}")

    p = _FORK.Process(target=run, daemon=True)
    p.start()
    there.close()

    def answer() -> Any:
        try:
            if not here.poll(_CHILD_TIMEOUT):
                raise AssertionError(f"the child said nothing in {_CHILD_TIMEOUT} s")
            return here.recv()
        finally:
            p.join(_CHILD_TIMEOUT)
            if p.is_alive():
                p.kill()
                p.join()
            here.close()

    return answer, p


def answer_of(work: Callable[[], Any]) -> Any:
    """What ``work`` returned in a forked child that then exited cleanly."""
    answer, p = _in_child(work)
    got = answer()
    assert p.exitcode == 0
    return got
