"""Persisted checkpoints in a zarr v3 store: the default persister's medium.

:class:`ZarrPersister` keeps the layout of :mod:`.versioned` as zarr groups and
arrays (documented for users in ``docs/design/checkpoint-stores.md``; plain
``zarr.open_group(persist_path)`` reads it): a generation is a group whose
attributes are its commit (``zarr.json``, written last), the arrays are zarr
arrays, a record is an empty group in ``committed/``.  The store is a local
directory or any fsspec URL (``s3://...``).

Every array's chunks end with a CRC32C (zarr's ``crc32c`` codec; chunks written
directly as files get the same layout), and the commit records the CRC32C of
every chunk: zarr reads a missing chunk as zeros, which the committed checksum
refuses.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec
from zarr.errors import ContainsGroupError, GroupNotFoundError

from .._keys import KEY_ENCODING
from .._serialize import VALUE_FRAMES
from ..arguments import local_store
from ..errors import DDictPersistCheckpointError
from .directory_store import MARK
from .files import fsync_tree
from .versioned import COMMITTED, ChunkSink, Values, VersionedPersister, manager_index

#: The store format; changes with the layout, the key bytes (:data:`KEY_ENCODING`) or
#: the value frames (:data:`VALUE_FRAMES`): an older version refuses what it would misread.
FORMAT = f"dask_ddict.checkpoint/{KEY_ENCODING}.{VALUE_FRAMES}"
#: The formats this version reads: its own, and the same key bytes with older frames.
READABLE = frozenset({FORMAT, f"dask_ddict.checkpoint/{KEY_ENCODING}"})
_ARRAY_CONFIG = {"write_empty_chunks": True}  # skip the per-chunk "all fill?" scan
_CRC = [Crc32cCodec()]


def _not_files(local: str | None, path: str) -> None:
    """Refuse a directory persister's store, which this one would misread."""
    if local is not None and os.path.exists(os.path.join(local, MARK)):
        raise DDictPersistCheckpointError(
            f"{path!r} holds the directory persister's files, not a zarr store: read it "
            "with persister_class=DirectoryPersister"
        )


def _sync(coro: Any) -> Any:
    from zarr.core.sync import sync

    return sync(coro)


def _child(group: Any, name: str) -> str:
    """The store key of ``name`` inside ``group``."""
    sp = group.store_path
    return f"{sp.path}/{name}" if sp.path else name


def _list_dir(group: Any) -> list[str]:
    """Names directly inside ``group``, as the store has them now.

    fsspec filesystems (s3fs, gcsfs, ...) cache listings per process, so a
    record written by another manager's process would stay unseen: the
    cached listing of this prefix is dropped first.
    """
    sp = group.store_path
    fs = getattr(sp.store, "fs", None)
    if fs is not None:
        root = getattr(sp.store, "path", "")
        fs.invalidate_cache(f"{root}/{sp.path}".strip("/") if root else sp.path)

    async def names() -> list[str]:
        return [n async for n in sp.store.list_dir(sp.path)]

    return list(_sync(names()))


def _require_group(path: str, names: list[str], storage_options: dict[str, Any] | None) -> Any:
    """Open (creating as needed) ``path/names...``.

    The managers of one dictionary open the same store at the same moment
    from different processes; when two create a group at once, one finds it
    already created and simply opens it on the next try.
    """
    for attempt in range(10):
        try:
            group = zarr.open_group(path, mode="a", storage_options=storage_options or None)
            for n in names:
                group = group.require_group(n)
            return group
        except (ContainsGroupError, FileExistsError):
            if attempt == 9:
                raise
            time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")


class _ZarrSink(ChunkSink):
    """A zarr array's chunks.  For the plain layout (bytes codec, then crc32c) a chunk's
    file is its bytes followed by their CRC32C, so full chunks go straight to the store
    (the checksum written into the buffer's 4 spare bytes: no codec pass, no extra
    copy) while the caller fills the next buffer; any other layout takes zarr's
    ordinary path."""

    def __init__(self, values: Any, chunk: int, step: Any) -> None:
        super().__init__(chunk, step)
        self.values = values
        meta = values.metadata
        names = [type(c).__name__ for c in getattr(meta, "codecs", ())]
        self.direct = names == ["BytesCodec", "Crc32cCodec"] and hasattr(meta, "encode_chunk_key")

    def store(self, i: int, buf: np.ndarray, nbytes: int, crc: int) -> Any:
        if not (self.direct and nbytes == self.chunk):
            self.values[i * self.chunk : i * self.chunk + nbytes] = buf[:nbytes]
            return None
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import _get_loop

        buf[nbytes : nbytes + 4] = np.frombuffer(np.uint32(crc).tobytes(), dtype=np.uint8)
        sp = self.values.store_path
        name = self.values.metadata.encode_chunk_key((i,))
        key = f"{sp.path}/{name}" if sp.path else name
        data = default_buffer_prototype().buffer.from_array_like(buf[: nbytes + 4])
        return asyncio.run_coroutine_threadsafe(sp.store.set(key, data), _get_loop())


class ZarrPersister(VersionedPersister):
    """One manager's persisted checkpoints in a zarr v3 store (a local directory or an
    fsspec URL): the default.  Parameters: those of
    :class:`~dask_ddict.persist.interface.CheckpointPersister`."""

    kind = "zarr"
    FORMAT = FORMAT
    READABLE = READABLE

    def _open(self) -> dict[str, Any] | None:
        if os.path.exists(self.root) and not os.path.isdir(self.root) and self.local:
            raise DDictPersistCheckpointError(
                f"persist_path {self.path!r} is a file, not a directory (a zarr store)"
            )
        _not_files(self.root if self.local else None, self.path)
        name, so = self.name, self.storage_options
        if self.writable:
            self.group: Any = _require_group(self.root, [name, f"manager_{self.manager_id}"], so)
            self.record_group = _require_group(self.root, [name, COMMITTED], so)
            self.dict_group = _require_group(self.root, [name], so)
        else:
            root = zarr.open_group(self.root, mode="r", storage_options=so or None)
            self.record_group = root[f"{name}/{COMMITTED}"]
            self.dict_group = root[name]
            mine = f"manager_{self.manager_id}"  # (none: a manager that a restore onto more
            self.group = (
                root[f"{name}/{mine}"]
                if mine
                in {  # managers adds)
                    n for n, _ in self.dict_group.groups()
                }
                else None
            )
        return None if self.group is None else dict(self.group.attrs)

    def _stamp(self, attrs: dict[str, Any]) -> None:
        self.group.attrs.update(attrs)

    def _manager_attrs(self, manager_id: int) -> dict[str, Any] | None:
        try:
            return dict(self.dict_group[f"manager_{manager_id}"].attrs)
        except KeyError:
            return None

    def _manager_ids(self) -> list[int]:
        return sorted(i for i in map(manager_index, _list_dir(self.dict_group)) if i >= 0)

    def _generation_names(self) -> list[str]:
        return [] if self.group is None else _list_dir(self.group)

    def _generation_attrs(self, name: str) -> dict[str, Any]:
        return dict(self.group[name].attrs)

    def _record_names(self) -> list[str]:
        return _list_dir(self.record_group)

    def _add_record(self, name: str) -> None:
        self.record_group.create_group(name, overwrite=True)

    def _drop_record(self, name: str) -> None:
        _sync(self.record_group.store_path.store.delete_dir(_child(self.record_group, name)))

    def _begin(self, name: str, attrs: dict[str, Any]) -> None:
        self.group.create_group(name, attributes=attrs)

    def _values_sink(self, name: str, nbytes: int, chunk: int) -> ChunkSink:
        values = self.group[name].create_array(
            "values",
            shape=(nbytes,),
            dtype="uint8",
            chunks=(chunk,),
            compressors=_CRC,
            fill_value=0,
            config=_ARRAY_CONFIG,
        )
        return _ZarrSink(values, chunk, self.step)

    def _write_array(self, name: str, aname: str, arr: np.ndarray) -> None:
        self.group[name].create_array(
            aname, data=arr, chunks=(max(1, arr.size),), compressors=_CRC, config=_ARRAY_CONFIG
        )

    def _commit(self, name: str, attrs: dict[str, Any]) -> None:
        self.group[name].attrs.update(attrs)

    def _flush(self, name: str) -> None:
        fsync_tree(os.path.join(self.root, self.name, f"manager_{self.manager_id}", name))

    def _uncommit(self, name: str) -> None:
        _sync(self.group.store_path.store.delete(f"{_child(self.group, name)}/zarr.json"))

    def _remove_data(self, name: str) -> None:
        _sync(self.group.store_path.store.delete_dir(_child(self.group, name)))

    def _read_array(self, name: str, aname: str) -> np.ndarray:
        return np.asarray(self.group[name][aname][...])

    def _values(self, name: str) -> Values:
        values = self.group[name]["values"]
        total, chunk = int(values.shape[0]), int(values.chunks[0])
        return Values(total, chunk, lambda i: values[i * chunk : min((i + 1) * chunk, total)])

    @classmethod
    def dictionaries(cls, path: str, storage_options: dict[str, Any] | None = None) -> list[str]:
        _not_files(local_store(path), path)
        try:
            root = zarr.open_group(
                local_store(path) or path, mode="r", storage_options=storage_options or None
            )
            return sorted(n for n, _ in root.groups())
        except (FileNotFoundError, GroupNotFoundError):  # (an empty directory or bucket)
            return []
        except Exception as e:  # noqa: BLE001 - any other reason the store cannot be read
            raise DDictPersistCheckpointError(
                f"{path!r} is not a readable zarr store ({type(e).__name__}: {e})"
            ) from None
