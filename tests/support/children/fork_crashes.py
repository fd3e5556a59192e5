"""Run the rotation scenario once per crash, killing a manager at a given step.

``fork_crashes.py <options as JSON> <kind>`` reads ``<path> <count> <op> <step> <nth>``
lines on stdin.  For each, it runs the scenario of :mod:`tests.support.rotation` in
``path``, every persist in a child process of its own, and kills the child of persist
``op`` at that step; the managers are processes of their own, so the other manager's
later persists still run and the killed one's do not.  Prints the killed child's exit
code.  A fresh interpreter that imports the scenario once and forks a child per persist
(:mod:`tests.support.rotation` starts no thread, so forking is safe).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # (the repository: tests.support)

from tests.support import rotation  # noqa: E402


def main(options: rotation.Options, kind: str) -> None:
    assert threading.active_count() == 1  # forking is safe: no thread to lose
    for line in sys.stdin:
        path, count, op, step, nth = line.split()
        dead: set[int] = set()
        code = None
        for i, (m, _) in enumerate(rotation.OPS):
            if m in dead:
                continue
            pid = os.fork()
            if pid == 0:
                rotation.run_op(
                    path, int(count), i, (step, int(nth)) if i == int(op) else None, options, kind
                )
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            if i == int(op):
                code = os.waitstatus_to_exitcode(status)
                dead.add(m)
        print(code, flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])
