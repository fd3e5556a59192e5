"""Whether a host supervisor lives, and why a worker left: the orchestrator's view.

The orchestrator learns that a host is gone in three ways, from the surest:

* the supervisor's own word (``ddict_host_gone``: its nanny closes, or it gave its host
  process up, or that process has ended);
* its port refuses connections (:func:`refused`): its process is gone, and its host
  process with it (a refused connection alone is no proof that the *host process*
  ended: a firewall's REJECT looks the same, so it never ends a lease);
* no answer within ``ddict.host.probe-timeout``: not known (a partition, a stopped
  machine), said ``UNKNOWN``.

Dask's comms retry a refused connection for their whole connect timeout (30 s), far
too long to learn that a host is gone, so every question to a supervisor here is
asked with :func:`ask`, which watches for the refusal meanwhile.  Why a worker left
comes from the ``stimulus_id`` Dask removed it with (:func:`why_left`), kept for the
loss its supervisor reports later, so that clients read in the layout *why* their
managers are lost ("its worker was retired").
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from distributed.comm import get_address_host_port

from .. import config
from ..layout import Layout

#: How often a probe of a supervisor checks whether its port refuses connections.
REFUSED_EVERY = 0.1

#: What :func:`ask` found: an answer, its process gone, or neither within the time.
ANSWERED, GONE, UNKNOWN = "answered", "gone", "unknown"

#: Why a manager's host is gone when its worker was retired (scaled down, ``lifetime``).
RETIRED = "its worker was retired"

#: What a worker's removal says, by the prefix of Dask's ``stimulus_id`` for it.
_LEFT = {
    "retire-workers": RETIRED,
    "worker-close-gracefully": RETIRED,
    "nanny-close": "its nanny closed",
    "handle-worker-cleanup": "its worker's connection to the scheduler broke",
}

#: How many workers' reasons for leaving are remembered (the newest kept).
MOST_LEFT = 1024


def why_left(stimulus_id: str) -> str:
    """Why a worker left, in words, from the ``stimulus_id`` Dask removed it with."""
    for prefix, why in _LEFT.items():
        if stimulus_id.startswith(prefix):
            return why
    return f"its worker was removed ({stimulus_id.rsplit('-', 1)[0] or 'unknown'})"


async def refused(address: str) -> bool:
    """Whether a TCP connection to ``address`` (a Dask address) is refused: nothing listens
    there, its process is gone.  Dask's own comms retry a refused connection for their
    whole connect timeout; this answers at once."""
    try:
        host, port = get_address_host_port(address)
    except Exception:  # noqa: BLE001 - not a TCP address (inproc://): not known here
        return False
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
    except ConnectionRefusedError:
        return True
    except Exception:  # noqa: BLE001 - a timeout, an unreachable network: not known here
        return False
    writer.close()
    return False


async def ask(call: Awaitable[Any], address: str, timeout: float | None) -> tuple[str, Any]:
    """``(ANSWERED, call's answer)``; ``(GONE, None)`` once ``address`` refuses connections
    (its process is gone: checked every :data:`REFUSED_EVERY` s meanwhile, since a
    process killed while a connection to it was being accepted never answers it); or
    ``(UNKNOWN, None)`` when ``timeout`` passed (a partition, a stopped machine) or the
    call failed otherwise: whether the process lives is not known then."""
    task = asyncio.ensure_future(call)
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
    try:
        while not task.done():
            if await refused(address):
                return GONE, None
            left = None if deadline is None else deadline - asyncio.get_running_loop().time()
            if left is not None and left <= 0:
                return UNKNOWN, None
            await asyncio.wait(
                [task], timeout=REFUSED_EVERY if left is None else min(REFUSED_EVERY, left)
            )
        if task.exception() is not None:
            return (GONE if await refused(address) else UNKNOWN), None
        return ANSWERED, task.result()
    finally:
        if not task.done():
            task.cancel()


class Liveness:
    """Which host supervisors the orchestrator knows to be gone, and why workers left.

    Parameters
    ----------
    rpc
        ``rpc(address)``: the scheduler's RPC to a host supervisor.
    workers
        ``workers()``: the scheduler's workers (address -> ``WorkerState``).
    layouts
        The orchestrator's registry (name -> layout): whose managers a host serves.
    """

    def __init__(
        self,
        rpc: Callable[[str], Any],
        workers: Callable[[], Mapping[str, Any]],
        layouts: Mapping[str, Layout],
    ) -> None:
        self._rpc = rpc
        self._workers = workers
        self._layouts = layouts
        #: Supervisors (nannies) found gone, or closing: they do not come back.
        self.gone: set[str] = set()
        #: ...those whose port refuses connections: their process ended.
        self.ended: set[str] = set()
        #: worker address -> why it left the scheduler (:func:`why_left`), for a loss its
        #: supervisor reports later; bounded (the newest kept).
        self.left: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"<Liveness gone={len(self.gone)} ended={len(self.ended)}>"

    def worker_left(self, worker: str, stimulus_id: str) -> str:
        """``worker`` left the scheduler (removed with ``stimulus_id``): why, in words."""
        why = self.left[worker] = why_left(stimulus_id)
        while len(self.left) > MOST_LEFT:
            del self.left[next(iter(self.left))]
        return why

    def closing(self, supervisor: str) -> None:
        """``supervisor`` said that it closes (its host process may live a little longer)."""
        self.gone.add(supervisor)

    def why_leaving(self, supervisor: str, why: str) -> str:
        """Why ``supervisor``'s host goes, as the scheduler knows it (its worker retired,
        left, ...), else ``why`` (the supervisor's own view)."""
        workers = self._workers()
        for w in sorted(_workers_of(supervisor, self._layouts.values())):
            ws = workers.get(w)
            if getattr(getattr(ws, "status", None), "name", "") == "closing_gracefully":
                return RETIRED
            why = self.left.get(w, why)
        return why

    async def probe(self, supervisor: str) -> str:
        """Whether a host supervisor still serves: ``ANSWERED``; ``GONE`` (its port refuses
        connections: its process is gone, or it closed, its host process with it); or
        ``UNKNOWN`` (no answer: a partition, a stopped machine; or it is closing: it
        answers ``None``, and its host process may live a little longer).

        Asked with a short timeout (:func:`ask`).  A supervisor found gone stays gone
        (a nanny does not come back).
        """
        if supervisor in self.ended:
            return GONE
        if supervisor in self.gone:  # (it said it closes: its host may not have ended yet)
            return UNKNOWN
        said, info = await ask(
            self._rpc(supervisor).ddict_host_info(),
            supervisor,
            config.get_seconds("host.probe-timeout"),
        )
        if said == ANSWERED and not isinstance(info, dict):  # (it closes)
            self.gone.add(supervisor)
            return UNKNOWN
        if said == GONE:
            self.gone.add(supervisor)
            self.ended.add(supervisor)
        return said

    async def reachable(self, supervisor: str) -> bool:
        """Whether a host supervisor still serves (see :meth:`probe`)."""
        return await self.probe(supervisor) == ANSWERED


def _workers_of(supervisor: str, layouts: Iterable[Layout]) -> set[str]:
    """The workers whose managers ``supervisor``'s host serves."""
    return {m.worker for lay in layouts for m in lay.managers if m.supervisor == supervisor}
