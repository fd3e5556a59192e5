# A same-host client's single read of a small value (``pure.SharedState.read_here``), and
# its single small put (``put_here``): the state of a process's view of a shard and of a
# manager's same-host channel in C fields (bases of ``transport.mapped._View`` and
# ``transport.shared.SharedChannel``), and each in one call.  Included by _compiled.pyx,
# after commit_behind.pxi (whose marks and commit it uses) and before key_lane.pxi (which
# calls them).
#
# A put counts itself inside the view, as the Python path does: its commit releases the
# interpreter lock.  Why a read needs no count of the operations inside the view
# (``_View.active``) and no ``_ENVS_LOCK``:
# the interpreter lock is held from the look at the view's ``evicted`` and ``closed`` to
# the end of the snapshot, and no Python code runs in between (nothing is allocated
# there: the frame is copied to the stack and decoded after the snapshot ended).  A view
# closes by Python code that marks it ``evicted`` before it reads ``active`` (under the
# lock) and closes its environment after: a close then either comes after the whole read
# or is seen by it.  py-lmdb marks an environment it closes not ``valid``, holding the
# interpreter lock, before it waits for anything but another thread's resize (whose
# ``resizing`` mark declines too), and that is checked as well.  The snapshot is
# py-lmdb's spare read transaction (a shard's environment keeps one: ``ShardStore``),
# renewed and reset again, as py-lmdb's own ``Environment.begin`` takes it; else one
# begun, and kept as the spare or ended.

DEF DDICT_HERE_FRAME = 4096  # (the largest frame read here, SMALL_FRAME: copied to the stack)

from .._serialize import SMALL_FRAME as _SMALL_FRAME_PY
from .pure import DIRECT_PUT_MAX

cdef Py_ssize_t _DIRECT_PUT_MAX = DIRECT_PUT_MAX

if _SMALL_FRAME_PY != DDICT_HERE_FRAME:  # (the stack's copy is sized by it)
    raise ImportError(f"kernels._compiled reads same-host frames under {DDICT_HERE_FRAME} "
                      f"bytes, not SMALL_FRAME = {_SMALL_FRAME_PY}")


@cython.auto_pickle(False)  # (a copy would drop its subclass's slots)
cdef class ViewState:
    """What the same-host read and put check of a process's view of a shard (``_View``'s
    base): its shard's store, whether it was closed for its channels (``evicted``) or
    closed, and when it was last used."""

    cdef public object store
    cdef public bint evicted, closed
    cdef public double used


@cython.auto_pickle(False)  # (a copy would drop its subclass's slots)
cdef class SharedState:
    """What the same-host read and put check of a manager's same-host channel
    (``SharedChannel``'s base; ``pure.SharedState`` says the rules)."""

    cdef public object _view, _seen, _orphans, _touched, _owner, _words
    cdef public double _alive_until
    cdef public long long _size, _mid
    cdef public bint _wfk, _closed, _direct

    def read_here(self, digest, chkpt, bint contains, decode):
        """``pure.SharedState.read_here``."""
        cdef long long c
        if type(digest) is not bytes or not _signed_int(chkpt, &c):
            return NotImplemented
        return self._here(<bytes>digest, c, contains, decode)

    def put_here(self, digest, kb, framed, chkpt):
        """``pure.SharedState.put_here``."""
        cdef long long c
        if (type(digest) is not bytes or type(kb) is not bytes or type(framed) is not Framed
                or not _signed_int(chkpt, &c)):  # fmt: skip
            return NotImplemented
        return self._put_here(<bytes>digest, <bytes>kb, framed, c)

    def may_put(self):
        """``pure.SharedState.may_put``."""
        return self._may_put()

    cdef bint _may_put(self):
        return (self._direct and self._size == 1 and not self._closed and not self._orphans
                and isinstance(self._view, ViewState) and not (<ViewState>self._view).evicted)

    cdef object _put_here(self, bytes digest, bytes kb, object framed, long long chkpt):
        """A small put committed here, in one C call (``DirectCommit.commit``, the
        interpreter lock released while it waits for LMDB's writer and commits): the
        view is counted inside as the Python path counts it (``_View.enter``, then the
        channel's ``_exit``), since other threads run meanwhile."""
        cdef ViewState view
        cdef StoreState store
        cdef object got
        if (not self._direct or self._size != 1 or self._closed or self._orphans
                or chkpt < 0 or PyBytes_GET_SIZE(digest) != _DIGEST
                or not isinstance(self._view, ViewState)):  # fmt: skip
            return NotImplemented
        view = <ViewState>self._view
        if view.evicted or not isinstance(view.store, StoreState):
            return NotImplemented
        store = <StoreState>view.store
        if store.indexed or (<tuple>framed)[1] > _DIRECT_PUT_MAX or self._words is None:
            return NotImplemented
        if not view.enter():
            return NotImplemented
        try:
            if _monotonic() >= self._alive_until:  # (after the wait to enter, as put_batch)
                return NotImplemented
            got = DirectCommit().commit(
                store.env, store._data, store._meta, [(digest, kb, framed)], chkpt,
                self._owner, store.full_thresh * store.capacity, store._psize,
                self._words.words, self._mid)
        finally:
            self._exit(view)  # (the last one out of a view closed meanwhile closes it)
        return None if got == _COMMITTED else NotImplemented

    cdef object _here(self, bytes digest, long long chkpt, bint contains, object decode):
        cdef ViewState view
        cdef StoreState store
        cdef ddict_lmdb_env* e
        cdef const ddict_mdb_api* api
        cdef ddict_mdb_txn* txn
        cdef unsigned char frame[DDICT_HERE_FRAME]
        cdef Py_ssize_t n = 0
        cdef int64_t newest = 0
        cdef long long seen_tid, seen_newest
        cdef bint frozen = False, fresh
        cdef size_t tid
        cdef double now
        cdef int got
        if _engines_state != 1:  # (once per process: before anything is looked at)
            try:
                _engines()
            except LmdbEngineError:
                return NotImplemented
        if (not isinstance(self._view, ViewState) or self._closed or self._wfk or self._orphans
                or chkpt < 0 or PyBytes_GET_SIZE(digest) != _DIGEST):  # fmt: skip
            return NotImplemented
        view = <ViewState>self._view
        if view.evicted or view.closed or not isinstance(view.store, StoreState):
            return NotImplemented
        now = _monotonic()
        if now >= self._alive_until:  # (the host's liveness is the Python path's to check)
            return NotImplemented
        seen = self._seen
        if type(seen) is not tuple or PyTuple_GET_SIZE(seen) != 3 or not (
                _signed_int((<tuple>seen)[0], &seen_tid)
                and _signed_int((<tuple>seen)[1], &seen_newest)):  # fmt: skip
            return NotImplemented
        store = <StoreState>view.store
        e = _open_env(store.env, store._data)
        if (e == NULL or e.resizing or e.pid != getpid()
                or not _lmdb_object(store._meta, _Database, e)):  # fmt: skip
            return NotImplemented
        api = e.libv
        # (from here to the snapshot's end: no Python object is made, no Python code runs)
        txn = e.spare_txn
        if txn != NULL:
            e.spare_txn = NULL
            if api.txn_renew(txn):
                api.txn_abort(txn)
                return NotImplemented
        elif api.txn_begin(e.env, NULL, DDICT_MDB_RDONLY, &txn):
            return NotImplemented
        tid = api.txn_id(txn)
        fresh = <long long>tid != seen_tid
        if fresh:  # (a commit since: the window and marks read again, as _check_state)
            got = _marks_here(api, txn, (<ddict_lmdb_db*><PyObject*>store._meta).dbi,
                              self._size, &newest, &frozen)
        else:
            newest, got = seen_newest, 0
        if got == 0 and chkpt < max(<int64_t>0, newest - self._size + 1):
            got = -1  # (retired: the Python path says so)
        if got == 0:
            got = _small_here(api, txn, (<ddict_lmdb_db*><PyObject*>store._data).dbi,
                              <const unsigned char*>PyBytes_AS_STRING(digest), <uint64_t>chkpt,
                              contains, frame, &n)
        if e.spare_txn == NULL and e.max_spare_txns:  # (kept as py-lmdb keeps its spare)
            api.txn_reset(txn)
            e.spare_txn = txn
        else:
            api.txn_abort(txn)
        if got < 0:
            return NotImplemented
        view.used = now
        if fresh:
            self._seen = (<object>tid, newest, frozen)
        if contains:
            return got == 1
        if got == 0:
            return NO_KEY
        self._touched(n)
        value = _small_at(frame, n)
        if value is NotImplemented:
            value = decode(PyBytes_FromStringAndSize(<char*>frame, n))
        return value


cdef int _marks_here(const ddict_mdb_api* api, ddict_mdb_txn* txn, unsigned int meta,
                     long long size, int64_t* newest, bint* frozen) noexcept nogil:
    """The shard's newest checkpoint and frozen mark as of ``txn`` (``saved_newest``,
    ``frozen``): 0, or -1 for a closed shard (or LMDB's error: the Python path's)."""
    cdef ddict_mdb_val v
    cdef int rc = 0
    if _mark(api, txn, meta, _NEWEST_MARK, &v, &rc):
        if v.mv_size != 9 or (<const unsigned char*>v.mv_data)[8] != 0:
            return -1  # (closed, moved or destroyed: the Python path says which)
        newest[0] = <int64_t>_le64(<const unsigned char*>v.mv_data)
    elif rc:
        return -1
    else:
        newest[0] = size - 1
    if _mark(api, txn, meta, _FROZEN_MARK, &v, &rc):
        frozen[0] = v.mv_size == 1 and (<const unsigned char*>v.mv_data)[0] == 1
    elif rc:
        return -1
    else:
        frozen[0] = False
    return 0


cdef int _small_here(const ddict_mdb_api* api, ddict_mdb_txn* txn, unsigned int dbi,
                     const unsigned char* digest, uint64_t chkpt, bint contains,
                     unsigned char* out, Py_ssize_t* n) noexcept nogil:
    """The newest version of ``digest`` at ``chkpt``: 1, live (its frame copied to ``out``
    unless ``contains``, ``n[0]`` its length), 0, absent or deleted, -1: the Python path's
    (a frame of ``DDICT_HERE_FRAME`` bytes or more, an entry no shard writes, LMDB's
    error)."""
    cdef ddict_mdb_cursor* cur = NULL
    cdef ddict_mdb_val k, v
    cdef unsigned char seek[24]
    cdef const unsigned char* raw
    cdef uint64_t flen
    cdef Py_ssize_t have
    cdef int rc, got
    _seek_key(seek, digest, chkpt)
    if api.cursor_open(txn, dbi, &cur):
        return -1
    k.mv_size, k.mv_data = _DIGEST + 8, seek
    rc = api.cursor_get(cur, &k, &v, DDICT_MDB_SET_RANGE)
    if rc == DDICT_MDB_NOTFOUND:
        got = 0
    elif rc or k.mv_size < <size_t>_DIGEST + 8:
        got = -1
    elif not _digest_at(&k, seek, _DIGEST):
        got = 0
    elif v.mv_size < <size_t>_ENTRY_HEADER:
        got = -1
    else:
        raw = <const unsigned char*>v.mv_data
        if raw[0] & _TOMBSTONE:
            got = 0
        else:
            flen = _le64(raw + 8)
            have = <Py_ssize_t>v.mv_size - _ENTRY_HEADER
            n[0] = have if flen > <uint64_t>have else <Py_ssize_t>flen
            if contains:
                got = 1
            elif n[0] >= DDICT_HERE_FRAME:
                got = -1
            else:
                memcpy(out, raw + _ENTRY_HEADER, n[0])
                got = 1
    api.cursor_close(cur)
    return got
