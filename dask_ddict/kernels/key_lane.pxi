# A handle's single-key operations over a TCP link, and its get_many over TCP links, each
# in one call (``pure.KeyLane``).
#
# Included by _compiled.pyx.  ``pure.KeyLane`` states the rules: the lane serves the
# common case of the handle's Python path (an open handle, a plain TCP link with an idle
# connection, a request that fits one send) and answers ``NotImplemented`` for anything
# else, before anything was sent, or after a reply that is not OK, or a broken
# connection (a timed request already sent: a ``Resend`` with its start); the caller's
# Python path then sends the request again and says what happened.  Here the whole
# exchange runs without a Python frame: the route (``Router``), the manager's channel
# and link, the pool's lock taken without waiting, the request written into the
# connection's receive buffer (empty while it is idle) and sent, and the reply received
# there with the interpreter lock released (``_receive_reply``); the header is written
# by ``framing.pxi``'s ``ddict_write_request``.  With a timeout every wait is a ``poll``
# of what is left of the operation's deadline (``_wait_fd``).  A get_many (untimed) groups
# its keys by manager in C arrays, writes one request per link into its connection's
# buffer, sends them all, then receives and decodes each reply (``unpack_values``) before
# its connection goes back (one of small frames is received into the connection's buffer).

cdef double _NO_TIMEOUT = -1.0  # (encode_timeout(None): a request that never times out)
cdef long long _MOST_MANAGER = 0xFFFFF  # (a get_many's manager ids index a table of ints)
cdef double _LONG_WAIT = 3600.0  # (a slice of an endless wait on a non-blocking socket)
cdef object _randbits = secrets.randbits
cdef Py_ssize_t _KEPT_REPLY = 256 << 10  # (a many-key reply of small frames, at most: _kept)


cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void* op)


cdef inline bint _all_bytes(tuple t):
    """Whether every item of ``t`` is a ``bytes`` (which refers to nothing)."""
    for item in t:
        if type(item) is not bytes:
            return False
    return True


cdef int _move_all(sock, char* p, Py_ssize_t n, bint sending, bint blocking,
                   double deadline) except -1:
    """``p[:n]`` sent on ``sock`` (``sending``), or ``n`` bytes received into ``p`` (a large
    reply's payload): a blocking descriptor's ``send``/``recv``, else without waiting and
    a wait for room or data cut at ``deadline``.  1 moved, 0 the deadline passed first."""
    cdef Py_ssize_t done = 0
    cdef ssize_t k
    cdef int fd, err = 0, flags = 0 if blocking else MSG_DONTWAIT
    while done < n:
        fd = _fd_of(sock)  # (each time: another thread may have closed it meanwhile)
        if fd < 0:
            raise OSError(EBADF, os.strerror(EBADF))
        with nogil:
            if sending:
                k = send(fd, p + done, <size_t>(n - done), flags)
            else:
                k = recv(fd, p + done, <size_t>(n - done), flags)
            if k < 0:
                err = errno
        if k > 0 or (k == 0 and sending):
            done += k
        elif k == 0:
            raise ConnectionResetError("connection closed by peer")
        elif err == EINTR:
            PyErr_CheckSignals()
        elif not blocking and (err == EAGAIN or err == EWOULDBLOCK):
            if not _wait_fd(fd, POLLOUT if sending else POLLIN, deadline):
                return 0
        else:
            raise OSError(err, os.strerror(err))
    return 1


cdef class KeyLane:
    cdef readonly object wire
    cdef object channel, pool, timing, buffer, decode, timed_out, deadline
    cdef object _acquire, _release, _idle
    cdef ManagerLock _lock  # (the pool's lock, when it is the compiled one: no call)
    cdef int op_get, op_contains, op_put, op_get_many, op_pop, op_fetch_add
    cdef int persist, missing, timeout_status
    cdef Py_ssize_t most, small, record_framing

    def __init__(self, wire, channel, pool, timing, buffer, decode, timed_out, deadline):
        self.wire = wire
        self.op_get, self.op_contains, self.op_put = wire.get, wire.contains, wire.put
        self.op_get_many, self.op_pop, self.op_fetch_add = wire.get_many, wire.pop, wire.fetch_add
        self.persist, self.missing = wire.persist, wire.missing_status
        self.timeout_status = wire.timeout_status
        self.most, self.small = wire.most, wire.small
        self.record_framing = wire.record_framing
        self.channel, self.pool, self.timing = channel, pool, timing
        self.buffer, self.decode = buffer, decode
        self.timed_out, self.deadline = timed_out, deadline
        self._acquire, self._release = pool.lock.acquire, pool.lock.release
        self._lock = pool.lock if type(pool.lock) is ManagerLock else None
        self._idle = pool.idle  # (the pool's own table of idle connections: never replaced)

    def __repr__(self):
        return f"<KeyLane most={self.most}>"

    def get(self, h, key):
        cdef bint here = False
        cdef object got = self._read(h, key, self.op_get, &here)
        if here or type(got) is not tuple:
            return got
        if (<tuple>got)[0] == 0:  # (raw bytes received into the value: a Taken, decode's)
            return _frame_value((<tuple>got)[2], self.decode)
        return NO_KEY

    def contains(self, h, key):
        cdef bint here = False
        cdef object got = self._read(h, key, self.op_contains, &here)
        if here:
            return got
        return bool((<tuple>got)[1]) if type(got) is tuple else got

    def pop(self, h, key):
        cdef object got = self._once(h, key, self.op_pop, 0)
        if type(got) is not tuple:
            return got
        if (<tuple>got)[0] == 0:  # (in a tuple of one: pure.KeyLane.pop)
            return (_frame_value((<tuple>got)[2], self.decode),)
        return NO_KEY

    def fetch_add(self, h, key, n):
        cdef object got = self._once(h, key, self.op_fetch_add, n)
        if type(got) is not tuple:
            return got
        return _frame_value((<tuple>got)[2], self.decode)

    cdef object _once(self, h, key, int op, object n):
        """``_exchange`` of an at-most-once operation on ``key`` (``pure.KeyLane._once``)."""
        cdef tuple route
        cdef object routed = self._routed(h)
        if routed is None or h._batch is not None:
            return NotImplemented
        try:
            route = (<Router>routed).one(key)
        except KeyTooLong:
            return NotImplemented
        kb = route[2]
        if op == self.op_pop:
            keysec = route[1]
        elif type(kb) is bytes:
            keysec = route[1] + kb
        else:
            return NotImplemented
        return self._exchange(h, key, route[0], op, 0, keysec, None, 0, h._client_id, n,
                              _randbits(63) + 1)  # (a new request id, as the link draws one)

    cdef object _read(self, h, key, int op, bint* here):
        """``_exchange`` of a read of ``key``; or (``here[0]`` set: the answer as it is) a
        read of a shard mapped here, ``SharedState._here`` (``pure.KeyLane._read``)."""
        cdef tuple route
        cdef long long chkpt
        cdef object routed = self._routed(h, False)
        if routed is None:
            return NotImplemented
        try:
            route = (<Router>routed).one(key)
        except KeyTooLong:  # (the Python path says why)
            return NotImplemented
        core = h._core
        target = h._target
        ch = (<dict>core._channels).get(route[0] if target is None else target)
        if isinstance(ch, SharedState):
            here[0] = True
            digest = route[1]
            if (self.timing.on or type(digest) is not bytes
                    or not _small_int(h._chkpt, 0x7FFFFFFFFFFFFFFF, &chkpt)):  # fmt: skip
                return NotImplemented
            return (<SharedState>ch)._here(<bytes>digest, chkpt, op == self.op_contains,
                                           self.decode)
        if not core.tcp:
            return NotImplemented
        return self._exchange(h, key, route[0], op, 0, route[1], None, 0, 0)

    def put(self, h, key, value, bint persistent):
        cdef tuple rec
        cdef long long chkpt
        cdef object routed = self._routed(h, False)
        if routed is None or h._batch is not None:
            return NotImplemented
        if type(value) is bytes and PyBytes_GET_SIZE(value) > self.most:  # (not framed twice)
            return NotImplemented
        core = h._core
        target = h._target
        try:
            if core.tcp:
                rec = (<Router>routed).record(key, value, h._routed[1])
            else:  # (only a channel that commits here takes it: found before framing)
                rec = (<Router>routed).one(key)
                ch = (<dict>core._channels).get(rec[0] if target is None else target)
                if not isinstance(ch, SharedState) or not (<SharedState>ch)._may_put():
                    return NotImplemented
                rec = rec + ((<Router>routed).framed(value, h._routed[1]),)
        except KeyTooLong:
            return NotImplemented
        framed, kb = rec[3], rec[2]
        room = core._room  # (None: not known yet; a value too large: the Python path's)
        if room is None or type(framed) is not Framed or framed.nbytes + len(kb) > room:
            return NotImplemented
        ch = (<dict>core._channels).get(rec[0] if target is None else target)
        if isinstance(ch, SharedState):  # (committed here, or the Python path's)
            if (self.timing.on or type(kb) is not bytes or type(rec[1]) is not bytes
                    or not _small_int(h._chkpt, 0x7FFFFFFFFFFFFFFF, &chkpt)):  # fmt: skip
                return NotImplemented
            return (<SharedState>ch)._put_here(<bytes>rec[1], <bytes>kb, framed, chkpt)
        if not core.tcp:
            return NotImplemented
        got = self._exchange(h, key, rec[0], self.op_put, self.persist if persistent else 0,
                             rec[1] + kb, framed.parts, framed.nbytes, h._client_id)
        return None if type(got) is tuple else got

    def batch_put(self, h, key, value, bint persistent):
        """``None`` once buffered in the handle's open batch, or ``NotImplemented``
        (``pure.KeyLane.batch_put``: the rules): ``BatchPut.add``'s common case in C,
        after the route and frame of ``Router.record``."""
        cdef tuple rec
        cdef Py_ssize_t own, size, flush_bytes
        core, batch = h._core, h._batch
        if core.closed or h._detached or batch is None or batch.persist is not persistent:
            return NotImplemented
        routed = h._routed
        room = core._room
        if (type(routed) is not tuple or type((<tuple>routed)[0]) is not Router
                or room is None):  # fmt: skip
            return NotImplemented
        try:
            rec = (<Router>(<tuple>routed)[0]).record(key, value, (<tuple>routed)[1])
        except KeyTooLong:  # (the Python path says why)
            return NotImplemented
        framed, kb = rec[3], rec[2]
        mid = rec[0] if h._target is None else h._target
        if type(framed) is not Framed or type(kb) is not bytes:
            return NotImplemented
        own = <Py_ssize_t>(<tuple>framed)[1] + PyBytes_GET_SIZE(kb)
        if own > room:  # (refused by the Python path, saying why at the batch's end)
            return NotImplemented
        route = (<dict>batch._routes).get(mid)
        flush_bytes = batch.flush_bytes
        own += self.record_framing
        sizes = <dict>batch.sizes
        if route is None or (own >= flush_bytes and sizes.get(route)):
            batch.add_kept(mid, rec[1], kb, framed, h._chkpt)  # (a manager's first, a large one)
            return None
        batch._chkpt = h._chkpt
        records = (<dict>batch.records).get(mid)
        if records is None:
            records = (<dict>batch.records)[mid] = []
        record = (rec[1], kb, framed)
        parts = (<tuple>framed)[0]
        if type(parts) is tuple and _all_bytes(<tuple>parts) and type(rec[1]) is bytes:
            # (no cycle can pass through it: the collector need not scan it)
            PyObject_GC_UnTrack(<PyObject*>parts)
            PyObject_GC_UnTrack(<PyObject*>framed)
            PyObject_GC_UnTrack(<PyObject*>record)
        (<list>records).append(record)
        size = <Py_ssize_t>sizes.get(route, 0) + own
        sizes[route] = size
        if size >= flush_bytes:
            batch.filled(route)
        return None

    cdef object _routed(self, h, bint tcp=True):
        """The handle's router, if it is one the lane serves now (else ``None``; ``tcp``:
        over a TCP link, so not for a core that has none)."""
        core = h._core
        if (tcp and not core.tcp) or core.closed or h._detached or h._vp is not None:
            return None
        routed = h._routed
        if type(routed) is not tuple or type((<tuple>routed)[0]) is not Router:
            return None
        return (<tuple>routed)[0]

    cdef object _take(self, link, Py_ssize_t total):
        """One of ``link``'s idle connections, as ``IdlePool.take`` takes it, whose receive
        buffer is empty and holds a request of ``total`` bytes, its waits the lane's own
        (``BoundedConnection.begin(None, None)``); ``None``: none idle, the pool's lock
        busy, or one that does not fit (given back as it was)."""
        if not self._take_lock():
            return None
        try:
            idle = link.idle
            if not idle:
                return None
            conn = idle.pop()
            del self._idle[conn]
        finally:
            self._give_lock()
        reader = conn.reader
        if reader._pos != reader._end or PyByteArray_GET_SIZE(reader._buf) < total:
            self._give(link, conn)
            return None
        conn.deadline = None
        conn.check = None
        return conn

    cdef int _give(self, link, conn) except -1:
        """``conn`` back to the pool, as ``IdlePool.give`` gives it (which does it, past
        the pool's bound or a closed link, or with its lock busy)."""
        conn.check = None
        if self._take_lock():
            try:
                if not link.closed and len(self._idle) < self.pool.most:
                    link.idle.append(conn)
                    self._idle[conn] = link
                    return 0
            finally:
                self._give_lock()
        self.pool.give(link, conn)
        return 0

    cdef inline bint _take_lock(self) except -1:
        """The pool's lock taken now (else busy: nothing waited for)."""
        if self._lock is not None:
            return self._lock.take()
        return bool(self._acquire(False))

    cdef inline int _give_lock(self) except -1:
        if self._lock is not None:
            self._lock.give()
        else:
            self._release()
        return 0

    cdef object _reply(self, conn, bytearray buf, bint blocking, double deadline,
                       bint frames=False):
        """``(status, ival, payload)`` of the reply to the request in flight on ``conn``,
        received into ``buf`` (its reader's), a large payload into a buffer of its own
        (``frames``, a many-key reply: of small frames only, into the connection's buffer,
        :meth:`_kept`); ``None`` once ``deadline`` (negative: none) passed first."""
        cdef Py_buffer view
        cdef Py_ssize_t have
        sock = conn.sock
        got = 0
        while True:
            wait = None if blocking else (
                _LONG_WAIT if deadline < 0 else max(deadline - _monotonic(), 0.0))
            status, ival, plen, payload, got = _receive_reply(sock, buf, got, wait, self.small)
            if status != _QUIET:
                break
            if deadline >= 0 and _monotonic() >= deadline:
                return None
        if payload is None and frames and status == 0:
            payload = self._kept(conn, buf, got, plen, blocking, deadline)
            if payload is False:
                return None
        elif payload is None and status == 0:
            payload = self._raw(sock, buf, got, plen, blocking, deadline)
            if payload is False:
                return None
        if payload is None:  # (a large one: into a buffer of its own)
            payload = self.buffer(plen)
            PyObject_GetBuffer(payload, &view, PyBUF_WRITABLE)
            try:
                have = min(<Py_ssize_t>got - _REPLY, view.len)
                memcpy(view.buf, PyByteArray_AS_STRING(buf) + _REPLY, have)
                if not _move_all(sock, <char*>view.buf + have, view.len - have, False,
                                 blocking, deadline):
                    return None
            finally:
                PyBuffer_Release(&view)
        return status, ival, payload

    cdef object _kept(self, conn, bytearray buf, Py_ssize_t got, uint64_t plen, bint blocking,
                      double deadline):
        """A many-key reply's payload received into ``conn``'s own buffer (``buf``, which
        holds its first ``got`` bytes; grown to fit), when every frame in it is under
        ``small`` (the table is in the bytes received) and it is at most ``_KEPT_REPLY``
        bytes (a connection's buffer then keeps at most twice that): each frame's value is
        then a copy (``unpack_values``), nothing refers to the buffer once they are
        decoded, and the reply costs no buffer of its own (a pool's buffer and its
        finalizer, some 5 us of a 1,000-key ``get_many``).  ``None``: not such a reply;
        ``False``: ``deadline`` passed first."""
        cdef const unsigned char* p = <const unsigned char*>PyByteArray_AS_STRING(buf) + _REPLY
        cdef Py_ssize_t have = got - _REPLY, n, i, need
        if plen > <uint64_t>_KEPT_REPLY or have < 4:
            return None
        n = <Py_ssize_t>_le32(p)
        if 4 + 8 * n > have:
            return None
        for i in range(n):
            if <int64_t>_le64(p + 4 + 8 * i) >= self.small:
                return None
        need = _REPLY + <Py_ssize_t>plen
        if PyByteArray_GET_SIZE(buf) < need:  # (grown by Reader.reserve, its bytes kept)
            reader = conn.reader
            reader.received(0, got)
            reader.reserve(need)
            reader.received(0, 0)
            buf = reader._buf
        if not _move_all(conn.sock, PyByteArray_AS_STRING(buf) + got, need - got, False,
                         blocking, deadline):  # fmt: skip
            return False
        return memoryview(buf)[_REPLY:need]

    cdef object _raw(self, sock, bytearray buf, Py_ssize_t got, uint64_t plen, bint blocking,
                     double deadline):
        """A large reply that is one raw-bytes value's frame (its head among the ``got``
        bytes received into ``buf``), received straight into the ``bytes`` that is the
        value: a ``Taken``, copied once where a buffer of the frame was copied again by
        its decoding.  ``None``: not such a reply; ``False``: ``deadline`` passed first."""
        cdef const unsigned char* p = <const unsigned char*>PyByteArray_AS_STRING(buf) + _REPLY
        cdef Py_ssize_t have = got - _REPLY, n
        if have < _HEAD or p[0] != _FMT_BYTES or _le64(p + 8) != plen - <uint64_t>_HEAD:
            return None
        n = <Py_ssize_t>(plen - <uint64_t>_HEAD)
        value = PyBytes_FromStringAndSize(NULL, n)
        have = min(have - _HEAD, n)
        memcpy(PyBytes_AS_STRING(value), p + _HEAD, have)
        if not _move_all(sock, PyBytes_AS_STRING(value) + have, n - have, False, blocking,
                         deadline):
            return False
        return Taken(value)

    cdef object _exchange(self, h, key, object mid, int op, int flags, bytes keysec,
                          object parts, object vlen_, object client, object arg_=0,
                          uint64_t rid=0):
        """``(status, ival, payload)``, ``NotImplemented`` or a ``Resend`` (``pure.KeyLane``)."""
        cdef long long m, term, chkpt, cid, vlen, arg
        cdef Py_ssize_t klen = PyBytes_GET_SIZE(keysec), total, at
        cdef bytearray buf
        cdef unsigned char* p
        cdef Py_buffer view
        cdef ddict_request_head head
        cdef double began, deadline = -1.0, wire_timeout = _NO_TIMEOUT
        cdef bint blocking, late = False
        target = h._target
        if target is not None:
            mid = target
        core = h._core
        ch = (<dict>core._channels).get(mid)
        if type(ch) is not self.channel or self.timing.on:
            return NotImplemented
        link = ch.link
        if link.kind != "tcp":
            return NotImplemented
        if not (_small_int(mid, 0xFFFFFFFF, &m) and _small_int(vlen_, self.most, &vlen)
                and _small_int(h._chkpt, 0x7FFFFFFFFFFFFFFF, &chkpt)
                and _small_int(client, 0x7FFFFFFFFFFFFFFF, &cid)):
            return NotImplemented
        if not _signed_int(arg_, &arg):  # (past 64 bits: the Python path says so)
            return NotImplemented
        total = _REQUEST + klen + <Py_ssize_t>vlen
        if total > self.most or not (vlen <= link._max_value):
            return NotImplemented
        if not _small_int(link.terms.get(mid, 0), 0xFFFF, &term):
            return NotImplemented
        timeout = h._timeout
        began = _monotonic()
        if timeout is not None:  # (the operation's time and the link's slack, as _exchange)
            wire_timeout = timeout
            deadline = began + wire_timeout + <double>link._slack
        conn = self._take(link, total)
        if conn is None:
            return NotImplemented
        buf = conn.reader._buf
        # (a socket without a timeout blocks; one a timed operation left with its own
        # does not, and is waited for by poll, as is every timed operation's)
        blocking = conn.timeout is None and deadline < 0
        p = <unsigned char*>PyByteArray_AS_STRING(buf)
        head.op, head.flags, head.term = op, flags, <unsigned int>term
        head.klen, head.manager, head.tag = <uint32_t>klen, <uint32_t>m, 0
        head.chkpt, head.arg, head.client = chkpt, arg, <uint64_t>cid
        head.timeout, head.vlen, head.rid = wire_timeout, <uint64_t>vlen, rid
        ddict_write_request(p, &head)
        memcpy(p + _REQUEST, PyBytes_AS_STRING(keysec), klen)
        at = _REQUEST + klen
        try:  # (nothing sent yet: a part that fails gives the connection back as it was)
            if parts is not None:
                for part in parts:
                    PyObject_GetBuffer(part, &view, PyBUF_SIMPLE)
                    try:
                        if view.len > total - at:
                            at = -1
                            break
                        memcpy(p + at, view.buf, view.len)
                        at += view.len
                    finally:
                        PyBuffer_Release(&view)
        except BaseException:
            self._give(link, conn)
            raise
        if at != total:  # (parts that do not add up to the value's length: not for here)
            self._give(link, conn)
            return NotImplemented
        # (once sent: a request id is sent again with it, never a new one)
        again = NotImplemented if deadline < 0 and rid == 0 else Resend(began, rid)
        try:
            late = not _move_all(conn.sock, <char*>p, total, True, blocking, deadline)
            if not late:
                reply = self._reply(conn, buf, blocking, deadline)
                late = reply is None
        except OSError:
            link._broken(conn)
            return again
        except BaseException:
            link.forget(conn)
            raise
        if late:  # (no answer within the operation's time: what the Python path raises)
            link.forget(conn)
            raise self.timed_out(h, key, op, link, mid, None)
        self._give(link, conn)
        status, ival, payload = reply
        if status == 0 or (status == self.missing and (op == self.op_get or op == self.op_pop)):
            return status, ival, payload
        if status == self.timeout_status and deadline >= 0:
            raise self.timed_out(h, key, op, link, mid, bytes(payload))
        return again

    def get_many(self, h, list keys not None, absent):
        """``(values, marked)`` of ``h.get_many(keys)``, or ``NotImplemented``
        (``pure.KeyLane.get_many``: the rules).  The keys are grouped by manager in C
        (a manager's group index by its id, a key's group by its index), each link's
        request is written into its connection's buffer (the table, then each key's
        digest at its group's place), every request is sent before any reply is read,
        and each reply is decoded where it was received and its values put back in the
        keys' order."""
        cdef Py_ssize_t n = PyList_GET_SIZE(keys), i, g, k, ngroups = 0, nlinks
        cdef long mid, most_mid = -1, target_mid = -1
        cdef long long chkpt, field
        cdef int* slot = NULL  # (each key's group; first its manager)
        cdef int* slot_of = NULL  # (each manager id's group, or -1)
        cdef int* link_of = NULL  # (each group's link)
        cdef Py_ssize_t* place = NULL  # (where a group's next digest goes in its request)
        cdef Py_ssize_t* count = NULL  # (each group's keys)
        cdef unsigned char** bufs = NULL  # (each link's request buffer)
        cdef object routed = self._routed(h)
        cdef list mids = [], links = [], conns = [], states = [], replies = []
        cdef dict link_index = {}
        if routed is None or n == 0 or self.timing.on:
            return NotImplemented
        if not _small_int(h._chkpt, 0x7FFFFFFFFFFFFFFF, &chkpt):
            return NotImplemented
        target = h._target
        if target is not None:
            if not _small_int(target, _MOST_MANAGER, &field):
                return NotImplemented
            target_mid = <long>field
        try:
            routes = (<Router>routed).many(keys)
        except KeyTooLong:  # (the Python path says why)
            return NotImplemented
        if type(routes) is not list or PyList_GET_SIZE(routes) != n:
            return NotImplemented
        chans = <dict>h._core._channels
        slot = <int*>PyMem_Malloc(n * sizeof(int))
        if slot == NULL:
            raise MemoryError()
        try:
            for i in range(n):  # each key's manager, checked
                route = (<list>routes)[i]
                if type(route) is not tuple or len(<tuple>route) != 2:
                    return NotImplemented
                if target_mid >= 0:
                    mid = target_mid
                elif not _small_int((<tuple>route)[0], _MOST_MANAGER, &field):
                    return NotImplemented
                else:
                    mid = <long>field
                d = (<tuple>route)[1]
                if type(d) is not bytes or PyBytes_GET_SIZE(d) != _DIGEST:
                    return NotImplemented
                slot[i] = <int>mid
                if mid > most_mid:
                    most_mid = mid
            slot_of = <int*>PyMem_Malloc((most_mid + 1) * sizeof(int))
            count = <Py_ssize_t*>PyMem_Calloc(min(n, most_mid + 1), sizeof(Py_ssize_t))
            if slot_of == NULL or count == NULL:
                raise MemoryError()
            memset(slot_of, 0xFF, (most_mid + 1) * sizeof(int))  # (-1: no group yet)
            for i in range(n):  # each key's group: its manager's, in the order first seen
                g = slot_of[slot[i]]
                if g < 0:
                    g = slot_of[slot[i]] = <int>ngroups
                    ngroups += 1
                    mids.append(slot[i])
                slot[i] = <int>g
                count[g] += 1
            link_of = <int*>PyMem_Malloc(ngroups * sizeof(int))
            place = <Py_ssize_t*>PyMem_Malloc(ngroups * sizeof(Py_ssize_t))
            bufs = <unsigned char**>PyMem_Malloc(ngroups * sizeof(unsigned char*))  # (<= groups)
            if link_of == NULL or place == NULL or bufs == NULL:
                raise MemoryError()
            for g in range(ngroups):  # each group's link: a plain TCP one's
                ch = chans.get(mids[g])
                if type(ch) is not self.channel:
                    return NotImplemented
                link = ch.link
                if link.kind != "tcp":
                    return NotImplemented
                k = link_index.get(link, -1)
                if k < 0:
                    k = len(links)
                    link_index[link] = k
                    links.append(link)
                link_of[g] = <int>k
            nlinks = len(links)
            return self._many(h, n, absent, routes, chkpt, mids, links, conns, states,
                              replies, slot, link_of, place, count, bufs, ngroups, nlinks)
        finally:
            PyMem_Free(slot)
            PyMem_Free(slot_of)
            PyMem_Free(link_of)
            PyMem_Free(place)
            PyMem_Free(count)
            PyMem_Free(bufs)

    cdef object _many(self, h, Py_ssize_t n, absent, list routes, long long chkpt, list mids,
                      list links, list conns, list states, list replies, int* slot,
                      int* link_of, Py_ssize_t* place, Py_ssize_t* count,
                      unsigned char** bufs, Py_ssize_t ngroups, Py_ssize_t nlinks):
        """:meth:`get_many`'s exchange of ``n`` keys, once grouped (``states``: each link's
        connection taken 0, its request sent 1, its reply received and the connection
        given back 2; ``bufs``: room for each link's request buffer).  A handle with a
        timeout: each link's waits end at the operation's deadline (the time and the
        link's slack from the start, as the Python path's exchange counts it); one that
        passes raises the Python path's error for that link, and what would be
        ``NotImplemented`` once sent is a :class:`Resend` (its time counted from here)."""
        cdef Py_ssize_t i, g, k, at, total, groups
        cdef Py_ssize_t vlen
        cdef unsigned char* p
        cdef ddict_request_head head
        cdef Py_ssize_t failing = -1
        cdef list out, marked, counts, values, cursor
        cdef bint unfit = False  # (a reply the Python path must take)
        cdef bint late = False  # (a link's deadline passed: ``failing``'s)
        cdef double began = _monotonic(), wire_timeout = _NO_TIMEOUT, deadline = -1.0
        error = None  # (a kept reply's decoding error)
        timeout = h._timeout
        if timeout is not None:
            wire_timeout = timeout
        deadlines = [-1.0 if timeout is None else began + wire_timeout + <double>link._slack
                     for link in links]  # (each link's, as its exchange counts it)
        again = NotImplemented if timeout is None else Resend(began)  # (once sent)
        # the requests: each link's size, then a connection that holds it
        sizes = []
        for k in range(nlinks):
            groups, total = 0, 0
            for g in range(ngroups):
                if link_of[g] == k:
                    groups += 1
                    total += count[g]
            vlen = 4 + 8 * groups + _DIGEST * total
            if _REQUEST + vlen > self.most or not (vlen <= links[k]._max_value):
                return NotImplemented
            sizes.append(vlen)
        for k in range(nlinks):
            conn = self._take(links[k], _REQUEST + <Py_ssize_t>sizes[k])
            if conn is None:
                break
            conns.append(conn)
            states.append(0)
        if len(conns) < nlinks:  # (nothing sent: every connection back as it was)
            for k in range(len(conns)):
                self._give(links[k], conns[k])
            return NotImplemented
        try:  # (an error before a request went out gives its connection back)
            for k in range(nlinks):  # each request: the header and the table
                p = <unsigned char*>PyByteArray_AS_STRING((<object>conns[k]).reader._buf)
                head.op, head.flags, head.term, head.klen = self.op_get_many, 0, 0, 0
                head.manager, head.tag = 0, 0
                head.chkpt, head.arg, head.client = chkpt, 0, 0
                head.timeout, head.vlen, head.rid = wire_timeout, <uint64_t>sizes[k], 0
                groups, at = 0, _REQUEST + 4
                for g in range(ngroups):
                    if link_of[g] == k:
                        if groups == 0:
                            head.manager = <uint32_t>mids[g]
                        _put_le32(<char*>p + at, <uint32_t>mids[g])
                        _put_le32(<char*>p + at + 4, <uint32_t>count[g])
                        at += 8
                        groups += 1
                _put_le32(<char*>p + _REQUEST, <uint32_t>groups)
                ddict_write_request(p, &head)
                for g in range(ngroups):  # (each group's digests after the ones before it)
                    if link_of[g] == k:
                        place[g] = at
                        at += _DIGEST * count[g]
                bufs[k] = p  # (each request's buffer: not resized until they are sent)
            for i in range(n):  # each key's digest, in its group's place
                g = slot[i]
                memcpy(bufs[link_of[g]] + place[g],
                       PyBytes_AS_STRING((<tuple>(<list>routes)[i])[1]), _DIGEST)
                place[g] += _DIGEST
            for k in range(nlinks):
                failing = k
                conn = conns[k]
                deadline = <double>deadlines[k]
                if not _move_all(conn.sock, <char*>bufs[k], _REQUEST + <Py_ssize_t>sizes[k],
                                 True, conn.timeout is None and deadline < 0, deadline):
                    late = True  # (its error raised below: a DDictTimeoutError is an OSError)
                    break
                states[k] = 1
            # each reply: one in its connection's buffer decoded before the connection goes
            # back (an error decoding it raised once all are back), the others after
            for k in range(0 if late else nlinks):
                failing = k
                conn = conns[k]
                buf = conn.reader._buf
                deadline = <double>deadlines[k]
                got = self._reply(conn, buf, conn.timeout is None and deadline < 0, deadline, True)
                if got is None:
                    late = True
                    break
                status, _, payload = got
                if type(payload) is memoryview and payload.obj is conn.reader._buf:
                    got = NotImplemented
                    try:
                        if error is None and not unfit:
                            got = self._decoded(status, payload, k, link_of, count, ngroups,
                                                absent)
                    except Exception as e:
                        error = e
                    finally:
                        payload.release()  # (nothing refers to it: every value a copy)
                    unfit = unfit or got is NotImplemented
                    replies.append(got)
                else:
                    replies.append((status, payload))  # (decoded once all are back)
                states[k] = 2
                self._give(links[k], conn)
        except OSError:
            self._drop(links, conns, states, failing, True)
            return again
        except BaseException:
            self._drop(links, conns, states, failing, False)
            raise
        if late:  # (every connection with a request in flight closed, then the error)
            self._drop(links, conns, states, failing, False)
            raise self._late(h, links, failing, link_of, mids, ngroups)
        if error is not None:
            raise error
        if unfit:  # (the Python path's: it decodes every reply again)
            return again
        # the values: each reply's, by group
        values = [None] * ngroups
        for k in range(nlinks):
            got = replies[k]
            if type(got) is tuple:
                got = self._decoded((<tuple>got)[0], (<tuple>got)[1], k, link_of, count,
                                    ngroups, absent)
            if got is NotImplemented:
                return again
            at = 0
            for g in range(ngroups):
                if link_of[g] == k:
                    values[g] = (<list>got)[at]
                    at += 1
        out, marked = [None] * n, []
        cursor = [0] * ngroups
        for i in range(n):  # (a group's values are in its keys' order)
            g = slot[i]
            at = cursor[g]
            v = (<list>values[g])[at]
            cursor[g] = at + 1
            out[i] = v
            if v is absent:
                marked.append(i)
        return out, marked

    cdef object _late(self, h, list links, Py_ssize_t k, int* link_of, list mids,
                      Py_ssize_t ngroups):
        """The error of link ``k``, whose deadline passed, as the Python path raises it: no
        answer from its first manager within the operation's time and slack (its caller
        drops every connection with a request in flight first)."""
        cdef Py_ssize_t g
        for g in range(ngroups):
            if link_of[g] == k:
                return self.timed_out(h, None, self.op_get_many, links[k], mids[g], None)
        return AssertionError("a link without a group")

    cdef object _decoded(self, int status, payload, Py_ssize_t k, int* link_of,
                         Py_ssize_t* count, Py_ssize_t ngroups, absent):
        """Link ``k``'s reply decoded where it was received (``unpack_values``): a list of
        each of its groups' values, or ``NotImplemented``: the Python path's (a status, a
        reply that does not add up, a key a reader must wait for)."""
        cdef Py_ssize_t g
        if status != 0:  # (a moved or leased manager, ...: the Python path's to follow)
            return NotImplemented
        counts = [count[g] for g in range(ngroups) if link_of[g] == k]
        try:
            got = unpack_values(payload, counts, self.small, absent, self.decode)
        except ValueError:  # (a reply that does not add up: the Python path says so)
            return NotImplemented
        return NotImplemented if got is None else got

    cdef int _drop(self, list links, list conns, list states, Py_ssize_t failing,
                   bint broken) except -1:
        """After a failed exchange: the failing link's connection broken (closed as the link
        closes one) or forgotten, each other one with a request in flight forgotten (its
        reply would be read as the next request's), each untouched one given back."""
        cdef Py_ssize_t k
        for k in range(len(conns)):
            if states[k] == 2:
                continue
            if k == failing:
                if broken:
                    links[k]._broken(conns[k])
                else:
                    links[k].forget(conns[k])
            elif states[k] == 1:
                links[k].forget(conns[k])
            else:
                self._give(links[k], conns[k])
        return 0
