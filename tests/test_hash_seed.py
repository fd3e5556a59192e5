"""The hash-seed check compares real ``hash()`` values, in every setup that places keys.

A key whose class defines ``__hash__`` goes to ``hash(key) % managers``; that is the same
in two processes only if their ``str``/``bytes`` hashes agree.  The check must decide from
what ``hash()`` returns, never from ``PYTHONHASHSEED`` in ``os.environ``: a process that
starts a ``LocalCluster`` has that variable set by the nanny (for its workers) although its
own seed is still random.  The cases with a known seed run the client in a subprocess
with a controlled environment; the one in this process asserts what this process's own
``hash()`` implies, so every assertion holds whether pytest runs with a seed or not.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

from dask_ddict import DDict
from dask_ddict._hashing import HASH_PROBE
from tests.support.cluster import local_cluster


class Named:
    """A key class placed by a str-based ``__hash__`` (Dragon's rule); the scripts too."""

    def __init__(self, name):
        self.name = name

    def __hash__(self):
        return hash(self.name)

    def __eq__(self, other):
        return isinstance(other, Named) and self.name == other.name


_NAMED = inspect.getsource(Named)

#: Starts its own LocalCluster in this process (the most common setup), puts 20 keys placed
#: by their __hash__, and reads them back from a task.
_OWN_CLUSTER = (
    _NAMED
    + """
import json, warnings
from distributed import Client, LocalCluster
from dask_ddict import DDict
from dask_ddict._hashing import HASH_PROBE

def read(d, ks):
    return sum(d.get(k) == i for i, k in enumerate(ks))

if __name__ == "__main__":
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cl, \\
            Client(cl) as client:
        d = DDict(total_mem="32 MiB", client=client)
        ks = [Named(f"key-{i}") for i in range(20)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, k in enumerate(ks):
                d[k] = i
            d[Named("once more")] = -1  # warned once per process and dictionary
        found = client.submit(read, d, ks, pure=False).result()
        workers = sorted(set(client.run(hash, HASH_PROBE).values()))
        warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        print(json.dumps([found, warned, hash(HASH_PROBE) in workers]))
        d.destroy()
"""
)


def _run(script: str, seed: str | None, *args: str) -> list:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    with open(os.devnull) as devnull:
        out = subprocess.run(
            [sys.executable, "-c", script, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=240,
            stdin=devnull,
        )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "seed", [None, pytest.param("123", marks=pytest.mark.slow), "6640"]
)  # (None: differs too)
def test_a_client_with_its_own_local_cluster(seed):
    """No seed: random; 123: not the workers' (the nanny gives them 6640, and writes 6640
    into this process's environment); 6640: the workers' seed, so no warning."""
    found, warned, same = _run(_OWN_CLUSTER, seed)
    if seed == "6640":
        assert same and found == 20 and warned == []
        return
    assert not same  # the process really hashes differently from its workers...
    assert found < 20  # ...so tasks miss keys it put (all 20 agree with probability 2**-20)
    assert len(warned) == 1, warned  # ...and it says so, once
    assert "PYTHONHASHSEED=6640" in warned[0] and "Named" in warned[0]


def _found_in_task(d, ks):
    return sum(d.get(k) == i for i, k in enumerate(ks))


def test_the_test_process_with_the_session_cluster(ddict, client):
    """This process (with or without PYTHONHASHSEED) warns exactly when its hash differs."""
    import warnings

    workers = set(client.run(hash, HASH_PROBE).values())
    assert len(workers) == 1  # the nanny gives every worker one seed
    assert set(ddict._core.layout.hash_probes) == workers  # what the workers reported
    ks = [Named(f"key-{i}") for i in range(20)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, k in enumerate(ks):
            ddict[k] = i
    warned = [str(w.message) for w in caught if "PYTHONHASHSEED" in str(w.message)]
    found = client.submit(_found_in_task, ddict, ks, pure=False).result()
    if hash(HASH_PROBE) in workers:  # pytest runs with the workers' seed
        assert (found, warned) == (20, [])
    else:
        assert found < 20 and len(warned) == 1


_NO_NANNY_CLIENT = (
    _NAMED
    + """
import json, sys, warnings
from distributed import Client
from dask_ddict import DDict

with Client(sys.argv[1]) as client:
    client.wait_for_workers(2, timeout=120)
    d = DDict(total_mem="32 MiB", client=client)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d[Named("a")] = 1
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    print(json.dumps([len(set(d._core.layout.hash_probes)), warned]))
    d.destroy()
"""
)


def test_workers_that_disagree_among_themselves(tmp_path):
    """Workers without a nanny and with different seeds place such keys differently from
    one another: every process that places one is told, whatever its own seed."""

    with local_cluster(0) as cl:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "distributed.cli.dask_worker",
                    cl.scheduler_address,
                    "--no-nanny",
                    "--nthreads",
                    "1",
                    "--no-dashboard",
                    "--local-directory",
                    str(tmp_path / seed),
                ],
                env={**os.environ, "PYTHONHASHSEED": seed},
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for seed in ("1", "2")
        ]
        try:
            distinct, warned = _run(_NO_NANNY_CLIENT, "1", cl.scheduler_address)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
    assert distinct == 2
    assert len(warned) == 1 and "disagree" in warned[0] and "PYTHONHASHSEED" in warned[0]


def test_a_dictionary_without_custom_hash_keys_never_checks(ddict):
    """Plain keys are placed by their digest: no hash seed matters, nothing is compared."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ddict["plain"] = 1
        ddict[("a", 1)] = 2
    assert not ddict._core.seed_checked
    assert isinstance(ddict, DDict)
