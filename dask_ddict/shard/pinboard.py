"""Pin boards: what each process on a host holds of a dictionary's shards as zero-copy values.

A zero-copy read (``d.get(k, copy=False)``, or any read of a frozen
dictionary) hands the caller a view of the shard's own pages, kept unchanged
by an LMDB read snapshot for as long as the view lives (see
:mod:`dask_ddict.transport.lending`).  While it lives, the pages that writes
free cannot be reused: the memory is the reader's to give back.  So that the
host can report it (``d.stats``, the dashboard, ``dask ddict stats``), every
process that holds such views writes its totals into a small file of its own
beside the dictionary's generations (``pins-<uid>.<pid>`` in the host's
private socket directory)::

    int64 [changes] [bytes, views] * managers

``changes`` moves with every update.  The host sums the boards of live
processes when asked (:func:`read_boards`) and removes those of processes
that died; the dictionary's boards go with it when it leaves the host
(:func:`remove_boards`).  Only the owner writes its board, so no lock is
needed; a reader may see a total one update old.

The boards also say whom to ask for the room back.  A process that lends
values listens on a datagram socket of its own in the same directory
(``unpin-<pid>``, :func:`request_path`); when a write is refused room while
views pin its shard, the manager asks the processes whose boards show bytes
of that shard to copy them out (:func:`ask_release`; each answers with the
bytes it released, see :meth:`dask_ddict.transport.lending.Lender.release`), and
tries the write once more.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np

from .._blocking import will_block
from .._memory import map_file

_PREFIX = "pins-"
_REQUESTS = "unpin-"
_ANSWER = struct.Struct("<qq")  # pid, bytes released (-1: failed)


def board_path(socket_dir: str, uid: str, pid: int) -> str:
    return os.path.join(socket_dir, f"{_PREFIX}{uid}.{pid}")


class PinBoard:
    """This process's board for one dictionary on one host (created on first use).

    Parameters
    ----------
    socket_dir, uid
        The host's socket directory and the dictionary.
    managers
        How many managers the dictionary has (manager ids index the board).
    """

    def __init__(self, socket_dir: str, uid: str, managers: int) -> None:
        self.path = board_path(socket_dir, uid, os.getpid())
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = 8 * (1 + 2 * managers)
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self.words = map_file(fd, size).view(np.int64)  # (no descriptor kept)
        finally:
            os.close(fd)

    def __repr__(self) -> str:
        return f"<PinBoard {self.path!r} bytes={int(self.words[1::2].sum())}>"

    def add(self, mid: int, nbytes: int, views: int) -> None:
        """This process now holds ``nbytes`` more bytes in ``views`` more views of ``mid``."""
        w = self.words
        if 2 + 2 * mid < len(w):
            w[1 + 2 * mid] += nbytes
            w[2 + 2 * mid] += views
            w[0] += 1


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet reaped, does not: its
    views and snapshots ended with it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _boards(socket_dir: str, uid: str) -> Iterator[tuple[int, np.ndarray]]:
    """``(pid, words)`` of each live process's board of dictionary ``uid`` (the boards
    and request sockets of processes that ended are removed: their pins ended too)."""
    prefix = f"{_PREFIX}{uid}."
    try:
        names = [n for n in os.listdir(socket_dir) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        path = os.path.join(socket_dir, name)
        pid = name[len(prefix) :]
        if not pid.isdigit() or not alive(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(path)
            if pid.isdigit():
                with contextlib.suppress(OSError):
                    os.unlink(request_path(socket_dir, int(pid)))
            continue
        try:
            with open(path, "rb") as f:
                w = np.frombuffer(f.read(), dtype=np.int64)
        except OSError:
            continue
        if len(w):
            yield int(pid), w


def read_boards(socket_dir: str, uid: str, managers: int) -> tuple[int, np.ndarray, np.ndarray]:
    """``(changes, bytes, views)``: the boards' update counts summed, and the bytes
    and views per manager pinned by the live processes of this host."""
    changes = 0
    nbytes = np.zeros(managers, dtype=np.int64)
    views = np.zeros(managers, dtype=np.int64)
    for pid, w in _boards(socket_dir, uid):
        n = min(managers, (len(w) - 1) // 2)
        changes += int(w[0]) + pid * 7919  # (a board that goes away changes it too)
        nbytes[:n] += w[1 : 1 + 2 * n : 2]
        views[:n] += w[2 : 2 + 2 * n : 2]
    return changes, nbytes, views


def holders(socket_dir: str, uid: str, mid: int) -> dict[int, int]:
    """``{pid: bytes}`` of the live processes that pin manager ``mid``'s shard."""
    return {
        pid: int(w[1 + 2 * mid])
        for pid, w in _boards(socket_dir, uid)
        if 1 + 2 * mid < len(w) and w[1 + 2 * mid] > 0
    }


# -- release requests ------------------------------------------------------------------------


def request_path(socket_dir: str, pid: int) -> str:
    """Where process ``pid`` listens for release requests of this host's managers."""
    return os.path.join(socket_dir, f"{_REQUESTS}{pid}")


def encode_request(uid: str, mid: int) -> bytes:
    return f"{uid} {mid}".encode()


def decode_request(data: bytes) -> tuple[str, int]:
    uid, mid = data.decode().split()
    return uid, int(mid)


def encode_answer(pid: int, freed: int) -> bytes:
    return _ANSWER.pack(pid, freed)


_ASKS = 0
_ASKS_LOCK = threading.Lock()


def ask_release(
    socket_dir: str, uid: str, mid: int, pids: list[int], timeout: float
) -> tuple[int, list[int]]:
    """Ask processes ``pids`` to copy out the values they hold of manager ``mid``'s shard
    and wait for their answers, at most ``timeout`` seconds: ``(bytes released, pids that
    did not answer in time)``."""
    global _ASKS
    with _ASKS_LOCK:
        _ASKS += 1
        path = os.path.join(socket_dir, f"{_REQUESTS}ask.{os.getpid()}.{_ASKS}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    freed, waiting = 0, set()
    try:
        sock.bind(path)
        request = encode_request(uid, mid)
        for pid in pids:
            try:
                sock.sendto(request, request_path(socket_dir, pid))
                waiting.add(pid)
            except OSError:  # (it listens no more: it ended, and its pins with it)
                pass
        will_block()  # (a host's event loop moves on rather than wait here)
        deadline = time.monotonic() + timeout
        while waiting and (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                data = sock.recv(_ANSWER.size)
            except TimeoutError:
                break
            pid, n = _ANSWER.unpack(data)
            waiting.discard(pid)
            freed += max(n, 0)
    finally:
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
    return freed, sorted(waiting)


class BoardReader:
    """The host's view of one dictionary's boards, read at most once per ``memo`` seconds
    (a broadcast of ``stats`` asks for every manager of the host in a row)."""

    def __init__(self, socket_dir: str, uid: str, managers: int, memo: float = 0.001) -> None:
        self.socket_dir, self.uid, self.managers, self.memo = socket_dir, uid, managers, memo
        self._at = -1.0
        self._last: tuple[int, np.ndarray, np.ndarray] = (0, np.zeros(0), np.zeros(0))

    def __repr__(self) -> str:
        return f"<BoardReader {self.uid} in {self.socket_dir!r}>"

    def totals(self) -> tuple[int, np.ndarray, np.ndarray]:
        now = time.monotonic()
        if now - self._at > self.memo:
            self._last = read_boards(self.socket_dir, self.uid, self.managers)
            self._at = now
        return self._last

    def of(self, mid: int) -> tuple[int, int]:
        """``(bytes, views)`` pinned in manager ``mid``'s shard."""
        _, nbytes, views = self.totals()
        return (int(nbytes[mid]), int(views[mid])) if mid < len(nbytes) else (0, 0)

    def changes(self) -> int:
        """A number that moves whenever any board does (kept answers check it)."""
        return self.totals()[0]

    def release(self, mid: int, timeout: float) -> tuple[int, list[int]]:
        """:func:`ask_release` of every process that pins manager ``mid``'s shard."""
        pids = list(holders(self.socket_dir, self.uid, mid))
        self._at = -1.0  # (the boards change: read them again next time)
        return ask_release(self.socket_dir, self.uid, mid, pids, timeout) if pids else (0, [])


def remove_boards(socket_dir: str, uid: str) -> None:
    """Delete every board of a dictionary that left this host."""
    prefix = f"{_PREFIX}{uid}."
    with contextlib.suppress(OSError):
        for name in os.listdir(socket_dir):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(socket_dir, name))
