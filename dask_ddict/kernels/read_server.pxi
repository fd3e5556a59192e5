# A host's plain reads, served in C: pure.ReadServer's rules, without a Python object per
# request.  Included by _compiled.pyx, after lmdb_engine.pxi (whose engine it calls).
#
# The interpreter lock is held throughout, and the state read of Python objects is their
# plain attributes (no Python code runs, so no other thread runs between them): a
# manager cannot close, nor its shard's environment, while a request is served.  One
# snapshot serves the run of requests of one environment: they were all received before
# it began.  Between requests the Python objects are read again; an environment found
# closed then (by a finalizer that ran Python code on an allocation) has already freed
# the snapshot's reader slot, and its transaction is dropped without a call into LMDB.

from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_GET_SIZE
from cpython.mem cimport PyMem_Realloc

from .pure import ReadServer as _PureReadServer

cdef extern from "<sys/epoll.h>" nogil:
    ctypedef union epoll_data_t:
        void* ptr
        int fd
        uint32_t u32
        uint64_t u64
    struct epoll_event:
        uint32_t events
        epoll_data_t data
    int epoll_wait(int epfd, epoll_event* events, int maxevents, int timeout)

DEF _MOST_EVENTS = 256  # (at most this many events a call; the rest come with the next)

cdef Py_ssize_t _READ = REQUEST.size + DIGEST  # a plain read's request: a header and a digest
cdef Py_ssize_t _SENT_AT_ONCE = 256 << 10  # replies gathered before one is sent


cdef class ReadServer:
    cdef object _c, reader, held, owed, hosted, served, sock
    cdef int get, contains, status
    cdef bytes missing
    cdef Py_ssize_t most
    cdef readonly Py_ssize_t count
    cdef char* out
    cdef Py_ssize_t cap, n
    # the snapshot of the run's last environment
    cdef ddict_mdb_txn* txn
    cdef object txn_env
    cdef object _pure

    def __init__(self, c, rules):
        get, contains, status, missing, most = rules
        self._c, self.reader, self.held, self.owed = c, c.reader, c.held, c.owed
        self.hosted, self.served, self.sock = c.hosted, c.served, c.sock
        self.get, self.contains, self.status = get, contains, status
        self.missing, self.most = bytes(missing), most
        self.count = 0
        self.txn, self.txn_env = NULL, None
        self._pure = None
        try:
            _engines()
        except LmdbEngineError:  # (lmdb's own objects, as the pure server reads them)
            self._pure = _PureReadServer(c, rules)

    def __dealloc__(self):
        PyMem_Free(self.out)

    cdef int _room(self, Py_ssize_t more) except -1:
        cdef Py_ssize_t cap = self.cap
        cdef char* grown
        if self.n + more <= cap:
            return 0
        while cap < self.n + more:
            cap = max(cap * 2, 4096)
        grown = <char*>PyMem_Realloc(self.out, cap)
        if grown == NULL:
            raise MemoryError()
        self.out, self.cap = grown, cap
        return 0

    cdef int _reply(self, int status, uint32_t tag, int64_t ival, const void* p,
                    Py_ssize_t plen) except -1:
        cdef unsigned char* w
        self._room(_REPLY + plen)
        w = <unsigned char*>self.out + self.n
        memset(w, 0, 4)
        w[0] = <unsigned char>status
        _put_le32(<char*>w + 4, tag)
        _put_le64(w + 8, <uint64_t>ival)
        _put_le64(w + 16, <uint64_t>plen)
        if plen:
            memcpy(w + _REPLY, p, plen)
        self.n += _REPLY + plen
        return 0

    cdef void _end_snapshot(self):
        cdef ddict_lmdb_env* e
        if self.txn != NULL:
            e = <ddict_lmdb_env*><PyObject*>self.txn_env
            if e.valid and e.env != NULL:  # (else closed under it: the slot is freed)
                e.libv.txn_abort(self.txn)
        self.txn, self.txn_env = NULL, None

    cdef int _send(self) except -1:
        """The gathered replies: sent without waiting after the kept-back ones, or kept."""
        cdef ssize_t sent = 0
        cdef int fd, err
        if self.n == 0:
            return 0
        if PyList_GET_SIZE(self.held) == 0:
            fd = self.sock.fileno()
            while True:
                sent = send(fd, self.out, <size_t>self.n, MSG_DONTWAIT)
                if sent >= 0:
                    break
                err = errno
                if err == EAGAIN or err == EWOULDBLOCK:
                    sent = 0
                    break
                if err != EINTR:
                    self.n = 0
                    raise OSError(err, os.strerror(err))
                PyErr_CheckSignals()
        if sent < self.n:
            self.held.append(PyBytes_FromStringAndSize(self.out + sent, self.n - sent))
        self.n = 0
        return 0

    cpdef bint serve(self) except -1:
        cdef bytearray buf
        cdef Py_ssize_t pos, end, served = 0, size, have, flen
        cdef const unsigned char* p
        cdef unsigned char seek[24]
        cdef int op, rc, i, live
        cdef uint32_t tag, mid
        cdef int64_t chkpt, newest, wsize
        cdef uint64_t c
        cdef unsigned int term
        cdef PyObject* found
        cdef ddict_lmdb_env* e
        cdef ddict_lmdb_db* d
        cdef ddict_mdb_cursor* cur
        cdef ddict_mdb_val k, v
        cdef const unsigned char* raw
        if self._pure is not None:
            return self._pure.serve()
        hosted, reader = self.hosted, self.reader
        if hosted.leased or self.owed[0] is not None:
            return False
        managers = hosted.managers
        buf = reader._buf
        pos, end = reader._pos, reader._end
        try:
            while end - pos >= _READ:
                p = <const unsigned char*>PyByteArray_AS_STRING(buf) + pos
                op = p[0]
                if (op != self.get and op != self.contains) or p[1] != 0 or _le32(p + 4) != (
                        <uint32_t>_DIGEST) or _le64(p + 48) != 0 or _le64(p + 56) != 0:  # fmt: skip
                    break
                term = p[2] | (<unsigned int>p[3] << 8)
                mid, tag, chkpt = _le32(p + 8), _le32(p + 12), <int64_t>_le64(p + 16)
                if chkpt < 0:
                    break
                # the manager's state: plain attributes (no Python code runs)
                found = PyDict_GetItem(managers, mid)
                if found == NULL:
                    break
                m = <object>found
                if m.closed or (term and term != m.wire):
                    break
                ws = m.working_set
                if ws.wait_for_keys:
                    break
                newest, wsize = ws.newest, ws.size
                if chkpt < newest - wsize + 1:
                    break
                store = m.store
                env, db = store.env, store._data
                counts = self.served[mid]  # (a defaultdict's row)
                if type(env) is not _Environment or type(db) is not _Database:
                    break
                e = <ddict_lmdb_env*><PyObject*>env
                d = <ddict_lmdb_db*><PyObject*>db
                if not e.valid or e.env == NULL or not d.valid or d.env != e or not _is_engine(
                        e.libv):  # fmt: skip
                    break
                # the snapshot: this environment's of the run, else a new one
                if self.txn != NULL and self.txn_env is not env:
                    self._end_snapshot()
                if self.txn == NULL:
                    rc = e.libv.txn_begin(e.env, NULL, DDICT_MDB_RDONLY, &self.txn)
                    if rc:
                        self.txn = NULL
                        break  # (the manager's path says what LMDB says)
                    self.txn_env = env
                c = ~(<uint64_t>chkpt)  # (MAXQ - chkpt, big-endian after the digest)
                memcpy(seek, p + _REQUEST, _DIGEST)
                for i in range(8):
                    seek[_DIGEST + i] = (c >> (56 - 8 * i)) & 0xFF
                cur = NULL
                rc = e.libv.cursor_open(self.txn, d.dbi, &cur)
                if rc:
                    break
                k.mv_size, k.mv_data = _DIGEST + 8, seek
                rc = e.libv.cursor_get(cur, &k, &v, DDICT_MDB_SET_RANGE)
                e.libv.cursor_close(cur)  # (the page's pointers stay valid in the snapshot)
                if rc and rc != DDICT_MDB_NOTFOUND:
                    break
                live, raw, flen = 0, NULL, 0
                if rc == 0 and _digest_at(&k, seek, _DIGEST):
                    raw = <const unsigned char*>v.mv_data
                    size = <Py_ssize_t>v.mv_size
                    if size < _ENTRY_HEADER or k.mv_size < <size_t>_DIGEST + 8:
                        break  # (what no shard writes: the manager's path says so)
                    live = not raw[0] & _TOMBSTONE
                    have = size - _ENTRY_HEADER
                    if live:
                        if _le64(raw + 8) > <uint64_t>have or size >= PRELOADED:
                            break
                        flen = <Py_ssize_t>_le64(raw + 8)
                if op == self.contains:
                    self._reply(0, tag, live, NULL, 0)
                elif not live:
                    self._reply(self.status, tag, 0, PyBytes_AS_STRING(self.missing),
                                PyBytes_GET_SIZE(self.missing))
                elif flen > self.most:
                    break
                else:
                    self._reply(0, tag, 0, raw + _ENTRY_HEADER, flen)
                counts[op] = counts.get(op, 0) + 1
                pos += _READ
                served += 1
                if self.n >= _SENT_AT_ONCE:
                    reader._pos = pos
                    self._send()
        finally:
            self._end_snapshot()
            reader._pos = pos
        self._send()
        self.count += served
        return pos == end and PyList_GET_SIZE(self.held) == 0


def poll_and_serve(ep, dict conns not None, int most):
    cdef epoll_event events[_MOST_EVENTS]
    cdef int epfd = ep.fileno(), n, i, err = 0
    cdef list left = []
    cdef PyObject* found
    most = max(1, min(most, _MOST_EVENTS))
    with nogil:
        n = epoll_wait(epfd, events, most, -1)
        if n < 0:
            err = errno
    if n < 0:
        if err == EINTR:
            PyErr_CheckSignals()
            return left
        raise OSError(err, os.strerror(err))
    for i in range(n):
        fd = events[i].data.fd
        found = PyDict_GetItem(conns, fd)
        reads = None if found == NULL else (<object>found).reads
        if reads is None:
            left.append((fd, None))
            continue
        try:
            _receive_nowait((<object>found).reader)
            if (<ReadServer>reads).serve() if type(reads) is ReadServer else reads.serve():
                continue
        except Exception as e:  # (the connection's end: the caller's to say)
            left.append((fd, e))
            continue
        left.append((fd, None))
    return left
