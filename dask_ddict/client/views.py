"""Lazy views of a DDict (``keys()``, ``values()``, ``items()``).

They are ``collections.abc`` views, as ``dict``'s are: key and item views are
sets (``d.keys() & other``, ``d.items() == other.items()``), and ``in`` on a
values view looks through the values.

Views stream each manager's entries in pages (see
:meth:`~dask_ddict.shard.manager.Manager.page`): a page is one request, resumed
after the last digest seen, so breaking out of a loop early leaves no state
on the manager and nothing unread on the connection.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from typing import Any, Protocol

from ..transport.ops import Page
from ..transport.protocol import WANT_ITEMS, WANT_KEYS, WANT_VALUES


class Viewed(Protocol):
    """What a view needs of its dictionary (a :class:`~dask_ddict.DDict`)."""

    def _length(self, managers: list[int]) -> int: ...
    def _iter(self, managers: list[int], want: int) -> Iterator[tuple[Any, Any]]: ...
    def which_manager(self, key: Any) -> int: ...
    def __contains__(self, key: Any) -> bool: ...
    def __getitem__(self, key: Any) -> Any: ...


def iter_pages(
    channel: Any,
    chkpt: int,
    want: int,
    page_items: int,
    after: bytes | None = None,
    timeout: float | None = None,
    lend: bool = False,
) -> Iterator[tuple[Any, Any]]:
    """Every ``(key bytes, value frame)`` a manager holds at ``chkpt``, page by page
    (after digest ``after``, when resuming); each page waited for at most ``timeout``;
    ``lend``: a same-host manager's frames zero-copy (:class:`~.ops.Page`)."""
    while True:
        items, last, more = channel.call(Page(chkpt, after, want, page_items, 0, timeout, lend))
        yield from items
        if not more:
            return
        after = last


def first_pages(
    each: Any,
    managers: list[int],
    chkpt: int,
    want: int,
    page_items: int,
    timeout: float | None,
    page_bytes: int,
    lend: bool = False,
) -> list[tuple[list[Any], bytes | None, bool]]:
    """Every manager's first page, in one broadcast: together at most about one page.

    So the first item of an iteration costs one broadcast however many managers
    there are, and what is held at once stays bounded (``page_items`` items and
    ``page_bytes`` bytes in all, at least one item per manager).
    """
    n = max(1, len(managers))
    return each(
        Page(chkpt, None, want, max(1, page_items // n), max(1, page_bytes // n), timeout, lend),
        managers,
    )


class _View:
    _mapping: Any  # the abc views' name for the dictionary

    def __init__(self, ddict: Viewed, managers: list[int], local: bool = False) -> None:
        self._ddict = self._mapping = ddict
        self._managers = managers
        self._local = local

    def _owns(self, key: Any) -> bool:
        """Whether ``key`` lives in this view's managers (all, unless a local view)."""
        return not self._local or self._ddict.which_manager(key) in self._managers

    def __len__(self) -> int:
        return self._ddict._length(self._managers)

    def __reversed__(self) -> Any:
        raise NotImplementedError("DDict views have no order")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self._ddict!r} managers={self._managers}>"

    @property
    def mapping(self) -> Viewed:
        return self._ddict


class DDictKeysView(_View, KeysView[Any]):
    def __iter__(self) -> Iterator[Any]:
        for k, _ in self._ddict._iter(self._managers, WANT_KEYS):
            yield k

    def __contains__(self, key: Any) -> bool:
        return self._owns(key) and key in self._ddict


class DDictValuesView(_View, ValuesView[Any]):
    def __iter__(self) -> Iterator[Any]:
        for _, v in self._ddict._iter(self._managers, WANT_VALUES):
            yield v


class DDictItemsView(_View, ItemsView[Any, Any]):
    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        yield from self._ddict._iter(self._managers, WANT_ITEMS)

    def __contains__(self, item: Any) -> bool:
        key, value = item
        return self._owns(key) and super().__contains__(item)
