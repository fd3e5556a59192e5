"""Stopping a process: SIGSTOP, and wait until the kernel says it is stopped.

Tests freeze a host process or a worker to see what clients do when a peer hangs
rather than dies.  The signal is delivered asynchronously: a request sent at once may
still be served, or a write caught half done, holding the shard's writer lock.  So
:func:`stop_process` returns only once the process is stopped.
"""

from __future__ import annotations

import psutil

from tests.support.polling import poll_for


def stop_process(p: psutil.Process) -> None:
    """SIGSTOP ``p`` and wait (up to 10 s) until it is stopped."""
    p.suspend()
    poll_for(
        lambda: p.status() == psutil.STATUS_STOPPED,
        10,
        f"process {p.pid} to stop",
        interval=0.001,
    )
