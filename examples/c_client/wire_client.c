/* A DDict client in C on ddict_wire.h alone: routes keys, puts and gets raw-bytes values
 * over a host process's Unix socket, or over TCP with the handshake's proofs.
 * tests/test_wire_header.py builds and runs it.
 *
 *   wire_client route MANAGERS KEY...
 *       each key's manager, digest and canonical bytes (hex), a line each
 *   wire_client put HOST UID_HEX MANAGERS KEY VALUE [KEY VALUE ...]
 *   wire_client get HOST UID_HEX MANAGERS KEY...
 *       one connection, one request per key; a line each: the status, then for a get
 *       the value (a raw-bytes value's text, "-" when absent)
 *
 * HOST is the host process's Unix socket path, or "tcp:HOST:PORT" (its tcp_host and
 * tcp_port as the layout names them); over TCP the dictionary's secret is read from the
 * environment variable DDICT_SECRET (never from the command line, which other users of
 * the machine can read).  A KEY is "s:text" (a str key) or "i:number" (an int key of 32
 * bits).  Exit status 3: the host refused, did not prove that it is the dictionary's,
 * or (a Unix socket) runs as another user.
 *
 * Build it against the installed package's header:
 *   cc -std=c99 -O2 -I"$(python -c 'import dask_ddict.kernels as k; print(k.get_include())')" \
 *      wire_client.c -o wire_client
 * and give it what a handle's layout says (d._core.layout: uid, secret, num_managers, and
 * the managers' uds_path or tcp_host and tcp_port); over the Unix socket, from a process
 * on the managers' machine, as the same user.
 */
#define _GNU_SOURCE /* (getaddrinfo under -std=c99; struct ucred for SO_PEERCRED) */

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
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

/* The most a reply's payload may hold here: its length comes from the peer. */
#define MOST_PAYLOAD ((uint64_t)1 << 30)

static void send_all(int fd, const void *buf, size_t n) {
    const unsigned char *p = buf;
    while (n > 0) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL); /* (a closed peer: an error, no SIGPIPE) */
        if (k <= 0) die("send");
        p += k;
        n -= (size_t)k;
    }
}

static void recv_all(int fd, void *buf, size_t n) {
    unsigned char *p = buf;
    while (n > 0) {
        ssize_t k = recv(fd, p, n, 0);
        if (k == 0) {
            fprintf(stderr, "recv: the host closed the connection\n");
            exit(3);
        }
        if (k < 0) die("recv");
        p += k;
        n -= (size_t)k;
    }
}

static void refused(const char *why, int answer) {
    fprintf(stderr, "%s (%d)\n", why, answer);
    exit(3);
}

/* `n` bytes from the system's entropy into `out`. */
static void entropy(unsigned char *out, size_t n) {
    FILE *f = fopen("/dev/urandom", "rb");
    if (!f || fread(out, 1, n, f) != n) die("/dev/urandom");
    fclose(f);
}

/* A Unix socket connected to `path`. */
static int unix_socket(const char *path) {
    struct sockaddr_un addr;
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    size_t n = strlen(path);
    if (fd < 0) die("socket");
    if (n >= sizeof addr.sun_path) {
        fprintf(stderr, "a socket path of %zu bytes is too long\n", n);
        exit(2);
    }
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, path, n);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) die("connect");
    return fd;
}

/* Refuse a Unix socket whose host process runs as another user (SO_PEERCRED), as the
 * Python client does: the socket's private directory keeps other users out, but a
 * path given on the command line may lie anywhere, and a value put there would go to
 * whoever listens. */
static void check_peer(int fd, const char *path) {
    struct ucred cred;
    socklen_t n = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &n) < 0) die("SO_PEERCRED");
    if (cred.uid != getuid()) {
        fprintf(stderr, "the host process at %s runs as another user (uid %u)\n", path,
                (unsigned)cred.uid);
        exit(3);
    }
}

/* A TCP socket connected to `target` ("host:port"), without Nagle's delay. */
static int tcp_socket(const char *target) {
    struct addrinfo hints, *found, *a;
    char host[256];
    const char *colon = strrchr(target, ':');
    int fd = -1, one = 1;
    if (!colon || (size_t)(colon - target) >= sizeof host) {
        fprintf(stderr, "not host:port: %s\n", target);
        exit(2);
    }
    memcpy(host, target, (size_t)(colon - target));
    host[colon - target] = 0;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, colon + 1, &hints, &found) != 0) {
        fprintf(stderr, "cannot resolve %s\n", target);
        exit(2);
    }
    for (a = found; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd >= 0 && connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
        if (fd >= 0) close(fd);
        fd = -1;
    }
    freeaddrinfo(found);
    if (fd < 0) die("connect");
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

/* A connection to the host at `where`, bound to dictionary `uid` by its handshake: over
 * TCP, the host's proof of `secret` checked before this client sends its own. */
static int connect_to(const char *where, const unsigned char *uid, const char *secret) {
    unsigned char hello[DDICT_HELLO_BYTES + DDICT_NONCE_BYTES], answer;
    unsigned char got[DDICT_INCARNATION_BYTES + DDICT_NONCE_BYTES + DDICT_PROOF_BYTES];
    unsigned char proof[DDICT_PROOF_BYTES];
    const unsigned char *incarnation = got, *host_nonce = got + DDICT_INCARNATION_BYTES;
    const unsigned char *client_nonce = hello + DDICT_HELLO_BYTES;
    const char *target = strncmp(where, "tcp:", 4) == 0 ? where + 4 : NULL;
    int fd = target ? tcp_socket(target) : unix_socket(where);
    if (!target) check_peer(fd, where); /* (before anything is sent) */
    memcpy(hello, DDICT_HELLO_MAGIC, 4);
    memcpy(hello + 4, uid, DDICT_UID_BYTES);
    entropy(hello + DDICT_HELLO_BYTES, DDICT_NONCE_BYTES);
    send_all(fd, hello, sizeof hello);
    recv_all(fd, &answer, 1);
    if (target && answer != DDICT_HELLO_PROVE)  /* (a host proves the secret first) */
        refused("over TCP the host answered without proving that it serves the dictionary",
                answer);
    if (target) {
        if (!secret) {
            fprintf(stderr, "over TCP the dictionary's secret comes from DDICT_SECRET\n");
            exit(2);
        }
        recv_all(fd, got, sizeof got);
        ddict_proof(secret, strlen(secret), "host", uid, target, strlen(target), incarnation,
                    client_nonce, host_nonce, proof);
        if (!ddict_proofs_equal(proof, got + DDICT_INCARNATION_BYTES + DDICT_NONCE_BYTES)) {
            fprintf(stderr, "the process at %s did not prove that it serves the dictionary "
                    "(a wrong secret, or not its host process)\n", target);
            exit(3);
        }
        ddict_proof(secret, strlen(secret), "client", uid, target, strlen(target), incarnation,
                    client_nonce, host_nonce, proof);
        send_all(fd, proof, sizeof proof);
        recv_all(fd, &answer, 1);
    }
    if (answer != DDICT_HELLO_OK) refused("the host answered the handshake with", answer);
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
    if (r.plen > MOST_PAYLOAD) {
        fprintf(stderr, "a reply of %llu bytes: more than this client takes\n",
                (unsigned long long)r.plen);
        exit(3);
    }
    *payload = malloc((size_t)r.plen + 1);
    if (!*payload) die("malloc");
    recv_all(fd, *payload, r.plen);
    return r;
}

int main(int argc, char **argv) {
    unsigned char kb[DDICT_KEY_BYTES_MOST], digest[DDICT_DIGEST_BYTES], uid[DDICT_UID_BYTES];
    uint64_t managers;
    int i, fd, put;
    if (argc >= 3 && strcmp(argv[1], "route") == 0) {
        managers = strtoull(argv[2], NULL, 10);
        if (managers == 0) return 2;
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
    for (i = 0; i < DDICT_UID_BYTES; i++) {
        if (strlen(argv[3]) != 2 * DDICT_UID_BYTES ||
            sscanf(argv[3] + 2 * i, "%2hhx", &uid[i]) != 1) {
            fprintf(stderr, "a uid is %d hex digits\n", 2 * DDICT_UID_BYTES);
            return 2;
        }
    }
    managers = strtoull(argv[4], NULL, 10);
    if (managers == 0) {
        fprintf(stderr, "a dictionary has at least one manager\n");
        return 2;
    }
    fd = connect_to(argv[2], uid, getenv("DDICT_SECRET"));
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
