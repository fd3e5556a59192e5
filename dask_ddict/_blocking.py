"""The one rule of a thread that runs an event loop: it never sleeps.

A host process can serve its idle connections from one event-loop thread
(:mod:`.host.loop`, ``ddict.host.event-loop``): under many clients one
``epoll_wait`` finds several requests ready, where a thread per connection pays
a wake-up and an interpreter-lock hand-over for each.  Most requests take
microseconds and are served on that thread.  Code that may sleep while serving one (a read or write
that must wait for a checkpoint, a manager lock held by a move, a replica's
acknowledgement, a peer slow to read its reply) calls :func:`will_block` first:
on the loop's thread, that hands the loop on to another thread, and this one
finishes its request blocking, as a thread of its own, then returns the
connection to the loop.  Nothing is copied and nothing is served twice: the
request stays on the stack that was serving it.

Elsewhere (client processes, tasks, control threads) :func:`will_block` does
nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

_local = threading.local()


def will_block() -> None:
    """About to sleep: if this thread runs an event loop, hand the loop on first."""
    hand_on = getattr(_local, "hand_on", None)
    if hand_on is not None:
        hand_on()


def acquire(lock: threading.Lock) -> None:
    """Take ``lock``, handing the loop on first if another thread holds it."""
    if not lock.acquire(False):
        will_block()
        lock.acquire()


@contextlib.contextmanager
def locked(lock: threading.Lock) -> Iterator[None]:
    """``with lock``, through :func:`acquire` (for paths off the hot one)."""
    acquire(lock)
    try:
        yield
    finally:
        lock.release()


def serving(hand_on: Callable[[], None] | None) -> None:
    """This thread runs an event loop now (``hand_on`` gives it away), or no longer
    (``None``).  ``hand_on`` must clear it: it is called at most once."""
    _local.hand_on = hand_on
