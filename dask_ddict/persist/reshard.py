"""Where a persisted key goes when a checkpoint restores onto another number of managers.

A checkpoint written by ``n`` managers restores onto ``m`` (``restore_from=`` on a
cluster of another size, ``dask ddict restore --managers``): each new manager reads
the parts of all ``n`` old ones and keeps the keys it owns under ``m``
(:func:`owner`), placed as clients place them (``client.core``):

* most keys go by their digest (:func:`~dask_ddict._hashing.manager_for_digest`),
  which the key bytes alone give: every key of a plain type (``str``, ``int``,
  ``tuple``, ...), and every object without a ``__hash__`` of its own;
* a key whose class defines ``__hash__`` in Python goes to ``hash(key) % m``.  Its
  bytes name its class (a pickle ``STACK_GLOBAL``), so only such keys are loaded
  (their classes must be importable in the host process, with the hash seed the
  clients use); one that cannot be loaded stays where its digest says if that is
  where it was (its old manager agrees), and is refused otherwise, naming the key,
  the class and the remedy: restore onto ``n`` managers.

Keys of a custom key pickler are its bytes, not a pickle: they are placed by digest
(a custom pickler's keys with a user ``__hash__`` that happen to agree with their
digest under ``n`` are the one case this cannot tell apart, said in the docs).
"""

from __future__ import annotations

import pickle
import pickletools

from .._hashing import custom_placement, key_digest, manager_for_digest
from ..errors import DDictPersistCheckpointError

_PROTOCOL_5 = b"\x80\x05"
_STACK_GLOBAL = 0x93


def _names_a_class(key_bytes: bytes) -> bool:
    """Whether a canonical key pickle refers to a class (it may have a user hash)."""
    if _STACK_GLOBAL not in key_bytes:  # (one C scan: most keys stop here)
        return False
    try:
        return any(
            op.name in ("STACK_GLOBAL", "GLOBAL") for op, _, _ in pickletools.genops(key_bytes)
        )
    except Exception:  # noqa: BLE001 - not a pickle after all: no class
        return False


def owner(key_bytes: bytes, part: int, n: int, m: int) -> int:
    """The manager of ``m`` that owns a key found in old manager ``part``'s part of ``n``.

    Raises
    ------
    DDictPersistCheckpointError
        For a key placed by its own ``__hash__`` that this process cannot load.
    """
    digest = key_digest(key_bytes)
    if key_bytes[:2] == _PROTOCOL_5 and _names_a_class(key_bytes):
        try:
            key = pickle.loads(key_bytes)
        except Exception as e:  # noqa: BLE001 - its class is not importable here
            if manager_for_digest(digest, n) == part:
                return manager_for_digest(digest, m)  # (it went by its digest)
            raise DDictPersistCheckpointError(
                f"a key of manager {part} of {n} was placed by its own __hash__, and this "
                f"host process cannot load it to place it among {m} managers ({e!r}): make "
                f"its class importable on the workers, or restore onto {n} managers"
            ) from None
        placed = custom_placement(key, m)
        if placed is not None:
            return placed
    return manager_for_digest(digest, m)
