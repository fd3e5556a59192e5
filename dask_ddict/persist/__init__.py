"""Persisted checkpoints: the persister interface and its implementations (the I/O), and
the policy that drives them.

:class:`ZarrPersister` is loaded on first use, so that choosing a persister (the
client does) does not import zarr.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .choice import DAOSCheckpointPersister, NULLCheckpointPersister, persister_for, persister_name
from .directory_store import DirectoryPersister
from .interface import CheckpointPersister, Version
from .persister import Persister
from .versioned import Generation, VersionedPersister

if TYPE_CHECKING:
    from .zarr_store import ZarrPersister

#: Dragon's name of the persister that writes plain files (here: a directory of them).
PosixCheckpointPersister = DirectoryPersister

__all__ = [
    "CheckpointPersister",
    "DAOSCheckpointPersister",
    "DirectoryPersister",
    "Generation",
    "NULLCheckpointPersister",
    "Persister",
    "PosixCheckpointPersister",
    "Version",
    "VersionedPersister",
    "ZarrPersister",
    "persister_for",
    "persister_name",
]


def __getattr__(name: str) -> Any:
    if name == "ZarrPersister":  # (imports zarr: only when asked for)
        from .zarr_store import ZarrPersister

        return ZarrPersister
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
