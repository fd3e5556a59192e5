# LMDB through its C API: the engine the installed lmdb (py-lmdb) package carries.
#
# Included by _compiled.pyx.  py-lmdb 3.0 builds LMDB into its extension and exports
# each engine's entry points as a table (``lmdb_api_v09``: LMDB 0.9, data format 1;
# ``lmdb_api_v10``: LMDB 1.0, format 3), and picks the engine of each environment when
# it opens it.  The kernels here call that very table on the environment py-lmdb opened,
# through the transaction and database objects the caller already holds: one LMDB build
# and one environment handle per shard in the process (LMDB forbids two handles on one
# environment in one process), the same files read and written by the same code whether
# a process runs the compiled kernels or the pure ones.
#
# Rejected: a copy of LMDB's source in this repository, or one fetched at build time
# (a second build of LMDB in the process, which must never open a shard py-lmdb has
# open), and the system's liblmdb (absent on a fresh machine, its version unrelated to
# the one that wrote the shard).
#
# What is read of py-lmdb's objects is their C layout in py-lmdb 3.0 (lmdb/cpython.c);
# the engine is checked once per process (its table against its own version function,
# the installed package's version against the layouts known here), and every object
# handed in is checked against its type and its engine before a pointer is taken from
# it.  Anything else (another py-lmdb, its CFFI flavour, a closed object) is refused
# with LmdbEngineError, and the caller runs the pure kernel instead.
#
# The GIL is held throughout: a transaction or an environment is closed by Python
# code, which therefore cannot run while a walk is inside LMDB.  (The one exception is
# commit_behind.pxi's thread, whose caller keeps the environment open until it is done.)

from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Malloc
from cpython.ref cimport PyObject
from posix.unistd cimport getpid

import logging

from .._serialize import loads_value as _loads_value
from .pure import (
    PRELOADED,
    TOUCH_STRIDE,
    lookup_entry as _pure_lookup_entry,
    lookup_frames as _pure_lookup_frames,
    lookup_values as _pure_lookup_values,
    place_values as _pure_place_values,
    put_entries as _pure_put_entries,
)

cdef Py_ssize_t _PRELOADED = PRELOADED  # (compared with C sizes: no int object per key)
_logger = logging.getLogger("dask_ddict.kernels")

cdef extern from "<dlfcn.h>" nogil:
    void* dlopen(const char* filename, int flags)
    void* dlsym(void* handle, const char* symbol)
    int RTLD_NOW
    int RTLD_NOLOAD

cdef extern from *:
    """
    /* The ABI of py-lmdb 3.0's per-engine table (lmdb/mdb_api.h): four ints, then
       entry points in this order.  Only the types this module calls are spelled out;
       the others keep their slots. */
    typedef struct { size_t mv_size; void *mv_data; } ddict_mdb_val;
    typedef struct {  /* LMDB's MDB_envinfo, the same in both engines */
        void *me_mapaddr;
        size_t me_mapsize, me_last_pgno, me_last_txnid;
        unsigned int me_maxreaders, me_numreaders;
    } ddict_mdb_envinfo;
    typedef struct ddict_mdb_txn_s ddict_mdb_txn;        /* opaque: LMDB's MDB_txn */
    typedef struct ddict_mdb_cursor_s ddict_mdb_cursor;  /* opaque: LMDB's MDB_cursor */
    typedef struct {
        int major, minor, patch;
        unsigned int data_version;
        void *env_fns[9];    /* env_create .. env_stat */
        int (*env_info)(void *env, ddict_mdb_envinfo *info);
        void *env_fns_after[10];  /* env_get_flags .. reader_list */
        int (*txn_begin)(void *env, ddict_mdb_txn *parent, unsigned int flags,
                         ddict_mdb_txn **txn);
        int (*txn_commit)(ddict_mdb_txn *txn);
        void (*txn_abort)(ddict_mdb_txn *txn);
        void (*txn_reset)(ddict_mdb_txn *txn);
        int (*txn_renew)(ddict_mdb_txn *txn);
        size_t (*txn_id)(ddict_mdb_txn *txn);
        void *dbi_open, *dbi_flags, *dbi_close, *drop;
        int (*get)(ddict_mdb_txn *txn, unsigned int dbi, ddict_mdb_val *key,
                   ddict_mdb_val *data);
        int (*put)(ddict_mdb_txn *txn, unsigned int dbi, ddict_mdb_val *key,
                   ddict_mdb_val *data, unsigned int flags);
        void *del_fn, *stat;
        int (*cursor_open)(ddict_mdb_txn *txn, unsigned int dbi, ddict_mdb_cursor **cursor);
        void (*cursor_close)(ddict_mdb_cursor *cursor);
        int (*cursor_get)(ddict_mdb_cursor *cursor, ddict_mdb_val *key, ddict_mdb_val *data,
                          int op);
        int (*cursor_put)(ddict_mdb_cursor *cursor, ddict_mdb_val *key, ddict_mdb_val *data,
                          unsigned int flags);
        int (*cursor_del)(ddict_mdb_cursor *cursor, unsigned int flags);
        void *cursor_count;
        char *(*strerror_fn)(int err);
        char *(*version_fn)(int *major, int *minor, int *patch);
    } ddict_mdb_api;
    /* py-lmdb 3.0's objects (lmdb/cpython.c), as far as they are read here. */
    typedef struct {
        PyObject_HEAD
        void *siblings[2], *children[2];
        int valid;
        PyObject *weaklist;
        void *env;
        const ddict_mdb_api *libv;
        void *main_db;
        int readonly;
        ddict_mdb_txn *spare_txn;
        int max_spare_txns;
        int pid;  /* (pid_t: the process that opened it) */
        unsigned long write_txn_tid;
        PyObject *open_keys;
        int active_ops, ops_waiters, write_begins, resizing;
        unsigned long resize_tid;
    } ddict_lmdb_env;
    typedef struct {
        PyObject_HEAD
        void *siblings[2], *children[2];
        int valid;
        PyObject *weaklist;
        ddict_lmdb_env *env;
        PyObject *parent;
        const ddict_mdb_api *libv;
        ddict_mdb_txn *txn;
        int flags;
        PyObject *db;
        int mutations;  /* py-lmdb's cursors read their item again when it moved */
    } ddict_lmdb_txn;
    typedef struct {
        PyObject_HEAD
        void *siblings[2], *children[2];
        int valid;
        ddict_lmdb_env *env;
        unsigned int dbi;
    } ddict_lmdb_db;
    #define DDICT_MDB_GET_CURRENT 4
    #define DDICT_MDB_NEXT 8
    #define DDICT_MDB_SET_KEY 16
    #define DDICT_MDB_SET_RANGE 17
    #define DDICT_MDB_RESERVE 0x10000
    #define DDICT_MDB_CURRENT 0x40
    #define DDICT_MDB_NOTFOUND (-30798)
    #define DDICT_MDB_MAP_FULL (-30792)
    #define DDICT_TRANS_BUFFERS 1
    #define DDICT_MDB_RDONLY 0x20000
    """
    ctypedef struct ddict_mdb_val:
        size_t mv_size
        void* mv_data
    ctypedef struct ddict_mdb_envinfo:
        size_t me_last_pgno
    ctypedef struct ddict_mdb_txn:
        pass
    ctypedef struct ddict_mdb_cursor:
        pass
    ctypedef struct ddict_mdb_api:
        int major, minor, patch
        unsigned int data_version
        int (*env_info)(void* env, ddict_mdb_envinfo* info) nogil
        int (*txn_begin)(void* env, ddict_mdb_txn* parent, unsigned int flags,
                         ddict_mdb_txn** txn) nogil
        int (*txn_commit)(ddict_mdb_txn* txn) nogil
        void (*txn_abort)(ddict_mdb_txn* txn) nogil
        void (*txn_reset)(ddict_mdb_txn* txn) nogil
        int (*txn_renew)(ddict_mdb_txn* txn) nogil
        size_t (*txn_id)(ddict_mdb_txn* txn) nogil
        int (*get)(ddict_mdb_txn* txn, unsigned int dbi, ddict_mdb_val* key,
                   ddict_mdb_val* data) nogil
        int (*put)(ddict_mdb_txn* txn, unsigned int dbi, ddict_mdb_val* key,
                   ddict_mdb_val* data, unsigned int flags) nogil
        int (*cursor_open)(ddict_mdb_txn* txn, unsigned int dbi,
                           ddict_mdb_cursor** cursor) nogil
        void (*cursor_close)(ddict_mdb_cursor* cursor) nogil
        int (*cursor_get)(ddict_mdb_cursor* cursor, ddict_mdb_val* key, ddict_mdb_val* data,
                          int op) nogil
        int (*cursor_put)(ddict_mdb_cursor* cursor, ddict_mdb_val* key, ddict_mdb_val* data,
                          unsigned int flags) nogil
        int (*cursor_del)(ddict_mdb_cursor* cursor, unsigned int flags) nogil
        char* (*strerror_fn)(int err)
        char* (*version_fn)(int* major, int* minor, int* patch)
    ctypedef struct ddict_lmdb_env:
        void* siblings[2]  # (prev, next: every py-lmdb object's place in its parent's list)
        void* children[2]  # (its own list of dependants: [1] is the head)
        int valid
        void* env
        const ddict_mdb_api* libv
        ddict_mdb_txn* spare_txn
        int max_spare_txns
        int pid
        unsigned long write_txn_tid
        int active_ops, ops_waiters, write_begins, resizing
    ctypedef struct ddict_lmdb_txn:
        int valid
        ddict_lmdb_env* env
        const ddict_mdb_api* libv
        ddict_mdb_txn* txn
        int flags
        int mutations
    ctypedef struct ddict_lmdb_db:
        int valid
        ddict_lmdb_env* env
        unsigned int dbi
    int DDICT_MDB_GET_CURRENT
    int DDICT_MDB_NEXT
    int DDICT_MDB_SET_KEY
    int DDICT_MDB_SET_RANGE
    unsigned int DDICT_MDB_RESERVE
    unsigned int DDICT_MDB_CURRENT
    int DDICT_MDB_NOTFOUND
    int DDICT_MDB_MAP_FULL
    int DDICT_TRANS_BUFFERS
    unsigned int DDICT_MDB_RDONLY


class LmdbEngineError(RuntimeError):
    """The installed lmdb package is not one whose C layout these kernels know, or an
    object handed to them is not a live one of its CPython flavour."""


#: The py-lmdb releases whose object layouts (lmdb/cpython.c) this module reads.
KNOWN_LMDB = ("3.0.",)

cdef const ddict_mdb_api* _ENGINES[2]
cdef int _engines_state = 0  # 0: not looked up yet; 1: usable; -1: refused (see _refusal)
cdef object _refusal = None
cdef object _Transaction = None
cdef object _Database = None
cdef object _Environment = None


cdef int _engines() except -1:
    """Find py-lmdb's engine tables, once per process; raise why they cannot be used."""
    global _engines_state, _refusal, _Transaction, _Database, _Environment
    if _engines_state == 1:
        return 0
    if _engines_state == -1:
        raise LmdbEngineError(_refusal)
    try:
        import lmdb
        if not lmdb.__version__.startswith(KNOWN_LMDB):
            raise LmdbEngineError(
                f"lmdb {lmdb.__version__} is installed; the compiled shard kernels know the "
                f"C layout of lmdb {' or '.join(v + 'x' for v in KNOWN_LMDB)} only")
        try:
            import lmdb.cpython as flavour
        except ImportError:
            raise LmdbEngineError("lmdb runs its CFFI flavour; the compiled shard kernels "
                                  "read the CPython one") from None
        if lmdb.Transaction is not flavour.Transaction:
            raise LmdbEngineError("lmdb runs its CFFI flavour (LMDB_FORCE_CFFI?); the "
                                  "compiled shard kernels read the CPython one")
        path = flavour.__file__.encode()
        handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD)
        if handle == NULL:
            raise LmdbEngineError(f"cannot reach the loaded {flavour.__file__}")
        _ENGINES[0] = <const ddict_mdb_api*>dlsym(handle, "lmdb_api_v09")
        _ENGINES[1] = <const ddict_mdb_api*>dlsym(handle, "lmdb_api_v10")
        for i in range(2):
            if _ENGINES[i] != NULL:
                _check_engine(_ENGINES[i])
        if _ENGINES[0] == NULL and _ENGINES[1] == NULL:
            raise LmdbEngineError(f"{flavour.__file__} exports no LMDB engine table")
        _Transaction, _Database = flavour.Transaction, flavour._Database
        _Environment = flavour.Environment
    except LmdbEngineError as e:
        _engines_state, _refusal = -1, str(e)
        raise
    _engines_state = 1
    return 0


cdef int _check_engine(const ddict_mdb_api* api) except -1:
    """The table is laid out as this module reads it: its first fields and its last one
    (the engine's own version function) agree, and its data format is LMDB's."""
    cdef int a = -1, b = -1, c = -1
    if api.data_version not in (1, 3) or api.version_fn == NULL or api.cursor_get == NULL:
        raise LmdbEngineError("lmdb's engine table is not laid out as the kernels read it")
    api.version_fn(&a, &b, &c)
    if (a, b, c) != (api.major, api.minor, api.patch):
        raise LmdbEngineError(
            f"lmdb's engine table says LMDB {api.major}.{api.minor}.{api.patch} and its "
            f"version function {a}.{b}.{c}: not the layout the kernels read")
    return 0


cdef bint _is_engine(const ddict_mdb_api* api):
    return api != NULL and (api == _ENGINES[0] or api == _ENGINES[1])


cdef bint _said = False


cdef bint _usable(object txn, object db) except -1:
    """Whether the engine may walk ``txn`` and ``db``: it was found (else say once per
    process why not) and they are lmdb's CPython objects (else the caller's objects go
    to the pure walk, which treats them as it always did)."""
    global _said
    if _engines_state != 1:
        try:
            _engines()
        except LmdbEngineError as e:
            if not _said:
                _said = True
                _logger.warning("dask_ddict.kernels: shard reads use lmdb's Python API: %s", e)
            return False
    return type(txn) is _Transaction and type(db) is _Database


cdef ddict_lmdb_txn* _txn_of(object txn, object db, unsigned int* dbi) except NULL:
    """The LMDB transaction of py-lmdb's ``txn`` (checked by :func:`_usable`) and the
    handle of its database ``db``, checked: that both are open and belong to one
    environment opened by one of the engines found."""
    cdef ddict_lmdb_txn* t = <ddict_lmdb_txn*><PyObject*>txn
    cdef ddict_lmdb_db* d = <ddict_lmdb_db*><PyObject*>db
    if not t.valid or t.txn == NULL or t.env == NULL or not d.valid:
        raise lmdb_error("Attempt to operate on closed/deleted/dropped object.")
    if not _is_engine(t.libv) or t.env.libv != t.libv or d.env != t.env:
        raise LmdbEngineError("an lmdb transaction not laid out as the kernels read it")
    dbi[0] = d.dbi
    return t


cdef bint _all_digests(list digests) except -1:
    """Whether every item is a digest (``bytes`` of DIGEST bytes): what the engine's
    walks take; anything else is walked by the pure kernel, which says what it says."""
    for d in digests:
        if type(d) is not bytes or PyBytes_GET_SIZE(d) != _DIGEST:
            return False
    return True


cdef object lmdb_error(str message):
    import lmdb
    return lmdb.Error(message)


def engine_refusal():
    """``None`` where the compiled shard kernels can use lmdb's engine, else why not."""
    try:
        _engines()
    except LmdbEngineError as e:
        return str(e)
    return None


def disown_transactions(env):
    """Let go of every transaction of py-lmdb's environment ``env`` without ending it
    (``pure.disown_transactions``), in a process forked from the one that opened it:
    each one's LMDB transaction (and the environment's spare one) is forgotten by its
    Python object, so that closing ``env`` aborts none of them.  Whether it may be
    closed now (so: also when it is closed already; not: the engine is not usable here,
    ``env`` is not its CPython flavour's, this process opened it, or a thread of the
    parent was inside it at the fork: py-lmdb's close would wait for that thread, which
    does not exist here, forever)."""
    cdef ddict_lmdb_env* e
    cdef void* child
    try:
        _engines()
    except LmdbEngineError:
        return False
    if type(env) is not _Environment:
        return False
    e = <ddict_lmdb_env*><PyObject*>env
    if not e.valid:
        return True  # (closed already: nothing of it is left to end)
    if e.pid == getpid():
        return False
    if e.active_ops or e.ops_waiters or e.write_begins or e.resizing or e.write_txn_tid:
        return False
    e.spare_txn = NULL  # (its reader slot is the parent's)
    child = e.children[1]  # (py-lmdb's list of what the environment closes: its head)
    while child != NULL:
        if type(<object>child) is _Transaction:
            (<ddict_lmdb_txn*>child).txn = NULL
        child = (<ddict_lmdb_env*>child).siblings[1]  # (the next one: every object's head)
    return True


cdef inline str _said_by(const ddict_mdb_api* api, str call, int rc):
    """What LMDB says of ``rc`` from ``call``, as lmdb's errors say it."""
    return f"{call}: {api.strerror_fn(rc).decode()}"


cdef inline object _mdb_failed(const ddict_mdb_api* api, str call, int rc):
    return lmdb_error(_said_by(api, call, rc))


cdef inline bint _live(const ddict_mdb_val* v) except -1:
    """Whether the entry ``v`` is a live version, not a tombstone (``not v[0] &
    TOMBSTONE``, with the same error for an empty value)."""
    if v.mv_size < 1:
        raise IndexError("index out of range")
    return not (<const unsigned char*>v.mv_data)[0] & _TOMBSTONE


cdef inline bint _digest_at(const ddict_mdb_val* k, const unsigned char* digest,
                            Py_ssize_t n) noexcept nogil:
    """Whether the key ``k`` starts with ``digest`` (``k[:DIGEST] == digest``)."""
    return n == _DIGEST and k.mv_size >= <size_t>_DIGEST and memcmp(k.mv_data, digest, n) == 0


cdef inline void _seek_key(unsigned char* seek, const unsigned char* digest,
                           uint64_t chkpt) noexcept nogil:
    """``seek`` (24 bytes): the data key of ``digest`` at ``chkpt``, the digest then
    ``MAXQ - chkpt`` big-endian (:func:`~dask_ddict._entry.data_key`): the first key at or
    after it with the digest is the newest version ``chkpt`` sees."""
    cdef uint64_t c = ~(<uint64_t>chkpt)
    cdef int i
    memcpy(seek, digest, _DIGEST)
    for i in range(8):
        seek[_DIGEST + i] = (c >> (56 - 8 * i)) & 0xFF


cdef inline object _val(ddict_lmdb_txn* t, const unsigned char* p, Py_ssize_t a, Py_ssize_t b):
    """``p[a:b]`` as the transaction gives values: a view of the page, or a copy."""
    if t.flags & DDICT_TRANS_BUFFERS:
        return PyMemoryView_FromMemory(<char*>p + a, b - a, PyBUF_READ)
    return PyBytes_FromStringAndSize(<const char*>p + a, b - a)


cdef Py_ssize_t* _seek_order(list digests) except NULL:
    """The indices of ``digests`` (16-byte bytes each) by their first two bytes, ascending
    (two counting sorts of 256 buckets, linear): seeks in that order walk the B-tree from
    left to right, and LMDB answers a seek whose key is within the cursor's current leaf
    page from that page alone, without descending from the root again.  Within one
    prefix the order is the callers'; the order of the answers is never changed by it.
    To be freed by the caller."""
    return _order_of(digests, NULL, len(digests))


cdef Py_ssize_t* _order_of(list digests, const unsigned char* packed,
                           Py_ssize_t n) except NULL:
    """:func:`_seek_order` of ``digests``, or (``digests`` None) of the ``n`` digests
    packed one after another at ``packed`` (a many-key request's).

    By two bytes for any number of keys: by the first alone (what a thousand keys were
    sorted by until 2026-11-30), a leaf page's keys came in the order of their second
    byte within each first one, and a same-host ``get_many`` of 1,000 keys ran 5.05 M
    keys/s against 5.76 M with the keys sorted whole."""
    cdef Py_ssize_t i
    cdef Py_ssize_t* order = <Py_ssize_t*>PyMem_Malloc((2 * n + 1) * sizeof(Py_ssize_t))
    cdef uint16_t* lead = <uint16_t*>PyMem_Malloc((n + 1) * sizeof(uint16_t))
    cdef Py_ssize_t* spare
    cdef const unsigned char* p
    if order == NULL or lead == NULL:
        PyMem_Free(order)
        PyMem_Free(lead)
        raise MemoryError()
    spare = order + n
    for i in range(n):
        if digests is None:
            p = packed + _DIGEST * i
        else:
            p = <const unsigned char*>PyBytes_AS_STRING(<bytes>digests[i])
        lead[i] = <uint16_t>((p[0] << 8) | p[1])
    _by_byte(lead, 0, NULL, spare, n)  # by the second byte,
    _by_byte(lead, 8, spare, order, n)  # then by the first, stably
    PyMem_Free(lead)
    return order


cdef void _by_byte(const uint16_t* lead, unsigned int shift, const Py_ssize_t* source,
                   Py_ssize_t* dest, Py_ssize_t n) noexcept nogil:
    """``dest``: the indices of ``source`` (``0 .. n - 1`` where NULL) by the byte
    ``lead[i] >> shift`` of each, stably (a counting sort, one of :func:`_order_of`'s
    two)."""
    cdef Py_ssize_t starts[257]
    cdef Py_ssize_t i, j, k
    memset(starts, 0, sizeof(starts))
    for j in range(n):
        i = j if source == NULL else source[j]
        starts[((lead[i] >> shift) & 0xFF) + 1] += 1
    for k in range(256):
        starts[k + 1] += starts[k]
    for j in range(n):
        i = j if source == NULL else source[j]
        k = (lead[i] >> shift) & 0xFF
        dest[starts[k]] = i
        starts[k] += 1


cdef const unsigned char* _newest(const ddict_mdb_api* api, ddict_mdb_cursor* cur,
                                  unsigned char* seek, bytes digest,
                                  Py_ssize_t* n) except? NULL:
    """The frame of ``digest``'s newest version at the checkpoint whose tail ``seek`` holds
    after its digest (``n[0]``: the frame's length), or NULL: absent, or a deletion."""
    return _newest_at(api, cur, seek, <const unsigned char*>PyBytes_AS_STRING(digest), n, NULL)


cdef const unsigned char* _newest_at(const ddict_mdb_api* api, ddict_mdb_cursor* cur,
                                     unsigned char* seek, const unsigned char* digest,
                                     Py_ssize_t* n, Py_ssize_t* size) except? NULL:
    """:func:`_newest` of the 16 bytes at ``digest``; ``size`` (unless NULL): the whole
    entry's length."""
    cdef ddict_mdb_val k, v
    cdef const unsigned char* raw
    cdef Py_ssize_t have
    cdef uint64_t flen
    cdef int rc
    memcpy(seek, digest, _DIGEST)
    k.mv_size, k.mv_data = _DIGEST + 8, seek
    rc = api.cursor_get(cur, &k, &v, DDICT_MDB_SET_RANGE)
    if rc == DDICT_MDB_NOTFOUND:
        return NULL
    if rc:
        raise _mdb_failed(api, "mdb_cursor_get", rc)
    if not _digest_at(&k, seek, _DIGEST):
        return NULL
    raw = <const unsigned char*>v.mv_data
    if v.mv_size < _ENTRY_HEADER:
        raise struct.error(f"a shard entry of {v.mv_size} bytes has no header")
    if raw[0] & _TOMBSTONE:
        return NULL
    flen = _le64(raw + 8)
    have = <Py_ssize_t>v.mv_size - _ENTRY_HEADER
    n[0] = have if flen > <uint64_t>have else <Py_ssize_t>flen
    if size != NULL:
        size[0] = <Py_ssize_t>v.mv_size
    return raw + _ENTRY_HEADER


cdef ddict_mdb_cursor* _walk(object txn, object db, ddict_lmdb_txn** t,
                             unsigned char* seek, bytes tail) except NULL:
    """A cursor on ``db`` in ``txn`` (``t[0]``: the transaction's object), ``seek`` holding
    ``tail`` after room for a digest: what a many-key walk seeks with."""
    cdef unsigned int dbi
    cdef ddict_mdb_cursor* cur = NULL
    cdef int rc
    t[0] = _txn_of(txn, db, &dbi)
    memcpy(seek + _DIGEST, PyBytes_AS_STRING(tail), 8)
    rc = t[0].libv.cursor_open(t[0].txn, dbi, &cur)
    if rc:
        raise _mdb_failed(t[0].libv, "mdb_cursor_open", rc)
    return cur


def lookup_frames(txn, db, list digests, bytes tail, Py_ssize_t small=0):
    cdef ddict_lmdb_txn* t
    cdef unsigned char seek[64]  # (a digest and a tail: 24 bytes)
    cdef Py_ssize_t n = 0, j, i
    cdef const unsigned char* frame
    cdef ddict_mdb_cursor* cur
    cdef list out
    cdef Py_ssize_t* order
    if not _usable(txn, db) or not _all_digests(digests) or PyBytes_GET_SIZE(tail) != 8:
        # (the pure walk, as it always was)
        return _pure_lookup_frames(txn, db, digests, tail, small)
    out = [None] * len(digests)  # (absent, unless found)
    cur = _walk(txn, db, &t, seek, tail)
    order = NULL
    try:
        order = _seek_order(digests)
        for j in range(len(digests)):
            i = order[j]
            frame = _newest(t.libv, cur, seek, <bytes>digests[i], &n)
            if frame == NULL:
                continue
            if n >= small:  # (as the cursor gives it: a view in a buffers txn)
                out[i] = _val(t, frame, 0, n)
            else:
                out[i] = PyBytes_FromStringAndSize(<char*>frame, n)
    finally:
        t.libv.cursor_close(cur)
        PyMem_Free(order)
    return out


def lookup_values(txn, db, list digests, bytes tail, Py_ssize_t small, object absent,
                  object take, object decode):
    cdef list out
    cdef Py_ssize_t nbytes = 0, copies = 0
    if not _usable(txn, db) or not _all_digests(digests) or PyBytes_GET_SIZE(tail) != 8:
        return _pure_lookup_values(txn, db, digests, tail, small, absent, take, decode)
    out = [absent] * len(digests)  # (absent, unless found)
    _values_into(txn, db, digests, NULL, out, tail, small, take, decode, &nbytes, &copies)
    return Decoded(out), nbytes, copies


def place_values(txn, db, list digests, bytes positions not None, list out not None,
                 bytes tail, Py_ssize_t small, object absent, object take, object decode):
    cdef Py_ssize_t n = len(digests), j, nbytes = 0, copies = 0
    cdef const unsigned char* at = <const unsigned char*>PyBytes_AS_STRING(positions)
    if PyBytes_GET_SIZE(positions) != 4 * n:
        raise ValueError(f"{PyBytes_GET_SIZE(positions)} bytes of positions for {n} digests")
    for j in range(n):
        if <Py_ssize_t>_le32(at + 4 * j) >= PyList_GET_SIZE(out):
            raise ValueError(f"a position beyond the {PyList_GET_SIZE(out)} values")
    if not _usable(txn, db) or not _all_digests(digests) or PyBytes_GET_SIZE(tail) != 8:
        return _pure_place_values(txn, db, digests, positions, out, tail, small, absent, take,
                                  decode)
    for j in range(n):  # (absent, unless found)
        out[_le32(at + 4 * j)] = absent
    _values_into(txn, db, digests, at, out, tail, small, take, decode, &nbytes, &copies)
    return nbytes, copies


cdef int _values_into(txn, db, list digests, const unsigned char* at, list out, bytes tail,
                      Py_ssize_t small, object take, object decode, Py_ssize_t* nbytes,
                      Py_ssize_t* copies) except -1:
    """:func:`lookup_values`' walk: the value of ``digests[i]`` into ``out[i]``, or (``at``
    not NULL: :func:`place_values`) into ``out[at[i]]`` (``u32`` each); an absent key's
    place is left as it is."""
    cdef ddict_lmdb_txn* t
    cdef unsigned char seek[64]
    cdef Py_ssize_t n = 0, j, i
    cdef const unsigned char* frame
    cdef ddict_mdb_cursor* cur
    cdef Py_ssize_t* order
    cdef bint own = decode is _loads_value  # (the frames' own decoder: small ones decoded here)
    cur = _walk(txn, db, &t, seek, tail)
    order = NULL
    try:
        order = _seek_order(digests)
        for j in range(len(digests)):
            i = order[j]
            frame = _newest(t.libv, cur, seek, <bytes>digests[i], &n)
            if frame == NULL:
                continue
            if n < small:  # (decoded where it lies; else from a copy, as the pure one does)
                nbytes[0] += n
                copies[0] += 1
                value = _small_at(frame, n) if own else NotImplemented
                if value is NotImplemented:
                    value = decode(PyBytes_FromStringAndSize(<char*>frame, n))
            elif t.flags & DDICT_TRANS_BUFFERS:
                value = decode(take(_val(t, frame, 0, n)))
            else:  # (a copy already: as the pure walk gives it)
                nbytes[0] += n
                copies[0] += 1
                value = decode(PyBytes_FromStringAndSize(<char*>frame, n))
            out[i if at == NULL else <Py_ssize_t>_le32(at + 4 * i)] = value
    finally:
        t.libv.cursor_close(cur)
        PyMem_Free(order)
    return 0


def put_entries(txn, db, list records, Py_ssize_t start, bytes tail, int flags,
                Py_ssize_t most, object full):
    cdef unsigned int dbi
    cdef ddict_lmdb_txn* t
    cdef const ddict_mdb_api* api
    cdef ddict_mdb_cursor* cur
    cdef ddict_mdb_val k, v, nk, nv
    cdef unsigned char seek[64]
    cdef bint dead = flags & _TOMBSTONE, live
    cdef Py_ssize_t delta = 0, i, n = len(records), nbytes, klen, total, off, end, dlen
    cdef char* p
    cdef int rc
    cdef object digest
    if not _usable(txn, db) or PyBytes_GET_SIZE(tail) != 8:  # (the pure loop, as ever)
        return _pure_put_entries(txn, db, records, start, tail, flags, most, full)
    t = _txn_of(txn, db, &dbi)
    api = t.libv
    cur = NULL
    rc = api.cursor_open(t.txn, dbi, &cur)
    if rc:
        raise _mdb_failed(api, "mdb_cursor_open", rc)
    try:
        for i in range(start, n):
            r = records[i]
            digest, kb, frame = r[0], r[1], r[2]
            if type(digest) is not bytes or PyBytes_GET_SIZE(digest) != _DIGEST:
                # (not a digest: the rest as the pure loop puts it, with its errors)
                done, more, error = _pure_put_entries(txn, db, records, i, tail, flags, most, full)
                return done, delta + more, error
            dlen = _DIGEST
            parts, nbytes = _parts(frame)
            klen = len(kb)
            total = _ENTRY_HEADER + nbytes + klen
            if total >= most:
                return i, delta, None
            memcpy(seek, PyBytes_AS_STRING(digest), dlen)
            memcpy(seek + dlen, PyBytes_AS_STRING(tail), PyBytes_GET_SIZE(tail))
            k.mv_size, k.mv_data = dlen + PyBytes_GET_SIZE(tail), seek
            # the version at this checkpoint, if any, is replaced (the pure loop's replace)
            rc = api.cursor_get(cur, &k, &v, DDICT_MDB_SET_KEY)
            if rc == 0:
                live = _live(&v)
            elif rc == DDICT_MDB_NOTFOUND:
                live = False
            else:
                raise _mdb_failed(api, "mdb_cursor_get", rc)
            existed = rc == 0
            k.mv_size, k.mv_data = dlen + PyBytes_GET_SIZE(tail), seek
            v.mv_size, v.mv_data = total, NULL
            # (written in place below; over the version found, without a second search)
            rc = api.cursor_put(cur, &k, &v,
                                DDICT_MDB_RESERVE | (DDICT_MDB_CURRENT if existed else 0))
            t.mutations += 1
            if rc == DDICT_MDB_MAP_FULL:  # (the transaction is then only to abort)
                return i, delta, full(_said_by(api, "mdb_cursor_put", rc))
            if rc:
                raise _mdb_failed(api, "mdb_cursor_put", rc)
            p = <char*>v.mv_data
            p[0] = <char>(flags & 0xFF)
            p[1] = p[2] = p[3] = 0
            _put_le32(p + 4, <uint32_t>klen)
            _put_le64(<unsigned char*>p + 8, <uint64_t>nbytes)
            off, end = _ENTRY_HEADER, total - klen
            for part in parts:
                off = _copy_in(p, off, end, part)
                if off < 0:
                    break
            if off != end or _copy_in(p, off, total, kb) != total:
                raise ValueError(_UNEVEN)  # (a frame whose parts do not add up: a bug)
            if not existed:  # new at this checkpoint: its older versions follow, newest first
                rc = api.cursor_get(cur, &nk, &nv, DDICT_MDB_NEXT)
                if rc == 0 and _digest_at(&nk, seek, dlen):
                    live = _live(&nv)
                    while True:
                        rc = api.cursor_del(cur, 0)
                        t.mutations += 1
                        if rc == DDICT_MDB_MAP_FULL:
                            return i, delta, full(_said_by(api, "mdb_cursor_del", rc))
                        if rc:
                            raise _mdb_failed(api, "mdb_cursor_del", rc)
                        rc = api.cursor_get(cur, &nk, &nv, DDICT_MDB_GET_CURRENT)
                        if rc or not _digest_at(&nk, seek, dlen):
                            break
                elif rc and rc != DDICT_MDB_NOTFOUND:
                    raise _mdb_failed(api, "mdb_cursor_get", rc)
            if live == dead:  # (seen before xor after: one key more or less)
                delta += -1 if live else 1
        return n, delta, None
    finally:
        api.cursor_close(cur)




def lookup_entry(txn, db, digest, chkpt, bint whole=True):
    cdef unsigned int dbi
    cdef ddict_lmdb_txn* t
    cdef const ddict_mdb_api* api
    cdef ddict_mdb_cursor* cur = NULL
    cdef ddict_mdb_val k, v
    cdef unsigned char seek[24]
    cdef uint64_t c, flen, klen, version = 0
    cdef Py_ssize_t size, end, stop, i
    cdef const unsigned char* p
    cdef int rc
    if (not _usable(txn, db) or type(digest) is not bytes
            or PyBytes_GET_SIZE(digest) != _DIGEST or type(chkpt) is not int
            or not 0 <= chkpt <= _MAXQ):  # (the pure seek, with its errors)
        return _pure_lookup_entry(txn, db, digest, chkpt, whole)
    t = _txn_of(txn, db, &dbi)
    api = t.libv
    _seek_key(seek, <const unsigned char*>PyBytes_AS_STRING(digest), chkpt)
    rc = api.cursor_open(t.txn, dbi, &cur)
    if rc:
        raise _mdb_failed(api, "mdb_cursor_open", rc)
    try:
        k.mv_size, k.mv_data = _DIGEST + 8, seek
        rc = api.cursor_get(cur, &k, &v, DDICT_MDB_SET_RANGE)
        if rc == DDICT_MDB_NOTFOUND:
            return None
        if rc:
            raise _mdb_failed(api, "mdb_cursor_get", rc)
        if not _digest_at(&k, seek, _DIGEST):
            return None
        if (k.mv_size < <size_t>_DIGEST + 8 or v.mv_size < <size_t>_ENTRY_HEADER
                or (whole and v.mv_size >= <size_t>_PRELOADED)):
            pass  # (what no shard writes, or a value to preload: the pure seek, below)
        else:
            p = <const unsigned char*>k.mv_data + _DIGEST
            for i in range(8):
                version = (version << 8) | p[i]
            p = <const unsigned char*>v.mv_data
            size = <Py_ssize_t>v.mv_size
            flen, klen = _le64(p + 8), _le32(p + 4)
            # (the frame, then the key, as Python slices: bounds past the end cut there)
            end = size if flen > <uint64_t>(size - _ENTRY_HEADER) else (
                _ENTRY_HEADER + <Py_ssize_t>flen)
            stop = size if klen > <uint64_t>(size - end) else end + <Py_ssize_t>klen
            return _new_tuple(_Entry, (~version, p[0], _val(t, p, _ENTRY_HEADER, end),
                                       _val(t, p, end, stop)))
    finally:
        api.cursor_close(cur)
    return _pure_lookup_entry(txn, db, digest, chkpt, whole)


cdef extern from *:
    """
    /* A byte of every page of p[:n] read (a volatile read: never optimised away), as
       py-lmdb's preload reads one, and the last byte (a value may end in a page its
       stride does not reach). */
    static void ddict_touch(const unsigned char *p, size_t n, size_t stride) {
        const volatile unsigned char *c = p;
        size_t i;
        for (i = 0; i < n; i += stride)
            (void)c[i];
        if (n)
            (void)c[n - 1];
    }
    """
    void ddict_touch(const unsigned char* p, size_t n, size_t stride) nogil


cdef size_t _TOUCH_STRIDE = TOUCH_STRIDE


def touch_pages(frame):
    """``pure.touch_pages``: here with the interpreter lock released while the pages are
    read (their faults wait for the kernel, not for the lock)."""
    cdef Py_buffer view
    _get_contiguous(frame, &view, "touch_pages")
    try:
        with nogil:
            ddict_touch(<const unsigned char*>view.buf, <size_t>view.len, _TOUCH_STRIDE)
    finally:
        PyBuffer_Release(&view)
