# A shard's plain writes through LMDB's C API, callable without the interpreter lock:
# a put's version over the key's older ones, and a window of one's key counts.  Included
# by _compiled.pyx, after lmdb_engine.pxi; the host's plain server (plain_server.pxi)
# writes its puts and fetch_adds with them, holding the interpreter lock, and a
# same-host client's commits behind its batch (commit_behind.pxi) on a thread that
# never takes it.  Nothing here touches a Python object: a value comes as C parts.

from .pure import COUNTS

cdef char _counts_key[16]  # (a window of one's counts, <qqq: see _counts_at; copied here,
cdef size_t _counts_len = len(COUNTS)  # read by a thread that may outlive the module)
assert _counts_len <= 16
memcpy(_counts_key, PyBytes_AS_STRING(COUNTS), _counts_len)
cdef int _PERSISTENT = PERSISTENT


ctypedef struct _Part:  # (one buffer of a value's frame)
    const char* p
    Py_ssize_t n


cdef Py_ssize_t _put_parts(const ddict_mdb_api* api, ddict_mdb_txn* w, unsigned int dbi,
                           const unsigned char* digest, const char* key, Py_ssize_t keylen,
                           const _Part* parts, Py_ssize_t nparts, Py_ssize_t vlen,
                           int64_t chkpt) noexcept nogil:
    """A plain put's version written in ``w`` (the value's frame: ``nparts`` parts of
    ``vlen`` bytes in all), its older versions dropped, as :func:`put_entries` writes a
    record: the change in keys seen (0 or 1), or -1 where LMDB refused it (the
    transaction is then only to abort)."""
    cdef ddict_mdb_cursor* cur = NULL
    cdef Py_ssize_t delta
    if api.cursor_open(w, dbi, &cur):
        return -1
    delta = _put_at(api, cur, digest, key, keylen, parts, nparts, vlen, chkpt)
    api.cursor_close(cur)
    return delta


cdef Py_ssize_t _put_at(const ddict_mdb_api* api, ddict_mdb_cursor* cur,
                        const unsigned char* digest, const char* key, Py_ssize_t keylen,
                        const _Part* parts, Py_ssize_t nparts, Py_ssize_t vlen,
                        int64_t chkpt) noexcept nogil:
    """:func:`_put_parts` on an open cursor of the data table."""
    cdef ddict_mdb_val k, v, nk, nv
    cdef unsigned char seek[24]
    cdef Py_ssize_t total = _ENTRY_HEADER + vlen + keylen, off, i
    cdef bint live, existed
    cdef char* q
    cdef int rc
    _seek_key(seek, digest, chkpt)
    k.mv_size, k.mv_data = _DIGEST + 8, seek
    rc = api.cursor_get(cur, &k, &v, DDICT_MDB_SET_KEY)
    if rc and rc != DDICT_MDB_NOTFOUND:
        return -1
    existed = rc == 0
    live = existed and v.mv_size >= 1 and not (<const unsigned char*>v.mv_data)[0] & _TOMBSTONE
    k.mv_size, k.mv_data = _DIGEST + 8, seek
    v.mv_size, v.mv_data = total, NULL
    if api.cursor_put(cur, &k, &v,  # (over the version found: no second search)
                      DDICT_MDB_RESERVE | (DDICT_MDB_CURRENT if existed else 0)):
        return -1
    q = <char*>v.mv_data
    q[0] = <char>_PERSISTENT
    q[1] = q[2] = q[3] = 0
    _put_le32(q + 4, <uint32_t>keylen)
    _put_le64(<unsigned char*>q + 8, <uint64_t>vlen)
    off = _ENTRY_HEADER
    for i in range(nparts):
        memcpy(q + off, parts[i].p, parts[i].n)
        off += parts[i].n
    memcpy(q + off, key, keylen)
    if not existed:  # new at this checkpoint: its older versions follow, newest first
        rc = api.cursor_get(cur, &nk, &nv, DDICT_MDB_NEXT)
        if rc == 0 and _digest_at(&nk, seek, _DIGEST):
            live = nv.mv_size >= 1 and not (<const unsigned char*>nv.mv_data)[0] & _TOMBSTONE
            while True:
                if api.cursor_del(cur, 0):
                    return -1
                rc = api.cursor_get(cur, &nk, &nv, DDICT_MDB_GET_CURRENT)
                if rc or not _digest_at(&nk, seek, _DIGEST):
                    break
        elif rc and rc != DDICT_MDB_NOTFOUND:
            return -1
    return 0 if live else 1


cdef inline Py_ssize_t _put_one(const ddict_mdb_api* api, ddict_mdb_txn* w, unsigned int dbi,
                                const unsigned char* ks, Py_ssize_t klen,
                                const unsigned char* value, Py_ssize_t vlen,
                                int64_t chkpt) noexcept nogil:
    """:func:`_put_parts` of a request's key section ``ks`` (the digest, then the key:
    ``klen`` bytes) and a value's frame in one buffer."""
    cdef _Part part
    part.p, part.n = <const char*>value, vlen
    return _put_parts(api, w, dbi, ks, <const char*>ks + _DIGEST, klen - _DIGEST, &part, 1,
                      vlen, chkpt)


cdef bint _counts_at(const ddict_mdb_api* api, ddict_mdb_txn* w, unsigned int dbi,
                     int64_t newest, unsigned char* counts) noexcept nogil:
    """Whether ``w`` holds the counts of a window of one checkpoint ending at ``newest``
    (key_counts' counts, ``<qqq``: newest, then the checkpoint's and the ones beyond's),
    copied to ``counts`` (else the manager recounts)."""
    cdef ddict_mdb_val k, v
    k.mv_size, k.mv_data = _counts_len, <void*>_counts_key
    if api.get(w, dbi, &k, &v) or v.mv_size != 24:
        return False
    memcpy(counts, v.mv_data, 24)
    return <int64_t>_le64(counts) == newest


cdef bint _count_by(const ddict_mdb_api* api, ddict_mdb_txn* w, unsigned int dbi,
                    int64_t newest, int64_t delta) noexcept nogil:
    """``delta`` keys more seen at every slot of a window of one checkpoint ending at
    ``newest``: whether it was counted (else the manager recounts)."""
    cdef ddict_mdb_val k, v
    cdef unsigned char counts[24]
    cdef int i
    if not _counts_at(api, w, dbi, newest, counts):
        return False
    k.mv_size, k.mv_data = _counts_len, <void*>_counts_key
    for i in range(1, 3):
        _put_le64(counts + 8 * i, <uint64_t>(<int64_t>_le64(counts + 8 * i) + delta))
    v.mv_size, v.mv_data = 24, counts
    return api.put(w, dbi, &k, &v, 0) == 0
