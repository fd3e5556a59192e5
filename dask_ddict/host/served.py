"""Served: the requests a host process served, by manager and operation.

The counts are taken where every request that reaches a host passes, the server's
request loop (:meth:`~dask_ddict.host.server.HostServer._one_request`): a plain
request counts once for its manager; a broadcast
(:class:`~dask_ddict.transport.ops.FanOut`) once for each of its managers hosted
here, under its inner operation (``len``, ``stats``), also when the host answers it
from a kept answer; a request on several managers (``get_many``, ``put_many``) once
for each manager it reaches.  Reads and small puts that a same-host client serves
from the shard itself never reach the host process and are not counted: these are
the host's requests, not every access to the dictionary.

Each connection counts in a table of its own that only its thread writes
(:class:`~dask_ddict.kernels.ServedTable`: C counters in the compiled set, which its
plain server adds to without an object), so the key path takes no lock; the table
joins the closed connections' total when its connection ends.  Reading (a ``stats``
request, rare) copies the tables under a lock.  The counts start at zero with each
host process: the scheduler reports them as Prometheus counters, which expect such
resets.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..kernels import ServedTable
from ..transport.ops import unpack_fan_out
from ..transport.protocol import Op

if TYPE_CHECKING:
    from ..shard.manager import Manager

_NAMES = {int(op): op.name.lower() for op in Op}
_STATS = int(Op.STATS)


class Served:
    """The requests served for one dictionary's managers in this host process."""

    __slots__ = ("_lock", "_open", "_done")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, ServedTable] = {}  # id(table) -> a live connection's table
        self._done = ServedTable()  # what the connections that ended counted

    def __repr__(self) -> str:
        return f"<Served connections={len(self._open)}>"

    def connection(self) -> ServedTable:
        """A new connection's table (written by its thread alone until :meth:`release`)."""
        table = ServedTable()
        with self._lock:
            self._open[id(table)] = table
        return table

    def release(self, table: ServedTable) -> None:
        """Keep what an ended connection counted."""
        with self._lock:
            del self._open[id(table)]
            for mid, counts in table.items():
                for op, n in counts.items():
                    self._done.count(mid, op, n)

    def _counts(self) -> Iterator[tuple[int, dict[int, int]]]:
        """``(manager, {operation: requests})`` of every table (lock held): copies of
        tables that their threads keep writing meanwhile (:meth:`ServedTable.items`)."""
        for table in (self._done, *self._open.values()):
            yield from table.items()

    def of(self, mid: int) -> dict[str, int]:
        """Requests served for manager ``mid``, by operation name (``{"get": 3}``)."""
        total: Counter[int] = Counter()
        with self._lock:
            for m, counts in self._counts():
                if m == mid:
                    total.update(counts)
        return {_NAMES.get(op, str(op)): n for op, n in sorted(total.items())}

    def moves(self) -> int:
        """A number that grows with every request served but ``stats`` requests.

        A broadcast's ``stats`` answer reports the requests served, so the host keeps
        it (``FanOut``'s kept answers) only while this number stays: other requests make
        it stale, while ``stats`` broadcasts alone leave it (and can still be answered
        from it, their own count lagging by the ones answered so).
        """
        with self._lock:
            return sum(
                n for _, counts in self._counts() for op, n in counts.items() if op != _STATS
            )


class Counting(Mapping[int, "Manager"]):
    """A host's managers as a request on several of them sees them: each one it looks
    up counts once for the request's operation (``get_many``, ``put_many``)."""

    __slots__ = ("_managers", "_table", "_op")

    def __init__(self, managers: Mapping[int, Manager], table: ServedTable, op: int) -> None:
        self._managers, self._table, self._op = managers, table, op

    def __getitem__(self, mid: int) -> Manager:
        manager = self._managers[mid]
        self._table.count(mid, self._op)
        return manager

    def __iter__(self) -> Iterator[int]:
        return iter(self._managers)

    def __len__(self) -> int:
        return len(self._managers)


def count_fanout(table: ServedTable, managers: Mapping[int, Manager], keysec: Any, op: int) -> None:
    """Count a broadcast (``keysec``: its key section) once for each of its managers
    hosted here, under its inner operation ``op``: from the request itself, so that a
    broadcast the host answers from a kept answer counts too."""
    for mid in unpack_fan_out(keysec)[1]:
        if mid in managers:
            table.count(mid, op)
