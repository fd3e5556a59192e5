"""Same-host reads with no round trip: open the manager's shard read-only.

A shard is an LMDB environment in ``/dev/shm``: any process on the host can map
it and read a committed snapshot while the manager keeps writing (LMDB's
readers never block the writer and never see a half-written transaction).  So
a client on the manager's host (another worker's task, or the user's process)
serves ``d[k]`` and ``k in d`` from the shard itself, at memory speed, and uses
the manager's Unix socket only for writes and for reads that must wait (a
``wait_for_keys`` read of a key not yet written).

Checkpoint rules are applied from the same snapshot: the window's newest
checkpoint is stored in the shard's metadata by every write that moves it.
The value is copied out while the snapshot is open, so a caller never holds a
view of pages that a later write could reuse.

LMDB forbids opening one environment twice in a process, so read-only
environments are shared process-wide (:data:`_ENVS`) and released when the
last channel using one closes.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import lmdb

from .._serialize import copy_frame
from ..errors import DDictKeyError, DDictManagerUnavailableError
from ..options import DDictOptions
from ..store import ShardStore
from ..working_set import check_window, entry_visible, saved_newest
from .client import SocketChannel

_ENVS: dict[str, list[Any]] = {}  # path -> [ShardStore, users]
_ENVS_LOCK = threading.Lock()


def _acquire(path: str, capacity: int) -> ShardStore:
    with _ENVS_LOCK:
        entry = _ENVS.get(path)
        if entry is None:
            entry = _ENVS[path] = [ShardStore(path, capacity, readonly=True), 0]
        entry[1] += 1
        return entry[0]


def _release(path: str) -> None:
    with _ENVS_LOCK:
        entry = _ENVS.get(path)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _ENVS[path]
            entry[0].close()


def forget(path: str) -> None:
    """Close this process's read-only view of a shard it is about to open for writing.

    LMDB must not have one environment open twice in a process; a restart can
    place a manager in a process that still maps the old shard read-only.
    """
    with _ENVS_LOCK:
        entry = _ENVS.pop(path, None)
    if entry is not None:
        entry[0].close()


class SharedReadChannel:
    """A :class:`SocketChannel` whose ``get``/``contains`` read the shard directly."""

    kind = "shm"

    def __init__(self, sock: SocketChannel, store_path: str, capacity: int,
                 options: DDictOptions) -> None:  # fmt: skip
        self._sock = sock
        self._path = store_path
        self._store = _acquire(store_path, capacity)
        self._size = options.working_set_size
        self._wfk = options.wait_for_keys
        self._closed = False

    def __repr__(self) -> str:
        return f"<SharedReadChannel manager={self._sock.info.manager_id} path={self._path!r}>"

    def __getattr__(self, name: str) -> Any:
        # Writes, waits, views, stats, admin: the manager's socket.
        return getattr(self._sock, name)

    def _check_alive(self) -> None:
        """A shard outlives its process: a dead manager must still read as unavailable,
        as it does over a socket.  One ``kill(pid, 0)`` per read (about a microsecond);
        a manager that closed says so in the shard itself (see :meth:`_visible`).
        """
        info = self._sock.info
        try:
            os.kill(info.pid, 0)
        except ProcessLookupError:
            raise DDictManagerUnavailableError(
                f"manager {info.manager_id} on worker {info.worker} is gone (process "
                f"{info.pid} ended)"
            ) from None
        except PermissionError:
            pass  # alive, under another user

    def _visible(self, digest: bytes, chkpt: int, txn: Any) -> Any:
        """The entry visible at ``chkpt``, ``None`` if absent, ``False`` if a reader must wait."""
        newest, closed = saved_newest(self._store, txn, self._size)
        if closed:
            info = self._sock.info
            raise DDictManagerUnavailableError(
                f"manager {info.manager_id} on worker {info.worker} is closed"
            )
        check_window(chkpt, newest, self._size)
        e = self._store.lookup(txn, digest, chkpt)
        if entry_visible(e, chkpt, self._wfk):
            return e
        return False if self._wfk else None  # under wait_for_keys the manager waits

    def _snapshot(self) -> Any:
        try:
            return self._store.read()
        except lmdb.Error as e:  # the view was closed (a restart reopened the shard here)
            info = self._sock.info
            raise DDictManagerUnavailableError(
                f"manager {info.manager_id} on worker {info.worker}: shard closed ({e})"
            ) from e

    def get(self, digest: bytes, chkpt: int, timeout: float | None) -> Any:
        self._check_alive()
        with self._snapshot() as txn:
            e = self._visible(digest, chkpt, txn)
            if e:
                return copy_frame(e.frame)
        if e is None:
            raise DDictKeyError()
        return self._sock.get(digest, chkpt, timeout)  # the manager waits for the writer

    def contains(self, digest: bytes, chkpt: int) -> bool:
        self._check_alive()
        with self._snapshot() as txn:
            return bool(self._visible(digest, chkpt, txn))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _release(self._path)
        self._sock.close()
