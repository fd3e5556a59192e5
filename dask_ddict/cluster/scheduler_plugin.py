"""DDictSchedulerPlugin: the orchestrator of every dictionary on a cluster.

It owns the registry (name -> :class:`~dask_ddict.layout.Layout`) and is the thin
set of handlers in front of it: it creates a dictionary's managers through the chosen
workers' host supervisors (in the nanny, or in a worker that has none; the steps:
:mod:`.creation`, and for ``restart=True`` :mod:`.restart_plan`), answers attach with
the layout, destroys, and marks managers lost when their host is gone (which hosts are
gone, and why their workers left: :mod:`.liveness`).  A user's mistake is refused with
an error reply, not a traceback in the scheduler's log (:mod:`.refusals`).  Moves,
evacuations, replicas and failovers are :class:`~.elastic.Elastic`'s.  It never sees
keys or values: those go from clients straight to the host processes.

A worker restart (a crash, a memory kill, ``client.restart()``) is not a
loss: its nanny and so the host process live on.  The orchestrator only
notes the worker's new address (locality) in a new layout epoch.

Install it with ``client.register_plugin(DDictSchedulerPlugin())`` or
``dask scheduler --preload dask_ddict``; ``DDict(...)`` registers it when it
is missing.  Registration is idempotent (fixed name ``"ddict"``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps

from .. import config
from ..errors import DDictError
from ..host.hygiene import KNOWS
from ..host.off_loop import off_loop
from . import metrics
from .creation import CreateRequest, Creation, close_managers
from .dashboard import DashboardData, install
from .elastic import Elastic
from .leases import Leases
from .leftovers import remove_lost
from .lifetime import Holders
from .liveness import ANSWERED, GONE, Liveness
from .refusals import refusing
from .worker_plugin import DDictNannyPlugin, DDictWorkerPlugin

if TYPE_CHECKING:
    from distributed import Scheduler

    from ..layout import Layout

logger = logging.getLogger(__name__)


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
        #: worker address -> (its hash() of the probe string, its PYTHONHASHSEED if any)
        self.hash_probes: dict[str, tuple[int, str]] = {}
        #: Which host supervisors are gone, and why workers left.
        self.liveness = Liveness(
            lambda address: self.scheduler.rpc(address), lambda: self.scheduler.workers, self.dicts
        )
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
        self.creation = Creation(self)
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

    async def create(self, **request: Any) -> dict[str, Any]:
        """Create a dictionary's managers (or re-attach kept shards: ``restart``) and
        register it; return its layout.  ``request``: the fields of
        :class:`~.creation.CreateRequest`; the steps: :mod:`.creation`."""
        req = CreateRequest.from_wire(request)
        opts, client, restart, lifetime = req.options, req.client, req.restart, req.lifetime
        layout = await self.creation.create(req)
        name = layout.name
        self.dicts[name] = layout
        if lifetime == "client":
            self.holders.created(name, layout.uid, client)
        if opts.replicas and not restart:  # (a restart's managers: placed again below too)
            await self.elastic.replicas.place(name)
        elif opts.replicas:
            self.spawn(self.elastic.replicas.place(name))
        logger.info(
            "ddict %s: %d managers on %d workers%s",
            name,
            layout.num_managers,
            len({m.worker for m in layout.managers}),
            " (restarted)" if restart else "",
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
        fields = self.hash_fields()  # workers may have come (or gone) since the creation
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
            - self.liveness.gone
        )
        self.elastic.replicas.forget(name)
        self._destroying[uid] = layout  # (its shards are marked kept before it is in kept)
        try:
            await close_managers(
                self.scheduler.rpc,
                self.liveness.reachable,
                live,
                uid,
                allow_restart=allow_restart,
            )
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
            if supervisor in self.liveness.gone:
                return  # (said when it began to close)
        if closing:
            self.liveness.closing(supervisor)
            why = self.liveness.why_leaving(supervisor, why)
        self._lose(supervisor, why, proven=ended)

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
        left = self.liveness.worker_left(worker, stimulus_id)
        supervisors = {
            m.supervisor
            for lay in self.dicts.values()
            for m in lay.managers
            if m.worker == worker and not m.lost
        }
        supervisors |= self.elastic.replicas.supervisors_for(worker)
        for sup in supervisors:
            said = GONE if sup == worker else await self.liveness.probe(sup)
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

    def hash_fields(self) -> dict[str, Any]:
        """The layout's ``hash_probes`` and ``hash_seed``: what the connected workers reported."""
        reported = [v for w, v in self.hash_probes.items() if w in self.scheduler.workers]
        seeds = {seed for _, seed in reported}
        return {
            "hash_probes": tuple(sorted({probe for probe, _ in reported})),
            "hash_seed": seeds.pop() if len(seeds) == 1 else "",
        }

    def supervisor_of(self, worker: str) -> str:
        """Where ``worker``'s host supervisor takes control calls: its nanny, or itself."""
        ws = self.scheduler.workers.get(worker)
        return (getattr(ws, "nanny", None) or worker) if ws is not None else worker
