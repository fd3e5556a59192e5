"""``ddict_wire.h``: the key path in C, for C and C++ clients (issue 53, item 5).

A client written on the header alone (``examples/c_client/wire_client.c``, built here with the
machine's C compiler, the one that builds the kernels) routes keys as the Python
client does, and puts and gets values over a host process's Unix socket, or over TCP
after the handshake's proofs, that the Python client then reads and wrote.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import pytest
from distributed import Client

from dask_ddict import DDict, kernels
from dask_ddict._hashing import key_digest, manager_for_digest
from dask_ddict._keys import encode_key
from dask_ddict.errors import Status
from dask_ddict.transport import handshake
from dask_ddict.transport.protocol import HELLO, REP, REQ, Hello
from tests.support.cluster import local_cluster
from tests.support.one_client import OneClient
from tests.support.shards import shards, shm_entries

SOURCE = Path(__file__).parent.parent / "examples" / "c_client" / "wire_client.c"


@pytest.fixture(scope="module")
def wire_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The C client, built against the installed package's header."""
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if shutil.which(cc[0]) is None:  # (then the kernels are pure Python, and this too)
        pytest.skip(f"no C compiler ({cc[0]}) on this machine")
    exe = tmp_path_factory.mktemp("wire") / "wire_client"
    subprocess.run(
        [*cc, "-std=c99", "-Wall", "-Wextra", "-Werror", "-O2", "-I", kernels.get_include()]
        + [str(SOURCE)]
        + ["-o", str(exe)],
        check=True,
        capture_output=True,
    )
    return exe


def _run(exe: Path, *args: str, env: dict[str, str] | None = None) -> list[str]:
    out = subprocess.run([str(exe), *args], check=True, capture_output=True, text=True, env=env)
    return out.stdout.splitlines()


def _arg(key: str | int) -> str:
    return f"s:{key}" if isinstance(key, str) else f"i:{key}"


def test_a_c_client_routes_keys_as_the_python_client(wire_client):
    keys: list[str | int] = ["", "a", "key-17", "ключ", "x" * 255, "日本"]
    keys += [0, 1, 255, 256, 65535, 65536, -1, -256, -(2**31), 2**31 - 1]
    for managers in (1, 7, 64):
        lines = _run(wire_client, "route", str(managers), *map(_arg, keys))
        for key, line in zip(keys, lines, strict=True):
            manager, digest, canonical = line.split()
            kb = encode_key(key)
            assert bytes.fromhex(canonical) == kb, key
            assert bytes.fromhex(digest) == key_digest(kb), key
            assert int(manager) == manager_for_digest(key_digest(kb), managers), key


def test_a_c_client_puts_and_gets_over_a_hosts_unix_socket(wire_client):
    with local_cluster(1) as cl, Client(cl) as c:
        d = DDict(managers_per_worker=3, total_mem="24 MiB", client=c)
        mine = shards(d)
        layout = d._core.layout
        (uds,) = {m.uds_path for m in layout.managers}  # (one host process serves all)
        where = (uds, layout.uid, str(layout.num_managers))
        ours = {f"py-{i}": f"from Python {i}".encode() for i in range(20)}
        d.update(ours)
        theirs = {f"c-{i}": f"from C {i}" for i in range(20)} | {7: "seven", -3: "minus"}
        pairs = [a for k, v in theirs.items() for a in (_arg(k), v)]
        assert _run(wire_client, "put", *where, *pairs) == [str(Status.OK.value)] * len(theirs)
        assert {k: d[k] for k in theirs} == {k: v.encode() for k, v in theirs.items()}
        asked = [*ours, "never-written"]
        got = _run(wire_client, "get", *where, *map(_arg, asked))
        assert got == [f"{Status.OK.value} {v.decode()}" for v in ours.values()] + [
            f"{Status.KEY_NOT_FOUND.value} -"
        ]
        d.destroy()
        assert not (mine & shm_entries())


def test_a_c_client_puts_and_gets_over_tcp_after_the_handshake(wire_client):
    """Over TCP the C client checks the host's proof of the dictionary's secret before it
    proves the secret itself (``ddict_proof``: HMAC-SHA256 in the header, no crypto
    library), then puts and gets as over the Unix socket.  With a wrong secret, or
    dialling the host by another name than the layout's (the proofs are bound to it),
    it stops at the host's proof, says so, and sends nothing."""
    with local_cluster(1) as cl, Client(cl) as c:
        d = DDict(managers_per_worker=2, total_mem="24 MiB", client=c)
        layout = d._core.layout
        ((host, port),) = {(m.tcp_host, m.tcp_port) for m in layout.managers}
        where = (layout.uid, str(layout.num_managers))
        env = os.environ | {"DDICT_SECRET": layout.secret}
        theirs = {f"tcp-{i}": f"over TCP {i}" for i in range(12)} | {70000: "int key"}
        pairs = [a for k, v in theirs.items() for a in (_arg(k), v)]
        got = _run(wire_client, "put", f"tcp:{host}:{port}", *where, *pairs, env=env)
        assert got == [str(Status.OK.value)] * len(theirs)
        assert {k: d[k] for k in theirs} == {k: v.encode() for k, v in theirs.items()}
        d["py"] = b"from Python"
        got = _run(wire_client, "get", f"tcp:{host}:{port}", *where, "s:py", "s:none", env=env)
        assert got == [f"{Status.OK.value} from Python", f"{Status.KEY_NOT_FOUND.value} -"]
        wrong = env | {"DDICT_SECRET": "0" * len(layout.secret)}
        for target, secrets_env in ((f"{host}:{port}", wrong), (f"localhost:{port}", env)):
            failed = subprocess.run(
                [str(wire_client), "put", f"tcp:{target}", *where, "s:never", "x"],
                capture_output=True,
                text=True,
                env=secrets_env,
            )
            assert failed.returncode == 3, failed
            assert f"the process at {target} did not prove" in failed.stderr
        assert "never" not in d
        d.destroy()


def test_a_c_client_refuses_a_tcp_host_that_skips_its_proof(wire_client):
    """Over TCP the C client sends nothing past its HELLO to a process that answers it
    with OK at once (what a Unix socket's host says), not with a proof."""
    host = OneClient(lambda conn, _: conn.sendall(bytes([Hello.OK])))
    env = os.environ | {"DDICT_SECRET": "ab" * 32}
    failed = subprocess.run(
        [str(wire_client), "put", f"tcp:{host.target}", "cd" * 16, "1", "s:key", "value"],
        capture_output=True,
        text=True,
        env=env,
    )
    host.thread.join(20)
    assert failed.returncode == 3, failed
    assert "without proving" in failed.stderr
    assert len(host.received) == HELLO.size + handshake.NONCE


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="listening as another user takes root")
def test_a_c_client_refuses_a_unix_socket_of_another_user(wire_client):
    """Over a Unix socket the C client checks the host process's uid (``SO_PEERCRED``)
    before it sends anything, as the Python client does: a socket that another user
    listens on gets nothing, and the client says why (exit status 3)."""
    where = tempfile.mkdtemp(prefix="ddict-peer-")
    path = os.path.join(where, "host.sock")
    os.chmod(where, 0o777)  # (the other user binds in it)
    ready_r, ready_w = os.pipe()
    got_r, got_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the other user's process: plain system calls, then out)
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(path)
            listener.listen(1)
            os.write(ready_w, b"r")
            listener.settimeout(20)
            conn, _ = listener.accept()
            conn.settimeout(20)
            received = conn.recv(1024)
            os.write(got_w, str(len(received)).encode())
            code = 0
        finally:
            os._exit(code)
    try:
        os.close(ready_w)
        os.close(got_w)
        assert os.read(ready_r, 1) == b"r"
        failed = subprocess.run(
            [str(wire_client), "put", path, "cd" * 16, "1", "s:key", "value"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert failed.returncode == 3, failed
        assert f"the host process at {path} runs as another user (uid {NOBODY})" in failed.stderr
        assert os.read(got_r, 16) == b"0"  # (nothing sent to it)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(got_r)
        shutil.rmtree(where)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_c_client_refuses_a_reply_longer_than_it_takes(wire_client):
    """A reply's payload length comes from the host: one of 2**64 - 1 bytes (which a
    ``malloc(plen + 1)`` would wrap to nothing) is refused, after a handshake the host
    proved, before anything is allocated or read."""
    secret = "5e" * 32
    uid = bytes(range(16))

    class Hosted:  # (what host_side finds: the dictionary's secret, as a host keeps it)
        def __init__(self) -> None:
            self.secret = secret.encode()

    def behave(conn: socket.socket, host: OneClient) -> None:
        handshake.host_side(
            conn,
            lambda n: host.read(conn, n),
            lambda u: Hosted() if u == uid else None,
            lambda u: False,
            tcp=True,
            target=host.target,
            incarnation=os.urandom(16),
        )
        head = REQ.unpack(host.read(conn, REQ.size))
        host.read(conn, head[3])  # (its key section)
        conn.sendall(REP.pack(0, head[5], 0, 2**64 - 1))

    host = OneClient(behave)
    env = os.environ | {"DDICT_SECRET": secret}
    failed = subprocess.run(
        [str(wire_client), "get", f"tcp:{host.target}", uid.hex(), "1", "s:key"],
        capture_output=True,
        text=True,
        env=env,
    )
    host.thread.join(20)
    assert failed.returncode == 3, failed
    assert f"a reply of {2**64 - 1} bytes" in failed.stderr


CPP_ROUTE = r"""
#include <cstdio>
#include <cstring>
#include "ddict_wire.h"

int main(int argc, char **argv) {
    unsigned char kb[DDICT_KEY_BYTES_MOST], digest[DDICT_DIGEST_BYTES];
    for (int i = 1; i < argc; i++) {
        size_t n = ddict_str_key(argv[i], std::strlen(argv[i]), kb);
        ddict_digest(kb, n, digest);
        std::printf("%llu\n", (unsigned long long)ddict_manager_of(digest, 7));
    }
    return 0;
}
"""


def test_the_header_serves_a_cpp_client_too(tmp_path):
    """A C++ translation unit includes the header as it is (no ``extern "C"`` needed:
    every function is inline in it) and routes as the Python client does."""
    cxx = shlex.split(sysconfig.get_config_var("CXX") or "c++")
    if shutil.which(cxx[0]) is None:
        pytest.skip(f"no C++ compiler ({cxx[0]}) on this machine")
    src, exe = tmp_path / "route.cc", tmp_path / "route"
    src.write_text(CPP_ROUTE)
    subprocess.run(
        [*cxx, "-std=c++11", "-Wall", "-Wextra", "-Werror", "-I", kernels.get_include()]
        + [str(src), "-o", str(exe)],
        check=True,
        capture_output=True,
    )
    keys = ["a", "key-17", "ключ"]
    want = [str(manager_for_digest(key_digest(encode_key(k)), 7)) for k in keys]
    assert _run(exe, *keys) == want
