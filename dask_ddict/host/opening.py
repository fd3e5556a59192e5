"""Opening a manager in a host process: a new shard, or one that is already there.

A shard is re-opened ("re-attached") in three cases, all with every committed
write intact because LMDB's pages live in the host's shared memory:
the host process restarted after a crash, ``restart=True`` after
``destroy(allow_restart=True)``, and the supervisor replaying its managers.
A new shard first reserves its whole size in the shard directory, so that a
full tmpfs is an error at creation instead of a bus error on some later write.
"""

from __future__ import annotations

import os
import re
import secrets
import socket

from .. import config
from ..errors import DDictFullError
from ..shard import key_counts
from ..shard.checkpoint_io import HISTORY
from ..shard.manager import Manager
from ..shard.reader_marks import add_waiters
from ..shard.store import ShardStore
from ..shard.working_set import WorkingSet
from . import hygiene
from .control import DictSpec
from .hygiene import shard_directory


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_room(directory: str, needed: int) -> None:
    """Refuse a shard that its directory (or, for a tmpfs, the host's memory) cannot hold."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    limits = [("free space in " + directory, free)]
    mem = _meminfo_available()
    if mem is not None:
        limits.append(("available memory", mem))
    for what, available in limits:
        if needed > available:
            raise DDictFullError(
                f"host {socket.gethostname()} cannot hold a {needed}-byte shard: "
                f"{available} bytes of {what} (lower total_mem, add hosts, or set "
                "ddict.store.directory)"
            )


def shard_name(name: str, mid: int) -> str:
    """A new shard directory's name (``ddict-<name>-<manager>-<random>``)."""
    return f"{hygiene.PREFIX}{_safe(name)}-{mid}-{secrets.token_hex(8)}"


def reserve_file(fd: int, size: int, where: str) -> None:
    """Allocate ``size`` bytes of the open file ``fd`` now (a tmpfs then never fills
    under a writer): :class:`DDictFullError` naming the host if ``where`` cannot."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        raise DDictFullError(
            f"host {socket.gethostname()} cannot reserve {size} bytes for a shard "
            f"in {where}: {e.strerror}"
        ) from None


def _reserve(store: ShardStore) -> None:
    """Allocate the shard's whole map now."""
    fd = os.open(os.path.join(store.path, "data.mdb"), os.O_RDWR | os.O_CLOEXEC)
    try:
        reserve_file(fd, store.map_size, os.path.dirname(store.path))
    finally:
        os.close(fd)


def history_of(uid: str) -> int:
    """A new dictionary's history (``shard.checkpoint_io.HISTORY``): from its uid, so the
    same on each of its managers and another for any other dictionary."""
    return int(uid[:15], 16) or 1


def open_manager(
    spec: DictSpec, mid: int, restart_path: str | None, worker: str = "", term: int | None = 0
) -> tuple[Manager, bool, int]:
    """A manager over a new shard, or over the existing shard at ``restart_path``, served
    under ``term`` (``None``: the one in its shard, for a host process that re-opens it).

    Returns the manager, whether it re-attached a shard, and the fd of its
    owner lock (see :mod:`.hygiene`), which the caller keeps while it serves it.
    """
    opts = spec.options
    reattach = bool(restart_path) and os.path.isfile(os.path.join(str(restart_path), "data.mdb"))
    if reattach:
        assert restart_path is not None
        from ..transport.mapped import forget

        forget(restart_path)  # this process may map it as a client (a clone's pull)
        path = restart_path
    else:
        base = shard_directory()
        path = os.path.join(base, shard_name(spec.name, mid))
        check_room(base, ShardStore.map_size_for(spec.capacity))
        os.makedirs(path, mode=0o700)
    lock = hygiene.claim(path)
    kept = hygiene.kept_record(path) if reattach else None  # (kept again, by the same
    # orchestrator, if it cannot be opened)
    store = None
    try:
        store = ShardStore(
            path, spec.capacity, opts.manager_pool_full_thresh, indexed=opts.wait_for_keys
        )
        if reattach:
            store.check_stamp(mid)  # (a readable older stamp is renewed: it may now hold
        store.stamp(mid, 0 if term is None and not reattach else term)  # frames an older
        # version would misread)
        if not reattach:
            if config.get("store.reserve"):
                _reserve(store)
            with store.write() as txn:  # (every manager's: the versions of retiring
                store.put_meta(txn, HISTORY, str(history_of(spec.uid)).encode())  # ones)
        ws = WorkingSet(
            store,
            opts.working_set_size,
            wait_for_keys=opts.wait_for_keys,
            wait_for_writers=opts.wait_for_writers,
        )
        frozen = False
        if reattach:
            hygiene.mark_kept(path, False)
            # A shard whose window never moved has no saved state: it is at the start.
            state = WorkingSet.saved_state(store)
            if state is not None:
                mismatch = [
                    k
                    for k in ("size", "wait_for_keys", "wait_for_writers")
                    if state[k] != getattr(ws, k)
                ]
                if mismatch:
                    raise ValueError(
                        f"restart of {spec.name!r}: manager {mid} was created with a different "
                        f"{', '.join(mismatch)} (working_set_size/wait_for_keys/"
                        "wait_for_writers must match the original)"
                    )
                ws.load(state)
            frozen = Manager.saved_frozen(store)
            with store.write() as txn:  # clears the closed mark the last manager left
                ws.save(txn)
                key_counts.ensure(store, txn, ws.window)  # (shards of older versions had none)
                add_waiters(store, txn, 0)  # whoever waited, waited at the old process
        persister = None
        if opts.persist_path:
            from ..persist import Persister, persister_for  # (zarr: only the zarr persister's)

            kind = persister_for(opts.persister)
            if opts.restore_from is not None and not reattach:  # (reads only: a failed
                from ..persist.restorable import check_restorable  # restore writes nothing)

                check_restorable(
                    kind,
                    opts.persist_path,
                    spec.name,
                    mid,
                    spec.num_managers,
                    opts.restore_from,
                    spec.storage_options,
                )

            persister = Persister(
                kind(
                    opts.persist_path,
                    spec.name,
                    mid,
                    spec.num_managers,
                    chunk_bytes=config.get_bytes("persist.chunk-bytes"),
                    fsync=bool(config.get("persist.fsync")),
                    storage_options=spec.storage_options,
                ),
                opts.persist_freq,
                opts.persist_count,
            )
        from .cloning import pull_shard

        manager = Manager(
            mid,
            store,
            ws,
            worker=worker,
            read_only=opts.read_only,
            frozen=frozen,
            persister=persister,
            pull_shard=pull_shard,
        )
        manager.term = store.term()
        if reattach:
            manager.resume_persists()  # (what a dead host process accepted and left undone)
    except BaseException:
        if kept is not None:
            hygiene.mark_kept(path, record=kept or None)
        if store is not None:
            if reattach:
                store.close()
            else:
                store.destroy()
        elif not reattach:
            import shutil

            shutil.rmtree(path, ignore_errors=True)
        hygiene.release(lock)
        raise
    if opts.restore_from is not None and not reattach:
        try:
            manager.restore(
                opts.restore_from, discard_newer=not opts.read_only, history=history_of(spec.uid)
            )
        except BaseException:
            manager.close()
            hygiene.release(lock)
            raise
    return manager, reattach, lock
