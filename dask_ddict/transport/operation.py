"""The base of every key-path operation: what a request is, on both ends of the wire.

:mod:`.ops` declares the operations themselves, one class each; this module holds
what they share: how safe a resend is (:class:`Kind`), the request header's
terms (:class:`Encoded`), the host's decoded view (:class:`Request`), and the
reply shapes (:class:`IntReply`, :class:`FrameReply`, :class:`PickledReply`).
"""

from __future__ import annotations

import enum
import pickle
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from .protocol import Op

if TYPE_CHECKING:
    from ..shard.manager import Manager


class Kind(enum.Enum):
    """What may happen when an operation is sent again after a broken connection."""

    READ = "read"  # changes nothing: resent freely; a timeout means only "no answer"
    IDEMPOTENT = "idempotent"  # the same request has the same effect: resent
    ONCE = "once"  # carries a request id: resent, and the host applies it at most once
    UNSAFE = "unsafe"  # cannot be resent: a broken connection is reported as "maybe applied"


class Encoded(NamedTuple):
    """An operation in the request header's terms (see :data:`.protocol.REQ`)."""

    flags: int = 0
    keysec: bytes = b""
    parts: tuple[Any, ...] = ()
    vlen: int = 0
    chkpt: int = 0
    arg: int = 0
    client: int = 0
    timeout: float | None = None


class Request(NamedTuple):
    """A request as the host decoded it (``value`` is a view valid until the next request)."""

    op: int
    flags: int
    manager: int
    chkpt: int
    arg: int
    client: int
    timeout: float | None
    digest: bytes
    key: bytes
    value: Any
    rid: int
    term: int  # the manager's term as its client knows it (wire_term; 0: none)


Reply = Callable[..., None]  # reply(ival=0, payload=b""); payload: a buffer, or a list of them
Answerer = Callable[["Manager", Request], tuple[int, Any]]  # see Answered.answer


class Operation:
    """Base of every operation: a request with its codec and its handler."""

    __slots__ = ()
    op: ClassVar[Op]
    kind: ClassVar[Kind] = Kind.IDEMPOTENT
    replies: ClassVar[bool] = True
    #: A moved manager is followed by the link (one manager's operation); ``False`` for
    #: those on several managers of a host, which their callers send again instead.
    follows: ClassVar[bool] = True
    #: Whether a host's event loop serves it on its own thread: it takes microseconds.
    #: ``False``: it may take long (a disk, a whole shard, another host), so it is
    #: served on a thread of its own (:mod:`dask_ddict._blocking`).
    inline: ClassVar[bool] = True
    timeout: float | None = None
    #: When its time began (``time.monotonic()``), if before it reached the link: a
    #: request the key lane sent first (``client/lane.py``) is sent again within the same
    #: deadline.  ``None``: when the link takes it.
    began: float | None = None
    #: An at-most-once operation's request id, if the key lane sent it first: sent again
    #: with it (its host applies it once).  0: the link draws one.
    rid: int = 0

    def encode(self) -> Encoded:
        return Encoded()

    def result(self, ival: int, payload: Any) -> Any:
        """What the caller gets back from the host's ``(ival, payload)``."""
        return None

    def buffer(self, nbytes: int) -> Any:
        """Where a large reply's ``nbytes`` are received (a shard's copy: its file)."""
        from .._serialize import aligned_empty

        return aligned_empty(nbytes)

    @staticmethod
    def serve(m: Manager, r: Request, reply: Reply) -> None:
        raise NotImplementedError


class Answered(Operation):
    """An operation whose handler only computes an answer: ``answer(m, r) -> (ival, payload)``.

    A broadcast (:class:`~.ops.FanOut`) calls ``answer`` on each manager of a
    host directly, without a reply callback per manager: the latency-bound
    broadcasts (``len``, ``stats``, ``clear``) cost a few microseconds per manager.
    """

    __slots__ = ()
    #: Whether a host may keep a broadcast's answers under its managers' generations
    #: (the answer depends only on the shard and on state that changes with a commit).
    cacheable: ClassVar[bool] = False

    @staticmethod
    def answer(m: Manager, r: Request) -> tuple[int, Any]:
        """``m``'s answer to ``r`` (whose ``manager`` field, in a broadcast, is not ``m``'s)."""
        raise NotImplementedError

    @classmethod
    def serve(cls, m: Manager, r: Request, reply: Reply) -> None:
        reply(*cls.answer(m, r))


class Command(Operation):
    """An operation that calls one manager method without arguments (``method``) and
    answers nothing: freeze, unfreeze, sync, rotate."""

    __slots__ = ()
    method: ClassVar[str]

    @classmethod
    def serve(cls, m: Manager, r: Request, reply: Reply) -> None:
        getattr(m, cls.method)()
        reply()


class HostWide(Operation):
    """An operation on several managers of one host process in one request
    (``get_many``, a batch of puts): the host serves it with all its managers,
    ``serve_host(managers, request, reply)``, instead of one."""

    __slots__ = ()
    follows = False

    @staticmethod
    def serve_host(
        managers: Mapping[int, Manager],
        r: Request,
        reply: Reply,
        missing: Callable[[int], Exception] = KeyError,
    ) -> None:
        """Serve ``r``; ``missing(mid)`` is the error for a manager not hosted here."""
        raise NotImplementedError

    @classmethod
    def serve(cls, m: Manager, r: Request, reply: Reply) -> None:
        """Served for the request's own manager alone (as any operation can be)."""
        cls.serve_host({r.manager: m}, r, reply)


class IntReply(Operation):
    """An operation whose answer is the reply's integer."""

    __slots__ = ()

    def result(self, ival: int, payload: Any) -> int:
        return ival


class FrameReply(Operation):
    """An operation whose answer is the reply's payload (a value frame)."""

    __slots__ = ()

    def result(self, ival: int, payload: Any) -> Any:
        return payload


class PickledReply(Operation):
    """An operation whose answer is a pickled structure (stats, ids, replication pages)."""

    __slots__ = ()

    def result(self, ival: int, payload: Any) -> Any:
        return pickle.loads(payload)


class AtCheckpoint(Operation):
    """An operation whose only argument is a checkpoint id."""

    __slots__ = ()
    chkpt: int

    def encode(self) -> Encoded:
        return Encoded(chkpt=self.chkpt)
