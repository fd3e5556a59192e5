"""The rest of the mapping protocol: what makes a DDict a full ``MutableMapping``.

``update`` as ``dict.update`` takes its arguments, ``popitem`` without an
order, and mapping equality; built on the handle's key operations
(``__setitem__``, ``pop``, ``keys``, ``items``, ``__len__``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from ..arguments import check_keys
from ..errors import DDictError, DDictKeyError
from .base import HandleBase


class MappingMethods(MutableMapping[Any, Any], HandleBase):
    """``update``, ``popitem``, ``==`` (a base of :class:`~dask_ddict.DDict`)."""

    def update(self, other: Mapping[Any, Any] | Any = (), /, **kwargs: Any) -> None:
        """Put every pair, as ``dict.update`` takes them (as one batch unless one is open).

        ``other`` is a mapping, anything with ``keys()`` and ``[]``, or an
        iterable of pairs; then ``kwargs``.  An error raised while reading
        ``other`` propagates as it is; the pairs before it are stored.
        """
        if isinstance(other, Mapping):
            pairs: Any = other.items()
        elif hasattr(other, "keys"):
            pairs = ((k, other[k]) for k in other.keys())
        else:
            pairs = _pairs(check_keys("other", other, "(key, value) pairs (or a mapping)", ""))
        own = self._batch is None
        if own:
            self.start_batch_put()
        try:
            for k, v in pairs:
                self[k] = v
            for k, v in kwargs.items():
                self[k] = v
        finally:
            if own:
                self.end_batch_put()

    def popitem(self) -> tuple[Any, Any]:
        """Remove and return some ``(key, value)`` pair; ``KeyError`` if there is none.

        A DDict has no order: the pair is the first key of the first manager
        (or the chosen one) that has any.  Another process may take that key
        first; then the next one is tried.
        """
        for _ in range(_POPITEM_TRIES):
            try:
                key = next(iter(self.keys()))
            except StopIteration:
                raise DDictKeyError(message="popitem(): the DDict is empty") from None
            try:
                return key, self.pop(key)
            except DDictKeyError:
                continue  # taken meanwhile by another process
        raise DDictError(
            f"popitem(): {_POPITEM_TRIES} keys were taken by others first", "INVALID_OPERATION"
        )

    def __eq__(self, other: object) -> bool:
        """Mapping equality: the same keys with equal values (at this handle's checkpoint)."""
        if not isinstance(other, Mapping):
            return NotImplemented
        if other is self:
            return True
        if len(self) != len(other):
            return False
        for key, value in self.items():
            try:
                theirs = other[key]
            except (KeyError, TypeError):  # absent, or a key the other cannot hold
                return False
            if not _equal(value, theirs):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # a mutable mapping, as dict is


#: How many times popitem() looks for another key after others took the one it found.
_POPITEM_TRIES = 100


def _pairs(items: Any) -> Iterator[tuple[Any, Any]]:
    """``(key, value)`` pairs of an iterable, refused as ``dict.update`` refuses them."""
    for i, item in enumerate(iter(items)):
        try:
            pair = tuple(item)
        except TypeError:
            raise TypeError(f"cannot convert update sequence element #{i} to a sequence") from None
        if len(pair) != 2:
            raise ValueError(f"update sequence element #{i} has length {len(pair)}; 2 is required")
        yield pair


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` as a bool, also for values whose ``==`` is elementwise (numpy arrays)."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except (ValueError, TypeError):  # an array's truth is ambiguous: compare as arrays
        import numpy as np

        try:
            return bool(np.array_equal(a, b))
        except Exception:
            return False
