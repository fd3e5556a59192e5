"""Pin boards and the many-key reply format: pure pieces, no cluster."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from dask_ddict._serialize import FRAME_BASE, aligned_empty, dumps_value, loads_value
from dask_ddict.kernels import pack_frames, unpack_frames
from dask_ddict.shard.pinboard import BoardReader, PinBoard, read_boards, remove_boards


def test_boards_sum_live_processes_and_forget_ended_ones(tmp_path):
    uid = "ab" * 8
    mine = PinBoard(str(tmp_path), uid, 3)
    mine.add(1, 1000, 2)
    mine.add(2, 10, 1)
    code = (
        f"from dask_ddict.shard.pinboard import PinBoard; "
        f"PinBoard({str(tmp_path)!r}, {uid!r}, 3).add(1, 5, 1)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)  # a process that then ended
    assert len(os.listdir(tmp_path)) == 2
    changes, nbytes, views = read_boards(str(tmp_path), uid, 3)
    assert list(nbytes) == [0, 1000, 10] and list(views) == [0, 2, 1]
    assert os.listdir(tmp_path) == [os.path.basename(mine.path)]  # the ended one's is gone
    reader = BoardReader(str(tmp_path), uid, 3, memo=0.0)
    before = reader.changes()
    mine.add(1, -1000, -2)
    assert reader.of(1) == (0, 0) and reader.of(2) == (10, 1) and reader.changes() != before
    assert reader.of(7) == (0, 0)  # (a manager the board does not know)
    remove_boards(str(tmp_path), uid)
    assert os.listdir(tmp_path) == []


def test_a_board_ignores_managers_beyond_its_size(tmp_path):
    board = PinBoard(str(tmp_path), "cd" * 8, 1)
    board.add(5, 100, 1)  # (never raises on the read path)
    assert read_boards(str(tmp_path), "cd" * 8, 1)[1].tolist() == [0]


Frames = st.lists(
    st.one_of(
        st.none(),
        st.just(False),
        st.binary(max_size=300),
        st.integers(0, 5000).map(lambda n: np.arange(n, dtype="f8")),
    ),
    max_size=20,
)


@given(values=Frames)
def test_many_replies_round_trip_with_aligned_frames(values):
    frames = [v if v is None or v is False else dumps_value(v).join() for v in values]
    payload = b"".join(pack_frames(frames))
    buf = aligned_empty(len(payload))  # as a client receives it
    buf[:] = payload
    got = unpack_frames(buf)
    assert len(got) == len(values)
    for v, f in zip(values, got):
        if v is None or v is False:
            assert f is v
            continue
        addr = np.frombuffer(f, dtype=np.uint8).__array_interface__["data"][0] if len(f) else 0
        assert not len(f) or addr % 64 == FRAME_BASE  # where numpy buffers come out aligned
        out = loads_value(f)
        assert (out == v).all() if isinstance(v, np.ndarray) else out == v
