"""A shard entry: its header, data keys and decoding, declared once for the store and kernels.

Each version of a key is one LMDB value: this 16-byte header (flags, key length,
frame length), the value frame, then the key's bytes.  The header puts the frame at
32 modulo 64 inside LMDB's page-aligned values, as a value frame expects
(:data:`~dask_ddict._serialize.FRAME_BASE`).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

TOMBSTONE = 1  # a deletion
PERSISTENT = 2  # (flags) kept by a persisting checkpoint

ENTRY = struct.Struct("<BxxxIQ")  # flags, key length, frame length
ENTRY_HEADER = ENTRY.size
DIGEST = 16  # a key's digest: the first part of its data keys

MAXQ = (1 << 64) - 1
BE = struct.Struct(">Q")  # a data key: the digest, then the checkpoint's complement


class Entry(NamedTuple):
    """One stored version of a key (views valid while the transaction lives)."""

    chkpt: int
    flags: int
    frame: memoryview
    key: memoryview

    @property
    def tombstone(self) -> bool:
        return bool(self.flags & TOMBSTONE)

    @property
    def persistent(self) -> bool:
        return bool(self.flags & PERSISTENT)


def data_key(digest: bytes, chkpt: int) -> bytes:
    return digest + BE.pack(MAXQ - chkpt)


def split_data_key(k: Any) -> tuple[bytes, int]:
    k = bytes(k)
    return k[:DIGEST], MAXQ - BE.unpack_from(k, DIGEST)[0]


new_entry = tuple.__new__  # half the cost of Entry(...): reads build one per lookup


def decode_entry(chkpt: int, raw: memoryview | bytes) -> Entry:
    flags, klen, flen = ENTRY.unpack_from(raw, 0)
    end = ENTRY_HEADER + flen
    return new_entry(Entry, (chkpt, flags, raw[ENTRY_HEADER:end], raw[end : end + klen]))
