"""The operations of the key path on keys, each declared once.

An operation is one request class.  It says in one place:

* what it carries (its fields) and how they travel (:meth:`Operation.encode`,
  into the fixed request header of :mod:`.protocol` plus a key section and a value);
* how safe it is to send again after a broken connection (:attr:`Operation.kind`);
* how the host serves it (:meth:`Operation.serve`: the :class:`Manager` method
  it calls, and what goes back);
* what its reply means to the caller (:meth:`Operation.result`).

Clients send operations through a channel's one ``call(operation)``; the host
dispatches them through :data:`~.table.HANDLERS`.  The operations live in three
modules, by what they work on: keys and a manager's state (here), many keys of a
host's managers in one request (:mod:`.many_key_ops`) and whole checkpoints
(:mod:`.whole_checkpoints`); :mod:`.table` lists the three and derives the host's
tables from them.  Adding an operation is one class in one of them plus the manager
method it calls; what every operation shares (kinds, the request header's terms,
reply shapes) is in :mod:`.operation`.

Requests are never changed after they are made, but they are not ``frozen``
dataclasses: a frozen dataclass's ``__init__`` costs several times a plain one's,
on every operation of the key path (``docs/design/transport.md``, "Measured choices
of the key path", has the figures).
"""

from __future__ import annotations

import os
import pickle
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._serialize import Framed, copy_frame, raw_range
from ..errors import DDictManagerMovedError
from ..kernels import SPAN, pack_records, unpack_records
from ..stats import DDictManagerStats
from .operation import (
    Answered,
    Command,
    Encoded,
    FrameReply,
    HostWide,
    IntReply,
    Kind,
    Operation,
    PickledReply,
    Reply,
    Request,
)
from .protocol import (
    FLAG_NOREPLY,
    FLAG_PERSIST,
    RECORD,
    WANT_KEYS,
    WANT_VALUES,
    Op,
)

if TYPE_CHECKING:
    from ..shard.manager import Manager


def _key_and_value(o: Put | SetDefault, flags: int) -> Encoded:
    """A write of one key: digest and key in the key section, the value's parts after."""
    return Encoded(
        flags,
        o.digest + o.key,
        tuple(o.framed.parts),
        o.framed.nbytes,
        o.chkpt,
        0,
        o.client,
        o.timeout,
    )


# -- the dict protocol ---------------------------------------------------------------------


@dataclass(slots=True)
class Get(FrameReply):
    """The value's frame.  ``lend`` (a same-host reader's choice, never sent): ``True``
    lends the shard's pages (zero-copy, :mod:`.lending`), ``None`` only a frozen shard's."""

    op = Op.GET
    kind = Kind.READ
    digest: bytes
    chkpt: int
    timeout: float | None = None
    lend: bool | None = False
    began: float | None = None

    def encode(self) -> Encoded:
        return Encoded(keysec=self.digest, chkpt=self.chkpt, timeout=self.timeout)

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        m.get(r.digest, r.chkpt, lambda frame: reply(0, frame), r.timeout)


#: A :class:`GetRange`'s bounds: what ``kernels.SPAN`` holds, clamped to it.
_BOUND = (-(1 << 63), (1 << 63) - 1)


@dataclass(slots=True)
class GetRange(Operation):
    """``(size, part)`` of a raw-bytes value: its length, and ``value[start:stop]`` (a
    Python slice, see :func:`~dask_ddict._serialize.raw_range`); an empty slice asks for
    the size alone.

    Read where the value lives (a same-host reader's shard, else the manager, which
    serves it as :meth:`Manager.get <dask_ddict.shard.manager.Manager.get>` serves a
    whole value: same snapshot, checkpoint and ``wait_for_keys`` rules), so only the
    part travels: zarr's sharding codec reads one inner chunk out of a large shard.  A
    value that is not raw bytes raises :class:`~dask_ddict.errors.DDictSerializationError`
    (its bytes are a pickle's, not the value's): the caller reads it whole.
    """

    op = Op.GET_RANGE
    kind = Kind.READ
    digest: bytes
    chkpt: int
    start: int
    stop: int
    timeout: float | None = None

    def encode(self) -> Encoded:
        low, high = _BOUND
        span = SPAN.pack(min(max(self.start, low), high), min(max(self.stop, low), high))
        return Encoded(keysec=self.digest + span, chkpt=self.chkpt, timeout=self.timeout)

    def result(self, ival: int, payload: Any) -> tuple[int, Any]:
        return ival, payload

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        start, stop = SPAN.unpack(r.key)
        m.get(r.digest, r.chkpt, lambda frame: reply(*raw_range(frame, start, stop)), r.timeout)


@dataclass(slots=True)
class Put(Operation):
    op = Op.PUT
    digest: bytes
    key: bytes
    framed: Framed
    chkpt: int
    client: int
    persistent: bool = False
    timeout: float | None = None
    began: float | None = None

    def encode(self) -> Encoded:
        return _key_and_value(self, FLAG_PERSIST if self.persistent else 0)

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        m.put(
            r.digest,
            r.key,
            r.value,
            r.chkpt,
            r.client,
            persistent=bool(r.flags & FLAG_PERSIST),
            timeout=r.timeout,
        )
        reply()


@dataclass(slots=True)
class SetDefault(FrameReply):
    """The key's value; if it has none at ``chkpt``, ``framed`` is put first (atomically)."""

    op = Op.SET_DEFAULT
    digest: bytes
    key: bytes
    framed: Framed
    chkpt: int
    client: int
    timeout: float | None = None

    def encode(self) -> Encoded:
        return _key_and_value(self, 0)

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        reply(0, m.setdefault(r.digest, r.key, r.value, r.chkpt, r.client, r.timeout))


@dataclass(slots=True)
class Contains(Operation):
    op = Op.CONTAINS
    kind = Kind.READ
    digest: bytes
    chkpt: int
    timeout: float | None = None
    began: float | None = None

    def encode(self) -> Encoded:
        return Encoded(keysec=self.digest, chkpt=self.chkpt, timeout=self.timeout)

    def result(self, ival: int, payload: Any) -> bool:
        return bool(ival)

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        reply(int(m.contains(r.digest, r.chkpt)))


@dataclass(slots=True)
class Pop(FrameReply):
    op = Op.POP
    kind = Kind.ONCE
    digest: bytes
    chkpt: int
    client: int
    timeout: float | None = None
    began: float | None = None
    rid: int = 0

    def encode(self) -> Encoded:
        return Encoded(
            keysec=self.digest, chkpt=self.chkpt, client=self.client, timeout=self.timeout
        )

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        reply(0, m.pop(r.digest, r.chkpt, r.client, r.timeout, r.rid))


@dataclass(slots=True)
class Length(IntReply, Answered):
    op = Op.LEN
    cacheable = True
    kind = Kind.READ
    chkpt: int
    timeout: float | None = None  # (the handle's: bounds the wait for an answer)

    def encode(self) -> Encoded:
        return Encoded(chkpt=self.chkpt, timeout=self.timeout)

    @staticmethod
    def answer(m: Manager, r: Request) -> tuple[int, Any]:
        return m.length(r.chkpt), b""


@dataclass(slots=True)
class Clear(Answered):
    op = Op.CLEAR
    chkpt: int
    client: int
    timeout: float | None = None

    def encode(self) -> Encoded:
        return Encoded(chkpt=self.chkpt, client=self.client, timeout=self.timeout)

    @staticmethod
    def answer(m: Manager, r: Request) -> tuple[int, Any]:
        m.clear(r.chkpt, r.client, r.timeout)
        return 0, b""


@dataclass(slots=True)
class Page(Answered):
    """One page of a view: ``(items, last digest, more)``, items ``(key bytes, frame)``.

    ``max_bytes`` (0: the host's ``ddict.iteration.page-bytes``) is at most that:
    a broadcast of first pages asks each manager for its share of one page.
    ``lend`` (a same-host reader's choice, never sent, as :class:`Get`'s): the
    values' frames are lent from a snapshot of the shard (zero-copy, :mod:`.lending`).
    """

    op = Op.PAGE
    cacheable = True
    kind = Kind.READ
    chkpt: int
    after: bytes | None
    want: int  # WANT_KEYS | WANT_VALUES
    max_items: int
    max_bytes: int = 0
    timeout: float | None = None
    lend: bool = False

    def encode(self) -> Encoded:
        return Encoded(
            keysec=self.after or b"",
            chkpt=self.chkpt,
            arg=self.want | (self.max_items << 8),
            client=self.max_bytes,
            timeout=self.timeout,
        )

    def result(self, ival: int, payload: Any) -> Any:
        if len(payload) <= 16:  # an empty page (most managers', in a broadcast of first pages)
            return [], None, bool(ival)
        mv = memoryview(payload)
        last = bytes(mv[:16])
        items = []
        off = 16
        while off < mv.nbytes:
            klen, vlen = RECORD.unpack_from(mv, off)
            off += RECORD.size
            k = bytes(mv[off : off + klen]) if self.want & WANT_KEYS else None
            off += klen
            v = copy_frame(mv[off : off + vlen]) if self.want & WANT_VALUES else None
            off += vlen
            items.append((k, v))
        return items, (last if items else None), bool(ival)

    @staticmethod
    def answer(m: Manager, r: Request, page_bytes: int = 1 << 20) -> tuple[int, Any]:
        """``page_bytes``: the host's limit (a broadcast's share is always below it)."""
        want = r.arg & 0xFF
        items, last, more = m.page(
            r.chkpt,
            r.digest or None,
            bool(want & WANT_KEYS),
            bool(want & WANT_VALUES),
            max(1, r.arg >> 8),
            min(page_bytes, r.client or page_bytes),
        )
        if not items:
            return int(more), b""
        parts: list[Any] = [last or bytes(16)]
        for k, v in items:
            parts += [RECORD.pack(len(k or b""), len(v or b"")), k or b"", v or b""]
        return int(more), b"".join(parts)


@dataclass(slots=True)
class FetchAdd(FrameReply):
    op = Op.FETCH_ADD
    kind = Kind.ONCE
    digest: bytes
    key: bytes
    chkpt: int
    client: int
    n: int
    timeout: float | None = None
    began: float | None = None
    rid: int = 0

    def encode(self) -> Encoded:
        return Encoded(
            keysec=self.digest + self.key,
            chkpt=self.chkpt,
            arg=self.n,
            client=self.client,
            timeout=self.timeout,
        )

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        reply(0, m.fetch_add(r.digest, r.key, r.chkpt, r.client, r.arg, r.timeout, r.rid))


@dataclass(slots=True)
class WaitFor(Operation):
    op = Op.WAIT_FOR
    inline = False  # (see Operation.inline)
    kind = Kind.READ
    digest: bytes
    chkpt: int
    frame: bytes
    timeout: float | None = None

    def encode(self) -> Encoded:
        return Encoded(
            keysec=self.digest,
            parts=(self.frame,),
            vlen=len(self.frame),
            chkpt=self.chkpt,
            timeout=self.timeout,
        )

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        m.wait_for(r.digest, r.chkpt, r.value, r.timeout)
        reply()


# -- batches ------------------------------------------------------------------------------


@dataclass(slots=True)
class BatchPut(HostWide):
    """Records for managers of one host process, streamed without a reply;
    :class:`BatchEnd` tells each manager's count.  ``records`` are
    ``(manager, digest, key, frame)``."""

    op = Op.BATCH_PUT
    kind = Kind.UNSAFE
    replies = False
    records: list[tuple[int, bytes, bytes, Framed]]
    chkpt: int
    client: int
    persistent: bool
    batch: int

    def encode(self) -> Encoded:
        parts, total = pack_records(self.records)
        flags = FLAG_NOREPLY | (FLAG_PERSIST if self.persistent else 0)
        return Encoded(flags, b"", tuple(parts), total, self.chkpt, self.batch, self.client)

    @staticmethod
    def serve_host(
        managers: Mapping[int, Manager],
        r: Request,
        reply: Reply,
        missing: Callable[[int], Exception] = KeyError,
    ) -> None:
        """Each manager's records in one transaction of its own, in message order.

        A manager that moved away stores none of them (nor of later messages): its
        batch count, at its new place, tells the client which to send again there,
        and the connection stays up for the other managers' records."""
        for mid, records in unpack_records(r.value).items():
            m = managers.get(mid)
            if m is None:
                e = missing(mid)  # (which may wait for it: confirmed here meanwhile)
                m = managers.get(mid)
                if m is None:
                    if isinstance(e, DDictManagerMovedError):
                        continue
                    raise e
            try:
                m.batch_put(
                    records, r.chkpt, r.client, persistent=bool(r.flags & FLAG_PERSIST), batch=r.arg
                )
            except DDictManagerMovedError:
                continue  # (it moved while these waited for its writes to resume)
        if not r.flags & FLAG_NOREPLY:
            reply()


@dataclass(slots=True)
class BatchEnd(IntReply):
    """The number of the batch's puts the manager stored (its state is in the shard)."""

    op = Op.BATCH_END
    client: int
    batch: int

    def encode(self) -> Encoded:
        return Encoded(client=self.client, arg=self.batch)

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        reply(m.batch_end(r.client, r.arg))


# -- state of the manager ------------------------------------------------------------------


@dataclass(slots=True)
class Stats(Answered):
    op = Op.STATS
    cacheable = True
    pinned = True  # (its answer reports pinned memory: kept under the pin boards too)
    kind = Kind.READ
    timeout: float | None = None

    def encode(self) -> Encoded:
        return Encoded(timeout=self.timeout)

    def result(self, ival: int, payload: Any) -> DDictManagerStats:
        return DDictManagerStats.from_record(pickle.loads(payload))

    @staticmethod
    def answer(m: Manager, r: Request) -> tuple[int, Any]:
        return 0, m.stats_pickled()


@dataclass(slots=True)
class Newest(IntReply, Answered):
    op = Op.NEWEST
    cacheable = True
    kind = Kind.READ
    timeout: float | None = None

    def encode(self) -> Encoded:
        return Encoded(timeout=self.timeout)

    @staticmethod
    def answer(m: Manager, r: Request) -> tuple[int, Any]:
        return m.newest_checkpoint(), b""


@dataclass(slots=True)
class Freeze(Command):
    op = Op.FREEZE
    inline = False  # (see Operation.inline)
    method = "freeze"


@dataclass(slots=True)
class Unfreeze(Command):
    op = Op.UNFREEZE
    inline = False  # (see Operation.inline)
    method = "unfreeze"


@dataclass(slots=True)
class Ping(IntReply, Answered):
    """The host process's pid (alive and answering)."""

    op = Op.PING
    kind = Kind.READ

    @staticmethod
    def answer(m: Manager, r: Request) -> tuple[int, Any]:
        return os.getpid(), b""


#: A :class:`FanOut`'s key section starts with the inner operation's arg and how many
#: managers, then their ids (``u32`` each), then the inner operation's key section.
_FANOUT = struct.Struct("<qI")


def pack_fan_out(arg: int, mids: Sequence[int], inner: bytes) -> bytes:
    """A :class:`FanOut`'s key section: the inner operation's ``arg``, its managers
    ``mids`` and its own key section ``inner``."""
    return _FANOUT.pack(arg, len(mids)) + struct.pack(f"<{len(mids)}I", *mids) + inner


def unpack_fan_out(keysec: bytes) -> tuple[int, tuple[int, ...], bytes]:
    """What :func:`pack_fan_out` packed: ``(arg, mids, inner)``."""
    arg, n = _FANOUT.unpack_from(keysec)
    mids = struct.unpack_from(f"<{n}I", keysec, _FANOUT.size)
    return arg, mids, keysec[_FANOUT.size + 4 * n :]


@dataclass(slots=True)
class FanOut(PickledReply):
    """``inner`` on managers ``mids`` of one host process in one round trip (broadcasts),
    answered with every manager's ``(mid, status, ival, payload)``.  Its host process
    serves it with its managers and the answers it keeps
    (:mod:`dask_ddict.host.fan_out`), not one manager."""

    follows = False  # (its caller sends the moved managers' part again)
    op = Op.FANOUT
    inner: Operation
    mids: tuple[int, ...]

    @property
    def kind(self) -> Kind:  # type: ignore[override]
        return self.inner.kind

    def encode(self) -> Encoded:
        e = self.inner.encode()
        return e._replace(keysec=pack_fan_out(e.arg, self.mids, e.keysec), arg=int(self.inner.op))

    @staticmethod
    def serve(m: Any, r: Request, reply: Reply) -> None:  # (the host serves it: host.fan_out)
        raise DDictManagerMovedError("a broadcast is served by its host process")


#: A :class:`TreeOut`'s key section starts with the inner operation's arg and the length
#: of the pickled tree (its managers and subtrees), then the tree, then the inner
#: operation's key section.
_TREE = struct.Struct("<qI")

#: A subtree of a :class:`TreeOut`: its host process (``tcp_host``, ``tcp_port``,
#: ``hostname``, ``worker``: what a forwarding host needs to reach it and name it), the
#: managers it serves, and its own subtrees.
Subtree = tuple[tuple[str, int, str, str], tuple[int, ...], tuple[Any, ...]]


def pack_tree(arg: int, mids: tuple[int, ...], children: tuple[Any, ...], inner: bytes) -> bytes:
    """A :class:`TreeOut`'s key section: the inner operation's ``arg``, the managers
    ``mids`` of its host and its ``children`` subtrees, and the inner key section."""
    tree = pickle.dumps((mids, children))
    return _TREE.pack(arg, len(tree)) + tree + inner


def unpack_tree(keysec: bytes) -> tuple[int, tuple[int, ...], tuple[Subtree, ...], bytes]:
    """What :func:`pack_tree` packed: ``(arg, mids, children, inner)``."""
    arg, n = _TREE.unpack_from(keysec)
    mids, children = pickle.loads(keysec[_TREE.size : _TREE.size + n])
    return arg, mids, children, keysec[_TREE.size + n :]


def subtree_mids(children: tuple[Subtree, ...]) -> list[int]:
    """Every manager of ``children`` and of their subtrees, in tree order."""
    out: list[int] = []
    for _, mids, grand in children:
        out += mids
        out += subtree_mids(grand)
    return out


@dataclass(slots=True)
class TreeOut(PickledReply):
    """``inner`` on managers ``mids`` of one host process, which first forwards it to the
    host processes of ``children`` (each with its own subtrees: see
    :mod:`dask_ddict.host.forward`), and answers every manager's
    ``(mid, status, ival, payload)`` of the whole tree, as :class:`FanOut` answers its
    host's: a broadcast whose sender sends one request, not one per host."""

    follows = False  # (its caller sends the moved managers' part again)
    inline = False  # (it waits for other hosts)
    op = Op.TREE
    inner: Operation
    mids: tuple[int, ...]
    children: tuple[Subtree, ...]

    @property
    def kind(self) -> Kind:  # type: ignore[override]
        return self.inner.kind

    def encode(self) -> Encoded:
        e = self.inner.encode()
        return e._replace(
            keysec=pack_tree(e.arg, self.mids, self.children, e.keysec), arg=int(self.inner.op)
        )

    @staticmethod
    def serve(m: Any, r: Request, reply: Reply) -> None:  # (the host serves it: host.forward)
        raise DDictManagerMovedError("a tree broadcast is served by its host process")


@dataclass(slots=True)
class Relayed(Operation):
    """A request a host received, sent on as it came (a :class:`TreeOut`'s inner
    operation, forwarded to a child host): its code, kind and encoding."""

    code: int
    how: Kind
    encoded: Encoded

    @property
    def op(self) -> int:  # type: ignore[override]
        return self.code

    @property
    def kind(self) -> Kind:  # type: ignore[override]
        return self.how

    def encode(self) -> Encoded:
        return self.encoded
