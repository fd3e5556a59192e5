"""The Dask side: the scheduler plugin (orchestrator) and the nanny/worker plugins.

On the scheduler:

* :mod:`.scheduler_plugin`: the registry of dictionaries and the handlers in front of
  it; :mod:`.refusals`: a user's mistake answered as an error reply;
* :mod:`.creation`: creating a dictionary (plan, ask the workers, layout);
  :mod:`.restart_plan`: ``restart=True`` over kept shards;
* :mod:`.liveness`: whether a host supervisor lives, why a worker left; :mod:`.leftovers`:
  removing what lost managers left;
* :mod:`.elastic`: evacuations and rebalances over :mod:`.moves`; :mod:`.replicas`:
  where replicas are kept, placed and repaired; :mod:`.failover`: a replica taking over,
  under :mod:`.leases`;
* :mod:`.lifetime`: which clients hold which dictionaries; :mod:`.sizing`: the memory
  warning at creation; :mod:`.dashboard` and :mod:`.metrics`: what an operator sees.

On each nanny (or worker without one): :mod:`.worker_plugin`, which owns the host
supervisor (:mod:`dask_ddict.host`).
"""
