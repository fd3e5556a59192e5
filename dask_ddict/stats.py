"""DDictManagerStats: what a manager reports about its shard."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class DDictManagerStats:
    """Usage of one manager's shard (``d.stats`` lists them by manager id)."""

    manager_id: int
    worker: str
    hostname: str
    total_bytes: int
    total_used_bytes: int
    pool_free_space: int
    pool_utilization: float
    num_keys: int
    oldest_checkpoint: int = 0
    newest_checkpoint: int = 0
    frozen: bool = False
    pid: int = 0
    #: Bytes of this shard that processes on its host hold as zero-copy values
    #: (``get(copy=False)``, reads of a frozen dictionary), and how many such values.
    pinned_bytes: int = 0
    pinned_views: int = 0
    #: Operations waiting at the manager (``wait_for_keys``/``wait_for_writers``: a
    #: put to a checkpoint that cannot be created yet, a read of a key not yet written).
    deferred_ops: int = 0
    #: Requests the host process served for this manager since it started, by
    #: operation (``{"get": 12, "put": 3, "stats": 1}``): every request that reached
    #: the host over a socket, a broadcast's share included.  Same-host reads and
    #: small puts that a client serves from the shard itself are not among them.
    ops_served: dict[str, int] = field(default_factory=dict, hash=False)
    #: How many times the supervisor restarted this manager's host process.
    host_restarts: int = 0
    #: Checkpoint ids this manager has committed to ``persist_path``, ascending
    #: (``persisted_ids()`` is those committed on every manager).
    persisted_ids: tuple[int, ...] = ()
    #: The live replicas this manager ships its writes to (``DDict(..., replicas=k)``);
    #: fewer than ``k`` while one is being made again after a loss.
    replicas: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DDictManagerStats:
        """From a manager's record (fields it has and this version lacks are dropped).

        Built without ``__init__`` (a frozen dataclass's sets each field through
        ``object.__setattr__``): ``stats`` builds one per manager, thousands at scale.
        """
        s = object.__new__(cls)
        if d.keys() == FIELDS:
            s.__dict__.update(d)
        else:
            s.__dict__.update({k: d[k] for k in FIELDS if k in d})
            s._fill()
        return s

    @classmethod
    def from_record(cls, values: tuple[Any, ...]) -> DDictManagerStats:
        """From :meth:`record`'s tuple (what a manager sends: no field names).

        An older manager's shorter tuple gets the defaults of the fields it lacks.
        """
        s = object.__new__(cls)
        s.__dict__.update(zip(FIELDS, values))
        if len(values) < len(FIELDS):
            s._fill()
        return s

    def _fill(self) -> None:
        """Give an older manager's record the fields it lacks whose default is made per
        record (``ops_served``); plain defaults are class attributes, read as they are."""
        for name, make in _FACTORIES.items():
            self.__dict__.setdefault(name, make())

    @staticmethod
    def record(d: dict[str, Any]) -> tuple[Any, ...]:
        """A manager's stats as a tuple in field order (for :meth:`from_record`)."""
        return tuple(d[k] for k in FIELDS)


#: The field names in order (``fields()`` is slow: once).
FIELDS = {f.name: None for f in fields(DDictManagerStats)}.keys()
#: The fields whose default is made for each record (``default_factory``).
_FACTORIES: dict[str, Callable[[], Any]] = {
    f.name: f.default_factory for f in fields(DDictManagerStats) if f.default_factory is not MISSING
}
