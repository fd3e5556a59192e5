"""Calling a shard's :class:`~dask_ddict.shard.manager.Manager` with plain keys and values.

A manager takes a key's digest and canonical bytes and a value's frames (the client
made them); tests of the manager alone, without a client, make them here.
"""

from __future__ import annotations

from typing import Any

from dask_ddict._hashing import key_digest
from dask_ddict._keys import dumps_key
from dask_ddict._serialize import dumps_value, loads_value
from dask_ddict.shard.manager import Manager

#: The client id of the tests' requests.
CLIENT = 7


def k(key: Any) -> tuple[Any, bytes]:
    """``key``'s digest and canonical bytes."""
    kb = dumps_key(key)
    return key_digest(kb), kb


def put(m: Manager, key: Any, value: Any, chkpt: int = 0, **kw: Any) -> None:
    """Put ``key -> value`` at checkpoint ``chkpt``."""
    d, kb = k(key)
    m.put(d, kb, dumps_value(value).join(), chkpt, CLIENT, **kw)


def get(m: Manager, key: Any, chkpt: int = 0, timeout: float | None = None) -> Any:
    """The value of ``key`` at checkpoint ``chkpt``."""
    return m.get(k(key)[0], chkpt, lambda f: loads_value(bytes(f)), timeout)
