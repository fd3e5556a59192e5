"""The lease word: until when a host process may serve its replicated primaries, shared.

A host process holds a lease from the orchestrator (see ``host.lease``); a process
on the same machine that reads a replicated manager's shard straight from shared
memory must stop when the host's lease does, or it could read a primary that a
replica has replaced.  So the host writes, after every renewal, the end of its
lease into a small file of its private socket directory (``lease``, one 64-bit
word: nanoseconds of :func:`lease_clock`; 0: no lease, or a manager in doubt), and
those readers check it at every read (one load and one clock read).

The clock is ``CLOCK_BOOTTIME``: unlike ``CLOCK_MONOTONIC`` it counts the time a
machine was suspended, so a host that wakes from a suspended VM finds its lease
over.  It is one clock for every process of a machine, so the host and its readers
compare the same numbers.
"""

from __future__ import annotations

import os
import time

from .._memory import map_file

#: The clock leases run on (``time.clock_gettime``'s id).
LEASE_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)
#: Seconds that stand for "no end" (what a 64-bit word of nanoseconds holds, about 285 years).
FOREVER = 9e9


def lease_clock() -> float:
    """Seconds of the machine's lease clock (``CLOCK_BOOTTIME`` where there is one)."""
    return time.clock_gettime(LEASE_CLOCK)


def path_for(socket_dir: str) -> str:
    """Where a host process's lease word lives (beside its Unix socket)."""
    return os.path.join(socket_dir, "lease")


class LeaseWord:
    """A mapped lease word.

    Parameters
    ----------
    path
        The file (see :func:`path_for`).
    create
        Create it, reading "no lease" (the host); a reader only opens it.
    """

    def __init__(self, path: str, *, create: bool = False) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, 8)
            elif os.fstat(fd).st_size < 8:
                raise OSError(f"{path}: empty")
            # (a memoryview of int64: reading it is a Python int, not a NumPy scalar)
            self._word = memoryview(map_file(fd, 8).data).cast("q")
        finally:
            os.close(fd)
        if create:
            self.set(0.0)

    def __repr__(self) -> str:
        return f"<LeaseWord {self.path!r} until={self.until()}>"

    def set(self, until: float) -> None:
        """The host may serve until ``until`` (of :func:`lease_clock`; 0: not now; ``inf``:
        always, for a host that keeps no lease)."""
        self._word[0] = int(min(until, FOREVER) * 1e9) if until > 0 else 0

    def until(self) -> float:
        return self._word[0] / 1e9

    def valid(self) -> bool:
        """Whether the host may serve now."""
        return time.clock_gettime_ns(LEASE_CLOCK) < self._word[0]
