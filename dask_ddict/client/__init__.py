"""The user's side: the handle (:class:`DDict`), its views, batches, replication and async face."""

from __future__ import annotations

from .asynchronous import AsyncDDict
from .creation import create_request
from .handle import DDict

__all__ = ["AsyncDDict", "DDict", "create_request"]
