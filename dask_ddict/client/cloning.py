"""Cloning: ``clone``, ``copy`` and ``synchronize_ddicts`` make a dictionary a copy of another.

Only requests go from the client: each target manager pulls its counterpart's
whole shard (every checkpoint of the working set) straight from the source
manager (:mod:`dask_ddict.host.cloning`), so no data passes through this
process or the scheduler.  Not to be confused with replicas, the copies of a
shard that other hosts keep up to date on every write
(:mod:`dask_ddict.host.replicas`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from distributed import Client

from ..arguments import check_keys
from ..errors import DDictError, DDictSyncError
from ..layout import Layout
from ..progress import track
from ..transport.whole_checkpoints import CopyFrom
from .base import HandleBase
from .core import HandleCore


def clone(
    source: Layout, serialized_source: str, clone_list: list[str], client: Client | None
) -> None:
    """Make every dictionary in ``clone_list`` (serialized) a copy of ``source``."""
    if isinstance(clone_list, str) or not isinstance(clone_list, (list, tuple)):
        raise TypeError("clone needs a list of serialized DDicts (DDict.serialize())")
    for s in clone_list:
        target = Layout.deserialize(s)
        _check_parallel(source, target)
        _pull_into(target, serialized_source, range(source.num_managers), client)


def copy_arguments(lay: Layout) -> dict[str, Any]:
    """The constructor arguments of a dictionary like ``lay`` (same workers, options, lifetime)."""
    workers = list(dict.fromkeys(lay.manager_workers))
    per_worker = {w: lay.manager_workers.count(w) for w in workers}
    if len(set(per_worker.values())) != 1:
        raise DDictError(
            "copy() needs the same number of managers on every worker "
            f"(this dictionary has {per_worker})",
            "INVALID_OPERATION",
        )
    options = dataclasses.replace(lay.options, read_only=False, restore_from=None).to_dict()
    options["persister_class"] = options.pop("persister")  # (its name: the argument takes it)
    return dict(
        managers_per_worker=next(iter(per_worker.values())),
        total_mem=lay.total_mem,
        workers=workers,
        lifetime=lay.lifetime,
        **options,
    )


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
    core = HandleCore(target, client)
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


#: What ``clone`` and ``synchronize_ddicts`` take many of.
_HANDLES = "serialized handles (DDict.serialize())"


class Cloning(HandleBase):
    """``clone``, ``copy`` and ``synchronize_ddicts`` (a base of :class:`~dask_ddict.DDict`)."""

    def clone(self, clone_list: list[str]) -> None:
        """Make every dictionary in ``clone_list`` (serialized) an exact copy of this one.

        Each target manager pulls its counterpart's whole shard (all
        checkpoints of the working set) directly from this dictionary's
        manager: no data goes through this process or the scheduler.  The
        targets need the same number of managers and working-set size.
        """
        self._check()
        check_keys("clone_list", clone_list, _HANDLES, "handle")
        clone(self._core.layout, self.serialize(), clone_list, self._core._client)

    def copy(self, name: str = "") -> Any:
        """A new dictionary (creator: the caller) with this one's options and content.

        It has the same managers on the same workers, and every checkpoint
        of the working set is copied manager to manager.
        """
        self._check()
        if not self._creator:
            raise DDictError("copy() is for the creator's handle", "INVALID_ARGUMENT")  # (Dragon's)
        create: Callable[..., Any] = type(self)  # (the handle's class: DDict's arguments)
        new = create(
            name=name,
            timeout=self._timeout,
            client=self._core.client,
            storage_options=self._core.storage_options,
            **copy_arguments(self._core.layout),
        )
        try:
            self.clone([new.serialize()])
        except BaseException:
            new.destroy()
            raise
        new._chkpt = self._chkpt
        return new

    @classmethod
    def synchronize_ddicts(cls, serialized_ddicts: list[str]) -> None:
        """Rebuild the empty managers of parallel dictionaries from the others.

        After a restart, a manager whose shard was lost comes back empty
        (``empty_managers``).  For each manager id, every dictionary whose
        manager is empty pulls that manager from a dictionary where it is not.

        Raises
        ------
        DDictSyncError
            If a manager id is empty in every dictionary.
        """
        synchronize(check_keys("serialized_ddicts", serialized_ddicts, _HANDLES, "handle"))
