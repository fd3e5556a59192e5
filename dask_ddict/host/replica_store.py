"""The replicas a host process keeps of other host processes' managers.

Each is a copy of a primary's shard to which the primary's committed change sets
(:mod:`dask_ddict.shard.changes`) are applied, one transaction each, in their
order; :func:`serve` is the host's handler of
:class:`~dask_ddict.transport.whole_checkpoints.Replicate`.  How replicas are
made, fed and promoted: :mod:`.replicas`.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Protocol

from .._blocking import will_block
from ..errors import DDictError, DDictManagerMovedError, DDictManagerUnavailableError
from ..shard import changes
from ..shard.store import ShardStore
from ..transport.operation import Reply, Request
from . import hygiene

#: Seconds a change set waits for its predecessor (sent over another connection).
OUT_OF_STEP_AFTER = 10.0


class Hosted(Protocol):
    """What :func:`serve` needs of a ``hosted.HostedDict``."""

    name: str
    replicas: dict[int, Replica]
    managers: dict[int, Any]


class Replica:
    """A replica of manager ``manager_id`` kept here: a copy of its shard, to which the
    primary's change sets are applied in their order."""

    def __init__(self, manager_id: int, store: ShardStore, lock: int | None) -> None:
        self.manager_id = manager_id
        self.store = store
        self.lock = lock  # (its owner lock: no sweep removes it while it is kept here)
        self.seq = 0  # the last change set applied
        self._cond = threading.Condition()
        self.stale = ""  # why it must not be promoted ("": it holds what its primary does)

    def __repr__(self) -> str:
        return f"<Replica manager={self.manager_id} seq={self.seq} {self.store.path!r}>"

    def apply(self, seq: int, payload: Any) -> None:
        """Apply change set ``seq`` once its predecessor is (a primary sends some without
        waiting, over several connections: their order is the numbers'); a resend of one
        applied is taken once; 0: a new primary ships from now on, numbering from 1; -1:
        the primary dropped this replica.  A replica that missed or failed a change set is
        *stale* from then on: it takes nothing more and is never promoted."""
        with self._cond:
            if self.stale:
                raise DDictError(
                    f"replica of manager {self.manager_id} is stale ({self.stale})",
                    "INVALID_OPERATION",
                )
            if seq < 0:
                self.stale = "its primary dropped it"
                return
            if seq == 0:
                self.seq = 0
                self._cond.notify_all()
                return
            if seq <= self.seq:
                return
            if seq > self.seq + 1:
                will_block()  # (its predecessor comes on another connection of this loop's)
            try:
                if (
                    not self._cond.wait_for(
                        lambda: self.seq >= seq - 1 or bool(self.stale), OUT_OF_STEP_AFTER
                    )
                    or self.seq != seq - 1
                ):
                    raise DDictError(
                        f"replica of manager {self.manager_id} is out of step: it "
                        f"got change set {seq} after {self.seq}",
                        "INVALID_OPERATION",
                    )
                with self.store.env.begin(write=True, buffers=True) as txn:
                    changes.apply(self.store, txn, payload)
            except BaseException as e:
                self.stale = self.stale or f"change set {seq} failed: {e}"
                self._cond.notify_all()
                raise
            self.seq = seq
            self._cond.notify_all()

    def close(self, destroy: bool = True) -> None:
        try:
            if destroy:
                self.store.destroy()
            else:
                self.store.close()
        finally:
            hygiene.release(self.lock)


def serve(hosted: Hosted, r: Request, reply: Reply) -> None:
    """Serve a :class:`Replicate` request: apply its change set to the replica here."""
    replica = hosted.replicas.get(r.manager)
    if replica is None and r.manager in hosted.managers:  # (it took over: the sender is
        raise DDictManagerMovedError(
            f"manager {r.manager} of {hosted.name!r} failed over to process {os.getpid()}"
        )  # deposed)
    if replica is None:
        raise DDictManagerUnavailableError(
            f"process {os.getpid()} keeps no replica of manager {r.manager} of {hosted.name!r}"
        )
    replica.apply(r.arg, r.value)
    reply()
