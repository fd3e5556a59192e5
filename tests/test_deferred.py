"""DeferredQueue alone: arrival order, passes, errors, timeouts and close (no shard)."""

from __future__ import annotations

import threading
import time

import pytest

from dask_ddict.errors import DDictClosedError, DDictKeyError, DDictTimeoutError
from dask_ddict.shard.deferred import DeferredQueue
from dask_ddict.shard.working_set import MustWait
from tests.support.polling import poll_for


class Harness:
    """A queue, its lock, and threads that defer operations on it."""

    def __init__(self, quiet: float | None = None) -> None:
        self.lock = threading.Lock()
        self.q = DeferredQueue(self.lock, quiet)
        self.out: dict[str, object] = {}
        self.threads: list[threading.Thread] = []

    def defer(self, name: str, attempt, timeout: float | None = 10, chkpt: int = 0) -> None:
        """Start a thread whose operation waits in the queue; return once it is queued."""
        n = len(self.q) + 1

        def run() -> None:
            with self.lock:
                try:
                    self.out[name] = self.q.wait(attempt, timeout, name, chkpt)
                except Exception as e:
                    self.out[name] = e

        t = threading.Thread(target=run)
        t.start()
        self.threads.append(t)

        def queued_or_done() -> bool:
            with self.lock:
                return len(self.q) == n or name in self.out

        poll_for(queued_or_done, 10, f"{name} queued as operation {n}, or done", 0.001)

    def drain(self, chkpt: int | None = None) -> None:
        with self.lock:
            self.q.drain(chkpt)

    def join(self) -> None:
        for t in self.threads:
            t.join(10)
            assert not t.is_alive()


def gate(state: dict, need: str, then=None):
    """An attempt that must wait until ``state[need]`` is set, then runs ``then``."""

    def attempt():
        if not state.get(need):
            raise MustWait
        return then() if then else need

    return attempt


def test_operations_run_in_arrival_order_and_a_pass_repeats_after_progress():
    h, state, order = Harness(), {}, []

    def record(name, sets=None):
        def run():
            order.append(name)
            if sets:
                state[sets] = True
            return name

        return run

    h.defer("first", gate(state, "late", record("first")))  # unblocked only by "third"
    h.defer("second", gate(state, "go", record("second")))
    h.defer("third", gate(state, "go", record("third", sets="late")))
    state["go"] = True
    h.drain()
    h.join()
    assert order == ["second", "third", "first"]  # a second pass took "first"
    assert h.out == {"first": "first", "second": "second", "third": "third"} and not len(h.q)


def test_an_operations_own_error_reaches_its_caller_only():
    h, state = Harness(), {}

    def fail():
        raise DDictKeyError("k")

    h.defer("bad", gate(state, "go", fail))
    h.defer("good", gate(state, "go"))
    state["go"] = True
    h.drain()
    h.join()
    assert isinstance(h.out["bad"], DDictKeyError) and h.out["good"] == "go"


def test_a_write_retries_only_the_operations_at_its_own_checkpoint():
    """Dragon's trigger: a drain for checkpoint 1 leaves those waiting at 2 queued."""
    h, state = Harness(), {"go": True}
    h.defer("at 2", gate(state, "go"), chkpt=2)  # (could run: only a trigger is missing)
    h.defer("at 1", gate(state, "go"), chkpt=1)
    h.drain(1)
    with h.lock:
        assert len(h.q) == 1 and h.q.waiting_at(2) and not h.q.waiting_at(1)
    h.drain(2)
    h.join()
    assert h.out == {"at 1": "go", "at 2": "go"}


def test_with_no_write_for_the_quiet_period_an_operation_retries_itself():
    """The write that unblocked it went elsewhere (or came from outside the queue):
    it does not wait for its timeout (60 s) for lack of a write to its checkpoint."""
    h, state = Harness(quiet=0.2), {}
    began = time.monotonic()
    h.defer("waits", gate(state, "go"), timeout=60, chkpt=3)
    state["go"] = True  # (no drain)
    h.join()
    assert h.out == {"waits": "go"} and time.monotonic() - began < 30


def test_an_operation_tries_once_more_when_its_timeout_expires():
    """Never a timeout for an operation that could have been applied (no quiet retry)."""
    h, state = Harness(quiet=None), {}
    h.defer("late", gate(state, "go"), timeout=0.3, chkpt=1)
    state["go"] = True  # (no drain, no quiet retry: only its own last try)
    h.join()
    assert h.out == {"late": "go"}


def test_a_timed_out_operation_leaves_the_queue_and_is_never_applied():
    h, state, applied = Harness(), {}, []
    h.defer("slow", gate(state, "go", lambda: applied.append(1)), timeout=0.05)
    h.join()
    assert isinstance(h.out["slow"], DDictTimeoutError) and "slow" in str(h.out["slow"])
    assert not len(h.q)
    state["go"] = True
    h.drain()
    assert applied == []


def test_close_fails_every_waiting_and_later_operation_with_its_own_error():
    h = Harness()
    h.defer("a", gate({}, "never"), timeout=None)
    h.defer("b", gate({}, "never"), timeout=None)
    with h.lock:
        h.q.close(lambda: DDictClosedError("manager 0 is closed"))
    h.join()
    assert all(isinstance(h.out[n], DDictClosedError) for n in "ab")
    assert h.out["a"] is not h.out["b"]  # one exception object per thread
    with h.lock, pytest.raises(DDictClosedError):
        h.q.wait(gate({}, "never"), 1, "late")
    assert "closed" in repr(h.q)
