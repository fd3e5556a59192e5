"""The operations on many keys per round trip: one request per host process.

Redis answers ``MGET`` and pipelines, ``ray.get`` takes a list: reading a
thousand keys must not cost a thousand round trips.  A :class:`GetMany`
carries, for each manager of one host process, the digests of its keys; the
host reads each manager's keys in one snapshot and answers every frame in
one reply (sent by :mod:`.many_key_reads`).  A same-host reader serves its
managers' groups from the shards themselves (:mod:`.shared`).

Wire (the request's value section, so that its size is bounded by the
shard's rather than the key limit)::

    request value = <u32 groups> (<u32 manager> <u32 count>) * groups  digests(16) ...
    reply payload = <u32 n> <i64 length> * n  [pad]  (frame [pad]) * n

A :class:`PutMany` carries records tagged with their manager (as a batch
does, :data:`~dask_ddict.kernels.BATCH_RECORD`) and is answered, per manager, with how
many records were put and the error that stopped the next one.

A length of -1 is an absent key, -2 a key whose reader must wait
(``wait_for_keys``: the client then asks for it alone, with its timeout).
Frames start at multiples of 64 from the payload's start, which clients
receive at :data:`~dask_ddict._serialize.FRAME_BASE` modulo 64: numpy buffers
come out aligned, as from a single get.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._serialize import SMALL_FRAME, Framed, loads_value
from ..errors import wire_error
from ..kernels import (
    JOIN,
    digest_groups,
    group_table,
    pack_frames,
    pack_records,
    unpack_frames,
    unpack_records,
    unpack_values,
)
from .operation import Encoded, HostWide, Kind, Reply, Request
from .protocol import FLAG_PERSIST, Op

if TYPE_CHECKING:
    from ..shard.manager import Manager

#: One manager's part of a many-key request: ``(manager id, digests)``.
Group = tuple[int, list[bytes]]


@dataclass(slots=True)
class GetMany(HostWide):
    """The frames of many keys on managers of one host process, in ``groups`` order.

    ``lend`` is a same-host reader's choice (see :class:`~.ops.Get`: ``None`` lends
    only a frozen shard's values), never sent; so is ``absent``: a reader that decodes
    with the value frames' own decoder and copies (``lend`` false) gives its marker of
    an absent key, and its answer is then values (:class:`~dask_ddict.kernels.Decoded`),
    decoded in the snapshot of a shard read on this host, or where a host's reply was
    received (:func:`~dask_ddict.kernels.unpack_values`), instead of frames.
    """

    op = Op.GET_MANY
    kind = Kind.READ
    groups: tuple[Group, ...]
    chkpt: int
    timeout: float | None = None
    lend: bool | None = False
    absent: Any = None

    def encode(self) -> Encoded:
        table = group_table(self.groups)
        digests = b"".join(b"".join(d) for _, d in self.groups)
        return Encoded(
            parts=(table, digests),
            vlen=len(table) + len(digests),
            chkpt=self.chkpt,
            timeout=self.timeout,
        )

    def result(self, ival: int, payload: Any) -> list[list[Any]]:
        if self.absent is not None:  # (the values, unless a reader must wait for one)
            counts = [len(d) for _, d in self.groups]
            values = unpack_values(payload, counts, SMALL_FRAME, self.absent, loads_value)
            if values is not None:
                return values  # type: ignore[return-value]
        # (small frames as bytes, as a same-host reader copies them: shared.py)
        frames, out, at = unpack_frames(payload, 0 if self.lend else SMALL_FRAME), [], 0
        for _, d in self.groups:
            out.append(frames[at : at + len(d)])
            at += len(d)
        if at != len(frames):
            raise ValueError(f"a many-key reply has {len(frames)} frames for {at} keys")
        return out

    @staticmethod
    def serve_host(
        managers: Mapping[int, Manager],
        r: Request,
        reply: Reply,
        missing: Callable[[int], Exception] = KeyError,
    ) -> None:
        """Each manager's keys in one snapshot of its shard; one reply for all."""
        frames: list[Any] = []
        with contextlib.ExitStack() as snapshots:
            for mid, digests in digest_groups(r.value):
                m = managers.get(mid)
                if m is None:
                    raise missing(mid)
                frames += m.get_many(
                    snapshots.enter_context(m.store.read()), digests, r.chkpt, JOIN
                )  # (small frames: copied by the cursor's walk,
                # as the reply copies them anyway, which is cheaper than a view of each)
            reply(0, pack_frames(frames))  # (inside the snapshots: views are valid; parts,
            # sent as they are: a large frame is never joined)


@dataclass(slots=True)
class PutMany(HostWide):
    """Puts for managers of one host process in one request, answered per manager:
    ``[(manager, how many were put, error status, error message)]`` (status 0: all)."""

    op = Op.PUT_MANY
    kind = Kind.IDEMPOTENT  # (a put again has the same effect)
    records: list[tuple[int, bytes, bytes, Framed]]
    chkpt: int
    client: int
    persistent: bool = False
    timeout: float | None = None

    def encode(self) -> Encoded:
        parts, total = pack_records(self.records)
        return Encoded(
            FLAG_PERSIST if self.persistent else 0,
            b"",
            tuple(parts),
            total,
            self.chkpt,
            0,
            self.client,
            self.timeout,
        )

    def result(self, ival: int, payload: Any) -> list[tuple[int, int, int, bytes]]:
        return pickle.loads(payload)

    @staticmethod
    def serve_host(
        managers: Mapping[int, Manager],
        r: Request,
        reply: Reply,
        missing: Callable[[int], Exception] = KeyError,
    ) -> None:
        out = []
        for mid, records in unpack_records(r.value).items():
            m = managers.get(mid)
            error: Exception | None
            try:
                if m is None:
                    raise missing(mid)
                done, error = m.put_many(
                    records,
                    r.chkpt,
                    r.client,
                    timeout=r.timeout,
                    persistent=bool(r.flags & FLAG_PERSIST),
                )
            except Exception as e:  # (the whole group: frozen, closed, not hosted, a timeout)
                done, error = 0, e
            status, msg = (0, b"") if error is None else wire_error(error)
            out.append((mid, done, int(status), msg))
        reply(0, pickle.dumps(out))
