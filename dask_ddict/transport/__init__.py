"""The key path, client side: framing, links to host processes, channels to managers.

Two ways to reach a manager, chosen per manager by the client handle:

* same host: read the shard, and commit small in-window puts, directly
  (:class:`~.shared.SharedChannel`); everything else through the host
  process's Unix socket;
* other hosts: TCP to the host process (HMAC-authenticated, TLS when the
  cluster requires it).

The modules, by what they hold:

* what travels: the wire format (:mod:`.protocol`), what every operation shares
  (:mod:`.operation`), the operations themselves (:mod:`.ops`, :mod:`.many_key_ops`,
  :mod:`.whole_checkpoints`) and the host's table of them (:mod:`.table`);
* a dictionary's channels, one per manager (:mod:`.channels`), and the operations on
  several managers at once (:mod:`.broadcast`, :mod:`.many_key_reads`, what they ask
  of the channels: :mod:`.routing`);
* the same host: a shard read in place (:mod:`.shared`), the process's mappings of
  shards (:mod:`.mapped`), values lent without a copy (:mod:`.lending`);
* a socket: links to host processes (:mod:`.socket_client`), one connection's bounded
  waits (:mod:`.bounded_connection`), the process's idle connections
  (:mod:`.idle_pool`), the handshake (:mod:`.handshake`), the socket toolkit
  (:mod:`.sockets`), an event loop's pipelined requests (:mod:`.pipelined`), the
  process's TLS settings (:mod:`.tls_settings`);
* the process's timings of what it sends (:mod:`.timing`).

The server side lives in :mod:`dask_ddict.host`.
"""

from __future__ import annotations

from .socket_client import HostLink, SocketChannel

__all__ = ["HostLink", "SocketChannel"]
