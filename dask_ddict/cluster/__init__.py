"""The Dask side: the scheduler plugin (orchestrator) and the nanny/worker plugins (host supervisors)."""
