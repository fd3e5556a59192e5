"""``DDict.filter``: Dragon's filter as Dask tasks beside the shards, merged up a tree.

One task per manager (a *leaf*, :mod:`.tasks`) runs ``mgr_code(dd, out_queue,
*args)`` on the worker that hosts the manager, so ``dd``'s reads come from the
shard itself.  Its results stream to its parent: a *merge task* (fan-in at most
``branching_factor``, placed on the worker most of its children run on, see
:mod:`.plan`), or the caller (:mod:`.caller`), which is the tree's root and
merges its own children as the user iterates.  Every hop is a socket between
two processes (:mod:`.streams` sends, :mod:`.receiving` receives) with a credit
window, so memory stays bounded by a few batches per task; the scheduler only
places the tasks and never sees a result.

Why every hop is a socket of ours, the worker-to-worker ones too, rather than
Dask's own comms (as Dask's P2P shuffle sends its shards) with only the last hop
to the caller on ours: the code at both ends of a hop is synchronous (a task's
thread, the caller's iterator), so on Dask's comms each batch would cross to the
worker's event loop and back, and share that loop with the worker's heartbeats
and the scheduler's messages.  Measured with ``python
benchmarks/bench_filter_hops.py`` (one hop between two processes, the default
batches and credit window; best of 3, median of 6 runs on a shared 2-core
machine): 100,000 small results take 160 ms on the stream socket and 1.2 s on
Dask's comms driven from the tasks' threads (0.2 s from the event loops alone,
which a task cannot be); 64 results of 1 MiB take 110 ms and 150 ms (140 ms).
The P2P shuffle is an all-to-all exchange whose receivers are the workers
themselves; a filter is a tree of streams read by one blocking iterator, which a
blocking socket per child with an explicit credit window bounds most simply.
Two transports in one filter (comms between workers, a socket to the caller)
would mean two ways to fail and to carry TLS, for no gain.  The sockets share
the key path's toolkit (:mod:`dask_ddict.transport.sockets`).
"""

from __future__ import annotations

from .caller import AsyncFilter, Filter

__all__ = ["AsyncFilter", "Filter"]
