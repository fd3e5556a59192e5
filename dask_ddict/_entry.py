"""A shard entry's header: the one declaration of it, for the store and the kernels.

Each version of a key is one LMDB value: this 16-byte header (flags, key length,
frame length), the value frame, then the key's bytes.  The header puts the frame at
32 modulo 64 inside LMDB's page-aligned values, as a value frame expects
(:data:`~dask_ddict._serialize.FRAME_BASE`).
"""

from __future__ import annotations

import struct

TOMBSTONE = 1  # a deletion
PERSISTENT = 2  # (flags) kept by a persisting checkpoint

ENTRY = struct.Struct("<BxxxIQ")  # flags, key length, frame length
ENTRY_HEADER = ENTRY.size
DIGEST = 16  # a key's digest: the first part of its data keys
