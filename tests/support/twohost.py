"""Two hosts on one machine: a second "host" in a network namespace.

:class:`TwoHosts` builds, and tears down completely:

* a veth pair with a link-local pair of addresses, ``169.254.77.(4k+1)`` (this
  host) and ``169.254.77.(4k+2)`` (the second host), the first ``/30`` block of
  169.254.77.0/24 that no interface uses yet (so fixtures can nest); no other
  address is ever a target;
* a network namespace holding the second end, entered with ``unshare --uts
  --mount``: its own hostname (``ddict-host2``) and its own tmpfs on
  ``/dev/shm``, so nothing is shared with this host but the wire;
* a ``dask scheduler`` and one ``dask worker`` (with its nanny) on this host,
  bound to the first address, and one ``dask worker`` on the second host, bound
  to the second, joining that scheduler.

Processes "on host 2" (:meth:`TwoHosts.on_host2`) join the second worker's
namespaces with ``nsenter``: its network, hostname and ``/dev/shm``.

Needs root (CI runs as root), ``ip`` and ``unshare``; :func:`unavailable` says
why not otherwise.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Self

from tests.support.paths import pythonpath
from tests.support.polling import poll_for

HOSTNAME2 = "ddict-host2"

#: ``DDICT_TEST_TWO_HOSTS=1``: the session cluster spans two hosts (this one and a network
#: namespace, :class:`TwoHosts`), so dictionaries of the core tests span both.
TWO_HOSTS = os.environ.get("DDICT_TEST_TWO_HOSTS") == "1"


#: Dask's command line in the environment that runs the tests (not whatever ``dask`` is on
#: PATH: a virtual environment need not be activated).
DASK = (sys.executable, "-m", "dask")


def _free_pair() -> tuple[str, str]:
    """The first 169.254.77.x/30 block that no interface uses: (this host, host 2)."""
    shown = subprocess.run(
        ["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    for k in range(64):
        first, second = f"169.254.77.{4 * k + 1}", f"169.254.77.{4 * k + 2}"
        if f" {first}/" not in shown:
            return first, second
    raise RuntimeError("no free 169.254.77.x/30 block for the two-host fixture")


def unavailable() -> str | None:
    """Why the two-host fixture cannot run here, or ``None``."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and veth pairs)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool!r} (iproute2, util-linux)"
    return None


def run_command(*cmd: str) -> None:
    """Run ``cmd`` (an ``ip`` or ``unshare`` step), failing if it fails."""
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


class Processes:
    """The processes a fixture starts (each in a session of its own, its output in a log
    of its temporary folder), a scheduler among them."""

    def __init__(self, prefix: str) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix=prefix))
        self.scheduler_file = str(self.tmp / "scheduler.json")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def kill(self, name: str, sig: int = signal.SIGTERM) -> None:
        """Stop one of the processes (and everything it started)."""
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        time.sleep(0.5)  # its children (nanny, worker, host process) follow their group
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _launch(self, name: str, cmd: list[str]) -> None:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env()
        )

    def _wait(self, ready: Any, what: str, timeout: float = 60) -> None:
        poll_for(ready, timeout, f"{type(self).__name__}: {what}; logs in {self.tmp}", 0.2)

    @property
    def scheduler_address(self) -> str:
        return str(json.loads(Path(self.scheduler_file).read_text())["address"])

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def env(self) -> dict[str, str]:
        """Tests' modules importable everywhere (task functions are pickled by reference)."""
        return {**os.environ, "PYTHONPATH": pythonpath()}


class TwoHosts(Processes):
    """See the module docstring.  Use as a context manager."""

    def __init__(self, *, security_args: tuple[str, ...] = ()) -> None:
        super().__init__("ddict-twohost-")
        tag = secrets.token_hex(3)
        self.netns = f"ddict-h2-{tag}"
        self.veth = (f"ddv{tag}a", f"ddv{tag}b")
        self.security_args = security_args
        self.host1 = self.host2 = ""

    def __repr__(self) -> str:
        return f"<TwoHosts {self.netns} {sorted(self.procs)}>"

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        self._network()
        self._start(
            "scheduler",
            [
                *DASK,
                "scheduler",
                "--host",
                self.host1,
                "--port",
                "0",
                "--dashboard-address",
                f"{self.host1}:0",
                "--scheduler-file",
                self.scheduler_file,
                *self.security_args,
            ],
        )
        self._wait(lambda: os.path.exists(self.scheduler_file), "the scheduler file")
        self._start("worker1", [*self._worker(), "--host", self.host1, "--name", "host1-worker"])
        self.start_host2()

    def close(self) -> None:
        for name in ("worker2", "worker1", "scheduler"):
            self.kill(name)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.veth[0]], capture_output=True, timeout=30)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def start_host2(self) -> None:
        """(Re)start the second host: a fresh namespace mount, so an empty /dev/shm."""
        self._start(
            "worker2",
            [
                "ip",
                "netns",
                "exec",
                self.netns,
                "unshare",
                "--uts",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                f"hostname {HOSTNAME2} && mount -t tmpfs -o size=1g tmpfs /dev/shm && "
                f"exec {' '.join(self._worker())} --host {self.host2} --name host2-worker",
            ],
        )

    # -- helpers -----------------------------------------------------------------------

    def _worker(self) -> list[str]:
        return [
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
            *self.security_args,
        ]

    def _network(self) -> None:
        a, b = self.veth
        self.host1, self.host2 = _free_pair()
        run_command("ip", "netns", "add", self.netns)
        run_command("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        run_command("ip", "link", "set", b, "netns", self.netns)
        run_command("ip", "addr", "add", f"{self.host1}/30", "dev", a)
        run_command("ip", "link", "set", a, "up")
        run_command(
            "ip", "netns", "exec", self.netns, "ip", "addr", "add", f"{self.host2}/30", "dev", b
        )
        run_command("ip", "netns", "exec", self.netns, "ip", "link", "set", b, "up")
        run_command("ip", "netns", "exec", self.netns, "ip", "link", "set", "lo", "up")

    def _start(self, name: str, cmd: list[str]) -> None:
        self._launch(name, cmd)

    def host2_pid(self) -> int:
        """A process inside the second host's namespaces (its worker's shell, then worker)."""
        return self.procs["worker2"].pid

    def on_host2(self, code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run Python ``code`` on the second host: its network, hostname and /dev/shm."""
        return subprocess.run(
            self.python_on(2, code), capture_output=True, text=True, timeout=timeout, env=self.env()
        )

    def python_on(self, host: int, code: str) -> list[str]:
        """The command line that runs Python ``code`` on host 1 or 2."""
        command = [sys.executable, "-c", code]
        if host == 1:
            return command
        return ["nsenter", "--target", str(self.host2_pid()), "--net", "--uts", "--mount", *command]

    def popen(self, host: int, code: str) -> subprocess.Popen[str]:
        """Start Python ``code`` on host 1 or 2 (stdout and stderr piped)."""
        return subprocess.Popen(
            self.python_on(host, code),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env(),
        )
