"""Hosting managers: processes of their own, supervised from the nanny (or worker).

In the nanny (or a worker without one):

* :mod:`.supervisor`: binds the listeners, starts the host process, restarts it
  over the same shards when it dies;
* :mod:`.pipe`: one control message down to the host process, its answer back;
* :mod:`.registry`: what the host process serves, remembered across its restarts;
* :mod:`.control_calls`: the orchestrator's calls to the supervisor (create, destroy,
  move, replica steps), each a control message and a change of the registry;
* :mod:`.machine`: the machine, as the orchestrator asks about it (memory, a
  persist path seen);
* :mod:`.control`: the messages between the supervisor and its host process.

In the host process (``python -m dask_ddict.host``):

* :mod:`.process`: the host process itself, which owns the dictionaries it serves
  (:mod:`.hosted`);
* :mod:`.server`: its key-path server, one operation table for every manager, served
  from an event loop (:mod:`.loop`);
* :mod:`.opening`: opening a manager over a new or existing shard;
* :mod:`.moves`, :mod:`.replicas`, :mod:`.replica_store`, :mod:`.cloning`: a manager's
  shard moved, kept up to date elsewhere, or copied into another dictionary;
* :mod:`.lease`: the lease a host needs to serve replicated primaries;
* :mod:`.hygiene`: owner locks, and removing what dead processes (and kept shards'
  gone clusters) left.
"""
