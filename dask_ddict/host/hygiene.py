"""Who owns a shard or socket directory, and removing those whose owners are gone.

Every directory this package creates on a host (a shard in ``/dev/shm``, a
supervisor's socket directory in the temp directory) holds an ``owner.lock``
file on which each owning process keeps a shared ``flock``: the host process
that serves the shard, and the supervisor that would restart it.  The kernel
drops a lock when its holder dies, however it dies, so a directory whose lock
can be taken exclusively is *provably* abandoned.  A directory without the
lock file (another program's, or one being created) is never touched.  The sweeper
holds that exclusive lock while it removes the directory, and a claim that waited for
it finds its lock file gone and fails (:func:`claim`): a shard is never removed under
a process that claimed it.  A shard that passes from one owner to the next (a copy
received, a replica promoted) is claimed by the next before the last lets it go.

A shard that no process serves may still be *kept*, with a ``kept`` marker: for
a restart (``destroy(allow_restart=True)``), parked (no worker could take it),
or kept aside (a deposed primary, until the orchestrator discards it).  What
keeps it alive is then not a process on this machine but the orchestrator, whose
registry alone can ever serve it again: the marker records that orchestrator
(:func:`keeper`: its scheduler's address), and a shard whose orchestrator is gone,
or no longer knows it, is an orphan that :func:`sweep_kept` removes.  See
:func:`keeper_states` for how "gone" is decided.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import ipaddress
import json
import logging
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import config
from ..layout import host_id

logger = logging.getLogger(__name__)

PREFIX = "ddict-"
LOCK = "owner.lock"
#: A directory being removed (renamed out of its name first: see ``_remove_abandoned``).
REMOVING = ".removing-"
KEPT = "kept"

#: Why a shard is kept (its marker's ``why``): for a restart, parked, or kept aside.
RESTART, PARKED, ASIDE = "restart", "parked", "aside"
#: What :func:`keeper_states` found of a kept shard's orchestrator: it lives and keeps
#: the shard; it is gone (or lives on without knowing the shard: nothing will ever
#: serve it again); or it cannot be told (no answer in time, an older marker that
#: names nobody, an address this process cannot reach).  Only ``GONE`` is swept.
ALIVE, GONE, UNKNOWN = "alive", "gone", "unknown"
#: The orchestrator's handler that says which shards it still keeps (see
#: ``DDictSchedulerPlugin.knows_shards``).
KNOWS = "ddict_knows_shards"


def shard_directory() -> str:
    """Where this host keeps shards (``ddict.store.directory``, else ``/dev/shm``)."""
    return config.get("store.directory") or "/dev/shm"


def claim(directory: str) -> int:
    """Hold a shared owner lock on ``directory``; return the fd (close it to release).

    The lock file is created under a temporary name and renamed into place
    only once locked, so a sweeper never sees an unlocked ``owner.lock``.  A claim
    that meets a sweeper removing the directory waits for it, then raises
    ``FileNotFoundError`` naming the directory: it was abandoned, and is gone.
    """
    path = os.path.join(directory, LOCK)
    if os.path.exists(path):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if not _same_file(fd, path):  # (removed while this claim waited for its lock)
                raise FileNotFoundError(
                    errno.ENOENT, "removed as abandoned while it was being claimed", directory
                )
        except BaseException:
            os.close(fd)
            raise
        return fd
    tmp = os.path.join(directory, f".{LOCK}.{os.getpid()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def release(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def mark_kept(directory: str, kept: bool = True, record: dict[str, Any] | None = None) -> None:
    """Mark a shard as kept (or no longer kept): for a restart, parked, or kept aside.

    ``record`` (see :func:`keeper`) says who keeps it and why; a sweep reads it to tell
    whether that orchestrator is gone.  Without one, a marker that exists keeps what it
    says (a host process marks its shard first, and its supervisor, which knows the
    orchestrator, then says whose it is), and a new one is empty: a keeper unknown, so
    never swept.  The record is written under a temporary name and renamed into place,
    so a reader never sees half of one.
    """
    path = os.path.join(directory, KEPT)
    if not kept:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    elif record is None:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    else:
        tmp = os.path.join(directory, f".{KEPT}.{os.getpid()}.{threading.get_ident()}")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.rename(tmp, path)


def is_kept(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, KEPT))


def kept_record(directory: str) -> dict[str, Any] | None:
    """What ``directory``'s kept marker says (``{}``: nothing, e.g. an older marker, or
    one whose keeper is about to be written); ``None`` if it is not kept."""
    try:
        with open(os.path.join(directory, KEPT)) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        record = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def keeper(scheduler: str, why: str, name: str, uid: str, manager: int) -> dict[str, Any]:
    """The record of a kept shard's marker: ``why`` it is kept (:data:`RESTART`,
    :data:`PARKED`, :data:`ASIDE`), whose it is (dictionary ``name``, ``uid``,
    ``manager``), and the orchestrator that keeps it.

    The orchestrator is named by its ``scheduler``'s address: its registry, in that
    scheduler's memory, is the only thing that can ever serve the shard again, so
    the shard lives exactly as long as that scheduler keeps it, wherever it runs (a
    process on this machine or elsewhere).  A scheduler without an address that other
    processes reach (an in-process cluster, ``""``) runs in this very process: the
    record names this process then (pid and start time, which a reused pid does not
    share).
    """
    record: dict[str, Any] = {
        "why": why,
        "name": name,
        "uid": uid,
        "manager": int(manager),
        "scheduler": scheduler,
        "host_id": host_id(),
        "since": time.time(),
    }
    if not scheduler and _scheduler_in_process():
        record["pid"], record["started"] = os.getpid(), _started(os.getpid())
    return record


def _scheduler_in_process() -> bool:
    module = sys.modules.get("distributed.scheduler")
    return module is not None and any(True for _ in list(module.Scheduler._instances))


def _started(pid: int) -> float | None:
    try:
        import psutil

        return round(psutil.Process(pid).create_time(), 2)
    except Exception:  # noqa: BLE001 - gone, or not ours to see
        return None


def is_abandoned(directory: str, kept: bool = False) -> bool:
    """Whether every process that owned ``directory`` is dead (and it is not kept, unless
    ``kept`` says that a kept one goes too)."""
    with _abandoned(directory, kept) as abandoned:
        return abandoned


@contextlib.contextmanager
def _abandoned(directory: str, kept: bool) -> Iterator[bool]:
    """Whether ``directory`` is abandoned (:func:`is_abandoned`), its owner lock held
    exclusively while the block runs if it is: no process claims it meanwhile."""
    try:
        fd = os.open(os.path.join(directory, LOCK), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        yield False  # no lock file: not ours, or still being created
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False  # an owner lives
            return
        yield kept or not is_kept(directory)  # (marked by its last owner before it went)
    finally:
        os.close(fd)


def sweep(base: str) -> list[str]:
    """Remove the abandoned ``ddict-*`` directories directly under ``base`` (not kept
    ones: see :func:`sweep_kept`)."""
    try:
        names = os.listdir(base)
    except OSError:
        return []
    for n in names:  # (a removal that a process's death cut short: nobody's any more)
        if n.startswith(REMOVING + PREFIX):
            shutil.rmtree(os.path.join(base, n), ignore_errors=True)
    removed = [p for p in (os.path.join(base, n) for n in names) if _remove_abandoned(p, False)]
    if removed:
        logger.info("ddict: removed %d abandoned directories under %s", len(removed), base)
    return removed


def remove(paths: list[str], kept: bool = False) -> int:
    """Remove those of ``paths`` that are abandoned ``ddict-*`` directories (see
    :func:`is_abandoned`); return how many."""
    return sum(_remove_abandoned(p, kept) for p in paths)


def _remove_abandoned(
    path: str, kept: bool, record: dict[str, Any] | None = None, whys: tuple[str, ...] = ()
) -> bool:
    """Remove ``path`` if it is an abandoned ``ddict-*`` directory, holding its owner lock
    exclusively while it goes: a process that claims it meanwhile waits, then fails.
    ``record``: a kept shard's marker as its keeper was asked about (a shard kept again
    since, by another keeper, stays); ``whys``: only a shard unmarked or kept for one of
    these."""
    name = os.path.basename(path.rstrip("/"))
    if not name.startswith(PREFIX) or not os.path.isdir(path):
        return False
    with _abandoned(path, kept) as abandoned:
        if not abandoned or (record is not None and kept_record(path) != record):
            return False
        if whys and (kept_record(path) or {}).get("why", "") not in ("", *whys):
            return False
        return _remove_held(path)


def remove_aside(path: str) -> bool:
    """Remove the shard that a deposed primary kept aside at ``path``, unless a process
    claims it or it is kept for another reason now (parked, for a restart): a manager
    that moved to another host process of this machine was not copied, so its new host
    may serve that very shard.  Whether it went."""
    return _remove_abandoned(path, True, whys=(ASIDE,))


def _remove_held(path: str) -> bool:
    """Remove ``path``, whose owner lock the caller holds exclusively."""
    # out of its name first: a claim after this finds no directory (rmtree may take
    # the lock file before the shard's), one before it fails once the lock is let go
    name = os.path.basename(path.rstrip("/"))
    gone = os.path.join(os.path.dirname(path.rstrip("/")), f"{REMOVING}{name}.{os.getpid()}")
    try:
        os.rename(path, gone)
    except OSError:
        return False
    shutil.rmtree(gone, ignore_errors=True)
    return True


# -- kept shards: who keeps them, whether it still does --------------------------------


@dataclass(frozen=True)
class KeptShard:
    """A kept shard on this machine, as its directory and marker say."""

    path: str
    name: str
    manager: int | None
    why: str  # RESTART, PARKED, ASIDE, or "" (an older marker)
    nbytes: int  # the memory its files hold (a tmpfs's pages)
    in_use: bool  # a process holds its owner lock: it is served (or being opened)
    record: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def keeper(self) -> str:
        """The orchestrator that keeps it, in words."""
        if self.record.get("scheduler"):
            return str(self.record["scheduler"])
        if self.record.get("pid"):
            return f"in-process (pid {self.record['pid']})"
        return "unknown"


def kept_shards(base: str) -> list[KeptShard]:
    """The kept shards directly under ``base`` (``ddict-*`` directories with an owner
    lock and a kept marker), by path."""
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    found = []
    for n in names:
        path = os.path.join(base, n)
        if not n.startswith(PREFIX) or not os.path.isfile(os.path.join(path, LOCK)):
            continue
        record = kept_record(path)
        if record is None:
            continue
        name, manager = _named(n)
        in_use = not is_abandoned(path, kept=True)
        found.append(
            KeptShard(
                path,
                str(record.get("name", name)),
                record.get("manager", manager),
                str(record.get("why", "")),
                _allocated(path),
                in_use,
                record,
            )
        )
    return found


def _named(directory: str) -> tuple[str, int | None]:
    """A shard directory's dictionary name (as made safe for a file name) and manager,
    from its name (``ddict-<name>-<manager>-<random>``)."""
    parts = directory[len(PREFIX) :].rsplit("-", 2)
    if len(parts) == 3 and parts[1].isdigit():
        return parts[0], int(parts[1])
    return directory[len(PREFIX) :], None


def _allocated(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, f)).st_blocks * 512
    return total


def keeper_states(
    shards: Iterable[KeptShard], security: Any = None, timeout: float | None = None
) -> dict[str, str]:
    """Whether each kept shard's orchestrator still keeps it: path -> :data:`ALIVE`,
    :data:`GONE` or :data:`UNKNOWN`.

    A shard is kept by the scheduler its marker names, for as long as that scheduler's
    registry knows it: no other process can ever serve it again (a new scheduler,
    even at the same address, has a registry of its own).  So it is

    * ``GONE`` when that scheduler's process is gone: nothing listens at its address
      on this machine (read from the kernel's socket table, no connection made), or a
      connection to it is refused; also when a scheduler answers there that does not
      keep the shard (a later one at the same address, or the same one once it
      destroyed or forgot the dictionary).  One question per scheduler, over Dask's
      own comms (TLS with ``security``);
    * ``ALIVE`` when it answers that it keeps it (a parked manager, a dictionary kept
      for a restart, a deposed shard it has not discarded yet), or when it runs in a
      process of this machine that is still alive (the record's pid and start time);
    * ``UNKNOWN`` otherwise: no answer within ``timeout`` (a partition, a stopped or
      powered-off machine), an address this process cannot use, or a marker that names
      nobody (written by an older version).  Those are never swept: better a shard
      kept too long than a parked manager lost while its cluster lives.

    A process id alone was not enough (a scheduler may run on another machine, and
    pids are reused), nor a lock file held by the scheduler (it only works on the
    scheduler's own machine); the scheduler's address and its own word work for both,
    and a scheduler that was SIGKILLed leaves its port closed.
    """
    states: dict[str, str] = {}
    asking: dict[str, list[KeptShard]] = {}
    here = host_id()
    for s in shards:
        r = s.record
        if r.get("scheduler"):
            asking.setdefault(str(r["scheduler"]), []).append(s)
        elif r.get("pid") and r.get("host_id") == here:
            alive = r.get("started") is not None and _started(int(r["pid"])) == r["started"]
            states[s.path] = ALIVE if alive else GONE
        else:
            states[s.path] = UNKNOWN
    if timeout is None:
        timeout = config.get_seconds("host.probe-timeout") or 3.0
    for address, theirs in asking.items():
        said = _ask_keeper(address, here, theirs, security, timeout)
        for s in theirs:
            states[s.path] = said if isinstance(said, str) else ALIVE if s.path in said else GONE
    return states


def _ask_keeper(
    address: str, here: str, shards: list[KeptShard], security: Any, timeout: float
) -> str | set[str]:
    """The paths of ``shards`` that the scheduler at ``address`` keeps, or :data:`GONE` /
    :data:`UNKNOWN` (see :func:`keeper_states`)."""
    try:
        from distributed.comm import get_address_host_port, parse_address

        scheme, _ = parse_address(address)
        host, port = get_address_host_port(address)
    except Exception:  # noqa: BLE001 - an address Dask cannot read
        return UNKNOWN
    if scheme not in ("tcp", "tls"):
        return UNKNOWN
    if _local(host) and not _listening(host, port):
        return GONE  # (its process is gone: a scheduler listens as long as it lives)
    try:
        return asyncio.run(_knows(address, here, shards, security, timeout))
    except OSError as e:
        refused = isinstance(e, ConnectionRefusedError)
        while e.__cause__ is not None and not refused:  # (Dask's connect wraps it)
            e = e.__cause__  # type: ignore[assignment]
            refused = isinstance(e, ConnectionRefusedError)
        return GONE if refused else UNKNOWN
    except Exception as e:  # noqa: BLE001 - no answer, a refused handshake (TLS)
        logger.debug("ddict: asking %s about kept shards: %r", address, e)
        return UNKNOWN


async def _knows(
    address: str, here: str, shards: list[KeptShard], security: Any, timeout: float
) -> str | set[str]:
    from distributed import Security
    from distributed.comm import connect

    args = (security or Security()).get_connection_args("client")
    comm = await connect(address, timeout=timeout, **args)
    try:
        asked = [[s.path, str(s.record.get("uid", ""))] for s in shards]
        await comm.write({"op": KNOWS, "host_id": here, "shards": asked, "reply": True})
        answer = await asyncio.wait_for(comm.read(), timeout)
    finally:
        await comm.close()
    if not isinstance(answer, (list, tuple)):  # (an error reply: not ours to judge)
        return UNKNOWN
    return {str(p) for p in answer}


def _local(host: str) -> bool:
    """Whether ``host`` (an address's host) is this machine (an interface of it)."""
    try:
        ip = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return False
    if ip.is_loopback:
        return True
    try:
        import psutil

        mine = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    except Exception:  # noqa: BLE001 - cannot tell: ask over the network
        return False
    return str(ip) in mine


def _listening(host: str, port: int) -> bool:
    """Whether a socket of this machine listens on ``host:port`` (the kernel's table, as
    ``ss -l`` reads it: whoever owns it, and no connection made, which a live scheduler
    would log); ``True`` when that cannot be read (then it is asked)."""
    try:
        import psutil

        conns = psutil.net_connections("tcp")
    except Exception:  # noqa: BLE001 - not readable here
        return True
    ip = socket.gethostbyname(host)
    return any(
        c.status == psutil.CONN_LISTEN
        and c.laddr
        and c.laddr.port == port
        and c.laddr.ip in (ip, "0.0.0.0", "::", "::ffff:" + ip)
        for c in conns
    )


def sweep_kept(
    base: str, security: Any = None, timeout: float | None = None, only: Iterable[str] | None = None
) -> list[KeptShard]:
    """Remove the kept shards under ``base`` whose orchestrator is gone (see
    :func:`keeper_states`) and that no process holds; return them.

    Parked shards of a cluster that ended without closing (a script SIGKILLed while
    a manager waited for a worker, a scheduler that crashed) and shards kept for a
    restart by a scheduler that is gone would otherwise hold their memory until the
    machine reboots.  ``only``: of these paths alone.
    """
    wanted = None if only is None else set(only)
    shards = [s for s in kept_shards(base) if not s.in_use and (wanted is None or s.path in wanted)]
    if not shards:
        return []
    states = keeper_states(shards, security, timeout)
    removed = [
        s
        for s in shards
        if states.get(s.path) == GONE and _remove_abandoned(s.path, True, s.record)
    ]
    for s in removed:
        logger.info(
            "ddict: removed the %s shard of manager %s of %r (%s, %d bytes): its "
            "orchestrator (%s) is gone or no longer keeps it",
            s.why or "kept",
            s.manager,
            s.name,
            s.path,
            s.nbytes,
            s.keeper,
        )
    return removed
