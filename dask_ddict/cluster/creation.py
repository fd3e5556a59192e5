"""Creating a dictionary: placing its managers, asking the workers, assembling its layout.

The orchestrator's ``ddict_create`` (:meth:`Creation.create`) runs these steps:

1. **name**: a name given must be free; none given, one is made up;
2. **plan** (:meth:`Creation.plan`): which worker's host serves which managers: the
   workers asked for (or all), ``managers_per_worker`` each; with placement policies,
   each manager on a worker that satisfies its own (:func:`~dask_ddict.placement.assign`);
   with ``restart=True``, each kept manager where its shard is
   (:mod:`.restart_plan`).  ``replicas=k`` needs ``k + 1`` workers;
3. **open** (:meth:`Creation.open`): every chosen worker's host supervisor is asked at
   once to serve its managers (``ddict_create_managers``), each with ``total_mem``
   shared evenly; if any refuses or fails, the others' managers are closed again (a
   failed restart keeps its shards, for another try) and the first error is raised;
4. **layout** (:meth:`Creation.layout`): the hosts' answers, in manager order, with each
   manager's policy, a new uid and secret, and the warnings of the sizing check
   (:mod:`.sizing`); a restart says which managers came back empty, and deletes the kept
   shards that none re-attached.

The orchestrator then registers the layout (:mod:`.scheduler_plugin`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import DDictError, raise_from_wire
from ..layout import Layout, ManagerInfo
from ..options import DDictOptions
from ..placement import Policy, WorkerView, as_policy, assign
from .elastic import Elastic
from .liveness import Liveness
from .restart_plan import kept_for_restart, remove_abandoned, restart_plan
from .sizing import hosts_warnings

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)

#: The smallest shard a manager may have.
LEAST_SHARD = 1 << 20


@dataclass(frozen=True)
class CreateRequest:
    """A client's ``ddict_create`` call, declared once: the keywords the client sends
    (:func:`dask_ddict.client.creation.create_request`, plus its Dask client id) are
    these fields; the orchestrator's handler takes them as they come
    (:meth:`from_wire`) and hands this on.

    ``storage_options`` (credentials for the persist store) only pass through, to the
    host processes: they are kept nowhere here.  ``policies``: ``[policy as a dict,
    managers or None]`` groups (``placement.policy_groups``).
    """

    name: str
    options: DDictOptions
    total_mem: int
    managers_per_worker: int
    n_workers: int | None = None
    workers: list[str] | None = None
    client: str = ""
    restart: bool = False
    lifetime: str = "client"
    storage_options: dict[str, Any] | None = None
    policies: list[Any] | None = None

    @classmethod
    def from_wire(cls, msg: dict[str, Any]) -> CreateRequest:
        """The request from the handler's keywords (``options`` as a dict)."""
        return cls(**{**msg, "options": DDictOptions.from_dict(msg["options"])})


class Orchestrator(Protocol):
    """What a creation needs of the orchestrator (``DDictSchedulerPlugin``)."""

    scheduler: Scheduler
    dicts: dict[str, Layout]
    kept: dict[str, Layout]
    elastic: Elastic
    liveness: Liveness

    def supervisor_of(self, worker: str) -> str: ...
    def hash_fields(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Plan:
    """Where a new dictionary's managers go: each worker's manager ids, the placement
    policy each pinned manager keeps, and for a restart the kept layout and the shard
    each manager re-attaches."""

    workers: dict[str, list[int]]
    num_managers: int
    policies: dict[int, Policy] = field(default_factory=dict)
    kept: Layout | None = None
    restart_paths: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class NewDict:
    """What every chosen host is asked to serve of a new dictionary."""

    name: str
    uid: str
    secret: str
    options: DDictOptions
    capacity: int  # each manager's shard, in bytes
    num_managers: int
    storage_options: dict[str, Any] | None = None  # (passed through, kept nowhere here)

    def __repr__(self) -> str:  # never print the secret or the storage options
        return f"NewDict(name={self.name!r}, uid={self.uid!r}, managers={self.num_managers})"


class Creation:
    """The creations of one orchestrator (see the module's docstring)."""

    def __init__(self, plugin: Orchestrator) -> None:
        self.plugin = plugin
        self._warned_hosts: set[str] = set()  # (the sizing check warns once per host)

    def __repr__(self) -> str:
        return f"<Creation warned={len(self._warned_hosts)}>"

    async def create(self, req: CreateRequest) -> Layout:
        """A new dictionary's layout, once its managers serve (``restart``: over the kept
        shards of ``name``)."""
        name = self.free_name(req.name)
        plan = await self.plan(name, req)
        new = NewDict(
            name,
            uuid.uuid4().hex,
            secrets.token_hex(32),
            req.options,
            _capacity(req.total_mem, plan.num_managers),
            plan.num_managers,
            req.storage_options,
        )
        replies = await self.open(new, plan)
        return await self.layout(new, plan, replies, req.total_mem, req.client, req.lifetime)

    # -- 1. name --------------------------------------------------------------------

    def free_name(self, name: str) -> str:
        """``name``, refused if a dictionary has it; none given: a new one."""
        name = name or uuid.uuid4().hex[:10]
        if name in self.plugin.dicts:
            raise DDictError(
                f"a DDict named {name!r} already exists: attach with DDict.from_name({name!r}, "
                f"client), or remove it with d.destroy() or `dask ddict destroy {name}`",
                "INVALID_ARGUMENT",
            )
        return name

    # -- 2. plan --------------------------------------------------------------------

    async def plan(self, name: str, req: CreateRequest) -> Plan:
        """Which worker serves which of the new dictionary's managers (named ``name``);
        with placement policies, each manager is placed on, and keeps, its policy."""
        opts, managers_per_worker = req.options, req.managers_per_worker
        connected = self.plugin.scheduler.workers
        pinned: dict[int, Policy] = {}
        if req.policies:
            chosen, pinned = await self.place_by_policy(
                req.policies, req.n_workers, req.workers, managers_per_worker
            )
        else:
            chosen = self.choose_workers(req.n_workers, req.workers)
        if opts.replicas >= len(connected):
            raise ValueError(
                f"replicas={opts.replicas} needs at least {opts.replicas + 1} "
                f"workers (each replica in another worker's host process); the "
                f"cluster has {len(connected)}"
            )
        num = len(pinned) if pinned else len(chosen) * managers_per_worker
        if req.restart:
            return self._restart(name, opts, num)
        if pinned:
            placed: dict[str, list[int]] = {}
            for mid, w in enumerate(chosen):
                placed.setdefault(w, []).append(mid)
            return Plan(placed, num, pinned)
        return Plan(
            {
                w: list(range(i * managers_per_worker, (i + 1) * managers_per_worker))
                for i, w in enumerate(chosen)
            },
            num,
        )

    def _restart(self, name: str, opts: DDictOptions, num: int) -> Plan:
        """The plan of a restart: each kept manager where its shard is."""
        kept = self.plugin.kept
        prior = kept.get(name)
        if prior is not None and any(m.policy is not None for m in prior.managers):
            num = prior.num_managers  # (its policies placed them: the count is theirs)
        layout = kept_for_restart(kept, name, opts, num)
        placed, paths = restart_plan(
            layout,
            sorted(self.plugin.scheduler.workers),
            self.plugin.supervisor_of,
            lambda w, policy: self.view(w).satisfies(policy),
        )
        pinned = {m.manager_id: m.policy for m in layout.managers if m.policy is not None}
        return Plan(placed, num, pinned, layout, paths)

    def choose_workers(self, n_workers: int | None, workers: list[str] | None) -> list[str]:
        """The workers asked for (all, by default), the first ``n_workers`` of them."""
        connected = self.plugin.scheduler.workers
        if workers:
            missing = [w for w in workers if w not in connected]
            if missing:
                raise ValueError(f"workers {missing} are not connected to the scheduler")
            chosen = list(dict.fromkeys(workers))
        else:
            chosen = sorted(connected)
        if not chosen:
            raise DDictError("no workers are connected to host managers", "INVALID_ARGUMENT")
        if n_workers is not None:
            if n_workers > len(chosen):
                raise ValueError(
                    f"n_workers={n_workers} but only {len(chosen)} workers are available"
                )
            chosen = chosen[:n_workers]
        return chosen

    async def place_by_policy(
        self,
        policies: list[Any],
        n_workers: int | None,
        workers: list[str] | None,
        managers_per_worker: int,
    ) -> tuple[list[str], dict[int, Policy]]:
        """Each manager's worker (manager id order) and policy, by ``policies`` among
        ``workers`` (default: all; a single policy: the first ``n_workers`` that satisfy
        it); a policy that no worker satisfies is refused, naming it."""
        groups = [(as_policy(p), None if c is None else int(c)) for p, c in policies]
        pool = self.choose_workers(None, workers)
        by_host = any(p is not None and p.host is not None for p, _ in groups)
        host_ids = [""] * len(pool)
        if by_host:  # (a machine's name: asked of its host once, then known)
            host_ids = await asyncio.gather(
                *(self.plugin.elastic._host_id(self.plugin.supervisor_of(w)) for w in pool)
            )
        views = [
            replace(self.view(w), hostname=h.split(":")[0]) if h else self.view(w)
            for w, h in zip(pool, host_ids)
        ]
        if n_workers is not None and len(groups) == 1 and groups[0][1] is None:
            fit = [v for v in views if v.satisfies(groups[0][0])]
            if 0 < len(fit) < n_workers:
                raise ValueError(
                    f"n_workers={n_workers} but only {len(fit)} workers satisfy {groups[0][0]!r}"
                )
            views = fit[:n_workers]
        try:
            placed = assign(groups, views, managers_per_worker)  # type: ignore[arg-type]
        except ValueError as e:
            raise DDictError(
                f"{e}: a manager's placement policy must be satisfied by a "
                "connected worker (resources: `dask worker --resources "
                "'GPU=1'`)",
                "INVALID_ARGUMENT",
            ) from None
        return [w for w, _ in placed], {mid: p for mid, (_, p) in enumerate(placed)}

    def view(self, worker: str) -> WorkerView:
        """What a placement policy looks at in ``worker`` (its machine's name if known)."""
        ws = self.plugin.scheduler.workers[worker]
        host_id = self.plugin.elastic._host_ids.get(self.plugin.supervisor_of(worker), "")
        return WorkerView(worker, ws.name, ws.host, host_id.split(":")[0], dict(ws.resources or {}))

    # -- 3. open --------------------------------------------------------------------

    async def open(self, new: NewDict, plan: Plan) -> list[list[dict[str, Any]]]:
        """Ask every planned worker's host supervisor to serve its managers of ``new``, at
        once: their answers (each manager's layout fields, with its ``supervisor``).
        If any fails, the managers the others opened are closed again (a restart's are
        kept, for another try), and the first error is raised."""
        plugin = self.plugin

        async def on(worker: str, mids: list[int]) -> list[dict[str, Any]]:
            supervisor = plugin.supervisor_of(worker)
            reply = await plugin.scheduler.rpc(supervisor).ddict_create_managers(
                name=new.name,
                uid=new.uid,
                secret=new.secret,
                options=new.options.to_dict(),
                capacity=new.capacity,
                manager_ids=mids,
                num_managers=new.num_managers,
                restart_paths={m: plan.restart_paths[m] for m in mids if m in plan.restart_paths},
                worker=worker,
                storage_options=new.storage_options,
            )
            if reply is None:
                raise DDictError(
                    f"worker {worker} has no ddict host supervisor (is its plugin installed?)",
                    "INVALID_OPERATION",
                )
            raise_from_wire(reply)
            return [{**i, "supervisor": supervisor} for i in reply]

        results = await asyncio.gather(
            *(on(w, m) for w, m in plan.workers.items()), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await close_managers(
                plugin.scheduler.rpc,
                plugin.liveness.reachable,
                [plugin.supervisor_of(w) for w in plan.workers],
                new.uid,
                allow_restart=plan.kept is not None,
            )
            raise errors[0]
        return results  # type: ignore[return-value]

    # -- 4. layout ------------------------------------------------------------------

    async def layout(
        self,
        new: NewDict,
        plan: Plan,
        replies: list[list[dict[str, Any]]],
        total_mem: int,
        client: str,
        lifetime: str,
    ) -> Layout:
        """The new dictionary's layout from its hosts' ``replies``; a restart's kept layout
        is used up (its shards that no manager re-attached are deleted)."""
        plugin = self.plugin
        fields = set(ManagerInfo.__dataclass_fields__)
        infos = sorted(
            (
                replace(
                    ManagerInfo(**{k: v for k, v in i.items() if k in fields}),
                    policy=plan.policies.get(i["manager_id"]),
                )
                for r in replies
                for i in r
            ),
            key=lambda m: m.manager_id,
        )
        extra: dict[str, Any] = {}
        warnings = hosts_warnings(plugin.scheduler, replies, self._warned_hosts)
        if warnings:
            extra["warnings"] = warnings
        if plan.kept is not None:
            del plugin.kept[new.name]
            extra["empty_managers"] = [m.manager_id for m in infos if not m.restarted]
            await remove_abandoned(plugin, plan.kept, infos)
        scheduler = plugin.scheduler
        return Layout(
            name=new.name,
            uid=new.uid,
            secret=new.secret,
            tls=bool(scheduler.security.require_encryption)
            or scheduler.address.startswith("tls://"),
            options=new.options,
            managers=tuple(infos),
            total_mem=total_mem,
            scheduler=scheduler.address,
            creator=client,
            extra=extra,
            lifetime=lifetime,
            **plugin.hash_fields(),
        )


def _capacity(total_mem: int, num: int) -> int:
    """Each of ``num`` managers' shard size, ``total_mem`` shared evenly: at least 1 MiB."""
    capacity = total_mem // num
    if capacity < LEAST_SHARD:
        raise ValueError(
            f"total_mem={total_mem} over {num} managers leaves {capacity} bytes each; "
            "give each manager at least 1 MiB"
        )
    return capacity


async def close_managers(
    rpc: Callable[[str], Any],
    reachable: Callable[[str], Any],
    supervisors: list[str],
    uid: str,
    *,
    allow_restart: bool,
) -> None:
    """Ask each of ``supervisors`` that still serves to close dictionary ``uid``'s managers
    (``allow_restart``: keeping their shards); a dead host has nothing left to close."""

    async def on(supervisor: str) -> None:
        if not await reachable(supervisor):
            return  # (and connecting would retry)
        try:
            await rpc(supervisor).ddict_destroy_managers(uid=uid, allow_restart=allow_restart)
        except Exception as e:  # a dead host has nothing left to destroy
            logger.info("ddict: destroy on %s failed: %r", supervisor, e)

    await asyncio.gather(*(on(s) for s in supervisors))
