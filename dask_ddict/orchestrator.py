"""DDictSchedulerPlugin: the orchestrator of every dictionary on a cluster.

It owns the registry (name -> :class:`~dask_ddict.layout.Layout`), creates
managers on the chosen workers through the worker plugin, answers attach with
the layout, destroys, marks managers lost when their worker leaves, and keeps
workers that host shards from being retired by adaptive scaling.  It never
sees keys or values: those go from clients straight to managers.

Install it with ``client.register_plugin(DDictSchedulerPlugin())`` or
``dask scheduler --preload dask_ddict``; ``DDict(...)`` registers it when it
is missing.  Registration is idempotent (fixed name ``"ddict"``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from distributed.comm import get_address_host
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps

from .errors import DDictError
from .layout import Layout, ManagerInfo
from .options import DDictOptions
from .worker_plugin import DDictWorkerPlugin

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import WorkerState

logger = logging.getLogger(__name__)


class DDictSchedulerPlugin(SchedulerPlugin):
    """Scheduler side of ``dask_ddict``: the registry and the control plane."""

    name = "ddict"
    idempotent = True

    scheduler: Scheduler
    dicts: dict[str, Layout]

    def __init__(self) -> None:
        self.dicts = {}

    def __repr__(self) -> str:
        return f"<DDictSchedulerPlugin dicts={sorted(self.dicts)}>"

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update(
            {
                "ddict_create": self.create,
                "ddict_attach": self.attach,
                "ddict_destroy": self.destroy,
                "ddict_list": self.list,
            }
        )
        await scheduler.register_worker_plugin(
            None, dumps(DDictWorkerPlugin()), name="ddict", idempotent=True
        )

    # -- Handlers (called by clients through Dask comms) ----------------------------

    async def create(
        self,
        name: str,
        options: dict[str, Any],
        total_mem: int,
        managers_per_worker: int,
        n_workers: int | None = None,
        workers: list[str] | None = None,
        client: str = "",
    ) -> dict[str, Any]:
        """Create a dictionary's managers; return its layout."""
        if not name:
            name = uuid.uuid4().hex[:10]
        if name in self.dicts:
            raise DDictError(f"a DDict named {name!r} already exists", "INVALID_ARGUMENT")
        chosen = self._choose_workers(n_workers, workers)
        num = len(chosen) * managers_per_worker
        capacity = total_mem // num
        if capacity < 1 << 20:
            raise ValueError(
                f"total_mem={total_mem} over {num} managers leaves {capacity} bytes each; "
                "give each manager at least 1 MiB"
            )
        uid = uuid.uuid4().hex
        secret = secrets.token_hex(32)
        tls = bool(self.scheduler.security.require_encryption) or self.scheduler.address.startswith(
            "tls://"
        )
        opts = DDictOptions.from_dict(options)
        plan = {
            w: list(range(i * managers_per_worker, (i + 1) * managers_per_worker))
            for i, w in enumerate(chosen)
        }

        async def on(worker: str, mids: list[int]) -> list[dict[str, Any]]:
            return await self.scheduler.rpc(worker).ddict_create_managers(
                name=name, uid=uid, secret=secret, tls=tls, options=opts.to_dict(),
                capacity=capacity, manager_ids=mids,
            )  # fmt: skip

        results = await asyncio.gather(*(on(w, m) for w, m in plan.items()), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self._destroy_on(list(plan), uid, allow_restart=False)
            raise errors[0]
        infos = sorted(
            (ManagerInfo(**i) for r in results for i in r),  # type: ignore[union-attr]
            key=lambda m: m.manager_id,
        )
        layout = Layout(
            name=name, uid=uid, secret=secret, tls=tls, options=opts, managers=tuple(infos),
            total_mem=total_mem, scheduler=self.scheduler.address, creator=client,
        )  # fmt: skip
        self.dicts[name] = layout
        logger.info("ddict %s: %d managers on %d workers", name, num, len(chosen))
        return layout.to_dict()

    def attach(self, name: str) -> dict[str, Any]:
        """The current layout of a dictionary."""
        try:
            return self.dicts[name].to_dict()
        except KeyError:
            raise DDictError(f"no DDict named {name!r} on this cluster", "INVALID_ARGUMENT")

    async def destroy(self, name: str, uid: str, allow_restart: bool = False) -> bool:
        """Remove a dictionary's managers; ``False`` if it was already gone."""
        layout = self.dicts.get(name)
        if layout is None or layout.uid != uid:
            return False
        del self.dicts[name]
        live = sorted({m.worker for m in layout.managers if not m.lost})
        await self._destroy_on(live, uid, allow_restart=allow_restart)
        if not allow_restart:
            await self._remove_lost(layout)
        return True

    def list(self) -> list[str]:
        return sorted(self.dicts)

    # -- Scheduler hooks ----------------------------------------------------------

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str,
                      **kwargs: Any) -> None:  # fmt: skip
        for name, layout in list(self.dicts.items()):
            if any(m.worker == worker for m in layout.managers):
                self.dicts[name] = layout.with_lost(worker)
                lost = [m.manager_id for m in layout.managers if m.worker == worker]
                logger.warning("ddict %s: managers %s lost with worker %s", name, lost, worker)

    def restart(self, scheduler: Scheduler) -> None:
        # Every worker process is replaced: their managers are gone.
        for name, layout in list(self.dicts.items()):
            managers = tuple(replace(m, lost=True) for m in layout.managers)
            self.dicts[name] = replace(layout, managers=managers, epoch=layout.epoch + 1)

    def valid_workers_downscaling(
        self, scheduler: Scheduler, workers: list[WorkerState]
    ) -> list[WorkerState]:
        hosting = {m.worker for lay in self.dicts.values() for m in lay.managers if not m.lost}
        return [ws for ws in workers if ws.address not in hosting]

    # -- helpers ----------------------------------------------------------------

    def _choose_workers(self, n_workers: int | None, workers: list[str] | None) -> list[str]:
        known = sorted(self.scheduler.workers)
        if workers:
            missing = [w for w in workers if w not in self.scheduler.workers]
            if missing:
                raise ValueError(f"workers {missing} are not connected to the scheduler")
            chosen = list(dict.fromkeys(workers))
        else:
            chosen = known
        if not chosen:
            raise DDictError("no workers are connected to host managers", "INVALID_ARGUMENT")
        if n_workers is not None:
            if n_workers > len(chosen):
                raise ValueError(
                    f"n_workers={n_workers} but only {len(chosen)} workers are available"
                )
            chosen = chosen[:n_workers]
        return chosen

    async def _remove_lost(self, layout: Layout) -> None:
        """Have a live worker on each lost manager's host delete what it left."""
        for m in layout.managers:
            if not m.lost:
                continue
            host = get_address_host(m.worker)
            helpers = [a for a, ws in self.scheduler.workers.items() if ws.host == host]
            paths = [m.store_path, os.path.dirname(m.uds_path)]
            for helper in helpers[:1]:
                try:
                    await self.scheduler.rpc(helper).ddict_remove_paths(paths=paths)
                except Exception as e:
                    logger.info("ddict: cleanup of manager %d failed: %r", m.manager_id, e)

    async def _destroy_on(self, workers: list[str], uid: str, *, allow_restart: bool) -> None:
        async def on(worker: str) -> None:
            try:
                await self.scheduler.rpc(worker).ddict_destroy_managers(
                    uid=uid, allow_restart=allow_restart
                )
            except Exception as e:  # a dead worker has nothing left to destroy
                logger.info("ddict: destroy on %s failed: %r", worker, e)

        await asyncio.gather(*(on(w) for w in workers))
