"""DDictSchedulerPlugin: the orchestrator of every dictionary on a cluster.

It owns the registry (name -> :class:`~dask_ddict.layout.Layout`), creates
managers for the chosen workers through their host supervisors (in the
nanny, or in a worker that has none), answers attach with the layout,
destroys, marks managers lost when their host is gone, and keeps workers
that host shards from being retired by adaptive scaling.  It never sees keys
or values: those go from clients straight to the host processes.

A worker restart (a crash, a memory kill, ``client.restart()``) is not a
loss: its nanny and so the host process live on.  The orchestrator only
notes the worker's new address (locality) in a new layout epoch.

Install it with ``client.register_plugin(DDictSchedulerPlugin())`` or
``dask scheduler --preload dask_ddict``; ``DDict(...)`` registers it when it
is missing.  Registration is idempotent (fixed name ``"ddict"``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import secrets
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from distributed.comm import get_address_host
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps

from .. import config
from ..errors import DDictError, error_to_wire, raise_from_wire
from ..host.hygiene import KNOWS
from ..host.supervisor import off_loop
from ..layout import Layout, ManagerInfo
from ..options import DDictOptions
from ..placement import Policy, WorkerView, as_policy, assign
from . import metrics
from .dashboard import DashboardData, install
from .elastic import Elastic
from .leases import Leases
from .leftovers import ANSWERED, GONE, UNKNOWN, ask, remove_lost
from .lifetime import Holders
from .sizing import hosts_warnings
from .worker_plugin import DDictNannyPlugin, DDictWorkerPlugin

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)


def refusing(handler: Callable[..., Any]) -> Callable[..., Any]:
    """``handler``, whose refusals come back as error replies instead of raises.

    Dask logs every exception that a handler raises at ERROR, with its traceback,
    in the scheduler's log, which is the user's terminal when the cluster runs in
    their process.  A call refused for the user's own mistake (a name that exists
    or does not, ``restart=True`` for an unknown name, a checkpoint that is not
    persisted, a ``total_mem`` the hosts cannot hold) is no bug of the scheduler's:
    it goes back as an error reply (:func:`~dask_ddict.errors.error_to_wire`, which
    the client raises typed through :func:`~dask_ddict.errors.raise_from_wire`) and
    is logged at INFO.  Anything else is a bug and keeps its traceback.
    """

    def refused(e: Exception, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        wire = error_to_wire(e)
        if wire is None or getattr(e, "code", "") == "INTERNAL":
            return None
        name = kwargs.get("name")
        logger.info(
            "ddict: %s of %s refused: %s", handler.__name__, repr(name) if name else "a DDict", e
        )
        logger.debug("ddict: the refusal's traceback", exc_info=True)
        return wire

    async def later(result: Awaitable[Any], kwargs: dict[str, Any]) -> Any:
        try:
            return await result
        except Exception as e:
            wire = refused(e, kwargs)
            if wire is None:
                raise
            return wire

    @functools.wraps(handler)
    def call(**kwargs: Any) -> Any:
        try:
            result = handler(**kwargs)
        except Exception as e:
            wire = refused(e, kwargs)
            if wire is None:
                raise
            return wire
        return later(result, kwargs) if inspect.isawaitable(result) else result

    return call


#: Why a manager's host is gone when its worker was retired (scaled down, ``lifetime``).
RETIRED = "its worker was retired"

#: What a worker's removal says, by the prefix of Dask's ``stimulus_id`` for it.
_LEFT = {
    "retire-workers": RETIRED,
    "worker-close-gracefully": RETIRED,
    "nanny-close": "its nanny closed",
    "handle-worker-cleanup": "its worker's connection to the scheduler broke",
}


def why_left(stimulus_id: str) -> str:
    """Why a worker left, in words, from the ``stimulus_id`` Dask removed it with."""
    for prefix, why in _LEFT.items():
        if stimulus_id.startswith(prefix):
            return why
    return f"its worker was removed ({stimulus_id.rsplit('-', 1)[0] or 'unknown'})"


class DDictSchedulerPlugin(SchedulerPlugin):
    """Scheduler side of ``dask_ddict``: the registry and the control plane."""

    name = "ddict"
    idempotent = True

    scheduler: Scheduler
    dicts: dict[str, Layout]
    kept: dict[str, Layout]  # destroyed with allow_restart=True: shards kept on their hosts

    def __init__(self) -> None:
        self.dicts = {}
        self.kept = {}
        self._warned_hosts: set[str] = set()
        #: worker address -> (its hash() of the probe string, its PYTHONHASHSEED if any)
        self.hash_probes: dict[str, tuple[int, str]] = {}
        self._gone: set[str] = set()  # supervisors (nannies) found gone, or closing
        self._ended: set[str] = set()  # ...whose port refuses connections: the process ended
        #: worker address -> why it left the scheduler (see :func:`why_left`), for a
        #: loss its supervisor reports later; bounded (the newest kept)
        self._left: dict[str, str] = {}
        self._tasks: set[asyncio.Task[Any]] = set()  # releases under way
        #: uid -> layout of the dictionaries being destroyed now (see knows_shards)
        self._destroying: dict[str, Layout] = {}
        self.calls: Counter[str] = Counter()  # handler calls by name, since the start
        self.dashboard = DashboardData(self)
        self._metrics: metrics.DDictCollector | None = None  # on /metrics while started
        self.holders = Holders(
            self._release,
            self._call_later,
            lambda: config.get_seconds("lifetime-grace-period") or 0.0,
        )
        #: The hosts' leases, set from the scheduler's ``ddict.lease.*`` when it starts (this
        #: object is built where the plugin is registered, often a client); ``None``:
        #: ``ddict.lease.duration: null``, none are kept.
        self.leases: Leases | None = Leases(4.0, 0.5)
        self.elastic = Elastic(self)  # managers move when workers leave or join
        self._overdue: asyncio.Task[Any] | None = None

    def __repr__(self) -> str:
        return f"<DDictSchedulerPlugin dicts={sorted(self.dicts)}>"

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        duration = config.get_seconds("lease.duration")
        if duration:
            self.leases = Leases(duration, config.get_seconds("lease.margin") or 0.0)
        else:
            self.leases = None
        self.elastic.failover.leases = self.leases
        handlers: dict[str, Callable[..., Any]] = {
            "ddict_create": refusing(self.create),
            "ddict_attach": refusing(self.attach),
            "ddict_destroy": self.destroy,
            "ddict_list": self.names,
            "ddict_list_kept": self.names_kept,
            KNOWS: self.knows_shards,
            "ddict_hash_probe": self.hash_probe,
            "ddict_host_gone": self.host_gone,
            "ddict_lease": self.elastic.failover.lease,
            **{name: refusing(h) for name, h in self.elastic.handlers().items()},
        }
        scheduler.handlers.update({name: self._counted(name, h) for name, h in handlers.items()})
        install(scheduler, self.dashboard)
        self._metrics = metrics.register(self.dashboard, asyncio.get_running_loop())
        # Bytes, not objects: an inproc transport would share one instance otherwise.
        await scheduler.register_nanny_plugin(
            None, dumps(DDictNannyPlugin()), name="ddict", idempotent=True
        )
        await scheduler.register_worker_plugin(
            None, dumps(DDictWorkerPlugin()), name="ddict", idempotent=True
        )
        if self.leases is not None:
            self._overdue = asyncio.ensure_future(self.elastic.failover.watch())

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
        restart: bool = False,
        lifetime: str = "client",
        storage_options: dict[str, Any] | None = None,
        policies: list[Any] | None = None,
    ) -> dict[str, Any]:
        """Create a dictionary's managers (or re-attach kept shards); return its layout.

        ``policies``: ``[policy as a dict, managers or None]`` groups
        (``placement.policy_groups``): each manager is placed on, and keeps, its policy.

        ``storage_options`` (credentials for the persist store) only pass
        through, to the host processes: they are kept nowhere here.
        """
        if not name:
            name = uuid.uuid4().hex[:10]
        if name in self.dicts:
            raise DDictError(
                f"a DDict named {name!r} already exists: attach with DDict.from_name({name!r}, "
                f"client), or remove it with d.destroy() or `dask ddict destroy {name}`",
                "INVALID_ARGUMENT",
            )
        opts = DDictOptions.from_dict(options)
        pinned: dict[int, Policy] = {}
        if policies:
            chosen, pinned = await self._place_by_policy(
                policies, n_workers, workers, managers_per_worker
            )
        else:
            chosen = self._choose_workers(n_workers, workers)
        if opts.replicas >= len(self.scheduler.workers):
            raise ValueError(
                f"replicas={opts.replicas} needs at least {opts.replicas + 1} "
                f"workers (each replica in another worker's host process); the "
                f"cluster has {len(self.scheduler.workers)}"
            )
        num = len(pinned) if pinned else len(chosen) * managers_per_worker
        prior = self.kept.get(name) if restart else None
        if prior is not None and any(m.policy is not None for m in prior.managers):
            num = prior.num_managers  # (its policies placed them: the count is theirs)
        kept = self._kept_for_restart(name, opts, num) if restart else None
        if kept is not None:
            plan, restart_paths = self._restart_plan(kept)
            pinned = {m.manager_id: m.policy for m in kept.managers if m.policy is not None}
        elif pinned:
            plan = {}
            for mid, w in enumerate(chosen):
                plan.setdefault(w, []).append(mid)
            restart_paths = {}
        else:
            plan = {
                w: list(range(i * managers_per_worker, (i + 1) * managers_per_worker))
                for i, w in enumerate(chosen)
            }
            restart_paths = {}
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

        async def on(worker: str, mids: list[int]) -> list[dict[str, Any]]:
            supervisor = self.supervisor_of(worker)
            reply = await self.scheduler.rpc(supervisor).ddict_create_managers(
                name=name,
                uid=uid,
                secret=secret,
                options=opts.to_dict(),
                capacity=capacity,
                manager_ids=mids,
                num_managers=num,
                restart_paths={m: restart_paths[m] for m in mids if m in restart_paths},
                worker=worker,
                storage_options=storage_options,
            )
            if reply is None:
                raise DDictError(
                    f"worker {worker} has no ddict host supervisor (is its plugin installed?)",
                    "INVALID_OPERATION",
                )
            raise_from_wire(reply)
            return [{**i, "supervisor": supervisor} for i in reply]

        results = await asyncio.gather(*(on(w, m) for w, m in plan.items()), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            # A failed restart leaves the kept shards where they were, for another try.
            await self._destroy_on(
                [self.supervisor_of(w) for w in plan], uid, allow_restart=kept is not None
            )
            raise errors[0]
        fields = set(ManagerInfo.__dataclass_fields__)
        infos = sorted(
            (
                replace(
                    ManagerInfo(**{k: v for k, v in i.items() if k in fields}),
                    policy=pinned.get(i["manager_id"]),
                )
                for r in results
                for i in r  # type: ignore[union-attr]
            ),
            key=lambda m: m.manager_id,
        )
        extra: dict[str, Any] = {}
        warnings = hosts_warnings(self.scheduler, results, self._warned_hosts)  # type: ignore[arg-type]
        if warnings:
            extra["warnings"] = warnings
        if kept is not None:
            del self.kept[name]
            extra["empty_managers"] = [m.manager_id for m in infos if not m.restarted]
            await self._remove_abandoned(kept, infos)
        layout = Layout(
            name=name,
            uid=uid,
            secret=secret,
            tls=tls,
            options=opts,
            managers=tuple(infos),
            total_mem=total_mem,
            scheduler=self.scheduler.address,
            creator=client,
            extra=extra,
            lifetime=lifetime,
            **self._hash_fields(),
        )
        self.dicts[name] = layout
        if lifetime == "client":
            self.holders.created(name, uid, client)
        if opts.replicas and kept is None:  # (a restart's managers: placed again below too)
            await self.elastic.replicas.place(name)
        elif opts.replicas:
            self.spawn(self.elastic.replicas.place(name))
        logger.info(
            "ddict %s: %d managers on %d workers%s",
            name,
            num,
            len(plan),
            " (restarted)" if kept else "",
        )
        return layout.to_dict()

    def attach(self, name: str, client: str = "", settled: bool = False) -> Any:
        """The current layout of a dictionary; ``client`` holds it from now on.

        ``settled``: once no move of it is under way (awaitable then: a client that
        met a moved manager asks so, and then finds it where it went)."""
        if settled:
            return self._settled(name, client)
        try:
            layout = self.dicts[name]
        except KeyError:
            raise DDictError(
                f"no DDict named {name!r} on this cluster", "INVALID_ARGUMENT"
            ) from None
        self.holders.attached(name, client)
        fields = self._hash_fields()  # workers may have come (or gone) since the creation
        if (layout.hash_probes, layout.hash_seed) != tuple(fields.values()):
            layout = self.dicts[name] = replace(layout, **fields)
        return layout.to_dict()

    async def _settled(self, name: str, client: str) -> dict[str, Any]:
        await self.elastic.moves.settled(name, config.get_seconds("move.timeout"))
        return self.attach(name, client)

    async def destroy(self, name: str, uid: str, allow_restart: bool = False) -> bool:
        """Remove a dictionary's managers; ``False`` if it was already gone.

        With ``allow_restart`` the managers stop but their shards stay in
        shared memory, and the layout is kept until ``restart=True`` re-attaches.
        """
        layout = self.dicts.get(name)
        if layout is None or layout.uid != uid:
            return False
        del self.dicts[name]
        self.holders.forget(name)
        # (a supervisor that gave up its host lives on: it removes what is left of the shards)
        live = sorted(
            ({m.supervisor for m in layout.managers} | self.elastic.replicas.supervisors(name))
            - self._gone
        )
        self.elastic.replicas.forget(name)
        self._destroying[uid] = layout  # (its shards are marked kept before it is in kept)
        try:
            await self._destroy_on(live, uid, allow_restart=allow_restart)
            if allow_restart:
                self.kept[name] = layout
            else:
                await remove_lost(self, layout)
        finally:
            self._destroying.pop(uid, None)
        return True

    def names(self) -> list[str]:
        return sorted(self.dicts)

    def hash_probe(self, worker: str, probe: int, seed: str = "") -> None:
        """A worker process's ``hash()`` of the probe string (see ``_hashing.probe_hash``)."""
        self.hash_probes[worker] = (int(probe), str(seed))

    def host_gone(
        self, supervisor: str, why: str, closing: bool = True, ended: bool = False
    ) -> None:
        """A supervisor's word that its host goes away, before it does: its nanny (or
        nanny-less worker) closes (``closing``), or it gave up restarting its host process;
        ``ended``: its host process has ended now (it holds no lease: replicas of its
        primaries take over at once).

        The scheduler alone cannot always tell: a retired worker's nanny still answers
        when the worker leaves, and closes only later.  So the supervisor says it, and
        clients that fail to reach its managers learn from the layout which are lost
        and why (:func:`~dask_ddict.errors.manager_lost`).  ``why`` is the supervisor's
        view ("its nanny closed"); why its worker left, if known here, says more.
        """
        if ended:
            self.elastic.failover.lease_ended(supervisor)
            if supervisor in self._gone:
                return  # (said when it began to close)
        if closing:
            self._gone.add(supervisor)
            why = self.why_leaving(supervisor, why)
        self._lose(supervisor, why, proven=ended)

    def why_leaving(self, supervisor: str, why: str) -> str:
        """Why ``supervisor``'s host goes, as the scheduler knows it (its worker retired,
        left, ...), else ``why`` (the supervisor's own view)."""
        workers = {
            m.worker
            for lay in self.dicts.values()
            for m in lay.managers
            if m.supervisor == supervisor
        }
        for w in sorted(workers):
            ws = self.scheduler.workers.get(w)
            if getattr(getattr(ws, "status", None), "name", "") == "closing_gracefully":
                return RETIRED
            why = self._left.get(w, why)
        return why

    def names_kept(self) -> list[str]:
        """Names of dictionaries destroyed with ``allow_restart=True``."""
        return sorted(self.kept)

    def knows_shards(self, host_id: str, shards: list[list[str]]) -> list[str]:
        """Which of ``shards`` (``[path, uid]`` of kept shards on the machine ``host_id``)
        this orchestrator still keeps: a sweeper there removes the others (see
        :func:`~dask_ddict.host.hygiene.keeper_states`).

        It keeps a shard that a manager of a dictionary it has, keeps for a restart or is
        destroying now lives in (parked, lost, kept), and any shard of such a dictionary's
        uid (a deposed primary's, kept aside until it says to discard it; a failed
        restart's, marked under the new uid).  Anything else no registry here will ever
        serve again.
        """
        layouts = [*self.dicts.values(), *self.kept.values(), *self._destroying.values()]
        uids = {lay.uid for lay in layouts}
        paths = {m.store_path for lay in layouts for m in lay.managers if m.host_id == host_id}
        return [str(path) for path, uid, *_ in shards if path in paths or uid in uids]

    # -- Scheduler hooks ----------------------------------------------------------

    async def close(self) -> None:
        if self._overdue is not None:
            self._overdue.cancel()
        for layout in list(self.dicts.values()):  # (live dictionaries' shards end with
            await remove_lost(self, layout, only_parked=True)  # their hosts; parked ones not)
        metrics.unregister(self._metrics)
        self._metrics = None
        await off_loop(self.dashboard.close)  # (also while the interpreter exits)

    def log_event(self, topic: Any, msg: Any) -> None:
        """Dask's events: a worker that begins to retire has its managers moved then."""
        if (
            isinstance(topic, str)
            and isinstance(msg, dict)
            and msg.get("action") == "worker-status-change"
            and msg.get("status") == "closing_gracefully"
        ):
            self.elastic.worker_retiring(topic)

    def add_client(self, scheduler: Scheduler, client: str) -> None:
        self.holders.client_came_back(client)

    def remove_client(self, scheduler: Scheduler, client: str) -> None:
        self.holders.client_left(client)

    async def remove_worker(
        self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any
    ) -> None:
        """A worker left.  Its managers are lost only if their host went with it; so are
        the replicas its host kept (a host with replicas alone too: else they were never
        made again, and the next loss of their primaries' host lost those managers)."""
        self.hash_probes.pop(worker, None)
        left = self._left[worker] = why_left(stimulus_id)
        while len(self._left) > 1024:
            del self._left[next(iter(self._left))]
        supervisors = {
            m.supervisor
            for lay in self.dicts.values()
            for m in lay.managers
            if m.worker == worker and not m.lost
        }
        supervisors |= self.elastic.replicas.supervisors_for(worker)
        for sup in supervisors:
            said = GONE if sup == worker else await self.probe(sup)
            if said == ANSWERED:
                continue  # a nanny restarts the worker; the host process serves on
            # (a refused connection is no proof that its host process ended: a firewall's
            # REJECT looks the same; only the supervisor's own word is, see host_gone)
            self._lose(
                sup,
                left
                if sup == worker
                else f"{left}, and its nanny {sup} "
                f"{'refuses connections' if said == GONE else 'does not answer'}",
                proven=False,
            )

    def _lose(self, supervisor: str, why: str, proven: bool = True) -> None:
        """Mark the managers of ``supervisor``'s host lost, ``why`` (a new layout epoch);
        their replicas take over (at once if it is ``proven`` gone, else once its lease is
        surely over)."""
        failing = self.elastic.failover.host_lost(supervisor, why, proven)
        for name, layout in list(self.dicts.items()):
            lost = [
                m.manager_id
                for m in layout.managers
                if m.supervisor == supervisor
                and not m.lost
                and m.manager_id not in failing.get(name, ())
            ]
            if lost:
                self.dicts[name] = layout.with_lost(supervisor, why, only=lost)
                logger.warning(
                    "ddict %s: managers %s lost with their host (%s): %s",
                    name,
                    lost,
                    supervisor,
                    why,
                )

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        """A (re)started worker: its nanny's managers are hosted for it now (locality);
        a new one takes managers when ``ddict.move.rebalance-on-join`` says so."""
        ws = scheduler.workers.get(worker)
        nanny = getattr(ws, "nanny", None)
        self.elastic.replicas.joined(nanny or worker, worker)
        self.elastic.worker_joined(worker)
        if not nanny:
            return
        for name, layout in list(self.dicts.items()):
            if any(m.supervisor == nanny and m.worker != worker for m in layout.managers):
                self.dicts[name] = layout.with_worker(nanny, worker)

    async def probe(self, supervisor: str) -> str:
        """Whether a host supervisor still serves: ``ANSWERED``; ``GONE`` (its port refuses
        connections: its process is gone, or it closed, its host process with it); or
        ``UNKNOWN`` (no answer: a partition, a stopped machine; or it is closing: it
        answers ``None``, and its host process may live a little longer).

        Asked with a short timeout: Dask's comms retry a refused connection for
        the whole connect timeout (30 s), far too long to learn that a host is gone.
        A supervisor found gone stays gone (a nanny does not come back).
        """
        if supervisor in self._ended:
            return GONE
        if supervisor in self._gone:  # (it said it closes: its host may not have ended yet)
            return UNKNOWN
        said, info = await ask(
            self.scheduler.rpc(supervisor).ddict_host_info(),
            supervisor,
            config.get_seconds("host.probe-timeout"),
        )
        if said == ANSWERED and not isinstance(info, dict):  # (it closes)
            self._gone.add(supervisor)
            return UNKNOWN
        if said == GONE:
            self._gone.add(supervisor)
            self._ended.add(supervisor)
        return said

    async def _reachable(self, supervisor: str) -> bool:
        """Whether a host supervisor still serves (see :meth:`probe`)."""
        return await self.probe(supervisor) == ANSWERED

    # -- helpers ----------------------------------------------------------------

    def _counted(self, name: str, handler: Callable[..., Any]) -> Callable[..., Any]:
        """``handler``, counting its calls in :attr:`calls` (the scale benchmark shows that
        operations never reach the orchestrator, and attaches at most once per process)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return handler(*args, **kwargs)

        return call

    def _call_later(self, seconds: float, callback: Any) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(seconds, callback)

    def _release(self, name: str, uid: str) -> None:
        """Destroy a dictionary whose holders are gone (from the event loop)."""
        self.spawn(self.destroy(name, uid))

    def spawn(self, work: Awaitable[Any]) -> None:
        """Run ``work`` on the event loop, kept until done."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _hash_fields(self) -> dict[str, Any]:
        """The layout's ``hash_probes`` and ``hash_seed``: what the connected workers reported."""
        reported = [v for w, v in self.hash_probes.items() if w in self.scheduler.workers]
        seeds = {seed for _, seed in reported}
        return {
            "hash_probes": tuple(sorted({probe for probe, _ in reported})),
            "hash_seed": seeds.pop() if len(seeds) == 1 else "",
        }

    @property
    def gone(self) -> set[str]:
        """Supervisors found gone (they do not come back)."""
        return self._gone

    def supervisor_of(self, worker: str) -> str:
        """Where ``worker``'s host supervisor takes control calls: its nanny, or itself."""
        ws = self.scheduler.workers.get(worker)
        return (getattr(ws, "nanny", None) or worker) if ws is not None else worker

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

    async def _place_by_policy(
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
        pool = self._choose_workers(None, workers)
        by_host = any(p is not None and p.host is not None for p, _ in groups)
        host_ids = [""] * len(pool)
        if by_host:  # (a machine's name: asked of its host once, then known)
            host_ids = await asyncio.gather(
                *(self.elastic._host_id(self.supervisor_of(w)) for w in pool)
            )
        views = [
            replace(self._view(w), hostname=h.split(":")[0]) if h else self._view(w)
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

    def _view(self, worker: str) -> WorkerView:
        """What a placement policy looks at in ``worker`` (its machine's name if known)."""
        ws = self.scheduler.workers[worker]
        host_id = self.elastic._host_ids.get(self.supervisor_of(worker), "")
        return WorkerView(worker, ws.name, ws.host, host_id.split(":")[0], dict(ws.resources or {}))

    def _kept_for_restart(self, name: str, opts: DDictOptions, num: int) -> Layout:
        kept = self.kept.get(name)
        if kept is None:
            raise DDictError(
                f"no DDict named {name!r} was destroyed with allow_restart=True on this "
                f"cluster (kept: {sorted(self.kept)})",
                "INVALID_ARGUMENT",
            )
        if kept.num_managers != num:
            raise ValueError(
                f"restart of {name!r} needs {kept.num_managers} managers (it had that many); "
                f"these arguments give {num}"
            )
        for field_name in ("working_set_size", "wait_for_keys", "wait_for_writers", "persist_freq"):
            old, new = getattr(kept.options, field_name), getattr(opts, field_name)
            if old != new:
                raise ValueError(
                    f"restart of {name!r}: {field_name}={new!r} but it was created with {old!r}"
                )
        return kept

    def _restart_plan(self, kept: Layout) -> tuple[dict[str, list[int]], dict[int, str]]:
        """Place each kept manager where its shard is: its old worker if still
        connected, else a worker on the same host; managers whose host has no
        worker left start empty on the least loaded worker."""
        workers = sorted(self.scheduler.workers)
        by_host: dict[str, list[str]] = {}
        for w in workers:
            by_host.setdefault(get_address_host(w), []).append(w)
        plan: dict[str, list[int]] = {}
        paths: dict[int, str] = {}
        by_supervisor = {self.supervisor_of(w): w for w in workers}
        for m in kept.managers:
            same_host = by_host.get(get_address_host(m.worker), [])
            if m.supervisor in by_supervisor:
                target = by_supervisor[m.supervisor]
            elif m.worker in self.scheduler.workers:
                target = m.worker
            elif same_host:
                target = min(same_host, key=lambda w: len(plan.get(w, ())))
            else:  # (a pinned manager: a worker that satisfies its policy, if one does)
                fit = [w for w in workers if self._view(w).satisfies(m.policy)] or workers
                target = min(fit, key=lambda w: len(plan.get(w, ())))
            if target in same_host:
                paths[m.manager_id] = m.store_path
            plan.setdefault(target, []).append(m.manager_id)
        return plan, paths

    async def _remove_abandoned(self, kept: Layout, infos: list[ManagerInfo]) -> None:
        """After a restart, delete kept shards that no manager re-attached."""
        reattached = {m.store_path for m in infos if m.restarted}
        abandoned = [replace(m, lost=True) for m in kept.managers if m.store_path not in reattached]
        if abandoned:
            await remove_lost(self, replace(kept, managers=tuple(abandoned)), kept=True)

    async def _destroy_on(self, supervisors: list[str], uid: str, *, allow_restart: bool) -> None:
        async def on(supervisor: str) -> None:
            if not await self._reachable(supervisor):
                return  # a dead host has nothing left to destroy (and connecting would retry)
            try:
                await self.scheduler.rpc(supervisor).ddict_destroy_managers(
                    uid=uid, allow_restart=allow_restart
                )
            except Exception as e:  # a dead host has nothing left to destroy
                logger.info("ddict: destroy on %s failed: %r", supervisor, e)

        await asyncio.gather(*(on(s) for s in supervisors))
