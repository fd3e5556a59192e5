"""Deferred operations of one manager, applied in the order they arrived.

An operation that the working set cannot do yet (it raised
:class:`~dask_ddict.shard.working_set.MustWait`: a put to a checkpoint that
cannot be created before an older one retires, or a read under
``wait_for_keys`` of a key not yet written) is queued here with a function
that tries it once, and the checkpoint it is at.  As in Dragon's manager, the
operations deferred at checkpoint ``c`` are retried when a write to ``c``
comes (:meth:`DeferredQueue.drain`), still holding the manager's lock:
first, in arrival order, before that write is applied (they arrived before
it), and again after it (it may be what they waited for).  So

- two deferred puts to one key are applied in the order they arrived, never
  the other way round, and a write to ``c`` that arrives after them lands
  after them (Dragon's test ``test_wait_keys_defer_put_get_same_key``: the
  write that "flushes" the deferred ones is the final value);
- a request that arrives after the write that unblocked them finds them
  applied: the lock is not released between that write and the last of them,
  and the write's own reply is sent only after the drain.

Unlike Dragon, an operation never waits past its timeout for lack of such a
write (Dragon's would, when the write that unblocked it went to another
checkpoint, e.g. under ``wait_for_writers``): once no write at all has come for
``ddict.deferred.quiet-retry``, the oldest waiting operation retries its
checkpoint's queue, and each retries once more when its timeout expires,
before it gives up.

Waiting threads otherwise sleep on their own condition until their operation
is done, failed, timed out or the manager closed.  This is a pure data
structure over a lock; the manager supplies the tries.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .. import kernels
from .._blocking import will_block
from ..errors import DDictError, DDictTimeoutError
from .working_set import MustWait

T = TypeVar("T")

#: How often a drain goes over its queue at most (each pass that completes an
#: operation can unblock an older one; a pass that completes none ends it).
_MAX_PASSES = 1 << 16


class Deferred(Generic[T]):
    """One waiting operation: its try, its checkpoint and, once done, its outcome."""

    __slots__ = ("attempt", "chkpt", "wake", "done", "result", "error")

    def __init__(self, attempt: Callable[[], T], chkpt: int, lock: threading.Lock) -> None:
        self.attempt = attempt
        self.chkpt = chkpt
        self.wake = threading.Condition(lock)
        self.done = False
        self.result: T | None = None
        self.error: BaseException | None = None

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """Record the outcome and wake the waiting thread (the lock is held)."""
        self.done, self.result, self.error = True, result, error
        self.wake.notify()


class DeferredQueue(kernels.DeferredState):
    """The deferred operations of one manager, oldest first (``waiting`` is a field of
    its base, which the plain server reads as such: :class:`~dask_ddict.kernels.DeferredState`).

    Parameters
    ----------
    lock
        The manager's lock: every method is called with it held.
    quiet
        Seconds without any write after which the oldest waiting operation of a
        checkpoint retries that checkpoint's queue itself (``None``: never).
    """

    def __init__(self, lock: threading.Lock, quiet: float | None = 1.0) -> None:
        self._lock = lock
        self._quiet = quiet
        #: The waiting operations, oldest first (a plain list: its truth is a cheap test).
        self.waiting: list[Deferred[Any]] = []
        self._closed: Callable[[], DDictError] | None = None
        #: When the last write came while operations waited (:meth:`wrote`).
        self.last_write = time.monotonic()

    def __len__(self) -> int:
        return len(self.waiting)

    def __repr__(self) -> str:
        return f"<DeferredQueue waiting={len(self.waiting)}{' closed' if self._closed else ''}>"

    def wait(self, attempt: Callable[[], T], timeout: float | None, what: str, chkpt: int = 0) -> T:
        """Queue an operation that must wait and sleep until a drain has done it.

        Parameters
        ----------
        attempt
            Tries the operation once: returns its result, raises
            :class:`MustWait` to stay queued, or raises its error.
        chkpt
            The checkpoint it is at: writes to it retry it.
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
        will_block()  # (a host's event loop moves to another thread meanwhile; first: the
        # op is queued only where the finally below takes it out again)
        op: Deferred[T] = Deferred(attempt, chkpt, self._lock)
        self.waiting.append(op)
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        quiet = self._quiet
        try:
            while not op.done:
                now = time.monotonic()
                remaining = None if deadline is None else deadline - now
                if remaining is not None and remaining <= 0:
                    self.drain(chkpt)  # a last try (in order) before giving up
                    if op.done:
                        break
                    raise DDictTimeoutError(f"{what} timed out after {timeout} s")
                if quiet is not None:
                    idle = now - self.last_write
                    if idle >= quiet and self._first_at(chkpt) is op:
                        self.last_write = now  # (one retry per quiet period)
                        self.drain(chkpt)
                        continue
                    step = quiet - idle if idle < quiet else quiet
                    remaining = step if remaining is None else min(remaining, step)
                op.wake.wait(remaining)
        finally:
            if not op.done:
                self.waiting.remove(op)
        if op.error is not None:
            raise op.error
        return op.result  # type: ignore[return-value]

    def _first_at(self, chkpt: int) -> Deferred[Any] | None:
        for op in self.waiting:
            if op.chkpt == chkpt:
                return op
        return None

    def wrote(self) -> None:
        """A write came (lock held): the quiet period starts again."""
        self.last_write = time.monotonic()

    def drain(self, chkpt: int | None = None) -> None:
        """Try the operations queued at ``chkpt`` (``None``: all) in arrival order,
        after a change (lock held).

        Passes repeat while one completes something: an operation applied
        late in the queue may unblock an older one.
        """
        for _ in range(_MAX_PASSES):
            if not self.waiting:
                return
            progressed = False
            for op in [o for o in self.waiting if chkpt is None or o.chkpt == chkpt]:
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

    def waiting_at(self, chkpt: int) -> bool:
        """Whether an operation waits at ``chkpt`` (lock held)."""
        return self._first_at(chkpt) is not None

    def close(self, error: Callable[[], DDictError]) -> None:
        """Fail every queued operation and all later ones with a new ``error()`` each
        (lock held): one exception object is never raised in two threads."""
        self._closed = error
        queue, self.waiting[:] = list(self.waiting), []
        for op in queue:
            op.finish(error=error())
