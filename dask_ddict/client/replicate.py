"""Replication: ``clone``, ``copy`` and ``synchronize_ddicts``.

Only requests go from the client: each target manager pulls its counterpart's
whole shard (every checkpoint of the working set) straight from the source
manager (:mod:`dask_ddict.host.replication`), so no data passes through this
process or the scheduler.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from distributed import Client

from ..errors import DDictError, DDictSyncError
from ..layout import Layout
from ..progress import track
from ..transport.ops import CopyFrom
from .core import _Core


def clone(source: Layout, serialized_source: str, clone_list: list[str],
          client: Client | None) -> None:  # fmt: skip
    """Make every dictionary in ``clone_list`` (serialized) a copy of ``source``."""
    if isinstance(clone_list, str) or not isinstance(clone_list, (list, tuple)):
        raise TypeError("clone needs a list of serialized DDicts (DDict.serialize())")
    for s in clone_list:
        target = Layout.deserialize(s)
        _check_parallel(source, target)
        _pull_into(target, serialized_source, range(source.num_managers), client)


def copy_arguments(lay: Layout) -> dict[str, Any]:
    """The constructor arguments of a dictionary like ``lay`` (same workers, options)."""
    workers = list(dict.fromkeys(lay.manager_workers))
    per_worker = {w: lay.manager_workers.count(w) for w in workers}
    if len(set(per_worker.values())) != 1:
        raise DDictError(
            "copy() needs the same number of managers on every worker "
            f"(this dictionary has {per_worker})",
            "INVALID_OPERATION",
        )
    options = dataclasses.replace(lay.options, read_only=False, restore_from=None)
    return dict(managers_per_worker=next(iter(per_worker.values())), total_mem=lay.total_mem,
                workers=workers, **options.to_dict())  # fmt: skip


def synchronize(serialized_ddicts: list[str]) -> None:
    """Rebuild the empty managers of parallel dictionaries from the others."""
    if isinstance(serialized_ddicts, str) or not isinstance(serialized_ddicts, (list, tuple)):
        raise TypeError("synchronize_ddicts needs a list of serialized DDicts")
    layouts = [Layout.deserialize(s) for s in serialized_ddicts]
    if not layouts:
        return
    for lay in layouts[1:]:
        _check_parallel(layouts[0], lay)
    for mid in range(layouts[0].num_managers):
        empty = [i for i, lay in enumerate(layouts) if mid in lay.extra.get("empty_managers", ())]
        if not empty:
            continue
        full = [i for i in range(len(layouts)) if i not in empty]
        if not full:
            raise DDictSyncError(
                f"manager {mid} is empty in every dictionary: nothing to synchronize from"
            )
        for i in empty:
            _pull_into(layouts[i], serialized_ddicts[full[0]], [mid])


def _pull_into(target: Layout, source: str, managers: Any, client: Client | None = None) -> None:
    """Have ``target``'s managers pull their counterparts' shards from ``source``.

    Only the request goes from here; the data flows manager to manager.
    """
    core = _Core(target, client)
    managers = list(managers)
    try:
        for mid in track(managers, f"copy into {target.name}", len(managers)):
            core.channel(mid).call(CopyFrom(source, mid))
    finally:
        core.close()


def _check_parallel(a: Layout, b: Layout) -> None:
    """Two dictionaries whose managers correspond one to one."""
    if a.num_managers != b.num_managers:
        raise DDictError(
            f"{b.name!r} has {b.num_managers} managers and {a.name!r} has {a.num_managers}: "
            "replication copies manager i to manager i, so the counts must match",
            "INVALID_ARGUMENT",
        )
    if a.options.working_set_size != b.options.working_set_size:
        raise DDictError(
            f"{b.name!r} has working_set_size={b.options.working_set_size} and {a.name!r} "
            f"has {a.options.working_set_size}",
            "INVALID_ARGUMENT",
        )
