# The key path's wire and routing as C-level functions (included by _compiled.pyx).
#
# Every request and reply of the key path starts with a fixed header
# (``transport/protocol.py``: ``REQ`` and ``REP``, declared in ``pure.REQUEST`` and
# ``pure.REPLY``; the import-time checks in _compiled.pyx hold them to these layouts),
# and every key goes to the manager its digest names.  Each is written once, in C, in
# ``ddict_wire.h`` (plain C functions that need no interpreter): the host's plain server
# reads requests and writes replies with them, the client's key lane writes requests
# and reads replies, and the Python-facing kernels (``take_request``, ``send_reply``,
# ``receive_reply``, the router) go through the same ones.  It is the layer a C or C++
# client (Dragon ships both) sits on: ``examples/c_client/wire_client.c`` is one.

cdef extern from "ddict_wire.h" nogil:
    enum:
        DDICT_REQUEST_BYTES
        DDICT_REPLY_BYTES
        DDICT_DIGEST_BYTES
        DDICT_HELLO_BYTES
        DDICT_NONCE_BYTES
        DDICT_UID_BYTES
        DDICT_INCARNATION_BYTES
        DDICT_PROOF_BYTES
        DDICT_VALUE_HEAD_BYTES
        DDICT_KEY_BYTES_MOST
        DDICT_HELLO_OK
        DDICT_HELLO_CLOSED
        DDICT_HELLO_UNKNOWN
        DDICT_HELLO_DENIED
        DDICT_HELLO_PROVE
        DDICT_OP_PUT
        DDICT_OP_GET
        DDICT_OP_CONTAINS
        DDICT_OP_POP
        DDICT_OP_FETCH_ADD
        DDICT_STATUS_OK
        DDICT_STATUS_KEY_NOT_FOUND
        DDICT_STATUS_TIMEOUT
        DDICT_FMT_PICKLE
        DDICT_FMT_RAW
        DDICT_FMT_BYTES
    const char* DDICT_HELLO_MAGIC
    const char* DDICT_HANDSHAKE_VERSION

    ctypedef struct ddict_request_head:
        unsigned int op
        unsigned int flags
        unsigned int term
        uint32_t klen
        uint32_t manager
        uint32_t tag
        int64_t chkpt
        int64_t arg
        uint64_t client
        double timeout
        uint64_t vlen
        uint64_t rid

    ctypedef struct ddict_reply_head:
        unsigned int status
        uint32_t tag
        int64_t ival
        uint64_t plen

    # (the kernels' own names for the little-endian fields)
    uint32_t _le32 "ddict_le32"(const unsigned char* p)
    uint64_t _le64 "ddict_le64"(const unsigned char* p)
    void _put_le32 "ddict_put_le32"(void* p, uint32_t v)
    void _put_le64 "ddict_put_le64"(void* p, uint64_t v)
    void ddict_write_request(unsigned char* p, const ddict_request_head* h)
    void ddict_read_request(const unsigned char* p, ddict_request_head* h)
    void ddict_write_reply(unsigned char* p, const ddict_reply_head* h)
    void ddict_read_reply(const unsigned char* p, ddict_reply_head* h)
    void ddict_value_head(unsigned char* head, unsigned int fmt, uint64_t n)
    void ddict_bytes_value_head(unsigned char* head, uint64_t n)
    size_t ddict_str_key(const char* utf8, size_t n, unsigned char* out)
    size_t ddict_int_key(int64_t v, unsigned char* out)
    void ddict_digest(const unsigned char* key, size_t n, unsigned char* digest)
    uint64_t ddict_manager_of(const unsigned char* digest, uint64_t managers)
    void ddict_proof(const char* secret, size_t slen, const char* role, const unsigned char* uid,
                     const char* target, size_t tlen, const unsigned char* incarnation,
                     const unsigned char* client_nonce, const unsigned char* host_nonce,
                     unsigned char* out)
    int ddict_proofs_equal(const unsigned char* a, const unsigned char* b)
    ctypedef struct ddict_sha256:
        pass
    void ddict_sha256_init(ddict_sha256* s)
    void ddict_sha256_update(ddict_sha256* s, const void* data, size_t n)
    void ddict_sha256_final(ddict_sha256* s, unsigned char* out)


# -- the same, from Python: for the tests that compare them with the structs' own ---------

def wire_constants():
    """The header's constants, by their Python names (``tests/test_kernels.py`` holds
    them to the declarations in ``transport/protocol.py``, ``errors.py`` and
    ``_serialize.py``: a C client's numbers are the Python client's)."""
    return {
        "REQUEST": DDICT_REQUEST_BYTES, "REPLY": DDICT_REPLY_BYTES,
        "DIGEST": DDICT_DIGEST_BYTES, "HELLO": DDICT_HELLO_BYTES,
        "NONCE": DDICT_NONCE_BYTES, "VALUE_HEAD": DDICT_VALUE_HEAD_BYTES,
        "UID": DDICT_UID_BYTES, "INCARNATION": DDICT_INCARNATION_BYTES,
        "PROOF": DDICT_PROOF_BYTES, "VERSION": <bytes>DDICT_HANDSHAKE_VERSION,
        "HELLO_MAGIC": <bytes>DDICT_HELLO_MAGIC, "Hello.OK": DDICT_HELLO_OK,
        "Hello.CLOSED": DDICT_HELLO_CLOSED, "Hello.UNKNOWN": DDICT_HELLO_UNKNOWN,
        "Hello.DENIED": DDICT_HELLO_DENIED, "Hello.PROVE": DDICT_HELLO_PROVE,
        "Op.PUT": DDICT_OP_PUT, "Op.GET": DDICT_OP_GET, "Op.CONTAINS": DDICT_OP_CONTAINS,
        "Op.POP": DDICT_OP_POP, "Op.FETCH_ADD": DDICT_OP_FETCH_ADD,
        "Status.OK": DDICT_STATUS_OK, "Status.KEY_NOT_FOUND": DDICT_STATUS_KEY_NOT_FOUND,
        "Status.TIMEOUT": DDICT_STATUS_TIMEOUT,
        "FMT_PICKLE": DDICT_FMT_PICKLE, "FMT_RAW": DDICT_FMT_RAW, "FMT_BYTES": DDICT_FMT_BYTES,
    }


def wire_proof(bytes secret not None, bytes role not None, bytes uid not None,
               bytes target not None, bytes incarnation not None, bytes client_nonce not None,
               bytes host_nonce not None):
    """``handshake.proof``, written by :func:`ddict_proof` (a C client's HMAC-SHA256)."""
    cdef unsigned char out[DDICT_PROOF_BYTES]
    if (PyBytes_GET_SIZE(uid) != DDICT_UID_BYTES
            or PyBytes_GET_SIZE(incarnation) != DDICT_INCARNATION_BYTES
            or PyBytes_GET_SIZE(client_nonce) != DDICT_NONCE_BYTES
            or PyBytes_GET_SIZE(host_nonce) != DDICT_NONCE_BYTES):  # fmt: skip
        raise ValueError("a uid, an incarnation or a nonce of the wrong size")
    ddict_proof(PyBytes_AS_STRING(secret), PyBytes_GET_SIZE(secret), role,
                <const unsigned char*>PyBytes_AS_STRING(uid), PyBytes_AS_STRING(target),
                PyBytes_GET_SIZE(target), <const unsigned char*>PyBytes_AS_STRING(incarnation),
                <const unsigned char*>PyBytes_AS_STRING(client_nonce),
                <const unsigned char*>PyBytes_AS_STRING(host_nonce), out)
    return PyBytes_FromStringAndSize(<char*>out, DDICT_PROOF_BYTES)


def wire_proofs_equal(bytes a not None, bytes b not None):
    """Whether :func:`ddict_proofs_equal` finds two proofs the same."""
    if PyBytes_GET_SIZE(a) != DDICT_PROOF_BYTES or PyBytes_GET_SIZE(b) != DDICT_PROOF_BYTES:
        raise ValueError(f"a proof is {DDICT_PROOF_BYTES} bytes")
    return bool(ddict_proofs_equal(<const unsigned char*>PyBytes_AS_STRING(a),
                                   <const unsigned char*>PyBytes_AS_STRING(b)))


def wire_sha256(bytes data not None, Py_ssize_t chunk=64):
    """SHA-256 of ``data`` by the header's own (fed ``chunk`` bytes at a time)."""
    cdef ddict_sha256 s
    cdef unsigned char out[32]
    cdef Py_ssize_t at = 0, n = PyBytes_GET_SIZE(data)
    ddict_sha256_init(&s)
    while at < n:
        ddict_sha256_update(&s, PyBytes_AS_STRING(data) + at, <size_t>min(chunk, n - at))
        at += chunk
    ddict_sha256_final(&s, out)
    return PyBytes_FromStringAndSize(<char*>out, 32)


def bytes_value_head(uint64_t n):
    """The head of a raw-bytes value of ``n`` bytes, written by
    :func:`ddict_bytes_value_head`."""
    cdef unsigned char head[DDICT_VALUE_HEAD_BYTES]
    ddict_bytes_value_head(head, n)
    return PyBytes_FromStringAndSize(<char*>head, DDICT_VALUE_HEAD_BYTES)


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
