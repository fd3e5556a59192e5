"""The worker plugin's lifecycle alone: a real scheduler and worker in this process, no client."""

from __future__ import annotations

import asyncio
import os

import psutil
from distributed import Scheduler, Worker

from dask_ddict.cluster.worker_plugin import DDictWorkerPlugin


def test_a_worker_without_a_nanny_supervises_its_host_and_stops_it():
    async def main() -> None:
        async with Scheduler(dashboard_address=":0") as s, Worker(s.address, nanny=None) as w:
            plugin = DDictWorkerPlugin()
            await plugin.setup(w)
            sup = plugin.supervisor
            assert sup is not None and "ddict_create_managers" in w.handlers
            info = await w.handlers["ddict_host_info"]()
            host = psutil.Process(info["host_pid"])
            assert host.is_running() and os.path.exists(sup.uds_path)
            await plugin.teardown(w)
            assert plugin.supervisor is None
            host.wait(10)  # the host process ends (raises if it does not)
            assert not host.is_running()
            assert not os.path.exists(sup.uds_path)  # its socket is gone with it
            assert await w.handlers["ddict_host_info"]() is None  # "gone", for the orchestrator

    asyncio.run(main())
