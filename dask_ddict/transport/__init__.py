"""The key path, client side: framing, links to host processes, channels to managers.

Two ways to reach a manager, chosen per manager by the client handle:

* same host: read the shard, and commit small in-window puts, directly
  (:class:`~.shared.SharedChannel`); everything else through the host
  process's Unix socket;
* other hosts: TCP to the host process (HMAC-authenticated, TLS when the
  cluster requires it).

The server side lives in :mod:`dask_ddict.host`.
"""

from __future__ import annotations

from .links import HostLink, SocketChannel

__all__ = ["HostLink", "SocketChannel"]
