"""dask_ddict: a distributed dictionary for Dask, with Dragon DDict's semantics.

``DDict`` shards keys over managers served by a host process beside each Dask
worker (supervised by the worker's nanny), each keeping its shard in shared
memory on its host.  Clients talk to the host processes directly; the
scheduler plugin (:class:`DDictSchedulerPlugin`) only orchestrates.

``dask scheduler --preload dask_ddict`` installs the orchestrator at start.

:class:`DDictStore` (a DDict as a zarr v3 store) and :class:`ZarrPersister` are loaded
on first use, so that ``import dask_ddict`` does not import zarr.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import config  # noqa: F401  (loads the ddict.* defaults)
from .client import AsyncDDict, DDict
from .cluster.scheduler_plugin import DDictSchedulerPlugin
from .cluster.worker_plugin import DDictNannyPlugin, DDictWorkerPlugin
from .errors import (
    DDictCheckpointSyncError,
    DDictClosedError,
    DDictError,
    DDictFullError,
    DDictFutureCheckpointError,
    DDictKeyError,
    DDictLeaseError,
    DDictManagerMovedError,
    DDictManagerUnavailableError,
    DDictPersistCheckpointError,
    DDictSerializationError,
    DDictSyncError,
    DDictTaskError,
    DDictTimeoutError,
    DDictUnableToCreateError,
)
from .persist import (
    CheckpointPersister,
    DAOSCheckpointPersister,
    DirectoryPersister,
    NULLCheckpointPersister,
    PosixCheckpointPersister,
)
from .placement import Policy
from .stats import DDictManagerStats

if TYPE_CHECKING:
    from .persist import ZarrPersister
    from .stores import DDictStore, StagedStore, stage

__all__ = [
    "AsyncDDict",
    "CheckpointPersister",
    "DAOSCheckpointPersister",
    "DDict",
    "DDictCheckpointSyncError",
    "DDictClosedError",
    "DDictError",
    "DDictFullError",
    "DDictFutureCheckpointError",
    "DDictKeyError",
    "DDictManagerStats",
    "DDictLeaseError",
    "DDictManagerMovedError",
    "DDictManagerUnavailableError",
    "DDictNannyPlugin",
    "DDictPersistCheckpointError",
    "DDictSchedulerPlugin",
    "DDictSerializationError",
    "DDictStore",
    "DDictSyncError",
    "DDictTaskError",
    "DDictTimeoutError",
    "DDictUnableToCreateError",
    "DDictWorkerPlugin",
    "DirectoryPersister",
    "NULLCheckpointPersister",
    "Policy",
    "PosixCheckpointPersister",
    "StagedStore",
    "ZarrPersister",
    "stage",
]


def __getattr__(name: str) -> Any:
    if name in ("DDictStore", "StagedStore", "stage"):  # (import zarr: only when asked for)
        from . import stores

        return getattr(stores, name)
    if name == "ZarrPersister":  # (the same)
        from .persist import ZarrPersister

        return ZarrPersister
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dask_setup(scheduler: Any) -> None:
    """Preload hook: ``dask scheduler --preload dask_ddict`` installs the orchestrator.

    Scheduler preloads run before plugins start, so ``start`` is still awaited.
    """
    scheduler.add_plugin(DDictSchedulerPlugin(), name=DDictSchedulerPlugin.name)
