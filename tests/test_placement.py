"""One placement everywhere: a key put from any process is found from every other."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dask_ddict import DDict
from dask_ddict._keys import encode_key
from tests.support.fuzz import fuzz
from tests.support.keys import keys
from tests.support.piped import PipeProcess

_READER = """
from dask_ddict import DDict

def handle(arg):
    h, ks = arg
    d = DDict.attach(h)
    try:
        return [d.get(k, None) for k in ks]
    finally:
        d.detach()
"""


@pytest.fixture(scope="module")
def reader():
    """A second client process, with its own str-hash seed, that reads keys by handle."""
    proc = PipeProcess(_READER, PYTHONHASHSEED="977")
    yield lambda handle, ks: proc.call((handle, ks))
    assert proc.close() == 0


def _read_in_task(handle, ks):
    d = DDict.attach(handle)
    try:
        return [d.get(k, None) for k in ks], sorted(map(encode_key, d.keys()))
    finally:
        d.detach()


scalars = st.sampled_from([np.float64(1.5), np.int64(-2), np.uint8(7), np.bool_(True)])


@fuzz(8)
@given(st.lists(keys | scalars, min_size=1, max_size=25, unique_by=encode_key))
def test_keys_put_by_the_client_are_found_by_tasks_and_other_processes(ddict, client, reader, ks):
    for k in list(ddict.keys()):
        del ddict[k]
    for i, k in enumerate(ks):
        ddict[k] = i
    want = list(range(len(ks)))
    got, there = client.submit(_read_in_task, ddict.serialize(), ks, pure=False).result()
    assert got == want
    assert there == sorted(map(encode_key, ks))  # keys() decodes to the same keys
    assert reader(ddict.serialize(), ks) == want


_SCRIPT = """
import json, sys, warnings
from distributed import Client
from dask_ddict import DDict

class Tag:  # a __main__ class: rebuilt by value in tasks
    def __init__(self, n):
        self.n = n

class Named:  # placed by a str-based __hash__ (Dragon's rule)
    def __init__(self, name):
        self.name = name
    def __hash__(self):
        return hash(self.name)
    def __eq__(self, other):
        return self.name == other.name

def read(handle, ks):
    d = DDict.attach(handle)
    return [d.get(k, None) for k in ks], sorted(t.n for t in d.keys() if type(t).__name__ == "Tag")

with Client(sys.argv[1]) as client:
    d = DDict.attach(sys.argv[2], client=client)
    tags = [Tag(i) for i in range(5)]
    named = [Named(f"key-{i}") for i in range(20)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, k in enumerate(tags + named):
            d[k] = i
    got, tag_ids = client.submit(read, d.serialize(), tags + named, pure=False).result()
    found = sum(g == i for i, g in enumerate(got))
    seed_warnings = [str(w.message) for w in caught if "PYTHONHASHSEED" in str(w.message)]
    print(json.dumps([found, tag_ids, seed_warnings]))
"""


@pytest.mark.parametrize("seed", ["6640", "123", None])
def test_main_classes_and_user_hashes_across_processes(ddict, client, seed):
    """A script's classes work in tasks; a user ``__hash__`` under another seed (or none:
    a random one) warns, naming the workers' seed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, client.scheduler.address, ddict.serialize()],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    found, tags, warned = json.loads(out.stdout.splitlines()[-1])
    assert tags == [0, 1, 2, 3, 4]  # keys() in the task decodes the script's __main__.Tag
    if seed == "6640":  # the nanny's seed: the script hashes as the workers do
        assert (found, warned) == (25, [])
    else:
        assert found >= 5  # the __main__ keys are placed by digest: always found
        assert len(warned) == 1 and "PYTHONHASHSEED=6640" in warned[0]
