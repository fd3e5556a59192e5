"""Checkpoint persistence: a zarr v3 store of retired (or explicitly persisted) checkpoints.

Layout (documented for users in ``docs/persistence.md``; plain
``zarr.open_group(persist_path)`` reads it)::

    <persist_path>/                     zarr group
      <dict name>/                      group
        manager_<i>/                    group, attrs {"num_managers": N, ...}
          chkpt_<k>/                    group, attrs {"checkpoint": k, "num_keys": n,
                                        #              "committed": true}  <- written last
            keys            uint8[...]  serialized keys, concatenated
            key_offsets     uint64[n+1] key i is keys[key_offsets[i]:key_offsets[i+1]]
            values          uint8[...]  value frames (dask_ddict framing), concatenated
            value_offsets   uint64[n+1]
            flags           uint8[n]    bit 1: persistent (matters under wait_for_keys)

A checkpoint is the full state visible at ``k`` (everything carried forward
into it), so restoring ``k`` needs nothing else.  A checkpoint counts only
once its ``committed`` attribute is true, and that attribute is written after
every array: a persist interrupted half-way (a killed worker, a full disk) is
never taken for complete, and the next persist of that id replaces it.

:class:`CheckpointStore` is the I/O (testable without a cluster);
:class:`Persister` is the policy (which ids, eviction) and the background
thread that keeps zarr I/O off the manager's write path and off the worker's
event loop.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import zarr
from zarr.errors import ContainsGroupError

from .errors import DDictError, DDictPersistCheckpointError

logger = logging.getLogger(__name__)

FORMAT = "dask_ddict.checkpoint/1"
_ARRAY_CONFIG = {"write_empty_chunks": True}  # skip the per-chunk "all fill?" scan


def _require_group(path: str, names: list[str], storage_options: dict[str, Any] | None) -> Any:
    """Open (creating as needed) ``path/names...``.

    The managers of one dictionary open the same store at the same moment
    from different processes; when two create a group at once, one finds it
    already created and simply opens it on the next try.
    """
    kwargs = {"storage_options": storage_options} if storage_options else {}
    for attempt in range(10):
        try:
            group = zarr.open_group(path, mode="a", **kwargs)
            for n in names:
                group = group.require_group(n)
            return group
        except (ContainsGroupError, FileExistsError):
            if attempt == 9:
                raise
            time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")


class _ChunkWriter:
    """Stores full chunks of a 1-D uncompressed uint8 array, overlapping copy and I/O.

    For the plain layout (bytes codec only) a chunk's bytes are its file, so
    they go straight to the store, with no codec pass and no extra copy, while
    the caller fills the next buffer (two buffers in flight).  Any other
    layout takes zarr's ordinary path.
    """

    def __init__(self, values: Any, chunk: int) -> None:
        self.values = values
        self.chunk = chunk
        self.buffers = [np.empty(chunk, dtype=np.uint8) for _ in range(2)]
        self.pending: list[Any] = [None, None]
        self.turn = 0
        meta = values.metadata
        codecs = getattr(meta, "codecs", ())
        self.direct = (
            len(codecs) == 1
            and type(codecs[0]).__name__ == "BytesCodec"
            and hasattr(meta, "encode_chunk_key")
        )

    @property
    def buffer(self) -> np.ndarray:
        """The buffer to fill next (its previous write has finished)."""
        fut = self.pending[self.turn]
        if fut is not None:
            fut.result()
            self.pending[self.turn] = None
        return self.buffers[self.turn]

    def put(self, i: int, nbytes: int) -> None:
        """Store the current buffer's first ``nbytes`` as chunk ``i``; switch buffers."""
        data = self.buffers[self.turn][:nbytes]
        if self.direct and nbytes == self.chunk:
            import asyncio

            from zarr.core.buffer import default_buffer_prototype
            from zarr.core.sync import _get_loop

            sp = self.values.store_path
            name = self.values.metadata.encode_chunk_key((i,))
            key = f"{sp.path}/{name}" if sp.path else name
            coro = sp.store.set(key, default_buffer_prototype().buffer.from_array_like(data))
            self.pending[self.turn] = asyncio.run_coroutine_threadsafe(coro, _get_loop())
        else:
            self.values[i * self.chunk : i * self.chunk + nbytes] = data
        self.turn ^= 1

    def finish(self) -> None:
        for t, fut in enumerate(self.pending):
            if fut is not None:
                fut.result()
                self.pending[t] = None


def _chkpt_name(chkpt: int) -> str:
    return f"chkpt_{chkpt}"


class CheckpointStore:
    """One manager's persisted checkpoints in a zarr store.

    Parameters
    ----------
    path
        The zarr store: a local directory or an fsspec URL.
    name
        The dictionary's name (its group in the store).
    manager_id, num_managers
        Which shard this is, and of how many (a checkpoint only makes sense
        with the key-to-manager mapping it was written with).
    chunk_bytes
        Chunk size of the ``values`` array (no compression: persisting runs
        at disk speed).
    storage_options
        Passed to fsspec for URLs.
    fsync
        Flush a local checkpoint's files to the disk before its commit marker
        is written (and the marker after): a checkpoint then survives a power
        loss, at disk speed instead of page-cache speed.
    """

    def __init__(
        self,
        path: str,
        name: str,
        manager_id: int,
        num_managers: int,
        *,
        chunk_bytes: int = 64 << 20,
        storage_options: dict[str, Any] | None = None,
        fsync: bool = False,
    ) -> None:
        self.path = path
        self.name = name
        self.manager_id = manager_id
        self.num_managers = num_managers
        self.chunk_bytes = chunk_bytes
        # file:// URLs are local directories: zarr's LocalStore creates parents and can
        # fsync.  fsync applies to local directories (fsspec stores have their own guarantees).
        self._local_root = path[7:] if path.startswith("file://") else path
        self.fsync = fsync and "://" not in self._local_root
        self.group = _require_group(
            self._local_root, [name, f"manager_{manager_id}"], storage_options
        )
        found = self.group.attrs.get("num_managers")
        if found is not None and found != num_managers:
            raise DDictPersistCheckpointError(
                f"the checkpoints of {name!r} in {path} were written by {found} managers, "
                f"this dictionary has {num_managers}: keys would map to other managers"
            )
        if found is None:
            self.group.attrs.update({"format": FORMAT, "num_managers": num_managers,
                                     "manager_id": manager_id})  # fmt: skip

    def __repr__(self) -> str:
        return f"<CheckpointStore {self.path!r} {self.name!r} manager={self.manager_id}>"

    def ids(self) -> list[int]:
        """Committed checkpoint ids, ascending (half-written ones are not listed)."""
        out = []
        for gname, g in self.group.groups():
            if gname.startswith("chkpt_") and g.attrs.get("committed") is True:
                out.append(int(gname[6:]))
        return sorted(out)

    def delete(self, chkpt: int) -> None:
        name = _chkpt_name(chkpt)
        if name in self.group:
            del self.group[name]

    def write(self, chkpt: int, entries: Callable[[], Iterable[tuple[Any, Any, int]]]) -> int:
        """Write checkpoint ``chkpt`` from ``entries()`` (called twice: sizes, then data).

        ``entries`` yields ``(key bytes, value frame, flags)``; frames may be
        views that are valid only during iteration.  Returns the value bytes
        written.
        """
        n = key_bytes = value_bytes = 0
        for k, v, _ in entries():
            n += 1
            key_bytes += len(k)
            value_bytes += memoryview(v).nbytes
        self.delete(chkpt)
        g = self.group.create_group(
            _chkpt_name(chkpt),
            attributes={"format": FORMAT, "checkpoint": chkpt, "manager_id": self.manager_id,
                        "num_keys": n, "value_bytes": value_bytes, "committed": False},
        )  # fmt: skip
        chunk = max(1, min(self.chunk_bytes, value_bytes))
        values = g.create_array(
            "values", shape=(value_bytes,), dtype="uint8", chunks=(chunk,),
            compressors=None, fill_value=0, config=_ARRAY_CONFIG,
        )  # fmt: skip
        writer = _ChunkWriter(values, chunk)
        keys = np.empty(key_bytes, dtype=np.uint8)
        koff = np.zeros(n + 1, dtype=np.uint64)
        voff = np.zeros(n + 1, dtype=np.uint64)
        flags = np.zeros(n, dtype=np.uint8)
        filled = written = kpos = vpos = 0
        buf = writer.buffer
        i = -1
        try:
            for i, (k, v, f) in enumerate(entries()):
                if i >= n:
                    raise RuntimeError("checkpoint changed while it was being persisted")
                keys[kpos : kpos + len(k)] = np.frombuffer(k, dtype=np.uint8)
                kpos += len(k)
                koff[i + 1] = kpos
                flags[i] = f
                mv = np.frombuffer(memoryview(v).cast("B"), dtype=np.uint8)
                vpos += mv.nbytes
                voff[i + 1] = vpos
                pos = 0
                while pos < mv.nbytes:  # stream through full chunks: no read-modify-write
                    take = min(chunk - filled, mv.nbytes - pos)
                    buf[filled : filled + take] = mv[pos : pos + take]
                    filled += take
                    pos += take
                    if filled == chunk:
                        writer.put(written // chunk, chunk)
                        buf = writer.buffer
                        written += chunk
                        filled = 0
            if i + 1 != n:
                raise RuntimeError("checkpoint changed while it was being persisted")
            if filled:
                writer.put(written // chunk, filled)
        finally:
            writer.finish()
        for aname, arr in (("keys", keys), ("key_offsets", koff), ("value_offsets", voff),
                           ("flags", flags)):  # fmt: skip
            g.create_array(aname, data=arr, chunks=(max(1, arr.size),), compressors=None,
                           config=_ARRAY_CONFIG)  # fmt: skip
        if self.fsync:
            self._fsync(_chkpt_name(chkpt))
        g.attrs["committed"] = True  # the commit marker, last
        if self.fsync:
            self._fsync(_chkpt_name(chkpt))
        return value_bytes

    def _fsync(self, name: str) -> None:
        """Flush a local checkpoint's files and directories to the disk."""
        root = os.path.join(self._local_root, self.name, f"manager_{self.manager_id}", name)
        for dirpath, _, files in os.walk(root):
            for f in files:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fd = os.open(dirpath, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def read(self, chkpt: int) -> Iterator[tuple[bytes, memoryview, int]]:
        """``(key bytes, value frame, flags)`` of a committed checkpoint."""
        name = _chkpt_name(chkpt)
        if name not in self.group or self.group[name].attrs.get("committed") is not True:
            raise DDictPersistCheckpointError(
                f"checkpoint {chkpt} is not persisted for manager {self.manager_id} "
                f"of {self.name!r} in {self.path} (persisted: {self.ids()})"
            )
        g = self.group[name]
        keys = g["keys"][...]
        koff = g["key_offsets"][...]
        voff = g["value_offsets"][...]
        flags = g["flags"][...]
        values = g["values"]
        chunk = values.chunks[0]
        n = len(flags)
        i = 0
        # Read whole chunks' worth of values at a time; yield views into them.
        while i < n:
            start = int(voff[i])
            j = i + 1
            while j < n and int(voff[j + 1]) - start <= chunk:
                j += 1
            block = values[start : int(voff[j])]
            mv = memoryview(block)
            for t in range(i, j):
                a, b = int(voff[t]) - start, int(voff[t + 1]) - start
                yield bytes(keys[int(koff[t]) : int(koff[t + 1])]), mv[a:b], int(flags[t])
            i = j


class Persister:
    """Which checkpoints to persist, and a background thread that writes them.

    Parameters
    ----------
    store
        Where checkpoints go.
    persist_freq, persist_count
        Dragon's policy: a retiring checkpoint ``k`` is persisted when
        ``persist_freq > 0``, ``persist_count != 0`` and ``k % persist_freq == 0``;
        the newest ``persist_count`` are kept (``-1``: all).
    """

    def __init__(self, store: CheckpointStore, persist_freq: int, persist_count: int) -> None:
        self.store = store
        self.persist_freq = persist_freq
        self.persist_count = persist_count
        self._ids = store.ids()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"<Persister {self.store!r} freq={self.persist_freq} count={self.persist_count} "
            f"persisted={self._ids}>"
        )

    def wants(self, chkpt: int) -> bool:
        """Whether retiring checkpoint ``chkpt`` is persisted."""
        f = self.persist_freq
        return f > 0 and self.persist_count != 0 and chkpt % f == 0

    def ids(self) -> list[int]:
        with self._lock:
            return list(self._ids)

    def submit(self, release: Callable[[], None],
               jobs: list[tuple[int, Callable[[], Iterable[Any]]]]) -> None:  # fmt: skip
        """Persist ``jobs`` (``(chkpt, entries)``) in the background, then call ``release``.

        ``entries`` read from a snapshot that ``release`` ends.
        """
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"ddict-persist-{self.store.manager_id}", daemon=True
            )
            self._thread.start()
        self._queue.put((release, jobs))

    def sync(self) -> None:
        """Wait until every submitted checkpoint is written; raise the first failure."""
        self._queue.join()
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise DDictError(f"persisting a checkpoint failed: {err!r}", "INVALID_OPERATION")

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def write_now(self, chkpt: int, entries: Callable[[], Iterable[Any]]) -> None:
        """Persist one checkpoint in this thread (evicting the oldest beyond the count).

        :meth:`CheckpointStore.write` replaces an earlier version of ``chkpt`` itself.
        """
        with self._lock:
            ids = [i for i in self._ids if i != chkpt]
        if self.persist_count > 0:
            while len(ids) >= self.persist_count:
                self.store.delete(ids.pop(0))
        try:
            self.store.write(chkpt, entries)
        except BaseException:
            # The old version may be gone and the new one is not committed: ask the store.
            with self._lock:
                self._ids = self.store.ids()
            raise
        with self._lock:
            self._ids = sorted(ids + [chkpt])

    def discard_above(self, chkpt: int) -> None:
        """Delete persisted checkpoints newer than ``chkpt`` (the history continues from it)."""
        with self._lock:
            doomed = [i for i in self._ids if i > chkpt]
            self._ids = [i for i in self._ids if i <= chkpt]
        for i in doomed:
            self.store.delete(i)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                release, jobs = item
                try:
                    for chkpt, entries in jobs:
                        self.write_now(chkpt, entries)
                except BaseException as e:
                    logger.exception("ddict manager %d: persisting failed", self.store.manager_id)
                    with self._lock:
                        self._error = self._error or e
                finally:
                    release()
            finally:
                self._queue.task_done()
