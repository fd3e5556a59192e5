"""What an operation on several managers needs of a dictionary's channels (:class:`Routing`).

A broadcast (:mod:`.broadcast`) and a many-key read (:mod:`.many_key_reads`) group
the managers by the host link that reaches them, send to every host before they read
any answer, and send again to the managers that moved meanwhile.  They ask the
dictionary's :class:`~.channels.Channels` for the links and the moves; the protocol
here says what they ask, so that they need not import it (it imports them, to offer
``each`` and ``get_many`` on the one object a handle holds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NoReturn, Protocol

from ..layout import Layout
from .socket_client import HostLink

#: How many moves one operation follows (a manager that moves again while it is followed).
MOST_FOLLOWS = 8


class Routing(Protocol):
    """A dictionary's channels, as an operation on several of its managers sees them."""

    closed: bool

    @property
    def layout(self) -> Layout: ...

    def channel(self, mid: int) -> Any:
        """Manager ``mid``'s channel (made on first use)."""
        ...

    def made(self, mid: int) -> Any:
        """Manager ``mid``'s channel if it was made already, else ``None`` (never asks)."""
        ...

    def routes(self, mids: list[int]) -> list[tuple[HostLink, list[int]]]:
        """``mids`` grouped by the host link that reaches them."""
        ...

    def follow(
        self, mid: int, deadline: float | None, via: tuple[str, str, int] | None = None
    ) -> HostLink:
        """The link to manager ``mid``'s host now that it moved from ``via``."""
        ...

    def settle(
        self,
        mid: int,
        deadline: float | None,
        since: float,
        via: tuple[str, str, int] | None = None,
    ) -> HostLink:
        """The link to send to again after manager ``mid``'s host answered ``LEASE``."""
        ...

    def pipe_links(self, mids: Iterable[int]) -> dict[int, HostLink]:
        """The links an event loop's requests to ``mids`` may be pipelined to."""
        ...

    def get_many(
        self,
        groups: dict[int, list[bytes]],
        chkpt: int,
        timeout: float | None,
        lend: bool | None = False,
        follows: int = 0,
        since: float = 0.0,
        absent: Any = None,
        began: float | None = None,
    ) -> dict[int, list[Any]]:
        """The frames of many keys, by manager (see :mod:`.many_key_reads`)."""
        ...


def failed(e: BaseException) -> Callable[[], NoReturn]:
    """The answer of a request that could not be sent (``e``, connecting): it raises
    ``e`` when collected, where the answers of the requests that went out are read, so
    that a failure to reach one host never leaves another's answer unread."""

    def answer() -> NoReturn:
        raise e

    return answer
