"""The operations on whole checkpoints: persistence, replication, a moving shard.

Part of the one table of operations (:mod:`.table` lists this module with the
others); each moves or names whole checkpoints of a shard rather than keys, and is
sent to every manager (or the chosen one) by the client's persistence and
replication calls.
"""

from __future__ import annotations

import pickle
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import DDictError
from .operation import (
    Answered,
    AtCheckpoint,
    Command,
    Encoded,
    IntReply,
    Kind,
    Operation,
    PickledReply,
    Reply,
    Request,
)
from .protocol import Op

if TYPE_CHECKING:
    from ..shard.manager import Manager


# -- persistence ---------------------------------------------------------------------------


def new_version() -> int:
    """A number for one broadcast that every manager must share and no other broadcast
    has (62 random bits): a :class:`Persist`'s version, a :class:`Restore`'s history."""
    return secrets.randbits(62) | 1


@dataclass(slots=True)
class Persist(AtCheckpoint):
    """Persist checkpoint ``chkpt`` now (written in the background; see :class:`Sync`)."""

    op = Op.PERSIST
    inline = False  # (see Operation.inline)
    chkpt: int
    version: int = 0  # the same for every manager (see persist.versioned); 0: a new one

    def encode(self) -> Encoded:
        return Encoded(chkpt=self.chkpt, arg=self.version)

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        m.persist(r.chkpt, r.arg)
        reply()


@dataclass(slots=True)
class PersistedIds(PickledReply, Answered):
    op = Op.PERSISTED_IDS
    inline = False  # (see Operation.inline)
    kind = Kind.READ

    @staticmethod
    def answer(m: Manager, r: Request) -> tuple[int, Any]:
        return 0, pickle.dumps(m.persisted_ids())


@dataclass(slots=True)
class Sync(PickledReply, Answered):
    """Wait for the background persists; answer those that failed, ``[(chkpt, why)]``.

    An answer, not an error: ``sync()`` names every manager's failures at once.
    Reading them changes nothing, so a resend is harmless.
    """

    op = Op.SYNC
    inline = False  # (see Operation.inline)
    kind = Kind.READ
    #: How long the client waits for the answers (``sync(timeout=...)``); the host's
    #: wait is not cut: the persists go on, and a later sync waits for them again.
    timeout: float | None = None

    def encode(self) -> Encoded:
        return Encoded(timeout=self.timeout)

    @staticmethod
    def answer(m: Manager, r: Request) -> tuple[int, Any]:
        return 0, pickle.dumps(m.sync())


@dataclass(slots=True)
class Rotate(Command):
    """Remove what ``persist_count`` no longer keeps (``Persister.rotate``), now.

    Sent by ``sync()`` once every manager's background persists are done: a
    manager rotates after each of its own persists, when the others may not have
    finished theirs yet, so without this a manager ahead of the others would
    hold more than ``persist_count`` checkpoints until its next persist.
    """

    op = Op.ROTATE
    inline = False  # (see Operation.inline)
    kind = Kind.IDEMPOTENT
    method = "rotate"
    timeout: float | None = None  # (the rest of a sync()'s time)

    def encode(self) -> Encoded:
        return Encoded(timeout=self.timeout)


@dataclass(slots=True)
class Restore(AtCheckpoint, IntReply):
    """Load persisted checkpoint ``chkpt``; the reply is its key count.  ``history``: the
    dictionary's history from then on, the same for every manager (``Manager.restore``)."""

    op = Op.RESTORE
    inline = False  # (see Operation.inline)
    chkpt: int
    history: int = 0

    def encode(self) -> Encoded:
        return Encoded(chkpt=self.chkpt, arg=self.history)

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        reply(m.restore(r.chkpt, history=r.arg))


@dataclass(slots=True)
class Advance(IntReply):
    """Read-only replay: load the next persisted checkpoint; the reply is its id."""

    op = Op.ADVANCE
    inline = False  # (see Operation.inline)
    kind = Kind.UNSAFE  # sent again, it would advance twice

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        reply(m.advance())


# -- replication ---------------------------------------------------------------------------


@dataclass(slots=True)
class DumpPage(PickledReply):
    """One page of the shard's raw records from one snapshot (see ``Manager.dump_page``)."""

    op = Op.DUMP_PAGE
    inline = False  # (see Operation.inline)
    kind = Kind.READ  # the snapshot is the manager's, by token: a resent request resumes it
    token: int | None
    after: bytes | None

    def encode(self) -> Encoded:
        return Encoded(keysec=self.after or b"", arg=self.token or 0)

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        after = (r.digest + r.key) or None
        reply(0, pickle.dumps(m.dump_page(r.arg or None, after)))


@dataclass(slots=True)
class CopyFrom(IntReply):
    """Replace the shard by manager ``manager_id`` of the serialized ``source``."""

    op = Op.COPY_FROM
    inline = False  # (see Operation.inline)
    source: str
    manager_id: int

    def encode(self) -> Encoded:
        data = self.source.encode()
        return Encoded(parts=(data,), vlen=len(data), arg=self.manager_id)

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        reply(m.copy_from(bytes(r.value).decode(), r.arg))


# -- moves -----------------------------------------------------------------------------------


@dataclass(slots=True)
class ShardPages(Operation):
    """A moving manager's whole shard (its used pages), received straight into the file
    of its copy on the new host (see :mod:`dask_ddict.host.moves`)."""

    op = Op.SHARD_PAGES
    inline = False  # (see Operation.inline)
    kind = Kind.READ  # nothing writes the shard while it moves: a resend reads the same
    into: Any = None  # (receiving end) nbytes -> a writable view of the copy's file
    timeout: float | None = None

    def encode(self) -> Encoded:
        return Encoded(timeout=self.timeout)

    def buffer(self, nbytes: int) -> Any:
        return self.into(nbytes)

    def result(self, ival: int, payload: Any) -> Any:
        return payload

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        pages = m.shard_pages()
        try:
            reply(0, pages)
        finally:
            mm: Any = pages.obj
            pages.release()
            mm.close()


# -- replicas --------------------------------------------------------------------------------


@dataclass(slots=True)
class Replicate(IntReply):
    """A replicated manager's committed change set (:mod:`dask_ddict.shard.changes`), to
    the host process of one of its replicas, number ``seq`` of that replica's: applied
    there in one transaction, in order.  The host serves it from its replicas
    (:func:`dask_ddict.host.replicas.serve`), not from a manager."""

    op = Op.REPLICATE
    kind = Kind.IDEMPOTENT  # a replica takes a resent change set (the same seq) once
    follows = False  # (a replica does not move: its primary drops it and a new one is made)
    seq: int
    parts: list[Any]
    nbytes: int
    timeout: float | None = None

    def encode(self) -> Encoded:
        return Encoded(
            parts=tuple(self.parts), vlen=self.nbytes, arg=self.seq, timeout=self.timeout
        )

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        raise DDictError(
            f"manager {r.manager} is served here: it is not a replica", "INVALID_OPERATION"
        )
