"""DDict is a full ``collections.abc.MutableMapping``: CPython's own mapping tests, against
live dictionaries on the test cluster."""

from __future__ import annotations

import threading
from collections.abc import ItemsView, KeysView, MutableMapping, ValuesView

import numpy as np
import pytest
from test import mapping_tests

from dask_ddict import DDict
from tests.support.twohost import TWO_HOSTS


@pytest.fixture
def made():
    """Every dictionary a test made, destroyed at its end."""
    dicts: list[DDict] = []
    yield dicts
    for d in dicts:
        d.destroy()


@pytest.fixture
def protocol(client, made):
    class DDictMappingProtocol(mapping_tests.BasicTestMappingProtocol):
        def _empty_mapping(self):
            d = DDict(total_mem="8 MiB", client=client)
            made.append(d)
            return d

    return DDictMappingProtocol


TESTS = [n for n in dir(mapping_tests.BasicTestMappingProtocol) if n.startswith("test_")]


@pytest.mark.parametrize("name", TESTS)
def test_cpython_mapping_protocol(protocol, name):
    result = protocol(name).run()
    problems = [str(e[1]) for e in result.errors + result.failures]
    assert result.testsRun == 1 and problems == []


def test_isinstance_equality_setdefault_and_popitem(ddict, client):
    assert isinstance(ddict, MutableMapping)
    ddict.update({"a": np.arange(3)}, b=2)
    assert ddict == {"a": np.arange(3), "b": 2} and ddict != {"a": np.arange(3)}
    with pytest.raises(TypeError):
        hash(ddict)
    got = []

    def race():
        h = DDict.attach(ddict.serialize())
        got.append(h.setdefault("once", threading.get_ident()))
        h.detach()

    threads = [threading.Thread(target=race) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and ddict["once"] == got[0]  # one winner, seen by all
    seen = {}
    while len(ddict):
        k, v = ddict.popitem()
        seen[k] = v
    assert set(seen) == {"a", "b", "once"}
    with pytest.raises(KeyError):
        ddict.popitem()


def test_views_are_dict_views(ddict):
    data = {f"k{i}": i for i in range(20)}
    ddict.update(data)
    assert isinstance(ddict.keys(), KeysView) and isinstance(ddict.items(), ItemsView)
    assert isinstance(ddict.values(), ValuesView)
    assert ddict.keys() == data.keys() and ddict.items() == data.items()
    assert ddict.keys() & {"k1", "nope"} == {"k1"} and ddict.keys() - data.keys() == set()
    assert ("k3", 3) in ddict.items() and ("k3", 4) not in ddict.items() and 19 in ddict.values()
    here = set(ddict.local_managers)
    if not TWO_HOSTS:
        assert here == {0, 1}  # one host: every manager is local
    assert here and here <= {0, 1}
    local = {(k, v) for k, v in data.items() if ddict.which_manager(k) in here}
    assert set(ddict.local_items()) == local
    assert all((k in ddict.local_keys()) == (k in dict(local)) for k in ("k3", "k4", "k5"))
