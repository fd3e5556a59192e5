"""Lazy views of a DDict (``keys()``, ``values()``, ``items()``).

Views stream each manager's entries in pages (see
:meth:`~dask_ddict.shard.manager.Manager.page`): a page is one request, resumed
after the last digest seen, so breaking out of a loop early leaves no state
on the manager and nothing unread on the connection.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from ..transport.ops import Page
from ..transport.protocol import WANT_ITEMS, WANT_KEYS, WANT_VALUES


class Viewed(Protocol):
    """What a view needs of its dictionary (a :class:`~dask_ddict.DDict`)."""

    def _length(self, managers: list[int]) -> int: ...
    def _iter(self, managers: list[int], want: int) -> Iterator[tuple[Any, Any]]: ...
    def which_manager(self, key: Any) -> int: ...
    def __contains__(self, key: Any) -> bool: ...


def iter_pages(channel: Any, chkpt: int, want: int, page_items: int) -> Iterator[tuple[Any, Any]]:
    """Every ``(key bytes, value frame)`` a manager holds at ``chkpt``, page by page."""
    after = None
    while True:
        items, last, more = channel.call(Page(chkpt, after, want, page_items))
        yield from items
        if not more:
            return
        after = last


class _View:
    def __init__(self, ddict: Viewed, managers: list[int], local: bool = False) -> None:
        self._ddict = ddict
        self._managers = managers
        self._local = local

    def __len__(self) -> int:
        return self._ddict._length(self._managers)

    def __reversed__(self) -> Any:
        raise NotImplementedError("DDict views have no order")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self._ddict!r} managers={self._managers}>"

    @property
    def mapping(self) -> Viewed:
        return self._ddict


class DDictKeysView(_View):
    def __iter__(self) -> Iterator[Any]:
        for k, _ in self._ddict._iter(self._managers, WANT_KEYS):
            yield k

    def __contains__(self, key: Any) -> bool:
        d = self._ddict
        if self._local and d.which_manager(key) not in self._managers:
            return False
        return key in d


class DDictValuesView(_View):
    def __iter__(self) -> Iterator[Any]:
        for _, v in self._ddict._iter(self._managers, WANT_VALUES):
            yield v


class DDictItemsView(_View):
    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        yield from self._ddict._iter(self._managers, WANT_ITEMS)
