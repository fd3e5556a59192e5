"""HostPipe: one control message down to a host process, its answer back up.

The supervisor speaks to each incarnation of its host process over that process's
stdin and stdout (the messages, and why a pipe: :mod:`.control`).  An exchange is a
message written whole, then a reply read whole within a deadline: a host process
that ends mid-exchange raises :class:`HostDiedError` (its pipe breaks, or reads end),
one that does not answer in time :class:`HostKilledError` (see below), and a reply
``(False, exception)`` raises that exception here.

A host process that did not answer in time is killed: the answer it still owes would
be read as the next message's, and what the late call did (a manager opened, a copy
kept) is not in the supervisor's registry, so a new incarnation replayed from that
registry (the supervisor's watcher starts it) is the one state both ends agree on.
Killing also fences the late call: a move whose copy timed out is aborted at its old
place, and the new place must never serve it too.

The pipe takes no lock: one exchange at a time is its caller's to keep (the
supervisor's lock), since what the supervisor records of an answer must change
under the same lock as the exchange that brought it.
"""

from __future__ import annotations

import os
import select
import subprocess
import time
from typing import Any

from ..errors import DDictManagerUnavailableError
from . import control


class HostDiedError(DDictManagerUnavailableError):
    """The host process ended while answering a control message."""


class HostKilledError(HostDiedError):
    """The host process did not answer a control message in time, and was killed: to
    its caller, a host that ended while answering (its next incarnation serves what the
    registry holds)."""


class HostPipe:
    """The control pipe of one incarnation of a host process (``proc``), for logs named
    ``label`` (the nanny's or worker's address)."""

    def __init__(self, proc: subprocess.Popen[bytes], label: str) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.proc = proc
        self.label = label
        #: An answer is owed that never came: the host process was killed (see above).
        self.out_of_step = False

    def __repr__(self) -> str:
        return f"<HostPipe {self.label!r} host_pid={self.proc.pid}>"

    def send(self, msg: Any) -> None:
        """Write ``msg`` whole (:class:`HostDiedError` if the host process is gone)."""
        if self.out_of_step:
            raise HostDiedError(
                f"the host process of {self.label} was killed: it did not answer in time"
            )
        try:
            control.send(self.proc.stdin, msg)  # type: ignore[arg-type]
        except (BrokenPipeError, OSError) as e:
            raise HostDiedError(f"the host process of {self.label} is gone ({e})") from None

    def recv(self, timeout: float | None) -> Any:
        """Read one reply within ``timeout`` seconds (``None``: no limit): its value, or
        the exception it carries raised."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout

        def read(n: int) -> bytes:
            buf = bytearray()
            while len(buf) < n:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not select.select([fd], [], [], wait)[0]:
                    self.out_of_step = True
                    self.proc.kill()
                    raise HostKilledError(
                        f"the host process of {self.label} did not answer within {timeout} s;"
                        " it was killed (a new incarnation serves its shards)"
                    )
                chunk = os.read(fd, n - len(buf))
                if not chunk:
                    raise HostDiedError(f"the host process of {self.label} ended")
                buf += chunk
            return bytes(buf)

        ok, value = control.read_message(read)  # read() raises at EOF: never None here
        if not ok:
            raise value
        return value

    def exchange(self, msg: Any) -> Any:
        """Send ``msg`` and return the reply, waited for at most as long as
        :func:`.control.answer_within` says."""
        self.send(msg)
        return self.recv(control.answer_within(msg))

    def close(self) -> None:
        """Close this end of the pipe (after the host process ended)."""
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
