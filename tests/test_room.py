"""Space comes back: a popped, deleted or cleared key's bytes, and the versions a retired
checkpoint leaves that no reader can see, are reusable by other keys at once.

A dictionary used as a queue or a cache (put, pop, put new keys) holds little and must
never fill up; so must an iterative program whose keys change from checkpoint to
checkpoint.  Real clusters, real shards.
"""

from __future__ import annotations

import numpy as np
import pytest

from dask_ddict import DDict

MiB = 1 << 20
#: A value of 256 KiB less LMDB's and the entry's headers: 64 pages, no page wasted.
VALUE = (256 << 10) - 256


def one_shard(client, **kw) -> DDict:
    return DDict(total_mem="32 MiB", client=client, n_workers=1, managers_per_worker=1, **kw)


def value(i: int, nbytes: int = VALUE) -> np.ndarray:
    return np.full(nbytes, i % 251, dtype="u1")


def count_for(d: DDict, fraction: float, nbytes: int = VALUE) -> int:
    return int(d.stats[0].total_bytes * fraction) // nbytes


@pytest.mark.parametrize("nbytes", [VALUE, 48 << 10], ids=["by the manager", "direct"])
def test_popped_keys_give_their_space_to_new_keys(client, nbytes):
    """Fill to 80%, pop everything, put as much under new keys: three rounds, no
    DDictFullError, and the shard's use falls back each time.  Values up to 64 KiB are
    committed by this process itself (same host), larger ones by the manager."""
    d = one_shard(client)
    try:
        n = count_for(d, 0.8 if nbytes == VALUE else 0.6, nbytes)  # (48 KiB takes 13 pages)
        for r in range(3):
            for i in range(n):
                d[f"r{r}-{i}"] = value(i, nbytes)
            full = d.stats[0].total_used_bytes
            assert full > 0.55 * d.stats[0].total_bytes
            for i in range(n):
                assert int(d.pop(f"r{r}-{i}")[0]) == i % 251
            assert len(d) == 0
            assert d.stats[0].total_used_bytes < 0.05 * full  # popped values are not kept
    finally:
        d.destroy()


def test_a_clear_gives_the_space_to_new_keys(client):
    d = one_shard(client)
    try:
        n = count_for(d, 0.8)
        for r in range(3):
            for i in range(n):
                d[f"r{r}-{i}"] = value(i)
            d.clear()
            assert len(d) == 0 and d.stats[0].total_used_bytes < MiB
    finally:
        d.destroy()


@pytest.mark.parametrize("how", ["one by one", "update"])
def test_versions_a_retired_checkpoint_left_give_their_space_to_new_keys(client, how):
    """working_set_size=2: 40% written at 0 and again at 1 (80% in all), then 40% of new
    keys at 2 (single puts, or many per request).  Writing at 2 retires 0, whose versions
    no reader can see any more: they make the room, and every reader still sees what it
    should."""
    d = one_shard(client, working_set_size=2)
    try:
        n = count_for(d, 0.4)
        for c in range(2):
            d.checkpoint_id = c
            for i in range(n):
                d[f"a{i}"] = value(c)
        d.checkpoint_id = 2
        if how == "update":
            d.update({f"b{i}": value(2) for i in range(n)})
        else:
            for i in range(n):
                d[f"b{i}"] = value(2)
        assert {int(d[f"a{i}"][0]) for i in range(n)} == {1}  # (the version at 1, seen at 2)
        assert {int(d[f"b{i}"][0]) for i in range(n)} == {2}
        d.checkpoint_id = 1
        assert {int(d[f"a{i}"][0]) for i in range(n)} == {1} and len(d) == n
    finally:
        d.destroy()


def test_a_truly_full_shard_still_says_so(client):
    """Room is made from dead versions only: live keys are never dropped to make it."""
    from dask_ddict import DDictFullError

    d = one_shard(client, working_set_size=2)
    try:
        n = count_for(d, 0.5)
        d.checkpoint_id = 1
        for i in range(n):
            d[f"a{i}"] = value(i)
        d.checkpoint_id = 2
        with pytest.raises(DDictFullError):
            for i in range(n):
                d[f"b{i}"] = value(i)
        assert all(int(d[f"a{i}"][0]) == i % 251 for i in range(n))
    finally:
        d.destroy()
