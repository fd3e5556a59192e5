"""Blocking iterations consumed from asyncio: a thread hop per batch, not per item."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_NO_MARK: Any = object()


async def in_thread(
    items: Callable[[], Iterable[T]], page: int, idle: Any = _NO_MARK
) -> AsyncIterator[T]:
    """``items()`` iterated in worker threads, at most ``page`` items per thread hop.

    So a blocking iteration (a dictionary's key view, a filter's merged results)
    never runs on the event loop; breaking out early leaves the rest unread.  An
    item that is ``idle`` (the iteration is about to wait: a filter's ``IDLE``) is
    not yielded; it ends the hop if the hop has anything, so what is ready is
    handed on instead of held back for more.
    """
    it: Iterator[T] | None = None

    def chunk() -> tuple[list[T], bool]:
        """``(items of this hop, whether the iteration is over)``."""
        nonlocal it
        if it is None:
            it = iter(items())
        got: list[T] = []
        for x in it:
            if x is idle:
                if got:
                    return got, False
                continue
            got.append(x)
            if len(got) >= page:
                return got, False
        return got, True

    while True:
        got, done = await asyncio.to_thread(chunk)
        for x in got:
            yield x
        if done:
            return
