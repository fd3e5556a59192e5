"""Who owns a shard or socket directory, and removing those whose owners are dead.

Every directory this package creates on a host (a shard in ``/dev/shm``, a
supervisor's socket directory in the temp directory) holds an ``owner.lock``
file on which each owning process keeps a shared ``flock``: the host process
that serves the shard, and the supervisor that would restart it.  The kernel
drops a lock when its holder dies, however it dies, so a directory whose lock
can be taken exclusively is *provably* abandoned.  A directory without the
lock file (another program's, or one being created) is never touched, and a
shard kept by ``destroy(allow_restart=True)`` carries a ``kept`` marker that
keeps it until a restart re-attaches it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil

from .. import config

logger = logging.getLogger(__name__)

PREFIX = "ddict-"
LOCK = "owner.lock"
KEPT = "kept"


def shard_directory() -> str:
    """Where this host keeps shards (``ddict.store.directory``, else ``/dev/shm``)."""
    return config.get("store.directory") or "/dev/shm"


def claim(directory: str) -> int:
    """Hold a shared owner lock on ``directory``; return the fd (close it to release).

    The lock file is created under a temporary name and renamed into place
    only once locked, so a sweeper never sees an unlocked ``owner.lock``.
    """
    path = os.path.join(directory, LOCK)
    if os.path.exists(path):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd
    tmp = os.path.join(directory, f".{LOCK}.{os.getpid()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.rename(tmp, path)
    return fd


def release(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def mark_kept(directory: str, kept: bool = True) -> None:
    """Mark a shard as kept for a restart (or no longer kept)."""
    path = os.path.join(directory, KEPT)
    if kept:
        with open(path, "w"):
            pass
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def is_kept(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, KEPT))


def is_abandoned(directory: str, kept: bool = False) -> bool:
    """Whether every process that owned ``directory`` is dead (and it is not kept, unless
    ``kept`` says that a kept one goes too)."""
    if not kept and is_kept(directory):
        return False
    try:
        fd = os.open(os.path.join(directory, LOCK), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # no lock file: not ours, or still being created
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # an owner lives
    finally:
        os.close(fd)
    return True


def sweep(base: str) -> list[str]:
    """Remove the abandoned ``ddict-*`` directories directly under ``base``."""
    try:
        names = os.listdir(base)
    except OSError:
        return []
    removed = [p for p in (os.path.join(base, n) for n in names) if _remove_abandoned(p, False)]
    if removed:
        logger.info("ddict: removed %d abandoned directories under %s", len(removed), base)
    return removed


def remove(paths: list[str], kept: bool = False) -> int:
    """Remove those of ``paths`` that are abandoned ``ddict-*`` directories (see
    :func:`is_abandoned`); return how many."""
    return sum(_remove_abandoned(p, kept) for p in paths)


def _remove_abandoned(path: str, kept: bool) -> bool:
    name = os.path.basename(path.rstrip("/"))
    if name.startswith(PREFIX) and os.path.isdir(path) and is_abandoned(path, kept):
        shutil.rmtree(path, ignore_errors=True)
        return True
    return False
