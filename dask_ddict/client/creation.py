"""Creating a dictionary: the constructor's arguments checked into one request.

:func:`create_request` is shared by :class:`~dask_ddict.DDict` and
:class:`~dask_ddict.AsyncDDict`, so both refuse the same mistakes with the same
messages before any message is sent.
"""

from __future__ import annotations

from typing import Any

from .. import config
from ..arguments import MAX_MANAGERS, check_bool, check_int, check_name, check_timeout
from ..options import DDictOptions, parse_total_mem

def create_request(
    managers_per_worker: int | None,
    n_workers: int | None,
    total_mem: int | str | None,
    *,
    name: str,
    timeout: float | None,
    restart: bool,
    manager_pool_full_thresh: float | None,
    workers: list[str] | None,
    **checkpoint_options: Any,
) -> dict[str, Any]:
    """Validate the constructor's arguments into the orchestrator's ``ddict_create`` call.

    Shared by :class:`DDict` and :class:`~dask_ddict.AsyncDDict` so that both
    reject the same mistakes, with the same messages, before any message is sent.
    """
    mpw = config.get("managers-per-worker") if managers_per_worker is None else managers_per_worker
    check_int("managers_per_worker", mpw, 1, MAX_MANAGERS)
    check_int("n_workers", n_workers, 1, MAX_MANAGERS, allow_none=True)
    if workers is not None and (
        isinstance(workers, (str, bytes)) or not isinstance(workers, (list, tuple))
        or not all(isinstance(w, str) for w in workers)
    ):  # fmt: skip
        raise TypeError(f"workers must be a list of worker addresses or None, got {workers!r:.80}")
    mem = parse_total_mem(config.get("total-mem") if total_mem is None else total_mem)
    check_name(name)
    check_timeout(timeout)
    check_bool("restart", restart)
    if manager_pool_full_thresh is None:
        manager_pool_full_thresh = config.get("manager-pool-full-thresh")
    options = DDictOptions(manager_pool_full_thresh=manager_pool_full_thresh, **checkpoint_options)
    options.validate(name=name, restart=restart)
    return dict(
        name=name, options=options.to_dict(), total_mem=mem, managers_per_worker=mpw,
        n_workers=n_workers, workers=None if workers is None else list(workers),
        restart=restart,
    )  # fmt: skip
