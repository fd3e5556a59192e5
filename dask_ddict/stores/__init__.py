"""Stores over a DDict for other libraries: :class:`DDictStore`, a zarr v3 store.

Not imported by ``import dask_ddict`` (it imports zarr): ``dask_ddict.DDictStore``
loads it on first use.
"""

from __future__ import annotations

from .zarr_v3 import DDictStore

__all__ = ["DDictStore"]
