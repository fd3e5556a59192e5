"""What every handle of one attached dictionary shares: its channels and its Dask client.

Handles derived from one another (:meth:`DDict.manager`, :meth:`DDict.pickler`)
share one :class:`HandleCore`, so that destroying through one closes them all.
The channels themselves come from :class:`~dask_ddict.transport.channels.Channels`;
the core adds what only a user-facing handle has: the Dask client for control
calls, an embedded cluster it may own, and the hash-seed check.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from dask.utils import format_bytes
from distributed import Client, LocalCluster

from .. import config, kernels
from .._forking import reinit_lock
from .._hashing import custom_placement, key_digest, manager_for_digest, seed_warning
from .._keys import PLAIN_KEYS, dumps_key, encode_key
from .._serialize import KeyPickler
from ..errors import (
    DDictClosedError,
    DDictError,
    DDictFullError,
    DDictManagerMovedError,
    DDictManagerUnavailableError,
    manager_lost,
)
from ..layout import Layout, ManagerInfo
from ..transport.channels import Channels
from ..transport.tls_settings import default_security
from . import embedded
from .layouts import LayoutRef, current_client, current_layout, fetched_layout, remember, resolve

#: Seconds between two questions of one handle to the orchestrator about unreachable
#: managers (see :meth:`HandleCore.explain`).
ASK_EVERY = 0.5
#: How often a client waiting for a replica to take over asks the orchestrator (seconds).
FAILOVER_POLL = 0.2

#: "No argument given" for methods whose ``None`` means something.
MISSING: Any = object()

#: Dictionaries (uids) whose hash-seed warning this process has shown: once per process
#: and dictionary, however many handles it attaches.
_SEED_WARNED: set[str] = set()


def install_orchestrator(client: Client) -> Any:
    """Install the scheduler plugin (idempotent) before a client's first control call.

    A cluster that never had a dictionary has no ``ddict_*`` handlers yet: with
    them, :meth:`DDict.list` answers ``[]`` and :meth:`DDict.from_name` "no DDict
    named ...", instead of Dask's "no handler".  Returns what
    ``client.register_plugin`` returns (a coroutine for an asynchronous client).
    """
    from ..cluster.scheduler_plugin import DDictSchedulerPlugin

    return client.register_plugin(DDictSchedulerPlugin())


class HandleCore(Channels):
    """A dictionary's channels, plus the Dask client for control and an owned cluster."""

    def __init__(
        self,
        layout: Layout | LayoutRef,
        client: Client | None = None,
        cluster: LocalCluster | None = None,
    ) -> None:
        if isinstance(layout, LayoutRef):  # from a pickled handle: resolved on first use
            self.ref = layout
            super().__init__(None)
        else:
            self.ref = LayoutRef.of(layout)
            remember(layout)  # handles pickled here and unpickled here need no fetch
            super().__init__(layout)
        self._client = client
        self._pid = os.getpid()  # (the process whose client it is: see forked)
        self._forked_from = 0
        self._security: Any = None  # (a forked child's: its parent's client's, see forked)
        self.cluster = cluster
        if cluster is not None and client is not None and isinstance(layout, Layout):
            embedded.own(client, cluster, layout.name, layout.uid)
        self.seed_checked = False
        self._routers: dict[tuple[int, bool], tuple[Any, kernels.Router]] = {}  # see router
        self.storage_options: dict[str, Any] | None = None  # the creator's, for copy()
        self._room: int | None = None  # see value_room
        self._lost: dict[int, ManagerInfo] = {}  # managers the orchestrator said lost
        self._asked = 0.0  # when explain() may ask the orchestrator again
        self._asking = threading.Lock()  # (one explain() asks at a time...)
        self._answer: Layout | DDictClosedError | None = None  # (...and the others share it)
        self._answers = 0  # answers got so far
        self._fresh_at = 0.0  # when fresh() may ask it again

    def _resolve(self) -> Layout:
        return resolve(self.ref, self._client)

    @property
    def name(self) -> str:
        """The dictionary's name (known without resolving the layout)."""
        return self.ref.name

    def router(self, kp: KeyPickler | None, placed: bool = True) -> kernels.Router:
        """The routing rule of this dictionary's keys, pickled by ``kp`` (cached per
        pickler: a handle's single-key operations route through it).  ``placed``: a key
        with a user ``__hash__`` goes where it says (not for a handle of one manager)."""
        got = self._routers.get((id(kp), placed))
        if got is None:
            encode = encode_key if kp is None else functools.partial(dumps_key, pickler=kp)
            router = kernels.Router(
                self.num_managers,
                self.max_key_bytes,
                encode,
                _placer(weakref.ref(self)) if placed else None,
                PLAIN_KEYS,
                key_digest,
                self.route_cache,
            )
            got = self._routers[id(kp), placed] = (kp, router)  # (kp kept: its id stays its)
        return got[1]

    def placed(self, key: Any, digest: bytes, n: int) -> int:
        """The manager of a key that is not a plain type: its user ``__hash__``'s, if any."""
        mid = custom_placement(key, n)
        if mid is None:
            return manager_for_digest(digest, n)
        if not self.seed_checked:
            self.check_hash_seed(type(key))
        return mid

    def check_hash_seed(self, cls: type) -> None:
        """Warn once if keys placed by ``cls.__hash__`` here may land elsewhere in tasks.

        Called on the first such placement through this core: it compares this
        process's ``hash()`` of the probe string with the workers' (carried by the
        layout), so it costs nothing per operation and no message.
        """
        self.seed_checked = True
        layout = self.layout
        if layout.uid in _SEED_WARNED:
            return
        text = seed_warning(cls, layout.hash_probes, layout.hash_seed)
        if text is not None:
            _SEED_WARNED.add(layout.uid)
            warnings.warn(text, RuntimeWarning, stacklevel=4)

    def explain(
        self, mid: int, e: DDictManagerUnavailableError, place: tuple[str, str, int] | None = None
    ) -> DDictError:
        """Why manager ``mid`` cannot be reached, as the orchestrator knows it.

        This process sees only a refused connection, a socket file gone or a shard
        marked closed; the orchestrator knows which hosts are gone and why (a
        retired worker, a closed nanny, a supervisor that gave up).  It is asked
        here, when an operation failed (never on the way of one that works), and
        its answer is kept: every later failure of that manager says the same,
        with what to do (:func:`~dask_ddict.errors.manager_lost`).  A dictionary
        destroyed meanwhile is :class:`DDictClosedError`.  An orchestrator that
        does not know (yet) leaves ``e`` as it is; it is asked at most every
        :data:`ASK_EVERY` seconds, so a loop of failures does not flood it.  Threads
        that fail together (a retired host's listener closed under all of them) share
        one answer: one asks while the others wait for it (before, they found the rate
        limit set and no answer yet, and raised ``e`` for a manager that had moved), so
        a failure waits for at most one question (``ddict.host.probe-timeout``).
        """
        info = self._lost.get(mid)
        if info is not None:
            return manager_lost(self.name, info)
        if place is not None and self.layout.options.replicas:
            return self._await_failover(mid, place) or e
        seen = self._answers
        with self._asking:
            if self._answers == seen and time.monotonic() >= self._asked:
                self._asked = time.monotonic() + ASK_EVERY
                self._answer = None  # (a question that raises leaves no older answer)
                try:
                    self._answer = current_layout(
                        self.ref, self._client, config.get_seconds("host.probe-timeout")
                    )
                except DDictClosedError as closed:
                    self._answer = closed
                finally:
                    self._answers += 1
                if isinstance(self._answer, Layout):
                    self._lost.update((m.manager_id, m) for m in self._answer.managers if m.lost)
                    if place is not None and self._answer.managers[mid].address != place:
                        self._asked = 0.0  # (a failure after the move is followed asks again)
            answer = self._answer  # (this thread's, or one that a thread got meanwhile)
        if isinstance(answer, DDictClosedError):
            return answer
        info = self._lost.get(mid)
        if info is not None:
            return manager_lost(self.name, info)
        if answer is not None and place is not None and answer.managers[mid].address != place:
            now_at = answer.managers[mid]
            return DDictManagerMovedError(
                f"manager {mid} of {self.name!r} moved to {now_at.hostname} ({now_at.worker})"
            )
        return e

    def _await_failover(self, mid: int, place: tuple[str, str, int]) -> DDictError | None:
        """A replicated manager that cannot be reached at ``place``: its host may be lost,
        and a replica about to take over.  The orchestrator is asked (once its moves
        are done) until the manager serves elsewhere (``MOVED``: followed), is lost, or
        ``ddict.failover-timeout`` passes (``None``)."""
        deadline = time.monotonic() + (config.get_seconds("failover-timeout") or 0.0)
        while True:
            left = deadline - time.monotonic()
            try:
                layout = current_layout(self.ref, self._client, max(0.05, left), settled=True)
            except DDictClosedError as closed:
                return closed
            now_at = None if layout is None else layout.managers[mid]
            if now_at is not None and now_at.lost:
                self._lost[mid] = now_at
                return manager_lost(self.name, now_at)
            if now_at is not None and now_at.address != place:
                return DDictManagerMovedError(
                    f"manager {mid} of {self.name!r} failed over to "
                    f"{now_at.hostname} ({now_at.worker})"
                )
            if left <= 0:
                return None
            time.sleep(min(FAILOVER_POLL, max(0.0, left)))

    def current(self, deadline: float | None) -> Layout | None:
        """The orchestrator's layout once its moves of this dictionary are done, asked
        within the operation's time (else ``ddict.move.timeout``)."""
        wait = (
            config.get_seconds("move.timeout")
            if deadline is None
            else max(0.05, deadline - time.monotonic())
        )
        return current_layout(self.ref, self._client, wait, settled=True)

    def fresh(self, force: bool = False) -> Layout:
        """The layout as the orchestrator has it now (managers move when workers leave or
        join), asked at most every :data:`ASK_EVERY` seconds (``force``: now), by a
        handle that has a client (the user's); others (a task's) keep the layout of
        their epoch, and follow a manager's move when they meet it."""
        if self._due(force):
            self.offer(
                current_layout(self.ref, self._client, config.get_seconds("host.probe-timeout"))
            )
        return self.layout

    def _due(self, force: bool = False) -> bool:
        """Whether :meth:`fresh` asks the orchestrator now (then not again for
        :data:`ASK_EVERY` seconds)."""
        now = time.monotonic()
        if (force or now >= self._fresh_at) and not self.closed and self._client is not None:
            self._fresh_at = now + ASK_EVERY
            return True
        return False

    async def fresh_async(self) -> Layout:
        """:meth:`fresh` from the event loop of an asynchronous client (whose loop a
        blocking ask would stall): the orchestrator's answer awaited."""
        client = self._client
        if client is not None and client.asynchronous and self._due():
            try:
                ask = client.scheduler.ddict_attach(name=self.ref.name)
                reply = await asyncio.wait_for(ask, config.get_seconds("host.probe-timeout"))
            except (TimeoutError, OSError):  # (no answer: the layout it has)
                return self.layout
            self.offer(fetched_layout(self.ref, reply))
        return self.layout

    def offer(self, layout: Layout | None) -> None:
        """Adopt the orchestrator's ``layout`` if it is newer than this one's."""
        if layout is not None and layout.epoch > self.layout.epoch:
            self.adopt(layout)

    def adopt(self, layout: Layout) -> None:
        super().adopt(layout)
        remember(layout)
        self._lost = {m.manager_id: m for m in layout.managers if m.lost}
        self._room = None

    @property
    def value_room(self) -> int:
        """The most bytes a put's value and key may have to fit an empty shard at all.

        Each shard holds ``total_mem / managers`` bytes and puts may fill
        ``manager_pool_full_thresh`` of it: a bigger value is refused here, naming
        the real shard size, before it is sent (the transport's own limit is the
        host's, at least ``ddict.transport.min-value-limit``: too loose to explain).
        """
        if self._room is None:
            lay = self.layout
            shard = lay.total_mem // lay.num_managers
            self._room = int(lay.options.manager_pool_full_thresh * shard)
        return self._room

    def too_large(self, mid: int | None, nbytes: int) -> DDictFullError:
        """The error for a value of ``nbytes`` (with its key) over :attr:`value_room`.

        ``mid`` is its manager (``None``: every manager, for ``bput``).
        """
        lay = self.layout
        n, thresh = lay.num_managers, lay.options.manager_pool_full_thresh
        at_least = math.ceil((nbytes + (1 << 20)) * n / thresh)  # (a MiB for LMDB's pages)
        where = "every manager" if mid is None else f"manager {mid}"
        return DDictFullError(
            f"DDict {lay.name!r} {where}: a {nbytes}-byte value (with its key) cannot fit: "
            f"each of its {n} managers' shards holds {lay.total_mem // n} bytes (total_mem "
            f"{lay.total_mem} / {n}), and puts may fill {self.value_room} of them "
            f"({thresh:.0%}: manager_pool_full_thresh).  Create the dictionary with a "
            f"total_mem of at least {format_bytes(at_least)} for {n} managers, or store the "
            "value in parts under several keys (which spread over the managers)"
        )

    def full(self, e: DDictFullError, mid: int) -> DDictFullError:
        """``e`` (a shard's own message, which cannot know it) naming dictionary and manager
        (the manager's names the zero-copy views that held its room, if any did)."""
        return DDictFullError(f"DDict {self.name!r} manager {mid}: {e.message}", e.code)

    def write(self, mid: int, op: Any) -> Any:
        """``op`` (a put) on manager ``mid``; a full shard says whose it is (:meth:`full`)."""
        try:
            return self.channel(mid).call(op)
        except DDictFullError as e:
            raise self.full(e, mid) from None

    def close_cluster(self) -> None:
        """Close the embedded cluster this core owns, if any (its dictionary destroyed)."""
        cluster, self.cluster = self.cluster, None
        if cluster is not None and not self._forked_from:  # (else the parent's: see forked)
            embedded.close(self.client, cluster, self.name, self.ref.uid)

    def forked(self) -> None:
        """In a forked child: the Dask client is the parent's, also one found lazily
        (its event loop is a thread of the parent's, which does not run here), so
        control operations say so rather than wait for it forever; its TLS settings
        stay, for the links the child makes."""
        super().forked()
        reinit_lock(self._asking)
        if self._client is not None:
            self._security = self._client.security
        self._client = None
        self._forked_from = self._forked_from or self._pid
        self._pid = os.getpid()

    @property
    def client(self) -> Client:
        """A Dask client for control operations, found lazily."""
        if self._client is None and self._forked_from:
            raise DDictError(
                f"this handle was made in process {self._forked_from}, which forked this "
                f"one, and its Dask client is that process's: attach with a client of this "
                f"process's (DDict.attach(d.serialize(), client=...)) for this operation",
                "INVALID_OPERATION",
            )
        if self._client is None:
            self._client = current_client()
            if self._client is None:
                raise DDictError(
                    "this operation needs a dask Client: pass client= to DDict.attach or "
                    "create one in this process",
                    "INVALID_OPERATION",
                )
        return self._client

    def security(self) -> Any:
        # No reference cycle through a stored bound method: the core must be freed as soon
        # as its last handle is (its finalizer closes channels), not by the cyclic GC.
        if self._client is not None:
            return self._client.security
        return self._security if self._security is not None else default_security()


def _placer(core: weakref.ref[HandleCore]) -> Callable[[Any, bytes, int], int]:
    """:meth:`HandleCore.placed` for a router that the core keeps: through a weak reference,
    so that a dropped handle's core is freed at once, not by the cyclic GC (its
    finalizer closes channels, which must not run at any moment)."""

    def placed(key: Any, digest: bytes, n: int) -> int:
        c = core()
        if c is None:
            raise DDictClosedError("the dictionary's handle is gone")
        return c.placed(key, digest, n)

    return placed
