"""The layouts this process knows: a pickled handle carries a reference, not the layout.

A layout lists every manager (about 490 bytes each), so a handle that carried it
would grow with the dictionary and travel with every task that takes it.  A
pickled handle carries a :class:`LayoutRef` instead (a few dozen bytes), and
each process resolves it at most once per layout epoch: from this cache, else
with one call to the orchestrator.  Resolution happens on the handle's first
use, in the thread that uses it, never while unpickling (a worker may unpickle
on its event loop, where a blocking call to the scheduler would deadlock).
Operations never contact the scheduler.  ``DDict.serialize()`` stays
self-contained, for processes outside the cluster's Dask context.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from distributed import Client, get_client, get_worker

from .._forking import in_child, reinit_lock
from ..errors import DDictClosedError, DDictError, raise_from_wire
from ..layout import Layout

_KNOWN: dict[str, Layout] = {}  # uid -> the newest layout seen in this process
_FETCHING: dict[str, threading.Lock] = {}  # uid -> held while its layout is fetched
_LOCK = threading.Lock()  # guards the two tables only: never held across a call


def _forked() -> None:
    """In a forked child: no fetch is under way (another thread of the parent may have
    been in one, holding its lock; see :mod:`dask_ddict._forking`)."""
    reinit_lock(_LOCK)
    _FETCHING.clear()


in_child(_forked)
#: Layouts this process fetched from the orchestrator (the scale benchmark counts them).
fetches = 0


@dataclass(frozen=True)
class LayoutRef:
    """What a pickled handle carries: enough to find its layout again."""

    name: str
    uid: str
    epoch: int
    scheduler: str

    @classmethod
    def of(cls, layout: Layout) -> LayoutRef:
        return cls(layout.name, layout.uid, layout.epoch, layout.scheduler)


def remember(layout: Layout) -> None:
    """Keep ``layout`` (unless a newer epoch of it is known)."""
    with _LOCK:
        known = _KNOWN.get(layout.uid)
        if known is None or known.epoch <= layout.epoch:
            _KNOWN[layout.uid] = layout


def forget(uid: str) -> None:
    """The dictionary was destroyed: drop its layout."""
    with _LOCK:
        _KNOWN.pop(uid, None)
        _FETCHING.pop(uid, None)


def resolve(ref: LayoutRef, client: Any = None) -> Layout:
    """The layout ``ref`` names: known here, else fetched once (under a lock per
    dictionary, so that many tasks unpickling the same handle at once cause one fetch).

    Raises
    ------
    DDictClosedError
        The dictionary was destroyed (or its name now belongs to a new one).
    """
    global fetches
    with _LOCK:
        known = _KNOWN.get(ref.uid)
        if known is not None and known.epoch >= ref.epoch:
            return known
        fetching = _FETCHING.setdefault(ref.uid, threading.Lock())
    # One fetch per dictionary at a time; the table lock is free meanwhile (an event
    # loop that a fetch waits on may need it, e.g. to remember a layout it created).
    with fetching:
        with _LOCK:
            known = _KNOWN.get(ref.uid)
            if known is not None and known.epoch >= ref.epoch:
                return known  # fetched by another thread while this one waited
            fetches += 1
        layout = fetched_layout(ref, _ask_orchestrator(ref, client))
        remember(layout)
        return layout


def fetched_layout(ref: LayoutRef, reply: Any) -> Layout:
    """The layout in the orchestrator's ``ddict_attach`` ``reply`` for ``ref``.

    Raises
    ------
    DDictClosedError
        The dictionary was destroyed (or its name now belongs to a new one).
    """
    try:
        layout = layout_reply(reply)
    except DDictError:  # "no DDict named ..."
        raise DDictClosedError(f"DDict {ref.name!r} was destroyed") from None
    if layout.uid != ref.uid:
        raise DDictClosedError(
            f"DDict {ref.name!r} was destroyed (its name now belongs to a new dictionary)"
        )
    return layout


def current_layout(
    ref: LayoutRef, client: Any, timeout: float | None, settled: bool = False
) -> Layout | None:
    """The orchestrator's layout of ``ref`` now (which managers it knows lost, and why),
    asked within ``timeout`` through a client or worker of this process; ``None`` if it
    cannot be asked (no client here, a scheduler that does not answer, an event loop's
    thread, which must not wait for itself).  ``settled``: once no move of it is
    under way (the orchestrator answers when its moves are done).

    Raises
    ------
    DDictClosedError
        The dictionary was destroyed.
    """
    try:
        reply = _ask_orchestrator(ref, client, timeout, own=False, settled=settled)
    except Exception:  # noqa: BLE001 - no answer: the caller says what it saw itself
        return None
    return None if reply is None else fetched_layout(ref, reply)


def layout_reply(reply: Any) -> Layout:
    """The layout in the orchestrator's ``ddict_create``/``ddict_attach`` reply, or its
    refusal raised.

    A refusal (the user's mistake) comes back as an error reply rather than an
    exception of the handler, so that the scheduler does not log it as a bug;
    :func:`~dask_ddict.errors.raise_from_wire` raises it here with its type.
    """
    raise_from_wire(reply)
    return Layout.from_dict(reply)


def current_client() -> Client | None:
    """This process's Dask client (in a task: its worker's), or ``None``."""
    try:
        return get_client()
    except ValueError:
        return None


def _ask_orchestrator(
    ref: LayoutRef,
    client: Any,
    timeout: float | None = None,
    own: bool = True,
    settled: bool = False,
) -> Any:
    """One ``ddict_attach`` call: through this worker's scheduler connection in a task,
    else through a client of this process, else (``own``) a short-lived client of its
    own; ``None`` if none may be made.  ``timeout``: seconds for the answer."""
    from distributed.utils import sync

    ask = {"name": ref.name, "settled": True} if settled else {"name": ref.name}
    if client is not None:
        if client.asynchronous:  # (this is its event loop's thread: a wait here would
            return None  # block the loop until the timeout; AsyncDDict asks by awaiting)
        return client.sync(
            client.scheduler.ddict_attach, **ask, asynchronous=False, callback_timeout=timeout
        )
    try:
        worker = get_worker()
    except ValueError:
        worker = None
    if worker is not None:
        return sync(worker.loop, worker.scheduler.ddict_attach, **ask, callback_timeout=timeout)
    client = current_client()
    if client is not None:
        return client.sync(
            client.scheduler.ddict_attach, **ask, asynchronous=False, callback_timeout=timeout
        )
    if not own:
        return None
    with Client(ref.scheduler, set_as_default=False) as mine:
        return mine.sync(mine.scheduler.ddict_attach, name=ref.name)
