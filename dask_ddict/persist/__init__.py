"""Checkpoints persisted to zarr: the store (I/O) and the persister (policy, thread)."""

from __future__ import annotations

from .persister import Persister
from .zarr_store import FORMAT, CheckpointStore, Generation

__all__ = ["FORMAT", "CheckpointStore", "Generation", "Persister"]
