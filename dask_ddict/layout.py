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
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .options import DDictOptions


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


@dataclass(frozen=True)
class Layout:
    """A dictionary's identity, managers and options."""

    name: str
    uid: str  # unique per creation: a re-created name never matches stale state
    secret: str  # authenticates TCP connections to the managers
    tls: bool
    options: DDictOptions
    managers: tuple[ManagerInfo, ...]
    total_mem: int
    scheduler: str = ""
    epoch: int = 0
    creator: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_managers(self) -> int:
        return len(self.managers)

    @property
    def manager_workers(self) -> list[str]:
        return [m.worker for m in self.managers]

    def with_lost(self, supervisor: str) -> Layout:
        """The layout after ``supervisor`` (and so its host process) is gone."""
        managers = tuple(
            replace(m, lost=True) if m.supervisor == supervisor else m for m in self.managers
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
        d["managers"] = [asdict(m) for m in self.managers]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        d = dict(d)
        d["options"] = DDictOptions.from_dict(d["options"])
        d["managers"] = tuple(ManagerInfo(**m) for m in d["managers"])
        return cls(**d)

    def serialize(self) -> str:
        """A printable string from which any process can attach."""
        raw = json.dumps(self.to_dict(), separators=(",", ":")).encode()
        return "ddict1:" + base64.urlsafe_b64encode(raw).decode()

    @classmethod
    def deserialize(cls, s: str) -> Layout:
        if not isinstance(s, str) or not s.startswith("ddict1:"):
            raise ValueError("not a serialized DDict (expected a string from DDict.serialize())")
        try:
            return cls.from_dict(json.loads(base64.urlsafe_b64decode(s[7:].encode())))
        except Exception as e:
            raise ValueError(f"corrupt serialized DDict: {e}") from None


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
