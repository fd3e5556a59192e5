# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The per-key loops of :mod:`.pure`, typed and compiled (Cython).

The same functions with the same results and errors (``tests/test_kernels.py``
compares them on fuzzed input); :mod:`.pure` is where each rule is explained.
What is faster here: the loops and their integer and byte work run in C, lengths
and headers are read from the buffers themselves, and the default key encoding,
digest and value decoding are called without the Python functions that wrap them.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.memoryview cimport PyMemoryView_FromMemory
from libc.stdint cimport int64_t, uint32_t, uint64_t
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from libc.string cimport memcmp, memcpy

import pickle
import struct

from .._hashing import _BLAKE2B, key_digest
from .._keys import _ATOMS, encode_key
from .._serialize import _HEAD as _HEAD_STRUCT, FMT_BYTES, FMT_PICKLE
from .._entry import DIGEST, ENTRY_HEADER, TOMBSTONE
from .pure import ABSENT, ALIGN, JOIN, PADS, WAIT, KeyTooLong

cdef extern from "Python.h":
    int PyBUF_READ

cdef object _dumps = pickle.dumps
cdef object _loads = pickle.loads
cdef object _blake_copy = _BLAKE2B.copy
cdef object _key_digest = key_digest
cdef object _encode_key = encode_key
cdef frozenset _atoms = _ATOMS
cdef Py_ssize_t _DIGEST = DIGEST
cdef Py_ssize_t _ENTRY_HEADER = ENTRY_HEADER
cdef int _TOMBSTONE = TOMBSTONE
cdef Py_ssize_t _ALIGN = ALIGN
cdef int64_t _ABSENT = ABSENT
cdef int64_t _WAIT = WAIT
cdef list _PADS = PADS
cdef Py_ssize_t _JOIN = JOIN
cdef bytes _EMPTY = b""
cdef Py_ssize_t _HEAD = _HEAD_STRUCT.size  # a value frame's header: fmt, nbufs, plen
cdef int _FMT_PICKLE = FMT_PICKLE
cdef int _FMT_BYTES = FMT_BYTES


cdef inline uint64_t _le64(const unsigned char* p) noexcept nogil:
    cdef uint64_t v = 0
    cdef int i
    for i in range(7, -1, -1):
        v = (v << 8) | p[i]
    return v


cdef inline uint32_t _le32(const unsigned char* p) noexcept nogil:
    return p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline void _put_le64(unsigned char* p, uint64_t v) noexcept nogil:
    cdef int i
    for i in range(8):
        p[i] = v & 0xFF
        v >>= 8


cdef inline bytes _digest(bytes kb, object digest):
    if digest is _key_digest:
        h = _blake_copy()
        h.update(kb)
        return h.digest()
    return digest(kb)


cdef object _pickled_str(str s):
    """``pickle.dumps(s, 5)`` for a str of under 256 UTF-8 bytes, written here, or None
    (a longer one, or one with lone surrogates: pickle writes it)::

        PROTO 5 | FRAME <u64 n + 4> | SHORT_BINUNICODE <u8 n> utf-8 | MEMOIZE | STOP
    """
    cdef Py_ssize_t n
    cdef const char* u
    try:
        u = PyUnicode_AsUTF8AndSize(s, &n)
    except UnicodeEncodeError:
        return None
    if n >= 256:
        return None
    cdef bytes out = PyBytes_FromStringAndSize(NULL, n + 15)
    cdef unsigned char* p = <unsigned char*>PyBytes_AS_STRING(out)
    p[0] = 0x80
    p[1] = 5
    p[2] = 0x95
    _put_le64(p + 3, <uint64_t>(n + 4))
    p[11] = 0x8c
    p[12] = <unsigned char>n
    memcpy(p + 13, u, n)
    p[13 + n] = 0x94
    p[14 + n] = 0x2e
    return out


def route(list keys, Py_ssize_t n, Py_ssize_t most, object encode, object placed,
          frozenset plain, object digest):
    cdef list out = []
    cdef bint fast = encode is _encode_key
    cdef object kb
    cdef bytes d
    for key in keys:
        kb = None
        if fast and type(key) is str:
            kb = _pickled_str(<str>key)
        if kb is not None:
            pass
        elif fast and type(key) in _atoms:
            kb = _dumps(key, 5)
        else:
            kb = encode(key)
        if len(kb) > most:
            raise KeyTooLong(kb)
        d = _digest(kb, digest) if type(kb) is bytes else digest(kb)
        if placed is None or type(key) in plain:
            if n <= 0:
                raise ZeroDivisionError("integer modulo by zero")
            if PyBytes_GET_SIZE(d) < 8:
                raise ValueError("a digest is shorter than 8 bytes")
            out.append((_le64(<const unsigned char*>PyBytes_AS_STRING(d)) % <uint64_t>n, d))
        else:
            out.append((placed(key, d, n), d))
    return out


def group(list routes):
    cdef dict groups = {}
    for mid, digest in routes:
        got = groups.get(mid)
        if got is None:
            groups[mid] = [digest]
        else:
            (<list>got).append(digest)
    return groups


cdef inline Py_ssize_t _frame_len(object f) except? -3:
    if type(f) is memoryview:
        return (<object>f).nbytes
    if f is None:
        return _ABSENT
    if f is False:
        return _WAIT
    if type(f) is bytes:
        return PyBytes_GET_SIZE(f)
    return memoryview(f).nbytes


def pack_frames(list frames):
    cdef Py_ssize_t n = len(frames), i, ln, hlen = 4 + 8 * n
    cdef bytes head = PyBytes_FromStringAndSize(NULL, hlen)
    cdef unsigned char* h = <unsigned char*>PyBytes_AS_STRING(head)
    cdef list parts = []
    cdef list run = [head, _PADS[hlen % _ALIGN]]
    h[0] = n & 0xFF
    h[1] = (n >> 8) & 0xFF
    h[2] = (n >> 16) & 0xFF
    h[3] = (n >> 24) & 0xFF
    for i in range(n):  # (the table first: a run's join copies it)
        _put_le64(h + 4 + 8 * i, <uint64_t>_frame_len(frames[i]))
    for i in range(n):
        f = frames[i]
        ln = <int64_t>_le64(h + 4 + 8 * i)
        if ln < 0:
            continue
        if ln < _JOIN:
            run.append(f)
            run.append(_PADS[ln % _ALIGN])
            continue
        parts.append(_EMPTY.join(run))
        parts.append(f)
        run = [_PADS[ln % _ALIGN]]
    last = _EMPTY.join(run)
    if PyBytes_GET_SIZE(last):
        parts.append(last)
    return parts


def unpack_frames(payload):
    mv = memoryview(payload).cast("B")
    cdef Py_buffer view
    PyObject_GetBuffer(mv, &view, PyBUF_SIMPLE)
    cdef const unsigned char* p = <const unsigned char*>view.buf
    cdef Py_ssize_t size = view.len, off, i, n
    cdef int64_t ln
    cdef list out = []
    try:
        if size < 4:
            raise ValueError(f"a many-key reply of {size} bytes has no table")
        n = _le32(p)
        if 4 + 8 * n > size:
            raise ValueError(f"a many-key reply of {size} bytes cannot hold {n} lengths")
        off = 4 + 8 * n
        off += (_ALIGN - off % _ALIGN) % _ALIGN
        for i in range(n):
            ln = <int64_t>_le64(p + 4 + 8 * i)
            if ln < 0:
                out.append(None if ln == _ABSENT else False)
                continue
            if off + ln > size:
                raise ValueError(f"a many-key reply of {size} bytes ends inside a frame")
            out.append(mv[off : off + ln])
            off += ln + (_ALIGN - ln % _ALIGN) % _ALIGN
    finally:
        PyBuffer_Release(&view)
    return out


def lookup_frames(cursor, list digests, bytes tail, Py_ssize_t small=0):
    seek, key, value = cursor.set_range, cursor.key, cursor.value
    cdef list out = []
    cdef Py_buffer kv, vv
    cdef bytes d
    cdef bint same
    cdef uint64_t n
    cdef Py_ssize_t have
    for d in digests:
        if not seek(d + tail):
            out.append(None)
            continue
        k = key()
        PyObject_GetBuffer(k, &kv, PyBUF_SIMPLE)
        same = (kv.len >= _DIGEST and PyBytes_GET_SIZE(d) == _DIGEST
                and memcmp(kv.buf, PyBytes_AS_STRING(d), _DIGEST) == 0)
        PyBuffer_Release(&kv)
        if not same:
            out.append(None)
            continue
        raw = value()
        PyObject_GetBuffer(raw, &vv, PyBUF_SIMPLE)
        try:
            if vv.len < _ENTRY_HEADER:
                raise struct.error(f"a shard entry of {vv.len} bytes has no header")
            if (<const unsigned char*>vv.buf)[0] & _TOMBSTONE:
                out.append(None)
                continue
            n = _le64(<const unsigned char*>vv.buf + 8)
            if n < <uint64_t>small:  # (a copy, as bytes(raw[16 : 16 + n]) makes it)
                have = vv.len - _ENTRY_HEADER
                out.append(PyBytes_FromStringAndSize(<char*>vv.buf + _ENTRY_HEADER,
                                                     have if <uint64_t>have < n else <Py_ssize_t>n))
                continue
        finally:
            PyBuffer_Release(&vv)
        out.append(raw[_ENTRY_HEADER : _ENTRY_HEADER + n])
    return out


cdef object _small(object frame):
    """The value of a small frame (bytes, or a pickle without out-of-band buffers), or
    NotImplemented (decode it the general way)."""
    cdef Py_buffer fv
    if PyObject_GetBuffer(frame, &fv, PyBUF_SIMPLE) < 0:
        return NotImplemented
    cdef const unsigned char* p = <const unsigned char*>fv.buf
    cdef uint64_t plen
    try:
        if fv.len < _HEAD:
            return NotImplemented
        plen = _le64(p + 8)
        if plen > <uint64_t>(fv.len - _HEAD):
            return NotImplemented
        if p[0] == _FMT_BYTES:
            return PyBytes_FromStringAndSize(<char*>p + _HEAD, plen)
        if p[0] != _FMT_PICKLE or _le32(p + 4) != 0:
            return NotImplemented
        try:
            return _loads(PyMemoryView_FromMemory(<char*>p + _HEAD, plen, PyBUF_READ))
        except Exception:
            return NotImplemented
    finally:
        PyBuffer_Release(&fv)


def decode_frames(list keys, list mids, dict got, object decode, object absent, object wait,
                  bint small):
    cdef dict frames = {mid: iter(fs) for mid, fs in got.items()}
    cdef list out = []
    cdef Py_ssize_t i, n = len(keys)
    if len(mids) < n:
        n = len(mids)
    for i in range(n):
        frame = next(frames[mids[i]])
        if frame is None:
            value = absent
        elif frame is False:
            value = wait
        else:
            value = _small(frame) if small else NotImplemented
            if value is NotImplemented:
                value = decode(frame)
        out.append((keys[i], value))
    return out


def values_of(list pairs, object absent, object wait):
    cdef Py_ssize_t i, n = len(pairs)
    cdef list values = [None] * n
    cdef list marked = []
    for i in range(n):
        v = (<tuple?>pairs[i])[1]
        values[i] = v
        if v is absent or v is wait:
            marked.append(i)
    return values, marked
