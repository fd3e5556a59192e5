"""The dashboard page: ``/ddict`` and ``/ddict.json`` on the scheduler's HTTP server.

:class:`DashboardData` asks every manager of every dictionary for its stats
and persisted checkpoints, from the scheduler (the orchestrator knows each
dictionary's secret), at most once per ``ddict.dashboard.refresh`` and one
collection at a time, whatever the number of open pages.  The asking is one
broadcast per dictionary (a request per host process, answered by each of its
managers; their persisted ids come with their stats), sent from a thread with a
deadline that the requests carry, so a hung host shows up as error rows for its
managers and never blocks the scheduler's event loop.  It uses sockets only:
no shard is ever mapped into the scheduler process.  The scheduler's
Prometheus metrics (:mod:`.metrics`) are read from the same snapshots.

:func:`install` adds the routes to ``scheduler.http_application`` (so they
are in ``/sitemap.json``) and, when bokeh serves the dashboard, a "DDict"
entry to its navigation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from tornado import web

from .. import config
from ..display import render, summarize
from ..layout import Layout
from ..stats import DDictManagerStats
from ..transport.channels import Channels
from ..transport.ops import Stats
from .elastic import Elastic
from .lifetime import Holders

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)

#: The page's path below the dashboard's prefix; the JSON endpoint is this plus ".json".
ROUTE = "ddict"


class Registry(Protocol):
    """What the page reads from the orchestrator (``DDictSchedulerPlugin``)."""

    dicts: dict[str, Layout]
    holders: Holders
    scheduler: Scheduler
    elastic: Elastic


class Observer(Channels):
    """The orchestrator's connections to one dictionary's managers.

    Sockets only (``direct_reads`` off: the scheduler never maps a shard, so a
    destroyed dictionary's memory is freed at once), with the scheduler's own
    TLS settings.
    """

    direct_reads = False

    def __init__(self, layout: Layout, security: Any) -> None:
        super().__init__(layout)
        self._security = security

    def security(self) -> Any:
        return self._security


class DashboardData:
    """What the page shows, collected from the managers (see the module docstring).

    Parameters
    ----------
    plugin
        The orchestrator: its registry, holders and scheduler.
    """

    def __init__(self, plugin: Registry) -> None:
        self._plugin = plugin
        self._observers: dict[str, Observer] = {}  # uid -> connections
        self._snapshot: list[dict[str, Any]] = []
        self._taken = -float("inf")
        self._pending: asyncio.Future[list[dict[str, Any]]] | None = None

    def __repr__(self) -> str:
        return f"<DashboardData dicts={len(self._snapshot)} observed={len(self._observers)}>"

    async def snapshot(self) -> list[dict[str, Any]]:
        """Every dictionary's summary (:func:`dask_ddict.display.summarize`), by name."""
        if not self._stale():
            return self._snapshot
        return await asyncio.shield(self._collecting())

    def refresh(self) -> None:
        """Start a collection if the snapshot is stale and none is under way, without
        waiting for it: for callers that cannot wait (the Prometheus collector).
        Call it on the scheduler's event loop."""
        if self._stale():
            self._collecting()

    def latest(self) -> tuple[list[dict[str, Any]], float]:
        """The newest snapshot as it is and its age in seconds (``inf`` before the first)."""
        return self._snapshot, time.monotonic() - self._taken

    def _stale(self) -> bool:
        return time.monotonic() - self._taken >= (config.get_seconds("dashboard.refresh") or 0)

    def _collecting(self) -> asyncio.Future[list[dict[str, Any]]]:
        """The collection under way, started if there is none."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._collect())
            self._pending.add_done_callback(self._collected)
        return self._pending

    def _collected(self, done: asyncio.Future[list[dict[str, Any]]]) -> None:
        self._pending = None
        if not done.cancelled() and done.exception() is not None:  # (nobody may wait for it)
            logger.warning("ddict dashboard: collecting the stats failed: %r", done.exception())

    async def _collect(self) -> list[dict[str, Any]]:
        plugin = self._plugin
        layouts = dict(plugin.dicts)
        for uid in set(self._observers) - {lay.uid for lay in layouts.values()}:
            await asyncio.to_thread(self._observers.pop(uid).close)
        summaries = await asyncio.gather(*(self._one(lay) for _, lay in sorted(layouts.items())))
        self._snapshot, self._taken = list(summaries), time.monotonic()
        return self._snapshot

    async def _one(self, layout: Layout) -> dict[str, Any]:
        observer = self._observers.get(layout.uid)
        if observer is None or observer.layout.epoch != layout.epoch:
            if observer is not None:
                await asyncio.to_thread(observer.close)
            security = self._plugin.scheduler.security
            observer = self._observers[layout.uid] = Observer(layout, security)
        deadline = config.get_seconds("dashboard.manager-timeout")
        live = [m.manager_id for m in layout.managers if not m.lost]
        try:  # one broadcast: a request per host process, each with the deadline
            answers = await asyncio.wait_for(
                asyncio.to_thread(observer.each_settled, Stats(deadline), live),
                None if deadline is None else 2 * deadline + 1,
            )
        except TimeoutError as e:  # (the broadcast itself hung: every manager unknown)
            answers = [e] * len(live)
        stats: dict[int, DDictManagerStats | BaseException] = {}
        persisted: dict[int, list[int]] = {}
        for mid, answer in zip(live, answers):
            if isinstance(answer, BaseException):
                if isinstance(answer, TimeoutError):
                    answer = TimeoutError(f"no answer within {deadline:g} s")
                stats[mid] = answer
            else:
                stats[mid], persisted[mid] = answer, list(answer.persisted_ids)
        holders = self._plugin.holders
        return summarize(
            layout,
            stats,
            persisted,
            holders=holders.holders(layout.name),
            release_pending=holders.release_pending(layout.name),
            moves=self._plugin.elastic.moves_of(layout.name),
        )

    def close(self) -> None:
        for observer in self._observers.values():
            observer.close()
        self._observers.clear()


class _Handler(web.RequestHandler):
    def initialize(self, data: DashboardData) -> None:
        self.data = data


class PageHandler(_Handler):
    """``/ddict``: the page; ``?fragment=1`` gives just the dictionaries (live updates)."""

    async def get(self) -> None:
        dicts = await self.data.snapshot()
        if self.get_argument("fragment", ""):
            self.write(render("dicts.html.j2", dicts=dicts))
            return
        refresh = max(0.5, config.get_seconds("dashboard.refresh") or 0)
        self.write(
            render(
                "dashboard.html.j2",
                dicts=dicts,
                refresh_ms=int(refresh * 1000),
                updated=time.strftime("%H:%M:%S"),
            )
        )


class JSONHandler(_Handler):
    """``/ddict.json``: the same summaries, for programs."""

    async def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps({"dicts": await self.data.snapshot()}))


def install(scheduler: Scheduler, data: DashboardData) -> bool:
    """Serve the page on the scheduler's HTTP server; ``False`` if it has none."""
    app = getattr(scheduler, "http_application", None)
    if app is None:
        return False
    prefix = _prefix(app)
    app.add_handlers(
        r".*",
        [
            (f"{prefix}{ROUTE}", PageHandler, {"data": data}),
            (f"{prefix}{ROUTE}.json", JSONHandler, {"data": data}),
        ],
    )
    try:  # the bokeh dashboard's "More..." menu (its template variables are shared lists)
        from distributed.dashboard.scheduler import template_variables
    except ImportError:  # no bokeh: the page still works, without a menu entry
        return True
    plots = template_variables(scheduler)["plots"]
    if not any(p["url"] == ROUTE for p in plots):
        plots.append({"url": ROUTE, "name": "DDict"})
    return True


def _prefix(app: web.Application) -> str:
    """The dashboard's URL prefix (``/`` unless the scheduler was given one)."""
    for rule in app.default_router.rules + app.wildcard_router.rules:
        target = getattr(rule, "target", None)
        for inner in getattr(target, "rules", [rule]):
            pattern = getattr(getattr(inner, "matcher", None), "regex", None)
            if pattern is not None and pattern.pattern.endswith("health$"):
                return pattern.pattern[: -len("health$")]
    return "/"
