"""Key and value serialization: pickle protocol 5 framing and custom picklers.

A *value frame* is what travels on the wire and what a shard stores::

    [u8 fmt][3 pad][u32 nbufs][u64 payload_len][u64 buf_len] * nbufs
    [payload]  [pad][buf 0]  [pad][buf 1] ...

``fmt`` is :data:`FMT_PICKLE` (``payload`` is a pickle-5 stream whose
out-of-band buffers follow), :data:`FMT_RAW` (``payload`` is whatever a
custom value pickler wrote; no buffers) or :data:`FMT_BYTES` (``payload`` is a
``bytes`` value itself, or a ``memoryview``'s bytes: no pickle, so a chunk of a
zarr store (:class:`~dask_ddict.DDictStore`) is framed without a copy and read
back as a view of the frame with :func:`bytes_view`; it reads as ``bytes``).  Buffers are padded so that a frame
placed at an address congruent to :data:`FRAME_BASE` modulo 64 has every
buffer 64-byte aligned.  That base is chosen for where frames actually land:
LMDB puts a large value in overflow pages right after a 16-byte page header,
and the shard stores a 16-byte entry header before the frame, so a stored frame
starts at 32 modulo 64; receivers allocate their buffers with the same offset
(:func:`aligned_empty`).  Unpickling then builds numpy arrays as views of the
frame, without copying.

Keys have their own canonical encoding (:mod:`dask_ddict._keys`).
"""

from __future__ import annotations

import ctypes
import io
import mmap
import pickle
import struct
import threading
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import cloudpickle
import numpy as np

from ._forking import in_child, reinit_lock
from .errors import DDictSerializationError

ALIGN = 64
FRAME_BASE = 32
FMT_PICKLE = 0
FMT_RAW = 1
FMT_BYTES = 2
#: Part of every shard's and checkpoint store's format: bump when a frame format is
#: added that an older reader would misread (2: :data:`FMT_BYTES`, which an older
#: version would unpickle).  Frames of every earlier version still decode.
VALUE_FRAMES = 2

_HEAD = struct.Struct("<BxxxIQ")
_LEN = struct.Struct("<Q")


class KeyPickler(Protocol):
    """A custom key pickler: ``dumps`` must return bytes-like (the key's identity)."""

    def dumps(self, obj: Any) -> bytes: ...
    def loads(self, data: bytes) -> Any: ...


class ValuePickler(Protocol):
    def dump(self, obj: Any, file: Any) -> None: ...
    def load(self, file: Any) -> Any: ...


class Framed(NamedTuple):
    """A serialized value as a sequence of buffers (no joined copy) and its size.

    The common frames' parts are a tuple: a batch holds thousands of frames, and a
    tuple of bytes, unlike a list, leaves the cyclic GC's books at its first pass (a
    list would be carried into the oldest generation, whose full passes then cost
    about a fifth of a batch's time)."""

    parts: Sequence[Any]
    nbytes: int

    def join(self) -> bytes:
        """One contiguous copy (what a store needs for a single put)."""
        return b"".join(self.parts)


_new_framed = tuple.__new__  # a Framed from its fields, without NamedTuple's __new__
#: Types that pickle never writes out of band: their frame is one pickle, no buffers.
_IN_BAND = frozenset({bytes, str, int, float, bool, type(None)})


def _pad(offset: int) -> int:
    return (-(FRAME_BASE + offset)) % ALIGN


def _describe(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def dumps_value(obj: Any, pickler: ValuePickler | None = None) -> Framed:
    """Serialize a value into a frame, keeping large buffers out of band.

    Raises
    ------
    DDictSerializationError
        If the value cannot be pickled; the message names its type.
    """
    if (type(obj) is bytes or type(obj) is memoryview) and pickler is None:
        return _bytes_frame(obj)
    if type(obj) in _IN_BAND and pickler is None:  # (small values, the common case)
        payload = pickle.dumps(obj, 5)
        n = len(payload)
        return _new_framed(Framed, ((_HEAD.pack(FMT_PICKLE, 0, n), payload), _HEAD.size + n))
    if pickler is not None:
        bio = io.BytesIO()
        try:
            pickler.dump(obj, bio)
        except Exception as e:
            raise DDictSerializationError(
                f"custom value pickler failed on a value of type {_describe(obj)}: {e}"
            ) from e
        raw = bio.getbuffer()
        return Framed([_HEAD.pack(FMT_RAW, 0, len(raw)), raw], _HEAD.size + len(raw))

    buffers: list[pickle.PickleBuffer] = []
    try:
        payload = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    except Exception:
        buffers.clear()
        try:
            payload = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        except Exception as e:
            raise DDictSerializationError(
                f"cannot serialize a value of type {_describe(obj)}: {e}"
            ) from e
    if not buffers:
        return Framed([_HEAD.pack(FMT_PICKLE, 0, len(payload)), payload], _HEAD.size + len(payload))
    raws = [b.raw() for b in buffers]
    head = _HEAD.pack(FMT_PICKLE, len(raws), len(payload)) + b"".join(
        _LEN.pack(r.nbytes) for r in raws
    )
    parts: list[Any] = [head, payload]
    offset = len(head) + len(payload)
    for r in raws:
        pad = _pad(offset)
        if pad:
            parts.append(bytes(pad))
        parts.append(r)
        offset += pad + r.nbytes
    return Framed(parts, offset)


def older_frame(frame: bytes) -> bytes | None:
    """How a version before :data:`FMT_BYTES` framed the ``bytes`` value of ``frame``
    (a pickle in band), or ``None`` if ``frame`` is not a raw-bytes frame: a value
    restored from an older checkpoint compares equal in either form (``wait_for``)."""
    if len(frame) < _HEAD.size or frame[0] != FMT_BYTES:
        return None
    payload = pickle.dumps(bytes(memoryview(frame)[_HEAD.size :]), 5)
    return _HEAD.pack(FMT_PICKLE, 0, len(payload)) + payload


def _bytes_frame(obj: bytes | memoryview) -> Framed:
    """A :data:`FMT_BYTES` frame: the header and the bytes themselves (not copied)."""
    if type(obj) is memoryview and not obj.c_contiguous:
        raise DDictSerializationError(
            "cannot store a memoryview that is not C-contiguous "
            "as bytes: pass bytes(view) or a contiguous view"
        )
    if type(obj) is memoryview and (obj.format != "B" or obj.ndim != 1):
        try:
            obj = obj.cast("B")
        except TypeError as e:  # (not C-contiguous)
            raise DDictSerializationError(f"cannot store a memoryview as bytes: {e}") from e
    n = len(obj)
    return _new_framed(Framed, ((_HEAD.pack(FMT_BYTES, 0, n), obj), _HEAD.size + n))


class Taken:
    """A value a reader took out of its frame as it copied the frame out of a shard (raw
    bytes: copied once into the ``bytes`` that is the value, where a copy of the frame
    was copied again by :func:`loads_value`).  What decodes a frame returns it as it is;
    raw bytes are the same under any value pickler."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def loads_value(frame: Any, pickler: ValuePickler | None = None) -> Any:
    """Deserialize a value frame; numpy buffers become views of ``frame``."""
    if type(frame) is Taken:
        return frame.value
    if type(frame) is bytes and pickler is None:  # a small frame as received: the common case
        fmt, nbufs, plen = _HEAD.unpack_from(frame, 0)
        if not nbufs and fmt == FMT_PICKLE:
            try:
                return pickle.loads(memoryview(frame)[_HEAD.size : _HEAD.size + plen])
            except Exception as e:
                raise DDictSerializationError(f"cannot deserialize value: {e}") from e
    mv = memoryview(frame)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    fmt, nbufs, plen = _HEAD.unpack_from(mv, 0)
    offset = _HEAD.size
    if fmt == FMT_BYTES:
        return bytes(mv[offset : offset + plen])
    if not nbufs and fmt == FMT_PICKLE and pickler is None:  # small values: the common case
        try:
            return pickle.loads(mv[offset : offset + plen])
        except Exception as e:
            raise DDictSerializationError(f"cannot deserialize value: {e}") from e
    lens = [_LEN.unpack_from(mv, offset + 8 * i)[0] for i in range(nbufs)]
    offset += 8 * nbufs
    payload = mv[offset : offset + plen]
    offset += plen
    if fmt == FMT_RAW:
        if pickler is None:
            raise DDictSerializationError(
                "value was stored with a custom value pickler; read it through d.pickler(...)"
            )
        return pickler.load(io.BytesIO(payload))
    bufs = []
    for n in lens:
        offset += _pad(offset)
        bufs.append(mv[offset : offset + n])
        offset += n
    try:
        if pickler is not None:
            return pickler.load(io.BytesIO(payload))
        return pickle.loads(payload, buffers=bufs)
    except Exception as e:
        raise DDictSerializationError(f"cannot deserialize value: {e}") from e


def raw_payload(frame: Any) -> memoryview | None:
    """The bytes of a :data:`FMT_BYTES` frame as a view of ``frame``; ``None`` for any
    other frame."""
    mv = memoryview(frame)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    fmt, _, plen = _HEAD.unpack_from(mv, 0)
    return mv[_HEAD.size : _HEAD.size + plen] if fmt == FMT_BYTES else None


def bytes_view(frame: Any) -> Any:
    """The bytes of a :data:`FMT_BYTES` frame as a read-only view of ``frame`` (no copy);
    any other frame's value (:func:`loads_value`).

    What a reader that wants buffers, not ``bytes`` objects, decodes frames with:
    the view keeps ``frame`` (and so a lent snapshot) alive as long as it lives.
    """
    payload = raw_payload(frame)
    return loads_value(frame) if payload is None else payload.toreadonly()


def raw_range(frame: Any, start: int, stop: int) -> tuple[int, memoryview]:
    """``(size, part)`` of a :data:`FMT_BYTES` frame: how many bytes the value has, and
    ``value[start:stop]`` (a Python slice: a negative bound counts from the end, a
    bound past the end is cut there) as a view of ``frame``, no copy.

    What a ranged read (:class:`~dask_ddict.transport.ops.GetRange`) takes out of a
    value where it lives, so that only the part travels; an empty slice
    (``start == stop``) answers the size alone.

    Raises
    ------
    DDictSerializationError
        If the frame is not raw bytes: a pickle's bytes are not the value's, and the
        host that serves the range never unpickles (the caller reads the value whole).
    """
    payload = raw_payload(frame)
    if payload is None:
        raise DDictSerializationError(
            "a byte range of a value that is not raw bytes (a pickled value): read it whole"
        )
    return payload.nbytes, payload[start:stop]


SMALL_FRAME = 4096


def copy_frame(frame: memoryview) -> Any:
    """A private copy of a frame: aligned for large frames, plain bytes for small.

    Small frames hold no buffers worth aligning, and ``bytes()`` is several
    times cheaper than allocating an aligned numpy buffer.
    """
    if frame.nbytes < SMALL_FRAME:
        return bytes(frame)
    buf = aligned_empty(frame.nbytes)
    buf[:] = frame
    return buf


#: Buffers at least this big are mapped directly (with transparent huge pages
#: where the kernel offers them): faulting in 4 KiB pages of fresh memory costs
#: more than the copy itself on VMs (the figures: ``docs/design/storage.md``).
HUGE_BYTES = 2 << 20


def empty_buffer(nbytes: int) -> memoryview:
    """A writable, uninitialized byte buffer, page aligned when large."""
    if nbytes < HUGE_BYTES:
        return np.empty(nbytes, dtype=np.uint8).data
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            m.madvise(advice)
        except OSError:
            pass
    # The numpy view keeps the mapping alive; it is unmapped with its last view.
    return np.frombuffer(m, dtype=np.uint8).data


class Scratch:
    """A reusable buffer for transient copies (a received value, an entry being built).

    Reusing warm memory turns a page-faulting copy into a plain ``memcpy``;
    buffers above ``keep`` bytes are allocated per use and released after, so
    an idle connection or store holds at most ``keep`` bytes.  Not
    thread-safe: one per connection thread or per single-writer store.
    """

    __slots__ = ("keep", "_buf")

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._buf: memoryview | None = None

    def __repr__(self) -> str:
        size = 0 if self._buf is None else self._buf.nbytes
        return f"<Scratch size={size} keep={self.keep}>"

    def get(self, nbytes: int) -> memoryview:
        """A writable buffer of ``nbytes``, valid until the next ``get``."""
        if nbytes > self.keep:
            return empty_buffer(nbytes)
        if self._buf is None or self._buf.nbytes < nbytes:
            self._buf = empty_buffer(max(nbytes, HUGE_BYTES))
        return self._buf[:nbytes]


class BufferPool:
    """Warm buffers for received values, given back when the user drops the value.

    A value read by a client becomes the user's (numpy arrays are views of
    its buffer), so its buffer cannot be reused while anything refers to it.
    But a process that reads many values and drops them would pay page faults
    on fresh memory for every one, and fresh pages fault slowly on VMs
    (worse in Dask workers, whose ``MALLOC_TRIM_THRESHOLD_`` makes every
    allocation above 128 KiB a new mapping).  So buffers come in a few sizes
    per power of two from a free list, and a weak reference to the slice handed out
    returns the buffer to the list once the last view of it is gone (its callback; the
    reference is kept in ``_out`` until then: a ``weakref.finalize`` cost 2.4 us a
    buffer, this 1).  At most ``keep`` bytes of free buffers are kept.
    """

    MIN = 64 << 10

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.held = 0
        self._free: dict[int, list[np.ndarray]] = {}
        self._out: dict[int, tuple[weakref.ref[np.ndarray], np.ndarray]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<BufferPool held={self.held} keep={self.keep}>"

    def get(self, nbytes: int) -> memoryview:
        """A buffer of at least ``nbytes`` (its own while the returned view lives)."""
        octave = 1 << (max(nbytes, self.MIN) - 1).bit_length()
        step = max(self.MIN, octave >> 3)  # eight sizes per power of two: little waste
        size = -(-nbytes // step) * step
        if size > self.keep:
            return np.frombuffer(empty_buffer(nbytes), dtype=np.uint8).data
        with self._lock:
            free = self._free.get(size)
            buf = free.pop() if free else None
            if buf is not None:
                self.held -= size
        if buf is None:
            buf = np.frombuffer(empty_buffer(size), dtype=np.uint8)
        view = buf[:]  # the handle: when it and every view of it are gone, buf comes back
        ref = weakref.ref(view, self._back)
        self._out[id(ref)] = (ref, buf)
        return view.data

    def _back(self, ref: weakref.ref[np.ndarray]) -> None:
        out = self._out.pop(id(ref), None)
        if out is not None:
            self._put(out[1])

    def _put(self, buf: np.ndarray) -> None:
        size = buf.nbytes
        with self._lock:
            if self.held + size <= self.keep:
                self._free.setdefault(size, []).append(buf)
                self.held += size


_POOL: BufferPool | None = None


def _forked() -> None:
    if _POOL is not None:  # (another thread of the parent may have held its lock)
        reinit_lock(_POOL._lock)


in_child(_forked)


def _pool() -> BufferPool:
    global _POOL
    if _POOL is None:
        from . import config

        _POOL = BufferPool(config.get_bytes("buffers.pool-bytes"))
    return _POOL


def aligned_empty(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` whose start is :data:`FRAME_BASE` mod 64.

    Receivers read a value frame into it so that out-of-band buffers come out
    64-byte aligned, as they are in the shard.  Large ones come warm from the
    :class:`BufferPool`.
    """
    raw = _pool().get(nbytes + ALIGN) if nbytes >= BufferPool.MIN else empty_buffer(nbytes + ALIGN)
    # (a writable buffer's address, through ctypes: a seventh of numpy's
    # ``__array_interface__``; ``kernels.address_of`` reads any buffer's, but the
    # kernels import this module)
    start = (FRAME_BASE - ctypes.addressof(ctypes.c_char.from_buffer(raw))) % ALIGN
    return raw[start : start + nbytes]


def frame_parts(frame: Any) -> tuple[Sequence[Any], int]:
    """``(parts, nbytes)`` of a frame given as a buffer, a :class:`Framed` or ``None``."""
    if frame is None:
        return [], 0
    if isinstance(frame, Framed):
        return frame.parts, frame.nbytes
    return [frame], memoryview(frame).nbytes


def gather(
    parts: Sequence[Any],
    nbytes: int,
    head: bytes = b"",
    tail: bytes = b"",
    scratch: Scratch | None = None,
) -> Any:
    """``head + parts + tail`` as one buffer, copying each part once.

    Large results are built in ``scratch`` when given (valid until its next use).
    """
    total = len(head) + nbytes + len(tail)
    if total < HUGE_BYTES:
        return b"".join((head, *parts, tail))
    out = empty_buffer(total) if scratch is None else scratch.get(total)
    off = 0
    for p in (head, *parts, tail):
        mv = memoryview(p).cast("B")
        out[off : off + mv.nbytes] = mv
        off += mv.nbytes
    return out
