"""Creating a dictionary: the constructor's arguments checked into one request.

:func:`create_request` is shared by :class:`~dask_ddict.DDict` and
:class:`~dask_ddict.AsyncDDict`, so both refuse the same mistakes with the same
messages before any message is sent.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, ParamSpec, TypeVar

from .. import config
from ..arguments import (
    MAX_MANAGERS,
    check_bool,
    check_int,
    check_lifetime,
    check_name,
    check_storage_options,
    check_timeout,
)
from ..options import DDictOptions, parse_total_mem

_OPTIONS = tuple(f.name for f in dataclasses.fields(DDictOptions))

P = ParamSpec("P")
R = TypeVar("R")


def check_keywords(what: str, given: Iterable[str], valid: Collection[str]) -> None:
    """Refuse a keyword that ``what`` does not take, naming the closest one it does.

    Python's own message (``got an unexpected keyword argument 'total_memory'``) leaves
    the user to find ``total_mem`` in the docs; ``difflib`` finds it for them.

    Raises
    ------
    TypeError
        Naming the first unknown keyword and its closest match (or every valid name
        when none is close).
    """
    unknown = [k for k in given if k not in valid]
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], sorted(valid), n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(sorted(valid))}"
    raise TypeError(f"{what}() got an unexpected keyword argument {unknown[0]!r}; {hint}")


def keywords_checked(init: Callable[P, R]) -> Callable[P, R]:
    """``init``, with :func:`check_keywords` over its own signature (their one declaration).

    The signature stays ``init``'s (``functools.wraps``: ``inspect.signature``, type
    checkers and the docs see it unchanged).
    """
    sig = inspect.signature(init)
    valid = frozenset(name for name, p in sig.parameters.items() if name != "self"
                      and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))  # fmt: skip
    what = init.__qualname__.removesuffix(".__init__")

    @functools.wraps(init)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        check_keywords(what, kwargs, valid)
        return init(*args, **kwargs)

    return checked


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
    storage_options = check_storage_options(args["storage_options"], options.persist_path)
    return dict(
        name=name, options=options.resolved().to_dict(), total_mem=mem, managers_per_worker=mpw,
        n_workers=n_workers, workers=None if workers is None else list(workers),
        restart=restart, lifetime=lifetime, storage_options=storage_options,
    )  # fmt: skip


def initial_checkpoint(h: Any, request: dict[str, Any]) -> None:
    """Where a creator's handle starts: ``restore_from``, else 0, also after a
    restart (as in Dragon: a program reads what it wrote at 0 and moves on with
    ``checkpoint()``; ``sync_to_newest_checkpoint()`` continues from the newest
    checkpoint instead).  Also shows the orchestrator's warnings,
    and keeps ``storage_options`` in this process only, for :meth:`DDict.copy`
    (they are credentials: never in the layout or a serialized handle)."""
    h._core.storage_options = request["storage_options"]
    for text in h._core.layout.extra.get("warnings", ()):  # at the line that called DDict(...)
        warnings.warn(text, RuntimeWarning, stacklevel=4)  # (here, __init__, keywords_checked)
    restore_from = request["options"]["restore_from"]
    if restore_from is not None:
        h._chkpt = restore_from
