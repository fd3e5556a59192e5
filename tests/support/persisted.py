"""Checkpoints written straight to a persister, each value saying which write it was.

The persistence tests write a checkpoint, kill the writer at a named step of its
persist (``tests/support/children/crash_persist.py``), and read back what is left: a
value whose every element is the tag of its write shows whether a checkpoint is the
old one, the new one, or (never) a mix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from dask_ddict._serialize import dumps_value
from dask_ddict.persist import CheckpointPersister, persister_for
from dask_ddict.shard.store import PERSISTENT

#: The persisters' chunk size: small, so that a checkpoint spans several chunks.
CHUNK = 1 << 12


def opened(kind: str, path: str, m: int = 0, n: int = 1, **kw: Any) -> CheckpointPersister:
    """Manager ``m`` of ``n``'s persister of ``kind`` at ``path``."""
    return persister_for(kind)(path, "d", m, n, chunk_bytes=CHUNK, **kw)


def entries_of(d: dict[Any, Any]) -> Callable[[], Iterator[tuple[Any, bytes, int]]]:
    """``d`` as a persist reads a shard: (key, value's frames, persistence) entries."""
    frames = {k: dumps_value(v).join() for k, v in d.items()}
    return lambda: ((k, f, PERSISTENT) for k, f in frames.items())


def generation(tag: int) -> dict[bytes, np.ndarray]:
    """A checkpoint's content whose every value says which write it came from."""
    return {f"k{i}".encode(): np.full(1000 + 300 * i, tag, dtype="i4") for i in range(8)}
