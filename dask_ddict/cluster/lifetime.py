"""Holders: which Dask clients keep which dictionaries alive (futures-like lifetime).

A dictionary created with ``lifetime="client"`` (the default) is held by the
client that created it and by every client that attached to it by name
(``DDict.from_name``).  When its last holder leaves the scheduler (closed,
crashed, or its process killed), the dictionary is released after a grace
period, as Dask releases a client's futures, Variables and Queues; a holder
that reconnects within the period (Dask clients reconnect with their id)
keeps it.  ``lifetime="cluster"`` dictionaries have no holders: they live
until ``destroy()``.

This is a pure data structure: the clock (``call_later``) and the release
action are injected, so it is unit-tested without a cluster.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class Timer(Protocol):
    def cancel(self) -> None: ...


class Holders:
    """The holders of every client-lifetime dictionary, and the pending releases.

    Parameters
    ----------
    release
        Called with a dictionary's name and uid when its grace period ends with
        no holder back.
    call_later
        ``call_later(seconds, callback)`` returning something with ``cancel()``
        (``asyncio.get_running_loop().call_later`` on the scheduler).
    grace
        The grace period in seconds, read when a release is scheduled.
    """

    def __init__(
        self,
        release: Callable[[str, str], Any],
        call_later: Callable[[float, Callable[[], Any]], Timer],
        grace: Callable[[], float],
    ) -> None:
        self._release = release
        self._call_later = call_later
        self._grace = grace
        self._uids: dict[str, str] = {}  # name -> uid of the client-lifetime dicts
        self._holders: dict[str, set[str]] = {}  # name -> connected holders
        self._departed: dict[str, set[str]] = {}  # name -> holders gone within the grace
        self._timers: dict[str, Timer] = {}  # name -> pending release

    def __repr__(self) -> str:
        return f"<Holders dicts={len(self._uids)} pending_releases={sorted(self._timers)}>"

    def created(self, name: str, uid: str, client: str) -> None:
        """``client`` created ``name`` with ``lifetime="client"``."""
        self._uids[name] = uid
        self._holders[name] = {client} if client else set()
        self._departed[name] = set()

    def attached(self, name: str, client: str) -> None:
        """``client`` attached by name: it holds the dictionary too."""
        if name in self._uids and client:
            self._holders[name].add(client)
            self._departed[name].discard(client)
            self._cancel(name)

    def forget(self, name: str) -> None:
        """``name`` was destroyed (by anyone): nothing to release any more."""
        self._cancel(name)
        for table in (self._uids, self._holders, self._departed):
            table.pop(name, None)

    def holders(self, name: str) -> list[str]:
        """The connected clients that hold ``name`` (empty for cluster lifetime)."""
        return sorted(self._holders.get(name, ()))

    def release_pending(self, name: str) -> bool:
        return name in self._timers

    def client_left(self, client: str) -> None:
        """A client left the scheduler: start the grace period of what only it held."""
        for name, held in self._holders.items():
            if client not in held:
                continue
            held.discard(client)
            self._departed[name].add(client)
            if not held and name not in self._timers:
                grace = self._grace()
                logger.info(
                    "ddict %s: its last client (%s) left; released in %g s unless it comes back",
                    name,
                    client,
                    grace,
                )
                self._timers[name] = self._call_later(grace, functools.partial(self._expire, name))

    def client_came_back(self, client: str) -> None:
        """A client (re)connected: it holds again what it held before leaving."""
        for name, gone in self._departed.items():
            if client in gone:
                gone.discard(client)
                self._holders[name].add(client)
                self._cancel(name)

    def _cancel(self, name: str) -> None:
        timer = self._timers.pop(name, None)
        if timer is not None:
            timer.cancel()
            logger.info("ddict %s: a holder is back; release cancelled", name)

    def _expire(self, name: str) -> None:
        self._timers.pop(name, None)
        uid = self._uids.get(name)
        if uid is None or self._holders.get(name):
            return
        logger.info("ddict %s: released (no client holds it)", name)
        self.forget(name)
        self._release(name, uid)
