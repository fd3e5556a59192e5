"""Staging: a zarr store loaded into a DDict in the background, readable at once.

Training and analysis read the same dataset again and again; from a file system or an
object store each epoch pays its latency.  :func:`stage` copies a zarr store's objects
(metadata and chunks, as they are: never decoded) into a dictionary, as
:class:`~dask_ddict.DDictStore` keys, with loader tasks on the workers that host the
dictionary's managers, and returns a :class:`StagedStore` at once:

* a read finds the object in the dictionary, or, not loaded yet, reads it from the
  source: the same bytes either way, so reads during staging are always right, and
  once everything is loaded the source is never read again;
* :meth:`StagedStore.wait` (with a ``tqdm`` bar when ``ddict.progress`` is on),
  :meth:`~StagedStore.is_loaded` and :meth:`~StagedStore.loaded` say how far it got, in
  any process (each loader records its count in the dictionary, under a key that is not
  a ``str``, so no store lists it); the loaders are Dask tasks named
  ``ddict-stage-...``, which the dashboard's progress shows;
* it is read-only while it loads (a write there could be overwritten by a loader), and
  :meth:`~StagedStore.done` gives the plain, writable store once it is loaded.

Why loaders beside the managers: an object's manager is known from its key
(:meth:`~dask_ddict.DDict.which_manager`), so each loader takes the objects of the
managers on its worker and commits them into their shards from that host (shared
memory, no socket), while the source is read by every worker at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from .. import config, progress
from ..arguments import check_int, local_store
from ..client import AsyncDDict, DDict
from ..errors import DDictError, DDictTimeoutError
from .zarr_v3 import DDictStore, _payload

logger = logging.getLogger(__name__)

#: The first part of a loader's record key: ``(STAGING, token, loader)`` holds
#: ``(objects loaded, objects it has, finished, error or None)``.
STAGING = "dask_ddict.staging"
#: Bytes a loader reads from the source before it puts them (one request per host).
LOAD_BYTES = 32 << 20
#: Reads a loader keeps in flight on the source.
READS = 16
#: Seconds between looks at the loaders' records while waiting.
POLL = 0.2
_METADATA = ("zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata")


def open_source(
    source: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> Store:
    """A read-only zarr store over ``source``: a local directory (or ``file://``) or an
    fsspec URL (``s3://...``, with ``storage_options``)."""
    from zarr.storage import FsspecStore, LocalStore

    path = os.fspath(source)
    local = local_store(path)
    if local is not None:
        if not os.path.isdir(local):
            raise FileNotFoundError(f"source {path!r}: no such directory (a zarr store)")
        return LocalStore(local, read_only=True)
    return FsspecStore.from_url(path, storage_options=storage_options or None, read_only=True)


def _is_metadata(key: str) -> bool:
    return key.rsplit("/", 1)[-1] in _METADATA


def _record(token: str, loader: int) -> tuple[str, str, int]:
    return (STAGING, token, loader)


def plan(
    keys: list[tuple[str, int]], workers: dict[str, list[int]], nloaders: int
) -> list[tuple[str, list[str]]]:
    """Split the source's objects (``(key, manager)``) among loaders: each loader a
    worker and keys of the managers on it, ``nloaders`` in all at most (one per worker
    at least), each worker's keys dealt out in turn (sizes are not known here); metadata
    first in each loader (a reader opens a group with it).  ``workers``: each worker's
    managers.  Pure (tested without a cluster)."""
    where = {m: w for w, ms in workers.items() for m in ms}
    by_worker: dict[str, list[str]] = {w: [] for w in workers}
    for key, mid in keys:
        by_worker[where[mid]].append(key)
    per = max(1, nloaders // max(1, len(workers)))
    out = []
    for w, ks in by_worker.items():
        if not ks:
            continue
        ks.sort(key=lambda k: (not _is_metadata(k), k))
        for i in range(min(per, len(ks))):
            out.append((w, ks[i::per]))
    return out


def load(
    d: DDict,
    source: str,
    storage_options: dict[str, Any] | None,
    prefix: str,
    token: str,
    loader: int,
    keys: list[str],
) -> int:
    """A loader task: copy ``keys`` from the source into ``d`` under ``prefix``, recording
    its count after each group; the number of objects it loaded."""
    record = _record(token, loader)
    done = 0
    try:
        store = open_source(source, storage_options)
        direct_max = config.get_bytes("zarr-store.direct-write-max")
        proto = default_buffer_prototype()
        from zarr.core.sync import sync

        async def read(group: list[str]) -> list[Buffer | None]:
            gate = asyncio.Semaphore(READS)

            async def one(k: str) -> Buffer | None:
                async with gate:
                    return await store.get(k, proto)

            return list(await asyncio.gather(*(one(k) for k in group)))

        for group in _groups(store, keys):
            got = sync(read(group))
            pairs = [(prefix + k, _payload(b)) for k, b in zip(group, got) if b is not None]
            for error in d._put_many(pairs, False, direct_max):
                if error is not None:
                    raise error
            done += len(group)
            d[record] = (done, len(keys), False, None)
    except BaseException as e:
        with contextlib.suppress(Exception):  # (said where it can be: the error goes on)
            d[record] = (done, len(keys), True, f"{type(e).__name__}: {e}")
        raise
    d[record] = (done, len(keys), True, None)
    return done


def _groups(store: Store, keys: list[str]) -> Iterable[list[str]]:
    """``keys`` in groups of about :data:`LOAD_BYTES` (sizes from a local store's files;
    elsewhere, groups of :data:`READS`)."""
    root = getattr(store, "root", None)
    group: list[str] = []
    size = 0
    for k in keys:
        group.append(k)
        try:
            size += os.path.getsize(os.path.join(str(root), k)) if root is not None else 0
        except OSError:  # (gone since the listing: its read says None)
            pass
        if size >= LOAD_BYTES or (root is None and len(group) >= READS):
            yield group
            group, size = [], 0
    if group:
        yield group


def stage(
    source: str | os.PathLike[str],
    ddict: DDict | AsyncDDict,
    *,
    prefix: str = "",
    storage_options: dict[str, Any] | None = None,
    nloaders: int | None = None,
    wait: bool = False,
) -> StagedStore:
    """Load the zarr store at ``source`` into ``ddict`` in the background; a store that
    reads it at once (see the module).

    Parameters
    ----------
    source
        The zarr store to load: a local directory, or an fsspec URL (``s3://...``).
    ddict
        The dictionary it goes into, as :class:`~dask_ddict.DDictStore` keys (``prefix +``
        the object's key, ``bytes`` values).
    prefix
        As :class:`~dask_ddict.DDictStore`'s.
    storage_options
        fsspec options for a URL ``source``; they travel to the loader tasks (as Dask's
        ``from_zarr`` sends them to its tasks).
    nloaders
        Loader tasks in all (default: two per worker that hosts managers); at least one
        per such worker.
    wait
        Return once everything is loaded (Dragon's ``wait_on_load``).

    Raises
    ------
    FileNotFoundError
        ``source`` is a local path that does not exist.
    TypeError, ValueError
        A wrong argument, named.
    """
    target = DDictStore(ddict, prefix=prefix)  # (checks ddict and prefix, as for any store)
    ddict = target.ddict
    check_int("nloaders", nloaders, 1, allow_none=True)
    path = os.fspath(source)
    store = open_source(path, storage_options)
    from zarr.core.sync import sync

    async def listing() -> list[str]:
        return [k async for k in store.list()]

    keys = sync(listing())
    names = [(k, ddict.which_manager(target.prefix + k)) for k in keys]
    workers: dict[str, list[int]] = {}
    for mid, w in enumerate(ddict.manager_workers):
        workers.setdefault(w, []).append(mid)
    loaders = plan(names, workers, nloaders or 2 * len(workers))
    token = secrets.token_hex(6)
    client = ddict._core.client
    name = ddict.get_name()
    futures = [
        client.submit(
            load,
            ddict,
            path,
            storage_options,
            target.prefix,
            token,
            i,
            ks,
            key=f"ddict-stage-{name}-{token}-{i}",
            workers=[w],
            allow_other_workers=True,
            pure=False,
        )
        for i, (w, ks) in enumerate(loaders)
    ]
    staged = StagedStore(
        ddict,
        path,
        prefix=target.prefix,
        storage_options=storage_options,
        token=token,
        loaders=len(loaders),
        total=len(keys),
    )
    staged._futures = futures
    logger.info("staging %s into %r: %d objects, %d loaders", path, name, len(keys), len(loaders))
    if wait:
        staged.wait()
    return staged


class StagedStore(DDictStore):
    """A :class:`~dask_ddict.DDictStore` being loaded from a source store (:func:`stage`):
    what is not loaded yet is read from the source.  Read-only; pickles by reference (the
    dictionary's handle, the source's path and options, the staging's token)."""

    def __init__(
        self,
        ddict: DDict | AsyncDDict,
        source: str,
        *,
        prefix: str = "",
        storage_options: dict[str, Any] | None = None,
        token: str,
        loaders: int,
        total: int,
    ) -> None:
        super().__init__(ddict, prefix=prefix, read_only=True)
        self.source = source
        self.storage_options = storage_options
        self.token = token
        self.loaders = loaders
        self.total = total
        self._source: Store | None = None
        self._loaded = False
        self._looked = 0.0  # (when a read last asked whether everything is loaded)
        self._futures: list[Any] = []

    def __reduce__(self) -> Any:
        return (
            _rebuild,
            (
                self._d,
                self.source,
                self.prefix,
                self.storage_options,
                self.token,
                self.loaders,
                self.total,
            ),
        )

    def __repr__(self) -> str:
        done, total = self.loaded()
        return (
            f"<StagedStore {self.source!r} -> {self._d.get_name()!r} prefix={self.prefix!r}"
            f" {done}/{total} loaded>"
        )

    def _identity(self) -> tuple[Any, ...]:
        return (*super()._identity(), self.token)

    def with_read_only(self, read_only: bool = False) -> DDictStore:
        """The dictionary's plain store under the same prefix (writable unless
        ``read_only``): only once loaded, else a loader could overwrite a write."""
        if not read_only and not self.is_loaded():
            raise DDictError(
                f"{self!r} is still loading: it is writable once loaded (wait())",
                "INVALID_OPERATION",
            )
        return DDictStore(self._d, prefix=self.prefix, read_only=read_only)

    def done(self) -> DDictStore:
        """:meth:`wait`, then the dictionary's plain (writable) store of the same data."""
        self.wait()
        return self.with_read_only(False)

    # -- how far it got ---------------------------------------------------------------

    def _records(self) -> list[Any]:
        d = self._d
        return [d.get(_record(self.token, i), None) for i in range(self.loaders)]

    def loaded(self) -> tuple[int, int]:
        """``(objects loaded, objects in the source)``."""
        if self._loaded:
            return self.total, self.total
        return sum(r[0] for r in self._records() if r is not None), self.total

    def is_loaded(self) -> bool:
        """Whether every object is in the dictionary (then the source is never read
        again).  Raises the first loader's error, if one failed."""
        return self._state()[1]

    def _state(self) -> tuple[int, bool]:
        """``(objects loaded, whether every loader finished)``, from one read of the
        loaders' records; raises the first loader's error, if one failed."""
        if self._loaded:
            return self.total, True
        records = self._records()
        for r in records:
            if r is not None and r[3] is not None:
                raise DDictError(
                    f"staging {self.source!r} into {self._d.get_name()!r} failed: {r[3]}",
                    "INVALID_OPERATION",
                )
        self._loaded = all(r is not None and r[2] for r in records)
        return sum(r[0] for r in records if r is not None), self._loaded

    def wait(self, timeout: float | None = None) -> None:
        """Wait until everything is loaded (``timeout`` seconds at most), with a bar when
        progress is on.

        Raises
        ------
        DDictError
            A loader failed (what it said); reads still fall through to the source.
        DDictTimeoutError
            ``timeout`` passed first (the loaders go on).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        bar = None
        if progress.enabled():
            from tqdm.auto import tqdm

            bar = tqdm(total=self.total, desc=f"staging {self.source}", unit="object", leave=False)
        try:
            while not (state := self._state())[1]:
                failed = [f for f in self._futures if f.status == "error"]
                if failed:
                    failed[0].result()  # (raises the loader's error)
                if bar is not None:
                    bar.update(state[0] - bar.n)
                if deadline is not None and time.monotonic() >= deadline:
                    raise DDictTimeoutError(
                        f"staging {self.source!r}: {state[0]} of "
                        f"{self.total} objects loaded after {timeout} s"
                    )
                time.sleep(
                    POLL if deadline is None else max(0.0, min(POLL, deadline - time.monotonic()))
                )
            if bar is not None:
                bar.update(self.total - bar.n)
        finally:
            if bar is not None:
                bar.close()

    # -- reads: the dictionary, else the source ---------------------------------------

    def _from_source(self) -> Store | None:
        """The source while loading (``None`` once everything is loaded: asked of the
        loaders' records at most every :data:`POLL` seconds)."""
        if not self._loaded and time.monotonic() - self._looked > POLL:
            self._looked = time.monotonic()
            try:
                self.is_loaded()
            except DDictError:  # (a loader failed: the source still answers)
                pass
        if self._loaded:
            return None
        if self._source is None:
            self._source = open_source(self.source, self.storage_options)
        return self._source

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        loading = not self._loaded  # (asked before the read, not after: see below)
        got = await super().get(key, prototype, byte_range)
        if got is not None or not loading:
            return got
        source = self._from_source()
        if source is None:  # (loaded since the read began: the dictionary has it now)
            return await super().get(key, prototype, byte_range)
        return await source.get(key, prototype, byte_range)

    def get_sync(
        self,
        key: str,
        *,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        loading = not self._loaded  # (before the read: as get)
        got = super().get_sync(key, prototype=prototype, byte_range=byte_range)
        if got is not None or not loading:
            return got
        source = self._from_source()
        if source is None:  # (loaded since the read began: the dictionary has it now)
            return super().get_sync(key, prototype=prototype, byte_range=byte_range)
        from zarr.core.sync import sync

        return sync(source.get(key, prototype or default_buffer_prototype(), byte_range))

    async def exists(self, key: str) -> bool:
        source = self._from_source()
        return await (super().exists(key) if source is None else source.exists(key))

    async def getsize(self, key: str) -> int:
        source = self._from_source()
        return await (super().getsize(key) if source is None else source.getsize(key))

    def list(self) -> AsyncIterator[str]:
        source = self._from_source()
        return super().list() if source is None else source.list()

    def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        source = self._from_source()
        return super().list_prefix(prefix) if source is None else source.list_prefix(prefix)

    def list_dir(self, prefix: str) -> AsyncIterator[str]:
        source = self._from_source()
        return super().list_dir(prefix) if source is None else source.list_dir(prefix)


def _rebuild(
    ddict: DDict,
    source: str,
    prefix: str,
    storage_options: dict[str, Any] | None,
    token: str,
    loaders: int,
    total: int,
) -> StagedStore:
    return StagedStore(
        ddict,
        source,
        prefix=prefix,
        storage_options=storage_options,
        token=token,
        loaders=loaders,
        total=total,
    )
