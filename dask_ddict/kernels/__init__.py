"""The key path's per-key loops, compiled where they could be built.

A ``get_many`` of a thousand keys (and the gets an ``AsyncDDict`` gathers) runs a few
loops once per key: routing each key to its manager, grouping digests, framing the
host's reply and taking it apart, the host's cursor walk, decoding small values; a
batch of puts runs them to route and frame each put, pack and unpack its records, and
write them into a shard (one LMDB ``replace`` each); and every single-key operation
over a socket receives its reply (a header and a small value in one ``recv``, with
the interpreter lock released); a host's event loop waits, receives and answers its
plain requests (gets, ``in``s, puts, ``get_many``s) in one call.  In Python each
step costs a microsecond or more of interpreter dispatch per key; these loops are
therefore written twice: :mod:`.pure` (the reference, and the fallback) and
:mod:`._compiled` (the same functions typed in Cython, built by ``pip install``
with the machine's C compiler; see ``setup.py``).

This module exports one set: the compiled one where it was built and
``ddict.compiled`` is true (read once, at import: ``DASK_DDICT__COMPILED=false``
gives every process of a cluster the pure set), else the pure one.
:data:`COMPILED` says which this process runs.
"""

from __future__ import annotations

import glob
import logging
import os
import warnings
from types import ModuleType
from typing import TYPE_CHECKING

from .. import config
from .._forking import in_child
from . import pure
from .pure import (
    BATCH_RECORD,
    COMMITTED,
    DIRECT_PUT_MAX,
    FORKED,
    GROUP,
    JOIN,
    LEFT,
    NO_KEY,
    PRELOADED,
    QUIET,
    REPLY,
    REQUEST,
    SPAN,
    KeyTooLong,
    LaneWire,
    PlainRequests,
    Record,
    Resend,
    group_table,
)

logger = logging.getLogger(__name__)


def _choose() -> tuple[ModuleType, bool]:
    if not config.get("compiled"):
        return pure, False
    try:
        from . import _compiled  # type: ignore[attr-defined,unused-ignore]
    except ImportError as e:  # (not built: no compiler, or DASK_DDICT__COMPILED=false at install)
        logger.debug("dask_ddict.kernels: not compiled (%s): pure Python", e)
        return pure, False
    here = os.path.dirname(__file__)
    # (only in a source tree: an installed wheel's files carry the install's times, in
    # no particular order, and cannot be rebuilt in place anyway)
    tree = os.path.exists(os.path.join(here, os.pardir, os.pardir, "pyproject.toml"))
    built = getattr(_compiled, "__file__", None) if tree else None
    sources = [
        os.path.join(here, "_compiled.pyx"),
        *glob.glob(os.path.join(here, "*.pxi")),
        *glob.glob(os.path.join(here, "*.h")),
    ]
    newest = max(((os.stat(p).st_mtime, p) for p in sources if os.path.exists(p)), default=None)
    if built and newest is not None and newest[0] > os.stat(built).st_mtime:
        source = newest[1]
        warnings.warn(
            f"{source} is newer than its build {built}: run `pip install -e .` again "
            "(or set ddict.compiled: false)",
            RuntimeWarning,
            stacklevel=2,
        )
    return _compiled, True


_impl, COMPILED = _choose()
if COMPILED:  # (the pure set's words come from random, which reseeds itself in a child)
    in_child(_impl.generation_words_forked)
in_child(_impl.commits_behind_forked)  # (a forked child has no commit thread of its own)


def get_include() -> str:
    """The directory of ``ddict_wire.h``: the key path's framing and routing in C, for C
    and C++ clients (``cc -I$(python -c 'import dask_ddict.kernels as k;
    print(k.get_include())')``); the compiled kernels are built on the same header."""
    return os.path.dirname(os.path.abspath(__file__))


if TYPE_CHECKING:  # (the pure functions' signatures; both sets have the same)
    from .pure import (
        ConnectionState,
        Decoded,
        DeferredState,
        DirectCommit,
        GenerationBump,
        GenerationsState,
        HostedState,
        KeyLane,
        LeaseState,
        ManagerLock,
        ManagerState,
        PlainServer,
        ReaderState,
        Router,
        ServedTable,
        SharedState,
        StoreState,
        ViewState,
        WindowState,
        address_of,
        commits_behind,
        commits_behind_forked,
        decode_frames,
        decode_values,
        decoded,
        digest_groups,
        disown_transactions,
        entries_bytes,
        group,
        group_positions,
        leading_within,
        lookup_entry,
        lookup_frames,
        lookup_values,
        marked,
        pack_frames,
        pack_records,
        place_values,
        poll_and_serve,
        put_entries,
        receive_nowait,
        receive_reply,
        route,
        send_reply,
        take_request,
        taken_out,
        touch_pages,
        unpack_frames,
        unpack_records,
        unpack_values,
    )
else:
    globals().update({name: getattr(_impl, name) for name in pure.__all__})

__all__ = [
    "BATCH_RECORD",
    "COMMITTED",
    "COMPILED",
    "DIRECT_PUT_MAX",
    "FORKED",
    "GROUP",
    "JOIN",
    "PRELOADED",
    "QUIET",
    "REPLY",
    "REQUEST",
    "SPAN",
    "ConnectionState",
    "Decoded",
    "DeferredState",
    "DirectCommit",
    "GenerationBump",
    "GenerationsState",
    "HostedState",
    "KeyLane",
    "LeaseState",
    "KeyTooLong",
    "LEFT",
    "LaneWire",
    "ManagerLock",
    "ManagerState",
    "NO_KEY",
    "PlainRequests",
    "Resend",
    "group_table",
    "PlainServer",
    "Record",
    "ReaderState",
    "Router",
    "ServedTable",
    "SharedState",
    "StoreState",
    "ViewState",
    "WindowState",
    "address_of",
    "commits_behind",
    "commits_behind_forked",
    "decode_frames",
    "decode_values",
    "decoded",
    "digest_groups",
    "disown_transactions",
    "get_include",
    "entries_bytes",
    "group",
    "group_positions",
    "leading_within",
    "lookup_entry",
    "lookup_frames",
    "lookup_values",
    "marked",
    "pack_frames",
    "pack_records",
    "place_values",
    "poll_and_serve",
    "put_entries",
    "receive_nowait",
    "receive_reply",
    "route",
    "send_reply",
    "take_request",
    "taken_out",
    "touch_pages",
    "unpack_frames",
    "unpack_records",
    "unpack_values",
]  # (pure.__all__, and what says which: tests/test_kernels.py)
