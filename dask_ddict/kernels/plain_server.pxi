# A host's plain requests, served in C: pure.PlainServer's rules, without a Python object
# per request (gets, ``in``s, puts, get_manys, byte ranges of raw-bytes values, pops and
# fetch_adds with their replies kept under their request ids).  Included
# by _compiled.pyx, after lmdb_engine.pxi (whose engine it calls).
#
# The interpreter lock is held while a request is read and answered, and the state read
# of Python objects is their C fields (plain_state.pxi) and plain attributes (no Python
# code runs, so no other thread runs between them): a manager cannot close, nor its
# shard's environment, while a read is served.  One snapshot serves a run of reads of one
# environment: they were all received before it began (a put ends it).  Between requests
# the Python objects are read again; an environment found closed then (by a finalizer
# that ran Python code on an allocation) has already freed the snapshot's reader slot,
# and its transaction is dropped without a call into LMDB.
#
# A put is written under its manager's lock (a ManagerLock: taken and given in C), taken
# only if it is free (else the put is the manager's path's, which waits for it); LMDB's
# writer lock is waited for with the interpreter lock released (another thread of this
# process may be the writer), and the manager's lock keeps its environment open meanwhile
# (Manager.close takes it first).
#
# A run of puts of one manager is one write transaction (a group): the puts that follow
# each other in the buffer join the first one's transaction, which is committed before
# anything else is served, before any reply is sent, and at the end of the run; no reply
# leaves before its put is committed.  The pure server writes each put alone: one
# transaction per put is its rule, the group only shares the commit (the free list, the
# meta page, the tables' roots) among puts that were all received before it began.  A
# group that LMDB refuses is dropped whole (nothing of it written) and the run goes back
# to its first put, which the manager's path then serves, and every one after it.

from cpython.dict cimport PyDict_GetItemWithError
from cpython.list cimport PyList_GET_SIZE
from cpython.mem cimport PyMem_Realloc

from .pure import PlainServer as _PurePlainServer, _settled as _pure_settled

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
cdef Py_ssize_t _RANGED = DIGEST + SPAN.size  # a byte range's key section: its digest, its bounds
cdef Py_ssize_t _SENT_AT_ONCE = 256 << 10  # replies gathered before one is sent
cdef Py_ssize_t _GROUP_MOST = 256  # puts of one transaction, at most (the lock held that long)
# puts of a group committed holding the interpreter lock: a commit waits for no other
# writer nor any I/O call (the writer's lock is held, a shard's map is written in place
# and never synced; the kernel may still stall a write to the map, as it may the group's
# puts, made under the interpreter lock too) and takes a few microseconds for a few puts,
# less than the lock's release and retake
cdef Py_ssize_t _COMMIT_HELD = 16
cdef Py_ssize_t _HUGE = HUGE_BYTES
cdef bytes _RID = RID, _RID_SLOT = RID_SLOT, _RID_SEQ = RID_SEQ
cdef uint64_t _RID_KEEP = RID_KEEP
cdef Py_ssize_t _BIG_REPLY = BIG_REPLY
DEF _MOST_INT_FRAME = 38  # (a frame of an int of 64 bits: 16 + 2 + 9 + 11 bytes, at most)

cdef extern from *:
    bint __builtin_add_overflow(int64_t a, int64_t b, int64_t* out) nogil
    int __builtin_clzll(unsigned long long x) nogil


cdef inline bint _waiting(object deferred) except -1:
    """Whether a manager's ``deferred`` operations wait (``DeferredQueue.waiting``)."""
    if isinstance(deferred, DeferredState):
        return bool((<DeferredState>deferred).waiting)
    return bool(deferred.waiting)


cdef bint _settled(list owed) except -1:
    """Whether a connection owes no delivery (``pure._settled``)."""
    if owed[0] is None:
        return True
    return _pure_settled(owed)


cdef inline bint _lmdb_object(object o, object kind, ddict_lmdb_env* e) except -1:
    """Whether ``o`` is an open py-lmdb database of environment ``e``."""
    return type(o) is kind and (<ddict_lmdb_db*><PyObject*>o).valid and (
        <ddict_lmdb_db*><PyObject*>o).env == e


cdef ddict_lmdb_env* _open_env(object env, object db) except? NULL:
    """The environment of py-lmdb's ``env`` if the engine may use it with its open
    database ``db``; NULL: objects the engine does not know, or closed ones."""
    cdef ddict_lmdb_env* e
    if type(env) is not _Environment:
        return NULL
    e = <ddict_lmdb_env*><PyObject*>env
    if not e.valid or e.env == NULL or not _is_engine(e.libv) or not _lmdb_object(
            db, _Database, e):  # fmt: skip
        return NULL
    return e


cdef class PlainServer:
    cdef object _c, held, owed, sock
    cdef HostedState hosted
    cdef ServedTable served
    cdef ReaderState reader
    cdef int get, contains, put, get_many, get_range, pop, fetch_add, persist, status, clock
    cdef bytes missing
    cdef Py_ssize_t most, most_key
    cdef readonly Py_ssize_t count
    cdef readonly Py_ssize_t dropped  # (groups of puts LMDB refused: the manager's, from the first)
    cdef char* out
    cdef Py_ssize_t cap, n
    cdef char* scratch  # (a many-key read's frames, in the order they were walked)
    cdef Py_ssize_t scratch_cap
    # the snapshot of the run's last environment read
    cdef ddict_mdb_txn* txn
    cdef object txn_env
    # the run's open group of puts: one manager's write transaction, under its lock
    cdef ddict_mdb_txn* gw
    cdef const ddict_mdb_api* gapi
    cdef object gstore, glock  # (its manager: gmid)
    cdef size_t gtid
    cdef uint32_t gmid
    cdef Py_ssize_t gbytes, gputs, gn0, gpos0  # (its puts' room, number, first reply and request)
    cdef Py_ssize_t alone  # (puts to write one per transaction: those of a group dropped)
    cdef object _pure

    def __init__(self, c, rules):
        (self.get, self.contains, self.put, self.get_many, self.get_range, self.pop,
         self.fetch_add, self.persist, self.status, missing, self.most, self.most_key,
         self.clock) = rules
        self._c, self.held, self.owed = c, c.held, c.owed
        self.reader = c.reader if isinstance(c.reader, ReaderState) else None
        self.sock = c.sock
        self.hosted = c.hosted if isinstance(c.hosted, HostedState) else None
        self.served = c.served if isinstance(c.served, ServedTable) else None
        self.missing = bytes(missing)
        self.count = self.dropped = 0
        self.txn, self.txn_env = NULL, None
        self.gw, self.gstore, self.glock = NULL, None, None
        self.gbytes = self.gputs = self.alone = 0
        self._pure = None
        try:
            _engines()
            pure = self.reader is None or self.hosted is None or self.served is None
        except LmdbEngineError:  # (lmdb's own objects, as the pure server reads them)
            pure = True
        if pure:
            self._pure = _PurePlainServer(c, rules)

    def __dealloc__(self):
        PyMem_Free(self.out)
        PyMem_Free(self.scratch)

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
        cdef ddict_reply_head head
        self._room(_REPLY + plen)
        w = <unsigned char*>self.out + self.n
        head.status, head.tag, head.ival, head.plen = status, tag, ival, <uint64_t>plen
        ddict_write_reply(w, &head)
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
            fd = _fd_of(self.sock)
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

    cdef ddict_lmdb_env* _snapshot(self, ManagerState m, WindowState ws, int64_t chkpt,
                                   unsigned int* dbi) except? NULL:
        """The run's snapshot of manager ``m``'s shard (``self.txn``, begun if it is not of
        its environment) and its data table's handle, for a read at ``chkpt``; NULL: the
        manager's (a retired checkpoint, objects the engine does not know)."""
        cdef int64_t newest = ws.newest, wsize = ws.size
        cdef ddict_lmdb_env* e
        cdef StoreState store
        if chkpt < newest - wsize + 1:
            return NULL
        if not isinstance(m.store, StoreState):
            return NULL
        store = <StoreState>m.store
        env, db = store.env, store._data
        e = _open_env(env, db)
        if e == NULL:
            return NULL
        if self.txn != NULL and self.txn_env is not env:  # (this environment's, else a new one)
            self._end_snapshot()
        if self.txn == NULL:
            if e.libv.txn_begin(e.env, NULL, DDICT_MDB_RDONLY, &self.txn):
                self.txn = NULL
                return NULL  # (the manager's path says what LMDB says)
            self.txn_env = env
        dbi[0] = (<ddict_lmdb_db*><PyObject*>db).dbi
        return e

    cdef int _read(self, ManagerState m, WindowState ws, int op, const unsigned char* p,
                   int64_t chkpt, uint32_t tag) except -1:
        """A plain get, ``in`` or byte range answered (1), or the manager's (0)."""
        cdef ddict_lmdb_env* e
        cdef ddict_mdb_cursor* cur
        cdef ddict_mdb_val k, v
        cdef const unsigned char* raw = NULL
        cdef unsigned char seek[24]
        cdef Py_ssize_t size, flen = 0
        cdef unsigned int dbi
        cdef int rc
        cdef bint live = False
        e = self._snapshot(m, ws, chkpt, &dbi)
        if e == NULL:
            return 0
        _seek_key(seek, p + _REQUEST, chkpt)
        cur = NULL
        if e.libv.cursor_open(self.txn, dbi, &cur):
            return 0
        k.mv_size, k.mv_data = _DIGEST + 8, seek
        rc = e.libv.cursor_get(cur, &k, &v, DDICT_MDB_SET_RANGE)
        e.libv.cursor_close(cur)  # (the page's pointers stay valid in the snapshot)
        if rc and rc != DDICT_MDB_NOTFOUND:
            return 0
        if rc == 0 and _digest_at(&k, seek, _DIGEST):
            raw = <const unsigned char*>v.mv_data
            size = <Py_ssize_t>v.mv_size
            if size < _ENTRY_HEADER or k.mv_size < <size_t>_DIGEST + 8:
                return 0  # (what no shard writes: the manager's path says so)
            live = not raw[0] & _TOMBSTONE
            if live:
                if _le64(raw + 8) > <uint64_t>(size - _ENTRY_HEADER) or (
                        size >= _PRELOADED and op == self.get):  # fmt: skip
                    return 0  # (an ``in`` reads the flags alone, a range its own pages)
                flen = <Py_ssize_t>_le64(raw + 8)
        if op == self.contains:
            self._reply(0, tag, live, NULL, 0)
        elif not live:
            self._reply(self.status, tag, 0, PyBytes_AS_STRING(self.missing),
                        PyBytes_GET_SIZE(self.missing))
        elif op == self.get_range:
            return self._range(raw + _ENTRY_HEADER, flen, p + _REQUEST + _DIGEST, tag)
        elif flen > self.most:
            return 0
        else:
            self._reply(0, tag, 0, raw + _ENTRY_HEADER, flen)
        return 1

    cdef int _range(self, const unsigned char* frame, Py_ssize_t flen,
                    const unsigned char* span, uint32_t tag) except -1:
        """A byte range of a raw-bytes value's ``frame`` answered as ``GetRange.serve``
        answers it (1: the value's size, and ``value[start:stop]`` for the ``<qq`` bounds at
        ``span``, a Python slice's), or the manager's (0: not a raw-bytes frame, or a part
        of more than ``most`` bytes).  Only the frame's head and the part are touched,
        whatever the value's size: a large value's other pages are never read."""
        cdef Py_ssize_t n, start, stop
        if flen < _HEAD or frame[0] != _FMT_BYTES:
            return 0
        n = <Py_ssize_t>min(_le64(frame + 8), <uint64_t>(flen - _HEAD))
        start = _slice_bound(<int64_t>_le64(span), n)
        stop = _slice_bound(<int64_t>_le64(span + 8), n)
        if stop < start:
            stop = start
        if stop - start > self.most:
            return 0
        self._reply(0, tag, n, frame + _HEAD + start, stop - start)
        return 1

    cdef ddict_lmdb_env* _writable(self, ManagerState m, WindowState ws, int64_t chkpt,
                                   Py_ssize_t nbytes) except? NULL:
        """Manager ``m``'s shard's environment, where a write of about ``nbytes`` at
        ``chkpt`` goes through alone by the rules that need no lock (``pure._alone``'s: a
        window of one checkpoint, at it; a shard neither frozen, replicated nor indexed;
        room by the running estimate, the open group's puts counted); NULL: the
        manager's."""
        cdef ddict_lmdb_env* e
        cdef StoreState store
        if ws.size != 1 or ws.wait_for_writers or chkpt != ws.newest or m.frozen:
            return NULL
        if not isinstance(m.store, StoreState):
            return NULL
        store = <StoreState>m.store
        if store.replicate is not None or store.indexed:
            return NULL
        e = _open_env(store.env, store._data)
        if e == NULL or not _lmdb_object(store._meta, _Database, e):
            return NULL
        if store._used_estimate + (self.gbytes if self.gw != NULL else 0) + nbytes > (
                store.full_thresh * store.capacity):  # fmt: skip
            return NULL
        return e

    cdef int _open_group(self, ManagerState m, ddict_lmdb_env* e, int64_t chkpt,
                         uint32_t mid, Py_ssize_t pos) except -1:
        """The run's group of writes of manager ``m`` begun (1): its write transaction,
        under the manager's lock, which holds the counts of a window of one checkpoint
        at ``chkpt``; or the manager's (0: its lock taken by another thread, a deferred
        operation or a retirement waiting, another process's commit since its last, no
        such counts).  ``pos``: the first request of the group (:meth:`serve` goes back
        to it when the group is dropped)."""
        cdef const ddict_mdb_api* api = e.libv
        cdef ddict_mdb_txn* w = NULL
        cdef StoreState store = <StoreState>m.store
        cdef ManagerLock lock
        cdef size_t tid
        cdef int rc
        cdef bint kept = False
        cdef unsigned char counts[24]
        if type(m._mutex) is not ManagerLock:
            return 0
        lock = <ManagerLock>m._mutex
        if not lock.take():
            return 0  # (another thread writes: the manager's path waits for it)
        try:
            if m.closed or m.frozen or m._retiring or _waiting(m._deferred):
                return 0
            self._end_snapshot()  # (a read after the write sees it)
            with nogil:  # (the writer may be another thread of this process)
                rc = api.txn_begin(e.env, NULL, 0, &w)
            if rc:
                return 0
            tid = api.txn_id(w)
            if tid != <size_t>store._next_own or not _counts_at(
                    api, w, (<ddict_lmdb_db*><PyObject*>store._meta).dbi, chkpt,
                    counts):  # fmt: skip
                api.txn_abort(w)  # (another process committed, or no window of one's
                return 0  # counts at it: the manager counts)
            kept = True
        finally:
            if not kept:
                lock.give()
        self.gw, self.gapi, self.gtid, self.gmid = w, api, tid, mid
        self.gstore, self.glock = store, lock
        self.gbytes = self.gputs = 0
        self.gn0, self.gpos0 = self.n, pos
        return 1

    cdef int _put(self, ManagerState m, WindowState ws, const unsigned char* p,
                  Py_ssize_t klen, Py_ssize_t vlen, int64_t chkpt, uint32_t mid,
                  Py_ssize_t pos) except -1:
        """A plain put written in the run's group of manager ``m`` (its reply gathered: 1),
        the manager's (0: nothing of it written, the group as it was), or the group
        dropped with it (2: nothing of the group written; ``pos``: the put's request)."""
        cdef ddict_lmdb_env* e
        cdef StoreState store
        cdef Py_ssize_t delta
        # the room: the running estimate (check_room's), else the manager counts
        cdef Py_ssize_t nbytes = 2 * (vlen + klen - _DIGEST + _ENTRY_HEADER + 64)
        e = self._writable(m, ws, chkpt, nbytes)
        if e == NULL:
            return 0
        if self.gw == NULL and not self._open_group(m, e, chkpt, mid, pos):
            return 0  # (the group's first put: the lock, the checks, the transaction)
        store = <StoreState>m.store
        delta = _put_one(self.gapi, self.gw, (<ddict_lmdb_db*><PyObject*>store._data).dbi,
                         p + _REQUEST, klen, p + _REQUEST + klen, vlen, chkpt)
        if delta < 0 or (delta and not _count_by(
                self.gapi, self.gw, (<ddict_lmdb_db*><PyObject*>store._meta).dbi, chkpt,
                1)):  # fmt: skip
            self._drop_group()  # (the transaction is only to abort: none of it written)
            return 2
        self.gbytes += nbytes
        self.gputs += 1
        return 1

    cdef int _once(self, ManagerState m, WindowState ws, bint pop, const unsigned char* p,
                   Py_ssize_t klen, int64_t chkpt, int64_t n, uint64_t rid, uint32_t mid,
                   uint32_t tag, Py_ssize_t pos) except -1:
        """A ``pop``, or a ``fetch_add`` of ``n``, of manager ``m`` (``p``: its request)
        written and committed in a transaction of its own and its reply gathered (1), as
        ``Manager.pop_alone`` and ``fetch_add_alone`` write them, the reply kept under
        request id ``rid`` as ``AtMostOnce._once`` keeps it; a pop of an absent key
        answered as the manager's ``DDictKeyError`` (1, nothing written); or the
        manager's (0, nothing written: see :meth:`_apply_once`)."""
        cdef ddict_lmdb_env* e
        cdef int rc
        cdef Py_ssize_t nbytes = 0 if pop else 2 * (
            _MOST_INT_FRAME + klen - _DIGEST + _ENTRY_HEADER + 64)
        e = self._writable(m, ws, chkpt, nbytes)
        if e == NULL or not self._open_group(m, e, chkpt, mid, pos):
            return 0
        try:
            rc = self._apply_once(pop, p + _REQUEST, klen, chkpt, n, rid, tag)
        except BaseException:
            self._abandon_group()
            raise
        if rc == 1:
            if self._commit_group():
                return 1
            self.n = self.gn0  # (refused: nothing written, its reply cut)
            return 0
        cdef Py_ssize_t n0 = self.gn0
        self._abandon_group()
        if rc == 0:
            self.n = n0
        return rc != 0

    cdef int _apply_once(self, bint pop, const unsigned char* ks, Py_ssize_t klen,
                         int64_t chkpt, int64_t n, uint64_t rid, uint32_t tag) except -1:
        """:meth:`_once`'s change in the run's group (``ks``: the request's key section):
        1, written and its reply gathered; 2, an absent key's pop answered (nothing
        written); 0, the manager's, nothing of it written (a request id applied before,
        a version of the key that is not its only one at ``chkpt`` or not live, a
        value that is not an int as ``dumps_value`` pickles one of 64 bits, a sum that
        is not, a reply over ``most`` bytes or one kept until read, LMDB's refusal)."""
        cdef const ddict_mdb_api* api = self.gapi
        cdef ddict_mdb_txn* w = self.gw
        cdef StoreState store = <StoreState>self.gstore
        cdef unsigned int data = (<ddict_lmdb_db*><PyObject*>store._data).dbi
        cdef unsigned int meta = (<ddict_lmdb_db*><PyObject*>store._meta).dbi
        cdef ddict_mdb_cursor* cur = NULL
        cdef ddict_mdb_val k, v
        cdef unsigned char seek[24]
        cdef unsigned char frame[_MOST_INT_FRAME]
        cdef const unsigned char* raw = NULL
        cdef Py_ssize_t flen = 0, at, delta, size
        cdef int64_t old = 0, new
        cdef int rc
        if rid and _kept_reply(api, w, meta, rid):
            return 0  # (a resend: the manager answers what the first try got)
        _seek_key(seek, ks, chkpt)
        if api.cursor_open(w, data, &cur):
            return 0
        try:
            k.mv_size, k.mv_data = _DIGEST + 8, seek
            rc = api.cursor_get(cur, &k, &v, DDICT_MDB_SET_RANGE)
            if rc and rc != DDICT_MDB_NOTFOUND:
                return 0
            if rc == 0 and _digest_at(&k, seek, _DIGEST):
                # (a window of one: a key with a version at its checkpoint has no other)
                if k.mv_size != 24 or memcmp(k.mv_data, seek, 24) != 0:
                    return 0  # (an older version: the manager moves it forward)
                raw = <const unsigned char*>v.mv_data
                if v.mv_size < <size_t>_ENTRY_HEADER or raw[0] & _TOMBSTONE:
                    return 0
                if _le64(raw + 8) > <uint64_t>(v.mv_size - _ENTRY_HEADER):
                    return 0
                flen = <Py_ssize_t>_le64(raw + 8)
                raw += _ENTRY_HEADER
            elif pop:
                self._reply(self.status, tag, 0, PyBytes_AS_STRING(self.missing),
                            PyBytes_GET_SIZE(self.missing))
                return 2
            if pop:
                if flen > self.most or (rid and flen > _BIG_REPLY):
                    return 0
                if v.mv_size >= <size_t>_PRELOADED:
                    return 0  # (a large value: copied with the interpreter lock released)
                at = self.n + _REPLY
                self._reply(0, tag, 0, raw, flen)  # (copied out before the page changes)
                if api.cursor_del(cur, 0):
                    return 0
                rc = api.cursor_get(cur, &k, &v, DDICT_MDB_GET_CURRENT)
                if rc == 0 and _digest_at(&k, seek, _DIGEST):
                    return 0  # (an older version after all: the manager's)
                if not _count_by(api, w, meta, chkpt, -1):
                    return 0
            else:
                if raw != NULL and not _int_of(raw, flen, &old):
                    return 0  # (not an int of 64 bits: the manager reads it, or says so)
                if __builtin_add_overflow(old, n, &new):
                    return 0
                at = self.n + _REPLY
                if raw == NULL:  # (absent: 0, framed as dumps_value(0))
                    flen = _int_frame(0, frame)
                    raw = frame
                self._reply(0, tag, 0, raw, flen)  # (copied out before the page changes)
                api.cursor_close(cur)
                cur = NULL
                size = _int_frame(new, frame)
                delta = _put_one(api, w, data, ks, klen, frame, size, chkpt)
                if delta < 0 or (delta and not _count_by(api, w, meta, chkpt, 1)):
                    return 0
                self.gbytes = 2 * (size + klen - _DIGEST + _ENTRY_HEADER + 64)  # (put's)
        finally:
            if cur != NULL:
                api.cursor_close(cur)
        if rid and not _keep_reply(api, w, meta, rid, self.out + at, flen):
            return 0
        return 1

    cdef bint _commit_group(self) except -1:
        """The run's group of puts committed (True), or dropped (False: nothing of it
        written; the run goes back to its first put, ``gpos0``, its replies cut at
        ``gn0``)."""
        cdef ddict_mdb_txn* w = self.gw
        cdef StoreState store = <StoreState>self.gstore
        cdef ManagerLock lock = <ManagerLock>self.glock
        cdef int rc
        self.gw = NULL  # (a failed commit frees the transaction too)
        try:
            if self.gputs <= _COMMIT_HELD:
                rc = self.gapi.txn_commit(w)
            else:
                with nogil:
                    rc = self.gapi.txn_commit(w)
            if rc:
                if self.gputs:  # (a group of puts: from its first on, one at a time)
                    self.dropped += 1
                    self.alone = self.gputs + 1
                return False
            self.alone = max(0, self.alone - self.gputs)
            store._next_own = self.gtid + 1
            store._used_estimate += self.gbytes
            hook = store.on_commit  # (its new generation word first: nothing may skip it)
            if type(hook) is GenerationBump:  # (the host's: no call)
                (<GenerationBump>hook).bump()
            elif hook is not None:
                hook()
            if self.gputs:
                self.served.add(self.gmid, self.put, self.gputs)  # (committed: counted)
        finally:
            lock.give()
            self.gstore = self.glock = None
        return True

    cdef void _drop_group(self):
        """The run's group aborted: none of its puts written."""
        if self.gw == NULL:
            return
        self._abandon_group()
        self.dropped += 1
        self.alone = self.gputs + 1  # (from its first put on, one transaction each)

    cdef void _abandon_group(self):
        """The run's group aborted, its lock given: nothing of it written."""
        cdef ManagerLock lock = <ManagerLock>self.glock
        self.gapi.txn_abort(self.gw)
        self.gw = NULL
        lock.give()
        self.gstore = self.glock = None

    cdef int _get_many(self, object managers, const unsigned char* v, Py_ssize_t vlen,
                       int64_t chkpt, uint32_t tag) except -1:
        """A plain many-key read (``v``: its table and digests) answered as
        ``GetMany.serve_host`` frames it (1), or the manager's (0): a table that does not
        add up, a manager not served here or not plain, a frame of ``JOIN`` bytes or
        more (a part of its own there)."""
        cdef Py_ssize_t groups, i, j, at, total = 0, head, flen, size, stored = 0
        cdef Py_ssize_t* order = NULL
        cdef int64_t* lens = NULL
        cdef Py_ssize_t* offs = NULL
        cdef ddict_lmdb_env* e
        cdef ddict_mdb_cursor* cur
        cdef const unsigned char* frame
        cdef const unsigned char* digests
        cdef unsigned char seek[24]
        cdef unsigned char* w
        cdef unsigned int dbi
        cdef uint32_t mid, count
        cdef PyObject* found
        cdef ddict_reply_head reply
        cdef list ms = []
        cdef ManagerState m
        if vlen < 4:
            return 0
        groups = <Py_ssize_t>_le32(v)
        if 4 + 8 * groups > vlen:
            return 0
        for i in range(groups):
            total += <Py_ssize_t>_le32(v + 8 + 8 * i)
        if 4 + 8 * groups + _DIGEST * total != vlen:
            return 0  # (the manager's path says where it does not add up)
        for i in range(groups):  # the managers: each served here, plain
            found = PyDict_GetItemWithError(managers, _le32(v + 4 + 8 * i))
            if found == NULL:
                return 0
            if not isinstance(<object>found, ManagerState):
                return 0
            m = <ManagerState>found
            if m.closed or not isinstance(m.working_set, WindowState) or (
                    <WindowState>m.working_set).wait_for_keys:  # fmt: skip
                return 0
            ms.append(m)
        lens = <int64_t*>PyMem_Malloc((total + 1) * sizeof(int64_t))
        offs = <Py_ssize_t*>PyMem_Malloc((total + 1) * sizeof(Py_ssize_t))
        if lens == NULL or offs == NULL:
            PyMem_Free(lens)
            PyMem_Free(offs)
            raise MemoryError()
        try:
            at, digests = 0, v + 4 + 8 * groups
            for i in range(groups):  # each manager's keys from one snapshot, in the tree's order
                count = _le32(v + 8 + 8 * i)
                if count:  # (the seek's tail: each key's digest goes before it)
                    _seek_key(seek, digests + _DIGEST * at, chkpt)
                m = <ManagerState>ms[i]
                if not isinstance(m.working_set, WindowState):
                    return 0
                e = self._snapshot(m, <WindowState>m.working_set, chkpt, &dbi)
                if e == NULL:
                    return 0
                cur = NULL
                if e.libv.cursor_open(self.txn, dbi, &cur):
                    return 0
                order = NULL
                try:
                    order = _order_of(None, digests + _DIGEST * at, count)
                    for j in range(count):
                        frame = _newest_at(e.libv, cur, seek,
                                           digests + _DIGEST * (at + order[j]), &flen, &size)
                        if frame == NULL:
                            lens[at + order[j]] = _ABSENT
                            continue
                        if flen >= _JOIN or size >= _PRELOADED:
                            return 0
                        self._hold(stored + flen)
                        memcpy(self.scratch + stored, frame, flen)
                        lens[at + order[j]], offs[at + order[j]] = flen, stored
                        stored += flen
                finally:
                    e.libv.cursor_close(cur)
                    PyMem_Free(order)
                at += count
            # the reply: <u32 n> <i64 length> * n [pad] (frame [pad]) * n
            head = 4 + 8 * total
            size = _aligned(head)
            for j in range(total):
                if lens[j] >= 0:
                    size += _aligned(lens[j])
            self._room(_REPLY + size)  # (the reply's header, its payload written in place)
            reply.status, reply.tag, reply.ival, reply.plen = 0, tag, 0, <uint64_t>size
            ddict_write_reply(<unsigned char*>self.out + self.n, &reply)
            self.n += _REPLY
            w = <unsigned char*>self.out + self.n
            _put_le32(<char*>w, <uint32_t>total)
            for j in range(total):
                _put_le64(w + 4 + 8 * j, <uint64_t>lens[j])
            at = _aligned(head)
            memset(w + head, 0, at - head)  # (the pads are zeros: nothing else is written)
            for j in range(total):
                if lens[j] >= 0:
                    memcpy(w + at, self.scratch + offs[j], lens[j])
                    memset(w + at + lens[j], 0, _aligned(lens[j]) - lens[j])
                    at += _aligned(lens[j])
            self.n += size
        finally:
            PyMem_Free(lens)
            PyMem_Free(offs)
        for i in range(groups):  # (each manager looked up counts once, as Counting counts)
            self.served.add(_le32(v + 4 + 8 * i), self.get_many, 1)
        return 1

    cdef int _hold(self, Py_ssize_t need) except -1:
        """Room for ``need`` bytes in the scratch buffer."""
        cdef Py_ssize_t cap = self.scratch_cap
        cdef char* grown
        if need <= cap:
            return 0
        while cap < need:
            cap = max(cap * 2, 64 << 10)
        grown = <char*>PyMem_Realloc(self.scratch, cap)
        if grown == NULL:
            raise MemoryError()
        self.scratch, self.scratch_cap = grown, cap
        return 0

    cdef bint _leased(self, object lease) except -1:
        """Whether the host's ``lease`` lets it serve its primaries now (``Lease.valid``)."""
        cdef timespec now
        cdef LeaseState state
        if not isinstance(lease, LeaseState):
            return False  # (the manager's path says why)
        state = <LeaseState>lease
        if not state.required:
            return True
        if clock_gettime(self.clock, &now):
            return False
        return now.tv_sec + now.tv_nsec * 1e-9 < state.until

    cpdef bint serve(self) except -1:
        cdef bytearray buf
        cdef Py_ssize_t pos, end, size, klen, vlen
        cdef const unsigned char* p
        cdef int op, rc, served = 0
        cdef bint once
        cdef uint32_t tag, mid
        cdef int64_t chkpt
        cdef unsigned int term
        cdef PyObject* found
        cdef ddict_request_head head
        cdef ManagerState m
        cdef WindowState ws
        cdef ReaderState reader = self.reader
        cdef HostedState hosted = self.hosted
        if self._pure is not None:
            return self._pure.serve()
        lease = hosted.lease if hosted.leased else None
        if hosted.leased and lease is None or not _settled(self.owed):
            return False
        managers = hosted.managers
        if type(managers) is not dict:
            return False  # (the manager's path's)
        buf = reader._buf
        pos, end = reader._pos, reader._end
        try:
            while end - pos >= _READ:
                p = <const unsigned char*>PyByteArray_AS_STRING(buf) + pos
                ddict_read_request(p, &head)
                op = head.op
                if self.gw != NULL and (op != self.put or head.manager != self.gmid
                                        or self.gputs >= (1 if self.alone else _GROUP_MOST)):
                    if not self._commit_group():  # (before anything else is served)
                        pos, served, self.n = self.gpos0, served - self.gputs, self.gn0
                        break
                once = op == self.pop or op == self.fetch_add  # (at most once: a request id)
                if (op != self.get and op != self.contains and op != self.put
                        and op != self.get_many and op != self.get_range
                        and not once):  # fmt: skip
                    break
                term, klen = head.term, <Py_ssize_t>head.klen
                vlen = <Py_ssize_t>head.vlen if head.vlen < <uint64_t>_HUGE else _HUGE
                mid, tag, chkpt = head.manager, head.tag, head.chkpt
                if chkpt < 0 or (head.rid != 0 and not once):
                    break
                if op == self.get_many:  # (several managers: its own checks and counts)
                    if head.flags != 0 or klen != 0 or term or end - pos < _REQUEST + vlen:
                        break
                    if lease is not None and not self._leased(lease):
                        break
                    if vlen >= _HUGE or not self._get_many(managers, p + _REQUEST, vlen, chkpt,
                                                           tag):  # fmt: skip
                        break
                    size = _REQUEST + vlen
                else:
                    # the manager's state: its C fields (no Python code runs)
                    found = PyDict_GetItemWithError(managers, mid)
                    if found == NULL or not isinstance(<object>found, ManagerState):
                        break
                    m = <ManagerState>found
                    if m.closed or (term and <long long>term != m.wire):
                        break
                    if not isinstance(m.working_set, WindowState):
                        break
                    ws = <WindowState>m.working_set
                    if ws.wait_for_keys:
                        break
                    if lease is not None and (op == self.put or once
                                              or not self._leased(lease)):  # fmt: skip
                        break  # (a primary's writes go to its replicas first; a lapsed lease)
                    if once:
                        if head.flags != 0 or vlen != 0 or klen < _DIGEST:
                            break
                        if klen > self.most_key or (op == self.pop and klen != _DIGEST):
                            break
                        if end - pos < _REQUEST + klen or not self._once(
                                m, ws, op == self.pop, p, klen, chkpt, head.arg, head.rid,
                                mid, tag, pos):  # fmt: skip
                            break
                        self.served.add(mid, op, 1)
                        size = _REQUEST + klen
                    elif op == self.put:
                        if head.flags & ~self.persist or klen < _DIGEST or klen > self.most_key:
                            break
                        if vlen > self.most or end - pos < _REQUEST + klen + vlen:
                            break
                        rc = self._put(m, ws, p, klen, vlen, chkpt, mid, pos)
                        if rc == 2:  # (the group dropped: from its first put on, the manager's)
                            pos, served, self.n = self.gpos0, served - self.gputs, self.gn0
                            break
                        if rc == 0:
                            break
                        self._reply(0, tag, 0, NULL, 0)
                        size = _REQUEST + klen + vlen  # (counted once its group is committed)
                    else:
                        size = _REQUEST + (_RANGED if op == self.get_range else _DIGEST)
                        if head.flags != 0 or klen != size - _REQUEST or vlen != 0:
                            break
                        if end - pos < size or not self._read(m, ws, op, p, chkpt, tag):
                            break
                        self.served.add(mid, op, 1)
                pos += size
                served += 1
                if self.n >= _SENT_AT_ONCE:
                    if self.gw != NULL and not self._commit_group():  # (before they leave)
                        pos, served, self.n = self.gpos0, served - self.gputs, self.gn0
                        break
                    reader._pos = pos
                    self.count += served  # (counted before they are answered)
                    served = 0
                    self._send()
            if self.gw != NULL and not self._commit_group():  # (before the replies leave)
                pos, served, self.n = self.gpos0, served - self.gputs, self.gn0
        finally:
            if self.gw != NULL:  # (an error: none of the group written, none answered)
                self._drop_group()
                pos, self.n = self.gpos0, self.gn0
            self._end_snapshot()
            reader._pos = pos
        self.count += served  # (counted before they are answered: seen once they are)
        self._send()
        return pos == end and PyList_GET_SIZE(self.held) == 0


cdef inline Py_ssize_t _slice_bound(int64_t i, Py_ssize_t n) noexcept:
    """A slice's bound ``i`` on a sequence of ``n`` items, as Python adjusts it (a negative
    one counts from the end; cut to ``[0, n]``)."""
    if i < 0:
        i += n
        return 0 if i < 0 else <Py_ssize_t>i
    return n if i > n else <Py_ssize_t>i


# -- at-most-once replies, as shard.replies keeps them (pure.RID...) ------------------


cdef inline void _rid_key(unsigned char* key, const void* rid) noexcept:
    """``key`` (12 bytes): where the reply of the request whose id is the 8 bytes at
    ``rid`` (``RID_ID``'s) is kept, ``RID`` then the id."""
    memcpy(key, PyBytes_AS_STRING(_RID), 4)
    memcpy(key + 4, rid, 8)


cdef bint _kept_reply(const ddict_mdb_api* api, ddict_mdb_txn* w, unsigned int meta,
                      uint64_t rid) except -1:
    """Whether the shard keeps a reply of request ``rid`` (or may: LMDB's error)."""
    cdef unsigned char key[12]
    cdef unsigned char word[8]
    cdef ddict_mdb_val k, v
    _put_le64(word, rid)
    _rid_key(key, word)
    k.mv_size, k.mv_data = 12, key
    return api.get(w, meta, &k, &v) != DDICT_MDB_NOTFOUND


cdef bint _keep_reply(const ddict_mdb_api* api, ddict_mdb_txn* w, unsigned int meta,
                      uint64_t rid, const void* reply, Py_ssize_t n) except -1:
    """Request ``rid``'s ``reply`` (``n`` bytes) kept in ``w`` as ``AtMostOnce._once``
    keeps it: in the ring's next slot, whose request loses its reply: whether it was
    (else the transaction is only to abort)."""
    cdef unsigned char slot[16]
    cdef unsigned char key[12]
    cdef unsigned char word[8]
    cdef ddict_mdb_val k, v
    cdef ddict_mdb_cursor* cur = NULL
    cdef uint64_t seq = 0
    cdef int rc
    k.mv_size, k.mv_data = PyBytes_GET_SIZE(_RID_SEQ), <void*>PyBytes_AS_STRING(_RID_SEQ)
    rc = api.get(w, meta, &k, &v)
    if rc == 0 and v.mv_size == 8:
        seq = _le64(<const unsigned char*>v.mv_data)
    elif rc != DDICT_MDB_NOTFOUND:
        return False
    memcpy(slot, PyBytes_AS_STRING(_RID_SLOT), 8)
    _put_le64(slot + 8, seq % _RID_KEEP)
    k.mv_size, k.mv_data = 16, slot
    rc = api.get(w, meta, &k, &v)
    if rc == 0 and v.mv_size == 8:  # (the slot's request: its reply goes)
        _rid_key(key, v.mv_data)
        k.mv_size, k.mv_data = 12, key
        if api.cursor_open(w, meta, &cur):
            return False
        rc = api.cursor_get(cur, &k, &v, DDICT_MDB_SET_KEY)
        if rc == 0:
            rc = api.cursor_del(cur, 0)
        api.cursor_close(cur)
        if rc and rc != DDICT_MDB_NOTFOUND:
            return False
    elif rc != DDICT_MDB_NOTFOUND:
        return False
    _put_le64(word, rid)
    k.mv_size, k.mv_data, v.mv_size, v.mv_data = 16, slot, 8, word
    if api.put(w, meta, &k, &v, 0):
        return False
    _put_le64(word, seq + 1)
    k.mv_size, k.mv_data = PyBytes_GET_SIZE(_RID_SEQ), <void*>PyBytes_AS_STRING(_RID_SEQ)
    v.mv_size, v.mv_data = 8, word
    if api.put(w, meta, &k, &v, 0):
        return False
    _put_le64(word, rid)
    _rid_key(key, word)
    k.mv_size, k.mv_data, v.mv_size, v.mv_data = 12, key, <size_t>n, <void*>reply
    return api.put(w, meta, &k, &v, 0) == 0


# -- fetch_add's values: ints pickled as dumps_value pickles them ----------------------


cdef bint _int_of(const unsigned char* f, Py_ssize_t flen, int64_t* out) noexcept:
    """The int of value frame ``f`` if it is one of 64 bits pickled in band with protocol 5
    (``BININT1``, ``BININT2``, ``BININT`` or ``LONG1`` of at most 8 bytes, in a ``FRAME``
    or not): whether it was (any other frame is the manager's to read)."""
    cdef const unsigned char* q
    cdef Py_ssize_t plen, nb, i
    cdef uint64_t u = 0
    if flen < _HEAD + 5 or f[0] != _FMT_PICKLE or f[1] or f[2] or f[3] or _le32(f + 4):
        return False
    if _le64(f + 8) != <uint64_t>(flen - _HEAD):
        return False
    q, plen = f + _HEAD + 2, flen - _HEAD - 2
    if f[_HEAD] != 0x80 or f[_HEAD + 1] != 5:
        return False
    if plen >= 9 and q[0] == 0x95:  # FRAME: its length, then the frame
        if _le64(q + 1) != <uint64_t>(plen - 9):
            return False
        q, plen = q + 9, plen - 9
    if plen < 3 or q[plen - 1] != 0x2E:  # STOP
        return False
    if q[0] == 0x4B and plen == 3:  # BININT1
        out[0] = q[1]
    elif q[0] == 0x4D and plen == 4:  # BININT2
        out[0] = q[1] | (<int64_t>q[2] << 8)
    elif q[0] == 0x4A and plen == 6:  # BININT
        out[0] = <int32_t>_le32(q + 1)
    elif q[0] == 0x8A and 1 <= q[1] <= 8 and plen == 3 + q[1]:  # LONG1
        nb = q[1]
        for i in range(nb):
            u |= (<uint64_t>q[2 + i]) << (8 * i)
        if nb < 8 and q[1 + nb] & 0x80:  # (negative: its sign carried up)
            u |= ~((<uint64_t>1 << (8 * nb)) - 1)
        out[0] = <int64_t>u
    else:
        return False
    return True


cdef Py_ssize_t _int_frame(int64_t x, unsigned char* f) noexcept:
    """``dumps_value(x).join()`` into ``f`` (at most ``_MOST_INT_FRAME`` bytes): the
    frame's header, then ``pickle.dumps(x, 5)`` as CPython's pickler writes it (the
    smallest of ``BININT1``, ``BININT2``, ``BININT``, else ``LONG1`` of the fewest
    bytes; a ``FRAME`` around a body of 4 bytes or more); its length."""
    cdef unsigned char body[12]
    cdef Py_ssize_t nb, blen, at
    cdef uint64_t a
    cdef int i
    if 0 <= x < 256:
        body[0], body[1], blen = 0x4B, <unsigned char>x, 2
    elif 0 <= x < 65536:
        body[0], body[1], body[2], blen = 0x4D, x & 0xFF, (x >> 8) & 0xFF, 3
    elif -2147483648 <= x <= 2147483647:
        body[0] = 0x4A
        _put_le32(body + 1, <uint32_t><int32_t>x)
        blen = 5
    else:  # LONG1: two's complement, little-endian, of (bit length // 8) + 1 bytes
        a = <uint64_t>x if x >= 0 else <uint64_t>0 - <uint64_t>x
        nb = ((64 - __builtin_clzll(a)) >> 3) + 1
        for i in range(nb):
            body[2 + i] = (<uint64_t>x >> (8 * i)) & 0xFF if i < 8 else (0xFF if x < 0 else 0)
        if x < 0 and nb > 1 and body[1 + nb] == 0xFF and body[nb] & 0x80:
            nb -= 1  # (a redundant sign byte)
        body[0], body[1], blen = 0x8A, <unsigned char>nb, 2 + nb
    body[blen] = 0x2E  # STOP
    blen += 1
    at = _HEAD
    f[at], f[at + 1] = 0x80, 5  # PROTO 5
    at += 2
    if blen >= 4:
        f[at] = 0x95
        _put_le64(f + at + 1, <uint64_t>blen)
        at += 9
    memcpy(f + at, body, blen)
    at += blen
    ddict_value_head(f, _FMT_PICKLE, <uint64_t>(at - _HEAD))
    return at


def poll_and_serve(ep, dict conns not None, int most):
    cdef epoll_event events[_MOST_EVENTS]
    cdef int epfd = ep.fileno(), n, i, err = 0
    cdef list left = []
    cdef PyObject* found
    most = max(1, min(most, _MOST_EVENTS))
    while not left:  # (a wake-up served whole waits again here, not in the caller's loop)
        with nogil:
            n = epoll_wait(epfd, events, most, -1)
            if n < 0:
                err = errno
        if n < 0:
            if err == EINTR:  # (waited again, as epoll.poll does: PEP 475)
                PyErr_CheckSignals()
                continue
            raise OSError(err, os.strerror(err))
        for i in range(n):
            fd = events[i].data.fd
            found = PyDict_GetItemWithError(conns, fd)
            c = None if found == NULL else <object>found  # (a reference of its own)
            if c is None:
                plain = reader = None
            elif isinstance(c, ConnectionState):  # (the loop's: its fields, no lookups)
                plain, reader = (<ConnectionState>c).plain, (<ConnectionState>c).reader
            else:
                plain, reader = c.plain, None  # (its reader read as the pure set reads it)
            if plain is None:
                left.append((fd, None))
                continue
            try:
                _receive_nowait(c.reader if reader is None else reader)
                if (<PlainServer>plain).serve() if type(plain) is PlainServer else plain.serve():
                    continue
            except Exception as e:  # (the connection's end: the caller's to say)
                left.append((fd, e))
                continue
            left.append((fd, None))
    return left
