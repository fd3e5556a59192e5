"""The per-key loops of the key path, in Python: the reference and the fallback.

Each function here is one loop that runs once per key of a ``get_many`` or of a
batch of puts, and nothing else: routing keys to managers (and framing a put's
value), grouping digests by manager, framing a many-key reply on the host and taking
it apart on the client, the host's cursor walk, decoding small values, packing a
batch's records and taking them apart, and writing them into a shard; and the host's
event loop for its plain requests (:class:`PlainServer`, :func:`poll_and_serve`), which
runs once per request.  :mod:`._compiled` has the same functions, typed, in C (Cython);
:mod:`dask_ddict.kernels` chooses one.  Both must give the same results and raise the
same errors for every input (``tests/test_kernels.py`` fuzzes them side by side;
``tests/test_plain_server.py`` compares the plain servers with the manager's path), so
every rule lives here, readable, and the compiled module is only a faster spelling of it.
"""

from __future__ import annotations

import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar, cast

import numpy as np

from .._entry import BE, DIGEST, ENTRY, ENTRY_HEADER, MAXQ, TOMBSTONE, Entry, new_entry
from .._hashing import manager_for_digest
from .._keys import encode_key
from .._serialize import _HEAD as _HEAD_STRUCT  # (a value frame's head)
from .._serialize import (
    ALIGN,  # (a many-key reply's frames start at multiples of it)
    FMT_BYTES,
    SMALL_FRAME,
    frame_parts,
    raw_range,
)

#: Frame lengths in a many-key reply that are not frames: an absent key, and one
#: whose reader must wait (``wait_for_keys``: the client then asks for it alone).
ABSENT, WAIT = -1, -2

T = TypeVar("T")

JOIN = 16 * 1024  # a many-key reply's frames under this are copied into one part

_U32 = struct.Struct("<I")

#: The padding after ``n`` bytes, by ``n % ALIGN``.
PADS = [bytes(-i % ALIGN) for i in range(ALIGN)]


#: The longest pickled key whose route a :class:`Router` keeps.
CACHED_KEY_BYTES = 128


class KeyTooLong(ValueError):
    """A key's serialized bytes are over the dictionary's limit (``args[0]``: them)."""


class Decoded(list):
    """One manager's answer to a many-key read as values, decoded inside the snapshot that
    read them (a same-host reader's: :func:`lookup_values`), its absent keys already the
    reader's marker: :func:`decode_frames` takes them as they are.  A plain list of the
    same answer holds frames (a host's answer over a socket)."""

    __slots__ = ()


def route(
    keys: list[Any],
    n: int,
    most: int,
    encode: Callable[[Any], bytes],
    placed: Callable[[Any, bytes, int], int] | None,
    plain: frozenset[Any],
    digest: Callable[[bytes], bytes],
) -> list[tuple[int, bytes]]:
    """``(manager, digest)`` of each key among ``n`` managers.

    ``encode`` gives a key's bytes and ``digest`` their 16-byte digest; the first 8
    bytes of the digest (little-endian) modulo ``n`` choose the manager, except for
    a key whose type is not in ``plain``, which ``placed(key, digest, n)`` places
    (a user ``__hash__``).  ``placed`` ``None``: every key goes by its digest.

    Raises
    ------
    KeyTooLong
        A key's bytes are longer than ``most``.
    """
    out = []
    for key in keys:
        kb = encode(key)
        if len(kb) > most:
            raise KeyTooLong(kb)
        d = digest(kb)
        if placed is None or type(key) in plain:
            out.append((manager_for_digest(d, n), d))
        else:
            out.append((placed(key, d, n), d))
    return out


class Router:
    """:func:`route` with its rule bound once (a handle's own): ``one(key)`` is ``(manager,
    digest, key bytes)`` for single keys and batch puts, ``many(keys)`` is :func:`route`.

    ``many`` keeps the routes of up to ``cached`` keys that are ``str`` or ``int`` (of
    at most :data:`CACHED_KEY_BYTES` pickled, under the default key pickler), and forgets
    them all when full: a ``get_many`` of keys routed before then skips their pickling
    and BLAKE2b, half of its time on the client.  A route depends only on the key,
    the pickler and the number of managers, all fixed for a router; ``str`` and ``int``
    keys are immutable and compare equal only to keys that pickle alike (``True``,
    ``1.0`` and ``str`` subclasses are never cached, so never confused with them)."""

    __slots__ = ("n", "most", "encode", "placed", "plain", "digest", "cached", "_routes")

    def __init__(
        self,
        n: int,
        most: int,
        encode: Callable[[Any], bytes],
        placed: Callable[[Any, bytes, int], int] | None,
        plain: frozenset[Any],
        digest: Callable[[bytes], bytes],
        cached: int = 0,
    ) -> None:
        self.n, self.most, self.encode, self.placed = n, most, encode, placed
        self.plain, self.digest = plain, digest
        self.cached = cached if encode is encode_key else 0
        self._routes: dict[Any, tuple[int, bytes]] = {}

    def __repr__(self) -> str:
        return f"<Router managers={self.n} most={self.most}>"

    def many(self, keys: list[Any]) -> list[tuple[int, bytes]]:
        """:func:`route` of ``keys``, through the routes kept (see the class)."""
        if not self.cached:
            return route(keys, self.n, self.most, self.encode, self.placed, self.plain, self.digest)
        routes, out = self._routes, []
        for key in keys:
            t = type(key)
            cacheable = (t is str or t is int) and (self.placed is None or t in self.plain)
            got = routes.get(key) if cacheable else None
            if got is None:
                mid, d, kb = self.one(key)
                got = (mid, d)
                if cacheable and len(kb) <= CACHED_KEY_BYTES:
                    if len(routes) >= self.cached:
                        routes.clear()
                    routes[key] = got
            out.append(got)
        return out

    def one(self, key: Any) -> tuple[int, bytes, bytes]:
        """``(manager, digest, key bytes)`` of ``key``, as :func:`route` gives the first two
        (and raises what it raises)."""
        kb = self.encode(key)
        if len(kb) > self.most:
            raise KeyTooLong(kb)
        d = self.digest(kb)
        if self.placed is None or type(key) in self.plain:
            return manager_for_digest(d, self.n), d, kb
        return self.placed(key, d, self.n), d, kb

    def record(
        self,
        key: Any,
        value: Any,
        dumps: Callable[[Any], Any],
    ) -> tuple[int, bytes, bytes, Any]:
        """A put's ``(manager, digest, key bytes, value frame)``: :meth:`one` and
        :meth:`framed`."""
        mid, d, kb = self.one(key)
        return mid, d, kb, self.framed(value, dumps)

    def framed(self, value: Any, dumps: Callable[[Any], Any]) -> Any:
        """``dumps(value)``: a put's value frame (the compiled set frames a ``bytes`` value
        itself when ``dumps`` is :func:`~dask_ddict._serialize.dumps_value`, exactly as it
        would); for a lane that routed the key already."""
        return dumps(value)


def group(routes: list[tuple[int, bytes]]) -> dict[int, list[bytes]]:
    """The digests of ``routes`` by manager, each manager's in their order."""
    groups: dict[int, list[bytes]] = {}
    for mid, digest in routes:
        groups.setdefault(mid, []).append(digest)
    return groups


def group_positions(routes: list[tuple[int, bytes]]) -> dict[int, tuple[list[bytes], bytes]]:
    """:func:`group`, and where each digest's key is in ``routes``: by manager, its
    digests and their indices (``u32`` each, little-endian) in order, which
    :func:`place_values` writes a manager's values at."""
    groups: dict[int, tuple[list[bytes], list[int]]] = {}
    for i, (mid, digest) in enumerate(routes):
        g = groups.setdefault(mid, ([], []))
        g[0].append(digest)
        g[1].append(i)
    return {m: (d, struct.pack(f"<{len(p)}I", *p)) for m, (d, p) in groups.items()}


def marked(values: list[Any], absent: Any) -> list[int]:
    """The indices of the ``absent`` values (those ``get_many`` looks at again)."""
    return [i for i, v in enumerate(values) if v is absent]


#: A many-key read's table (``GetMany``): a ``u32`` count of groups, then this per group
#: (manager, keys); every group's 16-byte digests follow, in order.
GROUP = struct.Struct("<II")


def group_table(groups: Sequence[tuple[int, Sequence[bytes]]]) -> bytes:
    """The table of a many-key read's request for ``groups`` (its digests follow it)."""
    return _U32.pack(len(groups)) + b"".join(GROUP.pack(mid, len(d)) for mid, d in groups)


def digest_groups(value: Any) -> list[tuple[int, list[bytes]]]:
    """The ``(manager, digests)`` groups of a many-key read's request (see :data:`GROUP`).

    Raises
    ------
    ValueError
        The request ends inside its table or its digests, or goes on after them.
    """
    raw = value if type(value) is bytes else memoryview(value).cast("B").tobytes()
    end = len(raw)
    if end < 4:
        raise ValueError(f"a many-key request of {end} bytes has no table")
    (n,) = _U32.unpack_from(raw, 0)
    off = 4 + GROUP.size * n
    if off > end:
        raise ValueError(f"a many-key request of {end} bytes cannot hold {n} groups")
    out = []
    for i in range(n):
        mid, count = GROUP.unpack_from(raw, 4 + GROUP.size * i)
        stop = off + DIGEST * count
        if stop > end:
            raise ValueError(f"a many-key request of {end} bytes ends inside its digests")
        out.append((mid, [raw[j : j + DIGEST] for j in range(off, stop, DIGEST)]))
        off = stop
    if off != end:
        raise ValueError(f"a many-key request of {end} bytes goes on after its digests")
    return out


def pack_frames(frames: list[Any]) -> list[Any]:
    """A many-key reply's parts for ``frames`` (buffers; ``None`` absent, ``False`` wait)::

        <u32 n> <i64 length> * n  [pad]  (frame [pad]) * n

    Frames under :data:`JOIN` bytes are copied, with the table and the padding around
    them, into one part (a thousand small values: one buffer to send, not two thousand);
    a larger frame is a part of its own, sent from where it is (the shard's pages).
    """
    lens = [
        f.nbytes
        if type(f) is memoryview
        else ABSENT
        if f is None
        else WAIT
        if f is False
        else memoryview(f).nbytes
        for f in frames
    ]
    head = _U32.pack(len(lens)) + struct.pack(f"<{len(lens)}q", *lens)
    parts: list[Any] = []
    run: list[Any] = [head, PADS[len(head) % ALIGN]]
    for f, ln in zip(frames, lens):
        if ln < 0:
            continue
        if ln < JOIN:
            run += (f, PADS[ln % ALIGN])
            continue
        parts += (b"".join(run), f)
        run = [PADS[ln % ALIGN]]
    last = b"".join(run)
    if last:
        parts.append(last)
    return parts


def unpack_frames(payload: Any, small: int = 0) -> list[Any]:
    """The frames of a many-key reply (views of ``payload``; ``None`` absent, ``False``
    wait); a frame shorter than ``small`` bytes is a copy (``bytes``: cheaper than a view
    of it, and not one more object for the garbage collector to track).

    Raises
    ------
    ValueError
        The payload is shorter than its table says.
    """
    mv = memoryview(payload).cast("B")
    if mv.nbytes < 4:
        raise ValueError(f"a many-key reply of {mv.nbytes} bytes has no table")
    (n,) = _U32.unpack_from(mv, 0)
    if 4 + 8 * n > mv.nbytes:
        raise ValueError(f"a many-key reply of {mv.nbytes} bytes cannot hold {n} lengths")
    lens = struct.unpack_from(f"<{n}q", mv, 4)
    off = 4 + 8 * n
    off += -off % ALIGN
    out: list[Any] = []
    for ln in lens:
        if ln < 0:
            out.append(None if ln == ABSENT else False)
            continue
        if off + ln > mv.nbytes:
            raise ValueError(f"a many-key reply of {mv.nbytes} bytes ends inside a frame")
        out.append(mv[off : off + ln].tobytes() if ln < small else mv[off : off + ln])
        off += ln + (-ln % ALIGN)
    return out


def unpack_values(
    payload: Any, counts: list[int], small: int, absent: Any, decode: Callable[[Any], Any]
) -> list[Decoded] | None:
    """The values of a many-key reply, decoded where they were received: one
    :class:`Decoded` per group of ``counts`` keys (a request's managers, in order),
    ``absent`` for an absent key; ``None`` if a reader must wait for any (the caller then
    takes the frames apart, :func:`unpack_frames`, and asks for those alone).

    ``decode`` is the value frames' own decoder (a reader that gave its ``absent``
    marker: see :class:`~dask_ddict.transport.many_key_ops.GetMany`); a frame under
    ``small`` bytes is decoded from a copy (the compiled kernel decodes ``bytes`` and a
    pickle without out-of-band buffers where the frame lies, as :func:`decode_frames`
    does), a larger one from its view of ``payload``.  One pass instead of two
    (:func:`unpack_frames`, then :func:`decode_values` frame by frame): a ``get_many``
    over a socket, which decodes what it receives anyway.

    Raises
    ------
    ValueError
        The payload is shorter than its table says (:func:`unpack_frames`), or holds
        another number of frames than ``counts`` adds up to.
    """
    frames = unpack_frames(payload, small)
    if len(frames) != sum(counts):
        raise ValueError(f"a many-key reply has {len(frames)} frames for {sum(counts)} keys")
    if any(f is False for f in frames):
        return None
    out, at = [], 0
    for n in counts:
        out.append(Decoded(absent if f is None else decode(f) for f in frames[at : at + n]))
        at += n
    return out


#: Puts of frames up to this size may be committed by a same-host client itself.
DIRECT_PUT_MAX = 64 << 10
#: A value at least this big, sought to be read whole, is read by lmdb's own cursor,
#: which touches its pages with the interpreter lock released (py-lmdb's ``preload``): a
#: copying read of a large value relies on that (docs/design/kernels.md, "A cold large
#: read on the same host"); one sought without (``whole=False``) has its pages touched
#: by :func:`touch_pages` before it is copied whole.
PRELOADED = 64 << 10
#: The stride of :func:`touch_pages` (py-lmdb's preload reads a byte every 4 KiB).
TOUCH_STRIDE = 4096


def disown_transactions(env: Any) -> bool:
    """Let go of every transaction of py-lmdb's environment ``env`` without ending it,
    so that closing ``env`` ends none: what a forked child does with an environment its
    parent opened (:mod:`dask_ddict._forking`; its reader slots are the parent's, shared
    memory, and ending a transaction frees its slot).  Whether it did so: not here, where
    py-lmdb's objects are reached only through its Python API, which ends what it lets go.
    """
    return False


#: What a :class:`DirectCommit` came to: committed; left to its caller (nothing of it
#: written); or queued by the process this one was forked from (committed there).
COMMITTED, LEFT, FORKED = 0, 1, 2


class DirectCommit:
    """One flush of a same-host batch's records committed into its shard behind the
    client's thread, by a C thread that never takes the interpreter lock, or a
    same-host put's records committed now in one C call (the compiled set's; see
    ``commit_behind.pxi``).  Here no commit is ever queued or made: :meth:`start` and
    :meth:`commit` say so, and the caller commits the records itself, as the compiled
    set's caller does with any commit left to it: one set of rules, the caller's."""

    def start(
        self,
        env: Any,
        data_db: Any,
        meta_db: Any,
        records: list[Record],
        chkpt: int,
        owner: bytes,
        limit: float,
        psize: int,
        words: Any = None,
        mid: int = 0,
    ) -> bool:
        """Whether the commit of ``records`` was queued: never, here."""
        return False

    def commit(self, *args: Any) -> int:
        """:meth:`start`'s commit (the same arguments) made now: :data:`LEFT` here
        (nothing written: the caller commits them by the same rules in Python)."""
        return LEFT

    def done(self) -> bool:
        """Whether :meth:`wait` would return at once: always, here."""
        return True

    def wait(self) -> int:
        """What the commit came to: :data:`LEFT`, as it was never queued."""
        return LEFT


def commits_behind() -> tuple[int, int]:
    """How many commits this process's commit thread committed, and left: none here."""
    return 0, 0


def commits_behind_forked() -> None:
    """(A forked child's hook: the compiled set forgets its parent's commit thread.)"""


def lookup_entry(txn: Any, db: Any, digest: bytes, chkpt: int, whole: bool = True) -> Entry | None:
    """The newest version of ``digest`` at or before checkpoint ``chkpt`` (an
    :class:`~dask_ddict._entry.Entry` of views of the cursor's key and value), or
    ``None``: a single-key read's seek, on a cursor of database ``db`` (the shard's
    data table) in transaction ``txn``.

    ``whole``: the reader reads all of a large value (of ``PRELOADED`` bytes or more),
    whose pages are then touched here with the interpreter lock released (py-lmdb's
    preload); else it reads a part (a byte range), and the compiled kernel touches none
    of them.  Here py-lmdb preloads every value it hands out, either way.

    A data key is the digest, then the checkpoint's big-endian complement
    (:func:`~dask_ddict._entry.data_key`): the first key at or after
    ``digest + complement`` with the same digest is the newest version ``chkpt`` sees.
    """
    cursor = txn.cursor(db)
    if not cursor.set_range(digest + BE.pack(MAXQ - chkpt)):
        return None
    k, raw = cursor.item()
    if k[:DIGEST] != digest:
        return None
    flags, klen, flen = ENTRY.unpack_from(raw, 0)
    end = ENTRY_HEADER + flen
    return new_entry(
        Entry,
        (MAXQ - BE.unpack_from(k, DIGEST)[0], flags, raw[ENTRY_HEADER:end], raw[end : end + klen]),
    )


def touch_pages(frame: Any) -> None:
    """Read a byte of every page of ``frame`` (a buffer; a large value's frame sought
    with ``lookup_entry(..., whole=False)``), as py-lmdb's ``preload`` does: the value's
    page faults are then taken here, with the interpreter lock released, rather than in
    the copy that follows, which holds it.  The caller keeps the buffer's mapping open
    throughout (its snapshot and its shard's view).  Here the lock is held: the pure set
    only reads the bytes (and its seeks preload every value they hand out anyway)."""
    view = _bytes_of(frame, "touch_pages")
    if view.nbytes:
        view[::TOUCH_STRIDE].tobytes()
        view[-1]


def address_of(buf: Any) -> int:
    """The start address of a C-contiguous buffer (a read-only one too: a value's frame
    in a shard's map), as an ``int``; ``BufferError`` for any other buffer."""
    view = _bytes_of(buf, "address_of")
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


def _bytes_of(buf: Any, caller: str) -> memoryview:
    """``buf``'s bytes, if it is a C-contiguous buffer (``BufferError`` naming
    ``caller`` if not; ``TypeError`` if it is no buffer)."""
    view = memoryview(buf)
    if not view.c_contiguous:
        raise BufferError(f"{caller}: the buffer is not C-contiguous")
    return view.cast("B")


def decoded(frame: Any, decode: Callable[[Any], Any]) -> Any:
    """``decode(frame)``: one value's frame, decoded by the value frames' own decoder
    (:func:`~dask_ddict._serialize.loads_value` without a custom pickler).  The compiled
    kernel decodes the common frames itself, as :func:`decode_frames` does."""
    return decode(frame)


def lookup_frames(
    txn: Any, db: Any, digests: list[bytes], tail: bytes, small: int = 0
) -> list[Any]:
    """The frames of the newest versions of ``digests`` at or before a checkpoint, in
    database ``db`` of transaction ``txn``, with one LMDB cursor (``None`` for an absent
    key or a deletion).

    A data key is ``digest + tail``-ordered: ``tail`` is the checkpoint's big-endian
    complement, so the first key at or after ``digest + tail`` with the same digest
    is the newest version the checkpoint sees.  A frame under ``small`` bytes comes
    as a copy (``bytes``: a same-host reader's copy of a small value, made here
    rather than in a loop of its own), a larger one as the cursor gives it (a view
    of the shard's page inside a ``buffers`` transaction).
    """
    cursor = txn.cursor(db)
    seek, key, value, unpack = cursor.set_range, cursor.key, cursor.value, ENTRY.unpack_from
    out: list[Any] = []
    for d in digests:
        if not seek(d + tail) or key()[:DIGEST] != d:
            out.append(None)
            continue
        raw = value()
        flags, _, n = unpack(raw, 0)
        if flags & TOMBSTONE:
            out.append(None)
            continue
        frame = raw[ENTRY_HEADER : ENTRY_HEADER + n]
        out.append(bytes(frame) if n < small else frame)
    return out


def taken_out(frames: list[Any], out: Callable[[Any], Any]) -> tuple[list[Any], int, int]:
    """``frames`` with each view given to ``out`` (copied, or lent: a same-host reader's
    frames from :func:`lookup_frames`), and the bytes and number of those that came as
    copies already (``bytes``)."""
    taken: list[Any] = []
    nbytes = copies = 0
    for f in frames:
        if type(f) is memoryview:
            f = out(f)
        elif type(f) is bytes:
            nbytes += len(f)
            copies += 1
        taken.append(f)
    return taken, nbytes, copies


def lookup_values(
    txn: Any,
    db: Any,
    digests: list[bytes],
    tail: bytes,
    small: int,
    absent: Any,
    take: Callable[[Any], Any],
    decode: Callable[[Any], Any],
) -> tuple[Decoded, int, int]:
    """The values of ``digests`` (:func:`lookup_frames`' walk), decoded in transaction
    ``txn``: ``absent`` for an absent key or a deletion; a frame under ``small`` bytes
    decoded from a copy by ``decode`` (the value frames' own decoder: the compiled kernel
    decodes ``bytes`` and a pickle without out-of-band buffers where the frame lies, as
    :func:`decode_frames` does), a larger one ``decode(take(frame))`` (``take``: the
    reader's copy out of the shard, as :func:`taken_out` gives it).  Also the bytes and
    the number of the frames copied here (:func:`taken_out`'s count of them).

    One pass instead of three (the walk's copies, :func:`taken_out`, :func:`decode_frames`):
    a same-host ``get_many``, which decodes what it reads anyway."""
    out = Decoded()
    nbytes = copies = 0
    for f in lookup_frames(txn, db, digests, tail, small):
        if f is None:
            out.append(absent)
        elif type(f) is bytes:
            nbytes += len(f)
            copies += 1
            out.append(decode(f))
        else:
            out.append(decode(take(f)))
    return out, nbytes, copies


def place_values(
    txn: Any,
    db: Any,
    digests: list[bytes],
    positions: bytes,
    out: list[Any],
    tail: bytes,
    small: int,
    absent: Any,
    take: Callable[[Any], Any],
    decode: Callable[[Any], Any],
) -> tuple[int, int]:
    """:func:`lookup_values` written into ``out``: the value of ``digests[j]`` at
    ``out[positions[j]]`` (``positions``: :func:`group_positions`' indices), so that a
    same-host ``get_many`` puts every manager's values in the keys' order as it reads
    them, without a list per manager to take apart.  Returns the bytes and the number of
    the frames copied.

    Raises
    ------
    ValueError
        ``positions`` is not one index per digest, each within ``out``; nothing written.
    """
    n = len(digests)
    if len(positions) != 4 * n:
        raise ValueError(f"{len(positions)} bytes of positions for {n} digests")
    at = struct.unpack(f"<{n}I", positions)
    if n and max(at) >= len(out):
        raise ValueError(f"a position beyond the {len(out)} values")
    values, nbytes, copies = lookup_values(txn, db, digests, tail, small, absent, take, decode)
    for i, v in zip(at, values, strict=True):
        out[i] = v
    return nbytes, copies


def decode_frames(
    keys: list[Any],
    routes: list[tuple[int, bytes]],
    got: dict[int, list[Any]],
    decode: Callable[[Any], Any],
    absent: Any,
    wait: Any,
    small: bool,
) -> list[tuple[Any, Any]]:
    """``(key, value)`` for each key, its frame taken in turn from its manager's (the
    first of its ``(manager, digest)`` route) frames in ``got``: ``absent`` for
    ``None``, ``wait`` for ``False``, else ``decode(frame)``.

    A manager's :class:`Decoded` answer holds values already: taken as they are.

    ``small``: ``decode`` is the value frames' own decoder
    (:func:`~dask_ddict._serialize.loads_value` without a custom pickler), which the
    compiled kernel does itself for the common frames, ``bytes`` and a pickle without
    out-of-band buffers (the same copy, the same ``pickle.loads``; any other frame, or
    an error, goes to ``decode``, which raises what it raises here).
    """
    frames = {mid: iter(fs) for mid, fs in got.items()}
    values = {mid for mid, fs in got.items() if type(fs) is Decoded}
    out: list[tuple[Any, Any]] = []
    for key, route in zip(keys, routes):
        frame = next(frames[route[0]])
        if route[0] in values:  # (decoded where it was read)
            out.append((key, frame))
            continue
        out.append((key, absent if frame is None else wait if frame is False else decode(frame)))
    return out


def decode_values(
    routes: list[tuple[int, bytes]],
    got: dict[int, list[Any]],
    decode: Callable[[Any], Any],
    absent: Any,
    wait: Any,
    small: bool,
) -> tuple[list[Any], list[int]]:
    """:func:`decode_frames` without the pairs: each key's value (in the order of
    ``routes``: ``absent``, ``wait``, or decoded as :func:`decode_frames` decodes it),
    and the indices of those that are ``absent`` or ``wait`` (the few that ``get_many``,
    whose keys are its caller's, must look at again)."""
    pairs = decode_frames(list(range(len(routes))), routes, got, decode, absent, wait, small)
    values = [v for _, v in pairs]
    return values, [i for i, v in enumerate(values) if v is absent or v is wait]


Record = tuple[bytes, bytes, Any]  # (digest, key bytes, frame): a put of a batch

#: A batch or many-put request's record on the wire: ``(16 + key length, manager, frame
#: length)``, then the digest, the key and the frame (part of the protocol's version).
BATCH_RECORD = struct.Struct("<IIQ")
_UNEVEN = "a record's frame parts are not the bytes its frame says"


def pack_records(records: list[tuple[int, bytes, bytes, Any]]) -> tuple[list[Any], int]:
    """The parts of a request of ``(manager, digest, key, frame)`` records, and their size.

    The headers, digests, keys and frames under :data:`JOIN` bytes are copied into
    runs, one part each (a thousand small puts: one buffer to send, not three thousand);
    a larger frame's parts are sent from where they are.
    """
    parts: list[Any] = []
    run: list[Any] = []
    total = 0
    for mid, digest, kb, frame in records:
        fparts, n = frame_parts(frame)
        run += (BATCH_RECORD.pack(len(digest) + len(kb), mid, n), digest, kb)
        total += BATCH_RECORD.size + len(digest) + len(kb) + n
        if n < JOIN:
            run += fparts
            continue
        parts.append(b"".join(run))
        parts += fparts
        run = []
    if run:
        parts.append(b"".join(run))
    if sum(memoryview(p).nbytes for p in parts) != total:
        raise ValueError(_UNEVEN)
    return parts, total


def unpack_records(value: Any) -> dict[int, list[Record]]:
    """The ``(digest, key, frame)`` records of a request by manager, in message order:
    frames under :data:`JOIN` bytes as copies (``bytes``), larger ones as views of
    ``value``.

    Raises
    ------
    ValueError
        The request ends inside a record, or a record's key section is shorter than a
        digest.
    """
    mv = memoryview(value).cast("B")
    by_mid: dict[int, list[Record]] = {}
    off, end, head = 0, mv.nbytes, BATCH_RECORD.size
    while off < end:
        if off + head > end:
            raise ValueError(f"a request of {end} bytes ends inside a record's header")
        klen, mid, vlen = BATCH_RECORD.unpack_from(mv, off)
        off += head
        if klen < DIGEST or off + klen + vlen > end:
            raise ValueError(
                f"a request of {end} bytes ends inside a record (or its key "
                f"section of {klen} bytes has no digest)"
            )
        keysec = bytes(mv[off : off + klen])
        off += klen
        frame = mv[off : off + vlen]
        by_mid.setdefault(mid, []).append(
            (keysec[:DIGEST], keysec[DIGEST:], bytes(frame) if vlen < JOIN else frame)
        )
        off += vlen
    return by_mid


def leading_within(records: list[Record], most: int) -> int:
    """How many of the first ``records`` have frames of at most ``most`` bytes."""
    n = 0
    for r in records:
        if frame_parts(r[2])[1] > most:
            break
        n += 1
    return n


def entries_bytes(records: list[Record]) -> int:
    """The bytes of ``records``' frames and keys (a batch's room is checked once)."""
    return sum(frame_parts(r[2])[1] + len(r[1]) for r in records)


def put_entries(
    txn: Any,
    db: Any,
    records: list[Record],
    start: int,
    tail: bytes,
    flags: int,
    most: int,
    full: type[Exception],
) -> tuple[int, int, Exception | None]:
    """Put ``records[start:]`` in order, each as its key's version under ``digest +
    tail`` with ``flags``, over its older versions, which are deleted (a window of one
    checkpoint: no reader sees them, as ``ShardStore.put_over`` does one), in database
    ``db`` of write transaction ``txn``: one LMDB ``replace`` per record, and a step of
    one cursor for a key new at the checkpoint.

    Returns ``(i, delta, error)``: ``records[start:i]`` were put, and the number of
    keys seen changed by ``delta``.  ``error`` is the ``full`` error (LMDB's
    ``MapFullError``, passed in: importing the package loads no LMDB) that refused
    ``records[i]`` (nothing of it was written), or ``None``: then
    ``records[i]``, if any, has an entry of ``most`` bytes or more, which the caller
    puts itself (a large value is gathered without a copy of its own).
    """
    cursor = txn.cursor(db)
    replace, step, key, value, delete = (
        cursor.replace,
        cursor.next,
        cursor.key,
        cursor.value,
        cursor.delete,
    )
    dead, delta = bool(flags & TOMBSTONE), 0
    for i in range(start, len(records)):
        r = records[i]
        digest, kb, frame = r[0], r[1], r[2]
        parts, nbytes = frame_parts(frame)
        if ENTRY_HEADER + nbytes + len(kb) >= most:
            return i, delta, None
        entry = b"".join((ENTRY.pack(flags, len(kb), nbytes), *parts, kb))
        if len(entry) != ENTRY_HEADER + nbytes + len(kb):
            raise ValueError(_UNEVEN)
        try:
            old = replace(digest + tail, entry)
            if old is not None:
                live = not old[0] & TOMBSTONE
            else:  # new at this checkpoint: its older versions follow it, the newest first
                live = False
                if step() and key()[:DIGEST] == digest:
                    live = not value()[0] & TOMBSTONE
                    while delete() and key()[:DIGEST] == digest:
                        pass
        except full as e:  # (the transaction is then only to abort)
            return i, delta, e
        if live == dead:  # (seen before xor after: one key more or less)
            delta += -1 if live else 1
    return len(records), delta, None


#: A request's header on the wire: operation, flags, the manager's term as the client
#: knows it (:func:`~dask_ddict.transport.protocol.wire_term`; 0: none), key section
#: length, manager, tag, checkpoint, argument, client, timeout, value length and request
#: id (part of the protocol's version; :data:`~dask_ddict.transport.protocol.REQ` is this).
REQUEST = struct.Struct("<BBHIIIqqQdQQ")
_DONTWAIT = socket.MSG_DONTWAIT


def receive_nowait(reader: Any) -> int:
    """What a host's connection sent, received into its reader's buffer without waiting
    (the event loop's read: :meth:`~dask_ddict.transport.protocol.Reader.fill_nowait`,
    whose rules this keeps); the bytes received, 0 if none were ready.  Raises
    ``ConnectionResetError`` at the end of the stream."""
    return int(reader.fill_nowait())


def take_request(most_value: int, cls: Any, reader: Any, tag: list[int]) -> Any:
    """The next request whole in ``reader``'s buffer, taken out of it: a ``cls`` (a
    :class:`~dask_ddict.transport.operation.Request`) of the header's fields, its
    digest (the key section's first 16 bytes) and key (the rest) and its value copied
    out, its timeout ``None`` when negative; its tag goes to ``tag[0]`` (its reply's).

    With nothing taken, an ``int``: the bytes the request needs (its header's while
    that is not whole), when fewer are buffered or its value is over ``most_value``
    bytes (the caller receives that one into a buffer of its own).  What a host does
    once per request (the event loop's), in one call.
    """
    head = reader.peek(REQUEST)
    if head is None:
        return REQUEST.size
    op, flags, term, klen, mid, tagged, chkpt, arg, client, timeout, vlen, rid = head
    need = REQUEST.size + klen + vlen
    if vlen > most_value or reader.buffered() < need:
        return need
    reader.unpack(REQUEST)
    keysec = reader.take(klen)
    value = reader.take(vlen)
    tag[0] = tagged
    return tuple.__new__(
        cls,
        (
            op,
            flags,
            mid,
            chkpt,
            arg,
            client,
            None if timeout < 0 else timeout,
            keysec[:DIGEST],
            keysec[DIGEST:],
            value,
            rid,
            term,
        ),
    )


def send_reply(sock: Any, tag: int, ival: int, payload: Any, small: int) -> Any:
    """A reply with a payload of at most ``small`` bytes (``bytes``, or a contiguous
    ``memoryview``), its header and payload in one ``send`` that does not wait:
    ``None`` when the socket took all of it, else what it did not take (a view; the
    caller sends it, waiting).  ``NotImplemented`` for any other payload, which the
    caller sends its own way.  Raises the socket's ``OSError`` when it broke."""
    t = type(payload)
    if t is bytes:
        n = len(payload)
    elif t is memoryview and payload.c_contiguous:
        n = payload.nbytes
    else:
        return NotImplemented
    if n > small:
        return NotImplemented
    data = REPLY.pack(0, tag, ival, n) + payload
    try:
        sent = sock.send(data, _DONTWAIT)
    except BlockingIOError:
        sent = 0
    return None if sent == len(data) else memoryview(data)[sent:]


#: A reply's header on the wire: status, the request's tag, the integer answer and the
#: payload's length (part of the protocol's version; :data:`~dask_ddict.transport.
#: protocol.REP` is this).
REPLY = struct.Struct("<BxxxIqQ")

#: A ranged read's bounds in its key section, after the digest (``ops.GetRange``'s,
#: declared with the kernel that reads it; signed: a Python slice's, bounds beyond 64
#: bits clamped, which cuts no value shorter than that).
SPAN = struct.Struct("<qq")

#: The replies a shard keeps of at-most-once requests (``shard.replies``, whose layout is
#: declared here with the kernel that writes it too): in its meta table, ``RID`` and the
#: request id (``<Q``, as ``RID_ID`` packs it) -> the reply; a ring of ``RID_KEEP``
#: slots, ``RID_SLOT`` and the slot's number -> the request id kept there, the next
#: slot's number under ``RID_SEQ``; a reply over ``BIG_REPLY`` bytes kept only until
#: its client read it.
RID, RID_SLOT, RID_SEQ, RID_KEEP, BIG_REPLY = b"rid:", b"ridslot:", b"ridseq", 4096, 4096
RID_ID = struct.Struct("<Q")
#: The shard's marks that a same-host client's commit reads (``shard.reader_marks`` and
#: ``shard.direct`` write them; declared here with the kernel that reads them too): its
#: newest checkpoint and closed mark (``<qB``), frozen (``b"\x01"``), operations waiting
#: at the manager (``<q``), the host process that serves it; and a window of one's key
#: counts (``shard.key_counts``: ``<qqq``, newest, then the keys seen at it and beyond).
NEWEST, FROZEN, WAITERS, OWNER, COUNTS = b"newest", b"frozen", b"waiters", b"owner", b"counts"
#: What :func:`receive_reply` gives when a wait of ``wait`` seconds went by with no reply.
QUIET = -1


def receive_reply(
    sock: Any, buf: bytearray, got: int, wait: float | None, small: int
) -> tuple[int, int, int, bytes | None, int]:
    """Receive the reply to the one request in flight on ``sock`` into ``buf``.

    ``buf`` holds ``got`` bytes of it already.  Returns ``(status, ival, plen,
    payload, got)`` once the header is in, and, for a payload under ``small`` bytes
    that fits ``buf``, the payload too (a copy); else ``payload`` is ``None`` and the
    caller receives the rest (``buf[REPLY.size:got]`` is its start).  A client asks one
    request at a time on a connection, so nothing after the reply is ever received.

    ``wait`` is the socket's timeout (``None``: a blocking socket): when it goes by
    with nothing received, ``status`` is :data:`QUIET` (nothing is lost: call again
    with ``got``).  Raises ``ConnectionResetError`` if the host closed the
    connection, and the socket's ``OSError`` if it broke (``EBADF`` if another thread
    closed it: never a wait on a closed socket).
    """
    view = memoryview(buf)
    size = REPLY.size
    while True:
        if got >= size:
            status, _, ival, plen = REPLY.unpack_from(buf)
            whole = plen < small and size + plen <= len(buf)
            if not whole:
                return status, ival, plen, None, got
            if got >= size + plen:
                return status, ival, plen, bytes(view[size : size + plen]), got
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError as e:
            if e.errno is not None:  # (ETIMEDOUT: the connection broke)
                raise
            return QUIET, 0, 0, None, got
        if not n:
            raise ConnectionResetError("connection closed by peer")
        got += n


class LaneWire(NamedTuple):
    """What a :class:`KeyLane` sends and reads, as the transport declares it: the codes of
    ``get``, ``in``, ``put``, ``get_many``, ``pop`` and ``fetch_add``, the flag of a
    persistent put, the status of
    an absent key and of a host's wait that ran out, the largest request it sends (one piece: a
    connection's buffer holds it), the smallest reply payload received into a buffer
    of its own (``receive_reply``'s ``small``), and a batch record's bytes beyond its
    key and value (``client/batch.py``'s ``RECORD_FRAMING``)."""

    get: int
    contains: int
    put: int
    get_many: int
    pop: int
    fetch_add: int
    persist: int
    missing_status: int
    timeout_status: int
    most: int
    small: int
    record_framing: int


class _NoKey:
    """:data:`NO_KEY`'s type (a name in a traceback, not ``<object ...>``)."""

    def __repr__(self) -> str:
        return "NO_KEY"


#: What :meth:`KeyLane.get` answers for a key that is not there (its caller raises
#: ``DDictKeyError(key)``, as its Python path does).
NO_KEY: Any = _NoKey()


class Resend(NamedTuple):
    """What a :class:`KeyLane` answers for an operation with a timeout, or an at-most-once
    one, that it sent and then leaves to the Python path (a broken connection, a reply
    that is not OK): send it again within the same deadline, whose time counts from
    ``began`` (``time.monotonic()``), not from the resend, and with the same request id
    ``rid`` (an at-most-once operation's: its host applies it once; 0: none)."""

    began: float
    rid: int = 0

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Never a value: a handle reads a lane's answer of this type as "send it again",
        so a dictionary could not hold one without being misread (pickling refuses)."""
        raise TypeError("a key lane's Resend is not a value to store")


#: ``timed_out(handle, key, op, link, manager, message)``: the error of an operation
#: whose time ran out, as the handle's Python path raises it (``message``: the host's,
#: when its own wait ran out; ``None``: no answer within the time and its slack).
TimedOut = Callable[[Any, Any, int, Any, int, "bytes | None"], BaseException]


class _Here(NamedTuple):
    """A read's answer from a shard mapped here (:meth:`KeyLane._read`)."""

    answer: Any


class KeyLane:
    """A handle's ``d[key]``, ``key in d``, ``d[key] = value``, ``d.pop(key)`` and
    ``d.fetch_add(key, n)`` over a TCP link, each in one call: the common case of the
    handle's Python path (routing the key, the manager's channel, the operation, its
    link's exchange, the reply's result), which is the reference of everything here.
    A pop or a ``fetch_add`` (at most once) goes with a new request id, as the link
    draws one, and once sent it is never ``NotImplemented``: a broken connection or a
    reply that is not OK is a :class:`Resend` with that id, which the Python path sends
    again (its host applies it once).

    A get, an ``in`` or a put of a manager whose channel reads its shard on this host is
    that channel's :meth:`SharedState.read_here` or :meth:`~SharedState.put_here` (its
    own set's: the lane of the other set finds no channel of its kind and declines),
    with no timings on.

    Over TCP, the common case: a handle open and attached whose core has a TCP link's
    channel (``tcp``: a handle on the managers' host has none), not in a batch,
    without a value pickler, routed before (``_routed``), whose key routes (a key too
    long, or whose routing fails otherwise, is the Python path's to say); a manager whose
    channel exists and is a plain TCP link's (not TLS, not on this host, no timings on)
    with an idle connection in the process's pool (waits nowhere: none is connected
    here); a request that fits one send, and a put's value that fits a shard.  It sends
    what the operation's ``encode`` and the link's exchange send (the manager's term as
    the link knows it, the handle's timeout, no request id) and answers an OK reply: the
    value, whether the key is seen, ``None`` for a put; and :data:`NO_KEY` for a get's
    absent key.  With a timeout, every wait is cut at the operation's deadline (its
    timeout and the link's slack, as ``HostLink._exchange`` cuts them), and an answer
    that does not come by then, or a host's reply that its own wait ran out, raises what
    the Python path raises (``timed_out``), the connection closed.  Anything else answers
    ``NotImplemented``: before anything was sent, or after a reply that is not OK (a
    moved or leased manager, a full shard, ...: the host applied nothing), or a broken
    connection (closed as the link closes one); the caller then takes its Python path,
    which sends the request again (a read, or a put: the same request has the same
    effect) and follows, waits or raises as it says.

    With a timeout, a request sent and then left to the Python path is answered as a
    :class:`Resend`: its caller sends it again within the same deadline.

    Nothing is kept: each call reads the handle, its core and the link as they are
    (``HandleBase`` declares what it reads), so the lane is one per process, holding
    only what the transport injects: the wire's codes (:class:`LaneWire`), the channel
    class of a link's manager, the connection pool (its lock taken without waiting: a
    busy one is the Python path's; a connection given back through the pool's own
    ``give`` then), the timings' switch, the buffer a large value is
    received into, the value frames' decoder, the errors of a timeout, and the exception a
    connection's wait raises at its deadline.
    """

    def __init__(
        self,
        wire: LaneWire,
        channel: type,
        pool: Any,
        timing: Any,
        buffer: Callable[[int], Any],
        decode: Callable[[Any], Any],
        timed_out: TimedOut,
        deadline: type[BaseException],
    ) -> None:
        self.wire, self.channel, self.pool, self.timing = wire, channel, pool, timing
        self.buffer, self.decode, self.timed_out = buffer, decode, timed_out
        self.deadline = deadline

    def __repr__(self) -> str:
        return f"<KeyLane most={self.wire.most}>"

    def get(self, h: Any, key: Any) -> Any:
        """``h[key]``'s value, :data:`NO_KEY`, a :class:`Resend`, or ``NotImplemented``."""
        got = self._read(h, key, self.wire.get)
        if type(got) is _Here:
            return got.answer
        if type(got) is not tuple:
            return got
        status, _, payload = got
        return decoded(payload, self.decode) if status == 0 else NO_KEY

    def contains(self, h: Any, key: Any) -> Any:
        """``key in h``, a :class:`Resend`, or ``NotImplemented``."""
        got = self._read(h, key, self.wire.contains)
        if type(got) is _Here:
            return got.answer
        return bool(got[1]) if type(got) is tuple else got

    def pop(self, h: Any, key: Any) -> Any:
        """``h.pop(key)``'s value in a tuple of one (a value of its own may be anything,
        ``NotImplemented`` too: never read as the lane's answer, a pop is not done twice),
        :data:`NO_KEY`, a :class:`Resend` (once sent: with its request id), or
        ``NotImplemented``."""
        got = self._once(h, key, self.wire.pop, 0)
        if type(got) is not tuple:
            return got
        status, _, payload = got
        return (decoded(payload, self.decode),) if status == 0 else NO_KEY

    def fetch_add(self, h: Any, key: Any, n: int) -> Any:
        """``h.fetch_add(key, n)``'s value, a :class:`Resend` (once sent: with its request
        id), or ``NotImplemented``."""
        got = self._once(h, key, self.wire.fetch_add, n)
        return decoded(got[2], self.decode) if type(got) is tuple else got

    def _once(self, h: Any, key: Any, op: int, n: int) -> Any:
        """:meth:`_exchange` of an at-most-once operation on ``key`` (not in a batch: the
        Python path's), with a new request id: the one its Python path would draw."""
        routed = self._routed(h)
        if routed is None or h._batch is not None:
            return NotImplemented
        try:
            mid, digest, kb = routed[0].one(key)
        except KeyTooLong:  # (the Python path says why)
            return NotImplemented
        keysec = digest if op == self.wire.pop else digest + kb
        rid = secrets.randbits(63) + 1
        return self._exchange(h, key, mid, op, 0, keysec, (), 0, h._client_id, n, rid)

    def _read(self, h: Any, key: Any, op: int) -> Any:
        """:meth:`_exchange` of a read of ``key``; or, for a manager whose channel reads
        its shard on this host, the channel's :meth:`SharedState.read_here` (no timings
        on), its answer in a :class:`_Here`."""
        routed = self._routed(h, False)
        if routed is None:
            return NotImplemented
        try:
            mid, digest, _ = routed[0].one(key)
        except KeyTooLong:  # (the Python path says why)
            return NotImplemented
        core = h._core
        ch = core._channels.get(mid if h._target is None else h._target)
        if isinstance(ch, SharedState):
            if self.timing.on:  # (the timed path's: one operation, timed as such)
                return _Here(NotImplemented)
            return _Here(ch.read_here(digest, h._chkpt, op == self.wire.contains, self.decode))
        if not core.tcp:
            return NotImplemented
        return self._exchange(h, key, mid, op, 0, digest, (), 0, 0)

    def put(self, h: Any, key: Any, value: Any, persistent: bool) -> Any:
        """``h[key] = value`` (``None`` once acknowledged), a :class:`Resend`, or
        ``NotImplemented``; to a manager whose channel reads its shard on this host, the
        channel's :meth:`SharedState.put_here` (no timings on)."""
        routed = self._routed(h, False)
        if routed is None or h._batch is not None:
            return NotImplemented
        if type(value) is bytes and len(value) > self.wire.most:  # (not framed twice)
            return NotImplemented
        router, dumps = routed
        core = h._core
        try:
            if core.tcp:
                mid, digest, kb, framed = router.record(key, value, dumps)
            else:  # (only a channel that commits here takes it: found before framing)
                mid, digest, kb = router.one(key)
                ch = core._channels.get(mid if h._target is None else h._target)
                if not isinstance(ch, SharedState) or not ch.may_put():
                    return NotImplemented
                framed = router.framed(value, dumps)
        except KeyTooLong:
            return NotImplemented
        room = core._room  # (None: not known yet; a value too large: the Python path's)
        if room is None or framed.nbytes + len(kb) > room:
            return NotImplemented
        ch = core._channels.get(mid if h._target is None else h._target)
        if isinstance(ch, SharedState):  # (committed here, or the Python path's)
            if self.timing.on:
                return NotImplemented
            return ch.put_here(digest, kb, framed, h._chkpt)
        if not core.tcp:
            return NotImplemented
        flags = self.wire.persist if persistent else 0
        parts = tuple(framed.parts)
        got = self._exchange(
            h, key, mid, self.wire.put, flags, digest + kb, parts, framed.nbytes, h._client_id
        )
        return None if type(got) is tuple else got

    def batch_put(self, h: Any, key: Any, value: Any, persistent: bool) -> Any:
        """``h[key] = value`` (``pput``: ``persistent``) in the handle's open batch:
        ``None`` once buffered, or ``NotImplemented``.

        The common case of the handle's Python path (``_put`` into ``BatchPut.add``): a
        handle open and attached, in a batch of the put's kind, routed before, whose
        key routes and whose value fits a shard (the room known); the record buffered
        as ``add`` buffers it, and the route's buffer sent once full
        (``BatchPut.filled``: a value refused there said at the batch's end), or, for a
        manager's first record and a large one that travels alone, given to ``add``
        itself (``BatchPut.add_kept``).  Anything else is ``NotImplemented``, nothing
        buffered: the Python path frames it again and says what is wrong (a persistence
        that differs from the batch's, a value too large, a key too long)."""
        core, batch = h._core, h._batch
        if core.closed or h._detached or batch is None or batch.persist is not persistent:
            return NotImplemented
        routed, room = h._routed, core._room
        if routed is None or room is None:
            return NotImplemented
        try:
            mid, digest, kb, framed = routed[0].record(key, value, routed[1])
        except KeyTooLong:
            return NotImplemented
        if h._target is not None:
            mid = h._target
        own = framed.nbytes + len(kb)
        if own > room:
            return NotImplemented
        route = batch._routes.get(mid)
        own += self.wire.record_framing
        if route is None or (own >= batch.flush_bytes and batch.sizes.get(route)):
            batch.add_kept(mid, digest, kb, framed, h._chkpt)  # (a manager's first, a large one)
            return None
        batch._chkpt = h._chkpt
        batch.records.setdefault(mid, []).append((digest, kb, framed))
        size = batch.sizes[route] = batch.sizes.get(route, 0) + own
        if size >= batch.flush_bytes:
            batch.filled(route)
        return None

    def get_many(self, h: Any, keys: list[Any], absent: Any) -> Any:
        """``h.get_many(keys)`` copying its values, as ``(values, marked)``: the values in
        the keys' order, ``absent`` for an absent key, and the indices of those; or
        ``NotImplemented``, or (a handle with a timeout, once sent) a :class:`Resend`.

        The common case of the handle's Python path (``Reads.get_many``: the keys'
        routes, one :class:`~dask_ddict.transport.many_key_ops.GetMany` per host process,
        every request sent before any reply is read, each reply's values decoded where
        it was received): a handle the lane serves, whose keys route (a key's group is
        its manager's, the groups in the order their first keys come), every manager's
        channel a plain TCP link's, each link with an idle connection that holds its
        request whole.  It sends what ``GetMany.encode`` and the link's exchange send (no
        term: a many-key request follows no manager; the first group's manager in the
        header; the handle's timeout) and answers when every reply is OK and decodes
        (:func:`unpack_values`).  With a timeout, each link's waits end at the Python
        path's deadline (the time and the link's slack from the start), and one that
        passes raises its error (``GET_MANY`` unanswered by the link's first manager),
        every connection with a request in flight closed.  Anything else answers
        ``NotImplemented`` (a :class:`Resend` with a timeout, once sent: the Python path
        reads again within the same deadline): before anything was sent, or after (a
        reply not OK: a moved or leased manager; one a reader must wait for; a broken
        connection, closed as the link closes one, every other one with a request in
        flight closed too); the caller then takes its Python path, which reads every
        key again."""
        routed = self._routed(h)
        if routed is None or not keys or self.timing.on:
            return NotImplemented
        timeout = h._timeout
        wire_timeout = -1.0 if timeout is None else float(timeout)
        try:
            routes = routed[0].many(keys)
        except KeyTooLong:
            return NotImplemented
        target, chans = h._target, h._core._channels
        members: dict[int, list[int]] = {}  # each manager's keys, by index
        links: dict[Any, list[int]] = {}  # each link's managers, in the order first seen
        for i, (mid, digest) in enumerate(routes):
            if target is not None:
                mid = target
            if len(digest) != DIGEST:
                return NotImplemented
            group = members.get(mid)
            if group is None:
                ch = chans.get(mid)
                if type(ch) is not self.channel or cast(Any, ch).link.kind != "tcp":
                    return NotImplemented
                links.setdefault(cast(Any, ch).link, []).append(mid)
                group = members[mid] = []
            group.append(i)
        requests = []
        for link, mids in links.items():
            table = group_table([(mid, cast(Any, members[mid])) for mid in mids])  # (counts)
            digests = b"".join(routes[i][1] for mid in mids for i in members[mid])
            vlen = len(table) + len(digests)
            if REQUEST.size + vlen > self.wire.most or vlen > link._max_value:
                return NotImplemented
            try:
                head = REQUEST.pack(
                    self.wire.get_many, 0, 0, 0, mids[0], 0, h._chkpt, 0, 0, wire_timeout, vlen, 0
                )
            except struct.error:  # (a field out of range: the Python path's to say)
                return NotImplemented
            requests.append((link, mids, head + table + digests))
        conns: list[Any] = []
        for link, _, _ in requests:
            conn = self._take(link)
            if conn is None:  # (nothing sent: every connection back as it was)
                for (other, _, _), c in zip(requests, conns, strict=False):
                    self.pool.give(other, c)
                return NotImplemented
            conns.append(conn)
        states = [0] * len(conns)  # (taken 0, sent 1, answered and given back 2)
        replies = []
        failing = 0
        began = time.monotonic()
        # (a timed one: each link's waits end at its deadline, the Python path's; once
        # sent, what would be NotImplemented is a Resend, its time counted from here)
        deadlines = [None if timeout is None else began + timeout + k._slack for k in links]
        again = NotImplemented if timeout is None else Resend(began)
        try:
            for failing, ((_, _, request), conn) in enumerate(zip(requests, conns)):
                conn.begin(deadlines[failing], None)
                conn.sendall(request)
                states[failing] = 1
            for failing, ((link, mids, _), conn) in enumerate(zip(requests, conns)):
                status, _, payload = self._reply(conn, deadlines[failing])
                states[failing] = 2
                self.pool.give(link, conn)
                replies.append((status, payload, [len(members[mid]) for mid in mids]))
        except self.deadline:
            self._drop(requests, conns, states, failing, broken=False)
            link, mids, _ = requests[failing]
            raise self.timed_out(h, None, self.wire.get_many, link, mids[0], None) from None
        except OSError:
            self._drop(requests, conns, states, failing, broken=True)
            return again
        except BaseException:
            self._drop(requests, conns, states, failing, broken=False)
            raise
        values: dict[int, list[Any]] = {}
        for (_, mids, _), (status, payload, counts) in zip(requests, replies):
            if status != 0:  # (a moved or leased manager, ...: the Python path's to follow)
                return again
            try:
                decoded = unpack_values(payload, counts, self.wire.small, absent, self.decode)
            except ValueError:  # (a reply that does not add up: the Python path says so)
                return again
            if decoded is None:  # (a reader must wait for one: the Python path's)
                return again
            values.update(zip(mids, decoded))
        out: list[Any] = [None] * len(keys)
        for mid, group in members.items():
            for i, v in zip(group, values[mid]):
                out[i] = v
        return out, [i for i, v in enumerate(out) if v is absent]

    def _reply(self, conn: Any, deadline: float | None) -> tuple[int, int, Any]:
        """``(status, ival, payload)`` of the reply to the request in flight on ``conn`` (a
        large payload received into a buffer of its own); raises ``self.deadline`` once
        ``deadline`` passed with no reply."""
        reader = conn.reader
        buf, got = reader.emptied(), 0
        while True:
            status, ival, plen, payload, got = receive_reply(
                conn.sock, buf, got, conn.timeout, self.wire.small
            )
            if status != QUIET:
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise self.deadline()
            conn._arm()  # (what is left of the time)
        if payload is None:  # (a large one: into a buffer of its own)
            reader.received(REPLY.size, got)
            payload = self.buffer(plen)
            reader.read_into(payload)
        return status, ival, payload

    def _take(self, link: Any) -> Any:
        """One of ``link``'s idle connections, as ``IdlePool.take`` takes it, with nothing
        in its receive buffer (``None``: none idle, the pool's lock busy, or one with
        something buffered, given back as it was)."""
        pool = self.pool
        if not pool.lock.acquire(False):
            return None
        try:
            conn = link.idle.pop() if link.idle else None
            if conn is not None:
                del pool.idle[conn]
        finally:
            pool.lock.release()
        if conn is not None and conn.reader.buffered():
            pool.give(link, conn)
            return None
        return conn

    def _drop(
        self, requests: list[Any], conns: list[Any], states: list[int], failing: int, broken: bool
    ) -> None:
        """After a failed exchange: the failing link's connection broken (closed as the link
        closes one) or forgotten, each other one with a request in flight forgotten (its
        reply would be read as the next request's), each untouched one given back."""
        for k, ((link, _, _), conn) in enumerate(zip(requests, conns)):
            if states[k] == 2:
                continue
            if k == failing:
                (link._broken if broken else link.forget)(conn)
            elif states[k] == 1:
                link.forget(conn)
            else:
                self.pool.give(link, conn)

    @staticmethod
    def _routed(h: Any, tcp: bool = True) -> Any:
        """The handle's router and framer, if it is one the lane serves now (``tcp``:
        over a TCP link, so not for a core that has none)."""
        core = h._core
        if (tcp and not core.tcp) or core.closed or h._detached or h._vp is not None:
            return None
        return h._routed

    def _exchange(
        self,
        h: Any,
        key: Any,
        mid: int,
        op: int,
        flags: int,
        keysec: bytes,
        parts: tuple[Any, ...],
        vlen: int,
        client: int,
        arg: int = 0,
        rid: int = 0,
    ) -> Any:
        """``(status, ival, payload)`` of one request to manager ``mid`` (the handle's own,
        or its target) on an idle connection of its link, answered OK (or, for a get or
        a pop, with its key absent); else ``NotImplemented`` (not for the lane, nothing
        sent; or, without a timeout or a request id ``rid``, sent and then a broken
        connection, closed here, or another reply) or, with one, a :class:`Resend`.
        Raises what the Python path raises when the operation's time runs out."""
        if h._target is not None:
            mid = h._target
        ch = h._core._channels.get(mid)
        if type(ch) is not self.channel or self.timing.on:
            return NotImplemented
        link = cast(Any, ch).link
        if link.kind != "tcp" or REQUEST.size + len(keysec) + vlen > self.wire.most:
            return NotImplemented
        if vlen > link._max_value:
            return NotImplemented
        timeout = h._timeout
        wire_timeout = -1.0 if timeout is None else float(timeout)
        term = link.terms.get(mid, 0)
        try:
            head = REQUEST.pack(
                op, flags, term, len(keysec), mid, 0, h._chkpt, arg, client, wire_timeout, vlen, rid
            )
        except struct.error:  # (a field out of range: the Python path's to say)
            return NotImplemented
        began = time.monotonic()
        deadline = None if timeout is None else began + timeout + link._slack
        pool = self.pool
        conn = self._take(link)
        if conn is None:
            return NotImplemented
        # (once sent: a request id is sent again with it, never a new one)
        again = NotImplemented if timeout is None and not rid else Resend(began, rid)
        try:
            conn.begin(deadline, None)  # (the socket's waits cut at the deadline, if any)
            conn.sendall(b"".join((head, keysec, *parts)))
            status, ival, payload = self._reply(conn, deadline)
        except self.deadline:
            link.forget(conn)
            raise self.timed_out(h, key, op, link, mid, None) from None
        except OSError:  # (ssl's errors are OSErrors too: no TLS here anyway)
            link._broken(conn)
            return again
        except BaseException:
            link.forget(conn)
            raise
        pool.give(link, conn)
        if status == 0 or (
            status == self.wire.missing_status and (op == self.wire.get or op == self.wire.pop)
        ):
            return status, ival, payload
        if status == self.wire.timeout_status and timeout is not None:
            raise self.timed_out(h, key, op, link, mid, bytes(payload))
        return again


class PlainRequests(NamedTuple):
    """What a :class:`PlainServer` serves, as the host declares it: the codes of ``get``,
    ``in``, ``put``, ``get_many``, ``get_range``, ``pop`` and ``fetch_add`` and the flag a
    put may carry (``persist``: under no ``wait_for_keys``, every put persists), what a
    get of an absent key is answered (the status and message that the manager's
    ``DDictKeyError`` becomes on the wire), the largest value it sends or puts (a larger
    one is the manager's, which moves it in parts), the largest key section a host
    takes (a larger one is refused by the server), and the clock a host's lease runs on
    (``time.clock_gettime``'s id)."""

    get: int
    contains: int
    put: int
    get_many: int
    get_range: int
    pop: int
    fetch_add: int
    persist: int
    missing_status: int
    missing: bytes
    most: int
    most_key: int
    clock: int


class GenerationBump:
    """``store.on_commit`` of manager ``mid``, whose host keeps the generations ``gens``
    (:class:`~dask_ddict.shard.generations.Generations`): ``gens.bump(mid)``.  The compiled
    one writes the word in C (63 random bits and a one, from a generator seeded from the
    system's entropy and again in a forked child), and the compiled plain server calls
    it without a call: a put's commit hook costs it no Python frame."""

    __slots__ = ("gens", "mid")

    def __init__(self, gens: Any, mid: int) -> None:
        if mid < 0:
            raise IndexError(f"manager {mid}: no generation word")
        self.gens, self.mid = gens, mid

    def __repr__(self) -> str:
        return f"<GenerationBump manager={self.mid} of {self.gens!r}>"

    def __call__(self) -> None:
        try:
            self.gens.bump(self.mid)
        except IndexError as e:
            raise IndexError(f"manager {self.mid}: no generation word in {self.gens!r}") from e


class ManagerState:
    """What a manager's plain requests are checked against: a base of ``Manager``
    (``closed``, ``frozen``, ``wire``, ``store``, ``working_set``, ``_mutex``,
    ``_deferred``, ``_retiring``).  The compiled one keeps them in C fields (an attribute
    of the base, as fast from Python as an instance's), which the compiled plain server
    reads as fields, not through an attribute lookup each (about 60 ns, some 25 times a
    put); here the subclass keeps them in its ``__dict__``."""

    __slots__ = ()


class WindowState:
    """A manager's checkpoint window and retirement rules: a base of ``WorkingSet``
    (``size``, ``newest``, ``wait_for_keys``, ``wait_for_writers``); see
    :class:`ManagerState`."""

    __slots__ = ()


class StoreState:
    """A shard's environment, tables, replication, commit hook and room estimate: a base
    of ``ShardStore`` (``env``, ``_data``, ``_meta``, ``replicate``, ``on_commit``,
    ``indexed``, ``capacity``, ``_used_estimate``, ``_next_own``, ``full_thresh``); see
    :class:`ManagerState`."""

    __slots__ = ()


class ReaderState:
    """A socket's receive buffer and the bytes received, not read yet: ``_buf[_pos:_end]``
    (a base of ``transport.protocol.Reader``; ``_mv`` is a view of ``_buf``): slots
    here, C fields in the compiled set (see :class:`ManagerState`)."""

    __slots__ = ("sock", "_buf", "_mv", "_pos", "_end")


class ConnectionState:
    """What the event loop reads of a connection at each of its wake-ups: its plain
    server and its socket's reader (a base of ``host.loop.Connection``; see
    :class:`ManagerState`)."""

    __slots__ = ("plain", "reader")


class HostedState:
    """What the plain server reads of a dictionary at each run of requests: its managers
    here, and whether its primaries need this host's lease, and the lease (a base of
    ``host.hosted.HostedDict``; see :class:`ManagerState`)."""

    __slots__ = ("managers", "lease", "leased")


class DeferredState:
    """A manager's operations waiting to be retried, oldest first, which a plain put
    checks for (a base of ``shard.deferred.DeferredQueue``; see :class:`ManagerState`)."""

    __slots__ = ("waiting",)


class GenerationsState:
    """A generations file's words (a base of ``shard.generations.Generations``): the
    compiled one holds their buffer while they stay, which its commit hook writes
    through (see :class:`ManagerState`)."""

    __slots__ = ("words",)


class LeaseState:
    """Whether a host's lease is kept at all, and its end (of ``lease_clock``), as the
    plain server checks them (a base of ``host.lease.LeaseKeeper``; see
    :class:`ManagerState`)."""

    __slots__ = ("required", "until")


class ViewState:
    """What the same-host read and put check of a process's view of a shard: a base of
    ``transport.mapped._View`` (``store``, ``evicted``, ``closed``, ``used``; see
    :class:`ManagerState`)."""

    __slots__ = ("store", "evicted", "closed", "used")


class SharedState:
    """What the same-host read and put check of a manager's same-host channel: a base of
    ``transport.shared.SharedChannel`` (``_view``, ``_seen``, ``_orphans``, ``_touched``,
    ``_alive_until``, ``_size``, ``_wfk``, ``_closed``; see :class:`ManagerState`), and
    the read itself.

    ``SharedChannel._get`` and ``_contains`` are the reference: about twenty Python
    calls around one seek.  :meth:`read_here` is their common case in one call (the key
    lane's, ``KeyLane.get`` and ``contains``), and declines (``NotImplemented``, before
    anything is counted) whatever else, which the Python path then serves and explains.
    """

    __slots__ = ()

    def may_put(self) -> bool:
        """Whether a put may be committed here at all, as far as the channel and its view
        say: what the key lane checks before it frames a value (a value framed and then
        left to the Python path would be framed twice)."""
        ch: Any = self
        view = ch._view
        return bool(
            ch._direct
            and ch._size == 1
            and not ch._closed
            and not ch._orphans
            and view is not None
            and not view.evicted
        )

    def put_here(self, digest: bytes, kb: bytes, framed: Any, chkpt: int) -> Any:
        """``None`` once a put of ``digest`` (key bytes ``kb``, value frame ``framed``) at
        checkpoint ``chkpt`` is committed by this process into the channel's shard, or
        ``NotImplemented`` (nothing written): the Python path's ``SharedChannel._put``
        then puts it, or sends it to the manager, and says what happened.

        The common case: a channel that may commit (``_direct``: no ``wait_for_*``, not
        read-only, no replicas, direct writes on), open with its view, no dropped batch's
        commit to let go, a window of one checkpoint, an unindexed shard, a frame of at
        most :data:`DIRECT_PUT_MAX` bytes, the host known alive within ``ALIVE_CHECK``;
        then the channel's commit of it (``put_batch``: its rules refuse a moved, closed,
        frozen or full shard, another checkpoint than the newest, and waiters at the
        manager; what it refuses, the Python path meets again; what it raises, it may
        raise after its commit: it is the put's).  The
        compiled one makes ``put_batch``'s one C call (``DirectCommit.commit``) itself,
        the view counted inside meanwhile, as ``put_batch`` counts it."""
        ch: Any = self  # (its fields are the subclass's)
        view = ch._view
        if (
            not ch._direct
            or ch._size != 1
            or ch._closed
            or ch._orphans
            or view is None
            or type(digest) is not bytes
            or len(digest) != DIGEST
            or type(kb) is not bytes
            or type(chkpt) is not int
            or chkpt < 0
            or framed.nbytes > DIRECT_PUT_MAX
            or time.monotonic() >= ch._alive_until
        ):
            return NotImplemented
        if view.store.indexed:
            return NotImplemented
        # (what it raises is the put's: it may have been committed, and is never made again)
        done, error = ch.put_batch([(digest, kb, framed)], chkpt)
        return None if done == 1 and error is None else NotImplemented

    def read_here(
        self, digest: bytes, chkpt: int, contains: bool, decode: Callable[[Any], Any]
    ) -> Any:
        """The value of ``digest`` at checkpoint ``chkpt`` in the channel's view of its
        shard (``contains``: whether one is seen), :data:`NO_KEY` for none, or
        ``NotImplemented``.

        The common case: the channel open with its view (not evicted, not closed), no
        dropped batch's commit to let go (``_orphans``), not ``wait_for_keys`` (a reader
        that may wait), the host known alive within ``ALIVE_CHECK`` (``_alive_until``:
        never for a replicated manager, whose lease is checked at every read), the shard
        open and ``chkpt`` in its window, as of the snapshot (the marks are read again
        after a commit, ``_seen`` then written as ``_check_state`` writes it), and the
        newest version at ``chkpt`` absent, deleted, or live with a frame under
        ``SMALL_FRAME`` (which no read lends: the copy is the value's); a live one is
        counted as touched (``_touched``, ``_View.copy``'s count) and decoded.  Here
        the read counts itself inside the view (``_View.enter``, then the channel's
        ``_exit``), as the Python path does: the snapshot's buffers are views of the
        map, which a close would unmap under them.  The compiled read holds the
        interpreter lock from the view's check to the snapshot's end and makes no Python
        object meanwhile, so no close can come between and it counts nothing (see
        ``same_host.pxi``)."""
        ch: Any = self  # (its fields are the subclass's)
        view = ch._view
        if (
            view is None
            or ch._closed
            or ch._wfk
            or ch._orphans
            or type(digest) is not bytes
            or len(digest) != DIGEST
            or type(chkpt) is not int
            or chkpt < 0
        ):
            return NotImplemented
        now = time.monotonic()
        if now >= ch._alive_until or not view.enter():  # (counted inside, as _enter does)
            return NotImplemented
        store, (seen_tid, newest, frozen) = view.store, ch._seen
        try:
            with store.env.begin(buffers=True) as txn:
                tid = txn.id()
                if tid != seen_tid:  # (a commit since: the window and marks read again)
                    raw = txn.get(NEWEST, db=store._meta)
                    if raw is None:
                        newest = ch._size - 1
                    elif len(raw) != 9 or raw[8] != 0:
                        return NotImplemented  # (closed: the Python path says how)
                    else:
                        newest = int.from_bytes(raw[:8], "little", signed=True)
                    mark = txn.get(FROZEN, db=store._meta)
                    frozen = mark is not None and bytes(mark) == b"\x01"
                if chkpt < max(0, newest - ch._size + 1):
                    return NotImplemented  # (retired: the Python path says so)
                e = lookup_entry(txn, store._data, digest, chkpt, whole=False)
                found: Any = None
                if e is not None and not e.flags & TOMBSTONE:
                    if contains:
                        found = True
                    elif len(e.frame) >= SMALL_FRAME:
                        return NotImplemented
                    else:
                        found = bytes(e.frame)
        except Exception:  # noqa: BLE001 - the Python path meets it again and says it
            return NotImplemented
        finally:
            ch._exit(view)  # (the last one out of a view closed meanwhile closes it)
        if tid != seen_tid:
            ch._seen = (tid, newest, frozen)
        if contains:
            return found is not None
        if found is None:
            return NO_KEY
        ch._touched(len(found))
        return decoded(found, decode)


SERVED_OPS = 64
"""Operation codes a :class:`ServedTable` counts: ``0 .. SERVED_OPS - 1`` (the wire's
are under 40)."""


class ServedTable:
    """One connection's requests served, by manager and operation
    (``host.served``): written by the connection's thread alone, copied by
    :meth:`items` for a reader on another thread.  The compiled one keeps a row of C
    counters per manager, which the compiled plain server adds to without an object."""

    __slots__ = ("_rows",)

    def __init__(self) -> None:
        self._rows: dict[int, dict[int, int]] = {}

    def __repr__(self) -> str:
        return f"<ServedTable managers={len(self._rows)}>"

    def count(self, mid: int, op: int, times: int = 1) -> None:
        """``times`` requests ``op`` for manager ``mid``."""
        if not (0 <= mid <= 0xFFFFFFFF and 0 <= op <= 0xFFFFFFFF and 0 <= times < 1 << 64):
            raise OverflowError(f"manager {mid}, operation {op}, {times} times: out of range")
        if op >= SERVED_OPS:
            raise ValueError(f"operation {op}: not under {SERVED_OPS}")
        counts = self._rows.get(mid)
        if counts is None:
            counts = self._rows[mid] = {}
        counts[op] = counts.get(op, 0) + times

    def items(self) -> list[tuple[int, dict[int, int]]]:
        """``[(manager, {operation: requests})]``, copies of the rows counted so far (a
        manager none of whose requests counted yet has no row)."""
        # (each row copied in one C call: the thread that counts may run meanwhile)
        rows = [(mid, dict(counts)) for mid, counts in list(self._rows.items())]
        rows = [(mid, {op: n for op, n in counts.items() if n}) for mid, counts in rows]
        return [(mid, counts) for mid, counts in rows if counts]


ManagerLock = threading.Lock
"""A lock taken on the key path (``Manager._mutex``, ``IdlePool.lock``):
``threading.Lock``.  The compiled one has the same interface, and a non-blocking take
and a release that the compiled plain server and key lane make without a call (a Python
lock's costs a call, its arguments' parsing and a clock read: a fifth of a plain put's
time in the host)."""


class PlainServer:
    """Serves the plain requests at the head of one event-loop connection's buffer.

    A plain request is a ``get``, an ``in`` or a ``put`` of one key of a manager served
    here (not closed, under the term its client names, its dictionary without
    ``wait_for_keys``), without a request id (but a pop's or a ``fetch_add``'s): a read
    at a checkpoint in the manager's window, answered from one snapshot without ever
    waiting (of a leased dictionary, a
    replicated primary here, only while the host's lease is valid); a put of a value
    of at most ``most`` bytes at the window's checkpoint, in a window of one checkpoint,
    to a shard neither frozen, replicated, nor waited on (no deferred operation, no
    checkpoint retiring, no ``wait_for_writers``), that its manager's lock is free to
    take: what :meth:`~dask_ddict.shard.working_set.WorkingSet.put_alone` writes in one
    transaction; a ``get_many`` of such managers' keys whose values are all under
    :data:`JOIN` bytes, framed as ``GetMany.serve_host`` frames it (each manager looked up
    counts once); a ``get_range`` of a raw-bytes value (``GetRange``: its size, and the
    part asked for, of at most ``most`` bytes, whatever the value's); a ``pop`` or a
    ``fetch_add``, with its request id, by a put's rules, as ``Manager.pop_alone`` and
    ``fetch_add_alone`` write them (its reply kept under its id in the same
    transaction; a resend, a reply over ``most`` bytes or one kept until read are the
    manager's).  :meth:`serve`
    answers the leading ones as the manager would (the value's frame, ``DDictKeyError``'s
    reply, whether the key is seen, a put's empty reply, a range), counts them in the
    connection's table and takes them out of its buffer; it stops at the first request
    that is anything else, or not whole, or a put that does
    not go through alone (nothing of it written), and leaves it to the server's Python
    path, which is the reference of everything here.  A read after a put sees it (the
    snapshot of a run ends at a put).  Its replies go out in one send that does not
    wait, after the ones the connection kept back; what the socket does not take joins
    them (``held``), for the server to send.

    ``c`` is the :class:`~dask_ddict.host.loop.Connection`: its ``reader``, ``sock``,
    ``held``, ``owed`` (a connection that owes a delivery is the server's:
    :func:`_settled`), ``hosted`` and ``served`` are read.
    """

    __slots__ = ("_c", "_rules", "count", "dropped")

    def __init__(self, c: Any, rules: PlainRequests) -> None:
        self._c, self._rules = c, rules
        self.count = 0  # requests served here
        self.dropped = 0  # groups of puts LMDB refused (the compiled server's; none here)

    def serve(self) -> bool:
        """Serve the plain requests at the head of the buffer (:attr:`count` counts them);
        whether that left nothing to do: nothing buffered, no reply kept back."""
        c, rules = self._c, self._rules
        r, hosted = c.reader, c.hosted
        lease = hosted.lease if hosted.leased else None
        if hosted.leased and lease is None or not _settled(c.owed):
            return False
        out: list[bytes] = []
        snap: tuple[Any, Any] | None = None  # (environment, snapshot) of the last read
        try:
            while r._end - r._pos >= REQUEST.size + DIGEST:
                op, flags, term, klen, mid, tag, chkpt, arg, client, _, vlen, rid = (
                    REQUEST.unpack_from(r._buf, r._pos)
                )
                at, end = r._pos + REQUEST.size, r._pos + REQUEST.size + klen + vlen
                once = op == rules.pop or op == rules.fetch_add  # (a request id: at most once)
                if lease is not None and (
                    op == rules.put  # (a primary's writes: shipped to its replicas first)
                    or once
                    or lease.required
                    and time.clock_gettime(rules.clock) >= lease.until
                ):
                    break  # (the lease lapsed: the manager's path says so)
                if op == rules.get_many:
                    if flags or klen or term or rid or end > r._end or chkpt < 0:
                        break
                    if snap is not None:
                        snap[1].abort()
                        snap = None
                    reply = _get_many(hosted.managers, c.served, op, bytes(r._buf[at:end]), chkpt)
                    if reply is None:
                        break
                    out.append(REPLY.pack(0, tag, 0, len(reply)) + reply)
                    r._pos = end
                    continue
                m = hosted.managers.get(mid)
                if m is None or m.closed or (term and term != m.wire) or chkpt < 0:
                    break
                if rid and not once:
                    break
                ws = m.working_set
                if ws.wait_for_keys:
                    break
                if once:
                    if flags or vlen or not DIGEST <= klen <= rules.most_key or end > r._end:
                        break
                    if op == rules.pop and klen != DIGEST:
                        break
                    if snap is not None:  # (a read after the write sees it)
                        snap[1].abort()
                        snap = None
                    reply = _once_alone(
                        m, op == rules.pop, r._buf, at, klen, (chkpt, client, arg, rid), rules.most
                    )
                    if reply is None:
                        break
                    out.append(REPLY.pack(0, tag, 0, len(reply)) + reply)
                elif op == rules.put:
                    if flags & ~rules.persist or not DIGEST <= klen <= rules.most_key:
                        break
                    if vlen > rules.most or end > r._end:
                        break
                    if snap is not None:  # (a read after the put sees it)
                        snap[1].abort()
                        snap = None
                    if not _put_alone(m, r._buf, at, klen, end, chkpt, client):
                        break
                    out.append(REPLY.pack(0, tag, 0, 0))
                else:
                    ranged = op == rules.get_range
                    if (op != rules.get and op != rules.contains and not ranged) or flags:
                        break
                    if klen != (DIGEST + SPAN.size if ranged else DIGEST) or end > r._end:
                        break
                    if vlen or chkpt < ws.newest - ws.size + 1:
                        break
                    env = m.store.env
                    if snap is None or snap[0] is not env:
                        if snap is not None:
                            snap[1].abort()
                        snap = None
                        snap = (env, m.store.read())
                    e = m.store.lookup(snap[1], bytes(r._buf[at : at + DIGEST]), chkpt)
                    live = e is not None and not e.flags & TOMBSTONE
                    if op == rules.contains:
                        out.append(REPLY.pack(0, tag, int(live), 0))
                    elif not live:
                        missing = rules.missing
                        out.append(REPLY.pack(rules.missing_status, tag, 0, len(missing)) + missing)
                    elif ranged:
                        got = _range(e.frame, *SPAN.unpack_from(r._buf, at + DIGEST))
                        if got is None or len(got[1]) > rules.most:
                            break  # (not raw bytes, or a large part: the manager's)
                        out.append(REPLY.pack(0, tag, got[0], len(got[1])) + bytes(got[1]))
                    elif len(e.frame) > rules.most:
                        break
                    else:
                        out.append(REPLY.pack(0, tag, 0, len(e.frame)) + bytes(e.frame))
                c.served.count(mid, op)
                r._pos = end
        finally:
            if snap is not None:
                snap[1].abort()
        self.count += len(out)  # (counted before they are answered: seen once they are)
        if out:
            data = b"".join(out)
            if not c.held:
                try:
                    sent = c.sock.send(data, _DONTWAIT)
                except BlockingIOError:
                    sent = 0
                data = data[sent:]
            if data:
                c.held.append(data)
        return r._pos == r._end and not c.held


def _range(frame: Any, start: int, stop: int) -> tuple[int, Any] | None:
    """:func:`~dask_ddict._serialize.raw_range` of a value's frame (its size and
    ``value[start:stop]``), or ``None``: not a raw-bytes frame (the manager says so)."""
    if len(frame) < _HEAD_STRUCT.size or frame[0] != FMT_BYTES:
        return None
    return raw_range(frame, start, stop)


def _get_many(
    managers: dict[int, Any], served: Any, op: int, value: bytes, chkpt: int
) -> bytes | None:
    """A plain ``get_many``'s reply payload (``value``: its table and digests), or
    ``None``: the manager's path's (a table that does not add up, a manager not served
    here or not plain, a value of :data:`JOIN` bytes or more)."""
    try:
        groups = digest_groups(value)
    except ValueError:
        return None
    frames: list[Any] = []
    for mid, digests in groups:
        m = managers.get(mid)
        if m is None or m.closed or m.working_set.wait_for_keys:
            return None
        ws = m.working_set
        if chkpt < ws.newest - ws.size + 1 or chkpt < 0:
            return None
        with m.store.read() as txn:
            got = ws.get_many(txn, digests, chkpt, JOIN)
            if any(f is not None and len(f) >= JOIN for f in got):
                return None
            frames += [None if f is None else bytes(f) for f in got]
    for mid, _ in groups:
        served.count(mid, op)
    return b"".join(bytes(p) for p in pack_frames(frames))


def _settled(owed: list[Any]) -> bool:
    """Whether a connection owes no delivery: the last at-most-once reply it was sent
    (``owed[0]``: its manager and request id, see ``HostServer._serve_request``) is read
    whole once another request came, and a reply its manager keeps only until then is
    the server's to drop (False); a small one, kept in the ring, asks nothing (settled
    here)."""
    last = owed[0]
    if last is None:
        return True
    if last[0].keeps(last[1]):
        return False
    owed[0] = None
    return True


def _alone(m: Any, chkpt: int, write: Callable[[], T]) -> T | None:
    """``write()`` under manager ``m``'s lock, where a write at ``chkpt`` goes through alone
    (a window of one checkpoint, at it; a shard neither frozen, replicated, indexed nor
    waited on) and the lock is free; else ``None``, nothing written."""
    ws = m.working_set
    store = ws.store
    if ws.size != 1 or ws.wait_for_writers or chkpt != ws.newest or m.frozen:
        return None
    if store.replicate is not None or store.indexed:
        return None
    if not m._mutex.acquire(False):
        return None
    try:
        if m.closed or m.frozen or m._deferred.waiting or m._retiring:
            return None
        return write()
    finally:
        m._mutex.release()


def _put_alone(
    m: Any, buf: bytearray, at: int, klen: int, end: int, chkpt: int, client: int
) -> bool:
    """A plain put of manager ``m`` (its digest, key and value at ``buf[at:end]``), as
    ``Manager.put`` writes it when it goes through alone (:func:`_alone`): whether it was
    written and committed (else nothing was)."""
    digest = bytes(buf[at : at + DIGEST])
    key = bytes(buf[at + DIGEST : at + klen])
    value = bytes(buf[at + klen : end])
    return bool(
        _alone(m, chkpt, lambda: m.working_set.put_alone(digest, chkpt, key, value, client))
    )


def _once_alone(
    m: Any, pop: bool, buf: bytearray, at: int, klen: int, head: tuple[int, ...], most: int
) -> bytes | None:
    """A ``pop`` (``pop``) or a ``fetch_add`` of manager ``m`` (its digest, and key, at
    ``buf[at:at + klen]``; ``head``: its ``(checkpoint, client, n, request id)``), as the
    manager applies it when it goes through alone (:func:`_alone`, ``Manager.pop_alone``),
    its reply kept under its request id: the reply, or ``None`` (nothing written: the
    manager's full way answers it, as it answers a reply over ``most`` bytes)."""
    chkpt, client, n, rid = head
    digest = bytes(buf[at : at + DIGEST])
    if pop:
        return _alone(m, chkpt, lambda: m.pop_alone(digest, chkpt, client, rid, most))
    key = bytes(buf[at + DIGEST : at + klen])
    return _alone(m, chkpt, lambda: m.fetch_add_alone(digest, key, chkpt, client, n, rid, most))


def poll_and_serve(ep: Any, conns: dict[int, Any], most: int) -> list[tuple[int, Any]]:
    """Wait for a host's connections (``ep``, the event loop's ``epoll``, at most ``most``
    events at a time), and for each that sent something, receive it and serve its plain
    requests (its :class:`PlainServer`, ``c.plain``, of ``conns[fd]``).  What is left for the
    caller: ``(fd, None)`` for a connection whose buffer holds a request that its plain
    server does not answer (or that has none), or for a descriptor that is not a
    connection's (the loop's wake-up); ``(fd, error)`` for one whose receive or send
    failed.  A wake-up whose events were all served whole (the loop's common one) is
    followed by the next wait here, so that, in the compiled set (which waits with the
    interpreter lock released), no Python runs between one reply and the next request:
    never empty (an interrupted wait is waited again, as ``epoll.poll`` does)."""
    left: list[tuple[int, Any]] = []
    while not left:
        for fd, _ in ep.poll(-1, most):
            c = conns.get(fd)
            plain = None if c is None else c.plain
            if c is None or plain is None:
                left.append((fd, None))
                continue
            try:
                receive_nowait(c.reader)
                if plain.serve():
                    continue
            except Exception as e:  # noqa: BLE001 - the connection's end (the caller's to say)
                left.append((fd, e))
                continue
            left.append((fd, None))
    return left


__all__ = [
    "Decoded",
    "route",
    "Router",
    "group",
    "group_positions",
    "digest_groups",
    "pack_frames",
    "unpack_frames",
    "unpack_values",
    "disown_transactions",
    "DirectCommit",
    "commits_behind",
    "commits_behind_forked",
    "lookup_entry",
    "touch_pages",
    "address_of",
    "lookup_frames",
    "lookup_values",
    "marked",
    "decoded",
    "taken_out",
    "decode_frames",
    "decode_values",
    "entries_bytes",
    "leading_within",
    "put_entries",
    "pack_records",
    "place_values",
    "unpack_records",
    "receive_reply",
    "KeyLane",
    "receive_nowait",
    "take_request",
    "send_reply",
    "GenerationBump",
    "ManagerLock",
    "ManagerState",
    "WindowState",
    "StoreState",
    "SharedState",
    "DIRECT_PUT_MAX",
    "ViewState",
    "ReaderState",
    "ConnectionState",
    "DeferredState",
    "GenerationsState",
    "HostedState",
    "LeaseState",
    "ServedTable",
    "PlainServer",
    "poll_and_serve",
]
