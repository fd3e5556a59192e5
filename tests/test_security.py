"""The key path under attack: each attack found on the old handshake, replayed.

A dedicated cluster (two workers, so two host processes) with TCP forced on,
a 1 s handshake timeout and at most 40 connections per host process.  Attacks
talk raw sockets to loopback addresses only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import secrets
import socket
import stat
import struct
import threading
import time

import dask.config
import numpy as np
import psutil
import pytest
from distributed import Client

from dask_ddict import DDict, DDictFullError, DDictManagerUnavailableError
from dask_ddict.client.core import HandleCore
from dask_ddict.errors import Status
from dask_ddict.transport import handshake, sockets
from dask_ddict.transport.protocol import HELLO, HELLO_MAGIC, REP, REQ, Hello, Op
from tests.support.cluster import local_cluster
from tests.support.one_client import OneClient

HANDSHAKE_TIMEOUT = 1.0
MAX_CONNECTIONS = 40


@pytest.fixture(scope="module")
def guarded():
    settings = {
        "ddict.local-transport": False,  # every client connection is TCP, as across hosts
        "ddict.transport.handshake-timeout": f"{HANDSHAKE_TIMEOUT}s",
        "ddict.host.max-connections": MAX_CONNECTIONS,
    }
    with (
        dask.config.set(settings),
        local_cluster(2) as cl,
        Client(cl) as c,
    ):
        d = DDict(total_mem="32 MiB", client=c, lifetime="cluster")
        try:
            yield c, d
        finally:
            d.destroy()


def _host_pid(d: DDict, mid: int) -> int:
    return d.manager(mid).stats[0].pid


def _raw(info) -> socket.socket:  # noqa: ANN001
    return socket.create_connection((info.tcp_host, info.tcp_port), timeout=10)


def _target(info) -> str:  # noqa: ANN001
    return f"{info.tcp_host}:{info.tcp_port}"


def _handshake(sock: socket.socket, layout, target: str):  # noqa: ANN001, ANN202
    """A client's half by hand: returns the host's answer and what was proven."""
    uid, secret = bytes.fromhex(layout.uid), layout.secret.encode()
    nonce = secrets.token_bytes(handshake.NONCE)
    sock.sendall(HELLO.pack(HELLO_MAGIC, uid) + nonce)
    assert sockets.recv_exact(sock, 1)[0] == Hello.PROVE
    got = sockets.recv_exact(sock, 16 + 32 + 32)
    incarnation, host_nonce, host_proof = got[:16], got[16:48], got[48:]
    return uid, secret, incarnation, nonce, host_nonce, host_proof


def _with_port(d: DDict, client: Client, mid: int, port: int) -> DDict:
    """A handle whose layout sends manager ``mid``'s traffic to ``port`` (a squatter)."""
    lay = d._core.layout
    managers = tuple(
        dataclasses.replace(m, tcp_port=port) if m.manager_id == mid else m for m in lay.managers
    )
    core = HandleCore(dataclasses.replace(lay, managers=managers), client)
    return DDict._from_core(core, creator=False, chkpt=0, timeout=5)


def squat(relay_to: tuple[str, int] | None = None, answer: bytes | None = None) -> OneClient:
    """A process that took over a port: relays its client to ``relay_to``, or answers its
    HELLO with ``answer`` (default: PROVE, and a made-up proof), and records what it is
    sent."""

    def behave(conn: socket.socket, host: OneClient) -> None:
        upstream = socket.create_connection(relay_to) if relay_to else None
        if upstream is not None:
            threading.Thread(target=_pump, args=(upstream, conn), daemon=True).start()
        try:
            while data := conn.recv(65536):
                host.received += data
                if upstream is not None:
                    upstream.sendall(data)
                elif len(host.received) == HELLO.size + handshake.NONCE:
                    # A made-up proof: it does not know the secret.
                    conn.sendall(answer or bytes([Hello.PROVE]) + secrets.token_bytes(80))
        except OSError:
            pass
        finally:
            if upstream is not None:
                upstream.close()

    return OneClient(behave, timeout=5)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass


# -- attack 1: a squatter answers the client ---------------------------------------------


def test_a_squatter_that_answers_gets_no_key_and_sends_no_pickle(guarded, caplog):
    client, d = guarded
    squatter = squat()
    h = _with_port(d, client, 0, squatter.port)
    caplog.set_level(logging.DEBUG, logger="dask_ddict")
    with pytest.raises(DDictManagerUnavailableError, match="did not prove"):
        h.manager(0)["secret key"] = "secret value"
    squatter.thread.join(10)
    # Only the HELLO and the client's nonce: no proof to relay, no key, no value.
    assert len(squatter.received) == HELLO.size + handshake.NONCE
    assert b"secret key" not in squatter.received
    assert d._core.layout.secret not in caplog.text


@pytest.mark.parametrize("answer", [Hello.OK, Hello.DENIED, Hello.PROVE + 1])
def test_a_squatter_that_skips_its_proof_gets_no_key(guarded, answer):
    """Over TCP a host must prove the secret before anything else: one that answers the
    HELLO with OK straight away (what a Unix socket's host answers), or anything but a
    proof, or a refusal of a dictionary it does not know, is not the dictionary's host;
    the client sends it nothing more."""
    client, d = guarded
    squatter = squat(answer=bytes([answer]))
    h = _with_port(d, client, 0, squatter.port)
    with pytest.raises(DDictManagerUnavailableError, match="without proving|not a DDict"):
        h.manager(0)["secret key"] = "secret value"
    squatter.thread.join(10)
    assert len(squatter.received) == HELLO.size + handshake.NONCE
    assert b"secret key" not in squatter.received


# -- attack 2: a squatter relays a client to a live host ------------------------------------


def test_a_relayed_handshake_fails_before_the_client_proves_anything(guarded):
    client, d = guarded
    real = d._core.layout.managers[0]
    squatter = squat(relay_to=(real.tcp_host, real.tcp_port))
    h = _with_port(d, client, 0, squatter.port)
    with pytest.raises(DDictManagerUnavailableError, match="did not prove"):
        h.manager(0)["k"] = 1
    squatter.thread.join(10)
    assert len(squatter.received) == HELLO.size + handshake.NONCE  # no client proof relayed


def test_the_host_refuses_proofs_for_another_target_replays_and_reflections(guarded):
    _, d = guarded
    lay = d._core.layout
    m0, m1 = lay.managers[0], lay.managers[1]
    assert _target(m0) != _target(m1)  # two host processes

    def attempt(make_proof) -> int:  # noqa: ANN001
        with _raw(m0) as s:
            uid, secret, inc, nc, ns, host_proof = _handshake(s, lay, _target(m0))
            assert host_proof == handshake.proof(secret, b"host", uid, _target(m0), inc, nc, ns)
            s.sendall(make_proof(uid, secret, inc, nc, ns, host_proof))
            return sockets.recv_exact(s, 1)[0]

    good = []

    def honest(uid, secret, inc, nc, ns, _):  # noqa: ANN001, ANN202
        good.append(handshake.proof(secret, b"client", uid, _target(m0), inc, nc, ns))
        return good[-1]

    assert attempt(honest) == Hello.OK
    other_host = lambda uid, secret, inc, nc, ns, _: handshake.proof(  # noqa: E731
        secret, b"client", uid, _target(m1), inc, nc, ns
    )
    assert attempt(other_host) == Hello.DENIED  # made for another host process
    assert attempt(lambda *a: good[0]) == Hello.DENIED  # replayed: the nonces are new
    assert attempt(lambda *a: a[-1]) == Hello.DENIED  # the host's own proof, reflected


# -- limits before allocation ----------------------------------------------------------------


def _authenticated(d: DDict, mid: int) -> socket.socket:
    lay, info = d._core.layout, d._core.layout.managers[mid]
    s = _raw(info)
    uid, secret, inc, nc, ns, _ = _handshake(s, lay, _target(info))
    s.sendall(handshake.proof(secret, b"client", uid, _target(info), inc, nc, ns))
    assert sockets.recv_exact(s, 1)[0] == Hello.OK
    return s


@pytest.mark.parametrize(
    "klen,vlen,status,text",
    [
        ((1 << 32) - 1, 0, Status.INVALID_ARGUMENT, "max-key-bytes"),
        (32, 1 << 40, Status.POOL_FULL, "cannot fit"),
    ],
)
def test_lengths_are_checked_before_any_allocation(guarded, klen, vlen, status, text):
    _, d = guarded
    host = psutil.Process(_host_pid(d, 0))
    rss = host.memory_info().rss
    with _authenticated(d, 0) as s:
        s.sendall(REQ.pack(Op.PUT, 0, 0, klen, 0, 5, 0, 0, 1, -1.0, vlen, 0))
        got, tag, ival, plen = REP.unpack(sockets.recv_exact(s, REP.size))
        assert got == status and tag == 5 and text in sockets.recv_exact(s, plen).decode()
        start = time.monotonic()
        d.manager(0)["meanwhile"] = 1  # another connection is served at once
        assert time.monotonic() - start < 2
        assert s.recv(1) == b""  # and the offending connection was dropped
    assert host.memory_info().rss - rss < 64 << 20  # nothing like 4 GB was allocated


def test_clients_check_the_limits_first(guarded):
    _, d = guarded
    with pytest.raises(DDictFullError, match="cannot fit"):  # refused before sending
        d.manager(0)["big"] = np.zeros(65 << 20, dtype="u1")  # over the 64 MiB floor
    with pytest.raises(DDictFullError, match="shards holds 16777216 bytes"):  # under it, but
        d.manager(0)["big"] = np.zeros(17 << 20, dtype="u1")  # over the shard: refused too
    with pytest.raises(ValueError, match="max-key-bytes"):
        d["k" * (2 << 20)] = 1
    d.manager(0)["after"] = 2
    assert d.manager(0)["after"] == 2


# -- idle strangers, connection floods, fd exhaustion ----------------------------------------


def test_idle_strangers_are_dropped_and_connections_bounded(guarded):
    _, d = guarded
    info = d._core.layout.managers[1]
    host = psutil.Process(_host_pid(d, 1))
    threads = host.num_threads()
    flood = [_raw(info) for _ in range(MAX_CONNECTIONS + 30)]
    try:
        time.sleep(0.3)
        assert host.num_threads() <= threads + MAX_CONNECTIONS
        for s in flood:
            s.settimeout(HANDSHAKE_TIMEOUT + 5)
        ended = sum(s.recv(1) == b"" for s in flood)  # each one closed by the host
        assert ended == len(flood)
    finally:
        for s in flood:
            s.close()
    h = DDict.attach(d.serialize())
    h.manager(1)["still"] = "served"
    assert h.manager(1)["still"] == "served"
    h.detach()


def test_the_listener_serves_again_after_running_out_of_descriptors(guarded):
    _, d = guarded
    pid = _host_pid(d, 0)
    info = d._core.layout.managers[0]
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    in_use = len(os.listdir(f"/proc/{pid}/fd"))
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (in_use + 10, hard))
    try:
        flood = [_raw(info) for _ in range(30)]  # the host runs out of descriptors
        time.sleep(0.5)
        assert len(os.listdir(f"/proc/{pid}/fd")) >= in_use + 9  # it did (EMFILE in accept)
        for s in flood:
            s.close()  # the episode ends
        time.sleep(HANDSHAKE_TIMEOUT + 0.5)
        h = DDict.attach(d.serialize())
        h.manager(0)["after the flood"] = 1
        assert h.manager(0)["after the flood"] == 1
        h.detach()
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))


# -- host hygiene ------------------------------------------------------------------------------


def test_shard_files_and_socket_directories_are_private(guarded):
    _, d = guarded
    for m in d._core.layout.managers:
        assert stat.S_IMODE(os.stat(m.store_path).st_mode) == 0o700
        for name in os.listdir(m.store_path):
            path = os.path.join(m.store_path, name)
            if name.endswith(".mdb"):
                assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
            assert os.stat(path).st_uid == os.getuid()
        assert stat.S_IMODE(os.stat(os.path.dirname(m.uds_path)).st_mode) == 0o700


def test_a_unix_socket_peer_of_another_user_is_refused(monkeypatch):
    a, b = socket.socketpair()
    with a, b:
        monkeypatch.setattr(handshake, "peer_uid", lambda sock: os.getuid() + 1)
        with pytest.raises(handshake.HandshakeError, match="another user"):
            handshake.host_side(
                a,
                lambda n: b"",
                lambda uid: None,
                lambda uid: False,
                tcp=False,
                target="",
                incarnation=b"",
            )
        with pytest.raises(handshake.HandshakeError, match="another user"):
            handshake.client_side(b, b"u" * 16, b"s", "/sock", tcp=False)


def test_reprs_never_show_the_secret(guarded):
    _, d = guarded
    secret = d._core.layout.secret
    links = list(d._core._links.values())
    shown = [repr(d), repr(d._core), repr(d._core.layout), str(d._core.layout), *map(repr, links)]
    assert links and not any(secret in text for text in shown)


def test_proofs_are_bound_to_every_field():
    args = [b"s", b"host", b"u" * 16, "h:1", b"i" * 16, b"n" * 32, b"m" * 32]
    base = handshake.proof(*args)
    for i in range(len(args)):
        changed = list(args)
        changed[i] = changed[i] + (b"x" if isinstance(changed[i], bytes) else "x")
        assert handshake.proof(*changed) != base, i
    assert struct.calcsize("<4s16s") == HELLO.size
