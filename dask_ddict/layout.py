"""Layout: where a dictionary's managers live and how to reach them.

The orchestrator builds a :class:`Layout` at creation and hands it to every
client.  It is all a client needs to talk to the managers directly, so it is
also the content of :meth:`DDict.serialize`: attaching from a serialized
string needs no scheduler round trip at all, and a pickled handle re-attaches
inside a task for free.  ``epoch`` increases whenever the orchestrator changes
the layout (e.g. a manager's worker is lost).
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .options import DDictOptions
from .placement import Policy, as_policy

_PREFIX = "ddict3:"  # 3: hash probes in the layout, not per manager


def _checksum(raw: bytes) -> str:
    return hashlib.blake2b(raw, digest_size=16, person=b"ddict-layout").hexdigest()


@dataclass(frozen=True)
class ManagerInfo:
    """How to reach one manager."""

    manager_id: int
    worker: str  # the worker it is hosted for (locality); the key path never uses it
    hostname: str
    host_id: str  # hostname + boot id: equal iff same machine (and so same /dev/shm)
    pid: int  # the supervisor's: alive iff the manager is served or being restarted
    uds_path: str
    tcp_host: str
    tcp_port: int
    store_path: str
    lost: bool = False
    restarted: bool = False  # re-attached a shard kept by destroy(allow_restart=True)
    supervisor: str = ""  # address of the nanny (or nanny-less worker) that supervises its host
    lost_why: str = ""  # why its host is gone, as the orchestrator knows it (when lost)
    #: Lost but kept: no worker could take it when its host left, so its shard waits in
    #: its machine's shared memory for a worker there (see ``cluster.elastic``).
    parked: bool = False
    #: Moves on with every change of the host process that serves it (a move, a failover,
    #: an adoption): a host serves it under the term it was given, and learns from its
    #: lease's renewals that a newer term exists elsewhere (see ``cluster.leases``).
    term: int = 0
    #: The placement policy it was created under (``None``: any worker): it moves, is
    #: adopted and is replicated only where a worker satisfies it (``placement``).
    policy: Policy | None = None

    def __post_init__(self) -> None:
        if self.policy is not None and not isinstance(self.policy, Policy):
            object.__setattr__(self, "policy", as_policy(self.policy))  # (its to_dict form)

    @property
    def address(self) -> tuple[str, str, int]:
        """The address of the host process that serves it (its sockets)."""
        return (self.uds_path, self.tcp_host, self.tcp_port)


@dataclass(frozen=True)
class Layout:
    """A dictionary's identity, managers and options."""

    name: str
    uid: str  # unique per creation: a re-created name never matches stale state
    secret: str = field(repr=False)  # authenticates the key path: never printed
    tls: bool
    options: DDictOptions
    managers: tuple[ManagerInfo, ...]
    total_mem: int
    scheduler: str = ""
    epoch: int = 0
    creator: str = ""
    lifetime: str = "client"  # "client": released with its holders; "cluster": until destroy()
    extra: dict[str, Any] = field(default_factory=dict)
    #: The distinct ``hash()`` of :data:`~dask_ddict._hashing.HASH_PROBE` in the cluster's
    #: workers (where tasks place keys), for the hash-seed check; empty: not known.
    hash_probes: tuple[int, ...] = ()
    #: The workers' ``PYTHONHASHSEED`` when they all name the same one: a hint for the
    #: warning's remedy, never used to decide.
    hash_seed: str = ""

    @property
    def num_managers(self) -> int:
        return len(self.managers)

    @property
    def manager_workers(self) -> list[str]:
        return [m.worker for m in self.managers]

    def with_lost(self, supervisor: str, why: str = "", only: list[int] | None = None) -> Layout:
        """The layout after ``supervisor`` (and so its host process) is gone, ``why``
        (``only``: those of its managers; the others' replicas take over)."""
        managers = tuple(
            replace(m, lost=True, lost_why=why)
            if m.supervisor == supervisor and not m.lost and (only is None or m.manager_id in only)
            else m
            for m in self.managers
        )
        return replace(self, managers=managers, epoch=self.epoch + 1)

    def with_worker(self, supervisor: str, worker: str) -> Layout:
        """The layout after ``supervisor``'s worker restarted at a new address."""
        managers = tuple(
            replace(m, worker=worker) if m.supervisor == supervisor else m for m in self.managers
        )
        return replace(self, managers=managers, epoch=self.epoch + 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["managers"] = [
            {**asdict(m), "policy": None if m.policy is None else m.policy.to_dict()}
            for m in self.managers
        ]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        d = dict(d)
        d["options"] = DDictOptions.from_dict(d["options"])
        d["managers"] = tuple(ManagerInfo(**m) for m in d["managers"])
        d["hash_probes"] = tuple(d.get("hash_probes", ()))
        return cls(**d)

    def serialize(self) -> str:
        """A printable string from which any process can attach.

        ``ddict3:<base64 JSON>.<checksum>``: the checksum (BLAKE2b of the JSON)
        makes an edited or truncated string fail at attach instead of reading
        the wrong shards.
        """
        raw = json.dumps(self.to_dict(), separators=(",", ":")).encode()
        return f"{_PREFIX}{base64.urlsafe_b64encode(raw).decode()}.{_checksum(raw)}"

    @classmethod
    def deserialize(cls, s: Any) -> Layout:
        """The layout in a :meth:`serialize` string, checked before any use.

        Raises
        ------
        TypeError
            ``serialized`` is not a string.
        ValueError
            It is not from :meth:`serialize`, was altered, or describes an
            impossible layout (no managers, ids out of order, shared shards).
        """
        if not isinstance(s, str):
            raise TypeError(
                f"serialized must be a str from DDict.serialize(), got {type(s).__name__}"
            )
        if s.startswith(("ddict1:", "ddict2:")):
            raise ValueError(
                f"serialized is a handle of an older dask_ddict (format {s[5]}): "
                "re-create or re-attach the dictionary with this version"
            )
        body, _, digest = s[len(_PREFIX) :].rpartition(".")
        if not s.startswith(_PREFIX) or not body:
            raise ValueError(
                "serialized is not a DDict handle (expected DDict.serialize()'s string)"
            )
        try:
            raw = base64.urlsafe_b64decode(body.encode())
        except Exception:
            raise ValueError("serialized DDict handle is not valid base64") from None
        if _checksum(raw) != digest:
            raise ValueError("serialized DDict handle was altered or truncated (checksum mismatch)")
        try:
            layout = cls.from_dict(json.loads(raw))
        except Exception as e:
            raise ValueError(f"serialized DDict handle is malformed: {e}") from None
        layout.check()
        return layout

    def check(self) -> None:
        """Raise ``ValueError`` for a layout no orchestrator builds."""
        if not self.managers:
            raise ValueError(f"DDict {self.name!r}: the layout has no managers")
        ids = [m.manager_id for m in self.managers]
        if ids != list(range(len(ids))):
            raise ValueError(f"DDict {self.name!r}: manager ids {ids} are not 0..{len(ids) - 1}")
        paths = [m.store_path for m in self.managers]
        if len(set(paths)) != len(paths):
            raise ValueError(f"DDict {self.name!r}: two managers name the same shard")


#: A term on the wire: its 15 low bits, and the top bit set (0: a request without one).
_TERM_BITS, _TERM_SET = 0x7FFF, 0x8000


def wire_term(term: int) -> int:
    """A manager's term (``ManagerInfo.term``) as a request carries it (16 bits)."""
    return (term & _TERM_BITS) | _TERM_SET


def term_is_newer(sent: int, served: int) -> bool:
    """Whether a request's wire term ``sent`` is newer than ``served`` (both from
    :func:`wire_term`): serial numbers over 15 bits, as TCP's sequence numbers (a client
    more than 16,383 changes of one manager behind is taken as ahead: it asks the
    orchestrator once, and is right again)."""
    return 0 < ((sent - served) & _TERM_BITS) < 0x4000


def host_id() -> str:
    """Identity of this machine: hostname plus kernel boot id.

    Two processes with the same host id share ``/dev/shm`` and can use the
    same-host paths; the boot id tells apart containers or VMs that happen to
    share a hostname.
    """
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"
