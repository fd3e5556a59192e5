"""Stable key hashing and manager choice.

Key identity is the serialized key bytes (as in Dragon: ``1``, ``1.0`` and
``True`` are three keys).  One BLAKE2b digest of those bytes serves two
purposes: its first 8 bytes choose the manager, and the whole 16-byte digest
is the fixed-length key under which the shard stores the entry (LMDB keys are
limited to 511 bytes, DDict keys are not).  BLAKE2b is in the standard
library, identical on every host and process, and never salted, unlike
Python's ``hash()`` of ``str``/``bytes``.

A key whose class is user-defined and implements ``__hash__`` in Python goes
to ``hash(key) % num_managers`` instead (Dragon's rule), so users can
co-locate data with workers.  That hash must be the same in every process
that touches the dictionary.  Python salts ``str`` and ``bytes`` hashes per
process unless ``PYTHONHASHSEED`` fixes the seed; Dask's nanny fixes it for its
workers (``6640`` unless configured), but the client process has its own.  So
each manager records its worker's seed (:func:`hash_seed`), and a process
whose seed differs is warned the first time it places a key by a user hash.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import sys
from functools import lru_cache
from typing import Any

DIGEST_SIZE = 16


def key_digest(key_bytes: bytes) -> bytes:
    """The 16-byte BLAKE2b digest of serialized key bytes."""
    return hashlib.blake2b(key_bytes, digest_size=DIGEST_SIZE).digest()


def manager_for_digest(digest: bytes, num_managers: int) -> int:
    """The manager that owns a key, from its digest (stable across hosts)."""
    return int.from_bytes(digest[:8], "little") % num_managers


@lru_cache(maxsize=1024)
def _has_user_hash(cls: type) -> bool:
    for klass in cls.__mro__:
        impl = klass.__dict__.get("__hash__", inspect.Parameter.empty)
        if impl is inspect.Parameter.empty:
            continue
        # The first class in the MRO that defines __hash__ decides.  A Python
        # function is a user implementation; ``None`` (unhashable) or a slot
        # wrapper from a C type (int, str, numpy scalars, object) is not.
        return inspect.isfunction(impl)
    return False


def custom_placement(key: Any, num_managers: int) -> int | None:
    """``hash(key) % num_managers`` for user-defined ``__hash__``, else ``None``."""
    cls: type = type(key)
    if _has_user_hash(cls):
        return hash(key) % num_managers
    return None


def hash_seed() -> str:
    """This process's ``str`` hash seed as text; equal text, equal ``hash()`` of strings.

    ``"0"`` when hashing is not randomized, the decimal seed when
    ``PYTHONHASHSEED`` set it (Dask's nanny passes it to its workers that
    way), else a value unique to this process.
    """
    if not sys.flags.hash_randomization:
        return "0"
    seed = os.environ.get("PYTHONHASHSEED", "")
    if seed.isdigit() and seed != "0":
        return str(int(seed))
    return f"random:{os.getpid()}@{os.uname().nodename}"


def seed_warning(cls: type, seeds: set[str]) -> str | None:
    """What to tell a process whose hash seed differs from the workers' (else ``None``)."""
    mine = hash_seed()
    others = sorted(s for s in seeds if s and s != mine)
    if not others:
        return None
    shown = ", ".join(others[:3])
    fix = others[0] if others[0].isdigit() else "<one fixed number, for the workers too>"
    return (
        f"key class {cls.__module__}.{cls.__qualname__} places keys by its __hash__, but this "
        f"process hashes str/bytes with seed {mine!r} and the managers' workers with {shown}: "
        "keys put here may not be found from tasks.  Run this process with "
        f"PYTHONHASHSEED={fix} (the "
        "workers' seed; Dask's nanny uses distributed.nanny.pre-spawn-environ), or make "
        "__hash__ deterministic, e.g. int.from_bytes(hashlib.blake2b(repr(self).encode(), "
        "digest_size=8).digest(), 'little')"
    )
