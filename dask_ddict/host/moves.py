"""A host process's half of a move: a manager leaves (out, done, abort) or arrives (in).

The orchestrator drives a move (:mod:`dask_ddict.cluster.moves`) through both
hosts' supervisors; the manager's own steps are :mod:`dask_ddict.shard.moving`.
On one machine the new host process opens the old one's shard in ``/dev/shm``
as it is: nothing is copied, and the manager pauses only while its shard is
re-opened.  To another machine the new host receives the shard's used pages
(:class:`~dask_ddict.transport.whole_checkpoints.ShardPages`, over TCP, TLS when
the cluster uses it) straight into the file of its copy, while the manager's
writes pause (reads go on); a copy of 1 GiB takes about as long as the network
needs for 1 GiB.  Pausing writes for the copy, rather than copying while they go
on and catching up, keeps a move one consistent snapshot with no log to replay.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import threading
from typing import TYPE_CHECKING, Any, Protocol

from .. import config
from ..layout import ManagerInfo
from ..transport.connect import default_security
from ..transport.links import HostLink
from ..transport.whole_checkpoints import ShardPages
from . import hygiene
from .control import DictSpec
from .hygiene import shard_directory
from .opening import check_room, reserve_file, shard_name

if TYPE_CHECKING:
    from ..shard.manager import Manager
    from .server import HostedDict


class Host(Protocol):
    """What a move needs of the host process (``process.Host``)."""

    dicts: dict[bytes, HostedDict]
    locks: dict[tuple[str, int], int]

logger = logging.getLogger(__name__)

#: Seconds a moved manager's shard stays open here after the move, for reads that
#: were under way in this process (its copy, if any, is deleted then).
LET_GO_AFTER = 5.0
#: The shards of managers that moved away, held until :func:`let_go`: path ->
#: (dictionary uid, manager, whether to delete it, its timer).
_LETTING_GO: dict[str, tuple[str, Manager, bool, threading.Timer]] = {}
_LOCK = threading.Lock()


def _manager(host: Host, uid: str, mid: int) -> Manager:
    hosted = host.dicts.get(bytes.fromhex(uid))
    manager = None if hosted is None else hosted.managers.get(mid)
    if manager is None:
        from ..errors import DDictError

        raise DDictError(f"manager {mid} of {uid} is not served by this host process",
                         "INVALID_ARGUMENT")  # fmt: skip
    return manager


def move_out(host: Host, uid: str, mid: int, copy: bool) -> dict[str, Any]:
    """Pause manager ``mid`` for a move (see ``Moving.move_out``)."""
    return _manager(host, uid, mid).move_out(copy)


def move_abort(host: Host, uid: str, mid: int) -> None:
    _manager(host, uid, mid).move_abort()


def move_done(host: Host, uid: str, mid: int, where: str, park: bool = False) -> None:
    """Manager ``mid`` serves at ``where`` now: requests for it here are answered
    ``MOVED``; its shard is let go after :data:`LET_GO_AFTER` (closed if the new host
    serves the same shard, deleted if it serves a copy).  ``park``: it serves nowhere
    now; its shard is kept (see :mod:`.hygiene`) for a host on this machine to open."""
    hosted = host.dicts[bytes.fromhex(uid)]
    manager = _manager(host, uid, mid)
    copied = manager.copying and not park  # (a parked shard is kept: see the supervisor)
    hosted.moved[mid] = (where, manager.store.capacity)
    del hosted.managers[mid]
    manager.move_done(where)
    hygiene.release(host.locks.pop((uid, mid), None))
    timer = threading.Timer(LET_GO_AFTER, let_go, (manager.store.path,))
    timer.daemon = True
    with _LOCK:
        _LETTING_GO[manager.store.path] = (uid, manager, copied, timer)
    timer.start()
    logger.info("ddict host %d: manager %d of %s moved to %s", os.getpid(), mid, hosted.name,
                where)  # fmt: skip


def let_go(path: str) -> None:
    """Close (or, for a copy's original, delete) the moved manager's shard at ``path`` now,
    if it is still held here: after :data:`LET_GO_AFTER`, or at once when the shard
    moves back to this process (LMDB opens an environment once per process) or its
    dictionary is destroyed (its space comes back)."""
    with _LOCK:
        held = _LETTING_GO.pop(path, None)
    if held is None:
        return
    _, manager, delete, timer = held
    timer.cancel()
    try:
        if manager.persister is not None:
            manager.persister.close()
        if delete:
            manager.store.destroy()
        else:
            manager.store.close()
    except Exception:  # noqa: BLE001 - nothing waits for it
        logger.exception("ddict host: letting go of moved manager %d failed", manager.manager_id)


def let_go_of(uid: str) -> None:
    """:func:`let_go` of every moved manager of dictionary ``uid`` still held here."""
    with _LOCK:
        paths = [p for p, held in _LETTING_GO.items() if held[0] == uid]
    for path in paths:
        let_go(path)


def receive(spec: DictSpec, mid: int, source: dict[str, Any], used: int, map_size: int,
            tls: bool) -> str:  # fmt: skip
    """Copy moving manager ``mid``'s shard from ``source`` (its old place) into a new
    shard directory here; returns its path (opened by the caller as a kept shard)."""
    base = shard_directory()
    check_room(base, map_size)
    path = os.path.join(base, shard_name(spec.name, mid))
    os.makedirs(path, mode=0o700)
    lock = hygiene.claim(path)
    try:
        data = os.path.join(path, "data.mdb")
        fd = os.open(data, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, map_size)
            if config.get("store.reserve"):
                reserve_file(fd, map_size, base)
            mm = mmap.mmap(fd, map_size)
        finally:
            os.close(fd)
        ssl_context = None
        if tls:
            ssl_context = default_security().get_connection_args("client")["ssl_context"]
        link = HostLink(ManagerInfo(**source), spec.uid, spec.secret, spec.name, use_uds=False,
                        ssl_context=ssl_context, max_value=1 << 62)  # fmt: skip
        views: list[memoryview] = []

        def into(nbytes: int) -> memoryview:
            view = memoryview(mm)[:nbytes]
            views.append(view)
            return view

        try:
            _, pages = link.call(ShardPages(into, config.get_seconds("move.timeout")), mid)
            if not views:  # (a reply under SMALL_FRAME arrives as bytes, not into the file)
                mm[: len(pages)] = pages
            if len(memoryview(pages)) != used:
                logger.info("ddict: manager %d's shard: %d bytes copied, %d announced", mid,
                            len(memoryview(pages)), used)  # fmt: skip
        finally:
            link.close()
            for v in views:
                v.release()
            mm.close()
    except BaseException:
        hygiene.release(lock)
        shutil.rmtree(path, ignore_errors=True)
        raise
    hygiene.release(lock)  # (the manager that opens it claims it again)
    return path
