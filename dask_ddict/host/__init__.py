"""Hosting managers: processes of their own, supervised from the nanny (or worker).

* :mod:`.supervisor`: binds the listeners, starts the host process, restarts it
  over the same shards when it dies, answers the orchestrator's control calls;
* :mod:`.process`: the host process itself (``python -m dask_ddict.host``);
* :mod:`.server`: its key-path server, one operation table for every manager;
* :mod:`.opening`: opening a manager over a new or existing shard;
* :mod:`.hygiene`: owner locks, and removing what dead processes (and kept shards'
  gone clusters) left;
* :mod:`.control`: the supervisor's messages to its host process.
"""
