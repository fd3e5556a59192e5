"""What an event loop hands to worker threads: ``asyncio.to_thread`` counted."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest


def count_to_thread(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The functions ``asyncio.to_thread`` runs from now on (each still runs), in order:
    a read that an event loop serves itself never appears."""
    threads: list[Any] = []
    to_thread = asyncio.to_thread

    async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        threads.append(fn)
        return await to_thread(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", counted)
    return threads
