/* A DDict client in C on ddict_wire.h alone: routes keys, puts and gets raw-bytes values
 * over a host process's Unix socket.  tests/test_wire_header.py builds and runs it.
 *
 *   wire_client route MANAGERS KEY...
 *       each key's manager, digest and canonical bytes (hex), a line each
 *   wire_client put UDS_PATH UID_HEX MANAGERS KEY VALUE [KEY VALUE ...]
 *   wire_client get UDS_PATH UID_HEX MANAGERS KEY...
 *       one connection, one request per key; a line each: the status, then for a get
 *       the value (a raw-bytes value's text, "-" when absent)
 *
 * A KEY is "s:text" (a str key) or "i:number" (an int key of 32 bits).
 *
 * Build it against the installed package's header:
 *   cc -std=c99 -O2 -I"$(python -c 'import dask_ddict.kernels as k; print(k.get_include())')" \
 *      wire_client.c -o wire_client
 * and give it what a handle's layout says (d._core.layout: uid, num_managers, and the
 * managers' uds_path), from a process on the managers' machine, as the same user.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "ddict_wire.h"

static void die(const char *what) {
    perror(what);
    exit(2);
}

/* A key's canonical bytes into `out`; their length. */
static size_t key_bytes(const char *arg, unsigned char *out) {
    size_t n = 0;
    char *end = NULL;
    long long v;
    if (strncmp(arg, "s:", 2) == 0) n = ddict_str_key(arg + 2, strlen(arg + 2), out);
    if (strncmp(arg, "i:", 2) == 0) {
        v = strtoll(arg + 2, &end, 10);
        if (end != arg + 2 && *end == 0) n = ddict_int_key(v, out);
    }
    if (n == 0) {
        fprintf(stderr, "not a short str or 32-bit int key: %s\n", arg);
        exit(2);
    }
    return n;
}

static void hex(const unsigned char *p, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) printf("%02x", p[i]);
}

static void send_all(int fd, const void *buf, size_t n) {
    const unsigned char *p = buf;
    while (n > 0) {
        ssize_t k = send(fd, p, n, 0);
        if (k <= 0) die("send");
        p += k;
        n -= (size_t)k;
    }
}

static void recv_all(int fd, void *buf, size_t n) {
    unsigned char *p = buf;
    while (n > 0) {
        ssize_t k = recv(fd, p, n, 0);
        if (k <= 0) die("recv");
        p += k;
        n -= (size_t)k;
    }
}

/* A connection to the host at `path`, bound to dictionary `uid` by its handshake. */
static int connect_to(const char *path, const unsigned char *uid) {
    struct sockaddr_un addr;
    unsigned char hello[DDICT_HELLO_BYTES + DDICT_NONCE_BYTES], answer;
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0) die("socket");
    size_t n = strlen(path);
    if (n >= sizeof addr.sun_path) {
        fprintf(stderr, "a socket path of %zu bytes is too long\n", n);
        exit(2);
    }
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, path, n);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) die("connect");
    memcpy(hello, DDICT_HELLO_MAGIC, 4);
    memcpy(hello + 4, uid, 16);
    memset(hello + DDICT_HELLO_BYTES, 0x5a, DDICT_NONCE_BYTES); /* (unused on a Unix socket) */
    send_all(fd, hello, sizeof hello);
    recv_all(fd, &answer, 1);
    if (answer != DDICT_HELLO_OK) {
        fprintf(stderr, "the host answered HELLO with %d\n", answer);
        exit(3);
    }
    return fd;
}

/* One request: the header, the digest, `key` (a write's), the value; its reply's
 * header, and its payload (malloc'ed) in `payload`. */
static ddict_reply_head exchange(int fd, unsigned op, uint32_t manager, uint32_t tag,
                                 const unsigned char *digest, const unsigned char *key,
                                 size_t klen, const char *value, unsigned char **payload) {
    unsigned char head[DDICT_REQUEST_BYTES], vhead[DDICT_VALUE_HEAD_BYTES];
    unsigned char rhead[DDICT_REPLY_BYTES];
    ddict_request_head h;
    ddict_reply_head r;
    size_t vlen = value ? strlen(value) : 0;
    memset(&h, 0, sizeof h);
    h.op = op;
    h.klen = (uint32_t)(DDICT_DIGEST_BYTES + klen);
    h.manager = manager;
    h.tag = tag;
    h.timeout = -1.0;
    h.vlen = value ? DDICT_VALUE_HEAD_BYTES + vlen : 0;
    ddict_write_request(head, &h);
    send_all(fd, head, sizeof head);
    send_all(fd, digest, DDICT_DIGEST_BYTES);
    if (klen) send_all(fd, key, klen);
    if (value) {
        ddict_bytes_value_head(vhead, vlen);
        send_all(fd, vhead, sizeof vhead);
        send_all(fd, value, vlen);
    }
    recv_all(fd, rhead, sizeof rhead);
    ddict_read_reply(rhead, &r);
    if (r.tag != tag) {
        fprintf(stderr, "a reply tagged %u, not %u\n", r.tag, tag);
        exit(3);
    }
    *payload = malloc(r.plen + 1);
    if (!*payload) die("malloc");
    recv_all(fd, *payload, r.plen);
    return r;
}

int main(int argc, char **argv) {
    unsigned char kb[DDICT_KEY_BYTES_MOST], digest[DDICT_DIGEST_BYTES], uid[16];
    uint64_t managers;
    int i, fd, put;
    if (argc >= 3 && strcmp(argv[1], "route") == 0) {
        managers = strtoull(argv[2], NULL, 10);
        for (i = 3; i < argc; i++) {
            size_t n = key_bytes(argv[i], kb);
            ddict_digest(kb, n, digest);
            printf("%llu ", (unsigned long long)ddict_manager_of(digest, managers));
            hex(digest, sizeof digest);
            printf(" ");
            hex(kb, n);
            printf("\n");
        }
        return 0;
    }
    if (argc < 6 || (strcmp(argv[1], "put") && strcmp(argv[1], "get"))) {
        fprintf(stderr, "usage: see the top of wire_client.c\n");
        return 2;
    }
    put = strcmp(argv[1], "put") == 0;
    for (i = 0; i < 16; i++) sscanf(argv[3] + 2 * i, "%2hhx", &uid[i]);
    managers = strtoull(argv[4], NULL, 10);
    fd = connect_to(argv[2], uid);
    for (i = 5; i < argc; i += put ? 2 : 1) {
        unsigned char *payload;
        size_t n = key_bytes(argv[i], kb);
        uint32_t manager;
        ddict_reply_head r;
        ddict_digest(kb, n, digest);
        manager = (uint32_t)ddict_manager_of(digest, managers);
        if (put) {
            if (i + 1 >= argc) return 2;
            r = exchange(fd, DDICT_OP_PUT, manager, (uint32_t)i, digest, kb, n, argv[i + 1],
                         &payload);
            printf("%u\n", r.status);
        } else {
            r = exchange(fd, DDICT_OP_GET, manager, (uint32_t)i, digest, NULL, 0, NULL, &payload);
            printf("%u ", r.status);
            if (r.status == DDICT_STATUS_OK && r.plen >= DDICT_VALUE_HEAD_BYTES &&
                payload[0] == DDICT_FMT_BYTES) {
                payload[r.plen] = 0;
                printf("%s\n", (char *)payload + DDICT_VALUE_HEAD_BYTES);
            } else {
                printf("-\n");
            }
        }
        free(payload);
    }
    close(fd);
    return 0;
}
