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
process unless ``PYTHONHASHSEED`` fixes the seed when it starts; Dask's nanny fixes
it for its workers (``6640`` unless configured), but the client process has its
own.  So every worker reports ``hash()`` of one probe string (:func:`probe_hash`)
to the orchestrator, the layout carries the values, and a process whose own probe
differs (or whose cluster's workers disagree among themselves) is warned the first
time it places a key by a user hash.  Environment variables are never trusted:
they may change after a process started.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

DIGEST_SIZE = 16


_BLAKE2B = hashlib.blake2b(digest_size=DIGEST_SIZE)  # (copied per key: cheaper than a new one)


def key_digest(key_bytes: bytes) -> bytes:
    """The 16-byte BLAKE2b digest of serialized key bytes (the compiled kernels compute
    the same bytes themselves, without an object per key: ``kernels._compiled``)."""
    h = _BLAKE2B.copy()
    h.update(key_bytes)
    return h.digest()


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


#: The string whose ``hash()`` every process compares (a str, as most user hashes hash one;
#: ``bytes`` use the same seed).
HASH_PROBE = "dask_ddict hash probe"


def probe_hash() -> int:
    """``hash(HASH_PROBE)`` in this process.

    Two processes place keys by a str-based ``__hash__`` alike exactly when their
    probes are equal, whatever their environments say: ``PYTHONHASHSEED`` in
    ``os.environ`` may have been set after the interpreter started (Dask's nanny
    sets it in the process that starts a ``LocalCluster``, for its workers), and
    then it does not describe this process's ``hash()`` at all.
    """
    return hash(HASH_PROBE)


_FIX = (
    "or make __hash__ deterministic, e.g. int.from_bytes(hashlib.blake2b("
    "repr(self).encode(), digest_size=8).digest(), 'little').  (A __hash__ that hashes "
    "no str or bytes, e.g. of ints alone, is the same everywhere: say so with "
    "`ddict_stable_hash = True` in the class, and this check is skipped.)"
)


def seed_warning(cls: type, probes: Sequence[int], seed: str = "") -> str | None:
    """What to tell a process that places keys of ``cls`` by their ``__hash__``, if anything.

    Parameters
    ----------
    cls
        The key's class (named in the message).
    probes
        The distinct :func:`probe_hash` values of the cluster's workers, as the
        orchestrator collected them (empty: not known, nothing to compare).
    seed
        The ``PYTHONHASHSEED`` that the workers' environment names when they all
        name the same one: only a hint for the remedy, never for the decision.

    Returns
    -------
    str or None
        ``None`` when this process hashes as every worker does, or when ``cls``
        declares ``ddict_stable_hash = True`` (its ``__hash__`` uses no ``str`` or
        ``bytes`` hash, e.g. it returns an int field, so no seed can change it).  Otherwise the
        warning: workers that disagree among themselves place such keys
        differently from one another (tasks miss each other's keys, whatever
        this process does); a process that differs from agreeing workers places
        them where tasks do not look.
    """
    if getattr(cls, "ddict_stable_hash", False) is True:
        return None  # the class says that its hash is the same in every process
    what = (
        f"key class {cls.__module__}.{cls.__qualname__} places keys by its __hash__ "
        "(hash(key) % managers)"
    )
    distinct = set(probes)
    if len(distinct) > 1:
        return (
            f"{what}, but the workers disagree on hash() of a str ({len(distinct)} different "
            "str-hash seeds among them): keys put by a task on one worker may not be found "
            "by a task on another.  Start every worker with the same PYTHONHASHSEED (Dask's "
            "nanny does: distributed.nanny.pre-spawn-environ; `dask worker --no-nanny` "
            f"workers need it in their environment), {_FIX}"
        )
    if not distinct or probe_hash() in distinct:
        return None
    run = f"PYTHONHASHSEED={seed}" if seed.isdigit() else "PYTHONHASHSEED=<the workers' seed>"
    return (
        f"{what}, but this process's hash() of a str differs from the workers' (Python "
        "salts str/bytes hashes per process unless PYTHONHASHSEED is set when it starts): "
        "keys put here may not be found from tasks, nor keys put by tasks from here.  Run "
        f"this process with {run} (the workers' seed; Dask's nanny uses 6640 unless "
        f"distributed.nanny.pre-spawn-environ says otherwise), {_FIX}"
    )
