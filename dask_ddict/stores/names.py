"""Pure helpers of :class:`~dask_ddict.DDictStore`: store keys, byte ranges, directory
children.  No I/O here, so each rule is tested on its own (``tests/test_store_zarr.py``).

A store key ``k`` is the dictionary's ``str`` key ``prefix + k`` (a non-empty
prefix ends with ``/``); every other key of the dictionary (another prefix, not
a ``str`` at all, or key bytes that are not a pickle: written through a custom
key pickler) is not the store's and is skipped by listing, never an error.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    SuffixByteRequest,
)


def check_key(key: Any, name: str = "key") -> str:
    """``key`` if it is a ``str``; zarr's keys always are, so anything else is a caller's bug."""
    if type(key) is not str:
        raise TypeError(f"{name} must be a str (a zarr store key), got {type(key).__name__}")
    return key


def directory(prefix: str) -> str:
    """A store's ``prefix`` as a directory: ``"run1"`` is ``"run1/"`` (so a store under
    ``"run1"`` never takes ``"run10/..."`` for its own), ``""`` stays the whole dictionary."""
    return prefix if not prefix or prefix.endswith("/") else prefix + "/"


def check_byte_range(byte_range: Any) -> ByteRequest | None:
    """``byte_range`` if zarr defines it, else the ``TypeError`` zarr's own stores raise."""
    if byte_range is None or isinstance(
        byte_range, (RangeByteRequest, OffsetByteRequest, SuffixByteRequest)
    ):
        return byte_range
    raise TypeError(f"Unexpected byte_range, got {byte_range}.")


#: A slice's stop past the end of any value (the largest a
#: :class:`~dask_ddict.transport.ops.GetRange` carries).
_TO_END = (1 << 63) - 1


def byte_span(byte_range: ByteRequest) -> tuple[int, int]:
    """``byte_range`` as the ``(start, stop)`` of a Python slice of the value, which the
    value's host takes without knowing zarr
    (:class:`~dask_ddict.transport.ops.GetRange`).

    The bytes are those of zarr's own stores (``value[start:stop]`` after zarr's
    ``_normalize_byte_range_index``, as its ``MemoryStore`` cuts them), but for a
    suffix longer than the value, which is the whole value, as zarr's ``LocalStore``
    reads it (``MemoryStore``'s negative start wraps around instead).
    """
    if isinstance(byte_range, RangeByteRequest):
        return byte_range.start, byte_range.end
    if isinstance(byte_range, OffsetByteRequest):
        return byte_range.offset, _TO_END
    if isinstance(byte_range, SuffixByteRequest):  # (-0 would be the whole value: none is)
        return (-byte_range.suffix, _TO_END) if byte_range.suffix > 0 else (0, 0)
    raise TypeError(f"Unexpected byte_range, got {byte_range}.")


def byte_slice(view: memoryview, byte_range: ByteRequest | None) -> memoryview:
    """The part of ``view`` that ``byte_range`` asks for (:func:`byte_span`), as a view."""
    return view if byte_range is None else view[slice(*byte_span(byte_range))]


def as_bytes(key: str, got: Any) -> memoryview:
    """A value read for ``key`` as a flat byte view: the store holds only bytes."""
    if isinstance(got, memoryview):
        return got
    if isinstance(got, (bytes, bytearray)):
        return memoryview(got)
    raise TypeError(
        f"DDict key {key!r} holds a {type(got).__module__}.{type(got).__qualname__} value, "
        "not bytes: it is not a zarr store value (store values are written as bytes)"
    )


def store_names(keys: Iterable[Any], prefix: str, under: str) -> Iterator[str]:
    """The store keys among dictionary ``keys`` that begin with ``under``.

    A dictionary key is the store's when it is a ``str`` beginning with
    ``prefix``; the store key is the rest.
    """
    start = prefix + under
    cut = len(prefix)
    for k in keys:
        if type(k) is str and k.startswith(start):
            yield k[cut:]


def dir_base(prefix: str) -> str:
    """``list_dir``'s prefix as the start of its children's keys (``""`` or ``"a/b/"``)."""
    prefix = prefix.rstrip("/")
    return prefix + "/" if prefix else ""


def children(names: Iterable[str], base: str) -> Iterator[str]:
    """Each direct child of directory ``base`` once: a key or a sub-directory's name."""
    seen: set[str] = set()
    cut = len(base)
    for name in names:
        child = name[cut:].split("/", 1)[0]
        if child and child not in seen:
            seen.add(child)
            yield child
