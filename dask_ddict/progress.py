"""Progress bars for long operations.

Operations that visit every manager (persist, sync, restore, clone) draw a
``tqdm.auto`` bar over the managers: a terminal bar, a widget in Jupyter.
Operations that run Dask tasks (``dask_dap.to_zarr``, ``to_ddict``) show
Dask's own progress for their futures, or ``dask.diagnostics.ProgressBar``
without a distributed client (:func:`compute`).  Bars are
shown when ``ddict.progress`` says so: ``auto`` (the default) shows them only
when someone watches (stderr is a terminal, or the code runs in a Jupyter
kernel), so logs and batch jobs stay clean; ``true``/``false`` force it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from . import config

T = TypeVar("T")


def enabled() -> bool:
    """Whether progress bars are shown in this process now."""
    setting = config.get("progress")
    if setting == "auto":
        return "ipykernel" in sys.modules or bool(getattr(sys.stderr, "isatty", bool)())
    return bool(setting)


def compute(collection: Any, client: Any = None) -> Any:
    """``collection.compute()`` (on ``client``, else the current Dask scheduler), with
    Dask's progress bar when progress is on."""
    if client is None:
        from distributed import default_client

        try:
            client = default_client()
        except ValueError:  # no distributed client: the local scheduler
            client = None
    if client is None:
        if not enabled():
            return collection.compute()
        from dask.diagnostics import ProgressBar

        with ProgressBar():
            return collection.compute()
    futures = client.compute(collection)
    if enabled():
        from distributed import progress

        progress(futures)  # a bar in a terminal (returns when done), a widget in Jupyter
    return client.gather(futures)


def track(
    items: Iterable[T], desc: str, total: int | None = None, unit: str = "manager"
) -> Iterable[T]:
    """``items``, with a bar named ``desc`` when progress is on."""
    if not enabled():
        return items
    from tqdm.auto import tqdm

    bar: Any = tqdm(items, desc=desc, total=total, unit=unit, leave=False)
    return bar
