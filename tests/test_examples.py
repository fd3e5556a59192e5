"""Every example runs, as a user would run it, and leaves nothing behind."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from tests.support.shards import shm_entries

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"

#: Each example with arguments that keep it short, and what its output must say.
RUNS = {
    "quickstart.py": ([], ["keys on", "steps:"]),
    "checkpoint_pi.py": (
        ["--clients", "4", "--iterations", "3", "--points", "20000"],
        [
            "phase 1",
            "by d.persist() (the newest, for the restart)",
            "phase 2: a new dictionary restored",
            "pi ~ 3.1",
        ],
    ),
}


def test_every_example_is_run():
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example(name):
    args, expected = RUNS[name]
    before = shm_entries()
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=EXAMPLES.parent,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for text in expected:
        assert text in out.stdout, out.stdout
    assert shm_entries() - before == set()  # its shards are gone with its cluster
