"""The ``DDictError`` family and the one place where wire errors become exceptions.

Every error a user can see is a :class:`DDictError` carrying a short string
``code`` and, as ``lib_err``, the name of Dragon's return code for it
(:data:`DRAGON_LIB_ERR`: Dragon programs compare ``ex.lib_err`` with these
strings).  Managers never
raise across the wire: they answer with a numeric status and a message, and
:func:`raise_for_status` is the only function that turns such an answer back
into an exception.  Handlers therefore contain no error-mapping boilerplate.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from .layout import ManagerInfo


class Status(enum.IntEnum):
    """Numeric status of a manager's reply (one byte on the wire)."""

    OK = 0
    MORE = 1  # a paged reply: more pages follow
    KEY_NOT_FOUND = 2
    INVALID_OPERATION = 3
    INVALID_ARGUMENT = 4
    CHECKPOINT_RETIRED = 5
    FUTURE_CHECKPOINT = 6
    PERSIST_CHECKPOINT_UNAVAILABLE = 7
    POOL_FULL = 8
    TIMEOUT = 9
    CLOSED = 10
    SYNC_ERROR = 11
    MANAGER_UNAVAILABLE = 12
    SERIALIZATION = 13
    INTERNAL = 14
    MOVED = 15  # the manager moved to another host process (clients follow it)
    LEASE = 16  # its host holds no lease for it now: not applied (clients ask the orchestrator)


#: Dragon's return-code name (``lib_err``) for each code: what Dragon's DDict raises
#: with in the same case.  Codes Dragon has no case for (a closed handle, an
#: unreachable manager, a value that does not pickle, an internal failure) take
#: the nearest of Dragon's names; docs/dragon.md lists them.
DRAGON_LIB_ERR: dict[str, str] = {
    "KEY_NOT_FOUND": "DRAGON_KEY_NOT_FOUND",
    "INVALID_OPERATION": "DRAGON_INVALID_OPERATION",
    "INVALID_ARGUMENT": "DRAGON_INVALID_ARGUMENT",
    "CHECKPOINT_RETIRED": "DRAGON_DDICT_CHECKPOINT_RETIRED",
    "FUTURE_CHECKPOINT": "DRAGON_DDICT_FUTURE_CHECKPOINT",
    "PERSIST_CHECKPOINT_UNAVAILABLE": "DRAGON_DDICT_PERSIST_CHECKPOINT_UNAVAILABLE",
    "POOL_FULL": "DRAGON_MEMORY_POOL_FULL",
    "TIMEOUT": "DRAGON_TIMEOUT",
    "SYNC_ERROR": "DRAGON_FAILURE",  # (Dragon's manager answers a failed sync with FAILURE)
    "CLOSED": "DRAGON_OBJECT_DESTROYED",
    "MANAGER_UNAVAILABLE": "DRAGON_FAILURE",
    "SERIALIZATION": "DRAGON_INVALID_ARGUMENT",
    "INTERNAL": "DRAGON_FAILURE",
    "MOVED": "DRAGON_FAILURE",  # (seen only where a move could not be followed)
    "LEASE": "DRAGON_FAILURE",  # (seen only where no primary answered within the wait)
    "TASK_FAILED": "DRAGON_FAILURE",  # (filter's mgr_code raised: Dragon's filter fails so)
}


class DDictError(Exception):
    """Base class of every ``dask_ddict`` error.

    Parameters
    ----------
    message
        Human-readable description.
    code
        Short machine-readable code, e.g. ``"INVALID_OPERATION"``.  Subclasses
        fix their own code; the base class defaults to ``"INVALID_OPERATION"``.
    """

    default_code = "INVALID_OPERATION"

    def __init__(self, message: str = "", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code

    @property
    def lib_err(self) -> str:
        """The name of Dragon's return code for this error, e.g.
        ``"DRAGON_DDICT_CHECKPOINT_RETIRED"`` (see :data:`DRAGON_LIB_ERR`)."""
        return DRAGON_LIB_ERR.get(self.code, "DRAGON_FAILURE")

    def __str__(self) -> str:
        return f"{self.message} [{self.code}]" if self.message else self.code

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.code, self.__dict__))


def _rebuild(cls: type[DDictError], message: str, code: str, state: dict[str, Any]) -> DDictError:
    exc = cls.__new__(cls)
    DDictError.__init__(exc, message, code)
    exc.__dict__.update(state)
    return exc


class DDictUnableToCreateError(DDictError):
    """The cluster refused to create the dictionary as a whole (Dragon's name: its
    orchestrator answers a failed creation with it): a name already taken, no
    worker to host managers, nothing kept for a ``restart=True``.

    A subclass of :class:`DDictError`, which these refusals raised before it
    existed, so that ``except DDictError`` keeps catching them.  Refusals with a
    more precise type keep it: ``ValueError`` for arguments the cluster cannot
    satisfy (``n_workers`` over the workers there are, ``total_mem`` under 1 MiB
    per manager), :class:`DDictFullError` for a ``total_mem`` its hosts cannot
    hold, :class:`DDictPersistCheckpointError` for a ``restore_from`` checkpoint
    that is not persisted.  The ``code`` is the refusal's own (most often
    ``INVALID_ARGUMENT``), so ``lib_err`` is unchanged too.
    """


class DDictKeyError(DDictError, KeyError):
    """A key is not in the dictionary (at the client's checkpoint).

    ``str()`` works for every key type (Dragon's version fails for non-str keys).
    """

    default_code = "KEY_NOT_FOUND"

    def __init__(self, key: Any = None, message: str = "", code: str | None = None) -> None:
        self.key = key
        if not message:
            try:
                message = f"key {key!r} not found"
            except Exception:  # a key whose repr itself fails
                message = f"key of type {type(key).__name__} not found"
        DDictError.__init__(self, message, code)

    def __str__(self) -> str:
        return DDictError.__str__(self)


class DDictFullError(DDictError):
    """A manager's shard is too full to take the value; nothing was stored."""

    default_code = "POOL_FULL"


class DDictTimeoutError(DDictError, TimeoutError):
    """A blocking operation did not finish within its timeout."""

    default_code = "TIMEOUT"


class DDictCheckpointSyncError(DDictError):
    """The operation's checkpoint has retired from the manager's working set."""

    default_code = "CHECKPOINT_RETIRED"


class DDictFutureCheckpointError(DDictError):
    """A batch put targets a checkpoint the working set cannot advance to yet."""

    default_code = "FUTURE_CHECKPOINT"


class DDictPersistCheckpointError(DDictError):
    """A persisted checkpoint id that the store does not have."""

    default_code = "PERSIST_CHECKPOINT_UNAVAILABLE"


class DDictSyncError(DDictError):
    """Synchronizing or cloning dictionaries failed."""

    default_code = "SYNC_ERROR"


class DDictClosedError(DDictError):
    """The dictionary was destroyed or this handle detached."""

    default_code = "CLOSED"


class DDictManagerUnavailableError(DDictError, ConnectionError):
    """A manager cannot be reached (its worker died or left the cluster)."""

    default_code = "MANAGER_UNAVAILABLE"


def manager_lost(name: str, info: ManagerInfo) -> DDictManagerUnavailableError:
    """The error of an operation on a manager whose host is gone, as the orchestrator knows it.

    Said in one place, whoever finds the loss (a refused connection, a shard marked
    closed, the layout): the user learns which manager, where it was, why its host
    is gone (``why``: "its worker was retired", "its nanny closed", ...) and the way
    back, which is not obvious (the dictionary lives on, without that manager's keys).
    A *parked* manager (one that no worker could take when its host left) is not
    lost: its shard waits in that machine's shared memory for a worker to join there.
    """
    mid, why = info.manager_id, info.lost_why or "the orchestrator found it gone"
    if info.parked:
        return DDictManagerUnavailableError(
            f"manager {mid} of DDict {name!r} is parked: {why}.  Its keys are kept in the "
            f"shared memory of {info.hostname} ({info.store_path}); it serves again, with "
            "all of them, as soon as a worker with a ddict host runs on that machine (one "
            "that joins takes it at once; d.rebalance() asks again).  The other managers "
            "work on"
        )
    return DDictManagerUnavailableError(
        f"manager {mid} of DDict {name!r} is unavailable: its host {info.hostname} "
        f"(worker {info.worker}) is gone: {why}.  The other managers work on; this one's keys "
        f"are out of reach.  To recreate it: d.destroy(allow_restart=True), then "
        f"DDict(..., name={name!r}, restart=True) on the workers left (it comes back empty, "
        "listed in empty_managers), then d.restore(<a persisted checkpoint>) or "
        "DDict.synchronize_ddicts from a copy"
    )


class DDictManagerMovedError(DDictManagerUnavailableError):
    """A manager moved to another host process (a worker retired, ``rebalance()``).

    Clients follow a move by themselves (they ask the orchestrator where the manager
    is now and send the operation there, within its own time): a user sees this
    only when that cannot be done, e.g. a process with no way to reach the scheduler.
    """

    default_code = "MOVED"


class DDictLeaseError(DDictManagerUnavailableError):
    """A replicated manager's host may not answer for it now: its lease from the
    orchestrator lapsed (it cannot reach the orchestrator, or a replica is taking over),
    the manager waits for the orchestrator to confirm it, or a replica failed a write
    and the orchestrator has not settled its replicas yet.  Nothing was applied, except
    for the write that found its replica failing, which was not acknowledged: it may
    be applied later, or not at all.

    Clients wait for a primary by themselves (they ask the orchestrator where the
    manager is and send the operation again, with its request id, within its time or
    ``ddict.failover-timeout``): a user sees this only when none answered in that time.
    """

    default_code = "LEASE"


class DDictSerializationError(DDictError, TypeError):
    """A key or value could not be pickled or unpickled; nothing was stored."""

    default_code = "SERIALIZATION"


class DDictTaskError(DDictError):
    """Code run beside a shard failed (``mgr_code`` of :meth:`~dask_ddict.DDict.filter`
    raised, or its task was lost); ``manager_id`` names the manager (``None``: a merge
    node of the filter's tree), and ``__cause__`` is the original exception."""

    default_code = "TASK_FAILED"

    def __init__(
        self, message: str = "", code: str | None = None, manager_id: int | None = None
    ) -> None:
        super().__init__(message, code)
        self.manager_id = manager_id


_CLASS_FOR_STATUS: dict[Status, type[DDictError]] = {
    Status.KEY_NOT_FOUND: DDictKeyError,
    Status.INVALID_OPERATION: DDictError,
    Status.INVALID_ARGUMENT: DDictError,
    Status.CHECKPOINT_RETIRED: DDictCheckpointSyncError,
    Status.FUTURE_CHECKPOINT: DDictFutureCheckpointError,
    Status.PERSIST_CHECKPOINT_UNAVAILABLE: DDictPersistCheckpointError,
    Status.POOL_FULL: DDictFullError,
    Status.TIMEOUT: DDictTimeoutError,
    Status.CLOSED: DDictClosedError,
    Status.SYNC_ERROR: DDictSyncError,
    Status.MANAGER_UNAVAILABLE: DDictManagerUnavailableError,
    Status.SERIALIZATION: DDictSerializationError,
    Status.INTERNAL: DDictError,
    Status.MOVED: DDictManagerMovedError,
    Status.LEASE: DDictLeaseError,
}


def status_of(exc: BaseException) -> Status:
    """The wire status that represents ``exc`` (``INTERNAL`` for foreign errors)."""
    if isinstance(exc, DDictError):
        try:
            return Status[exc.code]
        except KeyError:
            return Status.INTERNAL
    return Status.INTERNAL


def wire_error(exc: BaseException) -> tuple[Status, bytes]:
    """A failure as a manager's reply carries it: its status and its message text
    (what :func:`raise_for_status` turns back into the exception)."""
    return status_of(exc), str(getattr(exc, "message", "") or exc).encode()


def raise_for_status(status: int, message: str, key: Any = None) -> NoReturn:
    """Raise the exception that a non-OK manager reply stands for.

    Parameters
    ----------
    status
        The reply's status byte.
    message
        The reply's message text (from the manager).
    key
        The user's key, attached to :class:`DDictKeyError`.
    """
    raise error_for_status(status, message, key)


def error_for_status(status: int, message: str, key: Any = None) -> DDictError:
    """The exception that a non-OK manager reply stands for (:func:`raise_for_status`
    raises it; a broadcast that shows every manager's outcome keeps it)."""
    st = Status(status)
    cls = _CLASS_FOR_STATUS.get(st, DDictError)
    if cls is DDictKeyError:
        return DDictKeyError(key, code=st.name)
    return cls(message, code=st.name)


# -- control-plane errors (worker -> scheduler -> client) ---------------------------
#
# The scheduler does not unpickle what workers send (its RPCs run with
# ``deserialize=False``), so an exception raised in a worker handler reaches
# the orchestrator as a bare ``Exception(text)``.  Worker handlers therefore
# return expected errors as data, and the orchestrator re-raises them typed.

_PLAIN = {"ValueError": ValueError, "TypeError": TypeError}


def error_to_wire(exc: BaseException) -> dict[str, Any] | None:
    """``{"error": ...}`` for an error a user should see typed, else ``None``."""
    if isinstance(exc, DDictError):
        return {"error": [type(exc).__name__, exc.message, exc.code]}
    if type(exc).__name__ in _PLAIN:
        return {"error": [type(exc).__name__, str(exc), ""]}
    return None


def raise_from_wire(reply: Any) -> None:
    """Re-raise an error that :func:`error_to_wire` encoded (no-op for other replies)."""
    if not (isinstance(reply, dict) and "error" in reply):
        return
    name, message, code = reply["error"]
    if name in _PLAIN:
        raise _PLAIN[name](message)
    cls = globals().get(name)
    if not (isinstance(cls, type) and issubclass(cls, DDictError)):
        cls = DDictError
    raise cls(message, code or None)
