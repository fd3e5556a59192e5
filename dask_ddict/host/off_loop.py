"""off_loop: blocking work awaited from an event loop, in a thread, also while Python exits.

A supervisor's control calls block on its host's pipe, and the orchestrator's close
blocks on the dashboard's threads: their async handlers run them with :func:`off_loop`,
off the event loop, which keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable
from typing import Any


async def off_loop(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``await asyncio.to_thread(fn, ...)``, also while the interpreter exits.

    Once a script's main thread has ended, Python shuts the thread pools down
    (``concurrent.futures``' exit hook runs before any ``atexit`` handler), and a
    cluster closed after that (Dask's own ``atexit`` handler closes the local clusters
    a script left open) would meet ``RuntimeError: cannot schedule new futures after
    shutdown`` in every control call of its nannies' plugins: a traceback per call,
    and managers that could neither move nor be parked.  Then ``fn`` runs in a thread
    of its own instead, which a closing interpreter still starts.
    """
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    try:
        pooled = loop.run_in_executor(None, call)
    except RuntimeError:  # (the pool is shut down: the interpreter exits)
        pass
    else:
        return await pooled
    done: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result, error = call(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # (its loop closed meanwhile)
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="ddict-off-loop", daemon=True).start()
    return await done
