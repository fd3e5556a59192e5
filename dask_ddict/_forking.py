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
* a writer id is the parent's: the child's handles get their own;
* a lock that another thread of the parent held is held forever in the child, whose
  copy of that thread does not exist: the child's locks start free
  (:func:`reinit_lock`).

Each module that keeps such state registers its own handler with
``os.register_at_fork`` and uses the two tools here.
"""

from __future__ import annotations

import ctypes
from typing import Any

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
