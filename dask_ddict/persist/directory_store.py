"""Persisted checkpoints as plain files in a directory: the second persister's medium.

:class:`DirectoryPersister` keeps the layout of :mod:`.versioned` as directories
and files, for a local or shared (NFS, Lustre, GPFS) file system, with nothing but
the standard library needed to read them back (``docs/design/checkpoint-stores.md``)::

    <persist_path>/
      dask_ddict.json                 {"persister": "directory", "format": ...}
      <dict name>/
        manager_<i>/
          manager.json                {"format", "num_managers", "manager_id"}
          chkpt_<k>.g<gen>/
            generation.json           the generation's attributes: its commit, last
            keys, key_offsets, value_offsets, flags   raw little-endian arrays
            values                    the value frames, concatenated
        committed/
          chkpt_<k>.manager_<i>.g<gen>.v<version>.n<N>   empty files: the records

A commit replaces ``generation.json`` at once (written beside it, then renamed),
so a crash leaves the uncommitted attributes or the committed ones, and a removal
deletes it first.  Every array's CRC32C, and every values chunk's, is in the
commit: a flipped, missing or truncated file is refused, never read as data.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import numpy as np

from .._keys import KEY_ENCODING
from .._serialize import VALUE_FRAMES
from ..arguments import local_store
from ..errors import DDictPersistCheckpointError
from .files import fsync_path, fsync_tree, replace_file
from .versioned import COMMITTED, SMALL, ChunkSink, Values, VersionedPersister, manager_index

#: The store format (see ``zarr_store.FORMAT``: the same key bytes and value frames).
FORMAT = f"dask_ddict.directory/{KEY_ENCODING}.{VALUE_FRAMES}"
#: What marks a directory as this persister's (beside the dictionaries).
MARK = "dask_ddict.json"
_ATTRS = "generation.json"
_MANAGER = "manager.json"


def _read_json(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        out = json.loads(f.read())
    if not isinstance(out, dict):
        raise ValueError(f"{path} holds {type(out).__name__}, not an object")
    return out


class _FileSink(ChunkSink):
    """A generation's ``values`` file, a chunk at a time (at its offset: a chunk
    written again after a crash lands where it belongs)."""

    def __init__(self, path: str, chunk: int, step: Any) -> None:
        super().__init__(chunk, step)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def store(self, i: int, buf: np.ndarray, nbytes: int, crc: int) -> None:
        view, at = memoryview(buf[:nbytes].data), i * self.chunk
        while view.nbytes:
            done = os.pwrite(self.fd, view, at)
            view, at = view[done:], at + done

    def finish(self) -> None:
        super().finish()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class DirectoryPersister(VersionedPersister):
    """One manager's persisted checkpoints as plain files under a directory (local, or a
    shared file system every worker mounts at the same path).  Parameters: those of
    :class:`~dask_ddict.persist.interface.CheckpointPersister`; ``persist_path`` is a
    directory, not a URL."""

    kind = "directory"
    FORMAT = FORMAT
    READABLE = frozenset({FORMAT})

    def _open(self) -> dict[str, Any] | None:
        if not self.local:
            raise DDictPersistCheckpointError(
                f"persist_path {self.path!r}: the directory persister writes files in a "
                "directory (local, or a shared file system); for a URL (s3://...) use the "
                "zarr persister (persister_class=None)"
            )
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise DDictPersistCheckpointError(
                f"persist_path {self.path!r} is a file, not a directory"
            )
        _not_zarr(self.root, self.path)
        self._dict = os.path.join(self.root, self.name)
        self._mine = os.path.join(self._dict, f"manager_{self.manager_id}")
        self._records = os.path.join(self._dict, COMMITTED)
        if self.writable:
            os.makedirs(self._mine, exist_ok=True)
            os.makedirs(self._records, exist_ok=True)
            mark = os.path.join(self.root, MARK)
            if not os.path.exists(mark):
                replace_file(mark, json.dumps({"persister": self.kind, "format": FORMAT}).encode())
        elif not os.path.isdir(self._records):
            raise FileNotFoundError(f"{self._records} does not exist")
        return self._manager_attrs(self.manager_id)

    def _stamp(self, attrs: dict[str, Any]) -> None:
        replace_file(os.path.join(self._mine, _MANAGER), json.dumps(attrs).encode(), self.fsync)

    def _manager_attrs(self, manager_id: int) -> dict[str, Any] | None:
        path = os.path.join(self._dict, f"manager_{manager_id}", _MANAGER)
        return _read_json(path) if os.path.exists(path) else None

    def _manager_ids(self) -> list[int]:
        return sorted(i for i in map(manager_index, _listdir(self._dict)) if i >= 0)

    def _gen(self, name: str, *parts: str) -> str:
        return os.path.join(self._mine, name, *parts)

    def _generation_names(self) -> list[str]:
        return _listdir(self._mine)

    def _generation_attrs(self, name: str) -> dict[str, Any]:
        return _read_json(self._gen(name, _ATTRS))

    def _record_names(self) -> list[str]:
        return [n for n in _listdir(self._records) if not n.endswith(".tmp")]

    def _add_record(self, name: str) -> None:
        with open(os.path.join(self._records, name), "wb"):
            pass
        if self.fsync:
            fsync_path(self._records)

    def _drop_record(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self._records, name))
        except FileNotFoundError:
            pass

    def _begin(self, name: str, attrs: dict[str, Any]) -> None:
        os.mkdir(self._gen(name))
        replace_file(self._gen(name, _ATTRS), json.dumps(attrs).encode())

    def _values_sink(self, name: str, nbytes: int, chunk: int) -> ChunkSink:
        return _FileSink(self._gen(name, "values"), chunk, self.step)

    def _write_array(self, name: str, aname: str, arr: np.ndarray) -> None:
        with open(self._gen(name, aname), "wb") as f:
            f.write(np.ascontiguousarray(arr, dtype=SMALL[aname]).data)

    def _commit(self, name: str, attrs: dict[str, Any]) -> None:
        replace_file(self._gen(name, _ATTRS), json.dumps(attrs).encode(), self.fsync)

    def _flush(self, name: str) -> None:
        fsync_tree(self._gen(name))

    def _uncommit(self, name: str) -> None:
        try:
            os.unlink(self._gen(name, _ATTRS))
        except FileNotFoundError:
            pass

    def _remove_data(self, name: str) -> None:
        shutil.rmtree(self._gen(name), ignore_errors=True)

    def _read_array(self, name: str, aname: str) -> np.ndarray:
        return np.fromfile(self._gen(name, aname), dtype=SMALL[aname])

    def _values(self, name: str) -> Values:
        path = self._gen(name, "values")
        chunk = int(self._generation_attrs(name)["value_chunk"])
        total = os.path.getsize(path)

        def read(i: int) -> np.ndarray:
            with open(path, "rb") as f:
                return np.frombuffer(os.pread(f.fileno(), chunk, i * chunk), dtype=np.uint8)

        return Values(total, chunk, read)

    @classmethod
    def dictionaries(cls, path: str, storage_options: dict[str, Any] | None = None) -> list[str]:
        local = local_store(path)
        if local is None:
            raise DDictPersistCheckpointError(
                f"{path!r} is a URL: the directory persister reads local directories"
            )
        _not_zarr(local, path)
        return sorted(
            n for n in _listdir(local) if os.path.isdir(os.path.join(local, n, COMMITTED))
        )


def _not_zarr(root: str, path: str) -> None:
    """Refuse a zarr store: the zarr persister's, which this one would misread."""
    if os.path.exists(os.path.join(root, "zarr.json")):
        raise DDictPersistCheckpointError(
            f"{path!r} is a zarr store (the zarr persister's): read it with persister_class=None"
        )


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []
