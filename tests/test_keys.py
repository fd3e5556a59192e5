"""Canonical key bytes: one key, one encoding, in every process and under every hash seed."""

from __future__ import annotations

import collections
import os
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given

from dask_ddict._hashing import HASH_PROBE, probe_hash, seed_warning
from dask_ddict._keys import dumps_key, encode_key, loads_key
from dask_ddict.errors import DDictSerializationError
from tests.support.fuzz import fuzz
from tests.support.keys import keys
from tests.support.piped import PipeProcess


@pytest.fixture(scope="module")
def other_seed():
    """A process with another str-hash seed that encodes the keys it is sent."""
    proc = PipeProcess("from dask_ddict._keys import encode_key as handle", PYTHONHASHSEED="977")
    yield proc.call
    assert proc.close() == 0


@fuzz(300)
@given(keys)
def test_canonical_bytes_are_the_same_under_another_hash_seed(other_seed, key):
    assert os.environ.get("PYTHONHASHSEED") != "977"
    b = encode_key(key)
    assert other_seed(key) == b
    assert loads_key(b) == key


def test_sets_and_dicts_do_not_depend_on_order_or_identity(other_seed):
    words = [f"w{i}" for i in range(50)]
    assert encode_key(set(words)) == encode_key(set(reversed(words)))
    assert encode_key({"a": 1, "b": 2}) == encode_key({"b": 2, "a": 1})
    shared = "a" + "b" * 3
    assert encode_key((shared, shared)) == encode_key(("ab" + "bb", "abbb"))
    for key in [frozenset(words), {"s": set(words)}, (frozenset(words), {1: set(words)})]:
        assert other_seed(key) == encode_key(key)


class Box:
    """A key class with state, pickled by reference."""

    def __init__(self, items):
        self.items = items

    def __eq__(self, other):
        return type(other) is Box and other.items == self.items


Point = collections.namedtuple("Point", "x y")


def test_objects_sets_in_state_and_subclasses_are_canonical(other_seed):
    words = {f"w{i}" for i in range(20)}
    for key in [
        Box(set(words)),
        Point(frozenset(words), 1),
        collections.Counter(words),
        np.float64(2.5),
        np.int32(-3),
        np.datetime64("2026-11-23"),
    ]:
        b = encode_key(key)
        assert loads_key(b) == key
        assert other_seed(key) == b
    assert len({encode_key(1), encode_key(1.0), encode_key(True), encode_key(np.int64(1))}) == 4


def test_keys_that_cannot_be_canonical_are_refused():
    cyclic: list = []
    cyclic.append(cyclic)
    with pytest.raises(DDictSerializationError, match="cyclic"):
        encode_key(cyclic)
    with pytest.raises(TypeError, match="by reference"):
        encode_key(lambda: 1)

    def local():
        class Local:
            pass

        return Local()

    with pytest.raises(TypeError, match="Local"):
        encode_key(local())


class IntPickler:
    def dumps(self, key):
        return hash(key)

    def loads(self, data):
        return data


class ViewPickler:
    def dumps(self, key):
        return memoryview(key.encode())

    def loads(self, data):
        return bytes(data).decode()


def test_custom_key_pickler_must_return_bytes():
    with pytest.raises(TypeError, match="bytes-like.*int"):
        dumps_key("a", IntPickler())
    assert dumps_key("ab", ViewPickler()) == b"ab"


_MAIN_SCRIPT = """
from dask_ddict._keys import encode_key, loads_key
import cloudpickle, pickle, sys

class Tag:
    def __init__(self, n):
        self.n = n
    def __eq__(self, other):
        return type(other).__name__ == "Tag" and other.n == self.n

# A task sees the class rebuilt by value (cloudpickle): the bytes must not change.
code = cloudpickle.dumps(lambda: encode_key(Tag(7)))
sys.stdout.buffer.write(encode_key(Tag(7)) + b"|" + pickle.loads(code)() + b"|" + code)
"""


def test_classes_of_main_are_written_by_name(tmp_path):
    out = subprocess.run([sys.executable, "-c", _MAIN_SCRIPT], capture_output=True, check=True)
    here, there, code = out.stdout.split(b"|", 2)
    assert here == there
    # In a process without __main__.Tag, the same function (by value) encodes the same bytes...
    assert pickle.loads(code)() == here
    # ... and the key decodes there, from the class it encoded.
    assert loads_key(here).n == 7


class Seeded:
    def __init__(self, name):
        self.name = name

    def __hash__(self):
        return hash(self.name)


def test_hash_seed_warning_compares_real_hashes_and_names_the_fix(monkeypatch):
    mine = probe_hash()
    assert mine == hash(HASH_PROBE)
    monkeypatch.setenv("PYTHONHASHSEED", "6640")  # what the nanny writes into os.environ...
    text = seed_warning(Seeded, [mine + 1], "6640")  # ...says nothing about this process
    assert "PYTHONHASHSEED=6640" in text and "hashlib" in text and "Seeded" in text
    assert "<the workers' seed>" in seed_warning(Seeded, [mine + 1], "")  # no hint: no number
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert seed_warning(Seeded, [mine], "977") is None  # same hash(): the hint is moot
        assert seed_warning(Seeded, []) is None  # the workers' hashes unknown: nothing to compare
    # A class that declares its hash stable (no str/bytes hash in it) is never warned about.
    stable = type("Stable", (Seeded,), {"ddict_stable_hash": True})
    assert seed_warning(stable, [mine + 1], "6640") is None
    assert seed_warning(stable, [mine, mine + 1]) is None
    # Workers that disagree among themselves: said even to a process equal to one of them.
    both = seed_warning(Seeded, [mine, mine + 1], "")
    assert "disagree" in both and "2 different" in both and "PYTHONHASHSEED" in both


class KwNew:
    """A key class built with keyword arguments (pickled through ``__newobj_ex__``)."""

    def __new__(cls, *, tags):
        self = super().__new__(cls)
        self.tags = tags
        return self

    def __getnewargs_ex__(self):
        return (), {"tags": self.tags}

    def __eq__(self, other):
        return type(other) is KwNew and other.tags == self.tags


def test_keys_built_with_keyword_arguments(other_seed):
    key = KwNew(tags=frozenset(f"t{i}" for i in range(10)))
    b = encode_key(key)
    assert loads_key(b) == key and other_seed(key) == b
