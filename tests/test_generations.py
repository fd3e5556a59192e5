"""Generation words alone: a real shared file, two mappings of it, no cluster."""

from __future__ import annotations

import os
import stat

import pytest

from dask_ddict.shard.generations import Generations, path_for


def test_a_bump_is_seen_through_every_mapping_and_never_repeats(tmp_path):
    path = path_for(str(tmp_path), "ab" * 16)
    host = Generations(path, 3, create=True)
    client = Generations(path)  # as a same-host client maps it: size from the file
    try:
        assert len(client.words) == 3 and host.get(1) == 0
        seen = set()
        for _ in range(200):
            client.bump(1)  # a direct put's commit
            word = host.get(1)
            assert word and word not in seen and host.get(0) == host.get(2) == 0
            seen.add(word)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        client.close()
        host.close()
    assert host.get(1) == 0  # a closed mapping reads 0: never a kept answer's word


def test_a_client_never_creates_the_file(tmp_path):
    with pytest.raises(OSError):
        Generations(path_for(str(tmp_path), "cd" * 16))
    assert os.listdir(tmp_path) == []
