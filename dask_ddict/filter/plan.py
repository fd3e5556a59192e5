"""The plan of a filter: the tree of its tasks, where they run, what each one knows.

One task per manager (a *leaf*) runs beside its shard; its results go up to a
*merge task* (fan-in at most ``branching_factor``) or to the caller, the tree's
root.  :func:`tree` shapes the tree so the first merges happen on the workers
that host the leaves (only merged results travel further), and :class:`Plan`
is what every task is given: the tree, the stream limits, the caller's address
and the token that proves a connection belongs to this filter.

Tasks are submitted with :func:`map_placed`: one ``client.map`` per placement
(one message to the scheduler each), not one ``submit`` per task.
"""

from __future__ import annotations

import math
import ssl
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import distributed

from ..transport.sockets import tls_context
from .streams import ROOT, StreamLimits


@dataclass(frozen=True)
class Plan:
    """What every task of one filter knows: the tree, and how to reach the caller."""

    token: bytes = field(repr=False)  # proves a connection belongs to this filter
    root: tuple[str, int]
    #: The parent of each node: nodes ``0 .. leaves-1`` are the managers' tasks, the
    #: rest merge tasks; :data:`~.streams.ROOT` is the caller.
    parents: tuple[int, ...]
    leaves: int
    limits: StreamLimits
    tls: bool = False  # the cluster's TLS: every stream is TLS, with its certificates

    def ssl_context(self, listen: bool) -> ssl.SSLContext | None:
        """A task's TLS context (``None`` without TLS); in the task's own thread."""
        if not self.tls:
            return None
        return tls_context(distributed.get_worker().security, "worker", listen)

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]


def tree(workers: list[str], fan_in: int) -> tuple[list[int], list[str]]:
    """``(parent of each node, worker of each merge node)`` for leaves on ``workers``.

    Leaves are grouped by worker, so the first merges happen beside the shards
    and only merged results travel further; each level has as few merge nodes
    as the fan-in allows, evenly filled.
    """
    n = len(workers)
    parents = [ROOT] * n
    where = dict(enumerate(workers))
    level = sorted(range(n), key=lambda i: (workers[i], i))
    while len(level) > fan_in:
        groups = math.ceil(len(level) / fan_in)
        size = math.ceil(len(level) / groups)
        nxt = []
        for g in range(0, len(level), size):
            node = len(parents)
            parents.append(ROOT)
            members = level[g : g + size]
            for m in members:
                parents[m] = node
            where[node] = Counter(where[m] for m in members).most_common(1)[0][0]
            nxt.append(node)
        level = nxt
    return parents, [where[i] for i in range(n, len(parents))]


def by_placement(where: list[list[str] | None]) -> dict[tuple[str, ...], list[int]]:
    """The indices of ``where`` grouped by placement (``()``: anywhere), in order."""
    out: dict[tuple[str, ...], list[int]] = {}
    for i, w in enumerate(where):
        out.setdefault(tuple(w or ()), []).append(i)
    return out


def map_placed(
    client: distributed.Client,
    fn: Callable[..., Any],
    placed: dict[tuple[str, ...], list[int]],
    args: Callable[[int], tuple[Any, ...]],
    key: Callable[[int], str],
    **kwargs: Any,
) -> dict[int, distributed.Future]:
    """``fn(*args(node))`` per node, one ``client.map`` (one message to the scheduler)
    per placement (the workers it may run on; ``()``: anywhere)."""
    out: dict[int, distributed.Future] = {}
    for where, nodes in placed.items():
        columns = list(zip(*(args(n) for n in nodes)))
        futures = client.map(
            fn,
            *columns,
            key=[key(n) for n in nodes],
            workers=list(where) or None,
            allow_other_workers=bool(where),
            pure=False,
            **kwargs,
        )
        out.update(zip(nodes, futures))
    return out
