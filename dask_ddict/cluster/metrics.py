"""Prometheus metrics of every dictionary, on the scheduler's ``/metrics``.

Dask serves ``/metrics`` from ``prometheus_client``'s global registry, whose
collectors it calls one after the other, synchronously, in the HTTP handler on the
scheduler's event loop.  :class:`DDictCollector` adds ``dask_ddict_*`` series per
dictionary and manager to that page, named as Dask names its own (snake_case,
``_bytes`` units, ``_total`` counters; Dask's prefix,
``distributed.dashboard.prometheus.namespace``, is theirs too).  Each series is
described in ``docs/guide/operations.md`` ("Prometheus metrics").

Why it is built so:

* **It never asks a manager itself.**  The values come from the dashboard's
  snapshots (:class:`~dask_ddict.cluster.dashboard.DashboardData`): one collection
  at a time, at most once per ``ddict.dashboard.refresh`` for the page, its JSON and
  every scraper together, in threads, each manager with its own deadline.
* **A scrape never waits for the managers.**  Asking them from the handler would
  stall the scheduler's event loop for as long as the slowest manager takes (up to
  ``ddict.dashboard.manager-timeout`` for a hung host), and the collection cannot
  be awaited there.  So a scrape answers at once from the newest snapshot and starts
  the next collection in the background when that one is older than the refresh
  interval: each scrape shows what the managers said around the previous one
  (``dask_ddict_snapshot_age_seconds`` says how long ago), and nothing is asked
  while nobody looks.
* **A manager that does not answer is a series, not a failure.**  It is
  ``dask_ddict_manager_up 0`` (lost with its host, or no answer within the
  deadline) and has no other series, while every other manager's are there.
* **One collector per process in the registry.**  Several schedulers in one
  process (tests) would register the same names twice, which the registry refuses:
  the scheduler started last is the one reported (as Dask's own collectors report
  the last scheduler), and when it closes the one before it is again.
* **Optional.**  ``prometheus_client`` is not a dependency of distributed (the
  ``metrics`` extra installs it); without it Dask's ``/metrics`` says so, and the
  plugin runs as it does without metrics.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import dask.config

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from .dashboard import DashboardData

logger = logging.getLogger(__name__)

#: The labels of every per-manager series.
LABELS = ["ddict", "manager", "worker", "host"]

#: Per-manager gauges read from each row of a summary: (name, help, the row's field).
GAUGES = [
    ("keys", "Stored key versions of the manager's shard (deletion marks included)", "num_keys"),
    ("used_bytes", "Bytes of the manager's shard in pages that hold data", "bytes"),
    ("capacity_bytes", "Size of the manager's shard", "capacity"),
    (
        "pinned_bytes",
        "Bytes of the shard that processes on its host hold as zero-copy values",
        "pinned_bytes",
    ),
    ("pinned_views", "Zero-copy values of the shard held by processes on its host", "pinned_views"),
    (
        "deferred_operations",
        "Operations waiting at the manager (wait_for_keys/writers)",
        "deferred_ops",
    ),
    (
        "replicas",
        "Live replicas of the manager (DDict(replicas=k)); fewer than k while one "
        "is made again after a loss",
        "replicas",
    ),
]


class DDictCollector:
    """``prometheus_client`` collector of one scheduler's dictionaries (module docstring).

    Parameters
    ----------
    data
        The dashboard's snapshots of the scheduler's dictionaries.
    loop
        The scheduler's event loop, where collections start (a scrape may come from
        another thread, e.g. ``prometheus_client.start_http_server``).
    """

    def __init__(self, data: DashboardData, loop: asyncio.AbstractEventLoop) -> None:
        self._data = data
        self._loop = loop

    def __repr__(self) -> str:
        return f"<DDictCollector {self._data!r}>"

    def describe(self) -> list[Metric]:
        """The families without samples: what the registry checks names with, without
        collecting."""
        return list(families([], None))

    def collect(self) -> Iterator[Metric]:
        """Every series from the newest snapshot; starts the next collection if it is old."""
        try:
            self._loop.call_soon_threadsafe(self._data.refresh)
        except RuntimeError:  # the loop is closed: the scheduler is going
            logger.debug("ddict metrics: no event loop to refresh the snapshot on")
        snapshot, age = self._data.latest()
        return families(snapshot, None if math.isinf(age) else age)


def families(snapshot: Iterable[dict[str, Any]], age: float | None) -> Iterator[Metric]:
    """The metric families of dictionary summaries (:func:`~dask_ddict.display.summarize`).

    Pure (tested without a cluster).  ``age`` is the snapshot's, in seconds; ``None``
    before the first snapshot (no sample then).
    """
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    namespace = dask.config.get("distributed.dashboard.prometheus.namespace", "dask")

    def name(n: str) -> str:
        return "_".join(filter(None, [namespace, "ddict", n]))

    up = GaugeMetricFamily(
        name("manager_up"),
        "1 if the manager answered the last ask, 0 if it is lost or did not answer in time",
        labels=LABELS,
    )
    gauges = [(GaugeMetricFamily(name(n), doc, labels=LABELS), field) for n, doc, field in GAUGES]
    newest = GaugeMetricFamily(
        name("newest_checkpoint"),
        "Newest checkpoint id of the manager's working set",
        labels=LABELS,
    )
    persisted = GaugeMetricFamily(
        name("persisted_checkpoint"),
        "Newest checkpoint id that the manager has persisted",
        labels=LABELS,
    )
    restarts = CounterMetricFamily(
        name("host_restarts"), "Restarts of the host process that serves the manager", labels=LABELS
    )
    served = CounterMetricFamily(
        name("operations_served"),
        "Requests the manager's host process served for it, by operation, since it started",
        labels=[*LABELS, "op"],
    )
    moves = CounterMetricFamily(
        name("manager_moves"),
        "Moves of the dictionary's managers "
        "between host processes the orchestrator remembers (a worker "
        "retired, rebalance())",
        labels=["ddict"],
    )
    for d in snapshot:
        moves.add_metric([d["name"]], d.get("moves_total", 0))
        for row in d["managers"]:
            labels = [d["name"], str(row["manager_id"]), row["worker"], row["hostname"]]
            answered = row["num_keys"] is not None
            up.add_metric(labels, 1.0 if answered else 0.0)
            if not answered:
                continue
            for family, field in gauges:
                family.add_metric(labels, row[field])
            newest.add_metric(labels, row["window"][1])
            if row["persisted"]:
                persisted.add_metric(labels, max(row["persisted"]))
            restarts.add_metric(labels, row["host_restarts"] or 0)
            for op, n in sorted((row["ops_served"] or {}).items()):
                served.add_metric([*labels, op], n)
    yield up
    yield from (family for family, _ in gauges)
    yield from (newest, persisted, restarts, served, moves)
    snapshot_age = GaugeMetricFamily(
        name("snapshot_age_seconds"), "Seconds since the managers were asked for the values shown"
    )
    if age is not None:
        snapshot_age.add_metric([], age)
    yield snapshot_age


# -- registration: one collector of this package in the global registry ----------------

_lock = threading.Lock()
_started: list[DDictCollector] = []  # in start order; only the last is registered


def register(data: DashboardData, loop: asyncio.AbstractEventLoop) -> DDictCollector | None:
    """Report ``data``'s dictionaries on ``/metrics``; ``None`` without ``prometheus_client``.

    The collector replaces the one of a scheduler started before in this process (see
    the module docstring); :func:`unregister` puts that one back.
    """
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        logger.debug("ddict: prometheus_client is not installed: no dask_ddict_* metrics")
        return None
    collector = DDictCollector(data, loop)
    with _lock:
        if _started:
            _swap(REGISTRY, _started[-1], None)
        _started.append(collector)
        _swap(REGISTRY, None, collector)
    return collector


def unregister(collector: DDictCollector | None) -> None:
    """Stop reporting ``collector``'s dictionaries (the one started before it reports again)."""
    if collector is None:
        return
    from prometheus_client import REGISTRY

    with _lock:
        if collector not in _started:
            return
        last = _started[-1] is collector
        _started.remove(collector)
        if last:
            _swap(REGISTRY, collector, _started[-1] if _started else None)


def _swap(registry: Any, old: DDictCollector | None, new: DDictCollector | None) -> None:
    """Unregister ``old`` and register ``new`` (either may be ``None``); a name that
    another package registered leaves the metrics out, with a warning, not the plugin."""
    if old is not None:
        try:
            registry.unregister(old)
        except KeyError:  # (it could not be registered)
            pass
    if new is not None:
        try:
            registry.register(new)
        except ValueError as e:
            logger.warning("ddict: no dask_ddict_* metrics: %s", e)
