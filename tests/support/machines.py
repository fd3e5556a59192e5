"""Several machines on this one, and partitions between them (for ``test_partitions.py``).

:class:`Machines` builds, and tears down completely:

* a bridge in this (the test's) network namespace, with the first free
  ``169.254.(80+k).0/24`` block's ``.1``: this namespace is machine ``s``, where the
  scheduler and one ``dask worker`` run;
* for each other machine (``a``, ``b``, ``c``...) a network namespace with a veth into
  the bridge and the address ``.(10 + i)``, and an *anchor* process in new UTS and
  mount namespaces (its own hostname ``ddict-<name>`` and tmpfs on ``/dev/shm``,
  which outlive the processes started there: a worker restarted on a machine finds
  its shared memory).  Processes run there with ``nsenter`` into the anchor's
  namespaces.

:meth:`Machines.cut` partitions two machines (both ways: a blackhole route to the
other's address in each one's namespace; for ``s``, in this namespace, which only its
own processes use: traffic between other machines crosses the bridge untouched) and
:meth:`Machines.heal` ends it.  No packet ever leaves for an address the fixture did
not make.  Needs root, ``ip``, ``unshare`` and ``nsenter`` (:func:`twohost.unavailable`).
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import subprocess
import sys

from tests.support.twohost import DASK, Processes, run_command

#: The scheduler's machine: this network namespace.
S = "s"


def _free_block() -> int:
    """A ``169.254.(80+k).0/24`` that no interface uses: ``80 + k`` (one at random of the
    free ones, so that fixtures started at once rarely pick the same)."""
    shown = subprocess.run(
        ["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    free = [k for k in range(80, 120) if f" 169.254.{k}." not in shown]
    if not free:
        raise RuntimeError("no free 169.254.x.0/24 block for the machines fixture")
    return random.choice(free)


class Machines(Processes):
    """See the module docstring.  Use as a context manager.

    Parameters
    ----------
    names
        The machines besides ``s`` (this one).
    workers
        The machines that run a ``dask worker`` (with its nanny); ``s`` runs the
        scheduler in any case.
    env
        Environment variables for every process the fixture starts (e.g. ``DASK_DDICT__``
        settings: the scheduler's are the orchestrator's).
    """

    def __init__(
        self,
        names: tuple[str, ...] = ("a", "b", "c"),
        workers: tuple[str, ...] = (S, "a", "b"),
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__("ddict-machines-")
        self.tag = secrets.token_hex(3)
        self.names = names
        self.workers = workers
        self.extra_env = dict(env or {})
        self.bridge = f"ddb{self.tag}"
        self.ip: dict[str, str] = {}
        self.netns: dict[str, str] = {}
        self.anchors: dict[str, subprocess.Popen[bytes]] = {}
        self.blackholes: set[tuple[str, str]] = set()  # (machine, address blackholed there)

    def __repr__(self) -> str:
        return f"<Machines {self.ip} cut={sorted(self.blackholes)}>"

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        self._network()
        self._start(
            "scheduler",
            S,
            [
                *DASK,
                "scheduler",
                "--host",
                self.ip[S],
                "--port",
                "0",
                "--no-dashboard",
                "--scheduler-file",
                self.scheduler_file,
            ],
        )
        self._wait(lambda: os.path.exists(self.scheduler_file), "the scheduler file")
        for m in self.workers:
            self.start_worker(m)

    def close(self) -> None:
        for name in list(self.procs):
            self.kill(name)
        for proc in self.anchors.values():
            proc.kill()
            proc.wait(30)
        self.anchors.clear()
        for machine, address in list(self.blackholes):
            self._route("del", machine, address)
        for ns in self.netns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def start_worker(self, machine: str) -> None:
        self._start(
            f"worker-{machine}",
            machine,
            [
                *DASK,
                "worker",
                "--scheduler-file",
                self.scheduler_file,
                "--nworkers",
                "1",
                "--nthreads",
                "2",
                "--memory-limit",
                "2GiB",
                "--no-dashboard",
                "--host",
                self.ip[machine],
                "--name",
                f"worker-{machine}",
            ],
        )

    # -- partitions -------------------------------------------------------------------

    def cut(self, one: str, other: str) -> None:
        """Nothing passes between machines ``one`` and ``other`` (either way) until
        :meth:`heal`: connections between them time out, as across a broken switch."""
        for here, there in ((one, other), (other, one)):
            if (here, self.ip[there]) not in self.blackholes:
                self._route("add", here, self.ip[there])
                self.blackholes.add((here, self.ip[there]))

    def heal(self) -> None:
        """End every partition."""
        for machine, address in list(self.blackholes):
            self._route("del", machine, address)
            self.blackholes.discard((machine, address))

    def _route(self, verb: str, machine: str, address: str) -> None:
        cmd = ["ip", "route", verb, "blackhole", f"{address}/32"]
        if machine != S:
            cmd = ["ip", "netns", "exec", self.netns[machine], *cmd]
        subprocess.run(cmd, capture_output=True, timeout=30, check=verb == "add")

    # -- helpers -----------------------------------------------------------------------

    def _network(self) -> None:
        k = _free_block()
        self.ip[S] = f"169.254.{k}.1"
        run_command("ip", "link", "add", self.bridge, "type", "bridge")
        run_command("ip", "addr", "add", f"{self.ip[S]}/24", "dev", self.bridge)
        run_command("ip", "link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            ns, outer, inner = (
                f"ddm{self.tag}{name}",
                f"ddm{self.tag}{name}o",
                f"ddm{self.tag}{name}i",
            )
            self.netns[name], self.ip[name] = ns, f"169.254.{k}.{10 + i}"
            run_command("ip", "netns", "add", ns)
            run_command("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            run_command("ip", "link", "set", inner, "netns", ns)
            run_command("ip", "link", "set", outer, "master", self.bridge)
            run_command("ip", "link", "set", outer, "up")
            run_command(
                "ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.ip[name]}/24", "dev", inner
            )
            run_command("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
            run_command("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            self.anchors[name] = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "unshare",
                    "--uts",
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    f"hostname ddict-{name} && mount -t tmpfs -o size=1g "
                    "tmpfs /dev/shm && exec sleep infinity",
                ],
                start_new_session=True,
            )
        for name in self.names:  # (its namespaces are ready once its hostname is)
            self._wait(
                lambda name=name: (
                    subprocess.run(
                        self.on(name, ["hostname"]), capture_output=True, text=True, timeout=30
                    ).stdout.strip()
                    == f"ddict-{name}"
                ),
                f"machine {name}",
            )

    def on(self, machine: str, command: list[str]) -> list[str]:
        """``command`` run on ``machine`` (its network, hostname and /dev/shm)."""
        if machine == S:
            return command
        anchor = self.anchors[machine].pid
        # (the anchor is `ip netns exec`'s child once it exec'd sh then sleep: its pid)
        return ["nsenter", "--target", str(_leaf(anchor)), "--net", "--uts", "--mount", *command]

    def popen(
        self, machine: str, code: str, *args: str, name: str = "python"
    ) -> subprocess.Popen[str]:
        """Start Python ``code`` on ``machine``: its stdout piped, its stderr to the log
        ``name`` (:meth:`log`)."""
        with open(self.tmp / f"{name}.log", "wb") as log:
            return subprocess.Popen(
                self.on(machine, [sys.executable, "-c", code, *args]),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=self.env(),
                start_new_session=True,
            )

    def _start(self, name: str, machine: str, cmd: list[str]) -> None:
        self._launch(name, self.on(machine, cmd))

    def env(self) -> dict[str, str]:
        return {**super().env(), **self.extra_env}


def _leaf(pid: int) -> int:
    """The innermost descendant of ``pid`` along its only children (the anchor's
    ``sleep``, inside every namespace it made)."""
    import psutil

    proc = psutil.Process(pid)
    while True:
        children = proc.children()
        if len(children) != 1:
            return proc.pid
        proc = children[0]
