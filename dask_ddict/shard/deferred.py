"""Deferred operations of one manager, applied in the order they arrived.

An operation that the working set cannot do yet (it raised
:class:`~dask_ddict.shard.working_set.MustWait`: a put to a checkpoint that
cannot be created before an older one retires, or a read under
``wait_for_keys`` of a key not yet written) is queued here with a function
that tries it once.  After every change of the shard, the thread that made
the change, still holding the manager's lock, tries the queued operations in
arrival order (:meth:`DeferredQueue.drain`), so that

- two deferred puts to one key are applied in the order they arrived, never
  the other way round, and
- a request that arrives after the write that unblocked them finds them
  applied: the lock is not released between that write and the last of them,
  and the write's own reply is sent only after the drain (Dragon's manager
  retries its deferred operations before it answers the request that
  unblocked them).

Waiting threads do nothing but sleep on their own condition until their
operation is done, failed, timed out or the manager closed.  This is a pure
data structure over a lock; the manager supplies the tries.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ..errors import DDictError, DDictTimeoutError
from .working_set import MustWait

T = TypeVar("T")

#: How often a drain goes over its queue at most (each pass that completes an
#: operation can unblock an older one; a pass that completes none ends it).
_MAX_PASSES = 1 << 16


class Deferred(Generic[T]):
    """One waiting operation: its try and, once done, its outcome."""

    __slots__ = ("attempt", "wake", "done", "result", "error")

    def __init__(self, attempt: Callable[[], T], lock: threading.Lock) -> None:
        self.attempt = attempt
        self.wake = threading.Condition(lock)
        self.done = False
        self.result: T | None = None
        self.error: BaseException | None = None

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """Record the outcome and wake the waiting thread (the lock is held)."""
        self.done, self.result, self.error = True, result, error
        self.wake.notify()


class DeferredQueue:
    """The deferred operations of one manager, oldest first.

    Parameters
    ----------
    lock
        The manager's lock: every method is called with it held.
    """

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        #: The waiting operations, oldest first (a plain list: its truth is a cheap test).
        self.waiting: list[Deferred[Any]] = []
        self._closed: Callable[[], DDictError] | None = None

    def __len__(self) -> int:
        return len(self.waiting)

    def __repr__(self) -> str:
        return f"<DeferredQueue waiting={len(self.waiting)}{' closed' if self._closed else ''}>"

    def wait(self, attempt: Callable[[], T], timeout: float | None, what: str) -> T:
        """Queue an operation that must wait and sleep until a drain has done it.

        Parameters
        ----------
        attempt
            Tries the operation once: returns its result, raises
            :class:`MustWait` to stay queued, or raises its error.
        timeout
            Seconds to wait (``None`` or negative: no limit).
        what
            The operation, for the timeout's message.

        Raises
        ------
        DDictTimeoutError
            ``timeout`` expired first (the operation was not applied).
        """
        if self._closed is not None:
            raise self._closed()
        op: Deferred[T] = Deferred(attempt, self._lock)
        self.waiting.append(op)
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        try:
            while not op.done:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise DDictTimeoutError(f"{what} timed out after {timeout} s")
                op.wake.wait(remaining)
        finally:
            if not op.done:
                self.waiting.remove(op)
        if op.error is not None:
            raise op.error
        return op.result  # type: ignore[return-value]

    def drain(self) -> None:
        """Try the queued operations in arrival order, after a change (lock held).

        Passes repeat while one completes something: an operation applied
        late in the queue may unblock an older one.
        """
        for _ in range(_MAX_PASSES):
            if not self.waiting:
                return
            progressed = False
            for op in list(self.waiting):
                try:
                    result = op.attempt()
                except MustWait:
                    continue
                except BaseException as e:  # the operation's own failure: its caller's
                    self.waiting.remove(op)
                    op.finish(error=e)
                else:
                    self.waiting.remove(op)
                    op.finish(result)
                    progressed = True  # (a failure changed nothing: no new pass for it)
            if not progressed:
                return

    def close(self, error: Callable[[], DDictError]) -> None:
        """Fail every queued operation and all later ones with a new ``error()`` each
        (lock held): one exception object is never raised in two threads."""
        self._closed = error
        queue, self.waiting[:] = list(self.waiting), []
        for op in queue:
            op.finish(error=error())
