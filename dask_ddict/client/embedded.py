"""The LocalCluster that ``DDict()`` starts and owns when given no client.

It is closed with the dictionary (``destroy()``), and, for a script that ends
without ``destroy()``, by an exit hook that destroys the dictionary first and
says so in one line (:func:`_close_embedded_at_exit` says why the hook is not an
``atexit`` handler).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading

from distributed import Client, LocalCluster

from .. import config
from .._forking import in_child

logger = logging.getLogger(__name__)

#: Seconds the exit hook waits for the orchestrator to destroy a dictionary left
#: undestroyed on an embedded cluster; the cluster closes after it anyway (and its
#: host processes take their shards with them).
EXIT_DESTROY_TIMEOUT = 30.0


def start(total_mem: int) -> tuple[Client, LocalCluster]:
    """Start the LocalCluster (worker processes) that ``DDict()`` owns.

    Shards live beside the workers, not in them, so the workers' memory limits
    share what the host has left after ``total_mem``.
    """
    from distributed.deploy.utils import nprocesses_nthreads
    from distributed.system import MEMORY_LIMIT

    n_workers = config.get("embedded.n-workers")
    n = n_workers or nprocesses_nthreads()[0]
    memory_limit = max(256 << 20, (MEMORY_LIMIT - total_mem) // max(1, n))
    cluster = LocalCluster(
        n_workers=n_workers,
        threads_per_worker=config.get("embedded.threads-per-worker"),
        processes=True,
        dashboard_address=":0",
        memory_limit=memory_limit,
    )
    _close_embedded_at_exit()
    _STARTED[id(cluster)] = os.getpid()
    return Client(cluster, set_as_default=False), cluster


class _Embedded:
    """An embedded cluster whose dictionary was not destroyed yet.

    Kept here, not only by the handle's core, so that the exit hook finds it also when
    every handle was dropped without ``destroy()``, and destroys the dictionary by
    name and uid before it closes the cluster (a cluster closed under a live dictionary
    would try to move its managers off each closing worker, then park them).
    """

    def __init__(self, client: Client, cluster: LocalCluster, name: str, uid: str) -> None:
        self.client, self.cluster, self.name, self.uid = client, cluster, name, uid
        #: The process whose cluster it is (the one that started it: see _forked).
        self.pid = _STARTED.get(id(cluster), os.getpid())

    def close(self) -> None:
        if self.pid != os.getpid():  # (a forked child's copy: see _forked)
            return
        _EMBEDDED.pop(id(self.cluster), None)
        _STARTED.pop(id(self.cluster), None)
        try:
            self.client.close()
        finally:
            self.cluster.close()

    def drop(self) -> None:
        """The interpreter exits and the dictionary was not destroyed: say so in one line,
        destroy it, then close the cluster (quietly: nothing that goes wrong now could be
        acted on)."""
        if self.pid != os.getpid():
            return
        if self.cluster.status.name in ("closing", "closed"):
            _EMBEDDED.pop(id(self.cluster), None)
            return
        logger.warning(
            "DDict %r was not destroyed; its keys are dropped with the embedded "
            "cluster (call d.destroy(), or use `with DDict() as d:`)",
            self.name,
        )
        try:
            self.client.sync(
                self.client.scheduler.ddict_destroy,
                name=self.name,
                uid=self.uid,
                allow_restart=False,
                callback_timeout=EXIT_DESTROY_TIMEOUT,
            )
        except Exception as e:  # noqa: BLE001 - the cluster's close removes its shards anyway
            logger.debug("ddict: destroying %r at exit: %r", self.name, e)
        with contextlib.suppress(Exception):
            self.close()


#: The embedded clusters (by id) whose dictionary was not destroyed yet.
_EMBEDDED: dict[int, _Embedded] = {}
#: The embedded clusters (by id) that are open, and the process that started each.
_STARTED: dict[int, int] = {}
_EXIT_HOOKED = False


def _close_embedded_at_exit() -> None:
    """Have :func:`_at_exit` run when the main thread ends (once per process).

    Not with :mod:`atexit`: Python runs ``atexit`` handlers only after it has shut the
    thread pools down (``concurrent.futures`` registers its own exit hook with
    ``threading._register_atexit``, and those run first, when the main thread ends).
    A cluster closed by an ``atexit`` handler (Dask's, for the clusters a script left
    open) then finds its event loop's executor gone: every nanny plugin's control call
    raised "cannot schedule new futures after shutdown", the managers could neither
    move nor be parked, and a script that forgot ``destroy()`` ended with a hundred
    lines of tracebacks.  Registered the same way, after that pool's hook (whose
    module is imported first), ours runs before it (they run last registered first),
    while the cluster still works, as an explicit ``destroy()`` would.  Where
    ``threading`` has no such hook, :mod:`atexit` is the fallback.
    """
    global _EXIT_HOOKED
    if _EXIT_HOOKED:
        return
    import concurrent.futures.thread  # noqa: F401 - its exit hook registered before ours

    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(_at_exit)
        else:  # pragma: no cover - every CPython since 3.9 has it
            atexit.register(_at_exit)
    except RuntimeError:  # (the interpreter exits already)
        return
    _EXIT_HOOKED = True


def _at_exit() -> None:
    """The interpreter exits: drop the embedded clusters whose dictionary is not
    destroyed (see :meth:`_Embedded.drop`)."""
    for owned in list(_EMBEDDED.values()):
        owned.drop()


def _forked() -> None:
    """In a forked child: the embedded clusters are the parent's, to close when it
    destroys their dictionaries or exits; neither this process's exit nor a
    ``destroy()`` here closes them, nor ``distributed``'s exit hook (the child's copy of
    each says not to: it would wait for worker processes that are not its own)."""
    for owned in _EMBEDDED.values():
        owned.cluster.shutdown_on_close = False


in_child(_forked)


def own(client: Client, cluster: LocalCluster, name: str, uid: str) -> None:
    """``cluster`` is embedded for dictionary ``name`` (closed at exit if not before)."""
    _EMBEDDED[id(cluster)] = _Embedded(client, cluster, name, uid)


def close(client: Client, cluster: LocalCluster, name: str, uid: str) -> None:
    """Close embedded ``cluster`` (its dictionary was destroyed)."""
    owned = _EMBEDDED.get(id(cluster))
    if owned is None:
        owned = _Embedded(client, cluster, name, uid)
    owned.close()
