"""What broadcasts ask of a manager (``len``, ``stats``), kept while its shard is unchanged.

A broadcast asks every manager of every host, and most shards have not changed
since the last one: a manager computes these from a snapshot once, and answers
again from what it kept until its shard's generation (see
:mod:`~dask_ddict.shard.generations`) or its own window or frozen flag moves.
``len`` itself never scans: it reads the counts the shard keeps
(:mod:`~dask_ddict.shard.key_counts`).
"""

from __future__ import annotations

import os
import pickle
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import lmdb

from ..stats import FIELDS, DDictManagerStats
from . import key_counts
from .visibility import check_window

if TYPE_CHECKING:
    from .deferred import DeferredQueue
    from .generations import Generations
    from .pinboard import BoardReader
    from .store import ShardStore
    from .working_set import WorkingSet

T = TypeVar("T")

_HOSTNAME = socket.gethostname()  # (a syscall per stats record otherwise)
#: The fields at the end of a stats record that :meth:`Summaries._live` reads at each ask.
_LIVE = 7


class Summaries:
    """Mixin of :class:`~dask_ddict.shard.manager.Manager`: ``len`` and ``stats``."""

    manager_id: int
    worker: str
    store: ShardStore
    working_set: WorkingSet
    frozen: bool
    closed: bool
    generations: Generations | None
    #: The host's pin boards (:mod:`.pinboard`): ``pins.of(mid) -> (bytes, views)``.
    pins: BoardReader | None
    #: ``served(mid) -> {operation: requests}`` from the host's server, and how many times
    #: the host process was restarted: both set by the host process that serves it.
    served: Callable[[int], dict[str, int]] | None = None
    host_restarts: int = 0
    _cache: dict[str, tuple[tuple[int, int, int, bool], Any]]
    _deferred: DeferredQueue

    def _check_open(self) -> None:
        raise NotImplementedError

    if TYPE_CHECKING:  # provided by the manager (CheckpointIO)

        def persisted_ids(self) -> list[int]: ...

    def _derived(self, what: str, compute: Callable[[lmdb.Transaction], T]) -> T:
        """``compute`` on a snapshot, reused while the shard and this manager are unchanged.

        Broadcasts (``len``, ``stats``) ask every manager; most shards have not
        changed since the last one.  The shard's word in its host's
        :mod:`~.generations` (else a snapshot's transaction id) changes with every
        commit, also a same-host client's direct put, and the window and the
        frozen flag are this process's own: together they say when to compute again.
        """
        if self.closed:
            self._check_open()
        gens = self.generations
        word = gens.get(self.manager_id) if gens is not None else 0
        hit = self._cache.get(what)
        if word:  # read before the snapshot begins: the value is never older than it
            state = (word, 0, self.working_set.newest, self.frozen)
            if hit is not None and hit[0] == state:
                return hit[1]
            with self.store.read() as txn:
                value = compute(txn)
        else:
            with self.store.read() as txn:
                state = (0, txn.id(), self.working_set.newest, self.frozen)
                if hit is not None and hit[0] == state:
                    return hit[1]
                value = compute(txn)
        self._cache[what] = (state, value)
        return value

    def _counts(self) -> tuple[key_counts.Window, list[int]]:
        """The window and the keys seen at each of its checkpoints (see :mod:`.counts`)."""
        return self._derived("counts", self._load_counts)

    def _load_counts(self, txn: lmdb.Transaction) -> tuple[key_counts.Window, list[int]]:
        w = self.working_set.window
        return w, key_counts.load(self.store, txn, w)

    def length(self, chkpt: int) -> int:
        """Keys seen at ``chkpt``: kept counts, no scan (:mod:`.counts`), and never a wait."""
        w, n = self._counts()
        check_window(chkpt, w.newest, w.size)
        return n[w.slot(chkpt)]

    def stats(self) -> dict[str, Any]:
        return dict(zip(FIELDS, self._live(self._derived("stats-record", self._stats_record))))

    def stats_pickled(self) -> bytes:
        """:meth:`stats` as a reply carries it: a pickled record."""
        return pickle.dumps(self._live(self._derived("stats-record", self._stats_record)))

    def _live(self, record: tuple[Any, ...]) -> tuple[Any, ...]:
        """The shard's cached part of a stats record and what is read now (pins,
        deferred operations, requests served: they change without a commit)."""
        mid = self.manager_id
        pinned = (0, 0) if self.pins is None else self.pins.of(mid)
        served = {} if self.served is None else self.served(mid)
        shipper: Any = getattr(self, "shipper", None)
        return (
            record[:-_LIVE]
            + pinned
            + (
                len(self._deferred),
                served,
                self.host_restarts,
                tuple(self.persisted_ids()),
                0 if shipper is None else len(shipper.targets),
            )
        )

    def _stats_record(self, txn: lmdb.Transaction) -> tuple[Any, ...]:
        return DDictManagerStats.record(self._stats(txn))

    def _stats(self, txn: lmdb.Transaction) -> dict[str, Any]:
        used, entries = self.store.usage(txn)
        total = self.store.capacity
        return {
            "manager_id": self.manager_id,
            "worker": self.worker,
            "hostname": _HOSTNAME,
            "total_bytes": total,
            "total_used_bytes": used,
            "pool_free_space": max(0, total - used),
            "pool_utilization": used / total if total else 0.0,
            "num_keys": entries,
            "oldest_checkpoint": self.working_set.oldest,
            "newest_checkpoint": self.working_set.newest,
            "frozen": self.frozen,
            "pid": os.getpid(),
            "pinned_bytes": 0,  # (see _live: the host's pin boards)
            "pinned_views": 0,
            "deferred_ops": 0,
            "ops_served": {},
            "host_restarts": 0,
            "persisted_ids": (),
            "replicas": 0,
        }
