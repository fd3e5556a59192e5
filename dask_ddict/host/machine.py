"""The machine a host supervisor runs on, as the orchestrator asks about it.

Three questions, each answered by looking now rather than by anything remembered:

* :func:`identity`: which machine this is and how much memory it has (a supervisor's
  ``ddict_host_info``, where the orchestrator learns how to reach its host);
* :func:`memory`: what the sizing check (:mod:`dask_ddict.cluster.sizing`) needs of
  the memory right after a creation opened its shards: measured, not computed, so that
  it sees what really is there;
* :func:`probe`: whether this machine sees a file another machine wrote under a
  persist path (a move to another machine needs the persist path to be shared).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable
from typing import Any

from ..layout import host_id
from .hygiene import shard_directory


def identity() -> dict[str, Any]:
    """This machine's ``host_id`` and ``hostname``, and its total ``memory`` (0: unknown)."""
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except Exception:
        total = 0
    return {"host_id": host_id(), "hostname": socket.gethostname(), "memory": total}


def memory(shards: Iterable[tuple[int, str]]) -> dict[str, int]:
    """This machine's memory as the orchestrator's sizing check needs it, measured now,
    for the shards a supervisor serves (``(capacity, path)`` each).

    ``memory`` and ``available`` are the machine's (``psutil``), ``shard_dir_free`` the
    free bytes of the shard directory (``/dev/shm``: its tmpfs size, not the RAM),
    ``shard_bytes`` the size of every shard given and ``unbacked`` the part of it that
    holds no memory yet: nothing when shards are reserved at creation
    (``ddict.store.reserve``), else what their writes will still take.
    """
    import psutil

    vm = psutil.virtual_memory()
    st = os.statvfs(shard_directory())
    shard_bytes = unbacked = 0
    for capacity, path in shards:
        try:
            allocated = os.stat(os.path.join(path, "data.mdb")).st_blocks * 512
        except OSError:  # removed meanwhile
            continue
        shard_bytes += capacity
        unbacked += max(0, capacity - allocated)
    return {
        "memory": int(vm.total),
        "available": int(vm.available),
        "shard_dir_free": st.f_bavail * st.f_frsize,
        "shard_bytes": shard_bytes,
        "unbacked": unbacked,
    }


def probe(directory: str, token: str, step: str) -> bool:
    """Whether this machine sees what another wrote in ``directory`` (a persist path):
    ``step`` "leave" writes a probe file named by ``token``, "find" says whether it is
    there, "clear" removes it."""
    path = os.path.join(directory, f".ddict-probe-{token}")
    if step == "leave":
        os.makedirs(directory, exist_ok=True)
        with open(path, "w"):
            pass
        return True
    if step == "clear":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return True
    return os.path.exists(path)
