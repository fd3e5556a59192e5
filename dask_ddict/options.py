"""DDictOptions: the validated, immutable creation arguments of a dictionary.

Validation follows Dragon's constructor rules (``docs/dragon.md``) but raises
``ValueError``/``TypeError`` as the spec asks, with messages that name the
offending argument.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from dask.utils import parse_bytes

from .arguments import (
    INT64_MAX,
    MAX_REPLICAS,
    absolute_store,
    check_bool,
    check_int,
    check_store_writable,
    local_store,
)


def parse_total_mem(total_mem: Any) -> int:
    """``total_mem`` as bytes: an int, or a dask byte string such as ``"1 GiB"``."""
    if isinstance(total_mem, bool):
        raise TypeError(f"total_mem must be an int or a byte string, got {total_mem!r}")
    if isinstance(total_mem, int):
        value = total_mem
    elif isinstance(total_mem, str):
        try:
            value = int(parse_bytes(total_mem))
        except Exception as e:
            raise ValueError(f"total_mem {total_mem!r} is not a byte size: {e}") from None
    else:
        raise TypeError(
            f"total_mem must be an int or a byte string, got {type(total_mem).__name__}"
        )
    if not 0 < value <= INT64_MAX:
        raise ValueError(f"total_mem must be in [1, {INT64_MAX}] bytes, got {value}")
    return value


@dataclass(frozen=True)
class DDictOptions:
    """What a dictionary was created with (shared by all its handles)."""

    working_set_size: int = 1
    wait_for_keys: bool = False
    wait_for_writers: bool = False
    persist_freq: int = 0
    persist_count: int = 0
    persist_path: str = ""
    read_only: bool = False
    restore_from: int | None = None
    manager_pool_full_thresh: float = 0.9
    replicas: int = 0
    #: Which persister writes ``persist_path`` (``persist.choice.persister_name``).
    persister: str = "zarr"

    def validate(self, *, name: str = "", restart: bool = False) -> None:
        """Raise ``ValueError``/``TypeError`` for an invalid combination."""
        check_int("working_set_size", self.working_set_size, 1)
        check_int("persist_freq", self.persist_freq, 0)
        check_int("persist_count", self.persist_count, -1)
        check_int("restore_from", self.restore_from, 0, allow_none=True)
        check_int("replicas", self.replicas, 0, MAX_REPLICAS)
        for flag in ("wait_for_keys", "wait_for_writers", "read_only"):
            check_bool(flag, getattr(self, flag))
        if not isinstance(self.persist_path, str):
            raise TypeError(f"persist_path must be a str, got {type(self.persist_path).__name__}")
        local = local_store(self.persist_path)
        if local and os.path.isfile(local):
            raise ValueError(
                f"persist_path {self.persist_path!r} is a file, not a zarr store "
                "(a directory or an fsspec URL)"
            )
        if self.working_set_size == 1 and (self.wait_for_keys or self.wait_for_writers):
            raise ValueError(
                "working_set_size must be greater than 1 with wait_for_keys or wait_for_writers"
            )
        if self.persist_freq < 0:
            raise ValueError("persist_freq must be non-negative")
        if self.persist_count < -1:
            raise ValueError("persist_count must be -1 (keep all) or >= 0")
        if self.persister == "null" and (
            self.persist_freq or self.persist_path or self.restore_from is not None
        ):
            raise ValueError(
                "persister_class=NULLCheckpointPersister persists nothing: persist_freq must "
                "be 0 (as in Dragon), and persist_path and restore_from not given"
            )
        if self.persister == "directory" and self.persist_path and not local:
            raise ValueError(
                f"persist_path {self.persist_path!r} is a URL: the directory "
                "persister writes files in a directory (for a URL, "
                "persister_class=None: zarr)"
            )
        if self.persist_freq > 0 and not self.persist_path:
            raise ValueError("persist_freq > 0 needs a persist_path (a zarr store)")
        if self.restore_from is not None and self.restore_from < 0:
            raise ValueError("restore_from must be a checkpoint id >= 0")
        if self.read_only:
            if not name:
                raise ValueError("read_only needs the name of the dictionary to replay")
            if self.restore_from is None:
                raise ValueError("read_only needs restore_from (the checkpoint id to replay)")
            if self.wait_for_keys or self.wait_for_writers:
                raise ValueError("read_only cannot be combined with wait_for_keys/wait_for_writers")
            if self.working_set_size != 1:
                raise ValueError("read_only needs working_set_size == 1")
            if self.persist_count != 0:
                raise ValueError("read_only needs persist_count == 0")
            if self.replicas:
                raise ValueError(
                    "read_only cannot be combined with replicas (a replay writes "
                    "nothing that a replica would keep)"
                )
        if self.restore_from is not None and not name:
            raise ValueError("restore_from needs the name of the dictionary to restore")
        if restart and not name:
            raise ValueError("restart needs the name of the dictionary to restart")
        thresh = self.manager_pool_full_thresh
        if isinstance(thresh, bool) or not isinstance(thresh, (int, float)):
            raise TypeError("manager_pool_full_thresh must be a number")
        if not 0 < thresh <= 1:
            raise ValueError(f"manager_pool_full_thresh must be in (0, 1], got {thresh}")
        # Last, once every argument is known good: a dictionary that will write its store
        # must be able to.  A read_only replay never writes, and a restore (persist_freq=0)
        # may only read a store it cannot write (a missing one is the restore's to report).
        if local and not self.read_only and (self.persist_freq > 0 or self.restore_from is None):
            check_store_writable(self.persist_path)

    def resolved(self) -> DDictOptions:
        """These options as they mean in this process: a relative local
        ``persist_path`` made absolute here, before it reaches a host process
        (whose working directory is its own)."""
        return dataclasses.replace(self, persist_path=absolute_store(self.persist_path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DDictOptions:
        return cls(**d)
