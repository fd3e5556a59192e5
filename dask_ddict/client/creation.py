"""Creating a dictionary: the constructor's arguments checked into one request.

:func:`create_request` is shared by :class:`~dask_ddict.DDict` and
:class:`~dask_ddict.AsyncDDict`, so both refuse the same mistakes with the same
messages before any message is sent.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from .. import config
from ..arguments import (
    MAX_MANAGERS,
    check_bool,
    check_int,
    check_lifetime,
    check_name,
    check_timeout,
)
from ..errors import raise_from_wire
from ..layout import Layout
from ..options import DDictOptions, parse_total_mem

_OPTIONS = tuple(f.name for f in dataclasses.fields(DDictOptions))

def create_request(args: Mapping[str, Any]) -> dict[str, Any]:
    """Validate the constructor's arguments into the orchestrator's ``ddict_create`` call.

    ``args`` are :class:`~dask_ddict.DDict`'s constructor arguments by name (its
    signature is their one declaration; ``AsyncDDict.create`` binds to it), the
    client aside.  Both faces therefore reject the same mistakes, with the same
    messages, before any message is sent.
    """
    managers_per_worker, n_workers, total_mem, name, timeout, restart, workers = (
        args[k] for k in ("managers_per_worker", "n_workers", "total_mem", "name", "timeout",
                          "restart", "workers")
    )  # fmt: skip
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
    lifetime = check_lifetime(config.get("lifetime") if args["lifetime"] is None
                              else args["lifetime"])  # fmt: skip
    given = {k: args[k] for k in _OPTIONS if k in args}
    if given.get("manager_pool_full_thresh") is None:
        given["manager_pool_full_thresh"] = config.get("manager-pool-full-thresh")
    options = DDictOptions(**given)
    options.validate(name=name, restart=restart)
    return dict(
        name=name, options=options.to_dict(), total_mem=mem, managers_per_worker=mpw,
        n_workers=n_workers, workers=None if workers is None else list(workers),
        restart=restart, lifetime=lifetime,
    )  # fmt: skip


def created_layout(reply: Any) -> Layout:
    """The layout in the orchestrator's ``ddict_create`` reply, or its refusal raised.

    A refusal (the user's mistake) comes back as an error reply rather than an
    exception of the handler, so that the scheduler does not log it as a bug;
    :func:`~dask_ddict.errors.raise_from_wire` raises it here with its type.
    """
    raise_from_wire(reply)
    return Layout.from_dict(reply)


def initial_checkpoint(h: Any, request: dict[str, Any]) -> None:
    """Where a creator's handle starts: ``restore_from``, the newest restored
    checkpoint after a restart, else 0.  Also shows the orchestrator's warnings."""
    for text in h._core.layout.extra.get("warnings", ()):
        warnings.warn(text, RuntimeWarning, stacklevel=3)
    restore_from = request["options"]["restore_from"]
    if request["restart"]:
        h.sync_to_newest_checkpoint()
    elif restore_from is not None:
        h._chkpt = restore_from
