# A handle's single-key operations over a TCP link, each in one call (``pure.KeyLane``).
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
# of what is left of the operation's deadline (``_wait_fd``).

cdef double _NO_TIMEOUT = -1.0  # (encode_timeout(None): a request that never times out)
cdef double _LONG_WAIT = 3600.0  # (a slice of an endless wait on a non-blocking socket)


cdef inline bint _small_int(object v, long long most, long long* out):
    """Whether ``v`` is an ``int`` in ``[0, most]`` (put in ``out``): what the request
    header's field takes here (anything else, the Python path packs or refuses)."""
    cdef int overflow
    if type(v) is not int:
        return False
    out[0] = PyLong_AsLongLongAndOverflow(v, &overflow)
    return overflow == 0 and 0 <= out[0] <= most


cdef int _move_all(sock, char* p, Py_ssize_t n, bint sending, bint blocking,
                   double deadline) except -1:
    """``p[:n]`` sent on ``sock`` (``sending``), or ``n`` bytes received into ``p`` (a large
    reply's payload): a blocking descriptor's ``send``/``recv``, else without waiting and
    a wait for room or data cut at ``deadline``.  1 moved, 0 the deadline passed first."""
    cdef Py_ssize_t done = 0
    cdef ssize_t k
    cdef int fd, err = 0, flags = 0 if blocking else MSG_DONTWAIT
    while done < n:
        fd = sock.fileno()  # (each time: another thread may have closed it meanwhile)
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
    cdef int op_get, op_contains, op_put, persist, missing, timeout_status
    cdef Py_ssize_t most, small

    def __init__(self, wire, channel, pool, timing, buffer, decode, timed_out, deadline):
        self.wire = wire
        self.op_get, self.op_contains, self.op_put = wire.get, wire.contains, wire.put
        self.persist, self.missing = wire.persist, wire.missing_status
        self.timeout_status = wire.timeout_status
        self.most, self.small = wire.most, wire.small
        self.channel, self.pool, self.timing = channel, pool, timing
        self.buffer, self.decode = buffer, decode
        self.timed_out, self.deadline = timed_out, deadline
        self._acquire, self._release = pool.lock.acquire, pool.lock.release
        self._idle = pool.idle  # (the pool's own table of idle connections: never replaced)

    def __repr__(self):
        return f"<KeyLane most={self.most}>"

    def get(self, h, key):
        cdef object got = self._read(h, key, self.op_get)
        if type(got) is not tuple:
            return got
        if (<tuple>got)[0] == 0:
            value = _small((<tuple>got)[2])
            return self.decode((<tuple>got)[2]) if value is NotImplemented else value
        return NO_KEY

    def contains(self, h, key):
        cdef object got = self._read(h, key, self.op_contains)
        return bool((<tuple>got)[1]) if type(got) is tuple else got

    cdef object _read(self, h, key, int op):
        """``_exchange`` of a read of ``key``."""
        cdef tuple route
        cdef object routed = self._routed(h)
        if routed is None:
            return NotImplemented
        try:
            route = (<Router>routed).one(key)
        except KeyTooLong:  # (the Python path says why)
            return NotImplemented
        return self._exchange(h, key, route[0], op, 0, route[1], None, 0, 0)

    def put(self, h, key, value, bint persistent):
        cdef tuple rec
        cdef object routed = self._routed(h)
        if routed is None or h._batch is not None:
            return NotImplemented
        if type(value) is bytes and PyBytes_GET_SIZE(value) > self.most:  # (not framed twice)
            return NotImplemented
        try:
            rec = (<Router>routed).record(key, value, h._routed[1])
        except KeyTooLong:
            return NotImplemented
        framed, kb = rec[3], rec[2]
        room = h._core._room  # (None: not known yet; a value too large: the Python path's)
        if room is None or type(framed) is not Framed or framed.nbytes + len(kb) > room:
            return NotImplemented
        got = self._exchange(h, key, rec[0], self.op_put, self.persist if persistent else 0,
                             rec[1] + kb, framed.parts, framed.nbytes, h._client_id)
        return None if type(got) is tuple else got

    cdef object _routed(self, h):
        """The handle's router, if it is one the lane serves now (else ``None``)."""
        core = h._core
        if not core.tcp or core.closed or h._detached or h._vp is not None:
            return None
        routed = h._routed
        if type(routed) is not tuple or type((<tuple>routed)[0]) is not Router:
            return None
        return (<tuple>routed)[0]

    cdef object _take(self, link):
        """One of ``link``'s idle connections, as ``IdlePool.take`` takes it (``None``:
        none idle, or the pool's lock busy)."""
        if not self._acquire(False):
            return None
        try:
            idle = link.idle
            if not idle:
                return None
            conn = idle.pop()
            del self._idle[conn]
        finally:
            self._release()
        return conn

    cdef int _give(self, link, conn) except -1:
        """``conn`` back to the pool, as ``IdlePool.give`` gives it (which does it, past
        the pool's bound or a closed link, or with its lock busy)."""
        conn.check = None
        if self._acquire(False):
            try:
                if not link.closed and len(self._idle) < self.pool.most:
                    link.idle.append(conn)
                    self._idle[conn] = link
                    return 0
            finally:
                self._release()
        self.pool.give(link, conn)
        return 0

    cdef object _exchange(self, h, key, object mid, int op, int flags, bytes keysec,
                          object parts, object vlen_, object client):
        """``(status, ival, payload)``, ``NotImplemented`` or a ``Resend`` (``pure.KeyLane``)."""
        cdef long long m, term, chkpt, cid, vlen
        cdef Py_ssize_t klen = PyBytes_GET_SIZE(keysec), total, at, have
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
        conn = self._take(link)
        if conn is None:
            return NotImplemented
        reader = conn.reader
        buf = reader._buf
        if reader._pos != reader._end or PyByteArray_GET_SIZE(buf) < total:
            self._give(link, conn)
            return NotImplemented
        # (a socket without a timeout blocks; one a timed operation left with its own
        # does not, and is waited for by poll, as is every timed operation's)
        blocking = conn.timeout is None and deadline < 0
        conn.deadline = None  # (BoundedConnection.begin(None, None): its own state)
        conn.check = None
        p = <unsigned char*>PyByteArray_AS_STRING(buf)
        head.op, head.flags, head.term = op, flags, <unsigned int>term
        head.klen, head.manager, head.tag = <uint32_t>klen, <uint32_t>m, 0
        head.chkpt, head.arg, head.client = chkpt, 0, <uint64_t>cid
        head.timeout, head.vlen, head.rid = wire_timeout, <uint64_t>vlen, 0
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
        again = NotImplemented if deadline < 0 else Resend(began)  # (once sent)
        try:
            sock = conn.sock
            late = not _move_all(sock, <char*>p, total, True, blocking, deadline)
            got = 0
            while not late:
                wait = None if blocking else (
                    _LONG_WAIT if deadline < 0 else max(deadline - _monotonic(), 0.0))
                status, ival, plen, payload, got = _receive_reply(sock, buf, got, wait,
                                                                  self.small)
                if status != _QUIET:
                    break
                late = deadline >= 0 and _monotonic() >= deadline
            if not late and payload is None:  # (a large value: into a buffer of its own)
                payload = self.buffer(plen)
                PyObject_GetBuffer(payload, &view, PyBUF_WRITABLE)
                try:
                    have = min(<Py_ssize_t>got - _REPLY, view.len)
                    memcpy(view.buf, p + _REPLY, have)
                    late = not _move_all(sock, <char*>view.buf + have, view.len - have,
                                         False, blocking, deadline)
                finally:
                    PyBuffer_Release(&view)
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
        if status == 0 or (status == self.missing and op == self.op_get):
            return status, ival, payload
        if status == self.timeout_status and deadline >= 0:
            raise self.timed_out(h, key, op, link, mid, bytes(payload))
        return again
