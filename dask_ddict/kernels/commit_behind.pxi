# A same-host client's batch committed behind it: each flush of a batch's records into a
# shard mapped here is one write transaction, run by a C thread of this process that
# never takes the interpreter lock, while the client's thread routes and frames the next
# flush (the overlap a batch over TCP gets from its host process).  Included by
# _compiled.pyx, after plain_server.pxi (whose checks of py-lmdb's objects it uses); it
# writes with shard_writes.pxi's functions, as the host's plain server does.
#
# A commit runs the rules of shard.direct.puts_in_window, read from the shard's marks in
# its own write transaction (the host process that serves the shard, the window, frozen,
# operations waiting at the manager, the room below the high-water mark, the key
# counts), for a window of one checkpoint; it writes all of its records or none.  Any
# other outcome (a rule not met, LMDB's refusal, a full map) leaves nothing written,
# and the caller puts the same records as it did before this existed (its own
# transaction, then the manager), in the same order: whatever is left, and why, is the
# Python path's to find and say.
#
# A thread that could take the interpreter lock would wait for it behind the client's
# thread, which holds it while it runs Python: up to the switch interval (5 ms) a time,
# far more than a commit.  Here the records are read as C pointers into the bytes
# objects the commit keeps alive (taken with the lock, when it is queued), and the
# shard's environment is kept open by the caller (a view's count of operations inside)
# until the commit is done.  After it commits, the thread writes the manager's new
# generation word itself (shard.generations: before any wait for the commit returns,
# and whether or not one ever does), into the client's mapping of the words, which a
# client never closes (the commit keeps the array, and a buffer of it, until it is done).
#
# The same commit can be made by the calling thread (DirectCommit.commit, the lock
# released while it runs): a same-host client's single put, one C call where
# puts_in_window makes a dozen Python ones.
#
# Nothing that waits for a commit may hold a write transaction of the process (the
# thread may be waiting for LMDB's writer lock): a commit is waited for only by its
# caller's next step (the shard's next flush, the batch's end), never by a finalizer, and
# one dropped before it is done is kept, with what it reads, until it is (or for ever,
# at the interpreter's exit).

from cpython.ref cimport Py_INCREF
from posix.unistd cimport getpid

cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    int pthread_mutex_init(pthread_mutex_t* m, const void* attr)
    int pthread_mutex_lock(pthread_mutex_t* m)
    int pthread_mutex_unlock(pthread_mutex_t* m)
    int pthread_cond_init(pthread_cond_t* c, const void* attr)
    int pthread_cond_wait(pthread_cond_t* c, pthread_mutex_t* m)
    int pthread_cond_broadcast(pthread_cond_t* c)
    int pthread_cond_signal(pthread_cond_t* c)
    int pthread_create(pthread_t* t, const void* attr, void* (*start)(void*) noexcept nogil,
                       void* arg)
    int pthread_detach(pthread_t t)

cdef extern from "<signal.h>" nogil:
    ctypedef struct sigset_t:
        pass
    int sigfillset(sigset_t* s)
    int pthread_sigmask(int how, const sigset_t* s, sigset_t* old)
    int sigdelset(sigset_t* s, int sig)
    int SIG_BLOCK
    int SIG_SETMASK
    int SIGBUS, SIGSEGV, SIGFPE, SIGILL

from .pure import FROZEN, NEWEST, OWNER, WAITERS

ctypedef struct _Name:  # (a mark's name, copied: the thread may outlive the module)
    char p[16]
    size_t n

cdef _Name _NEWEST_MARK, _FROZEN_MARK, _WAITERS_MARK, _OWNER_MARK


cdef void _name(_Name* to, bytes name) except *:
    assert len(name) <= 16
    memcpy(to.p, PyBytes_AS_STRING(name), len(name))
    to.n = len(name)


_name(&_NEWEST_MARK, NEWEST)
_name(&_FROZEN_MARK, FROZEN)
_name(&_WAITERS_MARK, WAITERS)
_name(&_OWNER_MARK, OWNER)

# What a commit came to (:meth:`DirectCommit.wait`, as pure.COMMITTED... say it).
cdef enum:
    _COMMITTED = 0
    _LEFT = 1
    _FORKED = 2

from .pure import COMMITTED, FORKED, LEFT

assert (COMMITTED, LEFT, FORKED) == (_COMMITTED, _LEFT, _FORKED)  # (one meaning each)

ctypedef struct _Rec:  # (one record: its digest, its key, its value's parts)
    const unsigned char* digest
    const char* key
    Py_ssize_t klen, vlen, first, nparts

ctypedef struct _Job:
    _Job* next
    int state  # 0: not queued; 1: queued or running; 2: done
    int outcome
    int pid  # (the process that queued it)
    void* env
    const ddict_mdb_api* api
    unsigned int data, meta
    int64_t chkpt
    const char* owner
    Py_ssize_t owner_len
    double limit  # (the shard's full threshold, in bytes)
    size_t psize
    Py_ssize_t n, total  # (records, and their values' and keys' bytes)
    _Rec* recs
    _Part* parts
    int64_t* word  # (the manager's generation word, new after a commit; NULL: none)

cdef pthread_mutex_t _behind_lock
cdef pthread_cond_t _behind_ready, _behind_done
cdef _Job* _behind_head = NULL
cdef _Job* _behind_tail = NULL
cdef bint _behind_started = False
cdef Py_ssize_t _behind_counts[2]  # (committed, left)
cdef uint64_t _behind_words = 0  # (the thread's generator of words: Generations.bump's)


cdef void _behind_reset(uint64_t seed) noexcept:
    """The thread's state as at import (in a forked child, whose copy of the lock may be
    held, and which has no such thread)."""
    global _behind_head, _behind_tail, _behind_started, _behind_words
    pthread_mutex_init(&_behind_lock, NULL)
    pthread_cond_init(&_behind_ready, NULL)
    pthread_cond_init(&_behind_done, NULL)
    _behind_head = _behind_tail = NULL
    _behind_started = False
    _behind_counts[0] = _behind_counts[1] = 0
    _behind_words = seed


def commits_behind_forked():
    """(A forked child's hook.)  No commit thread here: the parent's queued commits are
    the parent's, the next one starts a thread of this process (and draws other words)."""
    _behind_reset(int.from_bytes(os.urandom(8), "little"))


commits_behind_forked()


def commits_behind():
    """How many commits this process's thread committed, and left to their callers."""
    return _behind_counts[0], _behind_counts[1]


cdef bint _mark(const ddict_mdb_api* api, ddict_mdb_txn* w, unsigned int meta, _Name name,
                ddict_mdb_val* v, int* rc) noexcept nogil:
    """The shard's mark ``name`` in ``v`` (True), absent (False, ``rc`` 0), or LMDB's
    error (False, ``rc``)."""
    cdef ddict_mdb_val k
    k.mv_size, k.mv_data = name.n, <void*>name.p
    rc[0] = api.get(w, meta, &k, v)
    if rc[0] == DDICT_MDB_NOTFOUND:
        rc[0] = 0
        return False
    return rc[0] == 0


cdef bint _commit_rules(_Job* j, ddict_mdb_txn* w) noexcept nogil:
    """Whether ``j`` may be committed in ``w`` as ``puts_in_window`` allows it, its
    records written there (else the transaction is only to abort)."""
    cdef const ddict_mdb_api* api = j.api
    cdef ddict_mdb_val v
    cdef ddict_mdb_envinfo info
    cdef int rc = 0
    cdef int64_t newest = 0, delta = 0
    cdef Py_ssize_t i, d
    cdef _Rec* r
    if _mark(api, w, j.meta, _OWNER_MARK, &v, &rc):  # (moved to another host process)
        if <Py_ssize_t>v.mv_size != j.owner_len or memcmp(v.mv_data, j.owner, j.owner_len):
            return False
    if rc:
        return False
    if _mark(api, w, j.meta, _NEWEST_MARK, &v, &rc):  # the window, and the closed mark
        if v.mv_size != 9 or (<const unsigned char*>v.mv_data)[8] != 0:
            return False
        newest = <int64_t>_le64(<const unsigned char*>v.mv_data)
    elif rc:
        return False
    if j.chkpt != newest:  # (a window of one: any other checkpoint is the caller's)
        return False
    if _mark(api, w, j.meta, _FROZEN_MARK, &v, &rc):
        if v.mv_size == 1 and (<const unsigned char*>v.mv_data)[0] == 1:
            return False
    if rc:
        return False
    if _mark(api, w, j.meta, _WAITERS_MARK, &v, &rc):  # (only the manager wakes them)
        if v.mv_size != 8 or _le64(<const unsigned char*>v.mv_data) != 0:
            return False
    if rc:
        return False
    if api.env_info(j.env, &info):  # the room: ShardStore.below_high_water's
        return False
    if (<double>(info.me_last_pgno + 4) * j.psize
            + 2.0 * (j.total + j.n * (_ENTRY_HEADER + 64)) > j.limit):  # fmt: skip
        return False
    for i in range(j.n):
        r = &j.recs[i]
        d = _put_parts(api, w, j.data, r.digest, r.key, r.klen, j.parts + r.first, r.nparts,
                       r.vlen, j.chkpt)
        if d < 0:
            return False
        delta += d
    return delta == 0 or _count_by(api, w, j.meta, newest, delta)


cdef int _commit_job(_Job* j, int64_t word) noexcept nogil:
    """``j`` committed in a write transaction of its own (``COMMITTED``), or nothing of
    it written (``LEFT``); its manager's new generation word is ``word``, or one of the
    commit thread's own (0: only that thread draws them)."""
    cdef ddict_mdb_txn* w = NULL
    if j.api.txn_begin(j.env, NULL, 0, &w):  # (waits for LMDB's writer lock)
        return _LEFT
    if not _commit_rules(j, w):
        j.api.txn_abort(w)
        return _LEFT
    if j.api.txn_commit(w):  # (a failed commit frees the transaction too)
        return _LEFT
    if j.word != NULL:  # (before the commit is said done: shard.generations)
        j.word[0] = word if word else _word_of(&_behind_words)  # (the thread's own state)
    return _COMMITTED


cdef void* _commit_thread(void* arg) noexcept nogil:
    """The process's commit thread: each queued commit in turn, for ever (it holds no
    Python object, and the process's exit does not wait for it)."""
    cdef _Job* j
    cdef int outcome
    global _behind_head, _behind_tail
    pthread_mutex_lock(&_behind_lock)
    while True:
        while _behind_head == NULL:
            pthread_cond_wait(&_behind_ready, &_behind_lock)
        j = _behind_head
        _behind_head = j.next
        if _behind_head == NULL:
            _behind_tail = NULL
        pthread_mutex_unlock(&_behind_lock)
        outcome = _commit_job(j, 0)
        pthread_mutex_lock(&_behind_lock)
        j.outcome, j.state = outcome, 2
        _behind_counts[0 if outcome == _COMMITTED else 1] += 1
        pthread_cond_broadcast(&_behind_done)
    return NULL


cdef bint _queue(_Job* j) noexcept nogil:
    """``j`` queued for the commit thread (started here the first time): whether it was
    (no thread to be had: the caller commits it itself)."""
    cdef pthread_t t
    cdef sigset_t every, before
    cdef int rc
    global _behind_head, _behind_tail, _behind_started
    pthread_mutex_lock(&_behind_lock)
    if not _behind_started:
        # (born with every signal blocked, the interpreter's to take; but its own faults,
        # e.g. a full /dev/shm's SIGBUS, are the process's to die of, loudly)
        sigfillset(&every)
        sigdelset(&every, SIGBUS)
        sigdelset(&every, SIGSEGV)
        sigdelset(&every, SIGFPE)
        sigdelset(&every, SIGILL)
        pthread_sigmask(SIG_BLOCK, &every, &before)
        rc = pthread_create(&t, NULL, _commit_thread, NULL)
        pthread_sigmask(SIG_SETMASK, &before, NULL)
        if rc:
            pthread_mutex_unlock(&_behind_lock)
            return False
        pthread_detach(t)
        _behind_started = True
    j.next, j.state = NULL, 1
    if _behind_tail == NULL:
        _behind_head = j
    else:
        _behind_tail.next = j
    _behind_tail = j
    pthread_cond_signal(&_behind_ready)
    pthread_mutex_unlock(&_behind_lock)
    return True


cdef void _wait_for(_Job* j) noexcept nogil:
    pthread_mutex_lock(&_behind_lock)
    while j.state == 1:
        pthread_cond_wait(&_behind_done, &_behind_lock)
    pthread_mutex_unlock(&_behind_lock)


cdef bint _running(_Job* j) noexcept nogil:
    """Whether ``j`` is queued or being committed (read under the thread's lock)."""
    cdef bint running
    pthread_mutex_lock(&_behind_lock)
    running = j.state == 1
    pthread_mutex_unlock(&_behind_lock)
    return running


@cython.final
@cython.no_gc_clear  # (what it keeps is the commit thread's until it is done: see __dealloc__)
cdef class DirectCommit:
    """One flush of a same-host batch's records, committed into its shard by this
    process's commit thread (see the module's comment): :meth:`start` queues it,
    :meth:`done` says whether it is done, :meth:`wait` what it came to.  Its records,
    the shard's objects and the generation words are kept alive until then; the
    caller keeps the shard's environment open."""

    cdef _Job* job  # (its own allocation: kept, not freed, if dropped while it runs)
    cdef object keep
    cdef Py_buffer words
    cdef bint has_words

    def __cinit__(self):
        self.job = <_Job*>PyMem_Calloc(1, sizeof(_Job))
        if self.job == NULL:
            raise MemoryError()
        self.has_words = False

    def __dealloc__(self):
        cdef _Job* j = self.job
        if j == NULL:
            return
        if j.pid == getpid() and _running(j):  # (the thread still reads it: kept for ever)
            Py_INCREF(self.keep)
            return
        self._release()
        PyMem_Free(j.recs)
        PyMem_Free(j.parts)
        PyMem_Free(j)

    cdef void _release(self):
        if self.has_words:
            PyBuffer_Release(&self.words)
            self.has_words = False
        self.keep = None

    def start(self, env, data_db, meta_db, list records, int64_t chkpt, bytes owner,
              double limit, Py_ssize_t psize, words=None, Py_ssize_t mid=0):
        """Queue the commit of ``records`` (``(digest, key, frame)`` each, a frame's parts
        all ``bytes``) at ``chkpt`` into the shard of py-lmdb's ``env`` and its open
        ``data_db`` and ``meta_db``, for the host process ``owner`` (the shard's owner
        mark), below ``limit`` bytes used (pages of ``psize`` bytes); once committed, a
        new word in ``words[mid]`` (``words``: the generations' writable int64 array, or
        ``None``).  Whether it was queued (else nothing was: records or objects this
        cannot commit, or no thread)."""
        if not self._prepare(env, data_db, meta_db, records, chkpt, owner, limit, psize,
                             words, mid):  # fmt: skip (Cython's argument list)
            return False
        if not _queue(self.job):
            self._release()
            return False
        return True

    def commit(self, env, data_db, meta_db, list records, int64_t chkpt, bytes owner,
               double limit, Py_ssize_t psize, words=None, Py_ssize_t mid=0):
        """:meth:`start`'s commit, made by the calling thread now, with the interpreter
        lock released (a same-host client's single put: one C call where
        ``puts_in_window`` makes a dozen Python ones): ``COMMITTED``, or ``LEFT``
        (nothing written: the caller commits them itself, by the Python rules)."""
        cdef _Job* j = self.job
        cdef int outcome
        cdef int64_t word = _next_word()  # (GenerationBump's, drawn with the lock held)
        if not self._prepare(env, data_db, meta_db, records, chkpt, owner, limit, psize,
                             words, mid):  # fmt: skip (Cython's argument list)
            return _LEFT
        with nogil:
            outcome = _commit_job(j, word)
        j.outcome, j.state = outcome, 2
        self._release()
        return outcome

    cdef bint _prepare(self, env, data_db, meta_db, list records, int64_t chkpt,
                       bytes owner, double limit, Py_ssize_t psize, words,
                       Py_ssize_t mid) except -1:
        """The job of :meth:`start` and :meth:`commit` (``self.job``), what it reads kept
        alive: whether it could be made."""
        cdef ddict_lmdb_env* e
        cdef _Job* j = self.job
        cdef tuple recs = tuple(records)  # (its own: the caller's list may change)
        cdef Py_ssize_t n = len(recs), nparts = 0, i, at = 0, vlen
        cdef _Rec* r
        if self.keep is not None or j.recs != NULL:
            raise RuntimeError("a DirectCommit commits once")
        if n == 0:
            return False
        try:
            _engines()
        except LmdbEngineError:
            return False
        e = _open_env(env, data_db)
        if e == NULL or not _lmdb_object(meta_db, _Database, e):
            return False
        for rec in recs:  # (each record's parts: all bytes, adding up)
            if type(rec) is not tuple or PyTuple_GET_SIZE(rec) != 3:
                return False
            digest, kb, frame = rec
            if type(digest) is not bytes or PyBytes_GET_SIZE(digest) != _DIGEST:
                return False
            if type(kb) is not bytes or type(frame) is not Framed:
                return False
            parts = (<tuple>frame)[0]
            if type(parts) is not tuple:
                return False
            vlen = 0
            for part in <tuple>parts:
                if type(part) is not bytes:
                    return False
                vlen += PyBytes_GET_SIZE(part)
            if vlen != (<tuple>frame)[1] or vlen + PyBytes_GET_SIZE(kb) + _ENTRY_HEADER >= _HUGE:
                return False
            nparts += PyTuple_GET_SIZE(parts)
        if words is not None:
            PyObject_GetBuffer(words, &self.words, PyBUF_WRITABLE)
            self.has_words = True
            if self.words.itemsize != 8 or mid < 0 or (mid + 1) * 8 > self.words.len:
                self._release()
                return False
            j.word = <int64_t*>self.words.buf + mid
        j.recs = <_Rec*>PyMem_Malloc(n * sizeof(_Rec))
        j.parts = <_Part*>PyMem_Malloc(max(nparts, 1) * sizeof(_Part))
        if j.recs == NULL or j.parts == NULL:
            self._release()
            raise MemoryError()
        j.total = 0
        for i in range(n):
            digest, kb, frame = <tuple>recs[i]
            parts = (<tuple>frame)[0]
            r = &j.recs[i]
            r.digest = <const unsigned char*>PyBytes_AS_STRING(digest)
            r.key, r.klen = PyBytes_AS_STRING(kb), PyBytes_GET_SIZE(kb)
            r.first, r.nparts, r.vlen = at, PyTuple_GET_SIZE(parts), 0
            for part in <tuple>parts:
                j.parts[at].p = PyBytes_AS_STRING(part)
                j.parts[at].n = PyBytes_GET_SIZE(part)
                r.vlen += PyBytes_GET_SIZE(part)
                at += 1
            j.total += r.vlen + r.klen
        j.n, j.env, j.api = n, e.env, e.libv
        j.data = (<ddict_lmdb_db*><PyObject*>data_db).dbi
        j.meta = (<ddict_lmdb_db*><PyObject*>meta_db).dbi
        j.chkpt, j.limit, j.psize = chkpt, limit, <size_t>psize
        self.keep = (recs, env, data_db, meta_db, owner, words)
        j.owner, j.owner_len = PyBytes_AS_STRING(owner), PyBytes_GET_SIZE(owner)
        j.pid = getpid()
        return True

    def done(self):
        """Whether :meth:`wait` would return at once (never queued, done, or queued by
        the process this one was forked from)."""
        return self.job.pid != getpid() or not _running(self.job)

    def wait(self):
        """What the commit came to (``COMMITTED``, ``LEFT``: nothing written, or
        ``FORKED``: queued by the process this one was forked from), once it is done.
        Never from a finalizer, nor while this thread holds a write transaction (see the
        module's comment)."""
        cdef _Job* j = self.job
        if j.state == 0:
            return _LEFT
        if j.pid != getpid():
            return _FORKED
        with nogil:
            _wait_for(j)
        self._release()
        return j.outcome
