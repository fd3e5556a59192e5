"""DDictStore: a DDict as a zarr v3 store (``zarr.abc.store.Store``).

``dask.array.to_zarr(x, DDictStore(d))`` writes each chunk from the task that
computed it into the dictionary, and ``xarray.open_zarr(DDictStore(d))`` reads
a dataset back from distributed shared memory.  The mapping is the plainest
one: store key ``k`` is the dictionary's ``str`` key ``prefix + k`` and its
value is ``bytes``, so ``d["grp/zarr.json"]`` is the raw metadata, and whatever
is written either way (through the store or with ``d[k] = b"..."``) is seen
the other way.

Why each choice:

- **No copies beyond the shard's own.**  A chunk is put as a ``memoryview`` of
  zarr's buffer, which the dictionary frames as raw bytes (no pickle, see
  :data:`~dask_ddict._serialize.FMT_BYTES`); a task on the manager's host
  commits it into the shard itself up to ``ddict.zarr-store.direct-write-max``
  (no socket); a chunk read on the manager's host is lent from the shard
  (zero-copy, :mod:`~dask_ddict.transport.lending`) and handed to zarr as a view.
- **Byte ranges are cut where the value lives.**  zarr's sharding codec reads
  one inner chunk out of a shard by byte range: the shard's host (or, beside
  the shard, the reader itself) slices the value, so only the range crosses a
  socket, and ``getsize`` moves none of the value
  (:class:`~dask_ddict.transport.ops.GetRange`).
- **Nothing blocks zarr's event loop.**  zarr awaits stores on one loop thread
  per process; every dictionary call runs in a worker thread, through the
  dictionary's async face (:class:`~dask_ddict.AsyncDDict`): the gets (and the
  puts) awaited in one loop turn travel together, one request per host process
  (:mod:`~dask_ddict.client.coalesce`).
- **Listing reads names, not values.**  It streams the dictionary's keys
  (``d.keys()``, page by page in a thread) and keeps the ``str`` keys under
  the prefix.  Keys are placed by hash, so a group's keys are on every manager
  and ``list_dir`` of one group reads every key's name; an index of
  directories would go stale when keys are written directly (``d[k] = ...``),
  which this store promises to see.  zarr lists rarely: consolidated metadata
  (xarray's default) opens a dataset without listing at all.
- **Pickles by handle.**  A store pickled into a task carries the handle's
  reference (name, uid, checkpoint), never the layout; it attaches on first use.
- **Checkpoints.**  The store reads and writes at its handle's checkpoint: a
  store over a handle at checkpoint ``k`` reads the arrays as of ``k``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import Any

from zarr.abc.store import ByteRequest, RangeByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from .. import config
from .._keys import dumps_key, loads_key
from .._serialize import bytes_view
from ..arguments import check_bool
from ..client import AsyncDDict, DDict
from ..client.coalesce import GetBatcher, PutBatcher
from ..client.reads import ABSENT, WAIT
from ..errors import DDictKeyError, DDictSerializationError
from ..threaded import in_thread
from .names import (
    as_bytes,
    byte_slice,
    byte_span,
    check_byte_range,
    check_key,
    children,
    dir_base,
    directory,
    store_names,
)

logger = logging.getLogger(__name__)

#: Names listed per worker-thread hop (a page of ``d.keys()`` is read in the thread).
LIST_PAGE = 1024
#: An empty range: what ``getsize`` reads (the size alone, none of the value).
_SIZE = RangeByteRequest(0, 0)


class DDictStore(Store):
    """A zarr v3 store over a :class:`~dask_ddict.DDict`'s ``str`` keys.

    Parameters
    ----------
    ddict
        The dictionary (a :class:`~dask_ddict.DDict` handle, or an
        :class:`~dask_ddict.AsyncDDict`, whose synchronous handle is used).
        The store reads and writes at the handle's checkpoint, with its timeout;
        it never destroys or detaches it.
    prefix
        Prepended to every store key to make the dictionary's key: several
        stores (or a store and other data) share one dictionary under
        different prefixes, such as ``"run1/"``.  A prefix is a directory:
        ``"run1"`` means ``"run1/"`` (the :attr:`prefix` attribute says so).
    read_only
        Refuse writes (``ValueError``, as every zarr store does).

    Notes
    -----
    Store values are ``bytes`` in the dictionary; a key under the prefix that
    holds anything else raises ``TypeError`` when read through the store.
    Equal stores have the same dictionary (uid), handle checkpoint and target
    manager, prefix and mode.

    Examples
    --------
    >>> import dask.array as da                                  # doctest: +SKIP
    >>> store = DDictStore(d, prefix="run1/")
    >>> da.ones((1000, 1000), chunks=250).to_zarr(store, component="x")
    >>> da.from_zarr(store, component="x").sum().compute()
    1000000.0
    """

    supports_writes: bool = True
    supports_deletes: bool = True
    supports_listing: bool = True

    def __init__(
        self, ddict: DDict | AsyncDDict, *, prefix: str = "", read_only: bool = False
    ) -> None:
        if isinstance(ddict, AsyncDDict):
            ddict = ddict.ddict
        if not isinstance(ddict, DDict):
            raise TypeError(f"ddict must be a DDict or an AsyncDDict, got {type(ddict).__name__}")
        if ddict._kp is not None or ddict._vp is not None:
            raise ValueError(
                "ddict: a handle with custom picklers (d.pickler(...)) cannot hold "
                "a zarr store, whose keys are str and values bytes"
            )
        check_key(prefix, "prefix")
        super().__init__(read_only=check_bool("read_only", read_only))
        self._d = ddict
        self._prefix = directory(prefix)
        self._names = ddict.pickler(key_pickler=_ListedKeys)  # (listing only)
        self._async = AsyncDDict(ddict)
        self._reads = GetBatcher(ddict, decode=bytes_view)
        self._direct_max = config.get_bytes("zarr-store.direct-write-max")
        self._writes = PutBatcher(ddict, direct_max=self._direct_max)

    # -- identity -------------------------------------------------------------------

    @property
    def ddict(self) -> DDict:
        """The dictionary handle the store reads and writes through."""
        return self._d

    @property
    def prefix(self) -> str:
        """What every store key is prefixed with in the dictionary."""
        return self._prefix

    def _name(self, key: str) -> str:
        """The dictionary's key of store key ``key`` (checked: zarr's keys are ``str``)."""
        return self._prefix + check_key(key)

    def _identity(self) -> tuple[Any, ...]:
        d = self._d
        return (d._core.ref.uid, d._chkpt, d._target, self._prefix, self.read_only)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DDictStore) and self._identity() == other._identity()

    __hash__ = None  # type: ignore[assignment]  # (the handle's checkpoint may move)

    def __reduce__(self) -> Any:
        # The handle pickles as a reference (name, uid, checkpoint): no layout travels.
        return (_rebuild, (self._d, self._prefix, self.read_only))

    def __repr__(self) -> str:
        mode = " read_only" if self.read_only else ""
        return f"<DDictStore {self._d.get_name()!r} prefix={self._prefix!r}{mode} {self._d!r}>"

    def __str__(self) -> str:
        return f"ddict://{self._d.get_name()}/{self._prefix}"

    def with_read_only(self, read_only: bool = False) -> DDictStore:
        """The same dictionary and prefix with another mode (not opened yet)."""
        return type(self)(self._d, prefix=self._prefix, read_only=read_only)

    # -- reads ----------------------------------------------------------------------

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        """The value of ``key`` (or its ``byte_range``), or ``None`` if absent.

        On the manager's host a large value is lent by the shard and handed to
        zarr as a view (no copy); gets awaited together are read with one
        request per host.  A byte range is cut where the value lives, and only
        its bytes travel (:meth:`_part`).
        """
        name = self._name(key)
        if (ranged := check_byte_range(byte_range)) is not None:
            return _buffer(prototype, await self._part_async(name, ranged))
        got = await self._reads.get(name, ABSENT, False)
        if got is ABSENT:
            return None
        return prototype.buffer.from_bytes(as_bytes(name, got))

    async def _part_async(self, name: str, byte_range: ByteRequest) -> tuple[int, Any] | None:
        """:meth:`_part` from the event loop: read on the loop itself where the value's
        shard is mapped here and nothing waits (a part's copy takes microseconds, a
        worker thread's round trip tens of them), else in a worker thread."""
        got = self._d._range_here(name, *byte_span(byte_range))
        if got is NotImplemented:
            got = await asyncio.to_thread(self._part, name, byte_range)
        return got

    def _part(self, name: str, byte_range: ByteRequest) -> tuple[int, Any] | None:
        """``(size, bytes)`` of dictionary key ``name``'s value: how many it has, and those
        ``byte_range`` asks for; ``None`` if absent.

        The value's host (or, on its host, this process from the shard) cuts the
        range, so reading one inner chunk of a 256 MiB zarr shard from another host
        moves the chunk, not the shard.  A value that is not raw bytes (a pickle:
        ``bytes`` as a version before raw frames stored them, or not bytes at all)
        is read whole, and judged here as a whole read is.
        """
        try:
            return self._d._get_range(name, *byte_span(byte_range))
        except DDictKeyError:
            return None
        except DDictSerializationError:  # (not raw bytes: the host never unpickles)
            got = self._d.get(name, ABSENT)
            if got is ABSENT:
                return None
            view = as_bytes(name, got)
            return len(view), byte_slice(view, byte_range)

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        """Each ``(key, byte_range)``'s bytes, read together (one request per host)."""
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    async def _get_many(
        self, requests: Iterable[tuple[str, BufferPrototype, ByteRequest | None]]
    ) -> AsyncGenerator[tuple[str, Buffer | None], None]:
        requests = list(requests)
        got = await asyncio.gather(*(self.get(*r) for r in requests))
        for (key, _, _), value in zip(requests, got):
            yield key, value

    async def exists(self, key: str) -> bool:
        return bool(await self._async.contains(self._name(key)))

    async def getsize(self, key: str) -> int:
        """Bytes of ``key``'s value: its host answers the size, none of the value moves."""
        got = await self._part_async(self._name(key), _SIZE)
        if got is None:
            raise FileNotFoundError(key)
        return got[0]

    # -- writes ---------------------------------------------------------------------

    async def set(self, key: str, value: Buffer) -> None:
        """Put ``value``'s bytes at ``prefix + key`` (framed without a copy).

        Puts awaited in one loop turn are sent together, one request per host.
        """
        self._check_writable()
        name = self._name(key)
        await self._writes.put(name, _payload(value), False)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        """Put ``value`` unless ``key`` exists, in one atomic step (``setdefault``)."""
        self._check_writable()
        name = self._name(key)
        await self._async.setdefault(name, _payload(value))

    async def delete(self, key: str) -> None:
        """Remove ``key``; an absent key is no error."""
        self._check_writable()
        await self._async.pop(self._name(key), None)

    async def delete_dir(self, prefix: str) -> None:
        """Remove every key under directory ``prefix`` (one worker thread for them all)."""
        self._check_writable()
        base = dir_base(check_key(prefix, "prefix"))
        await asyncio.to_thread(self._delete_under, base)

    def _delete_under(self, base: str) -> None:
        d, head = self._d, self._prefix
        names = list(store_names(self._names.keys(), head, base))  # (listed before the first pop)
        for name in names:
            d.pop(head + name, None)
        logger.debug("%r: deleted %d keys under %r", self, len(names), base)

    # -- listing --------------------------------------------------------------------

    def list(self) -> AsyncIterator[str]:
        return in_thread(lambda: store_names(self._names.keys(), self._prefix, ""), LIST_PAGE)

    def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        check_key(prefix, "prefix")
        return in_thread(lambda: store_names(self._names.keys(), self._prefix, prefix), LIST_PAGE)

    def list_dir(self, prefix: str) -> AsyncIterator[str]:
        base = dir_base(check_key(prefix, "prefix"))
        return in_thread(
            lambda: children(store_names(self._names.keys(), self._prefix, base), base), LIST_PAGE
        )

    # -- the synchronous protocols (SupportsGetSync, SupportsSetSync, SupportsDeleteSync) ----

    def get_sync(
        self,
        key: str,
        *,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        """:meth:`get` in the calling thread (not on an event loop)."""
        name = self._name(key)
        prototype = default_buffer_prototype() if prototype is None else prototype
        if (ranged := check_byte_range(byte_range)) is not None:
            return _buffer(prototype, self._part(name, ranged))
        ((_, got),) = self._d._many([name], False, decode=bytes_view)
        if got is WAIT:  # (wait_for_keys: not written at this checkpoint yet)
            got = self._d.get(name, ABSENT)
        if got is ABSENT:
            return None
        return prototype.buffer.from_bytes(as_bytes(name, got))

    def set_sync(self, key: str, value: Buffer) -> None:
        """:meth:`set` in the calling thread."""
        self._check_writable()
        name = self._name(key)
        (error,) = self._d._put_many([(name, _payload(value))], False, self._direct_max)
        if error is not None:
            raise error

    def delete_sync(self, key: str) -> None:
        """:meth:`delete` in the calling thread."""
        self._check_writable()
        self._d.pop(self._name(key), None)


class _ListedKeys:
    """The key pickler of a store's listings: key bytes that are not a pickle (a key
    written through a custom key pickler) list as ``None``, which no store name is,
    instead of failing the listing."""

    @staticmethod
    def dumps(key: Any) -> bytes:
        return dumps_key(key)

    @staticmethod
    def loads(data: bytes) -> Any:
        try:
            return loads_key(data)
        except DDictSerializationError:
            return None


def _buffer(prototype: BufferPrototype, part: tuple[int, Any] | None) -> Buffer | None:
    """A zarr buffer of a :meth:`DDictStore._part`'s bytes (``None``: absent)."""
    return None if part is None else prototype.buffer.from_bytes(part[1])


def _payload(value: Any) -> memoryview:
    """``value``'s bytes as a flat view: what the dictionary frames as raw bytes, uncopied."""
    if not isinstance(value, Buffer):
        raise TypeError(f"value must be a zarr Buffer, got {type(value).__name__}")
    mv = memoryview(value.as_buffer_like())
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _rebuild(ddict: DDict, prefix: str, read_only: bool) -> DDictStore:
    """Unpickling a store: its handle attached again (on first use), same prefix and mode."""
    return DDictStore(ddict, prefix=prefix, read_only=read_only)
