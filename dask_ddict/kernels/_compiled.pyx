# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The per-key loops of :mod:`.pure`, typed and compiled (Cython).

The same functions with the same results and errors (``tests/test_kernels.py``
compares them on fuzzed input); :mod:`.pure` is where each rule is explained.
What is faster here: the loops and their integer and byte work run in C, lengths
and headers are read from the buffers themselves, and the default key encoding,
digest and value decoding are called without the Python functions that wrap them.
"""

cimport cython
from cpython.buffer cimport (
    PyBUF_FULL_RO,
    PyObject_CheckBuffer,
    PyBUF_SIMPLE,
    PyBuffer_IsContiguous,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.memoryview cimport PyMemoryView_FromMemory
from cpython.object cimport PyObject_TypeCheck, PyTypeObject
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t, uint64_t
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.list cimport PyList_Append, PyList_GET_SIZE
from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Malloc
from cpython.tuple cimport PyTuple_GET_SIZE
from libc.string cimport memcmp, memcpy, memset
from libc.errno cimport EAGAIN, EBADF, EINTR, errno

import _socket
import os
import pickle
import secrets
import socket
import struct
import threading
import time

from .._hashing import key_digest
from .._keys import _ATOMS, encode_key
from .._serialize import _HEAD as _HEAD_STRUCT, FMT_BYTES, FMT_PICKLE, HUGE_BYTES, Framed, Taken, dumps_value, frame_parts
from .._entry import BE, DIGEST, ENTRY_HEADER, MAXQ, PERSISTENT, TOMBSTONE, Entry
from .pure import (_UNEVEN, ABSENT, ALIGN, BATCH_RECORD, BIG_REPLY, CACHED_KEY_BYTES, GROUP, JOIN,
                   NO_KEY, PADS, QUIET, REPLY, REQUEST, RID, RID_ID, RID_KEEP, RID_SEQ, RID_SLOT,
                   SERVED_OPS, SPAN, WAIT, Decoded, KeyTooLong, Resend)

if BATCH_RECORD.format != "<IIQ":  # (written here byte by byte: see pack_records)
    raise ImportError(f"kernels._compiled writes batch records as <IIQ, not {BATCH_RECORD.format}")
if REPLY.format != "<BxxxIqQ":  # (read here byte by byte: see receive_reply, send_reply)
    raise ImportError(f"kernels._compiled reads replies as <BxxxIqQ, not {REPLY.format}")
if RID_ID.format != "<Q":  # (written here byte by byte: see _keep_reply)
    raise ImportError(f"kernels._compiled keeps request ids as <Q, not {RID_ID.format}")
if GROUP.format != "<II":  # (read here byte by byte: see digest_groups)
    raise ImportError(f"kernels._compiled reads many-key tables as <II, not {GROUP.format}")
if SPAN.format != "<qq" or _HEAD_STRUCT.format != "<BxxxIQ":  # (read here: PlainServer._range)
    raise ImportError(f"kernels._compiled reads ranges as <qq of <BxxxIQ frames, not "
                      f"{SPAN.format} of {_HEAD_STRUCT.format}")
if DIGEST != 16:  # (written here: see _blake16)
    raise ImportError(f"kernels._compiled writes 16-byte key digests, not {DIGEST}")
if REQUEST.format != "<BBHIIIqqQdQQ":  # (read here byte by byte: see take_request)
    raise ImportError(f"kernels._compiled reads requests as <BBHIIIqqQdQQ, not {REQUEST.format}")

cdef extern from "Python.h":
    int PyBUF_READ
    int PyBUF_WRITABLE
    int PyErr_CheckSignals() except -1

cdef extern from "<errno.h>":
    int EWOULDBLOCK

cdef extern from "<sys/socket.h>" nogil:
    ssize_t recv(int fd, void* buf, size_t n, int flags)
    ssize_t send(int fd, const void* buf, size_t n, int flags)
    int MSG_DONTWAIT

cdef extern from "<time.h>" nogil:
    ctypedef int clockid_t
    struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(clockid_t clk, timespec* tp)

cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd* fds, unsigned long nfds, int timeout)
    short POLLIN
    short POLLOUT
    short POLLNVAL

cdef clockid_t _MONOTONIC = time.CLOCK_MONOTONIC  # (time.monotonic()'s clock)

cdef extern from *:
    """
    /* The head of CPython's socket object (socketmodule.h's PySocketSockObject, whose
       first field has been its descriptor since Python 2): socket.fileno()'s answer. */
    typedef struct { PyObject_HEAD int sock_fd; } ddict_socket_head;
    """
    ctypedef struct ddict_socket_head:
        int sock_fd

cdef type _SOCKET = _socket.socket
cdef type _SOCKET_SOCKET = socket.socket  # (its subclass that most sockets are)


cdef inline int _fd_of(object sock) except? -2:
    """``sock.fileno()``: -1 once it is closed.  A socket of the standard library's (or of
    a subclass: ``socket.socket``, ``ssl.SSLSocket``) is read in place, as ``fileno``
    reads it, without a method call on every request; any other object is asked."""
    if type(sock) is _SOCKET_SOCKET or PyObject_TypeCheck(sock, <PyTypeObject*>_SOCKET):
        return (<ddict_socket_head*><PyObject*>sock).sock_fd  # (socket.socket's first)
    return sock.fileno()


cdef inline bint _small_int(object v, long long most, long long* out):
    """Whether ``v`` is an ``int`` in ``[0, most]`` (put in ``out``): what a request
    header's field takes (anything else, the Python path packs or refuses)."""
    cdef int overflow
    if type(v) is not int:
        return False
    out[0] = PyLong_AsLongLongAndOverflow(v, &overflow)
    return overflow == 0 and 0 <= out[0] <= most


cdef inline bint _signed_int(object v, long long* out):
    """Whether ``v`` is an ``int`` of 64 bits, signed (put in ``out``)."""
    cdef int overflow
    if type(v) is not int:
        return False
    out[0] = PyLong_AsLongLongAndOverflow(v, &overflow)
    return overflow == 0


cdef inline double _monotonic() noexcept nogil:
    """``time.monotonic()``."""
    cdef timespec t
    clock_gettime(_MONOTONIC, &t)
    return t.tv_sec + t.tv_nsec * 1e-9


cdef object _dumps = pickle.dumps
cdef object _dumps_value = dumps_value
cdef object _loads = pickle.loads
cdef object _key_digest = key_digest
cdef object _encode_key = encode_key
cdef object _Entry = Entry
cdef object _MAXQ = MAXQ
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


cdef object _tuple_new = tuple.__new__


cdef extern from *:
    """
    /* Whether t is a subtype of tuple with a tuple's layout (a named tuple's), on a
       Python whose tuples keep nothing but their items: 3.14 caches a tuple's hash in
       it (ob_hash, -1 until computed), which tuple_subtype_new resets and a zeroed
       allocation would leave at 0, a wrong hash; there tuple.__new__ is called. */
    static int ddict_tuple_layout(PyTypeObject* t) {
    #if PY_VERSION_HEX >= 0x030E0000
        (void)t;
        return 0;
    #else
        return t->tp_base == &PyTuple_Type && t->tp_basicsize == PyTuple_Type.tp_basicsize
            && t->tp_itemsize == PyTuple_Type.tp_itemsize;
    #endif
    }
    /* An instance of such a t from a tuple of its fields, as tuple.__new__(t, fields)
       makes one of a subtype (tuple_subtype_new: the subtype's allocation, the fields
       set in it), without that call's wrapper and argument parsing. */
    static PyObject* ddict_new_tuple(PyTypeObject* t, PyObject* fields) {
        Py_ssize_t n = PyTuple_GET_SIZE(fields), i;
        PyObject* o = t->tp_alloc(t, n);
        if (o == NULL)
            return NULL;
        for (i = 0; i < n; i++) {
            PyObject* x = PyTuple_GET_ITEM(fields, i);
            Py_INCREF(x);
            PyTuple_SET_ITEM(o, i, x);
        }
        return o;
    }
    """
    bint ddict_tuple_layout(PyTypeObject* t)
    object ddict_new_tuple(PyTypeObject* t, tuple fields)


cdef inline object _new_tuple(type cls, tuple fields):
    """``tuple.__new__(cls, fields)``: a named tuple from its fields, without its
    ``__new__`` (a Python function) nor ``tuple.__new__``'s call."""
    if ddict_tuple_layout(<PyTypeObject*>cls):
        return ddict_new_tuple(<PyTypeObject*>cls, fields)
    return _tuple_new(cls, fields)  # (another layout: the general call)


include "framing.pxi"  # (the header's C functions, named here as the kernels use them)


cdef inline int64_t _aligned(int64_t n) noexcept nogil:
    """``n`` rounded up to a multiple of ``ALIGN`` (where a many-key reply's next frame
    starts; ``(ALIGN - n % ALIGN) % ALIGN``, not ``-n % ALIGN``: C's ``%`` is signed)."""
    return n + (_ALIGN - n % _ALIGN) % _ALIGN


# -- the key digest: BLAKE2b of 16 bytes (RFC 7693), as hashlib makes it ---------------
#
# hashlib's object per key (a copy of a primed one, ``update``, ``digest``) cost about as
# much again as the hash itself: written in C (``ddict_digest``, ddict_wire.h), a key's
# digest takes 180 ns where it took 245 (a 20-byte key; ``tests/test_kernels.py`` checks
# it against hashlib's).

cdef bytes _blake16(const unsigned char* p, Py_ssize_t n):
    """:func:`ddict_digest` as ``bytes``."""
    out = PyBytes_FromStringAndSize(NULL, 16)
    ddict_digest(p, n, <unsigned char*>PyBytes_AS_STRING(out))
    return out


def blake16(bytes data not None):
    """``key_digest(data)``, computed here (for the tests that compare it with hashlib's)."""
    return _blake16(<const unsigned char*>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))


cdef inline bytes _digest(bytes kb, object digest):
    if digest is _key_digest:
        return _blake16(<const unsigned char*>PyBytes_AS_STRING(kb), PyBytes_GET_SIZE(kb))
    return digest(kb)


cdef object _pickled_str(str s):
    """``pickle.dumps(s, 5)`` for a str of under 256 UTF-8 bytes, written by
    :func:`ddict_str_key`, or None (a longer one, or one with lone surrogates: pickle
    writes it)."""
    cdef Py_ssize_t n
    cdef const char* u
    cdef unsigned char p[DDICT_KEY_BYTES_MOST]
    try:
        u = PyUnicode_AsUTF8AndSize(s, &n)
    except UnicodeEncodeError:
        return None
    n = ddict_str_key(u, n, p)
    return None if n == 0 else PyBytes_FromStringAndSize(<char*>p, n)


cdef object _pickled_int(object x):
    """``pickle.dumps(x, 5)`` for an int of 32 bits, written by :func:`ddict_int_key`
    (pickle's own call costs more than half a route: it makes a pickler), or None (a
    larger one: pickle writes it)."""
    cdef int overflow = 0
    cdef long long v = PyLong_AsLongLongAndOverflow(x, &overflow)
    cdef unsigned char p[24]
    cdef size_t n = 0 if overflow else ddict_int_key(v, p)
    return None if n == 0 else PyBytes_FromStringAndSize(<char*>p, n)


cdef inline object _encoded(object key, bint fast, object encode):
    """The key's bytes: a short str, a 32-bit int and the atoms written here, the rest
    by ``encode``."""
    cdef object kb = None
    if fast and type(key) is str:
        kb = _pickled_str(<str>key)
    elif fast and type(key) is int:
        kb = _pickled_int(key)
    if kb is not None:
        return kb
    if fast and type(key) in _atoms:
        return _dumps(key, 5)
    return encode(key)


cdef inline object _by_digest(bytes d, Py_ssize_t n):
    if n <= 0:
        raise ZeroDivisionError("integer modulo by zero")
    if PyBytes_GET_SIZE(d) < 8:
        raise ValueError("a digest is shorter than 8 bytes")
    return ddict_manager_of(<const unsigned char*>PyBytes_AS_STRING(d), <uint64_t>n)


def route(list keys, Py_ssize_t n, Py_ssize_t most, object encode, object placed,
          frozenset plain, object digest):
    cdef list out = []
    cdef bint fast = encode is _encode_key
    cdef object kb
    cdef bytes d
    for key in keys:
        kb = _encoded(key, fast, encode)
        if len(kb) > most:
            raise KeyTooLong(kb)
        d = _digest(kb, digest) if type(kb) is bytes else digest(kb)
        if placed is None or type(key) in plain:
            out.append((_by_digest(d, n), d))
        else:
            out.append((placed(key, d, n), d))
    return out


cdef Py_ssize_t _CACHED_KEY = CACHED_KEY_BYTES


@cython.final  # (the key lane calls one and record in C)
cdef class Router:
    cdef readonly Py_ssize_t n, most, cached
    cdef readonly object encode, placed, digest
    cdef readonly frozenset plain
    cdef bint fast
    cdef readonly dict _routes

    def __init__(self, Py_ssize_t n, Py_ssize_t most, object encode, object placed,
                 frozenset plain, object digest, Py_ssize_t cached=0):
        self.n, self.most, self.encode, self.placed = n, most, encode, placed
        self.plain, self.digest = plain, digest
        self.fast = encode is _encode_key
        self.cached = cached if self.fast else 0
        self._routes = {}

    def __repr__(self):
        return f"<Router managers={self.n} most={self.most}>"

    def many(self, list keys):
        if self.cached <= 0:
            return route(keys, self.n, self.most, self.encode, self.placed, self.plain,
                         self.digest)
        cdef dict routes = self._routes
        cdef list out = []
        cdef object kb, got
        cdef bytes d
        cdef bint cacheable
        for key in keys:
            t = type(key)
            cacheable = (t is str or t is int) and (self.placed is None or t in self.plain)
            if cacheable:
                got = routes.get(key)
                if got is not None:
                    out.append(got)
                    continue
            kb = _encoded(key, True, self.encode)
            if len(kb) > self.most:
                raise KeyTooLong(kb)
            d = _digest(kb, self.digest) if type(kb) is bytes else self.digest(kb)
            if self.placed is None or t in self.plain:
                got = (_by_digest(d, self.n), d)
            else:
                got = (self.placed(key, d, self.n), d)
            if cacheable and len(kb) <= _CACHED_KEY:
                if len(routes) >= self.cached:
                    routes.clear()
                routes[key] = got
            out.append(got)
        return out

    cpdef tuple one(self, object key):
        cdef object kb = _encoded(key, self.fast, self.encode)
        cdef bytes d
        if len(kb) > self.most:
            raise KeyTooLong(kb)
        d = _digest(kb, self.digest) if type(kb) is bytes else self.digest(kb)
        if self.placed is None or type(key) in self.plain:
            return _by_digest(d, self.n), d, kb
        return self.placed(key, d, self.n), d, kb

    cpdef tuple record(self, object key, object value, object dumps):
        return self.one(key) + (self.framed(value, dumps),)

    cpdef object framed(self, object value, object dumps):
        cdef Py_ssize_t n
        cdef bytes head
        if type(value) is not bytes or dumps is not _dumps_value:
            return dumps(value)
        n = PyBytes_GET_SIZE(value)  # (dumps_value's FMT_BYTES frame: the header, the bytes)
        head = PyBytes_FromStringAndSize(NULL, DDICT_VALUE_HEAD_BYTES)
        ddict_bytes_value_head(<unsigned char*>PyBytes_AS_STRING(head), <uint64_t>n)
        return _new_tuple(Framed, ((head, value), DDICT_VALUE_HEAD_BYTES + n))


def group(list routes not None):
    cdef dict groups = {}
    for mid, digest in routes:
        got = groups.get(mid)
        if got is None:
            groups[mid] = [digest]
        else:
            (<list>got).append(digest)
    return groups


def group_positions(list routes not None):
    cdef Py_ssize_t n = PyList_GET_SIZE(routes), i, g, ngroups = 0
    cdef Py_ssize_t table[256]  # (a small manager id's group, or -1: the ids layouts use)
    cdef Py_ssize_t* slot = <Py_ssize_t*>PyMem_Malloc((n + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t* fill = NULL
    cdef long long m
    cdef int overflow = 0
    cdef dict index = {}  # (any other id's group)
    cdef list mids = [], digs = [], places = []
    cdef object route, mid, digest
    if slot == NULL:
        raise MemoryError()
    memset(table, 0xFF, sizeof(table))
    try:
        for i in range(n):  # each key's group, its digest appended to the group's
            if i >= PyList_GET_SIZE(routes):  # (shrunk by a manager id's __hash__: as the
                n = i  # pure loop's iterator, the routes left are not read; routes that
                break  # one appends are not read here, where the pure loop reads them)
            route = (<list>routes)[i]
            if type(route) is tuple and PyTuple_GET_SIZE(route) == 2:
                mid, digest = (<tuple>route)[0], (<tuple>route)[1]
            else:
                mid, digest = route  # (as the pure loop unpacks it, with its errors)
            g = -1
            m = PyLong_AsLongLongAndOverflow(mid, &overflow) if type(mid) is int else -1
            if 0 <= m < 256 and not overflow:
                g = table[m]
            if g < 0:  # (every group is in index too: an equal id of another type, True
                found = index.get(mid)  # for 1, finds the group as the pure dict does)
                if found is not None:
                    g = <Py_ssize_t>found
                    if 0 <= m < 256 and not overflow:
                        table[m] = g
            if g < 0:
                g = ngroups
                ngroups += 1
                if 0 <= m < 256 and not overflow:
                    table[m] = g
                index[mid] = g
                mids.append(mid)
                digs.append([])
            (<list>digs[g]).append(digest)
            slot[i] = g
        fill = <Py_ssize_t*>PyMem_Calloc(ngroups + 1, sizeof(Py_ssize_t))
        if fill == NULL:
            raise MemoryError()
        for g in range(ngroups):  # each group's positions: u32s, in its keys' order
            places.append(PyBytes_FromStringAndSize(NULL, 4 * PyList_GET_SIZE(digs[g])))
        for i in range(n):
            g = slot[i]
            _put_le32(PyBytes_AS_STRING(<bytes>places[g]) + fill[g], <uint32_t>i)
            fill[g] += 4
        return {mids[g]: (digs[g], places[g]) for g in range(ngroups)}
    finally:
        PyMem_Free(slot)
        PyMem_Free(fill)


def marked(list values, object absent):
    cdef Py_ssize_t i
    cdef list out = []
    for i in range(PyList_GET_SIZE(values)):
        if (<list>values)[i] is absent:
            out.append(i)
    return out


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


def digest_groups(value):
    cdef bytes raw = value if type(value) is bytes else memoryview(value).cast("B").tobytes()
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(raw)
    cdef Py_ssize_t end = PyBytes_GET_SIZE(raw), i, j
    cdef uint64_t n, off, stop  # (sums of 32-bit counts: never past 64 bits, nor past end)
    cdef list out = [], digests
    if end < 4:
        raise ValueError(f"a many-key request of {end} bytes has no table")
    n = _le32(p)
    off = 4 + 8 * n
    if off > <uint64_t>end:
        raise ValueError(f"a many-key request of {end} bytes cannot hold {n} groups")
    for i in range(<Py_ssize_t>n):
        stop = off + <uint64_t>_DIGEST * _le32(p + 8 + 8 * i)
        if stop > <uint64_t>end:
            raise ValueError(f"a many-key request of {end} bytes ends inside its digests")
        digests = []
        j = <Py_ssize_t>off
        while j < <Py_ssize_t>stop:
            digests.append(PyBytes_FromStringAndSize(<const char*>p + j, _DIGEST))
            j += _DIGEST
        out.append((_le32(p + 4 + 8 * i), digests))
        off = stop
    if off != <uint64_t>end:
        raise ValueError(f"a many-key request of {end} bytes goes on after its digests")
    return out


cdef Py_ssize_t _frames_at(const unsigned char* p, Py_ssize_t size, Py_ssize_t* n) except -1:
    """Where the first frame of a many-key reply of ``size`` bytes at ``p`` starts, its
    table's count of frames in ``n``; the errors of a reply too short for its table."""
    if size < 4:
        raise ValueError(f"a many-key reply of {size} bytes has no table")
    n[0] = _le32(p)
    if 4 + 8 * n[0] > size:
        raise ValueError(f"a many-key reply of {size} bytes cannot hold {n[0]} lengths")
    return _aligned(4 + 8 * n[0])


def unpack_frames(payload, Py_ssize_t small=0):
    mv = memoryview(payload).cast("B")
    cdef Py_buffer view
    PyObject_GetBuffer(mv, &view, PyBUF_SIMPLE)
    cdef const unsigned char* p = <const unsigned char*>view.buf
    cdef Py_ssize_t size = view.len, off, i, n
    cdef int64_t ln
    cdef list out = []
    try:
        off = _frames_at(p, size, &n)
        for i in range(n):
            ln = <int64_t>_le64(p + 4 + 8 * i)
            if ln < 0:
                out.append(None if ln == _ABSENT else False)
                continue
            if ln > size - off:  # (not off + ln: a length near 2**63 would wrap)
                raise ValueError(f"a many-key reply of {size} bytes ends inside a frame")
            if ln < small:
                out.append(PyBytes_FromStringAndSize(<char*>p + off, <Py_ssize_t>ln))
            else:
                out.append(mv[off : off + ln])
            off += _aligned(ln)
    finally:
        PyBuffer_Release(&view)
    return out


def unpack_values(payload, list counts, Py_ssize_t small, object absent, object decode):
    mv = memoryview(payload).cast("B")
    cdef Py_buffer view
    PyObject_GetBuffer(mv, &view, PyBUF_SIMPLE)
    cdef const unsigned char* p = <const unsigned char*>view.buf
    cdef Py_ssize_t size = view.len, start, off, i, n, k, total = 0
    cdef int64_t ln
    cdef bint waits = False
    cdef list out
    cdef object values  # (a Decoded: a list, not exactly one)
    try:
        off = start = _frames_at(p, size, &n)
        for i in range(n):  # (first the table, as unpack_frames checks it: nothing decoded)
            ln = <int64_t>_le64(p + 4 + 8 * i)
            if ln < 0:
                waits = waits or ln != _ABSENT
                continue
            if ln > size - off:  # (not off + ln: a length near 2**63 would wrap)
                raise ValueError(f"a many-key reply of {size} bytes ends inside a frame")
            off += _aligned(ln)
        for c in counts:
            total += c
        if total != n:
            raise ValueError(f"a many-key reply has {n} frames for {total} keys")
        if waits:
            return None
        out, off, i = [], start, 0
        for c in counts:
            values = Decoded()
            for k in range(c):
                ln = <int64_t>_le64(p + 4 + 8 * i)
                i += 1
                if ln < 0:
                    PyList_Append(values, absent)
                    continue
                if ln < small:
                    value = _small_at(p + off, <Py_ssize_t>ln)
                    if value is NotImplemented:
                        value = decode(PyBytes_FromStringAndSize(<char*>p + off, <Py_ssize_t>ln))
                else:
                    value = decode(mv[off : off + ln])
                PyList_Append(values, value)
                off += _aligned(ln)
            out.append(values)
        return out
    finally:
        PyBuffer_Release(&view)


def decoded(frame, decode):
    return _frame_value(frame, decode)


cdef inline object _frame_value(object frame, object decode):
    """One value's frame decoded: a small one here, any other by ``decode`` (which takes
    a value already taken out of its frame, ``_serialize.Taken``, no buffer, as it is)."""
    cdef object value = _small(frame) if PyObject_CheckBuffer(frame) else NotImplemented
    return decode(frame) if value is NotImplemented else value


def taken_out(list frames, object out):
    cdef list taken = []
    cdef Py_ssize_t nbytes = 0, copies = 0
    for f in frames:
        if type(f) is memoryview:
            f = out(f)
        elif type(f) is bytes:
            nbytes += PyBytes_GET_SIZE(f)
            copies += 1
        taken.append(f)
    return taken, nbytes, copies


def address_of(buf):
    cdef Py_buffer view
    _get_contiguous(buf, &view, "address_of")
    try:
        return <size_t>view.buf
    finally:
        PyBuffer_Release(&view)


cdef int _get_contiguous(object buf, Py_buffer* view, str caller) except -1:
    """``view`` of ``buf`` if it is a C-contiguous buffer (released again, and
    ``BufferError`` naming ``caller``, if not): ``pure._bytes_of``."""
    PyObject_GetBuffer(buf, view, PyBUF_FULL_RO)
    if not PyBuffer_IsContiguous(view, b'C'):
        PyBuffer_Release(view)
        raise BufferError(f"{caller}: the buffer is not C-contiguous")
    return 0


cdef object _small(object frame):
    """The value of a small frame (bytes, or a pickle without out-of-band buffers), or
    NotImplemented (decode it the general way)."""
    cdef Py_buffer fv
    if PyObject_GetBuffer(frame, &fv, PyBUF_SIMPLE) < 0:
        return NotImplemented
    try:
        return _small_at(<const unsigned char*>fv.buf, fv.len)
    finally:
        PyBuffer_Release(&fv)


cdef object _small_at(const unsigned char* p, Py_ssize_t n):
    """:func:`_small` of the ``n`` bytes of a frame at ``p`` (valid during the call)."""
    cdef uint64_t plen
    if n < _HEAD:
        return NotImplemented
    plen = _le64(p + 8)
    if plen > <uint64_t>(n - _HEAD):
        return NotImplemented
    if p[0] == _FMT_BYTES:
        return PyBytes_FromStringAndSize(<char*>p + _HEAD, plen)
    if p[0] != _FMT_PICKLE or _le32(p + 4) != 0:
        return NotImplemented
    try:
        return _loads(PyMemoryView_FromMemory(<char*>p + _HEAD, plen, PyBUF_READ))
    except Exception:
        return NotImplemented


cdef inline object _value_of(object frame, bint decoded, object decode, object absent,
                             object wait, bint small):
    """One key's value in :func:`decode_frames` and :func:`decode_values`."""
    if decoded:  # (decoded where it was read)
        return frame
    if frame is None:
        return absent
    if frame is False:
        return wait
    value = _small(frame) if small else NotImplemented
    if value is NotImplemented:
        value = decode(frame)
    return value


cdef class _Turns:
    """Each manager's answers in ``got``, taken in turn as the routes name their managers
    (the walk of :func:`decode_frames` and :func:`decode_values`): a list's next item by
    its index, and a manager's answers found through a table for the small ids every
    layout uses (a dict lookup and an iterator step per key cost more than the key's
    decoding).  Any other id is looked up as ``pure`` looks it up (``KeyError``), and an
    answer that is not a list is iterated."""

    cdef list answers  # (a list, or an iterator of a manager's answer, by slot)
    cdef dict slots  # manager id -> slot
    cdef Py_ssize_t table[256]  # (a small int id's slot, or -1)
    cdef Py_ssize_t* pos  # (how far each list was taken)
    cdef char* flags  # (bit 1: a list; bit 2: a Decoded answer, values already)

    def __cinit__(self, dict got):
        cdef Py_ssize_t n = len(got), s = 0
        cdef long long m
        cdef int overflow
        self.pos = <Py_ssize_t*>PyMem_Calloc(n + 1, sizeof(Py_ssize_t))
        self.flags = <char*>PyMem_Calloc(n + 1, 1)
        if self.pos == NULL or self.flags == NULL:
            raise MemoryError()
        memset(self.table, 0xFF, sizeof(self.table))
        self.answers, self.slots = [], {}
        for mid, fs in got.items():
            self.slots[mid] = s
            if type(mid) is int:
                m = PyLong_AsLongLongAndOverflow(mid, &overflow)
                if not overflow and 0 <= m < 256:
                    self.table[m] = s
            if isinstance(fs, list):
                self.answers.append(fs)
                self.flags[s] = 1
            else:
                self.answers.append(iter(fs))
            if type(fs) is Decoded:
                self.flags[s] |= 2
            s += 1

    def __dealloc__(self):
        PyMem_Free(self.pos)
        PyMem_Free(self.flags)

    cdef inline object take(self, object mid, bint* decoded):
        """Manager ``mid``'s next answer (``decoded``: whether it is a value already)."""
        cdef Py_ssize_t s = -1, at
        cdef long long m
        cdef int overflow
        cdef list answer
        if type(mid) is int:
            m = PyLong_AsLongLongAndOverflow(mid, &overflow)
            if not overflow and 0 <= m < 256:
                s = self.table[m]
        if s < 0:
            got = self.slots.get(mid)
            if got is None:
                raise KeyError(mid)
            s = <Py_ssize_t>got
        decoded[0] = (self.flags[s] & 2) != 0
        if not self.flags[s] & 1:
            return next(self.answers[s])
        answer = <list>self.answers[s]
        at = self.pos[s]
        if at >= PyList_GET_SIZE(answer):
            raise StopIteration
        self.pos[s] = at + 1
        return answer[at]


@cython.boundscheck(True)  # (a route that is not a pair: IndexError, as in pure)
def decode_frames(list keys, list routes, dict got, object decode, object absent, object wait,
                  bint small):
    cdef _Turns turns = _Turns(got)
    cdef list out = []
    cdef Py_ssize_t i, n = len(keys)
    cdef bint decoded
    if len(routes) < n:
        n = len(routes)
    for i in range(n):
        frame = turns.take(routes[i][0], &decoded)
        out.append((keys[i], _value_of(frame, decoded, decode, absent, wait, small)))
    return out


@cython.boundscheck(True)  # (a route that is not a pair: IndexError, as in pure)
def decode_values(list routes, dict got, object decode, object absent, object wait, bint small):
    cdef _Turns turns = _Turns(got)
    cdef Py_ssize_t i, n = len(routes)
    cdef list out = [None] * n
    cdef list marked = []
    cdef bint decoded
    for i in range(n):
        frame = turns.take(routes[i][0], &decoded)
        value = _value_of(frame, decoded, decode, absent, wait, small)
        out[i] = value
        if value is absent or value is wait:
            marked.append(i)
    return out, marked


cdef inline Py_ssize_t _nbytes(object frame) except -1:
    """What ``frame_parts(frame)[1]`` says."""
    if type(frame) is bytes:
        return PyBytes_GET_SIZE(frame)
    if type(frame) is Framed:
        return (<tuple>frame)[1]
    if type(frame) is memoryview:
        return (<object>frame).nbytes
    return frame_parts(frame)[1]


@cython.boundscheck(True)
def leading_within(list records, Py_ssize_t most):
    cdef Py_ssize_t n = 0
    for r in records:
        if _nbytes(r[2]) > most:
            break
        n += 1
    return n


@cython.boundscheck(True)  # (a record that is not a triple: IndexError, as in pure)
def entries_bytes(list records):
    cdef Py_ssize_t total = 0
    for r in records:
        total += _nbytes(r[2]) + len(r[1])
    return total


cdef inline Py_ssize_t _copy_in(char* p, Py_ssize_t off, Py_ssize_t end, object part) except -1:
    """Copy ``part`` into ``p[off:end]``; the offset after it (-2: it does not fit)."""
    cdef Py_buffer v
    cdef Py_ssize_t n
    if type(part) is bytes:
        n = PyBytes_GET_SIZE(part)
        if off + n > end:
            return -2
        memcpy(p + off, PyBytes_AS_STRING(part), n)
        return off + n
    PyObject_GetBuffer(part, &v, PyBUF_SIMPLE)
    try:
        if off + v.len > end:
            return -2
        memcpy(p + off, v.buf, v.len)
        return off + v.len
    finally:
        PyBuffer_Release(&v)


cdef inline tuple _parts(object frame):
    """``frame_parts(frame)``, without the call for a Framed or bytes."""
    if type(frame) is Framed:
        return <tuple>frame
    if type(frame) is bytes:
        return ((frame,), PyBytes_GET_SIZE(frame))
    return tuple(frame_parts(frame))


@cython.boundscheck(True)
cdef inline Py_ssize_t _copy_all(char* p, Py_ssize_t off, Py_ssize_t end, object part) except -1:
    off = _copy_in(p, off, end, part)
    if off < 0:
        raise ValueError(_UNEVEN)
    return off


@cython.boundscheck(True)
def pack_records(list records):
    cdef list parts = [], runs = []
    cdef Py_ssize_t total = 0, run = 0, n, klen, j = 0, off = 0, end = 0, sent = 0
    cdef bint open_run = False
    cdef object mid
    cdef bytes buf = None
    cdef char* p = NULL
    # Pass 1: the length of each run of small records (each record's header opens one).
    for r in records:
        mid, digest, kb = r[0], r[1], r[2]
        n = _parts(r[3])[1]
        klen = len(digest) + len(kb)
        if not 0 <= mid <= 0xFFFFFFFF or not 0 <= klen <= 0xFFFFFFFF or n < 0:
            raise struct.error("argument out of range")
        total += 16 + klen + n
        run += 16 + klen
        open_run = True
        if n < _JOIN:
            run += n
        else:
            runs.append(run)
            run, open_run = 0, False
    if open_run:
        runs.append(run)
    # Pass 2: the runs written, the large frames' parts between them.
    for r in records:
        if p == NULL:
            end = runs[j]
            buf = PyBytes_FromStringAndSize(NULL, end)
            p, off = PyBytes_AS_STRING(buf), 0
        mid, digest, kb = r[0], r[1], r[2]
        fparts, n = _parts(r[3])
        klen = len(digest) + len(kb)
        if off + 16 > end:
            raise ValueError(_UNEVEN)
        _put_le32(p + off, <uint32_t>klen)
        _put_le32(p + off + 4, <uint32_t>mid)
        _put_le64(<unsigned char*>p + off + 8, <uint64_t>n)
        off = _copy_all(p, off + 16, end, digest)
        off = _copy_all(p, off, end, kb)
        if n < _JOIN:
            for part in fparts:
                off = _copy_all(p, off, end, part)
            continue
        if off != end:
            raise ValueError(_UNEVEN)
        parts.append(buf)
        parts.extend(fparts)
        p, j = NULL, j + 1
    if p != NULL:
        if off != end:
            raise ValueError(_UNEVEN)
        parts.append(buf)
    for part in parts:
        sent += PyBytes_GET_SIZE(part) if type(part) is bytes else memoryview(part).nbytes
    if sent != total:
        raise ValueError(_UNEVEN)
    return parts, total


def unpack_records(value):
    cdef Py_buffer v
    cdef dict by_mid = {}
    cdef Py_ssize_t off = 0, end, klen, vlen
    cdef uint32_t mid
    cdef const unsigned char* p
    mv = None
    PyObject_GetBuffer(value, &v, PyBUF_SIMPLE)
    try:
        p, end = <const unsigned char*>v.buf, v.len
        while off < end:
            if off + 16 > end:
                raise ValueError(f"a request of {end} bytes ends inside a record's header")
            klen = _le32(p + off)
            mid = _le32(p + off + 4)
            vlen = <Py_ssize_t>_le64(p + off + 8)
            off += 16
            if klen < _DIGEST or vlen < 0 or klen > end - off or vlen > end - off - klen:
                raise ValueError(f"a request of {end} bytes ends inside a record (or its key "
                                 f"section of {klen} bytes has no digest)")
            digest = PyBytes_FromStringAndSize(<const char*>p + off, _DIGEST)
            kb = PyBytes_FromStringAndSize(<const char*>p + off + _DIGEST, klen - _DIGEST)
            off += klen
            if vlen < _JOIN:
                frame = PyBytes_FromStringAndSize(<const char*>p + off, vlen)
            else:
                if mv is None:
                    mv = memoryview(value).cast("B")
                frame = mv[off : off + vlen]
            got = by_mid.get(mid)
            if got is None:
                by_mid[mid] = [(digest, kb, frame)]
            else:
                (<list>got).append((digest, kb, frame))
            off += vlen
    finally:
        PyBuffer_Release(&v)
    return by_mid


cdef Py_ssize_t _REPLY = REPLY.size
cdef int _QUIET = QUIET


cdef int _wait_fd(int fd, short events, double deadline) except -1:
    """Wait until ``fd`` is ready for ``events``, at most until ``deadline`` (of
    ``_monotonic``; negative: no end; one past, or a signal, polls what is left: at least
    once): 1 ready, 0 the deadline passed."""
    cdef pollfd pfd
    cdef int ready, ms, err = 0
    while True:
        ms = -1
        if deadline >= 0:
            ms = <int>min(max((deadline - _monotonic()) * 1000.0 + 0.999, 0.0), 2147483647.0)
        pfd.fd, pfd.events, pfd.revents = fd, events, 0
        with nogil:
            ready = poll(&pfd, 1, ms)
            if ready < 0:
                err = errno
        if ready > 0:
            if pfd.revents & POLLNVAL:
                raise OSError(EBADF, os.strerror(EBADF))
            return 1
        if ready == 0:
            return 0
        if err != EINTR:
            raise OSError(err, os.strerror(err))
        PyErr_CheckSignals()


def receive_reply(sock, bytearray buf, Py_ssize_t got, object wait, Py_ssize_t small):
    return _receive_reply(sock, buf, got, wait, small)


cdef tuple _receive_reply(sock, bytearray buf, Py_ssize_t got, object wait, Py_ssize_t small):
    cdef int fd
    cdef int flags = 0
    cdef int err = 0
    cdef ssize_t n
    cdef Py_ssize_t cap
    cdef uint64_t plen
    cdef char* p
    cdef ddict_reply_head head
    cdef Py_buffer view
    cdef double end = 0.0
    if wait is not None:  # (the socket's timeout: its descriptor does not block)
        end = _monotonic() + max(<double>wait, 0.0)
        flags = MSG_DONTWAIT
    PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE)
    try:
        p = <char*>view.buf
        cap = view.len
        if got < 0 or got > cap:
            raise ValueError(f"{got} bytes received into a {cap}-byte buffer")
        while True:
            if got >= _REPLY:
                ddict_read_reply(<const unsigned char*>p, &head)
                plen = head.plen
                if plen >= <uint64_t>small or plen > <uint64_t>(cap - _REPLY):
                    return head.status, head.ival, plen, None, got
                if <uint64_t>(got - _REPLY) >= plen:
                    return (head.status, head.ival, plen,
                            PyBytes_FromStringAndSize(p + _REPLY, <Py_ssize_t>plen), got)
            fd = _fd_of(sock)  # (each time: another thread may have closed it meanwhile)
            if fd < 0:
                raise OSError(EBADF, os.strerror(EBADF))
            if flags and not _wait_fd(fd, POLLIN, end):  # (a signal does not lengthen it)
                return _QUIET, 0, 0, None, got
            with nogil:
                n = recv(fd, p + got, <size_t>(cap - got), flags)
                if n < 0:
                    err = errno
            if n > 0:
                got += n
            elif n == 0:
                raise ConnectionResetError("connection closed by peer")
            elif err == EINTR:
                PyErr_CheckSignals()
            elif not flags or (err != EAGAIN and err != EWOULDBLOCK):
                raise OSError(err, os.strerror(err))
    finally:
        PyBuffer_Release(&view)


# -- a host's requests (the event loop's) --------------------------------------------------

cdef Py_ssize_t _REQUEST = REQUEST.size

def receive_nowait(reader):
    return _receive_nowait(reader)


cdef Py_ssize_t _receive_nowait(reader) except -1:
    cdef ReaderState r = reader if isinstance(reader, ReaderState) else None
    cdef bytearray buf = reader._buf if r is None else r._buf
    cdef Py_ssize_t pos = reader._pos if r is None else r._pos
    cdef Py_ssize_t end = reader._end if r is None else r._end
    cdef ssize_t n
    cdef int fd, err = 0
    if end == PyByteArray_GET_SIZE(buf):
        reader.reserve(PyByteArray_GET_SIZE(buf) - pos + 1)  # (moved down, or grown)
        buf, end = reader._buf, reader._end
    fd = _fd_of(reader.sock if r is None else r.sock)
    while True:
        n = recv(fd, PyByteArray_AS_STRING(buf) + end,
                 <size_t>(PyByteArray_GET_SIZE(buf) - end), MSG_DONTWAIT)  # fmt: skip
        if n > 0:
            if r is None:
                reader._end = end + n
            else:
                r._end = end + n
            return n
        if n == 0:
            raise ConnectionResetError("connection closed by peer")
        err = errno
        if err == EAGAIN or err == EWOULDBLOCK:
            return 0
        if err != EINTR:
            raise OSError(err, os.strerror(err))
        PyErr_CheckSignals()


@cython.boundscheck(True)  # (a tag list without a first item: IndexError, as in pure)
def take_request(Py_ssize_t most_value, object cls, reader, list tag not None):
    cdef bytearray buf = reader._buf
    cdef Py_ssize_t pos = reader._pos, end = reader._end, d
    cdef const unsigned char* p
    cdef uint64_t klen, vlen
    cdef ddict_request_head h
    if end - pos < _REQUEST:
        return _REQUEST
    p = <const unsigned char*>PyByteArray_AS_STRING(buf) + pos
    ddict_read_request(p, &h)
    klen, vlen = h.klen, h.vlen
    if most_value < 0 or vlen > <uint64_t>most_value or klen + vlen > <uint64_t>(
            end - pos - _REQUEST):  # fmt: skip
        return _REQUEST + <object>klen + <object>vlen
    d = <Py_ssize_t>klen if klen < <uint64_t>_DIGEST else _DIGEST
    request = _new_tuple(cls, (
        h.op, h.flags, h.manager, h.chkpt, h.arg, h.client,
        None if h.timeout < 0 else h.timeout,
        PyBytes_FromStringAndSize(<const char*>p + _REQUEST, d),
        PyBytes_FromStringAndSize(<const char*>p + _REQUEST + d, <Py_ssize_t>klen - d),
        PyBytes_FromStringAndSize(<const char*>p + _REQUEST + klen, <Py_ssize_t>vlen),
        h.rid, h.term))
    tag[0] = h.tag
    reader._pos = pos + _REQUEST + <Py_ssize_t>(klen + vlen)
    return request


def send_reply(sock, object tag, object ival, payload, Py_ssize_t small):
    cdef ddict_reply_head head
    cdef Py_buffer pv
    cdef Py_ssize_t n
    cdef ssize_t sent
    cdef int fd, err = 0
    cdef bytes data
    cdef unsigned char* w
    if type(payload) is not bytes and not (type(payload) is memoryview
                                           and payload.c_contiguous):  # fmt: skip
        return NotImplemented
    PyObject_GetBuffer(payload, &pv, PyBUF_SIMPLE)
    try:
        n = pv.len
        if n > small:
            return NotImplemented
        if not (type(tag) is int and type(ival) is int and 0 <= tag <= 0xFFFFFFFF
                and -(1 << 63) <= ival < (1 << 63)):  # fmt: skip
            REPLY.pack(0, tag, ival, n)  # (raises what the pure spelling raises, if it does)
        data = PyBytes_FromStringAndSize(NULL, _REPLY + n)
        w = <unsigned char*>PyBytes_AS_STRING(data)
        head.status, head.tag, head.ival, head.plen = 0, <uint32_t>tag, <int64_t>ival, n
        ddict_write_reply(w, &head)
        memcpy(w + _REPLY, pv.buf, n)
    finally:
        PyBuffer_Release(&pv)
    fd = _fd_of(sock)
    while True:
        sent = send(fd, w, <size_t>(_REPLY + n), MSG_DONTWAIT)
        if sent >= 0:
            break
        err = errno
        if err == EAGAIN or err == EWOULDBLOCK:
            sent = 0
            break
        if err != EINTR:
            raise OSError(err, os.strerror(err))
        PyErr_CheckSignals()
    return None if sent == _REPLY + n else memoryview(data)[sent:]


include "lmdb_engine.pxi"
include "shard_writes.pxi"
include "generation_bump.pxi"
include "manager_lock.pxi"
include "plain_state.pxi"
include "served_table.pxi"
include "plain_server.pxi"
include "commit_behind.pxi"
include "same_host.pxi"
include "key_lane.pxi"
