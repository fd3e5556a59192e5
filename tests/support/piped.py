"""A Python subprocess that answers calls over its stdin/stdout (another hash seed, another process)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from typing import Any

from tests.support.paths import pythonpath

_LOOP = """
import pickle, sys
{setup}
inp, out = sys.stdin.buffer, sys.stdout.buffer
while True:
    n = int.from_bytes(inp.read(8), "little")
    if not n:
        break
    raw = pickle.dumps(handle(pickle.loads(inp.read(n))))
    out.write(len(raw).to_bytes(8, "little") + raw)
    out.flush()
"""


class PipeProcess:
    """Runs ``setup`` (which defines ``handle(arg)``), then answers :meth:`call` with it."""

    def __init__(self, setup: str, **env: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LOOP.format(setup=setup)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": pythonpath(), **env},
        )

    def __repr__(self) -> str:
        return f"<PipeProcess pid={self.proc.pid}>"

    def call(self, arg: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        raw = pickle.dumps(arg)
        self.proc.stdin.write(len(raw).to_bytes(8, "little") + raw)
        self.proc.stdin.flush()
        n = int.from_bytes(self.proc.stdout.read(8), "little")
        return pickle.loads(self.proc.stdout.read(n))

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(bytes(8))
        self.proc.stdin.close()
        return self.proc.wait(30)
