"""``dask worker`` processes of their own, to kill a whole worker host at once.

A :class:`~distributed.LocalCluster`'s workers are children of the test process, and
so is their nanny; a host failure is every process of a worker's host dying at once
(nanny, worker, the ddict host process and its supervisor), which needs workers
started as ``dask worker`` processes, each in a session of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
from distributed import Client

from dask_ddict.client.workers import scheduler_workers
from tests.support.paths import pythonpath


class Workers:
    """``dask worker`` processes (nanny and worker each) attached to a local scheduler."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, n: int) -> None:
        for _ in range(n):
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "dask",
                        "worker",
                        self.address,
                        "--nthreads",
                        "2",
                        "--memory-limit",
                        "1GiB",
                        "--no-dashboard",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    env={**os.environ, "PYTHONPATH": pythonpath()},
                )
            )  # (tasks of tests' helpers)

    def of(self, c: Client, worker: str) -> subprocess.Popen[bytes]:
        """The ``dask worker`` process (its nanny) of ``worker``."""
        nanny = scheduler_workers(c)[worker]["nanny"]
        port = int(nanny.rsplit(":", 1)[1])
        for p in self.procs:
            if p.poll() is None and any(
                s.status == "LISTEN" and s.laddr.port == port
                for s in psutil.Process(p.pid).net_connections()
            ):
                return p
        raise AssertionError(f"no process serves nanny {nanny}")

    @staticmethod
    def kill(proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL every process of that worker's host: nanny (and its host supervisor),
        worker, host process."""
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:  # (multiprocessing's resource tracker lives on: it removes the nanny's
                if "resource_tracker" not in " ".join(p.cmdline()):  # semaphores, as a
                    p.send_signal(signal.SIGKILL)  # dead machine's /dev/shm would go)
            except psutil.NoSuchProcess:
                pass
        proc.wait(30)

    def close(self) -> None:
        """Close the workers that live gracefully (their hosts remove what they hold)."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                self.kill(p)
