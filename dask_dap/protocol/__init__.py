"""The protocol itself (DAP 0.10.0): one dimension's index maps and the validators.

Pure functions over dicts and numpy arrays; no dask, no cluster.
"""

from __future__ import annotations

from .dims import global_indices, normalize_dim, num_owned_indices, owned_slice
from .validate import VERSION, validate, validate_distribution

__all__ = [
    "VERSION",
    "global_indices",
    "normalize_dim",
    "num_owned_indices",
    "owned_slice",
    "validate",
    "validate_distribution",
]
