"""What a dictionary looks like to people: one summary, rendered as HTML.

:func:`summarize` turns a layout and its managers' answers into plain,
JSON-ready data; the Jupyter repr (``DDict._repr_html_``), the dashboard page
and its JSON endpoint (:mod:`dask_ddict.cluster.dashboard`) all show that same
summary, rendered by the Jinja2 templates in ``dask_ddict/templates``.  Pure
functions: tested without a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

from dask.utils import format_bytes

from .layout import Layout
from .stats import DDictManagerStats

if TYPE_CHECKING:
    import jinja2


def summarize(
    layout: Layout,
    stats: Mapping[int, DDictManagerStats | BaseException],
    persisted: Mapping[int, Sequence[int]] | None = None,
    *,
    holders: Sequence[str] | None = None,
    release_pending: bool = False,
    checkpoint: int | None = None,
    moves: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """A dictionary's state as JSON-ready data.

    Parameters
    ----------
    layout
        Where its managers are.
    stats
        Each reachable manager's stats, or the exception that asking it raised
        (a lost or unreachable manager is shown as such, not left out).
    persisted
        Checkpoint ids persisted by each manager, when known.
    holders, release_pending
        The clients that keep a ``lifetime="client"`` dictionary alive, and
        whether its release is pending (its holders left, grace running);
        ``None`` where only the orchestrator knows (a handle's repr).
    checkpoint
        The checkpoint of the handle that shows it (a repr), if any.
    moves
        Its managers' moves the orchestrator remembers, oldest first (see
        :mod:`dask_ddict.cluster.moves`): the last 10 are shown.
    """
    managers = []
    for m in layout.managers:
        s = stats.get(m.manager_id)
        row: dict[str, Any] = {
            "manager_id": m.manager_id,
            "worker": m.worker,
            "hostname": m.hostname,
            "lost": m.lost,
            "error": None,
            "num_keys": None,
            "bytes": None,
            "capacity": None,
            "fill": None,
            "window": None,
            "frozen": None,
            "pinned_bytes": None,
            "pinned_views": None,
            "deferred_ops": None,
            "ops_served": None,
            "host_restarts": None,
            "persisted": list((persisted or {}).get(m.manager_id, ())),
            "replicas": None,
        }
        if isinstance(s, DDictManagerStats):
            row.update(
                num_keys=s.num_keys,
                bytes=s.total_used_bytes,
                capacity=s.total_bytes,
                fill=s.pool_utilization,
                frozen=s.frozen,
                pinned_bytes=s.pinned_bytes,
                pinned_views=s.pinned_views,
                deferred_ops=s.deferred_ops,
                ops_served=dict(s.ops_served),
                host_restarts=s.host_restarts,
                replicas=s.replicas,
                window=[s.oldest_checkpoint, s.newest_checkpoint],
            )
        elif m.lost:
            row["error"] = "lost with its host"
        elif s is not None:
            row["error"] = f"{type(s).__name__}: {s}"[:200]
        managers.append(row)
    known = [r for r in managers if r["num_keys"] is not None]
    opts = layout.options
    return {
        "name": layout.name,
        "uid": layout.uid,
        "lifetime": layout.lifetime,
        "holders": None if holders is None else list(holders),
        "release_pending": release_pending,
        "creator": layout.creator,
        "epoch": layout.epoch,
        "checkpoint": checkpoint,
        "num_managers": layout.num_managers,
        "hosts": sorted({m.hostname for m in layout.managers}),
        "workers": sorted({m.worker for m in layout.managers}),
        "total_mem": layout.total_mem,
        "num_keys": sum(r["num_keys"] for r in known) if known else None,
        "bytes": sum(r["bytes"] for r in known) if known else None,
        "answered": len(known),
        "working_set_size": opts.working_set_size,
        "persist_path": opts.persist_path,
        "persist_freq": opts.persist_freq,
        "read_only": opts.read_only,
        "replicas": opts.replicas,
        "managers": managers,
        "moves_total": len(moves),
        "moves": [dict(m) for m in list(moves)[-10:]],
    }


@cache
def _environment(package: str) -> jinja2.Environment:
    import jinja2  # on first render: importing dask_ddict stays light

    env = jinja2.Environment(
        loader=jinja2.PackageLoader(package, "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["bytes"] = lambda n: "?" if n is None else format_bytes(n)
    env.filters["percent"] = lambda x: "?" if x is None else f"{x:.1%}"
    return env


def render(template: str, package: str = "dask_ddict", **context: Any) -> str:
    """Render ``<package>/templates/<template>`` (autoescaped: names are user text)."""
    return _environment(package).get_template(template).render(**context)


def dict_html(summary: dict[str, Any]) -> str:
    """One dictionary as an HTML fragment (Jupyter, the dashboard)."""
    return render("ddict.html.j2", d=summary)
