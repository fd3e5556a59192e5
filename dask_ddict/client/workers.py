"""The scheduler's workers, as a client reads them now.

``Client.scheduler_info()`` fetches the scheduler's identity into a cache and returns
the cache, which the client's periodic refresh overwrites with cluster totals only (no
workers) at any moment, from its own thread: read just after a refresh, its
``"workers"`` is empty, and a lookup of a worker that is there fails.  These ask the
scheduler, and return what it answered.
"""

from __future__ import annotations

from typing import Any

from distributed import Client


def scheduler_workers(client: Client) -> dict[str, Any]:
    """The scheduler's workers (address -> its info), asked now (a synchronous client)."""
    return dict(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


async def scheduler_workers_async(client: Client) -> dict[str, Any]:
    """:func:`scheduler_workers` from the client's event loop."""
    return dict((await client.scheduler.identity(n_workers=-1))["workers"])
