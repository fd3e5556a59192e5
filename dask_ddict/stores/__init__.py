"""Stores over a DDict for other libraries: :class:`DDictStore`, a zarr v3 store, and
:func:`stage`, a zarr store loaded into a DDict in the background (:class:`StagedStore`).

Not imported by ``import dask_ddict`` (it imports zarr): ``dask_ddict.DDictStore`` and
``dask_ddict.stage`` load it on first use.
"""

from __future__ import annotations

from .staging import StagedStore, stage
from .zarr_v3 import DDictStore

__all__ = ["DDictStore", "StagedStore", "stage"]
