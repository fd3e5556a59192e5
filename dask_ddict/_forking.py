"""What a forked child does with the key path's state it inherits: it shares none of it.

``os.fork()`` (``multiprocessing``'s fork context, a PyTorch ``DataLoader``'s workers)
copies a process whole, handles and all, and a handle used in the child must behave as
one made there.  What the parent had open is the parent's:

* a pooled connection is one byte stream to its host: a child that wrote a request on
  the parent's connection could read the parent's reply, and the parent the child's.
  The child closes its copies of the descriptors (that ends nothing: the parent's stay
  open, and closing a copy sends nothing, also over TLS) and connects anew;
* a shard's LMDB environment belongs to the process that opened it: its reader slots
  carry that process's pid, and a read transaction that the child ended (or an
  environment it closed, which ends its transactions) would end the parent's (the
  slot is shared memory), so the pages that the parent reads or lends would be free
  to reuse under it.  The child lets the parent's transactions go without ending them
  (the compiled kernels' ``disown_transactions``) and closes its copy of the
  environment, then maps the shard as itself; where that cannot be done it never
  closes nor frees the environment (:func:`keep_forever`) and reads that shard over
  its host's socket;
* a value lent to the parent maps the shard's file, kept unchanged by the parent's
  snapshot, which may end as soon as the fork returns: the parent swaps it for a
  private copy before the fork, which the child shares copy-on-write;
* an embedded cluster is the parent's to close, also at the child's exit, and the
  parent's Dask client does not work in the child (its event loop is a thread of the
  parent's): control operations say so;
* a writer id is the parent's, and so is an open batch put: the child's handles get
  their own;
* a lock that another thread of the parent held is held forever in the child, whose
  copy of that thread does not exist: the child's locks start free
  (:func:`reinit_lock`).

Each module that keeps such state registers its own hooks here (:func:`in_child`,
:func:`before_fork`), not with ``os.register_at_fork``: they run in one fixed order
(the modules' import order: a module's before those that import it), each item's error
logged without stopping the rest, and with the cyclic GC off from before the fork
until the child's hooks are done.  A finalizer the GC ran in the middle (a dropped
handle closing its channels and views) would take locks not yet freed, and close an
environment not yet let go of; or, in the parent, wait for a lock that the thread
forking holds.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

_incref = ctypes.pythonapi.Py_IncRef
_incref.argtypes = [ctypes.py_object]
_incref.restype = None


def keep_forever(obj: Any) -> None:
    """Never free ``obj`` in this process (nor what it holds): an inherited LMDB
    environment or transaction, whose deallocation would end the parent's reader slots
    or drop this process's file locks.  Costs its memory, once per fork."""
    _incref(obj)


def reinit_lock(lock: Any) -> None:
    """``lock`` (a ``threading.Lock`` or ``RLock``) free again, in a forked child: what
    the standard library does with its own locks after a fork."""
    lock._at_fork_reinit()


_BEFORE: list[Callable[[], None]] = []
_AFTER_IN_PARENT: list[Callable[[], None]] = []
_IN_CHILD: list[Callable[[], None]] = []
_collecting = False  # (the GC's state before the fork, restored after it)


def before_fork(
    hook: Callable[[], None], after_in_parent: Callable[[], None] | None = None
) -> None:
    """Run ``hook`` in the parent just before each fork (in registration order) and
    ``after_in_parent`` just after it there."""
    _BEFORE.append(hook)
    if after_in_parent is not None:
        _AFTER_IN_PARENT.append(after_in_parent)


def in_child(hook: Callable[[], None]) -> None:
    """Run ``hook`` in each forked child, with the others registered here (in
    registration order), before the GC runs again."""
    _IN_CHILD.append(hook)


def each(items: Iterable[T], forked: Callable[[T], object]) -> None:
    """``forked(item)`` for each item, one's error logged without stopping the others
    (a child's hooks must leave nothing of its parent's half done)."""
    for item in list(items):
        try:
            forked(item)
        except Exception:
            logger.exception("ddict: around a fork, %r", item)


def _run(hooks: list[Callable[[], None]]) -> None:
    each(hooks, lambda hook: hook())


def _before() -> None:
    global _collecting
    _collecting = gc.isenabled()
    gc.disable()
    _run(_BEFORE)


def _after(hooks: list[Callable[[], None]]) -> None:
    """The fork is done (in the parent, or in the child): ``hooks``, then the GC on."""
    try:
        _run(hooks)
    finally:
        if _collecting:
            gc.enable()


os.register_at_fork(
    before=_before,
    after_in_parent=lambda: _after(_AFTER_IN_PARENT),
    after_in_child=lambda: _after(_IN_CHILD),
)
