"""A bounded wait: poll a predicate until it holds, or fail naming what was awaited.

A test that waits for something another process does (a move, a failover, a file
swept) polls for it: a fixed sleep is either too short on a loaded machine or too
long everywhere else.  The wait sleeps between polls (the tests share two cores with
the cluster they test: a busy wait would slow down what it waits for) and is bounded:
on timeout it raises ``AssertionError`` (a failed test, not an error in the
harness) whose message says what did not happen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll_for(
    predicate: Callable[[], T],
    timeout: float,
    what: str | Callable[[], object],
    interval: float = 0.05,
) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns a true value, and
    return that value; after ``timeout`` seconds fail with ``what`` in the message (a
    callable ``what`` is called then, to say how things stood)."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"waited {timeout} s for: {said}")
        time.sleep(interval)
