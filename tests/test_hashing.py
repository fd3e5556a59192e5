from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

from dask_ddict._hashing import custom_placement, key_digest, manager_for_digest
from dask_ddict._keys import dumps_key


def test_digest_is_stable_across_processes():
    keys = ["alpha", 12345, ("t", 1), b"raw", 2.5]
    here = [manager_for_digest(key_digest(dumps_key(k)), 7) for k in keys]
    code = (
        "from dask_ddict._hashing import key_digest, manager_for_digest;"
        "from dask_ddict._keys import dumps_key;"
        f"print([manager_for_digest(key_digest(dumps_key(k)), 7) for k in {keys!r}])"
    )
    # A different PYTHONHASHSEED changes hash(str) but must not change placement.
    env = {"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert eval(out.stdout) == here


def test_keys_spread_over_managers():
    counts = [0] * 4
    for i in range(4000):
        counts[manager_for_digest(key_digest(dumps_key(i)), 4)] += 1
    assert min(counts) > 800


@dataclass(frozen=True)
class Placed:
    worker: int

    def __hash__(self) -> int:
        return self.worker


class PlainSub(int):
    pass


def test_user_defined_hash_is_used():
    assert custom_placement(Placed(5), 4) == 1
    assert custom_placement(Placed(6), 4) == 2


def test_builtin_and_inherited_hashes_are_not_custom():
    for k in ["s", 1, 1.5, (1, 2), b"b", PlainSub(3), frozenset({1})]:
        assert custom_placement(k, 4) is None
