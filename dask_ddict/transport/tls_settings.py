"""This process's TLS settings for the key path's TCP connections (process-wide state).

A client and a worker have Dask's: their client's or worker's ``security``.  A host
process has neither, so its supervisor hands it the worker's when it starts
(:func:`set_default_security`), for the connections it opens itself: replication
pulls, moves, replicas' change sets, a tree broadcast forwarded to other hosts.  One
module-level setting rather than an argument through every one of those calls: they
are far apart, and a host process has one set of certificates for its whole life.
"""

from __future__ import annotations

from typing import Any

_DEFAULT_SECURITY: Any = None


def set_default_security(security: Any) -> None:
    """TLS certificates for processes with neither a client nor a worker (host processes)."""
    global _DEFAULT_SECURITY
    _DEFAULT_SECURITY = security


def default_security() -> Any:
    """This process's TLS settings: set by its host process, else its worker's or client's."""
    import distributed

    if _DEFAULT_SECURITY is not None:
        return _DEFAULT_SECURITY
    try:
        return distributed.get_worker().security
    except ValueError:
        pass
    try:
        return distributed.get_client().security
    except ValueError:
        return distributed.Security()
