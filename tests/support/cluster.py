"""A local Dask cluster for a test, its options written once.

Most tests that need a cluster of their own (rather than the session's, see
``tests/conftest.py``) want worker processes with one thread each and a dashboard on
a free port (two tests at once must not fight over 8787).  :func:`local_cluster` says
so once; a test passes only what is particular to it (how many workers, security,
memory limits, ``processes=False``, ``asynchronous=True``).
"""

from __future__ import annotations

from typing import Any

from distributed import LocalCluster


def local_cluster(n_workers: int = 2, **options: Any) -> LocalCluster:
    """A started :class:`~distributed.LocalCluster` of ``n_workers`` worker processes, one
    thread each and a dashboard on a free port unless ``options`` say otherwise.  Use it
    as a context manager (``with local_cluster(2) as cl``; ``async with`` for
    ``asynchronous=True``), or close it."""
    return LocalCluster(
        n_workers=n_workers, **{"threads_per_worker": 1, "dashboard_address": ":0", **options}
    )
