"""The tree has one style: ``ruff format`` leaves every file as it is and ``ruff check``
finds nothing (the configuration is ``[tool.ruff]`` in ``pyproject.toml``).  A style that
only a test enforces is still one style: a pragma that keeps a line's shape against the
formatter needs a comment saying why that line must keep it."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_the_formatter_leaves_every_file_as_it_is():
    out = _ruff("format", "--check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_linter_finds_nothing():
    out = _ruff("check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_line_kept_from_the_formatter_says_why():
    bare = []
    for path in ROOT.rglob("*.py"):
        if any(part.startswith(".") or part in ("build", "generated") for part in path.parts):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"#\s*fmt:\s*(skip|off)\s*$", line):
                bare.append(f"{path.relative_to(ROOT)}:{n}")
    assert not bare, "a formatter pragma without a reason: " + ", ".join(bare)
