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
import logging
import os
import sys
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
    either,
)
from ..errors import DDictError, DDictUnableToCreateError
from ..layout import Layout
from ..options import DDictOptions, parse_total_mem
from ..persist.choice import persister_name
from ..placement import Policy, policy_groups
from .layouts import layout_reply

_OPTIONS = tuple(f.name for f in dataclasses.fields(DDictOptions))

P = ParamSpec("P")
R = TypeVar("R")

#: Dragon's names of constructor arguments spelled otherwise here, and ours: a Dask
#: worker stands for a Dragon node (its host process serves the managers placed on
#: it).  Either name may be given, not both (``docs/dragon.md``, "Moving from Dragon").
DRAGON_NAMES: dict[str, str] = {"managers_per_node": "managers_per_worker", "n_nodes": "n_workers"}
#: Dragon's placement arguments: ``policy`` and ``managers_per_policy`` place managers
#: (:mod:`dask_ddict.placement`); ``orc_policy`` is accepted without effect.
DRAGON_PLACEMENT = ("policy", "managers_per_policy", "orc_policy")


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
    valid = frozenset(
        name
        for name, p in sig.parameters.items()
        if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )
    what = init.__qualname__.removesuffix(".__init__")

    @functools.wraps(init)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        check_keywords(what, kwargs, valid)
        return init(*args, **kwargs)

    return checked


def dragon_arguments(args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` with Dragon's names (:data:`DRAGON_NAMES`) taken as ours, and Dragon's
    arguments that mean nothing here checked, so that a Dragon program's constructor
    call runs unchanged where it means the same, and is refused where it does not.

    Raises
    ------
    TypeError
        Both names of one argument given, or a wrong type.
    ValueError
        A persister class that is not here (Dragon's DAOS), saying what to use.
    """
    out = dict(args)
    for dragon, ours in DRAGON_NAMES.items():
        out[ours] = either("DDict", ours, out[ours], dragon, out.pop(dragon))
    if out["orc_policy"] is not None and not isinstance(out["orc_policy"], Policy):
        raise TypeError(
            f"orc_policy must be a dask_ddict.Policy or None, got {out['orc_policy']!r:.80}"
        )
    # (orc_policy: without effect, the orchestrator is the scheduler plugin)
    out["persister"] = persister_name(out.pop("persister_class"))
    if (
        out["persister"] == "directory"
        and not out["persist_path"]
        and (out["persist_freq"] or out["restore_from"] is not None)
    ):
        out["persist_path"] = os.getcwd()  # (Dragon's POSIX persister: "" is the cwd)
    check_bool("trace", out["trace"])
    check_int("streams_per_manager", out["streams_per_manager"], 0, allow_none=True)
    return out


def trace_logging(trace: bool) -> None:
    """Dragon's ``trace=True``: this process's ``dask_ddict`` loggers at DEBUG.

    Dragon's trace makes its client and managers log verbosely.  Here the
    managers run in their workers' host processes, which log their warnings
    beside their worker's, so ``trace`` is the nearest meaning: this process's
    records, shown on stderr by a handler added once, only where no handler
    would show them (neither the package's logger nor the root logger has one).
    Logging is the process's: ``trace=False`` turns nothing off.
    """
    if not trace:
        return
    logger = logging.getLogger("dask_ddict")
    logger.setLevel(logging.DEBUG)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)


def created_layout(reply: Any) -> Layout:
    """The layout in the orchestrator's ``ddict_create`` ``reply``, or its refusal raised.

    The one place where a creation's refusal becomes an exception (the
    orchestrator's code is not the client's to change): one of the creation as a
    whole, a plain :class:`DDictError` (a name taken, no worker to host managers,
    nothing kept to restart), is raised as :class:`DDictUnableToCreateError`,
    Dragon's name for it and a subclass of what it was (its code, so its
    ``lib_err``, kept); refusals of a more precise type keep theirs.
    """
    try:
        return layout_reply(reply)
    except DDictError as e:
        if type(e) is not DDictError:
            raise
        raise DDictUnableToCreateError(e.message, e.code) from None


def create_request(args: Mapping[str, Any]) -> dict[str, Any]:
    """Validate the constructor's arguments into the orchestrator's ``ddict_create`` call.

    ``args`` are :class:`~dask_ddict.DDict`'s constructor arguments by name (its
    signature is their one declaration; ``AsyncDDict.create`` binds to it), the
    client aside.  Both faces therefore reject the same mistakes, with the same
    messages, before any message is sent.  Dragon's names are taken as ours
    (:func:`dragon_arguments`).  Nothing else happens here (each face turns on
    ``trace``'s logging once this returns: :func:`trace_logging`).
    """
    args = dragon_arguments(args)
    managers_per_worker, n_workers, total_mem, name, timeout, restart, workers = (
        args[k]
        for k in (
            "managers_per_worker",
            "n_workers",
            "total_mem",
            "name",
            "timeout",
            "restart",
            "workers",
        )
    )
    groups = policy_groups(args["policy"], args["managers_per_policy"], managers_per_worker)
    if groups and restart:
        raise ValueError(
            "restart=True re-creates the managers where their shards were kept, "
            "with the policies they had: policy must be None (as in Dragon)"
        )
    if groups and (len(groups) > 1 or groups[0][1] is not None) and n_workers is not None:
        raise ValueError(
            "with a list (or mapping) of policies, the policies place the "
            "managers: n_workers (n_nodes) must be None, as in Dragon"
        )
    mpw = config.get("managers-per-worker") if managers_per_worker is None else managers_per_worker
    check_int("managers_per_worker", mpw, 1, MAX_MANAGERS)
    check_int("n_workers", n_workers, 1, MAX_MANAGERS, allow_none=True)
    if workers is not None and (
        isinstance(workers, (str, bytes))
        or not isinstance(workers, (list, tuple))
        or not all(isinstance(w, str) for w in workers)
    ):
        raise TypeError(f"workers must be a list of worker addresses or None, got {workers!r:.80}")
    mem = parse_total_mem(config.get("total-mem") if total_mem is None else total_mem)
    check_name(name)
    check_timeout(timeout)
    check_bool("restart", restart)
    lifetime = check_lifetime(
        config.get("lifetime") if args["lifetime"] is None else args["lifetime"]
    )
    given = {k: args[k] for k in _OPTIONS if k in args}
    if given.get("manager_pool_full_thresh") is None:
        given["manager_pool_full_thresh"] = config.get("manager-pool-full-thresh")
    options = DDictOptions(**given)
    options.validate(name=name, restart=restart)
    storage_options = check_storage_options(args["storage_options"], options.persist_path)
    return dict(
        name=name,
        options=options.resolved().to_dict(),
        total_mem=mem,
        managers_per_worker=mpw,
        n_workers=n_workers,
        workers=None if workers is None else list(workers),
        restart=restart,
        lifetime=lifetime,
        storage_options=storage_options,
        **({"policies": [[p.to_dict(), c] for p, c in groups]} if groups else {}),
    )


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
