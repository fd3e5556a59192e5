"""Stable key hashing and manager choice.

Key identity is the serialized key bytes (as in Dragon: ``1``, ``1.0`` and
``True`` are three keys).  One BLAKE2b digest of those bytes serves two
purposes: its first 8 bytes choose the manager, and the whole 16-byte digest
is the fixed-length key under which the shard stores the entry (LMDB keys are
limited to 511 bytes, DDict keys are not).  BLAKE2b is in the standard
library, identical on every host and process, and never salted, unlike
Python's ``hash()`` of ``str``/``bytes``.

A key whose class is user-defined and implements ``__hash__`` in Python goes
to ``hash(key) % num_managers`` instead, so users can co-locate data with
workers (Dragon ignores such hashes; the spec asks for them).
"""

from __future__ import annotations

import hashlib
import inspect
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
    if _has_user_hash(type(key)):
        return hash(key) % num_managers
    return None
