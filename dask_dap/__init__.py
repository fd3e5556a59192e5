"""dask_dap: the Distributed Array Protocol (DAP 0.10.0) for dask arrays.

One DAP rank is one dask block; the process grid is ``x.numblocks`` and ranks
are row-major over block coordinates.  ``to_dap``/``to_dap_futures`` export,
``from_dap`` imports any producer's ranks, ``to_zarr``/``from_zarr`` keep the
layout in a zarr store, and ``to_ddict`` keeps sections in a DDict.
"""

from __future__ import annotations

from .errors import DAPValidationError
from .export import to_dap, to_dap_futures
from .ingest import from_dap
from .protocol import (
    VERSION,
    global_indices,
    normalize_dim,
    num_owned_indices,
    validate,
    validate_distribution,
)
from .resident import DDictArray, from_ddict, to_ddict
from .zarr_io import from_zarr, read_dap_layout, to_zarr

__all__ = [
    "DAPValidationError",
    "DDictArray",
    "VERSION",
    "from_dap",
    "from_ddict",
    "from_zarr",
    "global_indices",
    "normalize_dim",
    "num_owned_indices",
    "read_dap_layout",
    "to_dap",
    "to_dap_futures",
    "to_ddict",
    "to_zarr",
    "validate",
    "validate_distribution",
]
