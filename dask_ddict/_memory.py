"""Shared mappings of shard files: giving back the pages a reader touched, and the
mappings of lent values (:class:`Lent`), which can be swapped for private copies.

A same-host reader maps a shard read-only.  Every page it reads stays in its
resident set (RSS) until it unmaps, although the data lives in the host's
shared memory and is owned by the shard: a task that reads 1 GiB through a
shard would look 1 GiB bigger to Dask's memory monitor, and be paused or
killed for it.  ``madvise(MADV_DONTNEED)`` on a read-only shared file mapping
only drops this process's page-table entries (the pages stay in the tmpfs,
and a later read maps them again), so a reader can give them back once it
has copied what it needs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

MADV_DONTNEED = 4
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value


def _check(addr: Any, what: str) -> int:
    """``addr`` from a libc call that returns an address, or the ``OSError`` it set."""
    if addr is None or addr == _MAP_FAILED:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return int(addr)


class _Mapping:
    """A shared mapping of (part of) a file that holds no descriptor of it.

    (Python's ``mmap`` keeps a duplicate of the file's descriptor for as long as the
    map lives, until 3.13's ``trackfd=False``: one descriptor per small shared file a
    process maps.)  NumPy arrays made from it keep it alive; the last one unmaps it.
    """

    def __init__(self, fd: int, nbytes: int, offset: int = 0, writable: bool = True) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self.addr = _check(_libc.mmap(None, nbytes, prot, mmap.MAP_SHARED, fd, offset), "mmap")
        self.nbytes = nbytes
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (self.addr, not writable),
            "version": 3,
        }

    def __del__(self) -> None:
        if hasattr(self, "addr"):  # (else its mmap failed: nothing to unmap)
            _libc.munmap(self.addr, self.nbytes)


def map_file(fd: int, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` of file ``fd``, mapped shared and writable, as bytes; ``fd``
    may be closed at once (the mapping needs no descriptor)."""
    return np.asarray(_Mapping(fd, nbytes))


#: Large values whose pages this process mapped since they were last given back (address
#: -> bytes; minus the bytes: counted by a part's read, not known mapped): read again,
#: they map nothing and count nothing (``transport/mapped.py``).
#: :func:`forget` drops those of a range whose pages were given back or unmapped (an
#: address may be mapped again later, to other pages).
MAPPED: dict[int, int] = {}


def forget(start: int, nbytes: int) -> None:
    """Drop the values of :data:`MAPPED` that start in ``[start, start + nbytes)``
    (its keys listed in one call first: another thread's read may add one meanwhile)."""
    for addr in [a for a in list(MAPPED) if start <= a < start + nbytes]:
        MAPPED.pop(addr, None)


def release(start: int, nbytes: int) -> None:
    """Drop this process's mapping of the pages covering ``[start, start + nbytes)``.

    Only for read-only shared mappings of files (the data stays in the file).
    """
    forget(start, max(nbytes, 1))
    if nbytes <= 0:
        return
    lo = start & ~(PAGE - 1)
    hi = (start + nbytes + PAGE - 1) & ~(PAGE - 1)
    _libc.madvise(lo, hi - lo, MADV_DONTNEED)


def _maps() -> Iterator[tuple[int, int, int, str]]:
    """``(start, end, file offset of start, path)`` of each of this process's mappings
    (from /proc/self/maps; ``path`` is empty for anonymous ones)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            yield lo, hi, int(fields[2], 16), fields[5].rstrip("\n") if len(fields) > 5 else ""


def mapping_of(path: str) -> tuple[int, int] | None:
    """``(start, end)`` of this process's largest mapping of file ``path`` from its start:
    an environment's own map, whose pieces (the kernel may split it) map the file at
    ``address - start``, not the smaller maps of lent values."""
    runs: dict[int, tuple[int, int]] = {}  # start address of the file -> (start, end)
    try:
        for lo, hi, offset, name in _maps():
            if not name.endswith(path):
                continue
            run = runs.get(lo - offset)
            if run is None:
                runs[lo - offset] = (lo, hi)
            elif run[1] == lo:  # (the next piece of the same map)
                runs[lo - offset] = (run[0], hi)
    except (OSError, ValueError, IndexError):
        return None
    whole = [run for base, run in runs.items() if run[0] == base]  # (from the file's start)
    return max(whole, key=lambda r: r[1] - r[0], default=None)


# -- lent mappings ---------------------------------------------------------------------------

_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mprotect.restype = ctypes.c_int
_libc.mremap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_void_p,
]
_libc.mremap.restype = ctypes.c_void_p
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2


class Lent(_Mapping):
    """A read-only mapping of part of a file, made for one lent value (see
    :mod:`dask_ddict.transport.lending`): the value's pages, mapped apart from the
    environment's own map so that they can be swapped for a private copy at the same
    addresses (:meth:`privatize`) without touching the environment's."""

    def __init__(self, fd: int, offset: int, nbytes: int) -> None:
        """Map ``nbytes`` of file ``fd`` from ``offset`` (both multiples of :data:`PAGE`)."""
        self.private = False
        #: Set once the last view is gone and the mapping is being unmapped: it is not to
        #: be privatized then (a weak reference still finds it while ``__del__`` runs).
        self.gone = False
        #: Called with :attr:`private` once the last view is gone, before the unmapping
        #: (the lender's count of what it lends: no finalizer object per value).
        self.on_gone: Callable[[bool], None] | None = None
        #: :meth:`privatize` against ``__del__``: exactly one of them counts the value
        #: off (``privatize`` releases the interpreter lock in its system calls, and
        #: ``__del__`` may begin in another thread before it says ``gone``).
        self._turn = threading.Lock()
        super().__init__(fd, nbytes, offset, writable=False)

    def __del__(self) -> None:
        with self._turn:  # (a privatize under way ends first: it never waits for us)
            self.gone = True
            private = self.private
        gone, self.on_gone = self.on_gone, None
        try:
            if gone is not None:
                gone(private)
        finally:
            super().__del__()

    def __repr__(self) -> str:
        return f"<Lent {self.nbytes} bytes at {self.addr:#x}{' (private)' if self.private else ''}>"

    def privatize(self) -> bool:
        """Swap the mapped pages for a private copy of them at the same addresses, in one
        step (``mremap``): a reader never sees the range unmapped or different, and the
        file's pages are no longer held by this mapping.  Whether it did so now (not: it
        was private already, or its last view is gone and it is being unmapped)."""
        with self._turn:
            if self.private or self.gone:
                return False
            self._privatize()
            self.private = True
            return True

    def forked(self) -> None:
        """In a forked child: this process's copy of the mapping made private now (the
        parent's snapshot, which keeps the file's pages unchanged, is the parent's), and
        its lender, the parent's, told nothing when its last view here is gone."""
        self._turn = threading.Lock()  # (another thread of the parent may have held it)
        self.on_gone = None  # (whether or not the copy is made: the count is not ours)
        self.privatize()

    def _privatize(self) -> None:
        rw = mmap.PROT_READ | mmap.PROT_WRITE
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        new = _check(_libc.mmap(None, self.nbytes, rw, flags, -1, 0), "mmap")
        try:
            ctypes.memmove(new, self.addr, self.nbytes)
            if _libc.mprotect(new, self.nbytes, mmap.PROT_READ):
                _check(None, "mprotect")
            _check(
                _libc.mremap(
                    new, self.nbytes, self.nbytes, MREMAP_MAYMOVE | MREMAP_FIXED, self.addr
                ),
                "mremap",
            )
        except BaseException:
            _libc.munmap(new, self.nbytes)
            raise


def file_span(addr: int) -> tuple[int, int, int, str] | None:
    """``(start, end, file offset of start, path)`` of this process's mapping that holds
    address ``addr``; ``None`` if it maps no file."""
    try:
        for span in _maps():
            if span[0] <= addr < span[1]:
                return span if span[3].startswith("/") else None
    except (OSError, ValueError, IndexError):
        pass
    return None
