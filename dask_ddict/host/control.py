"""Control messages between a supervisor and its host process, over a pipe.

The pipe is the host process's stdin (requests) and stdout (replies), so it
is private to the two processes and carries the dictionaries' secrets, which
therefore never appear in a command line.  The host process reads EOF on its
stdin when the supervisor is gone, however it ended, and shuts down.

Each message is a frozen dataclass, framed as ``[u64 length][pickle]``: both
ends are this package, started by the same user, so pickle is safe here.
Replies are ``(True, value)`` or ``(False, exception)``.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from .. import config
from ..options import DDictOptions

_LEN = struct.Struct("<Q")


@dataclass(frozen=True)
class DictSpec:
    """What a host process needs to serve a dictionary's managers (sent over its pipe)."""

    name: str
    uid: str
    secret: str
    options: DDictOptions
    capacity: int
    num_managers: int
    storage_options: dict[str, Any] | None = None  # fsspec credentials: never printed

    def __repr__(self) -> str:  # never print the secret or the storage options
        return f"DictSpec(name={self.name!r}, uid={self.uid!r}, managers={self.num_managers})"

    def to_wire(self) -> dict[str, Any]:
        """As plain data, for a control call through the scheduler (a replica's seed)."""
        return {
            **{f: getattr(self, f) for f in self.__dataclass_fields__},
            "options": self.options.to_dict(),
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> DictSpec:
        return cls(**{**d, "options": DDictOptions.from_dict(d["options"])})


@dataclass(frozen=True)
class Init:
    """First message to a new incarnation of the host process."""

    security: Any  # distributed.Security (certificates for TLS), or None
    supervisor_pid: int
    socket_dir: str
    tls: bool = False  # serve TCP over TLS (the cluster's comms use TLS)
    closed: tuple[str, ...] = ()  # uids destroyed on this host: their clients get CLOSED
    config: dict[str, Any] = field(default_factory=dict)  # the supervisor's ddict.* settings
    restarts: int = 0  # how many incarnations the supervisor restarted (the managers' stats)
    #: The orchestrator that grants the host's lease (the scheduler's address; "": none
    #: this process can reach), and the address that names this host to it.
    scheduler: str = ""
    supervisor: str = ""
    #: Deposed primaries' shards kept aside: (uid, manager, path), see ``lease``.
    aside: tuple[tuple[str, int, str], ...] = ()


@dataclass(frozen=True)
class OpenManagers:
    """Serve managers ``manager_ids`` of a dictionary (re-attaching ``restart_paths``)."""

    spec: DictSpec
    manager_ids: tuple[int, ...]
    restart_paths: dict[int, str] = field(default_factory=dict)
    worker: str = ""
    #: The term they are served under (``ManagerInfo.term``); ``None``: the one in each
    #: shard (a new incarnation re-opening them).
    term: int | None = 0


@dataclass(frozen=True)
class CloseManagers:
    """Stop serving a dictionary; keep its shards when ``allow_restart``."""

    uid: str
    allow_restart: bool = False


@dataclass(frozen=True)
class MoveOut:
    """Pause manager ``manager_id`` of ``uid`` for a move (``copy``: to another machine)."""

    uid: str
    manager_id: int
    copy: bool


@dataclass(frozen=True)
class MoveIn:
    """Serve a moving manager: over its shard at ``path`` (same machine), or over a copy
    received from ``source`` (the old place's :class:`~dask_ddict.layout.ManagerInfo`
    fields) of ``used`` bytes in a map of ``map_size`` (into the file that
    :class:`MovePrepare` made at ``path``, if one is given)."""

    spec: DictSpec
    manager_id: int
    worker: str = ""
    path: str = ""
    source: dict[str, Any] | None = None
    used: int = 0
    map_size: int = 0
    term: int = 0


@dataclass(frozen=True)
class MovePrepare:
    """Make room for a copy of manager ``manager_id`` of dictionary ``name`` before its
    move pauses it: the file of a shard of ``capacity`` bytes whose first ``nbytes``
    (about what it uses now) are allocated and mapped already.  Returns its path."""

    name: str
    manager_id: int
    capacity: int
    nbytes: int


@dataclass(frozen=True)
class MoveDone:
    """Manager ``manager_id`` of ``uid`` serves at ``where`` now: stop serving it here
    (``park``: nowhere; keep its shard for a worker on this machine to take)."""

    uid: str
    manager_id: int
    where: str
    park: bool = False


@dataclass(frozen=True)
class MoveAbort:
    """The move of ``manager_id`` failed: resume its writes here."""

    uid: str
    manager_id: int


@dataclass(frozen=True)
class ShardBytes:
    """The used bytes of each manager of ``uid`` served here (what a move would copy)."""

    uid: str


@dataclass(frozen=True)
class ReplicaHold:
    """Pause manager ``manager_id`` of ``uid`` while a new replica copies its shard."""

    uid: str
    manager_id: int


@dataclass(frozen=True)
class ReplicaSeed:
    """Keep a replica of manager ``manager_id``: its shard copied from ``source`` (the
    primary's layout fields; held), ``used`` bytes of a map of ``map_size``."""

    spec: DictSpec
    manager_id: int
    source: dict[str, Any]
    used: int
    map_size: int


@dataclass(frozen=True)
class ReplicaTargets:
    """Change manager ``manager_id``'s replicas: ``add`` one (its host's layout fields),
    ``remove`` those at these host addresses; ``release`` ends a :class:`ReplicaHold`."""

    spec: DictSpec
    manager_id: int
    add: dict[str, Any] | None = None
    remove: tuple[Any, ...] = ()
    release: bool = False


@dataclass(frozen=True)
class ReplicaDrop:
    """Stop keeping the replica of manager ``manager_id`` of ``uid`` here."""

    uid: str
    manager_id: int


@dataclass(frozen=True)
class ReplicaPromote:
    """Serve manager ``manager_id`` over the replica kept here: its primary is lost
    (``old_path``, its shard: removed if it is on this machine)."""

    spec: DictSpec
    manager_id: int
    worker: str = ""
    old_path: str = ""
    term: int = 0


@dataclass(frozen=True)
class Serve:
    """Start accepting connections (the managers are open)."""


@dataclass(frozen=True)
class Shutdown:
    """Close every manager, delete their shards, exit."""


@dataclass(frozen=True)
class Ping:
    """Answer with the host process's pid."""


# -- notices: from the host process to its supervisor (a pipe of their own) ----------------


@dataclass(frozen=True)
class Deposed:
    """The host stopped serving manager ``manager_id`` of ``uid`` for good (the
    orchestrator serves it elsewhere); its shard at ``path`` is kept aside."""

    uid: str
    manager_id: int
    path: str


@dataclass(frozen=True)
class Discarded:
    """The orchestrator let the host delete the shard it kept aside for ``manager_id``."""

    uid: str
    manager_id: int


def answer_within(msg: Any) -> float | None:
    """Seconds a supervisor waits for the answer to ``msg`` (``None``: no limit); a host
    that does not answer in time is killed (:mod:`.pipe`), so this is the most any
    healthy host may take.

    ``ddict.host.start-timeout`` for most messages; ``ddict.move.timeout`` more for the
    steps of a move or a new replica that move a shard's bytes (a copy from another
    host, the room made for one: each gives up after ``move.timeout`` itself, and a shard
    of gigabytes over a slow link may need most of it); no limit for what waits on
    storage as long as it takes (a dictionary's close, which waits for its persists; an
    opening that restores a checkpoint), where killing the host would cut that short.
    """
    if isinstance(msg, CloseManagers) or (
        isinstance(msg, OpenManagers) and msg.spec.options.restore_from is not None
    ):
        return None
    wait = config.get_seconds("host.start-timeout")
    moving = isinstance(msg, (ReplicaSeed, MovePrepare)) or (
        isinstance(msg, MoveIn) and msg.source is not None
    )
    if wait is None or not moving:
        return wait
    more = config.get_seconds("move.timeout")
    return None if more is None else wait + more


def send(f: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=5)
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


def read_message(read: Callable[[int], bytes]) -> Any:
    """The next message from ``read(n)`` (which returns up to ``n`` bytes), or ``None`` at EOF."""
    head = read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    data = read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


def recv(f: BinaryIO) -> Any:
    """The next message from a file, or ``None`` at EOF."""
    return read_message(f.read)
