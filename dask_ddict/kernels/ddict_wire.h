/* ddict_wire.h: the key path of dask_ddict in C, for C and C++ clients.
 *
 * One header, no library: what a client needs to route a key and to speak to the host
 * process that serves it, written once.  The compiled kernels (_compiled.pyx, through
 * framing.pxi) include it, so the Python clients and hosts frame, hash and route with
 * these very functions; `dask_ddict.kernels.get_include()` gives its directory, and
 * examples/c_client/wire_client.c is a client that uses nothing else (a put and a get over a
 * host's Unix socket).  tests/test_kernels.py holds the constants to the Python
 * declarations (transport/protocol.py, errors.py, _serialize.py).
 *
 * A key is routed by its canonical bytes (pickle protocol 5 of the key, as
 * `dask_ddict._keys.encode_key` writes it; written here for short str and 32-bit int
 * keys): their 16-byte BLAKE2b digest names the manager (its first 8 bytes,
 * little-endian, modulo the number of managers).  A request is a 64-byte header, the
 * key section (the digest; for a write, then the key's bytes) and the value (a frame:
 * a 16-byte head, then the payload); a reply is a 24-byte header and a payload.  Every
 * field is little-endian whatever the machine.
 *
 * A connection is bound to one dictionary by its handshake: `HELLO` (the magic and the
 * dictionary's 16-byte uid) and a 32-byte nonce.  Over the host's Unix socket (same
 * machine, same user) the host answers one byte, DDICT_HELLO_OK.  Over TCP it answers
 * DDICT_HELLO_PROVE, its incarnation, its nonce and its proof of the dictionary's secret;
 * the client checks that proof (a process that is not the dictionary's host cannot make
 * it) and sends its own, and the host answers DDICT_HELLO_OK or DDICT_HELLO_DENIED
 * (transport/handshake.py).  A proof is HMAC-SHA256 under the secret (the ASCII of its
 * hex string) of the version, the role, the uid, the target (the host's "tcp_host:port"
 * as the layout names it), the incarnation and both nonces, joined by '|': ddict_proof
 * writes it with the SHA-256 below (no crypto library; the nonces come from the
 * caller's system entropy).  TLS needs a TLS library: not here.
 */
#ifndef DDICT_WIRE_H
#define DDICT_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum {
    DDICT_REQUEST_BYTES = 64, /* protocol.REQUEST.size */
    DDICT_REPLY_BYTES = 24,   /* protocol.REPLY.size */
    DDICT_DIGEST_BYTES = 16,  /* _entry.DIGEST */
    DDICT_HELLO_BYTES = 20,   /* protocol.HELLO.size: magic (4), dictionary uid (16) */
    DDICT_UID_BYTES = 16,     /* the dictionary's uid, as HELLO carries it */
    DDICT_NONCE_BYTES = 32,   /* handshake.NONCE */
    DDICT_INCARNATION_BYTES = 16, /* handshake.INCARNATION: the host process's */
    DDICT_PROOF_BYTES = 32,   /* handshake.PROOF: an HMAC-SHA256 */
    DDICT_VALUE_HEAD_BYTES = 16, /* _serialize._HEAD.size: fmt, nbufs, payload length */
    DDICT_KEY_BYTES_MOST = 270,  /* a short str key's canonical bytes, at most */
};

/* protocol.HELLO_MAGIC, the host's one-byte answers (protocol.Hello), and the version
 * that a handshake's proofs are bound to (handshake.VERSION). */
#define DDICT_HELLO_MAGIC "DDK5"
#define DDICT_HANDSHAKE_VERSION "ddict-key-path/3"
enum {
    DDICT_HELLO_OK = 1,
    DDICT_HELLO_CLOSED = 2,  /* the dictionary was destroyed */
    DDICT_HELLO_UNKNOWN = 3, /* this host serves no such dictionary */
    DDICT_HELLO_DENIED = 4,  /* the client's proof was wrong */
    DDICT_HELLO_PROVE = 5,   /* TCP: the host's proof follows */
};

/* The data plane's operations (protocol.Op) and answers (errors.Status). */
enum {
    DDICT_OP_PUT = 1,
    DDICT_OP_GET = 2,
    DDICT_OP_CONTAINS = 3,
    DDICT_OP_POP = 4,
    DDICT_OP_FETCH_ADD = 8,
};
enum {
    DDICT_STATUS_OK = 0,
    DDICT_STATUS_KEY_NOT_FOUND = 2,
    DDICT_STATUS_TIMEOUT = 9,
};
/* A value frame's format byte (_serialize.FMT_*): a pickle (its out-of-band buffers
 * after it), a raw buffer, raw bytes (the payload is the value). */
enum { DDICT_FMT_PICKLE = 0, DDICT_FMT_RAW = 1, DDICT_FMT_BYTES = 2 };

/* -- little-endian fields ------------------------------------------------------------ */

static inline uint32_t ddict_le32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

static inline uint64_t ddict_le64(const unsigned char *p) {
    uint64_t v = 0;
    int i;
    for (i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static inline void ddict_put_le32(void *to, uint32_t v) {
    unsigned char *p = (unsigned char *)to;
    p[0] = (unsigned char)(v & 0xFF);
    p[1] = (unsigned char)((v >> 8) & 0xFF);
    p[2] = (unsigned char)((v >> 16) & 0xFF);
    p[3] = (unsigned char)((v >> 24) & 0xFF);
}

static inline void ddict_put_le64(void *to, uint64_t v) {
    unsigned char *p = (unsigned char *)to;
    int i;
    for (i = 0; i < 8; i++) {
        p[i] = (unsigned char)(v & 0xFF);
        v >>= 8;
    }
}

/* -- requests and replies ------------------------------------------------------------ */

typedef struct {
    /* REQUEST: op, flags, term, klen, manager, tag, chkpt, arg, client, timeout, vlen, rid */
    unsigned int op;    /* u8: a DDICT_OP_* */
    unsigned int flags; /* u8 */
    unsigned int term;  /* u16: the manager's term as the client knows it (0: none) */
    uint32_t klen;      /* the key section's bytes: digest (16), then the key's bytes */
    uint32_t manager;
    uint32_t tag;       /* the client's number for the request, which its reply repeats */
    int64_t chkpt;
    int64_t arg;
    uint64_t client;
    double timeout;     /* seconds; negative: none */
    uint64_t vlen;      /* the value's bytes */
    uint64_t rid;       /* a request id (0: none): applied at most once */
} ddict_request_head;

typedef struct {
    /* REPLY: status, (3 bytes of padding), tag, ival, payload length */
    unsigned int status; /* u8: a DDICT_STATUS_* (errors.Status) */
    uint32_t tag;
    int64_t ival;
    uint64_t plen;
} ddict_reply_head;

/* The header of request `h` into p[0:DDICT_REQUEST_BYTES]. */
static inline void ddict_write_request(unsigned char *p, const ddict_request_head *h) {
    uint64_t bits;
    p[0] = (unsigned char)h->op;
    p[1] = (unsigned char)h->flags;
    p[2] = (unsigned char)(h->term & 0xFF);
    p[3] = (unsigned char)((h->term >> 8) & 0xFF);
    ddict_put_le32(p + 4, h->klen);
    ddict_put_le32(p + 8, h->manager);
    ddict_put_le32(p + 12, h->tag);
    ddict_put_le64(p + 16, (uint64_t)h->chkpt);
    ddict_put_le64(p + 24, (uint64_t)h->arg);
    ddict_put_le64(p + 32, h->client);
    memcpy(&bits, &h->timeout, 8);
    ddict_put_le64(p + 40, bits);
    ddict_put_le64(p + 48, h->vlen);
    ddict_put_le64(p + 56, h->rid);
}

/* The request header at p[0:DDICT_REQUEST_BYTES] into `h`. */
static inline void ddict_read_request(const unsigned char *p, ddict_request_head *h) {
    uint64_t bits;
    h->op = p[0];
    h->flags = p[1];
    h->term = p[2] | ((unsigned int)p[3] << 8);
    h->klen = ddict_le32(p + 4);
    h->manager = ddict_le32(p + 8);
    h->tag = ddict_le32(p + 12);
    h->chkpt = (int64_t)ddict_le64(p + 16);
    h->arg = (int64_t)ddict_le64(p + 24);
    h->client = ddict_le64(p + 32);
    bits = ddict_le64(p + 40);
    memcpy(&h->timeout, &bits, 8);
    h->vlen = ddict_le64(p + 48);
    h->rid = ddict_le64(p + 56);
}

/* The header of reply `h` into p[0:DDICT_REPLY_BYTES]. */
static inline void ddict_write_reply(unsigned char *p, const ddict_reply_head *h) {
    p[0] = (unsigned char)h->status;
    p[1] = p[2] = p[3] = 0;
    ddict_put_le32(p + 4, h->tag);
    ddict_put_le64(p + 8, (uint64_t)h->ival);
    ddict_put_le64(p + 16, h->plen);
}

/* The reply header at p[0:DDICT_REPLY_BYTES] into `h`. */
static inline void ddict_read_reply(const unsigned char *p, ddict_reply_head *h) {
    h->status = p[0];
    h->tag = ddict_le32(p + 4);
    h->ival = (int64_t)ddict_le64(p + 8);
    h->plen = ddict_le64(p + 16);
}

/* The 16-byte head of a value frame of format `fmt` (a DDICT_FMT_*) whose payload of `n`
 * bytes follows it, with no out-of-band buffers (_serialize._HEAD: fmt, 3 bytes of
 * padding, nbufs, the payload's length). */
static inline void ddict_value_head(unsigned char *head, unsigned int fmt, uint64_t n) {
    memset(head, 0, DDICT_VALUE_HEAD_BYTES);
    head[0] = (unsigned char)fmt;
    ddict_put_le64(head + 8, n);
}

/* The head of a raw-bytes value of `n` bytes (what dumps_value frames `bytes` with). */
static inline void ddict_bytes_value_head(unsigned char *head, uint64_t n) {
    ddict_value_head(head, DDICT_FMT_BYTES, n);
}

/* -- keys: canonical bytes, digest, manager ----------------------------------------- */

/* The canonical bytes of a str key whose UTF-8 is `utf8[0:n]` (n < 256) into `out`
 * (room for n + 16 bytes), as pickle.dumps(key, 5) writes them:
 *   PROTO 5 | FRAME <u64 n + 4> | SHORT_BINUNICODE <u8 n> utf-8 | MEMOIZE | STOP
 * Returns their length, or 0 for a longer key (its bytes are pickle's to write). */
static inline size_t ddict_str_key(const char *utf8, size_t n, unsigned char *out) {
    if (n >= 256) return 0;
    out[0] = 0x80;
    out[1] = 5;
    out[2] = 0x95;
    ddict_put_le64(out + 3, (uint64_t)(n + 4));
    out[11] = 0x8c;
    out[12] = (unsigned char)n;
    memcpy(out + 13, utf8, n);
    out[13 + n] = 0x94;
    out[14 + n] = 0x2e;
    return n + 15;
}

/* The canonical bytes of an int key within 32 bits into `out` (room for 17 bytes):
 *   0 <= v < 256:  PROTO 5 | BININT1 <u8> | STOP
 *   else:          PROTO 5 | FRAME <u64> | BININT2 <u16> or BININT <i32> | STOP
 * Returns their length, or 0 for a key outside 32 bits (pickle's to write). */
static inline size_t ddict_int_key(int64_t v, unsigned char *out) {
    size_t n;
    uint32_t u;
    if (v < -2147483648LL || v > 2147483647LL) return 0;
    if (v >= 0 && v < 256) {
        out[0] = 0x80;
        out[1] = 5;
        out[2] = 0x4b;
        out[3] = (unsigned char)v;
        out[4] = 0x2e;
        return 5;
    }
    n = (v >= 0 && v < 65536) ? 2 : 4;
    out[0] = 0x80;
    out[1] = 5;
    out[2] = 0x95;
    ddict_put_le64(out + 3, (uint64_t)(n + 2));
    out[11] = n == 2 ? 0x4d : 0x4a;
    u = (uint32_t)(int64_t)v;
    out[12] = (unsigned char)(u & 0xFF);
    out[13] = (unsigned char)((u >> 8) & 0xFF);
    if (n == 4) {
        out[14] = (unsigned char)((u >> 16) & 0xFF);
        out[15] = (unsigned char)((u >> 24) & 0xFF);
    }
    out[12 + n] = 0x2e;
    return 13 + n;
}

/* BLAKE2b (RFC 7693) with a 16-byte digest and no key: a key's digest, as
 * hashlib.blake2b(key, digest_size=16) makes it. */
static const uint64_t ddict_blake2b_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

/* RFC 7693's ten rows of SIGMA, the first two again for rounds 10 and 11 (indexing
 * the rows by r % 10 instead cost 27 ns per key). */
static const unsigned char ddict_blake2b_sigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t ddict_rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

#define DDICT_BLAKE2B_MIX(a, b, c, d, x, y)          \
    do {                                             \
        v[a] = v[a] + v[b] + (x);                    \
        v[d] = ddict_rotr64(v[d] ^ v[a], 32);        \
        v[c] = v[c] + v[d];                          \
        v[b] = ddict_rotr64(v[b] ^ v[c], 24);        \
        v[a] = v[a] + v[b] + (y);                    \
        v[d] = ddict_rotr64(v[d] ^ v[a], 16);        \
        v[c] = v[c] + v[d];                          \
        v[b] = ddict_rotr64(v[b] ^ v[c], 63);        \
    } while (0)

static inline void ddict_blake2b_compress(uint64_t *h, const unsigned char *block, uint64_t t,
                                          int last) {
    uint64_t v[16], m[16];
    int i, r;
    const unsigned char *s;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(m, block, 128); /* (the words are the bytes in place) */
#else
    for (i = 0; i < 16; i++) m[i] = ddict_le64(block + 8 * i);
#endif
    for (i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = ddict_blake2b_iv[i];
    }
    v[12] ^= t; /* (the byte counter's high word stays 0: keys are far shorter) */
    if (last) v[14] = ~v[14];
    for (r = 0; r < 12; r++) {
        s = ddict_blake2b_sigma[r];
        DDICT_BLAKE2B_MIX(0, 4, 8, 12, m[s[0]], m[s[1]]);
        DDICT_BLAKE2B_MIX(1, 5, 9, 13, m[s[2]], m[s[3]]);
        DDICT_BLAKE2B_MIX(2, 6, 10, 14, m[s[4]], m[s[5]]);
        DDICT_BLAKE2B_MIX(3, 7, 11, 15, m[s[6]], m[s[7]]);
        DDICT_BLAKE2B_MIX(0, 5, 10, 15, m[s[8]], m[s[9]]);
        DDICT_BLAKE2B_MIX(1, 6, 11, 12, m[s[10]], m[s[11]]);
        DDICT_BLAKE2B_MIX(2, 7, 8, 13, m[s[12]], m[s[13]]);
        DDICT_BLAKE2B_MIX(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* The 16-byte digest of a key's canonical bytes key[0:n] into `digest`. */
static inline void ddict_digest(const unsigned char *key, size_t n, unsigned char *digest) {
    uint64_t h[8];
    unsigned char last[128];
    uint64_t t = 0;
    int i;
    for (i = 0; i < 8; i++) h[i] = ddict_blake2b_iv[i];
    h[0] ^= 0x01010000ULL ^ DDICT_DIGEST_BYTES; /* fanout 1, depth 1, a 16-byte digest */
    while (n > 128) {
        t += 128;
        ddict_blake2b_compress(h, key, t, 0);
        key += 128;
        n -= 128;
    }
    memset(last, 0, 128);
    memcpy(last, key, n);
    ddict_blake2b_compress(h, last, t + (uint64_t)n, 1);
    for (i = 0; i < 2; i++) ddict_put_le64(digest + 8 * i, h[i]);
}

/* The manager of a key with `digest` among `managers` (at least 1). */
static inline uint64_t ddict_manager_of(const unsigned char *digest, uint64_t managers) {
    return ddict_le64(digest) % managers;
}

/* -- the TCP handshake's proofs: SHA-256 (FIPS 180-4), HMAC (RFC 2104) -------------- */

typedef struct {
    uint32_t h[8];
    uint64_t bytes;          /* hashed so far */
    unsigned char block[64]; /* the open block, `fill` bytes of it */
    size_t fill;
} ddict_sha256;

static const uint32_t ddict_sha256_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
};

static inline uint32_t ddict_rotr32(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static inline void ddict_sha256_compress(uint32_t *h, const unsigned char *block) {
    uint32_t w[64], a, b, c, d, e, f, g, k, t1, t2;
    int i;
    for (i = 0; i < 16; i++)
        w[i] = ((uint32_t)block[4 * i] << 24) | ((uint32_t)block[4 * i + 1] << 16) |
               ((uint32_t)block[4 * i + 2] << 8) | (uint32_t)block[4 * i + 3];
    for (i = 16; i < 64; i++)
        w[i] = w[i - 16] +
               (ddict_rotr32(w[i - 15], 7) ^ ddict_rotr32(w[i - 15], 18) ^ (w[i - 15] >> 3)) +
               w[i - 7] +
               (ddict_rotr32(w[i - 2], 17) ^ ddict_rotr32(w[i - 2], 19) ^ (w[i - 2] >> 10));
    a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (i = 0; i < 64; i++) {
        t1 = k + (ddict_rotr32(e, 6) ^ ddict_rotr32(e, 11) ^ ddict_rotr32(e, 25)) +
             ((e & f) ^ (~e & g)) + ddict_sha256_k[i] + w[i];
        t2 = (ddict_rotr32(a, 2) ^ ddict_rotr32(a, 13) ^ ddict_rotr32(a, 22)) +
             ((a & b) ^ (a & c) ^ (b & c));
        k = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
}

static inline void ddict_sha256_init(ddict_sha256 *s) {
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, iv, sizeof iv);
    s->bytes = 0;
    s->fill = 0;
}

static inline void ddict_sha256_update(ddict_sha256 *s, const void *data, size_t n) {
    const unsigned char *p = (const unsigned char *)data;
    size_t take;
    s->bytes += n;
    while (n) {
        take = 64 - s->fill < n ? 64 - s->fill : n;
        memcpy(s->block + s->fill, p, take);
        s->fill += take, p += take, n -= take;
        if (s->fill == 64) {
            ddict_sha256_compress(s->h, s->block);
            s->fill = 0;
        }
    }
}

/* The digest of what was hashed into `s` (32 bytes into `out`); `s` is spent. */
static inline void ddict_sha256_final(ddict_sha256 *s, unsigned char *out) {
    uint64_t bits = s->bytes * 8;
    int i;
    s->block[s->fill++] = 0x80;
    if (s->fill > 56) {
        memset(s->block + s->fill, 0, 64 - s->fill);
        ddict_sha256_compress(s->h, s->block);
        s->fill = 0;
    }
    memset(s->block + s->fill, 0, 56 - s->fill);
    for (i = 0; i < 8; i++) s->block[63 - i] = (unsigned char)(bits >> (8 * i));
    ddict_sha256_compress(s->h, s->block);
    for (i = 0; i < 8; i++) {
        out[4 * i] = (unsigned char)(s->h[i] >> 24);
        out[4 * i + 1] = (unsigned char)(s->h[i] >> 16);
        out[4 * i + 2] = (unsigned char)(s->h[i] >> 8);
        out[4 * i + 3] = (unsigned char)s->h[i];
    }
}

/* HMAC-SHA256 under `key[0:klen]`: `inner` is started (hash the message into it), `outer`
 * holds the outer pad until ddict_hmac_sha256_final. */
static inline void ddict_hmac_sha256_init(ddict_sha256 *inner, ddict_sha256 *outer,
                                          const void *key, size_t klen) {
    unsigned char k[64], pad[64];
    int i;
    memset(k, 0, sizeof k);
    if (klen > 64) {
        ddict_sha256_init(inner);
        ddict_sha256_update(inner, key, klen);
        ddict_sha256_final(inner, k);
    } else if (klen) {
        memcpy(k, key, klen);
    }
    for (i = 0; i < 64; i++) pad[i] = k[i] ^ 0x36;
    ddict_sha256_init(inner);
    ddict_sha256_update(inner, pad, 64);
    for (i = 0; i < 64; i++) pad[i] = k[i] ^ 0x5c;
    ddict_sha256_init(outer);
    ddict_sha256_update(outer, pad, 64);
}

static inline void ddict_hmac_sha256_final(ddict_sha256 *inner, ddict_sha256 *outer,
                                           unsigned char *out) {
    unsigned char mid[32];
    ddict_sha256_final(inner, mid);
    ddict_sha256_update(outer, mid, 32);
    ddict_sha256_final(outer, out);
}

/* One side's proof of the dictionary's secret for this connection (handshake.proof):
 * `role` is "host" (the proof a client checks) or "client" (the one it sends); `secret`
 * is the dictionary's secret as its layout spells it (a hex string: its ASCII is the
 * key), `target` the host's "tcp_host:tcp_port" as the layout names it (where the
 * client dialled).  32 bytes into `out`. */
static inline void ddict_proof(const char *secret, size_t slen, const char *role,
                               const unsigned char *uid, const char *target, size_t tlen,
                               const unsigned char *incarnation,
                               const unsigned char *client_nonce,
                               const unsigned char *host_nonce, unsigned char *out) {
    ddict_sha256 inner, outer;
    ddict_hmac_sha256_init(&inner, &outer, secret, slen);
    ddict_sha256_update(&inner, DDICT_HANDSHAKE_VERSION, strlen(DDICT_HANDSHAKE_VERSION));
    ddict_sha256_update(&inner, "|", 1);
    ddict_sha256_update(&inner, role, strlen(role));
    ddict_sha256_update(&inner, "|", 1);
    ddict_sha256_update(&inner, uid, DDICT_UID_BYTES);
    ddict_sha256_update(&inner, "|", 1);
    ddict_sha256_update(&inner, target, tlen);
    ddict_sha256_update(&inner, "|", 1);
    ddict_sha256_update(&inner, incarnation, DDICT_INCARNATION_BYTES);
    ddict_sha256_update(&inner, "|", 1);
    ddict_sha256_update(&inner, client_nonce, DDICT_NONCE_BYTES);
    ddict_sha256_update(&inner, "|", 1);
    ddict_sha256_update(&inner, host_nonce, DDICT_NONCE_BYTES);
    ddict_hmac_sha256_final(&inner, &outer, out);
}

/* Whether two proofs are the same, in a time that does not depend on where they differ
 * (handshake.matches: how long a check takes tells a stranger nothing). */
static inline int ddict_proofs_equal(const unsigned char *a, const unsigned char *b) {
    unsigned char diff = 0;
    int i;
    for (i = 0; i < DDICT_PROOF_BYTES; i++) diff |= (unsigned char)(a[i] ^ b[i]);
    return diff == 0;
}

#endif /* DDICT_WIRE_H */
