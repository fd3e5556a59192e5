"""The key path: framing, the managers' socket servers, and client channels.

Three ways to reach a manager, chosen per manager by the client handle:

* in-process (:class:`InProcessChannel`): a task on the hosting worker calls
  the manager object directly;
* same host (:class:`SocketChannel` over a Unix socket);
* other hosts (:class:`SocketChannel` over TCP, HMAC-authenticated, TLS when
  the cluster requires it).
"""

from __future__ import annotations

from .client import InProcessChannel, SocketChannel
from .server import ManagerServer

__all__ = ["InProcessChannel", "ManagerServer", "SocketChannel"]
