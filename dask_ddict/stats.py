"""DDictManagerStats: what a manager reports about its shard."""

from __future__ import annotations

from dataclasses import dataclass, fields
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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DDictManagerStats:
        """From a manager's record (fields it has and this version lacks are dropped).

        Built without ``__init__`` (a frozen dataclass's sets each field through
        ``object.__setattr__``): ``stats`` builds one per manager, thousands at scale.
        """
        s = object.__new__(cls)
        s.__dict__.update(d if d.keys() == FIELDS else {k: d[k] for k in FIELDS if k in d})
        return s

    @classmethod
    def from_record(cls, values: tuple[Any, ...]) -> DDictManagerStats:
        """From :meth:`record`'s tuple (what a manager sends: no field names)."""
        s = object.__new__(cls)
        s.__dict__.update(zip(FIELDS, values))
        return s

    @staticmethod
    def record(d: dict[str, Any]) -> tuple[Any, ...]:
        """A manager's stats as a tuple in field order (for :meth:`from_record`)."""
        return tuple(d[k] for k in FIELDS)


#: The field names in order (``fields()`` is slow: once).
FIELDS = {f.name: None for f in fields(DDictManagerStats)}.keys()
