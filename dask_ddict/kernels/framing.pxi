# The key path's wire and routing as C-level functions (included by _compiled.pyx).
#
# Every request and reply of the key path starts with a fixed header
# (``transport/protocol.py``: ``REQ`` and ``REP``, declared in ``pure.REQUEST`` and
# ``pure.REPLY``; the import-time checks in _compiled.pyx hold them to these layouts),
# and every key goes to the manager its digest names.  Here each is written once, as a
# C struct and plain C functions that need no interpreter (``nogil``): the host's plain
# server reads requests and writes replies with them, the client's key lane writes
# requests and reads replies, and the Python-facing kernels (``take_request``,
# ``send_reply``, ``receive_reply``, the router) go through the same ones.  They are
# the layer a C or C++ client (Dragon ships both) would sit on: a key's canonical bytes
# (``_keys.encode_key``'s) give its digest and manager, a request is a header, the key
# section (digest, then the key's bytes) and the value; a reply is a header and a
# payload.  Fields are little-endian whatever the machine.

cdef enum:
    DDICT_REQUEST_BYTES = 64  # (REQUEST.size)
    DDICT_REPLY_BYTES = 24  # (REPLY.size)
    DDICT_DIGEST_BYTES = 16  # (_entry.DIGEST)


ctypedef struct ddict_request_head:
    # REQUEST: op, flags, term, klen, manager, tag, chkpt, arg, client, timeout, vlen, rid
    unsigned int op  # u8
    unsigned int flags  # u8
    unsigned int term  # u16: the manager's term as the client knows it (wire_term; 0: none)
    uint32_t klen  # the key section's bytes: digest (16), then the key's bytes
    uint32_t manager
    uint32_t tag  # the client's number for the request, which its reply repeats
    int64_t chkpt
    int64_t arg
    uint64_t client
    double timeout  # seconds; negative: none
    uint64_t vlen  # the value's bytes
    uint64_t rid  # a request id (0: none): applied at most once


ctypedef struct ddict_reply_head:
    # REPLY: status, (3 bytes of padding), tag, ival, payload length
    unsigned int status  # u8 (errors.Status)
    uint32_t tag
    int64_t ival
    uint64_t plen


cdef inline void ddict_write_request(unsigned char* p, const ddict_request_head* h) noexcept nogil:
    """The header of request ``h`` into ``p[:DDICT_REQUEST_BYTES]``."""
    cdef uint64_t bits
    p[0], p[1] = <unsigned char>h.op, <unsigned char>h.flags
    p[2], p[3] = <unsigned char>(h.term & 0xFF), <unsigned char>((h.term >> 8) & 0xFF)
    _put_le32(<char*>p + 4, h.klen)
    _put_le32(<char*>p + 8, h.manager)
    _put_le32(<char*>p + 12, h.tag)
    _put_le64(p + 16, <uint64_t>h.chkpt)
    _put_le64(p + 24, <uint64_t>h.arg)
    _put_le64(p + 32, h.client)
    memcpy(&bits, &h.timeout, 8)
    _put_le64(p + 40, bits)
    _put_le64(p + 48, h.vlen)
    _put_le64(p + 56, h.rid)


cdef inline void ddict_read_request(const unsigned char* p, ddict_request_head* h) noexcept nogil:
    """The header at ``p[:DDICT_REQUEST_BYTES]`` into ``h``."""
    cdef uint64_t bits
    h.op, h.flags = p[0], p[1]
    h.term = p[2] | (<unsigned int>p[3] << 8)
    h.klen, h.manager, h.tag = _le32(p + 4), _le32(p + 8), _le32(p + 12)
    h.chkpt, h.arg = <int64_t>_le64(p + 16), <int64_t>_le64(p + 24)
    h.client = _le64(p + 32)
    bits = _le64(p + 40)
    memcpy(&h.timeout, &bits, 8)
    h.vlen, h.rid = _le64(p + 48), _le64(p + 56)


cdef inline void ddict_write_reply(unsigned char* p, const ddict_reply_head* h) noexcept nogil:
    """The header of reply ``h`` into ``p[:DDICT_REPLY_BYTES]``."""
    p[0], p[1], p[2], p[3] = <unsigned char>h.status, 0, 0, 0
    _put_le32(<char*>p + 4, h.tag)
    _put_le64(p + 8, <uint64_t>h.ival)
    _put_le64(p + 16, h.plen)


cdef inline void ddict_read_reply(const unsigned char* p, ddict_reply_head* h) noexcept nogil:
    """The header at ``p[:DDICT_REPLY_BYTES]`` into ``h``."""
    h.status, h.tag = p[0], _le32(p + 4)
    h.ival, h.plen = <int64_t>_le64(p + 8), _le64(p + 16)


cdef inline void ddict_digest(const unsigned char* key, size_t n,
                              unsigned char* digest) noexcept nogil:
    """The 16-byte digest of a key's canonical bytes ``key[:n]`` (``key_digest``: BLAKE2b
    of 16 bytes, no key) into ``digest``."""
    _blake16_into(key, <Py_ssize_t>n, digest)


cdef inline uint64_t ddict_manager_of(const unsigned char* digest,
                                      uint64_t managers) noexcept nogil:
    """The manager of a key with ``digest`` among ``managers`` (``manager_for_digest``:
    its first 8 bytes, little-endian, modulo the count); ``managers`` is at least 1."""
    return _le64(digest) % managers


# -- the same, from Python: for the tests that compare them with the structs' own ---------

def request_head(tuple fields):
    """``REQUEST.pack(*fields)``, written by :func:`ddict_write_request`."""
    cdef ddict_request_head h
    cdef bytes out = PyBytes_FromStringAndSize(NULL, DDICT_REQUEST_BYTES)
    (h.op, h.flags, h.term, h.klen, h.manager, h.tag, h.chkpt, h.arg, h.client, h.timeout,
     h.vlen, h.rid) = fields
    ddict_write_request(<unsigned char*>PyBytes_AS_STRING(out), &h)
    return out


def request_fields(bytes head not None):
    """``REQUEST.unpack(head)``, read by :func:`ddict_read_request`."""
    cdef ddict_request_head h
    if PyBytes_GET_SIZE(head) != DDICT_REQUEST_BYTES:
        raise ValueError(f"a request header is {DDICT_REQUEST_BYTES} bytes")
    ddict_read_request(<const unsigned char*>PyBytes_AS_STRING(head), &h)
    return (h.op, h.flags, h.term, h.klen, h.manager, h.tag, h.chkpt, h.arg, h.client,
            h.timeout, h.vlen, h.rid)


def reply_head(tuple fields):
    """``REPLY.pack(*fields)``, written by :func:`ddict_write_reply`."""
    cdef ddict_reply_head h
    cdef bytes out = PyBytes_FromStringAndSize(NULL, DDICT_REPLY_BYTES)
    h.status, h.tag, h.ival, h.plen = fields
    ddict_write_reply(<unsigned char*>PyBytes_AS_STRING(out), &h)
    return out


def reply_fields(bytes head not None):
    """``REPLY.unpack(head)``, read by :func:`ddict_read_reply`."""
    cdef ddict_reply_head h
    if PyBytes_GET_SIZE(head) != DDICT_REPLY_BYTES:
        raise ValueError(f"a reply header is {DDICT_REPLY_BYTES} bytes")
    ddict_read_reply(<const unsigned char*>PyBytes_AS_STRING(head), &h)
    return h.status, h.tag, h.ival, h.plen


def manager_of(bytes key not None, uint64_t managers):
    """``(manager_for_digest(key_digest(key), managers), key_digest(key))``, computed by
    :func:`ddict_digest` and :func:`ddict_manager_of`."""
    cdef unsigned char digest[16]
    if managers == 0:
        raise ZeroDivisionError("no managers")
    ddict_digest(<const unsigned char*>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), digest)
    return ddict_manager_of(digest, managers), PyBytes_FromStringAndSize(<char*>digest, 16)
