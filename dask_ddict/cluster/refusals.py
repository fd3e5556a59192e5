"""refusing: an orchestrator's handler whose refusals are error replies, not raises.

Dask logs every exception that a handler raises at ERROR, with its traceback, in the
scheduler's log, which is the user's terminal when the cluster runs in their process.
A call refused for the user's own mistake (a name that exists or does not,
``restart=True`` for an unknown name, a checkpoint that is not persisted, a
``total_mem`` the hosts cannot hold) is no bug of the scheduler's: it goes back as an
error reply (:func:`~dask_ddict.errors.error_to_wire`, which the client raises typed
through :func:`~dask_ddict.errors.raise_from_wire`) and is logged at INFO.  Anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import error_to_wire

logger = logging.getLogger(__name__)


def refusing(handler: Callable[..., Any]) -> Callable[..., Any]:
    """``handler`` (synchronous or not), whose refusals come back as error replies
    instead of raises (see the module's docstring); an ``INTERNAL`` error is a bug."""

    def refused(e: Exception, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        wire = error_to_wire(e)
        if wire is None or getattr(e, "code", "") == "INTERNAL":
            return None
        name = kwargs.get("name")
        logger.info(
            "ddict: %s of %s refused: %s", handler.__name__, repr(name) if name else "a DDict", e
        )
        logger.debug("ddict: the refusal's traceback", exc_info=True)
        return wire

    async def later(result: Awaitable[Any], kwargs: dict[str, Any]) -> Any:
        try:
            return await result
        except Exception as e:
            wire = refused(e, kwargs)
            if wire is None:
                raise
            return wire

    @functools.wraps(handler)
    def call(**kwargs: Any) -> Any:
        try:
            result = handler(**kwargs)
        except Exception as e:
            wire = refused(e, kwargs)
            if wire is None:
                raise
            return wire
        return later(result, kwargs) if inspect.isawaitable(result) else result

    return call
