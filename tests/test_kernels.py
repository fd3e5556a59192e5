"""The key path's kernels: the compiled set gives what the pure-Python reference gives.

Both sets run side by side here on fuzzed input (hypothesis), whichever one the
package itself runs: every result equal, every error of the same type and message.
The compiled set must be built wherever a C compiler is (``pip install`` builds it);
``DASK_DDICT__COMPILED=false`` runs the package (and the rest of the suite) on the
pure set, as a machine without a compiler would.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import shutil
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import lmdb
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dask_ddict import config, kernels
from dask_ddict._entry import ENTRY, TOMBSTONE, Entry
from dask_ddict._hashing import key_digest, manager_for_digest
from dask_ddict._keys import PLAIN_KEYS, dumps_key, encode_key
from dask_ddict._serialize import Framed, Taken, dumps_value, loads_value
from dask_ddict.kernels import pure
from dask_ddict.shard.store import ShardStore
from dask_ddict.transport.operation import Request
from dask_ddict.transport.protocol import Reader
from tests.support.keys import Placed

try:
    from dask_ddict.kernels import _compiled
except ImportError:  # (a machine without a compiler: test_the_compiled_set_is_built says so)
    _compiled = None

SETS = [pure] if _compiled is None else [pure, _compiled]


def _outcome(f: Any, *args: Any) -> tuple[str, Any]:
    """``("ok", result)`` or ``("error", (type, message))``: what to compare."""
    try:
        return "ok", f(*args)
    except Exception as e:  # noqa: BLE001 - compared as they are
        return "error", (type(e), str(e))


def _same(name: str, *args: Any) -> Any:
    """Run kernel ``name`` of every set on ``args``; all outcomes equal; the outcome."""
    outcomes = [_outcome(getattr(s, name), *args) for s in SETS]
    assert all(o == outcomes[0] for o in outcomes), outcomes
    return outcomes[0]


def test_the_compiled_set_is_built_and_chosen():
    """Where the machine has a C compiler, ``pip install`` built the kernels, and the
    package runs them unless ``ddict.compiled`` is false."""
    assert set(pure.__all__) | {
        "BATCH_RECORD",
        "COMMITTED",
        "COMPILED",
        "FORKED",
        "LEFT",
        "GROUP",
        "JOIN",
        "KeyTooLong",
        "LaneWire",
        "NO_KEY",
        "PlainRequests",
        "PRELOADED",
        "QUIET",
        "Resend",
        "Record",
        "REPLY",
        "REQUEST",
        "SPAN",
        "get_include",
        "group_table",
    } == set(kernels.__all__)
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        assert _compiled is None or kernels.COMPILED == bool(config.get("compiled"))
        return
    assert _compiled is not None, "a C compiler is here but the kernels were not built"
    assert set(pure.__all__) <= set(dir(_compiled))
    assert kernels.COMPILED == bool(config.get("compiled"))
    assert (kernels.route is _compiled.route) == kernels.COMPILED
    if os.environ.get("DASK_DDICT__COMPILED", "").lower() == "false":
        assert not kernels.COMPILED and kernels.route is pure.route


keys_st = st.recursive(
    st.one_of(
        st.text(max_size=20),
        st.integers(),
        st.binary(max_size=20),
        st.booleans(),
        st.none(),
        st.floats(allow_nan=False),
    ),
    lambda inner: st.tuples(inner, inner) | st.frozensets(st.integers(), max_size=3),
    max_leaves=6,
)


def _placed(key: Any, digest: bytes, n: int) -> int:
    return hash(key) % n if isinstance(key, Placed) else int.from_bytes(digest[:8], "little") % n


@settings(max_examples=150, deadline=None)
@given(
    keys=st.lists(keys_st | st.integers(0, 50).map(Placed), max_size=30),
    n=st.integers(0, 17),
    most=st.integers(1, 64),
    by_user_hash=st.booleans(),
    custom=st.booleans(),
)
def test_route_is_the_same(keys, n, most, by_user_hash, custom):
    encode = encode_key if not custom else (lambda k: dumps_key(k, pickle))
    kind, got = _same(
        "route", keys, n, most, encode, _placed if by_user_hash else None, PLAIN_KEYS, key_digest
    )
    if kind == "ok":  # the reference's rule, spelled out once more
        for key, (mid, digest) in zip(keys, got):
            assert digest == key_digest(encode(key))
            assert mid == (
                _placed(key, digest, n)
                if by_user_hash and isinstance(key, Placed)
                else int.from_bytes(digest[:8], "little") % n
            )


@settings(max_examples=100, deadline=None)
@given(
    keys=st.lists(keys_st | st.integers(0, 50).map(Placed), max_size=12),
    n=st.integers(0, 17),
    most=st.integers(1, 64),
    by_user_hash=st.booleans(),
    custom=st.booleans(),
)
def test_a_router_routes_one_key_as_route_does(keys, n, most, by_user_hash, custom):
    """``Router(...).one(key)`` (a handle's single keys, batch puts) is ``route``'s
    answer for that key with its bytes, or ``route``'s error, in both sets."""
    encode = encode_key if not custom else (lambda k: dumps_key(k, pickle))
    args = (n, most, encode, _placed if by_user_hash else None, PLAIN_KEYS, key_digest)
    for key in keys:
        kind, got = _same("route", [key], *args)
        ones = [_outcome(s.Router(*args).one, key) for s in SETS]
        assert all(o == ones[0] for o in ones), ones
        assert ones[0] == ((kind, (*got[0], encode(key))) if kind == "ok" else (kind, got))


@settings(max_examples=100, deadline=None)
@given(
    batches=st.lists(
        st.lists(keys_st | st.integers(0, 50).map(Placed) | st.sampled_from([1, True, 1.0, "1"])),
        max_size=6,
    ),
    n=st.integers(1, 17),
    most=st.integers(1, 64),
    by_user_hash=st.booleans(),
    cached=st.integers(0, 8),
)
def test_a_routers_kept_routes_never_change_an_answer(batches, n, most, by_user_hash, cached):
    """``Router.many(keys)`` is ``route(keys)`` however many routes it keeps (none, fewer
    than the keys, all), whichever keys came before (``1``, ``True``, ``1.0`` and ``"1"``
    are equal or alike to a dict and pickle differently), in both sets."""
    args = (n, most, encode_key, _placed if by_user_hash else None, PLAIN_KEYS, key_digest)
    routers = [s.Router(*args, cached) for s in SETS]
    for keys in batches:
        kind, got = _same("route", keys, *args)
        for router in routers:
            assert _outcome(router.many, keys) == (kind, got)
            assert len(router._routes) <= cached


class Text(str):
    """A ``str`` subclass: a key equal to a ``str`` that pickles otherwise."""


def test_a_router_keeps_the_routes_of_str_and_int_keys_only():
    """What ``many`` keeps: short ``str`` and ``int`` keys (not their look-alikes, not
    a long key, nothing under a custom key pickler), forgotten all at once when full;
    a kept route is handed out again as it is)."""
    custom = lambda k: dumps_key(k, pickle)  # noqa: E731 - a pickler that is not the default
    for s in SETS:
        r = s.Router(3, 1 << 20, encode_key, None, PLAIN_KEYS, key_digest, 4)
        first = r.many(["a", 7, True, 1.0, b"b", ("t",), "x" * 200])
        again = r.many(["a", 7, True, 1.0, b"b", ("t",), "x" * 200])
        assert first == again
        same = [x is y for x, y in zip(first, again)]
        assert same == [True, True, False, False, False, False, False], s.__name__

        sub = r.many([Text("a")])  # (equal to "a" for a dict, pickled as another class)
        assert sub == s.route([Text("a")], 3, 1 << 20, encode_key, None, PLAIN_KEYS, key_digest)
        assert sub != [first[0]]
        full = r.many(["c", "d", "e", "f"])  # (4 kept already: forgotten, then these)
        assert r.many(["a"])[0] is not first[0] and r.many(["f"])[0] is full[3]
        other = s.Router(3, 1 << 20, custom, None, PLAIN_KEYS, key_digest, 4)
        assert other.cached == 0 and other.many(["a"])[0] is not other.many(["a"])[0]


@given(
    st.lists(
        st.text(max_size=300)
        | st.text(st.characters(min_codepoint=0xD7F0, max_codepoint=0xE010), max_size=4)
        | st.text(st.characters(min_codepoint=0x80), min_size=60, max_size=130),
        max_size=20,
    )
)
def test_route_writes_str_keys_as_pickle_does(keys):
    """The compiled kernel writes short str keys itself (one of its fast paths): the
    digests are those of ``pickle.dumps(key, 5)``, surrogates and long keys included."""
    for s in SETS:
        got = s.route(keys, 7, 1 << 20, encode_key, None, PLAIN_KEYS, key_digest)
        assert [d for _, d in got] == [key_digest(pickle.dumps(k, protocol=5)) for k in keys]


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=700) | st.sampled_from([bytes(n) for n in (0, 127, 128, 129, 256, 257)])
)
def test_the_compiled_digest_is_hashlibs(data):
    """The compiled set writes BLAKE2b itself (RFC 7693: a key's digest without hashlib's
    object per key); it is ``key_digest``'s, one block or many, exact multiples of a
    block included."""
    if _compiled is None:  # (no compiler: test_the_compiled_set_is_built_and_chosen)
        return
    assert _compiled.blake16(data) == key_digest(data)
    managers = 1 + len(data) % 7
    assert _compiled.manager_of(data, managers) == (
        manager_for_digest(key_digest(data), managers),
        key_digest(data),
    )


_U = st.integers(0, 2**64 - 1)
_Q = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=200, deadline=None)
@given(
    request=st.tuples(
        st.integers(0, 255),
        st.integers(0, 255),
        st.integers(0, 0xFFFF),
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**32 - 1),
        _Q,
        _Q,
        _U,
        st.floats(allow_nan=False) | st.just(-1.0),
        _U,
        _U,
    ),
    reply=st.tuples(st.integers(0, 255), st.integers(0, 2**32 - 1), _Q, _U),
)
def test_the_c_level_headers_are_the_structs(request, reply):
    """The key path's headers as the C-level functions write and read them
    (``framing.pxi``: the host's plain server, the client's key lane, and the kernels
    that take requests and send and receive replies) are ``REQUEST``'s and ``REPLY``'s,
    field by field."""
    if _compiled is None:  # (no compiler: test_the_compiled_set_is_built_and_chosen)
        return
    assert _compiled.request_head(request) == pure.REQUEST.pack(*request)
    assert _compiled.request_fields(pure.REQUEST.pack(*request)) == request
    assert _compiled.reply_head(reply) == pure.REPLY.pack(*reply)
    assert _compiled.reply_fields(pure.REPLY.pack(*reply)) == reply


def test_the_c_headers_constants_are_the_python_declarations():
    """``ddict_wire.h`` (what a C client includes) names the Python client's numbers: its
    sizes, handshake, operations, answers and value formats are the declarations'."""
    if _compiled is None:  # (no compiler: test_the_compiled_set_is_built_and_chosen)
        return
    from dask_ddict import _entry, _serialize
    from dask_ddict.errors import Status
    from dask_ddict.transport import handshake, protocol

    declared = {
        "REQUEST": pure.REQUEST.size,
        "REPLY": pure.REPLY.size,
        "DIGEST": _entry.DIGEST,
        "HELLO": protocol.HELLO.size,
        "NONCE": handshake.NONCE,
        "UID": protocol.HELLO.size - len(protocol.HELLO_MAGIC),
        "INCARNATION": handshake.INCARNATION,
        "PROOF": handshake.PROOF,
        "VERSION": handshake.VERSION,
        "VALUE_HEAD": _serialize._HEAD.size,
        "HELLO_MAGIC": protocol.HELLO_MAGIC,
        "FMT_PICKLE": _serialize.FMT_PICKLE,
        "FMT_RAW": _serialize.FMT_RAW,
        "FMT_BYTES": _serialize.FMT_BYTES,
    }
    declared |= {f"Hello.{h.name}": h for h in protocol.Hello}
    declared |= {f"Op.{o}": protocol.Op[o] for o in ("PUT", "GET", "CONTAINS", "POP", "FETCH_ADD")}
    declared |= {f"Status.{s}": Status[s] for s in ("OK", "KEY_NOT_FOUND", "TIMEOUT")}
    assert _compiled.wire_constants() == declared
    for n in (0, 1, 100, 1 << 40):  # a raw-bytes value's head, as dumps_value frames it
        framed = dumps_value(b"x" * n) if n < 1 << 20 else None
        if framed is not None:
            assert _compiled.bytes_value_head(n) == bytes(framed.parts[0])[:16]
        assert _compiled.bytes_value_head(n) == _serialize._HEAD.pack(_serialize.FMT_BYTES, 0, n)


@settings(max_examples=200, deadline=None)
@given(
    secret=st.text(max_size=200),
    role=st.sampled_from([b"host", b"client"]),
    uid=st.binary(min_size=16, max_size=16),
    target=st.text(max_size=80),
    incarnation=st.binary(min_size=16, max_size=16),
    nonces=st.tuples(st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32)),
)
def test_the_c_headers_handshake_proof_is_the_python_clients(
    secret, role, uid, target, incarnation, nonces
):
    """``ddict_proof`` (SHA-256 and HMAC written in ``ddict_wire.h`` for a C client) gives
    ``handshake.proof``'s bytes for any secret (shorter and longer than SHA-256's block),
    target and nonces, and ``ddict_proofs_equal`` finds it equal to itself."""
    if _compiled is None:  # (no compiler: test_the_compiled_set_is_built_and_chosen)
        return
    from dask_ddict.transport import handshake

    key = secret.encode()
    want = handshake.proof(key, role, uid, target, incarnation, *nonces)
    assert _compiled.wire_proof(key, role, uid, target.encode(), incarnation, *nonces) == want


def test_the_c_headers_sha256_and_proof_comparison():
    """``ddict_wire.h``'s SHA-256 is ``hashlib``'s for every length across a few blocks
    (its padding's edges: 55, 56, 63, 64 bytes...), fed whole or in odd pieces; and
    ``ddict_proofs_equal`` tells two proofs apart by any one byte."""
    if _compiled is None:  # (no compiler: test_the_compiled_set_is_built_and_chosen)
        return
    import hashlib

    data = bytes((i * 37 + 11) & 0xFF for i in range(300))
    for n in range(len(data) + 1):
        for chunk in (1, 7, 64, 1000):
            assert _compiled.wire_sha256(data[:n], chunk) == hashlib.sha256(data[:n]).digest()
    proof = hashlib.sha256(b"a proof").digest()
    assert _compiled.wire_proofs_equal(proof, proof)
    for i in range(32):
        for bit in (1, 0x80):
            other = bytearray(proof)
            other[i] ^= bit
            assert not _compiled.wire_proofs_equal(proof, bytes(other))


@settings(max_examples=100, deadline=None)
@given(
    groups=st.lists(
        st.tuples(
            st.integers(0, 2**32 - 1), st.lists(st.binary(min_size=16, max_size=16), max_size=6)
        ),
        max_size=5,
    ),
    data=st.data(),
)
def test_digest_groups_read_what_get_many_wrote_and_refuse_a_cut_request(groups, data):
    """A host reads a many-key read's groups (``GetMany.encode``'s table and digests) with
    ``digest_groups``: the same groups in both sets; a request cut anywhere inside them,
    one that goes on after them, or junk, is the same ``ValueError`` in both (or, for
    junk, the same groups)."""
    from dask_ddict.transport.many_key_ops import GetMany

    value = b"".join(GetMany(tuple(groups), 0).encode().parts)
    assert _same("digest_groups", value) == ("ok", groups)
    assert _same("digest_groups", memoryview(bytearray(value))) == ("ok", groups)
    cut = data.draw(st.integers(0, max(0, len(value) - 1)))
    kind, got = _same("digest_groups", value[:cut])
    assert kind == "error" and got[0] is ValueError
    kind, got = _same("digest_groups", value + data.draw(st.binary(min_size=1, max_size=20)))
    assert kind == "error" and got[0] is ValueError and "after its digests" in got[1]
    _same("digest_groups", data.draw(st.binary(max_size=60)))


def test_route_errors_name_the_key_that_is_too_long():
    for s in SETS:
        with pytest.raises(pure.KeyTooLong) as info:
            s.route(["a", "b" * 100], 3, 50, encode_key, None, PLAIN_KEYS, key_digest)
        assert info.value.args[0] == encode_key("b" * 100)
        with pytest.raises(ZeroDivisionError):
            s.route(["a"], 0, 50, encode_key, None, PLAIN_KEYS, key_digest)


@given(st.lists(st.tuples(st.integers(0, 5), st.binary(min_size=16, max_size=16)), max_size=50))
def test_group_is_the_same(routes):
    kind, got = _same("group", routes)
    assert kind == "ok" and sum(map(len, got.values())) == len(routes)
    assert [list(v) for v in got.values()] == [[d for m, d in routes if m == mid] for mid in got]


_ODD_DIGESTS = st.one_of(
    st.binary(min_size=16, max_size=16), st.binary(max_size=2), st.integers(0, 3)
)


@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.integers(0, 5) | st.integers(250, 2**40) | st.sampled_from([True, 1.0]),
                _ODD_DIGESTS,
            ),
            st.lists(st.integers(0, 3), max_size=3),
        ),
        max_size=50,
    )
)
def test_group_positions_is_the_same(routes):
    """Both sets group alike: the same managers in the order of their first keys (an id
    equal to another of another type, ``True`` for ``1``, in the same group), each
    one's digests in its keys' order with their indices in ``routes``; and refuse the
    same routes (not a pair) with the same type of error (Cython words an unpacking's
    error its own way)."""
    outcomes = [_outcome(s.group_positions, routes) for s in SETS]
    kinds = [o if o[0] == "ok" else ("error", o[1][0]) for o in outcomes]
    assert all(k == kinds[0] for k in kinds), outcomes
    kind, got = outcomes[0]
    if kind == "error":
        return
    assert list(got) == list(dict.fromkeys(m for m, _ in routes))
    for mid, (ds, positions) in got.items():
        at = struct.unpack(f"<{len(ds)}I", positions)
        assert list(at) == [i for i, (m, _) in enumerate(routes) if m == mid]
        assert ds == [routes[i][1] for i in at]
    for s in SETS:
        with pytest.raises(TypeError):
            s.group_positions(None)


frames_st = st.lists(
    st.one_of(
        st.none(),
        st.just(False),
        st.binary(max_size=200),
        st.binary(max_size=200).map(memoryview),
        st.binary(max_size=200).map(bytearray),
        st.integers(pure.JOIN - 2, pure.JOIN + 70).map(
            lambda n: memoryview(bytes(range(256)) * (n // 256 + 1))[:n]
        ),
    ),
    max_size=30,
)


@given(frames_st)
def test_pack_and_unpack_are_the_same_and_round_trip(frames):
    kind, parts = _same("pack_frames", frames)
    assert kind == "ok"
    for s in SETS:  # a large frame is sent from where it is, at a multiple of 64
        got = s.pack_frames(frames)
        for f in frames:
            if f is not None and f is not False and memoryview(f).nbytes >= pure.JOIN:
                at = next(i for i, p in enumerate(got) if p is f)
                assert sum(memoryview(p).nbytes for p in got[:at]) % pure.ALIGN == 0
    payload = b"".join(bytes(p) for p in parts)
    kind, back = _same_views("unpack_frames", payload)
    assert kind == "ok"
    assert [f if f is None or f is False else bytes(f) for f in back] == [
        f if f is None or f is False else bytes(f) for f in frames
    ]


def _same_views(name: str, *args: Any) -> Any:
    """:func:`_same` for results that hold views (compared by their bytes)."""

    def flat(outcome: Any) -> Any:
        kind, got = outcome
        if kind != "ok":
            return outcome
        return kind, [f if f is None or f is False else bytes(f) for f in got]

    outcomes = [flat(_outcome(getattr(s, name), *args)) for s in SETS]
    assert all(o == outcomes[0] for o in outcomes), outcomes
    return _outcome(getattr(SETS[-1], name), *args)


@given(frames_st, st.integers(0, pure.JOIN + 80))
def test_unpack_copies_the_frames_under_small_and_views_the_rest(frames, small):
    """``small``: a frame shorter than it is ``bytes`` (a copy: no view for the garbage
    collector to track, issue 33's TCP ``get_many``), the rest are views of the payload;
    the same frames in both sets."""
    payload = bytearray(b"".join(bytes(p) for p in pure.pack_frames(frames)))
    _same_views("unpack_frames", payload, small)
    for s in SETS:
        got = s.unpack_frames(payload, small)
        for f in got:
            if f is not None and f is not False:
                assert type(f) is (bytes if len(f) < small else memoryview), (s, len(f), small)
                assert type(f) is bytes or f.obj is payload or f.obj.obj is payload


@given(frames_st, st.data())
def test_unpack_of_a_cut_or_bad_payload_is_the_same_error(frames, data):
    payload = b"".join(bytes(p) for p in pure.pack_frames(frames))
    cut = data.draw(st.integers(0, len(payload)))
    _same_views("unpack_frames", payload[:cut])
    junk = data.draw(st.binary(max_size=80))
    _same_views("unpack_frames", junk)


def _shard(path: str, versions: list[tuple[bytes, int, int, bytes]]) -> lmdb.Environment:
    """An LMDB data table of ``(digest, checkpoint, flags, frame)`` versions, keyed as
    the shard keys them (digest, then the checkpoint's big-endian complement)."""
    env = lmdb.open(path, map_size=1 << 24, max_dbs=2)
    db = env.open_db(b"data")
    with env.begin(write=True, db=db) as txn:
        for digest, chkpt, flags, frame in versions:
            k = digest + struct.pack(">Q", (1 << 64) - 1 - chkpt)
            txn.put(k, ENTRY.pack(flags, 3, len(frame)) + frame + b"key", db=db)
    return env


@settings(max_examples=40, deadline=None)
@given(
    versions=st.lists(
        st.tuples(
            st.sampled_from([bytes([i]) * 16 for i in range(6)]),
            st.integers(0, 5),
            st.sampled_from([0, TOMBSTONE]),
            st.binary(max_size=40),
        ),
        max_size=20,
    ),
    asked=st.lists(
        st.sampled_from([bytes([i]) * 16 for i in range(8)]) | st.binary(max_size=20), max_size=12
    ),
    chkpt=st.integers(0, 6),
    buffers=st.booleans(),
    small=st.sampled_from([0, 10, 4096]),
)
def test_lookup_frames_is_the_same_on_a_real_lmdb(
    tmp_path_factory, versions, asked, chkpt, buffers, small
):
    env = _shard(str(tmp_path_factory.mktemp("lmdb")), versions)
    try:
        db = env.open_db(b"data")
        tail = struct.pack(">Q", (1 << 64) - 1 - chkpt)
        with env.begin(db=db, buffers=buffers) as txn:
            kind, got = _same_views("lookup_frames", txn, db, asked, tail, small)
            kinds = []
            for s in SETS:  # (small frames: copies, whatever the transaction gives)
                frames = s.lookup_frames(txn, db, asked, tail, small)
                assert all(type(f) is bytes for f in frames if f is not None and len(f) < small)
                kinds.append([type(f) for f in frames])
            assert all(k == kinds[0] for k in kinds)  # (views where the cursor gives views)
        assert kind == "ok"
        newest = {}
        for digest, c, flags, frame in versions:
            if c <= chkpt:
                newest.setdefault(digest, {})[c] = (flags, frame)
        for digest, frame in zip(asked, got):
            seen = newest.get(digest)
            want = None if not seen else seen[max(seen)]
            assert (None if want is None or want[0] & TOMBSTONE else want[1]) == (
                None if frame is None else bytes(frame)
            )
    finally:
        env.close()


def test_lookup_frames_finds_each_keys_newest_version_at_the_checkpoint(tmp_path):
    """Versions at the very checkpoint, older ones, a tombstone over an older version,
    absent keys and digests of the wrong length: the compiled walk (LMDB's C API) and
    the pure one (lmdb's cursor) give the same frames, in order."""
    d = [bytes([i]) * 16 for i in range(6)]
    env = _shard(
        str(tmp_path / "lmdb"),
        [
            (d[0], 3, 0, b"a3"),
            (d[1], 3, 0, b"b3"),
            (d[2], 1, 0, b"c1"),
            (d[3], 3, TOMBSTONE, b""),
            (d[3], 2, 0, b"d2"),
            (d[4], 3, 0, b"e3"),
            (d[4], 1, 0, b"e1"),
        ],
    )
    try:
        db = env.open_db(b"data")
        tail = struct.pack(">Q", (1 << 64) - 1 - 3)
        asked = [d[0], d[1], d[4], d[5], d[0], d[2], d[3], d[4], d[1][:12], d[1] + b"x"]
        with env.begin(db=db, buffers=True) as txn:
            kind, got = _same_views("lookup_frames", txn, db, asked, tail, 4096)
        assert kind == "ok"
        assert got == [b"a3", b"b3", b"e3", None, b"a3", b"c1", None, b"e3", None, None]
    finally:
        env.close()


def _entry_outcome(f: Any, *args: Any) -> tuple[str, Any]:
    """:func:`_outcome` of a ``lookup_entry``, its views compared by their bytes."""
    kind, got = _outcome(f, *args)
    if kind != "ok" or got is None:
        return kind, got
    return kind, (type(got), got.chkpt, got.flags, bytes(got.frame), bytes(got.key))


@settings(max_examples=60, deadline=None)
@given(
    versions=st.lists(
        st.tuples(
            st.sampled_from([bytes([i]) * 16 for i in range(6)]),
            st.integers(0, 5),
            st.sampled_from([0, TOMBSTONE, 2, 3]),
            st.binary(max_size=40),
        ),
        max_size=20,
    ),
    asked=st.sampled_from([bytes([i]) * 16 for i in range(8)]) | st.binary(max_size=20),
    chkpt=st.integers(0, 6) | st.sampled_from([-1, (1 << 64) - 1, 1 << 64, 2.0, True]),
    buffers=st.booleans(),
    raw=st.lists(st.tuples(st.binary(max_size=30), st.binary(max_size=30)), max_size=3),
)
@example(versions=[], asked=bytes(16), chkpt=(1 << 64) - 1, buffers=False, raw=[])  # (MAXQ)
def test_lookup_entry_is_the_same_on_a_real_lmdb(
    tmp_path_factory, versions, asked, chkpt, buffers, raw
):
    """A single key's seek (every same-host get, and the host's): both sets find the
    same version (an ``Entry`` of the same checkpoint, flags, frame and key) as the
    newest at or before ``chkpt``, with the same error for a checkpoint out of range
    or a table holding what no shard writes (``raw``: short keys, short values)."""
    env = _shard(str(tmp_path_factory.mktemp("lmdb")), versions)
    try:
        db = env.open_db(b"data")
        if raw:
            with env.begin(write=True, db=db) as txn:
                for k, v in raw:
                    if k:
                        txn.put(k, v, db=db)
        with env.begin(db=db, buffers=buffers) as txn:
            outcomes = [_entry_outcome(s.lookup_entry, txn, db, asked, chkpt) for s in SETS]
        assert all(o == outcomes[0] for o in outcomes), outcomes
        if raw or not (type(chkpt) is int and 0 <= chkpt < 7):
            return
        kind, got = outcomes[0]
        newest = {c: (flags, frame) for d, c, flags, frame in versions if d == asked and c <= chkpt}
        assert kind == "ok" and (got is None) == (not newest)
        if newest:
            c = max(newest)
            assert got == (Entry, c, newest[c][0], newest[c][1], b"key")
    finally:
        env.close()


values_st = st.one_of(
    st.integers(),
    st.text(max_size=30),
    st.binary(max_size=300),
    st.lists(st.integers(), max_size=5),
    st.none(),
    st.integers(0, 50).map(lambda n: np.arange(n)),
)


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.one_of(values_st, st.sampled_from(["<absent>", "<wait>"])), max_size=20),
    mids=st.data(),
    as_views=st.booleans(),
    damage=st.integers(-1, 40),
)
def test_decode_frames_is_the_same(values, mids, as_views, damage):
    frames = [
        None if _is(v, "<absent>") else False if _is(v, "<wait>") else dumps_value(v).join()
        for v in values
    ]
    if damage >= 0 and frames and frames[0] not in (None, False):
        broken = bytearray(frames[0])
        broken[damage % len(broken)] ^= 0xFF  # (a damaged frame: the same error either way)
        frames[0] = bytes(broken)
    ids = mids.draw(st.lists(st.integers(0, 3), min_size=len(frames), max_size=len(frames)))
    got: dict[int, list[Any]] = {}
    for mid, f in zip(ids, frames):
        got.setdefault(mid, []).append(memoryview(f) if as_views and f not in (None, False) else f)
    keys = list(range(len(frames)))
    routes = [(mid, DIGESTS[0]) for mid in ids]
    absent, wait = object(), object()
    outcomes = []
    for s in SETS:
        for small in (True, False):
            kind, out = _outcome(
                s.decode_frames, keys, routes, got, loads_value, absent, wait, small
            )
            outcomes.append((kind, _comparable(out, absent, wait) if kind == "ok" else out))
    assert all(o == outcomes[0] for o in outcomes), outcomes
    for s in SETS:  # (get_many's own path: the values and the marked ones, no pairs)
        for small in (True, False):
            kind, got_values = _outcome(
                s.decode_values, routes, got, loads_value, absent, wait, small
            )
            assert kind == outcomes[0][0]
            if kind != "ok":
                assert got_values == outcomes[0][1]
                continue
            decoded_values, marked = got_values
            assert _comparable(list(zip(keys, decoded_values)), absent, wait) == outcomes[0][1]
            assert marked == [i for i, v in enumerate(decoded_values) if v is absent or v is wait]
    if outcomes[0][0] == "ok":
        for s in SETS:
            _, marked = s.decode_values(routes, got, loads_value, absent, wait, False)
            assert marked == [
                i for i, v in enumerate(values) if _is(v, "<absent>") or _is(v, "<wait>")
            ]
    if damage < 0 and outcomes[0][0] == "ok":
        assert outcomes[0][1] == _comparable(list(enumerate(values)), "<absent>", "<wait>")


@contextlib.contextmanager
def _snapshot(
    tmp_path_factory: Any, versions: list[Any], chkpt: int, buffers: bool
) -> Iterator[tuple[Any, Any, bytes]]:
    """A snapshot of a new shard that holds ``versions``: its transaction, data table,
    and the seek tail of checkpoint ``chkpt``."""
    env = _shard(str(tmp_path_factory.mktemp("lmdb")), versions)
    try:
        db = env.open_db(b"data")
        with env.begin(db=db, buffers=buffers) as txn:
            yield txn, db, struct.pack(">Q", (1 << 64) - 1 - chkpt)
    finally:
        env.close()


#: A shard's versions: (digest, checkpoint, flags, value).
_STORED = st.lists(
    st.tuples(
        st.sampled_from([bytes([i]) * 16 for i in range(6)]),
        st.integers(0, 4),
        st.sampled_from([0, TOMBSTONE]),
        values_st,
    ),
    max_size=16,
)


@settings(max_examples=60, deadline=None)
@given(
    stored=_STORED,
    asked=st.lists(st.sampled_from([bytes([i]) * 16 for i in range(8)]), max_size=12),
    chkpt=st.integers(0, 5),
    buffers=st.booleans(),
    small=st.sampled_from([0, 40, 4096]),
    damage=st.integers(-1, 40),
)
def test_lookup_values_decodes_what_lookup_frames_and_decode_frames_give(
    tmp_path_factory, stored, asked, chkpt, buffers, small, damage
):
    """``lookup_values`` (a same-host ``get_many``'s walk, decoding in the snapshot) gives,
    in both sets, the values that ``lookup_frames``, ``taken_out`` and ``decode_frames``
    give together (``absent`` for an absent key or a deletion; a damaged frame's error),
    and the bytes and number of frames it copied, as ``taken_out`` counts them; the
    order of the answers is the order asked."""
    versions = [(d, c, flags, dumps_value(v).join()) for d, c, flags, v in stored]
    if damage >= 0 and versions and len(versions[0][3]) > 0:
        d, c, flags, frame = versions[0]
        broken = bytearray(frame)
        broken[damage % len(broken)] ^= 0xFF
        versions[0] = (d, c, flags, bytes(broken))
    absent = object()
    with _snapshot(tmp_path_factory, versions, chkpt, buffers) as (txn, db, tail):
        frames = pure.lookup_frames(txn, db, asked, tail, small)
        taken, nbytes, copies = pure.taken_out(frames, bytes)
        routes = [(0, d) for d in asked]
        kind, want = _outcome(
            pure.decode_frames, asked, routes, {0: taken}, loads_value, absent, 0, False
        )
        for s in SETS:
            got = _outcome(s.lookup_values, txn, db, asked, tail, small, absent, bytes, loads_value)
            if kind != "ok":
                assert got[0] == "error" and got[1][0] is want[0], (got, want)
                continue
            assert got[0] == "ok", got
            values, n, c = got[1]
            assert type(values) is pure.Decoded and (n, c) == (nbytes, copies)
            assert _comparable(list(zip(asked, values)), absent, 0) == _comparable(want, absent, 0)


@settings(max_examples=60, deadline=None)
@given(
    stored=_STORED,
    mids=st.lists(st.integers(0, 3) | st.integers(250, 300), max_size=14),
    asked=st.data(),
    chkpt=st.integers(0, 5),
    buffers=st.booleans(),
    small=st.sampled_from([0, 40, 4096]),
)
def test_place_values_writes_each_managers_values_where_its_keys_are(
    tmp_path_factory, stored, mids, asked, chkpt, buffers, small
):
    """A same-host ``get_many`` read in place (``group_positions``, then each manager's
    ``place_values``, then ``marked``) gives, in both sets, what ``group`` and
    ``lookup_values`` give, each value at its key's index; a ``positions`` that does not
    fit is refused before anything is written."""
    digests = asked.draw(
        st.lists(st.sampled_from([bytes([i]) * 16 for i in range(8)]), min_size=len(mids))
    )[: len(mids)]
    routes = list(zip(mids, digests))
    versions = [(d, c, flags, dumps_value(v).join()) for d, c, flags, v in stored]
    absent = object()
    rest = (small, absent, bytes, loads_value)
    with _snapshot(tmp_path_factory, versions, chkpt, buffers) as (txn, db, tail):
        groups = pure.group(routes)
        for s in SETS:
            placed = s.group_positions(routes)
            assert list(placed) == list(groups)
            out = ["<unset>"] * len(routes)
            for mid, (ds, positions) in placed.items():
                assert ds == groups[mid]
                at = struct.unpack(f"<{len(ds)}I", positions)
                assert [routes[i] for i in at] == [(mid, d) for d in ds]
                with pytest.raises(ValueError, match="positions"):
                    s.place_values(txn, db, ds, positions + b"\0", out, tail, *rest)
                if ds:
                    with pytest.raises(ValueError, match="beyond"):
                        s.place_values(txn, db, ds, positions, out[:0], tail, *rest)
                assert all(_is(out[i], "<unset>") for i in at)  # (nothing written)
                copied = s.place_values(txn, db, ds, positions, out, tail, *rest)
                want, *counted = pure.lookup_values(txn, db, ds, tail, *rest)
                assert list(copied) == counted
                got = [out[i] for i in at]
                assert _comparable(list(zip(ds, got)), absent, 0) == _comparable(
                    list(zip(ds, want)), absent, 0
                )
            assert not any(_is(v, "<unset>") for v in out)
            assert s.marked(out, absent) == [i for i, v in enumerate(out) if v is absent]


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.one_of(values_st, st.just("<absent>")), max_size=20), mids=st.data())
def test_decode_frames_takes_a_decoded_answer_as_it_is(values, mids):
    """A manager's :class:`Decoded` answer (values, its absent keys the reader's marker)
    is put in key order as it is, beside other managers' frames, in both sets."""
    absent, wait = object(), object()
    ids = mids.draw(st.lists(st.integers(0, 3), min_size=len(values), max_size=len(values)))
    got: dict[int, list[Any]] = {}
    for mid, v in zip(ids, values):
        if mid % 2:  # (odd managers answered values, even ones frames)
            got.setdefault(mid, pure.Decoded()).append(absent if _is(v, "<absent>") else v)
        else:
            got.setdefault(mid, []).append(None if _is(v, "<absent>") else dumps_value(v).join())
    keys = list(range(len(values)))
    routes = [(mid, DIGESTS[0]) for mid in ids]
    for s in SETS:
        out = s.decode_frames(keys, routes, got, loads_value, absent, wait, True)
        assert _comparable(out, absent, wait) == _comparable(
            list(zip(keys, [absent if _is(v, "<absent>") else v for v in values])), absent, wait
        )


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(
        st.one_of(
            values_st,
            st.integers(1000, 6000).map(b"v".__mul__),  # (around SMALL_FRAME: views, copies)
            st.sampled_from(["<absent>", "<wait>"]),
        ),
        max_size=16,
    ),
    data=st.data(),
    small=st.sampled_from([0, 64, 4096]),
    damage=st.integers(-1, 60),
)
def test_unpack_values_decodes_what_unpack_frames_and_decode_frames_give(
    values, data, small, damage
):
    """A many-key reply decoded where it was received (a socket ``get_many``'s one pass)
    gives, in both sets, each group's values as ``unpack_frames`` and ``decode_frames``
    give them together, ``None`` where a reader must wait, and the same error for a cut,
    damaged or miscounted reply."""
    frames = [
        None if _is(v, "<absent>") else False if _is(v, "<wait>") else dumps_value(v).join()
        for v in values
    ]
    payload = bytearray(b"".join(bytes(p) for p in pure.pack_frames(frames)))
    if damage >= 0 and payload:
        payload[damage % len(payload)] ^= 0xFF
    cut = data.draw(st.sampled_from([None, 0, 3, len(payload) // 2]))
    if cut is not None:
        payload = payload[:cut]
    counts = []
    left = len(frames)
    while left > 0:
        counts.append(data.draw(st.integers(1, left)))
        left -= counts[-1]
    if data.draw(st.booleans()):
        counts.append(data.draw(st.integers(0, 2)))  # (a group too many, or an empty one)
    absent = object()
    outcomes = []
    for s in SETS:
        kind, got = _outcome(s.unpack_values, payload, counts, small, absent, loads_value)
        if kind == "ok" and got is not None:
            assert all(type(g) is pure.Decoded for g in got)
            got = [_comparable(list(enumerate(g)), absent, 0) for g in got]
        outcomes.append((kind, got))
    assert all(o == outcomes[0] for o in outcomes), outcomes
    kind, want = _outcome(pure.unpack_frames, payload, small)
    if kind == "error":
        assert outcomes[0] == (kind, want)
        return
    if len(want) != sum(counts):
        assert outcomes[0][0] == "error" and outcomes[0][1][0] is ValueError
        return
    if any(f is False for f in want):
        assert outcomes[0] == ("ok", None)
        return
    at, groups = 0, []
    for n in counts:
        routes = [(0, DIGESTS[0])] * n
        got = {0: want[at : at + n]}
        w = _outcome(pure.decode_frames, list(range(n)), routes, got, loads_value, absent, 0, False)
        if w[0] == "error":
            assert outcomes[0][0] == "error" and outcomes[0][1][0] is w[1][0], (outcomes, w)
            return
        groups.append(_comparable(w[1], absent, 0))
        at += n
    assert outcomes[0] == ("ok", groups)
    if damage < 0 and cut is None:
        flat = [v for g in groups for _, v in g]
        assert flat == [v for _, v in _comparable(list(enumerate(values)), "<absent>", 0)]


def test_a_frame_length_near_2_63_is_the_same_error():
    """A many-key reply whose table claims a frame of nearly 2**63 bytes: both sets say it
    ends inside a frame (the compiled bound must not wrap around and read past it)."""
    payload = struct.pack("<I2q", 2, 2**63 - 8, 10) + bytes(64)
    for name, args in (
        ("unpack_frames", (payload, 0)),
        ("unpack_values", (payload, [2], 0, None, bytes)),
    ):
        outcomes = [_outcome(getattr(s, name), *args) for s in SETS]
        assert all(o == outcomes[0] for o in outcomes), outcomes
        assert outcomes[0][0] == "error" and outcomes[0][1][0] is ValueError


@pytest.mark.parametrize("kind", ["big ids", "iterators", "missing", "short"])
def test_decode_walks_any_answers_as_pure_does(kind):
    """The compiled walk of each manager's answers (a table for small ids, lists by
    index) gives what ``pure`` gives for what it does not take that way: ids past the
    table or not ints, answers that are not lists, a route to a manager with no answer
    (``KeyError``), a manager with fewer answers than routes (``StopIteration``)."""
    values = [b"a", b"bb", None, 7, "x", [1]]
    frames = [None if v is None else dumps_value(v).join() for v in values]
    mids = [10**30, -3, True, 255, 256, "m"] if kind == "big ids" else [0, 1, 0, 2, 1, 0]
    got: dict[Any, Any] = {}
    for mid, f in zip(mids, frames):
        got.setdefault(mid, []).append(f)
    routes = [(mid, DIGESTS[0]) for mid in mids]
    if kind == "missing":
        routes[3] = (99, DIGESTS[0])
    if kind == "short":
        routes.append((1, DIGESTS[0]))
    absent = object()
    outcomes = []
    for s in SETS:
        fresh = {m: iter(fs) for m, fs in got.items()} if kind == "iterators" else got
        o = _outcome(s.decode_values, routes, fresh, loads_value, absent, 0, True)
        outcomes.append(o if o[0] == "error" else _comparable(list(enumerate(o[1][0])), absent, 0))
    assert all(o == outcomes[0] for o in outcomes), outcomes
    if kind in ("big ids", "iterators"):
        assert outcomes[0] == _comparable(list(enumerate(values)), None, 0)
    else:
        assert outcomes[0][0] == "error"
        assert outcomes[0][1][0] is (KeyError if kind == "missing" else StopIteration)


@settings(max_examples=100, deadline=None)
@given(value=values_st, as_view=st.booleans(), damage=st.integers(-1, 40))
def test_decoded_is_the_frames_decoder(value, as_view, damage):
    """One value's frame (a single get's): both sets give what ``loads_value`` gives,
    or its error, damaged frames included."""
    frame = dumps_value(value).join()
    if damage >= 0:
        broken = bytearray(frame)
        broken[damage % len(broken)] ^= 0xFF
        frame = bytes(broken)
    given_ = memoryview(frame) if as_view else frame
    outcomes = [_outcome(s.decoded, given_, loads_value) for s in SETS]
    shown = [
        (k, ("array", v.tolist()) if isinstance(v, np.ndarray) else v) if k == "ok" else (k, v[0])
        for k, v in outcomes
    ]
    assert all(o == shown[0] for o in shown), outcomes
    if damage < 0:
        assert shown[0] == (
            "ok",
            ("array", value.tolist()) if isinstance(value, np.ndarray) else value,
        )


def test_decoded_returns_a_taken_value_as_it_is():
    """A value a same-host reader took out of its frame (``Taken``) is what both sets
    give back, the same object, with or without the frames' decoder; anything else
    that is no buffer is the decoder's to refuse, as it was."""
    value = b"x" * 5000
    for s in SETS:
        assert s.decoded(Taken(value), loads_value) is value
        assert s.decoded(Taken(value), lambda f: loads_value(f, None)) is value
        with pytest.raises(TypeError):
            s.decoded(object(), loads_value)


def _is(v: Any, marker: str) -> bool:
    return isinstance(v, str) and v == marker


def _comparable(pairs: list[tuple[Any, Any]], absent: Any, wait: Any) -> list[Any]:
    return [
        (
            k,
            "A"
            if v is absent or _is(v, absent)
            else "W"
            if v is wait or _is(v, wait)
            else ("array", v.tolist())
            if isinstance(v, np.ndarray)
            else v,
        )
        for k, v in pairs
    ]


# -- batch puts ------------------------------------------------------------------------------

DIGESTS = [bytes([i]) * 16 for i in range(5)]


def _frame(kind: str, data: bytes) -> Any:
    """One of the frames a batch record carries: a value's parts, a received view, ..."""
    if kind == "framed":  # (a header and the bytes, as dumps_value frames them)
        return Framed([data[:3], memoryview(data[3:])], len(data))
    if kind == "view":
        return memoryview(bytearray(data))
    return None if kind == "none" and not data else data


record_frames_st = st.builds(
    _frame,
    st.sampled_from(["framed", "view", "bytes", "none"]),
    st.binary(max_size=64) | st.integers(60_000, 90_000).map(b"y".__mul__),
)
records_st = st.lists(
    st.tuples(st.sampled_from(DIGESTS), st.binary(min_size=1, max_size=12), record_frames_st),
    max_size=14,
)


def test_entries_bytes_is_the_same():
    records = [(DIGESTS[0], b"k", _frame(kind, b"abcdef")) for kind in ("framed", "view", "bytes")]
    assert _same("entries_bytes", records) == ("ok", 3 * 7)
    assert _same("entries_bytes", records + [(DIGESTS[0], b"k", None)]) == ("ok", 3 * 7 + 1)
    assert _same("entries_bytes", [(b"d", b"k")])[0] == "error"  # (not a record)
    assert _same("entries_bytes", [(b"d", b"k", 5)])[0] == "error"  # (not a buffer)


@settings(max_examples=60, deadline=None)
@given(
    before=st.lists(
        st.tuples(st.sampled_from(DIGESTS), st.integers(0, 3), st.sampled_from([0, TOMBSTONE])),
        max_size=10,
    ),
    records=records_st,
    chkpt=st.integers(3, 4),
    start=st.integers(0, 3),
    flags=st.sampled_from([0, 2, TOMBSTONE]),
    most=st.sampled_from([0, 40, 1 << 20]),
)
@example(
    before=[],
    records=[(DIGESTS[i % 5] + bytes([i]), b"k", b"x" * 90_000) for i in range(14)],
    chkpt=3,
    start=0,
    flags=2,
    most=1 << 20,
)  # (the map fills: refused at the same record)
def test_put_entries_is_put_over_in_a_loop_on_a_real_shard(
    tmp_path_factory, before, records, chkpt, start, flags, most
):
    """Each set's ``put_entries`` leaves a real shard as ``ShardStore.put_over`` of the
    same records does (the rule), says the same change in keys seen, stops at the same
    record (one over ``most``) and, in a map too small, is refused at the same one."""
    outcomes, tables = [], []
    for s in [None, *SETS]:  # (None: the reference, put_over in a loop)
        store = ShardStore(str(tmp_path_factory.mktemp("shard")), 128 << 10)  # (map: 1.1 MiB)
        try:
            with store.write() as txn:
                for digest, c, f in before:
                    store.put(txn, digest, c, b"old", b"v" * c, f)
            txn = store.env.begin(write=True, buffers=True)
            try:
                if s is None:
                    outcomes.append(_put_over_loop(store, txn, records, start, chkpt, flags, most))
                else:
                    tail = struct.pack(">Q", (1 << 64) - 1 - chkpt)
                    kind, got = _outcome(
                        s.put_entries,
                        txn,
                        store._data,
                        records,
                        start,
                        tail,
                        flags,
                        most,
                        lmdb.MapFullError,
                    )
                    outcomes.append((kind, got[:2] + (type(got[2]),) if kind == "ok" else got))
                tables.append(
                    [(bytes(k), bytes(v)) for k, v in txn.cursor(store._data)]
                    if outcomes[-1][1][2] is type(None)
                    else None
                )
            finally:
                txn.abort()
        finally:
            store.destroy()
    assert all(o == outcomes[0] for o in outcomes), outcomes
    assert all(t == tables[0] for t in tables)


def _put_over_loop(
    store: ShardStore,
    txn: lmdb.Transaction,
    records: list[Any],
    start: int,
    chkpt: int,
    flags: int,
    most: int,
) -> tuple[str, Any]:
    delta = 0
    for i in range(start, len(records)):
        digest, kb, frame = records[i]
        nbytes = (
            0
            if frame is None
            else frame.nbytes
            if isinstance(frame, Framed)
            else memoryview(frame).nbytes
        )
        if 16 + nbytes + len(kb) >= most:
            return "ok", (i, delta, type(None))
        try:
            live = store.put_over(txn, digest, chkpt, kb, frame, flags)
        except Exception as e:  # noqa: BLE001 - (a full map: the kernels' LMDB error)
            assert isinstance(e.__cause__, lmdb.MapFullError), e
            return "ok", (i, delta, lmdb.MapFullError)
        if live == bool(flags & TOMBSTONE):
            delta += -1 if live else 1
    return "ok", (len(records), delta, type(None))


wire_records_st = st.lists(
    st.tuples(
        st.integers(0, 5), st.sampled_from(DIGESTS), st.binary(max_size=12), record_frames_st
    ),
    max_size=14,
)


def _data(frame: Any) -> bytes:
    """A record's frame as the bytes it stands for."""
    if isinstance(frame, Framed):
        return b"".join(bytes(p) for p in frame.parts)
    return b"" if frame is None else bytes(frame)


def _by_mid(got: dict[int, list[Any]]) -> dict[int, list[Any]]:
    """Unpacked records, comparable: frames as bytes, with the type they came as."""
    return {mid: [(d, k, bytes(f), type(f)) for d, k, f in rs] for mid, rs in got.items()}


@settings(max_examples=80, deadline=None)
@given(records=wire_records_st)
def test_pack_and_unpack_records_are_the_same_and_round_trip(records):
    """A batch's (or many-put's) request: the same bytes from both sets, small records
    joined into runs, a large frame sent from where it is; unpacked the same, in order,
    small frames as copies."""
    outcomes = []
    for s in SETS:
        parts, total = s.pack_records(records)
        for *_, f in records:  # (a large frame's parts are sent as they are)
            if len(_data(f)) >= pure.JOIN:
                assert any(p is (f.parts[-1] if isinstance(f, Framed) else f) for p in parts)
        outcomes.append((b"".join(bytes(p) for p in parts), total))
    assert all(o == outcomes[0] for o in outcomes)
    payload, total = outcomes[0]
    assert len(payload) == total
    kinds = [_outcome(s.unpack_records, payload) for s in SETS]
    back = [_by_mid(got) for _, got in kinds]
    assert all(kind == "ok" for kind, _ in kinds) and all(b == back[0] for b in back)
    want: dict[int, list[Any]] = {}
    for mid, d, k, f in records:
        data = _data(f)
        want.setdefault(mid, []).append(
            (d, k, data, bytes if len(data) < pure.JOIN else memoryview)
        )
    assert back[0] == want


@settings(max_examples=60, deadline=None)
@given(records=wire_records_st, cut=st.integers(0, 200), junk=st.binary(max_size=60))
def test_unpack_records_of_a_cut_or_bad_request_is_the_same_error(records, cut, junk):
    payload = b"".join(bytes(p) for p in pure.pack_records(records)[0])
    for bad in (payload[: max(0, len(payload) - cut)], junk, payload + junk):
        outcomes = [_outcome(s.unpack_records, bad) for s in SETS]
        shown = [(k, _by_mid(g) if k == "ok" else g) for k, g in outcomes]
        assert all(x == shown[0] for x in shown), shown


def test_packing_records_whose_frames_lie_about_their_size_is_refused():
    liar = Framed([b"abc"], 5)  # (says 5 bytes, holds 3)
    for rec in (
        [(0, DIGESTS[0], b"k", liar)],
        [(0, DIGESTS[0], b"k", Framed([bytes(1 << 20)], 9))],
    ):
        assert _same("pack_records", rec) == ("error", (ValueError, pure._UNEVEN))
    assert _same("pack_records", [(-1, DIGESTS[0], b"k", b"v")])[0] == "error"


class _Pickler:
    """A custom value pickler (``pickler(value_pickler=...)``): the general path."""

    def dump(self, obj: Any, f: Any) -> None:
        pickle.dump(obj, f)

    def load(self, f: Any) -> Any:
        return pickle.load(f)


@settings(max_examples=100, deadline=None)
@given(
    key=keys_st,
    value=values_st | st.binary(max_size=300) | st.binary(max_size=3).map(memoryview),
    custom=st.booleans(),
)
def test_a_router_frames_a_put_as_dumps_value_does(key, value, custom):
    """``Router.record``: the key's route and the value's frame, byte for byte what
    ``dumps_value`` gives (the compiled set frames ``bytes`` itself), in both sets; and
    ``Router.framed``, the frame alone (a lane that routed the key already), the same."""
    dumps = dumps_value if not custom else (lambda v: dumps_value(v, _Pickler()))
    outcomes = []
    for s in SETS:
        router = s.Router(5, 64, encode_key, None, PLAIN_KEYS, key_digest)
        kind, got = _outcome(router.record, key, value, dumps)
        if kind == "ok":
            alone = router.framed(value, dumps)
            assert type(alone) is Framed and alone.nbytes == got[3].nbytes
            assert b"".join(bytes(p) for p in alone.parts) == b"".join(
                bytes(p) for p in got[3].parts
            )
        outcomes.append(
            (
                kind,
                got[:3] + (b"".join(bytes(p) for p in got[3].parts), got[3].nbytes)
                if kind == "ok"
                else got,
            )
        )
        if kind == "ok":  # (a Framed, made as tuple.__new__ makes it: its fields in place)
            assert type(got[3]) is Framed and tuple(got[3]) == (got[3].parts, got[3].nbytes)
            parts = got[3].parts
            if type(parts) is tuple and all(type(p) is bytes for p in parts):  # (hashable)
                assert hash(got[3]) == hash(tuple(got[3]))
    assert all(o == outcomes[0] for o in outcomes), outcomes
    if outcomes[0][0] == "ok":
        want = dumps(value)
        assert outcomes[0][1][3:] == (b"".join(bytes(p) for p in want.parts), want.nbytes)
        back = loads_value(b"".join(bytes(p) for p in want.parts), _Pickler() if custom else None)
        assert (
            np.array_equal(back, value)
            if isinstance(value, np.ndarray)
            else back == (bytes(value) if isinstance(value, memoryview) else value)
        )


@given(
    st.lists(
        st.integers(-(2**33), 2**33)
        | st.sampled_from(
            [0, 255, 256, 65535, 65536, -1, 2**31 - 1, -(2**31), 2**31, -(2**31) - 1, 2**64, True]
        )
    )
)
def test_route_writes_int_keys_as_pickle_does(keys):
    """The compiled kernel writes 32-bit int keys itself: their bytes are
    ``pickle.dumps(key, 5)``'s, at every opcode's bounds (and a bool stays a bool)."""
    for s in SETS:
        router = s.Router(7, 1 << 20, encode_key, None, PLAIN_KEYS, key_digest)
        assert [router.one(k)[2] for k in keys] == [pickle.dumps(k, 5) for k in keys]


@given(records=records_st, most=st.integers(-1, 100_000))
def test_leading_within_is_the_same(records, most):
    kind, n = _same("leading_within", records, most)
    assert kind == "ok" and n == next(
        (i for i, r in enumerate(records) if len(_data(r[2])) > most), len(records)
    )


@given(
    frames=st.lists(
        st.none()
        | st.just(False)
        | st.binary(max_size=20)
        | st.binary(max_size=20).map(memoryview),
        max_size=12,
    )
)
def test_taken_out_is_the_same(frames):
    """A same-host reader's frames: views given to ``out``, copies counted, in both sets."""

    def out(f: memoryview) -> Any:
        return ("out", bytes(f))

    kind, got = _same("taken_out", frames, out)
    copies = [f for f in frames if type(f) is bytes]
    assert kind == "ok" and got == (
        [out(f) if type(f) is memoryview else f for f in frames],
        sum(map(len, copies)),
        len(copies),
    )


@settings(max_examples=80, deadline=None)
@given(
    status=st.integers(0, 255),
    ival=st.integers(-(2**63), 2**63 - 1),
    payload=st.binary(max_size=300),
    cut=st.integers(0, 400),
    small=st.integers(0, 400),
    room=st.integers(0, 300),
    end=st.booleans(),
)
def test_receive_reply_is_the_same_and_reads_one_reply(
    status, ival, payload, cut, small, room, end
):
    """A reply, its first ``cut`` bytes already in the buffer and the rest on a socket
    (cut short by the peer's close with ``end``): both sets give the same answer, and
    the header's fields, with the payload when it is under ``small`` and fits."""
    reply = kernels.REPLY.pack(status, 7, ival, len(payload)) + payload
    cut = min(cut, len(reply))
    size = kernels.REPLY.size + room
    outcomes = []
    for s in SETS:
        a, b = socket.socketpair()
        with a, b:
            buf = bytearray(max(size, cut))
            buf[:cut] = reply[:cut]
            b.sendall(reply[cut:-1] if end else reply[cut:])
            if end:
                b.close()
            outcomes.append(_outcome(s.receive_reply, a, buf, cut, None, small))
    assert all(o == outcomes[0] for o in outcomes), outcomes
    kind, got = outcomes[0]
    whole = len(payload) < small and len(payload) <= len(buf) - kernels.REPLY.size
    there = max(cut, len(reply) - 1) if end else len(reply)  # (bytes the kernel can have)
    if there < kernels.REPLY.size + (len(payload) if whole else 0):
        assert got == (ConnectionResetError, "connection closed by peer")
        return
    assert kind == "ok" and got[:3] == (status, ival, len(payload))
    assert got[3] == (payload if whole else None)


def test_receive_reply_says_quiet_when_its_wait_goes_by():
    for s in SETS:
        a, b = socket.socketpair()
        with a, b:
            a.settimeout(0.01)
            head = kernels.REPLY.pack(0, 1, 2, 3)
            b.sendall(head[:5])
            buf = bytearray(64)
            assert s.receive_reply(a, buf, 0, 0.01, 100) == (kernels.QUIET, 0, 0, None, 5)
            b.sendall(head[5:] + b"abc")  # (then the rest: nothing received was lost)
            assert s.receive_reply(a, buf, 5, 0.01, 100) == (0, 2, 3, b"abc", 27)


def test_receive_reply_on_a_socket_closed_meanwhile_raises_ebadf_instead_of_waiting():
    """(Another thread closed the connection between two waits: no wait goes on.)"""
    for wait in (None, 0.01):
        outcomes = []
        for s in SETS:
            a, b = socket.socketpair()
            with b:
                a.settimeout(wait)
                a.close()
                outcomes.append(_outcome(s.receive_reply, a, bytearray(64), 0, wait, 100))
        assert all(o == outcomes[0] for o in outcomes), outcomes
        assert outcomes[0][0] == "error" and outcomes[0][1][0] is OSError
        assert outcomes[0][1][1] == f"[Errno {errno.EBADF}] {os.strerror(errno.EBADF)}"


# -- a host's requests ----------------------------------------------------------------------

requests_st = st.tuples(
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(0, 2**64 - 1),
    st.floats(allow_nan=False) | st.just(-1.0),
    st.integers(0, 2**64 - 1),
    st.binary(max_size=40),
    st.binary(max_size=300),
)


def _request(fields: tuple[Any, ...]) -> bytes:
    op, flags, mid, tag, chkpt, arg, client, timeout, rid, keysec, value = fields
    term = (mid * 7919) & 0xFFFF  # (some term, the same for the same fields)
    return (
        kernels.REQUEST.pack(
            op, flags, term, len(keysec), mid, tag, chkpt, arg, client, timeout, len(value), rid
        )
        + keysec
        + value
    )


@settings(max_examples=100, deadline=None)
@example(
    requests=[(0, 0, 0, 0, 0, 0, 0, -1.0, 0, b"", b"")], cut=144, most=0, room=1, pos=0, lying=1
)
@given(
    requests=st.lists(requests_st, min_size=1, max_size=4),
    cut=st.integers(0, 2000),
    most=st.integers(-2, 400),
    room=st.integers(1, 200),
    pos=st.integers(0, 100),
    lying=st.integers(1, 2**64 - 1) | st.none(),
)
def test_take_request_is_the_same_and_takes_each_request_whole(
    requests, cut, most, room, pos, lying
):
    """Requests in a reader's buffer, the last cut short (``cut``), a header whose value
    length lies (``lying``: more than follow it): both sets take the same requests, leave
    the same bytes, and say the same need for one that is not whole or whose value is
    over ``most``."""
    stream = b"".join(_request(f) for f in requests)
    if lying is not None:
        stream += kernels.REQUEST.pack(2, 0, 0, 16, 1, 9, 0, 0, 0, -1.0, lying, 0) + b"d" * 16
    stream = stream[:cut] if cut < len(stream) else stream
    outcomes = []
    for s in SETS:
        a, b = socket.socketpair()
        with a, b:
            r = Reader(a, room)
            r.reserve(pos + len(stream) + 1)
            r._buf[: pos + len(stream)] = b"x" * pos + stream
            r._pos, r._end = pos, pos + len(stream)
            taken, tag = [], [0]
            while True:
                got = _outcome(s.take_request, most, Request, r, tag)
                taken.append((got, tag[0], r._pos, r._end))
                if got[0] != "ok" or type(got[1]) is int:
                    break
        outcomes.append(taken)
    assert outcomes[0] == outcomes[1], outcomes
    at = 0
    for (kind, got), tag, _, _ in outcomes[0]:
        assert kind == "ok"
        if type(got) is int:  # (what the next request needs: more than is here, or too large)
            left = stream[at:]
            if len(left) < kernels.REQUEST.size:
                assert got == kernels.REQUEST.size
            else:
                head = kernels.REQUEST.unpack_from(left)
                assert got == kernels.REQUEST.size + head[3] + head[10]
                assert head[10] > most or len(left) < got
            break
        f = next(f for f in requests if _request(f) == stream[at : at + len(_request(f))])
        op, flags, mid, tagged, chkpt, arg, client, timeout, rid, keysec, value = f
        assert type(got) is Request and tag == tagged
        assert got == (
            op,
            flags,
            mid,
            chkpt,
            arg,
            client,
            None if timeout < 0 else timeout,
            keysec[:16],
            keysec[16:],
            value,
            rid,
            (mid * 7919) & 0xFFFF,
        )
        at += len(_request(f))


def test_take_request_reads_odd_timeouts_and_refuses_a_tag_list_without_an_item():
    """NaN, -0.0 and -inf timeouts read as pure reads them (NaN compares unequal, so
    apart from the fuzzing above); a tag list with no item is an ``IndexError`` (never a
    write past a list), and no list a ``TypeError``, in both sets."""
    for timeout, want in ((float("nan"), "nan"), (-0.0, "0.0"), (float("-inf"), "None")):
        for s in SETS:
            a, b = socket.socketpair()
            with a, b:
                r = Reader(a, 256)
                data = _request((2, 0, 3, 5, 0, 0, 0, timeout, 0, b"d" * 16, b""))
                r._buf[: len(data)] = data
                r._end = len(data)
                got = s.take_request(100, Request, r, [0])
                assert repr(got.timeout).lstrip("-") == want, (s, got.timeout)
                r._pos = 0
                with pytest.raises(IndexError):
                    s.take_request(100, Request, r, [])
                r._pos = 0
                with pytest.raises(TypeError):
                    s.take_request(100, Request, r, None)


class _Wrapped:
    """A socket behind an object of another type: its descriptor is asked for."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.asked = sock, 0

    def fileno(self) -> int:
        self.asked += 1
        return self.sock.fileno()

    def recv_into(self, *args: Any) -> int:
        return self.sock.recv_into(*args)


class _Socket(socket.socket):
    """A subclass of the standard library's socket: its descriptor is read in place."""


def test_receive_nowait_reads_the_descriptor_of_any_socket_and_refuses_a_closed_one():
    """The compiled set reads a socket's descriptor in place (``socket.socket`` and its
    subclasses), and asks any other object for it: both sets receive the same bytes
    through each, and both raise ``EBADF`` once the socket is closed (never a read of
    a descriptor another file may have taken)."""
    for s in SETS:
        for make in (lambda x: x, _Wrapped, lambda x: _Socket(fileno=x.detach())):
            a, b = socket.socketpair()
            sock = make(a)
            with b:
                r = Reader(sock, 64)
                b.sendall(b"hello")
                assert s.receive_nowait(r) == 5 and bytes(r._buf[r._pos : r._end]) == b"hello"
                if type(sock) is _Wrapped and s is not pure:
                    assert sock.asked == 1
                (sock.sock if type(sock) is _Wrapped else sock).close()
                with pytest.raises(OSError) as e:
                    s.receive_nowait(r)
                assert e.value.errno == errno.EBADF, (s, make)


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.binary(min_size=1, max_size=300), max_size=4),
    room=st.integers(1, 200),
    read=st.integers(0, 200),
    end=st.booleans(),
)
def test_receive_nowait_is_the_same_as_fill_nowait(chunks, room, read, end):
    """What a connection sent, received without waiting into a reader whose buffer may be
    full (moved down or grown first): both sets receive the same bytes, say 0 when
    nothing is ready and raise the same error at the end of the stream."""
    outcomes = []
    for s in SETS:
        a, b = socket.socketpair()
        with a, b:
            r = Reader(a, room)
            r._end = room  # (a full buffer, of which ``read`` bytes were read already)
            r._pos = min(read, room)
            seen = []
            for chunk in chunks:
                b.sendall(chunk)
                while True:
                    got = _outcome(s.receive_nowait, r)
                    seen.append((got, bytes(r._buf[r._pos : r._end])))
                    if got != ("ok", 0) and got[0] == "ok":
                        continue
                    break
            if end:
                b.close()
            seen.append((_outcome(s.receive_nowait, r), bytes(r._buf[r._pos : r._end])))
        outcomes.append(seen)
    assert outcomes[0] == outcomes[1], outcomes
    last = outcomes[0][-1]
    assert last[0] == (
        ("error", (ConnectionResetError, "connection closed by peer")) if end else ("ok", 0)
    )
    assert last[1].endswith(b"".join(chunks))


def _odd_payload(kind: str) -> Any:
    """Payloads a small reply's send refuses (or takes: a contiguous view of int16s)."""
    return {
        "bytearray": lambda: bytearray(b"ab"),
        "strided": lambda: memoryview(b"abcd")[::2],
        "list": lambda: [b"x"],
        "array": lambda: memoryview(np.arange(6, dtype="i2")),
    }[kind]()


@settings(max_examples=80, deadline=None)
@given(
    tag=st.integers(0, 2**32 - 1) | st.sampled_from([-1, 2**32, 1.0, True]),
    ival=st.integers(-(2**63), 2**63 - 1) | st.sampled_from([2**63, -(2**63) - 1, 2.5]),
    payload=st.binary(max_size=300)
    | st.binary(max_size=300).map(memoryview)
    | st.sampled_from(["bytearray", "strided", "list", "array"]).map(_odd_payload),
    small=st.integers(0, 400),
)
def test_send_reply_is_the_same_and_sends_one_reply(tag, ival, payload, small):
    """A small reply in one send: both sets send the same bytes (``REPLY`` and the
    payload), refuse the same payloads (``NotImplemented``) and raise the same errors."""
    outcomes = []
    for s in SETS:
        a, b = socket.socketpair()
        with a, b:
            got = _outcome(s.send_reply, a, tag, ival, payload, small)
            a.shutdown(socket.SHUT_WR)
            outcomes.append((got, b.recv(1 << 16)))
    assert outcomes[0] == outcomes[1], outcomes
    (kind, got), sent = outcomes[0]
    if kind == "ok" and got is None:
        body = memoryview(payload).tobytes()
        assert sent == kernels.REPLY.pack(0, tag, ival, len(body)) + body
    elif kind == "ok":
        assert got is NotImplemented and sent == b""


def test_send_reply_gives_back_what_a_full_socket_did_not_take():
    """A peer that reads nothing: in each set the send takes what fits and the rest
    comes back to be sent waiting (what went and what came back make the reply); a
    closed peer is the socket's error."""
    for s in SETS:
        a, b = socket.socketpair()
        with a, b:
            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            payload = b"p" * 60_000
            rests, sent = [], 0
            for _ in range(200):
                rest = s.send_reply(a, 3, 4, payload, 1 << 20)
                if rest is not None:
                    rests.append(rest)
                    break
                sent += 1
            assert rests and type(rests[0]) is memoryview and 0 < rests[0].nbytes
            reply = kernels.REPLY.pack(0, 3, 4, len(payload)) + payload
            b.setblocking(False)
            came = b""
            while True:  # (what the peer got: the whole replies before, then a part)
                try:
                    chunk = b.recv(1 << 20)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                came += chunk
            assert came == reply * sent + reply[: len(reply) - rests[0].nbytes]
            assert rests[0].tobytes() == reply[len(reply) - rests[0].nbytes :]
            b.close()
            with pytest.raises(OSError) as info:
                for _ in range(100):
                    s.send_reply(a, 3, 4, payload, 1 << 20)
            assert info.value.errno in (errno.EPIPE, errno.ECONNRESET)


_COUNTS = st.lists(
    st.tuples(
        st.one_of(st.integers(0, 5), st.integers(0, 0xFFFFFFFF), st.integers(-2, 1 << 33)),
        st.one_of(
            st.integers(0, kernels.pure.SERVED_OPS - 1),
            st.integers(-1, 70),
            st.integers((1 << 32) - 2, (1 << 32) + 2),
        ),
        st.one_of(st.integers(1, 3), st.integers(0, 1 << 40), st.just(-1)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(_COUNTS)
def test_served_tables_count_alike(counts):
    """A connection's served counts: every set's table gives the same rows as a plain
    count of the calls that were taken, and refuses the same calls (a manager id off 32
    bits, an operation off the table, a negative count) with the same error type, having
    counted none of them."""
    tables = [s.ServedTable() for s in SETS]
    want: dict[int, dict[int, int]] = {}
    for mid, op, times in counts:
        outcomes = []
        for t in tables:
            try:
                t.count(mid, op, times)
                outcomes.append("ok")
            except (OverflowError, ValueError) as e:
                outcomes.append(type(e))
        assert all(o == outcomes[0] for o in outcomes), (mid, op, times, outcomes)
        if outcomes[0] == "ok":
            row = want.setdefault(mid, {})
            row[op] = row.get(op, 0) + times
    expect = sorted((mid, {op: n for op, n in row.items() if n}) for mid, row in want.items())
    expect = [(mid, row) for mid, row in expect if row]
    for t in tables:
        assert sorted(t.items()) == expect
        assert repr(t).startswith("<ServedTable managers=")


@pytest.mark.parametrize("s", SETS)
def test_a_served_table_read_while_its_thread_counts_is_never_torn(s):
    """A ``stats`` reader copies a table that its connection's thread keeps counting
    in, a new row added every 50 counts (the rows grown and moved meanwhile), the
    threads switching as often as the interpreter lets them: every copy is a count the
    thread had reached (each row's counts no lower than an earlier copy's, never above
    the final ones), and the final one is exact."""
    table = s.ServedTable()
    stop = threading.Event()
    n, per = 20_000, 50

    def counting() -> None:
        for i in range(n):
            table.count(i // per, 2)
            table.count(i // per, 28, 3)
            if i % 70 == 0:
                time.sleep(0)  # (the reader's turn, mid-row and mid-growth)
        stop.set()

    t = threading.Thread(target=counting)
    t.start()
    last: dict[int, dict[int, int]] = {}
    reads = grew = 0
    while not stop.is_set() or reads == 0:
        seen = dict(table.items())
        for mid, row in seen.items():
            before = last.get(mid, {})
            assert all(row.get(op, 0) >= k for op, k in before.items()), (mid, row, before)
            assert set(row) <= {2, 28} and row.get(2, 0) <= per
        grew += len(seen) > len(last)
        last, reads = seen, reads + 1
        if reads > 100_000:  # (bounded: the thread is done long before)
            break
    t.join(timeout=60)
    assert not t.is_alive() and grew > 10  # (rows were added between reads)
    assert dict(table.items()) == {mid: {2: per, 28: 3 * per} for mid in range(n // per)}


@pytest.mark.parametrize(
    "frame",
    [b"", b"x", bytearray(10_000), memoryview(b"y" * 9000), np.ones((3, 4)), bytes(1 << 16)],
)
def test_touch_pages_reads_a_contiguous_buffer_and_changes_nothing(frame):
    """Both sets read a byte of every page of any C-contiguous buffer and leave it as it was."""
    before = bytes(memoryview(frame).cast("B"))
    assert [s.touch_pages(frame) for s in SETS] == [None] * len(SETS)
    assert bytes(memoryview(frame).cast("B")) == before


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        (5, TypeError),
        (None, TypeError),
        ("text", TypeError),
        (np.arange(10)[::2], BufferError),
        (memoryview(b"xy" * 10)[::2], BufferError),
        (np.ones((3, 4)).T, BufferError),
    ],
)
def test_touch_pages_refuses_what_is_no_contiguous_buffer_alike(frame, error):
    """Not a buffer: ``TypeError``; not C-contiguous: ``BufferError``, in both sets."""
    for s in SETS:
        with pytest.raises(error):
            s.touch_pages(frame)


def test_address_of_is_the_same_and_refuses_what_touch_pages_refuses():
    """Both sets give a C-contiguous buffer's start address (a view's, past its offset;
    a read-only one's too) and refuse the rest alike."""
    data = np.arange(64, dtype=np.uint8)
    start = data.__array_interface__["data"][0]
    for buf, at in ((data, 0), (memoryview(data)[5:], 5), (data.data.toreadonly()[9:], 9)):
        assert [s.address_of(buf) for s in SETS] == [start + at] * len(SETS)
    for bad, error in ((data[::2], BufferError), (None, TypeError), ("text", TypeError)):
        for s in SETS:
            with pytest.raises(error):
                s.address_of(bad)
