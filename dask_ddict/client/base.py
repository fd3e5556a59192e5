"""HandleBase: the state and helpers every part of a :class:`~dask_ddict.DDict` shares.

``DDict`` is assembled from parts, one module per kind of call (:mod:`.reads`,
:mod:`.bulk`, :mod:`.checkpoints`, :mod:`.introspection`, :mod:`.mapping`,
:mod:`.cloning`, :mod:`.compute`, :mod:`.placement`, and the handle itself in
:mod:`.handle`).  They all read the same state (the shared core, the checkpoint,
the timeout, the picklers, an open batch) and call the same helpers (the closed
check, routing a key to its manager, framing a value).  This base declares that
state and defines those helpers once; every part inherits it.  The few
operations one part takes from another (a batch's start, the handle's stats, a
derived handle, ...) are declared here as abstract methods, each defined by the
one part named beside it, so mypy checks every call against the real signature.

Rejected: each part re-declaring the state and stubbing the helpers it calls
under ``TYPE_CHECKING``, which is what the parts did: eight copies that drift
apart, each part type-checked against its own stubs rather than against the
methods that run.
"""

from __future__ import annotations

import builtins  # (the handle's ``list`` method shadows the builtin in its parts)
import functools
import secrets
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Self

from .. import kernels
from .._forking import each, in_child
from .._serialize import Framed, KeyPickler, ValuePickler, dumps_value
from ..errors import DDictClosedError, DDictError
from ..stats import DDictManagerStats
from .batch import BatchPut
from .core import HandleCore

#: Every handle of this process, by id (handles are mappings, not hashable): what a
#: forked child gives writer ids of its own.
_HANDLES: weakref.WeakValueDictionary[int, HandleBase] = weakref.WeakValueDictionary()


def _forked() -> None:
    """In a forked child: each writer id becomes one of its own (the same new id for
    the handles that shared one), so that the hosts count the child apart from its
    parent as a writer (``wait_for_writers``), as they would a handle made here; and an
    open batch put is the parent's (its id, and the puts it holds, which the parent
    sends): the child's handle holds a new, empty one, its puts a batch of their own."""
    ids: dict[int, int] = {}

    def forked(h: HandleBase) -> None:
        h._client_id = ids.setdefault(h._client_id, secrets.randbits(63))
        if h._batch is not None:
            b = h._batch
            h._batch = BatchPut(b.persist, b._channel, h._client_id, b._named)

    each(_HANDLES.values(), forked)


in_child(_forked)


class HandleBase(ABC):
    """The handle's state, its key routing and its checks: the base of every part.

    The process's key lane (:mod:`.lane`) reads this state as declared here (and the
    core's ``closed``, ``_channels`` and ``_room``) on every ``d[k]``, ``get``, ``in``
    and put, and keeps none of it: a handle whose state changes is served by what it
    is at the call.
    """

    _core: HandleCore  # what derived handles share: layout, channels, closed state
    _creator: bool  # this handle created the dictionary (it should destroy it)
    _chkpt: int  # the checkpoint this handle reads and writes at
    _timeout: float | None  # seconds for each blocking operation; None: forever
    _client_id: int  # this handle's writer id (kept by derived handles)
    _target: int | None  # the one manager its keys go to (d.manager(i)); None: their own
    _kp: KeyPickler | None  # the key pickler (d.pickler(...)); None: the default
    _vp: ValuePickler | None  # the value pickler; None: the default
    _batch: BatchPut | None  # the open batch put, if any
    _derived: bool  # made by manager() or pickler() from another handle
    _detached: bool  # detach() was called on this derived handle
    _routed: tuple[kernels.Router, Callable[[Any], Framed]] | None  # (see _routing)

    def _setup(
        self,
        core: HandleCore,
        *,
        creator: bool,
        chkpt: int,
        timeout: float | None,
        client_id: int | None = None,
    ) -> None:
        self._core = core
        self._creator = creator
        self._chkpt = chkpt
        self._timeout = timeout
        self._client_id = secrets.randbits(63) if client_id is None else client_id
        _HANDLES[id(self)] = self
        self._aim(None, None, None)
        self._batch = None
        self._derived = False
        self._detached = False

    @classmethod
    def _from_core(cls, core: HandleCore, **kwargs: Any) -> Self:
        """A handle on ``core`` (attached: the constructor is for creating)."""
        self = cls.__new__(cls)
        self._setup(core, **kwargs)
        return self

    # -- checks ---------------------------------------------------------------------

    def _check(self) -> None:
        """Raise :class:`DDictClosedError` if this handle was destroyed or detached: every
        operation of a closed handle does, including those that send nothing (moving
        its checkpoint, reading its options), so that using one is always an error
        at the line that does it (only :meth:`get_name`, :meth:`destroy`,
        :meth:`detach` and ``repr`` work on)."""
        if self._core.closed or self._detached:
            raise DDictClosedError(f"DDict {self._core.name!r} was destroyed or detached")

    def _no_batch(self, what: str) -> None:
        if self._batch is not None:
            raise DDictError(f"{what} is not allowed inside a batch put", "INVALID_OPERATION")

    # -- routing --------------------------------------------------------------------

    def _aim(self, target: int | None, kp: KeyPickler | None, vp: ValuePickler | None) -> None:
        """Set the manager this handle's keys go to (``None``: their own) and its key and
        value picklers (the only place they are set: their routing is kept with them)."""
        self._target, self._kp, self._vp = target, kp, vp
        self._routed = None

    def _routing(self) -> tuple[kernels.Router, Callable[[Any], Framed]]:
        """This handle's key router (:meth:`HandleCore.router`) and value framer."""
        vp = self._vp
        dumps = dumps_value if vp is None else functools.partial(dumps_value, pickler=vp)
        self._routed = (self._core.router(self._kp, self._target is None), dumps)
        return self._routed

    def _route(self, key: Any) -> tuple[int, bytes, bytes]:
        """``(manager, digest, key bytes)`` of ``key`` (:meth:`HandleCore.router`'s rule)."""
        if self._core.closed or self._detached:
            self._check()
        try:
            mid, digest, kb = (self._routed or self._routing())[0].one(key)
        except kernels.KeyTooLong as e:
            raise self._too_long(e.args[0]) from None
        return (mid if self._target is None else self._target), digest, kb

    def _routes(self, keys: builtins.list[Any]) -> builtins.list[tuple[int, bytes]]:
        """``(manager, digest)`` of each key: :meth:`_route` for many, in one loop of
        :meth:`~dask_ddict.kernels.Router.many` (compiled where it was built; the routes of
        keys routed before are kept, ``ddict.transport.route-cache``)."""
        core, target = self._core, self._target
        if core.closed or self._detached:
            self._check()
        r = (self._routed or self._routing())[0]
        try:
            routes = r.many(keys)
        except kernels.KeyTooLong as e:
            raise self._too_long(e.args[0]) from None
        return routes if target is None else [(target, d) for _, d in routes]

    def _too_long(self, kb: bytes) -> ValueError:
        return ValueError(
            f"key is {len(kb)} bytes pickled; keys may have at most "
            f"{self._core.max_key_bytes} (ddict.transport.max-key-bytes)"
        )

    def _managers(self) -> builtins.list[int]:
        """The managers this handle addresses: every one, or its target."""
        self._check()
        if self._target is not None:
            return [self._target]
        return list(range(self._core.layout.num_managers))

    # -- values ---------------------------------------------------------------------

    def _framed(self, mid: int | None, kb: bytes, value: Any) -> Framed:
        """``value`` serialized, refused here if it cannot fit its shard at all."""
        return self._fits(mid, kb, dumps_value(value, self._vp))

    def _fits(self, mid: int | None, kb: bytes, framed: Framed) -> Framed:
        """``framed``, or ``DDictFullError`` if with ``kb`` it cannot fit a shard at all."""
        if framed.nbytes + len(kb) > self._core.value_room:
            raise self._core.too_large(mid, framed.nbytes + len(kb))
        return framed

    # -- what one part takes from another (each defined by the part named) ------------

    @abstractmethod
    def _put(self, key: Any, value: Any, persistent: bool, began: float | None = None) -> None:
        """One put (:mod:`.handle`); ``began``: see :class:`~dask_ddict.kernels.Resend`."""

    @abstractmethod
    def _derive(self) -> Self:
        """A handle sharing this one's core, checkpoint and writer id (:mod:`.handle`)."""

    @abstractmethod
    def manager(self, manager_id: int) -> Self:
        """A handle directed to one manager (:mod:`.handle`)."""

    @abstractmethod
    def serialize(self) -> str:
        """The string another process attaches from (:mod:`.handle`)."""

    @abstractmethod
    def start_batch_put(self, persist: bool = False) -> None:
        """Open a batch put (:mod:`.bulk`)."""

    @abstractmethod
    def end_batch_put(self) -> None:
        """Send and close the batch put (:mod:`.bulk`)."""

    @property
    @abstractmethod
    def main_manager(self) -> int:
        """The manager a broadcast value is read from (:mod:`.introspection`)."""

    @property
    @abstractmethod
    def stats(self) -> builtins.list[DDictManagerStats]:
        """Each manager's statistics (:mod:`.introspection`)."""
