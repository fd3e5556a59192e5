"""The operation table: every operation of the key path by its wire code, and the
host's tables derived from it.

Operations are declared once each, in three modules by what they work on: keys and a
manager's state (:mod:`.ops`), many keys of a host's managers in one request
(:mod:`.many_key_ops`), whole checkpoints (:mod:`.whole_checkpoints`).  This module
names those modules, once (:data:`MODULES`), and derives every table the host serves
from: an operation added to one of them is in every table, and a new module of
operations is one more name there.  Clients import an operation from the module that
declares it; only the host needs the tables.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

from . import many_key_ops, ops, whole_checkpoints
from .operation import Answered, Answerer, HostWide, Operation, Reply, Request
from .protocol import Op

if TYPE_CHECKING:
    from ..shard.manager import Manager

#: The modules that declare operations.
MODULES: tuple[ModuleType, ...] = (ops, many_key_ops, whole_checkpoints)


def _declared(module: ModuleType) -> list[type[Operation]]:
    """The operations ``module`` declares: its own classes with a wire code (not a base
    class, nor :class:`~.ops.Relayed`, whose code is a request's)."""
    return [
        cls
        for cls in vars(module).values()
        if isinstance(cls, type)
        and issubclass(cls, Operation)
        and cls.__module__ == module.__name__
        and isinstance(cls.__dict__.get("op"), Op)
    ]


def _operations() -> dict[Op, type[Operation]]:
    out: dict[Op, type[Operation]] = {}
    for module in MODULES:
        for cls in _declared(module):
            if cls.op in out:
                raise TypeError(
                    f"{cls.__qualname__} and {out[cls.op].__qualname__}: both {cls.op!r}"
                )
            out[cls.op] = cls
    return out


#: Every operation, by wire code: what the host dispatches on.
OPERATIONS: dict[Op, type[Operation]] = _operations()
#: The host's table: operation code -> handler(manager, request, reply).
HANDLERS: dict[Op, Callable[[Manager, Request, Reply], None]] = {
    code: cls.serve for code, cls in OPERATIONS.items()
}
#: The operations on several managers of a host in one request: code -> serve_host.
HOST_WIDE: dict[Op, Callable[..., None]] = {
    code: cls.serve_host for code, cls in OPERATIONS.items() if issubclass(cls, HostWide)
}
#: The operations a broadcast answers directly: code -> answer(manager, request).
ANSWERERS: dict[Op, Answerer] = {
    code: cls.answer for code, cls in OPERATIONS.items() if issubclass(cls, Answered)
}
#: The operations a host's event loop serves on its own thread (``Operation.inline``); a
#: broadcast is one of them when its inner operation is.
INLINE: frozenset[int] = frozenset(code for code, cls in OPERATIONS.items() if cls.inline)
