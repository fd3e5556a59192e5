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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DDictManagerStats:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
