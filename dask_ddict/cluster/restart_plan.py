"""Restarting a dictionary kept for a restart: ``DDict(..., restart=True)``.

``d.destroy(allow_restart=True)`` stops the managers but keeps their shards in their
machines' shared memory, and the orchestrator keeps the layout (``kept``).  A creation
with ``restart=True`` under that name re-attaches them:

* :func:`kept_for_restart`: the kept layout, once the new arguments are checked
  against it (as many managers; the same checkpoint options, which the shards' data
  was written under);
* :func:`restart_plan`: each kept manager placed where its shard is: its old host if
  still connected, else a worker on the same machine (re-attaching the shard), else
  the least loaded worker (that satisfies its placement policy), where it starts empty;
* :func:`remove_abandoned`: once the managers serve, the kept shards that none
  re-attached are deleted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from distributed.comm import get_address_host

from ..errors import DDictError
from ..layout import Layout, ManagerInfo
from ..options import DDictOptions
from ..placement import Policy
from .leftovers import Orchestrator, remove_lost

#: The options a restart must repeat: the kept shards' data was written under them.
SAME_OPTIONS = ("working_set_size", "wait_for_keys", "wait_for_writers", "persist_freq")


def kept_for_restart(kept: Mapping[str, Layout], name: str, opts: DDictOptions, num: int) -> Layout:
    """The layout of ``name`` kept for a restart, which ``num`` managers with ``opts``
    re-attach; refused if none is kept, or the arguments do not match it."""
    layout = kept.get(name)
    if layout is None:
        raise DDictError(
            f"no DDict named {name!r} was destroyed with allow_restart=True on this "
            f"cluster (kept: {sorted(kept)})",
            "INVALID_ARGUMENT",
        )
    if layout.num_managers != num:
        raise ValueError(
            f"restart of {name!r} needs {layout.num_managers} managers (it had that many); "
            f"these arguments give {num}"
        )
    for field_name in SAME_OPTIONS:
        old, new = getattr(layout.options, field_name), getattr(opts, field_name)
        if old != new:
            raise ValueError(
                f"restart of {name!r}: {field_name}={new!r} but it was created with {old!r}"
            )
    return layout


def restart_plan(
    kept: Layout,
    workers: list[str],
    supervisor_of: Callable[[str], str],
    satisfies: Callable[[str, Policy | None], bool],
) -> tuple[dict[str, list[int]], dict[int, str]]:
    """Each kept manager's worker among ``workers`` (the connected ones, sorted), and the
    shard path of each that re-attaches its shard: its old host's worker if still
    connected, else its old worker, else a worker on the same machine; a manager whose
    machine has no worker left starts empty on the least loaded worker (one that
    ``satisfies`` its placement policy, if one does)."""
    by_host: dict[str, list[str]] = {}
    for w in workers:
        by_host.setdefault(get_address_host(w), []).append(w)
    by_supervisor = {supervisor_of(w): w for w in workers}
    plan: dict[str, list[int]] = {}
    paths: dict[int, str] = {}
    for m in kept.managers:
        same_host = by_host.get(get_address_host(m.worker), [])
        if m.supervisor in by_supervisor:
            target = by_supervisor[m.supervisor]
        elif m.worker in workers:
            target = m.worker
        elif same_host:
            target = min(same_host, key=lambda w: len(plan.get(w, ())))
        else:  # (a pinned manager: a worker that satisfies its policy, if one does)
            fit = [w for w in workers if satisfies(w, m.policy)] or workers
            target = min(fit, key=lambda w: len(plan.get(w, ())))
        if target in same_host:
            paths[m.manager_id] = m.store_path
        plan.setdefault(target, []).append(m.manager_id)
    return plan, paths


async def remove_abandoned(plugin: Orchestrator, kept: Layout, infos: list[ManagerInfo]) -> None:
    """After a restart, delete the kept shards that no manager (``infos``) re-attached."""
    reattached = {m.store_path for m in infos if m.restarted}
    abandoned = [replace(m, lost=True) for m in kept.managers if m.store_path not in reattached]
    if abandoned:
        await remove_lost(plugin, replace(kept, managers=tuple(abandoned)), kept=True)
