"""The wire codec alone (transport/protocol.py): frames over a real socket pair."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dask_ddict.transport.protocol import (
    REP,
    REQ,
    SMALL,
    Op,
    Reader,
    decode_timeout,
    encode_timeout,
    send_parts,
)
from tests.support.fuzz import fuzz

heads = st.tuples(
    st.sampled_from(list(Op)),
    st.integers(0, 255),
    st.integers(0, 2**16 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(0, 2**64 - 1),
    st.one_of(st.none(), st.floats(0, 1e9)),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
)


@fuzz(200)
@given(heads)
def test_request_headers_round_trip(head):
    op, flags, term, klen, mid, tag, chkpt, arg, client, timeout, vlen, rid = head
    raw = REQ.pack(
        op, flags, term, klen, mid, tag, chkpt, arg, client, encode_timeout(timeout), vlen, rid
    )
    out = REQ.unpack(raw)
    assert out[:9] == (op, flags, term, klen, mid, tag, chkpt, arg, client)
    assert decode_timeout(out[9]) == timeout and out[10:] == (vlen, rid)


def test_frames_small_and_large_arrive_whole_and_in_order():
    a, b = socket.socketpair()
    big = np.arange(3 * SMALL, dtype="u1")  # sent part by part, never joined
    parts = [REP.pack(0, 9, 7, 5), b"hello", big, b"tail"]
    sender = threading.Thread(target=send_parts, args=(a, parts))
    sender.start()
    r = Reader(b)
    assert REP.unpack(r.read(REP.size)) == (0, 9, 7, 5)
    assert bytes(r.read(5)) == b"hello"
    dst = memoryview(bytearray(big.nbytes))
    r.read_into(dst)  # what was buffered is copied, the rest received straight into dst
    assert bytes(dst) == big.tobytes()
    assert bytes(r.read(4)) == b"tail" and bytes(r.read(0)) == b""
    sender.join()
    a.close()
    try:
        r.read(1)
    except ConnectionResetError as e:
        assert "closed" in str(e)
    else:
        raise AssertionError("a closed peer must be reported")
    b.close()


def test_send_waiting_sends_everything_in_order_to_a_slow_reader():
    """A large buffer sent to a peer that reads slowly, through a small send buffer, in
    pieces that do not wait: every byte arrives in order (an array of 8-byte items
    sent as its bytes), and the sender's socket stays blocking."""
    from dask_ddict.transport.sockets import send_waiting

    a, b = socket.socketpair()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
        data = np.arange(1 << 20, dtype=np.int64)  # 8 MiB
        got = bytearray()

        def read() -> None:
            while len(got) < data.nbytes:
                chunk = b.recv(200_000)
                if not chunk:
                    return
                got.extend(chunk)
                threading.Event().wait(0.0005)  # (a slow reader)

        t = threading.Thread(target=read)
        t.start()
        send_waiting(a, data)
        t.join(timeout=60)
        assert not t.is_alive() and bytes(got) == data.tobytes()
        assert a.getblocking()


def test_send_waiting_raises_when_the_peer_goes_away_instead_of_waiting():
    from dask_ddict.transport.sockets import send_waiting

    a, b = socket.socketpair()
    with a:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
        threading.Timer(0.2, b.close).start()  # (gone while the sender waits for room)
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            send_waiting(a, b"x" * (16 << 20))


def test_send_waiting_on_a_socket_closed_by_another_thread_raises_ebadf():
    """Another thread closes the socket while the sender waits for room (the event
    loop drops a connection whose reply a thread still sends): the sender sees it
    within ``ROOM_CHECK`` and raises ``EBADF``, instead of waiting on a descriptor
    number that another file may take next."""
    import errno

    from dask_ddict.transport import sockets

    a, b = socket.socketpair()
    with b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
        threading.Timer(0.2, a.close).start()
        with pytest.raises(OSError) as info:
            sockets.send_waiting(a, b"x" * (16 << 20))
        assert info.value.errno == errno.EBADF


def test_send_waiting_keeps_a_socket_timeout_for_the_whole_send():
    """A socket with a timeout is sent to as ``sendall`` sends (its timeout bounds the
    send): a peer that does not read makes it time out, not wait forever."""
    from dask_ddict.transport.sockets import send_waiting

    a, b = socket.socketpair()
    with a, b:
        a.settimeout(0.3)
        with pytest.raises(TimeoutError):
            send_waiting(a, b"x" * (16 << 20))


def test_send_waiting_waits_for_room_on_a_non_blocking_socket():
    """A non-blocking socket (timeout 0), whose ``sendall`` would raise partway, is sent
    to in pieces with waits for room, as a blocking one."""
    from dask_ddict.transport.sockets import send_waiting

    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        data = b"y" * (8 << 20)
        got = bytearray()
        t = threading.Thread(target=lambda: got.extend(_read_all(b, len(data))))
        t.start()
        send_waiting(a, data)
        t.join(timeout=60)
        assert bytes(got) == data


def _read_all(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        out += chunk
    return bytes(out)
