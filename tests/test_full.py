"""A value too large for its shard, or a full shard, says which dictionary and manager, the
shard's real size, and what to do about it."""

from __future__ import annotations

import re

import numpy as np
import pytest

from dask_ddict import DDict, DDictFullError

MiB = 1 << 20


def test_a_value_too_large_names_the_real_shard_size(client):
    """100 MiB into 64 MiB over 2 managers: each shard holds 32 MiB, not the transport's
    64 MiB floor, and the remedy is a total_mem that would hold it."""
    d = DDict(total_mem="64 MiB", client=client)
    try:
        assert d._core.layout.num_managers == 2
        big = np.zeros(100 * MiB, dtype="u1")
        mid = d.which_manager("big")
        with pytest.raises(DDictFullError) as e:
            d["big"] = big
        text = str(e.value)
        assert f"DDict {d.get_name()!r} manager {mid}:" in text
        assert "each of its 2 managers' shards holds 33554432 bytes" in text
        assert "puts may fill 30198988" in text and "manager_pool_full_thresh" in text
        assert "total_mem of at least" in text and "67108864 bytes" not in text
        with pytest.raises(DDictFullError, match="every manager: .* cannot fit"):
            d.bput("big", big)
        d.start_batch_put()
        d["big"] = big  # refused before it is sent; said at the batch's end, as the spec wants
        d.bput("big", big)
        d["small"] = 1  # the batch goes on
        with pytest.raises(DDictFullError, match=f"manager {mid}: .* cannot fit"):
            d.end_batch_put()  # the batch's first error
        assert "big" not in d and len(d) == 1 and d["small"] == 1
    finally:
        d.destroy()


@pytest.mark.parametrize("value_bytes", [8 << 10, 256 << 10], ids=["direct put", "host put"])
def test_a_full_shard_names_dictionary_manager_threshold_and_remedy(client, value_bytes):
    """Small values are committed by the client itself (same host), larger ones by the
    manager: both say the same."""
    d = DDict(total_mem="8 MiB", client=client)  # 2 shards of 4 MiB: puts fill 3.6 MiB
    one = d.manager(1)
    try:
        with pytest.raises(DDictFullError) as e:
            for i in range(4 * MiB // value_bytes + 2):
                one[i] = np.ones(value_bytes // 8)
        text = str(e.value)
        said = re.search(
            f"DDict {d.get_name()!r} manager 1: shard is full: a (\\d+)-byte put "
            r"does not fit: the shard holds (\d+) of the 3774873 bytes puts may fill "
            r"\(90% of its 4194304: manager_pool_full_thresh=0.9\)",
            text,
        )
        assert said, text
        put, held = map(int, said.groups())
        # The put's own size (its value, pickled, and its key), not the shard's total after it...
        assert value_bytes < put < value_bytes + 512
        # ...and what the shard holds: too much for this put to fit under the threshold.
        assert 3774873 - 2 * value_bytes < held and held + put > 3774873 - 1024
        assert "larger total_mem" in text and "higher manager_pool_full_thresh" in text
        assert len(d.manager(0)) == 0 and len(one) == i  # every put before it stored
    finally:
        d.destroy()


def test_a_full_shard_in_a_batch_names_its_manager(client):
    d = DDict(total_mem="8 MiB", client=client)
    zero = d.manager(0)
    try:
        zero.start_batch_put()
        for i in range(40):
            zero[i] = np.ones(32 << 10)  # 256 KiB each, 10 MiB in all
        with pytest.raises(
            DDictFullError,
            match=f"DDict {d.get_name()!r} manager 0: shard is full: .*larger total_mem",
        ):
            zero.end_batch_put()
    finally:
        d.destroy()


def test_a_full_map_names_the_puts_size_and_the_map(tmp_path):
    """Beyond the threshold's check, LMDB's map itself may fill (a put sent by a writer
    that skipped it): the message names the put and the map, not a total."""
    from dask_ddict._hashing import key_digest
    from dask_ddict.shard.store import ShardStore

    st = ShardStore(str(tmp_path / "s"), 1 << 20)
    try:
        with pytest.raises(DDictFullError) as e, st.write() as txn:
            st.put(txn, key_digest(b"b"), 0, b"b", bytes(3 << 20))
        text = str(e.value)
        said = re.search(
            r"shard is full: a (\d+)-byte put does not fit: the shard's map of "
            r"1048576 bytes is full \(its pages reach (\d+) bytes\)",
            text,
        )
        assert said, text
        put, reach = map(int, said.groups())
        assert put == (3 << 20) + 1 and 0 < reach <= ShardStore.map_size_for(1 << 20)
    finally:
        st.destroy()
