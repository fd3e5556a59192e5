"""Generation words alone: a real shared file, two mappings of it, no cluster."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from dask_ddict import kernels
from dask_ddict.kernels import pure
from dask_ddict.shard.generations import Generations, path_for

#: The commit hooks (the compiled one where it was built).
BUMPS = [pure.GenerationBump] + ([kernels.GenerationBump] if kernels.COMPILED else [])


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


@pytest.mark.parametrize("bump", BUMPS)
def test_a_hook_writes_where_the_words_are_now(tmp_path, bump):
    """A manager's commit hook writes an odd positive word, new each time, into the
    words its generations hold now: after ``close`` (the words read as zeros), no longer
    into the file."""
    path = path_for(str(tmp_path), "ab" * 16)
    host, other = Generations(path, 2, create=True), Generations(path)
    hook = bump(host, 1)
    try:
        words = set()
        for _ in range(100):
            hook()
            word = other.get(1)
            assert word > 0 and word % 2 and word not in words and other.get(0) == 0
            words.add(word)
        last = other.get(1)
        host.close()
        hook()
        assert other.get(1) == last  # (the file: unchanged)
        assert host.get(1) != 0 and host.words[0] == 0  # (the zeros took it)
    finally:
        other.close()
        host.close()


@pytest.mark.parametrize("bump", BUMPS)
def test_a_hook_of_a_manager_without_a_word_says_so(tmp_path, bump):
    gens = Generations(path_for(str(tmp_path), "ab" * 16), 2, create=True)
    try:
        with pytest.raises(IndexError, match="manager -1"):
            bump(gens, -1)
        with pytest.raises(IndexError, match="manager 2"):
            bump(gens, 2)()
        assert list(gens.words) == [0, 0]
    finally:
        gens.close()


@pytest.mark.skipif(not kernels.COMPILED, reason="the compiled hook's own generator")
def test_a_forked_child_draws_words_of_its_own():
    """The compiled hook's generator is seeded again in a forked child: a parent and a
    child that both commit never write the same words (one would hide the other's)."""

    class Words:
        words = np.zeros(1, dtype=np.int64)

    hook = kernels.GenerationBump(Words, 0)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child: its next words, to the parent)
        try:
            for _ in range(4):
                hook()
                os.write(write, int(Words.words[0]).to_bytes(8, "little"))
        finally:
            os._exit(0)
    os.close(write)
    try:
        got = b""
        while len(got) < 32:
            chunk = os.read(read, 32 - len(got))
            assert chunk, "the child ended early"
            got += chunk
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    child = {int.from_bytes(got[i : i + 8], "little") for i in range(0, 32, 8)}
    ours = set()
    for _ in range(4):
        hook()
        ours.add(int(Words.words[0]))
    assert len(child) == len(ours) == 4 and not child & ours
