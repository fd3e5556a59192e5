"""Argument checks: every public argument is validated here, once.

Each check raises ``TypeError`` (wrong type) or ``ValueError`` (wrong value)
with a message that names the argument and what it accepts, before anything
is sent, created or written: a bad argument never reaches a manager, leaves
nothing behind and does not disturb the dictionary.  The wire carries ids and
increments as signed 64-bit integers, hence the default ranges.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from typing import Any, TypeVar

import dask.config
from dask.typing import NoDefault, no_default
from dask.utils import parse_timedelta

T = TypeVar("T")

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
#: Longest timeout in seconds (about 31 years): anything longer is "forever", i.e. ``None``.
MAX_TIMEOUT = 1e9
#: Most managers per worker, and most workers hosting managers, of one dictionary.
MAX_MANAGERS = 1 << 16
#: Most replicas of each manager (``DDict(replicas=...)``): each costs a shard's memory.
MAX_REPLICAS = 8
#: The values of ``DDict(lifetime=...)`` (see ``dask_ddict.cluster.lifetime``).
LIFETIMES = ("client", "cluster")
#: A dictionary's name is a directory in its zarr store and part of shard file names.
MAX_NAME_BYTES = 200
#: What a ``timeout`` argument accepts: seconds, a duration string, ``None``
#: (forever), or ``no_default`` for the ``ddict.timeout`` configuration.
Timeout = float | str | None | NoDefault
_NAME_OK = re.compile(r"^[^/\\\x00]+$")


def check_int(
    name: str, value: Any, lo: int = INT64_MIN, hi: int = INT64_MAX, *, allow_none: bool = False
) -> Any:
    """``value`` if it is an int in ``[lo, hi]`` (or ``None`` when allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        what = "an int or None" if allow_none else "an int"
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r:.80}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return int(value)


def either(what: str, name: str, value: T | None, alias: str, alias_value: T | None) -> T | None:
    """``value``, or ``alias_value`` when the caller spelled argument ``name`` as ``alias``.

    ``alias`` is Dragon's name of the argument (``val`` for ``n``, ``n_nodes``
    for ``n_workers``): a Dragon program runs unchanged, and ours keep their
    names.  ``None`` is "not given" for both.

    Raises
    ------
    TypeError
        Both names given (even with equal values): naming both, so that the
        program says one thing once.
    """
    if alias_value is None:
        return value
    if value is not None:
        raise TypeError(
            f"{what}() got both {name}= and {alias}= ({alias} is Dragon's name "
            f"of {name}): give one of them"
        )
    return alias_value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool (``"no"`` is not false: it is refused)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r:.80}")
    return value


#: What iterates over its own characters or bytes: never an iterable of keys (or handles).
_TEXT = (str, bytes, bytearray, memoryview)


def check_keys(name: str, value: T, of: str = "keys", one: str = "key") -> T:
    """``value``, refused if it is text or bytes where an iterable of ``of`` is meant.

    A ``str`` is an iterable of its characters (``bytes``, of ints): without this,
    ``d.get_many("abc")`` would look up ``'a'``, ``'b'`` and ``'c'`` and answer
    something, and ``d.clone(s)`` would read each character as a handle.  One
    check, for every argument that takes many: the mistake is common (a single
    key where a list is meant) and its symptom is far from its cause.  ``one``
    names a single item, for the hint (``""``: no hint).
    """
    if isinstance(value, _TEXT):
        each = "character" if isinstance(value, str) else "byte"
        hint = f" (for one {one}, pass it in a list: [{one}])" if one else ""
        raise TypeError(
            f"{name} must be an iterable of {of}, not a {type(value).__name__}: "
            f"each of its {each}s would be taken as one{hint}"
        )
    return value


def check_timeout(value: Any, name: str = "timeout") -> float | None:
    """Seconds as a float, from a number or a Dask duration string (``"10s"``); ``None`` waits forever.

    ``no_default`` (Dask's own sentinel, the default of every ``timeout``
    argument) takes ``ddict.timeout`` from dask.config, so that a cluster's
    configuration sets the timeout of handles whose code never names one, as
    ``distributed.comm.timeouts`` does for Dask's clients.

    Raises
    ------
    TypeError, ValueError
        Naming ``name`` and the range ``[0, 1e9]`` seconds.
    """
    if value is no_default:
        value, name = dask.config.get("ddict.timeout"), "ddict.timeout"
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = parse_timedelta(value)
        except Exception:
            raise ValueError(
                f"{name} {value!r} is not a duration (e.g. 10, 2.5, '10s', '5 minutes')"
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be seconds (a number or a string such as '10s') or None, "
            f"got {type(value).__name__} {value!r:.80}"
        )
    seconds = float(value)
    if math.isnan(seconds) or not 0 <= seconds <= MAX_TIMEOUT:
        raise ValueError(
            f"{name} must be in [0, {MAX_TIMEOUT:g}] seconds or None (wait forever), got {value!r}"
        )
    return seconds


def check_lifetime(value: Any) -> str:
    """``"client"`` (released with the clients that hold it) or ``"cluster"`` (until destroy)."""
    if value not in LIFETIMES or not isinstance(value, str):
        raise ValueError(
            f"lifetime must be one of {', '.join(map(repr, LIFETIMES))}, got {value!r:.80}"
        )
    return value


def check_name(value: Any) -> str:
    """A dictionary name: a string usable as one zarr group (directory) name, or ``""``."""
    if not isinstance(value, str):
        raise TypeError(f"name must be a str, got {type(value).__name__} {value!r:.80}")
    if value == "":
        return value
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise ValueError(
            f"name must be at most {MAX_NAME_BYTES} bytes (it names a directory "
            f"of the zarr store), got {size}"
        )
    if not _NAME_OK.match(value) or value in (".", "..") or value.startswith("__"):
        raise ValueError(
            f"name {value!r:.80} must not contain '/', '\\' or NUL, be '.' or "
            "'..', or start with '__' (zarr reserves it)"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"name {value!r:.80} is not valid UTF-8 text") from None
    return value


def local_store(path: str) -> str | None:
    """The local directory that a zarr store path names (``file://`` stripped), or
    ``None`` for another fsspec URL (``s3://...``), which only its filesystem can check."""
    local = path[7:] if path.startswith("file://") else path
    return None if "://" in local else local


def absolute_store(path: str) -> str:
    """A zarr store path as it means in this process.

    A local path is made absolute here (``~`` expanded), where the user wrote
    it: the host processes that write the checkpoints run in directories of
    their own, where a relative path would name a store that goes with the
    cluster.  A URL (``s3://...``) is returned as it is.
    """
    local = local_store(path)
    if not local:
        return path
    full = os.path.abspath(os.path.expanduser(local))
    return f"file://{full}" if path.startswith("file://") else full


def check_store_writable(path: str) -> None:
    """Raise ``ValueError`` when the local zarr store ``path`` cannot be written here.

    Without this, a store that can never be written (``/proc/x.zarr``, a
    read-only mount, a directory of another user) fails only in each host
    process, when the store's groups are made, with the store's own words
    ("unreadable group metadata"), which hide the cause.  The probe is real,
    not ``os.access`` (which says yes to root everywhere, ``/proc`` included):
    a directory with a fresh name is made, then removed, in the store itself
    or in its parent, where the store would be created.  Nothing is left behind.
    A path whose parent does not exist here may be one of the workers' machines
    only (a client outside the cluster): it is left to their host processes,
    which refuse it with the same words.  A URL (``s3://...``) is left to its filesystem.
    """
    local = local_store(absolute_store(path))
    if not local:
        return
    parent = local
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent not in (local, os.path.dirname(local)):
        return  # (maybe a path of the workers' machines only: their hosts say)
    try:
        probe = tempfile.mkdtemp(prefix=".ddict-write-probe-", dir=parent)
    except OSError as e:
        reason = f"{e.strerror} [errno {e.errno}]" if e.strerror else str(e)
        raise ValueError(
            f"persist_path {path!r} cannot be written: a directory cannot be "
            f"created in {parent} ({reason})"
        ) from None
    os.rmdir(probe)


def check_storage_options(value: Any, persist_path: str) -> dict[str, Any] | None:
    """fsspec options for a URL ``persist_path``: ``None`` or a JSON-like dict with str keys.

    They travel to every host process of the dictionary (never into its
    serialized handle, logs or reprs: they hold credentials), so they must be
    plain data.
    """
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(
            f"storage_options must be a dict with str keys or None, got {type(value).__name__}"
        )
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"storage_options must hold plain data (str, numbers, bools, None, lists, dicts): {e}"
        ) from None
    if value and not persist_path:
        raise ValueError(
            "storage_options needs a persist_path (an fsspec URL such as 's3://bucket/ckpt.zarr')"
        )
    if value and local_store(persist_path) is not None:
        raise ValueError(
            f"storage_options are fsspec options for a URL persist_path; "
            f"{persist_path!r} is a local directory"
        )
    return dict(value)


def check_client(value: Any) -> Any:
    """A ``distributed.Client`` or ``None``."""
    from distributed import Client

    if value is not None and not isinstance(value, Client):
        raise TypeError(
            f"client must be a distributed.Client or None, got {type(value).__name__} {value!r:.80}"
        )
    return value
