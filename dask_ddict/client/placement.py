"""Where a dictionary's managers are, and moving them: ``rebalance()``, ``moves``.

Managers move when their worker leaves gracefully and with :meth:`Placement.rebalance`
(see :mod:`dask_ddict.cluster.elastic`); handles follow by themselves.  This
mixin is what a user asks of it (a base of :class:`~dask_ddict.DDict`).
"""

from __future__ import annotations

from typing import Any

from ..errors import raise_from_wire
from .base import HandleBase


class Placement(HandleBase):
    """Rebalancing a dictionary over the workers, and the moves it has seen."""

    def _ask(self, handler: str, **kwargs: Any) -> Any:
        client = self._core.client
        reply = client.sync(getattr(client.scheduler, handler), name=self._core.name, **kwargs)
        raise_from_wire(reply)
        return reply

    def rebalance(self) -> list[dict[str, Any]]:
        """Move managers so that the workers' numbers of them differ by at most one.

        Use it after the cluster grew (``cluster.scale(n)`` up, ``adapt``): new workers
        host nothing until managers move to them.  Each move pauses the writes of the
        manager that moves for a moment (on one machine: while its shard is re-opened;
        to another: while it is copied), and every handle follows it by itself.  More
        managers than workers (``managers_per_worker``) make finer moves.
        ``ddict.move.rebalance-on-join`` does it whenever a worker joins.

        Returns
        -------
        list of dict
            The moves made: ``manager_id``, ``source`` and ``target`` workers,
            ``copied`` (to another machine), ``nbytes``, ``seconds`` of paused writes.
        """
        self._check()
        moves = self._ask("ddict_rebalance")
        self._core.fresh(force=True)
        return list(moves)

    @property
    def moves(self) -> list[dict[str, Any]]:
        """The moves of this dictionary's managers that the orchestrator remembers (the
        newest 256 of the cluster's), oldest first, and managers that could not move
        (``target`` empty: their worker left and no other could take them).  Each says
        which manager moved from which worker to which, why, and how long its writes
        paused; ``dask ddict stats`` and the dashboard show the same."""
        self._check()
        return list(self._ask("ddict_moves"))
