"""A host process's half of a move: a manager leaves (out, done, abort) or arrives (in).

The orchestrator drives a move (:mod:`dask_ddict.cluster.moves`) through both
hosts' supervisors; the manager's own steps are :mod:`dask_ddict.shard.moving`.
On one machine the new host process opens the old one's shard in ``/dev/shm``
as it is: nothing is copied, and the manager pauses only while its shard is
re-opened.  To another machine the new host first makes the file of its copy
ready while the manager still works (:func:`prepare`: allocating and mapping a
shard's pages costs about as much as receiving them), then receives the shard's
used pages (:class:`~dask_ddict.transport.whole_checkpoints.ShardPages`, over
TCP, TLS when the cluster uses it) straight into that file, while the manager's
writes pause (reads go on): the pause is about the network's time for the bytes.  Pausing writes for the copy, rather than copying while they go
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
from ..errors import DDictError
from ..layout import ManagerInfo
from ..shard.store import ShardStore
from ..transport.socket_client import HostLink
from ..transport.tls_settings import default_security
from ..transport.whole_checkpoints import ShardPages
from . import hygiene
from .control import DictSpec
from .hygiene import shard_directory
from .opening import check_room, reserve_file, shard_name

if TYPE_CHECKING:
    from ..shard.manager import Manager
    from .hosted import HostedDict


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
#: Seconds a copy's file made ready by :func:`prepare` waits for its move.
PREPARED_FOR = 60.0
#: Those files: path -> (its map, the shard's map size, its owner lock, its expiry).
_PREPARED: dict[str, tuple[mmap.mmap, int, int, threading.Timer]] = {}


def served_manager(host: Host, uid: str, mid: int) -> Manager:
    """Manager ``mid`` of ``uid`` here (serving, or waiting for its lease's word)."""
    hosted = host.dicts.get(bytes.fromhex(uid))
    manager = None if hosted is None else hosted.find(mid)
    if manager is None:
        raise DDictError(
            f"manager {mid} of {uid} is not served by this host process", "INVALID_ARGUMENT"
        )
    return manager


def move_out(host: Host, uid: str, mid: int, copy: bool) -> dict[str, Any]:
    """Pause manager ``mid`` for a move (see ``Moving.move_out``)."""
    return served_manager(host, uid, mid).move_out(copy)


def move_abort(host: Host, uid: str, mid: int) -> None:
    served_manager(host, uid, mid).move_abort()


def move_done(host: Host, uid: str, mid: int, where: str, park: bool = False) -> None:
    """Manager ``mid`` serves at ``where`` now: requests for it here are answered
    ``MOVED``; its shard is let go after :data:`LET_GO_AFTER` (closed if the new host
    serves the same shard, deleted if it serves a copy).  ``park``: it serves nowhere
    now; its shard is kept (see :mod:`.hygiene`) for a host on this machine to open."""
    hosted = host.dicts[bytes.fromhex(uid)]
    if hosted.find(mid) is None and mid in hosted.moved:
        return  # (its lease's renewal learned it first: see depose)
    manager = served_manager(host, uid, mid)
    copied = manager.copying and not park  # (a parked shard is kept: see the supervisor)
    _stop_serving(host, hosted, uid, manager, where, copied)
    manager.move_done(where)
    logger.info("ddict host %d: manager %d of %s moved to %s", os.getpid(), mid, hosted.name, where)


def depose(host: Host, uid: str, manager: Manager, where: str) -> bool:
    """The orchestrator serves ``manager`` at ``where`` now (a replica took over: it took
    this host for lost; or a move that this host has not heard of yet is done): from
    now on its requests here are answered ``MOVED`` (not applied), as after a move; its
    shard is closed after :data:`LET_GO_AFTER` and kept (see ``Host.depose``).  Called
    by the manager's own write (its lock held), or by the lease's renewal.  Whether its
    shard is kept aside: not if it was not served here, nor if it was paused for a move
    to another host process of this machine, whose new host serves this very shard (the
    move is done: the renewal learned it before :func:`move_done` came)."""
    hosted = host.dicts.get(bytes.fromhex(uid))
    if hosted is None or hosted.find(manager.manager_id) is not manager:
        return False
    if manager.moving and not manager.copying:
        _stop_serving(host, hosted, uid, manager, where, False)
        manager.move_done(where)
        logger.info(
            "ddict host %d: manager %d of %s moved to %s (its lease's renewal said so)",
            os.getpid(),
            manager.manager_id,
            hosted.name,
            where,
        )
        return False
    hygiene.mark_kept(manager.store.path)  # (before its owner lock goes: no sweep takes it)
    _stop_serving(host, hosted, uid, manager, where, False)
    manager.moved, manager.closed = where, True
    manager._deferred.close(manager.moved_error)
    logger.warning(
        "ddict host %d: manager %d of %s is served by a replica at %s now; its "
        "shard is kept aside (%s) until the orchestrator discards it",
        os.getpid(),
        manager.manager_id,
        hosted.name,
        where,
        manager.store.path,
    )
    return True


def _stop_serving(
    host: Host, hosted: HostedDict, uid: str, manager: Manager, where: str, delete: bool
) -> None:
    """Requests for ``manager`` here are answered ``MOVED`` (to ``where``) from now on; its
    shard is let go after :data:`LET_GO_AFTER` (deleted if ``delete``: a copy serves)."""
    mid = manager.manager_id
    hosted.moved[mid] = (where, manager.store.capacity)
    hosted.managers.pop(mid, None)
    hosted.fenced.pop(mid, None)
    if manager.shipper is not None:  # (its replicas follow a move: the orchestrator says so)
        manager.shipper.close()
    hygiene.release(host.locks.pop((uid, mid), None))
    timer = threading.Timer(LET_GO_AFTER, let_go, (manager.store.path,))
    timer.daemon = True
    with _LOCK:
        _LETTING_GO[manager.store.path] = (uid, manager, delete, timer)
    timer.start()


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


def prepare(name: str, mid: int, capacity: int, nbytes: int) -> str:
    """Make the file of a copy of manager ``mid`` ready before its move pauses it (see
    :class:`~.control.MovePrepare`): allocating and mapping a shard's pages costs about
    as much as receiving them, so the pause is left with the transfer alone.  Kept for
    :data:`PREPARED_FOR` seconds; returns its path."""
    map_size = ShardStore.map_size_for(capacity)
    length = min(map_size, nbytes + max(nbytes // 4, 64 << 20))  # (room to grow meanwhile)
    path, mm, lock = _new_copy(name, mid, map_size, length, populate=True)
    timer = threading.Timer(PREPARED_FOR, _unprepare, (path,))
    timer.daemon = True
    with _LOCK:
        _PREPARED[path] = (mm, map_size, lock, timer)
    timer.start()
    return path


def _unprepare(path: str) -> None:
    """Drop a prepared copy's file that no move used (in time)."""
    with _LOCK:
        held = _PREPARED.pop(path, None)
    if held is not None:
        held[3].cancel()
        held[0].close()
        shutil.rmtree(path, ignore_errors=True)
        hygiene.release(held[2])


def _new_copy(
    name: str, mid: int, map_size: int, length: int, populate: bool
) -> tuple[str, mmap.mmap, int]:
    """A new shard directory here for a copy of manager ``mid``: its path, the map of its
    data file (see :func:`_copy_file`) and its owner lock."""
    base = shard_directory()
    check_room(base, map_size)
    path = os.path.join(base, shard_name(name, mid))
    os.makedirs(path, mode=0o700)
    lock = hygiene.claim(path)
    try:
        return path, _copy_file(path, map_size, length, populate), lock
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)  # (before its lock goes: a sweep's then)
        hygiene.release(lock)
        raise


def _copy_file(path: str, map_size: int, length: int, populate: bool) -> mmap.mmap:
    """The data file of a copy at ``path``: ``map_size`` bytes (reserved whole with
    ``ddict.store.reserve``), its first ``length`` mapped (``populate``: its pages
    allocated and mapped now, not one by one as they are written)."""
    fd = os.open(os.path.join(path, "data.mdb"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, map_size)
        if config.get("store.reserve"):
            reserve_file(fd, map_size, os.path.dirname(path))
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(fd, length, flags=flags)
    finally:
        os.close(fd)


def receive(
    spec: DictSpec,
    mid: int,
    source: dict[str, Any],
    used: int,
    map_size: int,
    tls: bool,
    prepared: str = "",
) -> tuple[str, int]:
    """Copy moving manager ``mid``'s shard from ``source`` (its old place) into the file
    :func:`prepare` made at ``prepared``, else into a new shard directory here; returns
    its path (opened by the caller as a kept shard) and its owner lock, which the caller
    releases once whatever serves the copy claimed it (no sweep takes it in between)."""
    with _LOCK:
        held = _PREPARED.pop(prepared, None) if prepared else None
    if held is not None:
        held[3].cancel()
        if len(held[0]) >= used and held[1] == map_size:
            path, mm, lock = prepared, held[0], held[2]
        else:  # (it grew past the room made for it: made again)
            held[0].close()
            shutil.rmtree(prepared, ignore_errors=True)
            hygiene.release(held[2])
            held = None
    if held is None:
        path, mm, lock = _new_copy(spec.name, mid, map_size, map_size, populate=False)
    try:
        ssl_context = None
        if tls:
            ssl_context = default_security().get_connection_args("client")["ssl_context"]
        link = HostLink(
            ManagerInfo(**source),
            spec.uid,
            spec.secret,
            spec.name,
            use_uds=False,
            ssl_context=ssl_context,
            max_value=1 << 62,
        )
        views: list[memoryview] = []

        def into(nbytes: int) -> memoryview:
            if nbytes > len(mm):
                raise DDictError(
                    f"manager {mid}'s shard sent {nbytes} bytes, over its {len(mm)}-byte map",
                    "INTERNAL",
                )
            view = memoryview(mm)[:nbytes]
            views.append(view)
            return view

        try:
            _, pages = link.call(ShardPages(into, config.get_seconds("move.timeout")), mid)
            if not views:  # (a reply under SMALL_FRAME arrives as bytes, not into the file)
                mm[: len(pages)] = pages
            if len(memoryview(pages)) != used:
                logger.info(
                    "ddict: manager %d's shard: %d bytes copied, %d announced",
                    mid,
                    len(memoryview(pages)),
                    used,
                )
        finally:
            link.close()
            for v in views:
                v.release()
            mm.close()
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)  # (before its lock goes: a sweep's then)
        hygiene.release(lock)
        raise
    return path, lock
