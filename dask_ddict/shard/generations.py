"""Generations: one word per manager that changes with every commit to its shard.

A broadcast (``len``, ``stats``) asks every manager of a host; most shards have
not changed since the last one.  To answer from what it computed before, a
host must know, cheaply, which shards changed.  A commit by the manager
itself it sees, but a same-host client commits small puts into the shard
directly (see :func:`~dask_ddict.shard.direct.put_in_window`).  So each
dictionary has, on each host, a small shared file of one 64-bit word per
manager (``gen-<uid>`` in the host's private socket directory): every commit,
the manager's or a client's, writes a new random word for its manager after
it committed and before it acknowledges.  A host reads the words of all its
managers at once (one NumPy comparison), before it reads any shard: a cached
answer is never older than the words it is kept under.

Random words rather than a counter: two writers that raced would both write
"old + 1" and one change would go unseen; two random 63-bit words collide
with probability 2**-63.

The file lives as long as the dictionary on that host: created (or reused,
after a restart of the host process) when its managers open, removed when
they close.  A client maps it once per host it writes to, and keeps no
descriptor of it (so a client's descriptors do not grow with the hosts it writes to).
"""

from __future__ import annotations

import contextlib
import os
import random

import numpy as np

from .. import kernels
from .._memory import map_file


def path_for(socket_dir: str, uid: str) -> str:
    """Where a dictionary's generations live on a host (beside its Unix socket)."""
    return os.path.join(socket_dir, f"gen-{uid}")


class Generations(kernels.GenerationsState):
    """A mapped generations file: ``words[mid]`` for every manager of one dictionary
    (a field of its base, whose buffer the host's commit hook writes through:
    :class:`~dask_ddict.kernels.GenerationsState`).

    Parameters
    ----------
    path
        The file (see :func:`path_for`).
    managers
        How many managers the dictionary has (its manager ids index the words);
        ``None``: as many as the file holds (a client opening the host's).
    create
        Create the file if missing (the host); a client only opens it.

    A client never closes its mapping: a put that commits while its handle is
    closed must still change the word, so the mapping lives as long as a
    channel refers to it (no descriptor: unmapped with the last reference).
    """

    def __init__(self, path: str, managers: int | None = None, *, create: bool = False) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            size = os.fstat(fd).st_size if managers is None else 8 * max(1, managers)
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            if size < 8:
                raise OSError(f"{path}: empty")
            # (no descriptor kept: a client maps one such file per dictionary and host)
            self.words = map_file(fd, size).view(np.int64)
        finally:
            os.close(fd)

    def __repr__(self) -> str:
        return f"<Generations {self.path!r} managers={len(self.words)}>"

    def bump(self, mid: int) -> None:
        """A commit to manager ``mid``'s shard ended: give it a new word."""
        self.words[mid] = random.getrandbits(63) | 1

    def get(self, mid: int) -> int:
        return int(self.words[mid])

    def remove(self) -> None:
        """Unmap and delete the file (its dictionary left this host)."""
        self.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def close(self) -> None:
        """Unmap (the words of a closed mapping read as 0: never a cache hit).  A view of
        the words still held somewhere keeps the mapping until it is dropped."""
        self.words = np.zeros(len(self.words), dtype=np.int64)
