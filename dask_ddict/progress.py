"""Progress bars for operations that visit every manager (persist, sync, restore, clone).

``tqdm.auto`` draws a bar in a terminal and a widget in Jupyter.  Bars are
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


def track(items: Iterable[T], desc: str, total: int | None = None) -> Iterable[T]:
    """``items``, with a bar named ``desc`` when progress is on."""
    if not enabled():
        return items
    from tqdm.auto import tqdm

    bar: Any = tqdm(items, desc=desc, total=total, unit="manager", leave=False)
    return bar  # type: ignore[no-any-return]
