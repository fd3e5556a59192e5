"""The packages ship ``py.typed`` and type-check clean; their types reach users' code."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _mypy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_mypy_is_clean_on_both_packages_and_typed_usage():
    out = _mypy("dask_ddict", "dask_dap", "tests/typed_usage.py")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success: no issues found" in out.stdout
    for package in ("dask_ddict", "dask_dap"):
        assert (ROOT / package / "py.typed").is_file()


def test_the_async_face_has_its_twins_signatures(tmp_path):
    """Generated coroutines are typed from the synchronous methods, not ``Any``."""
    wrong = tmp_path / "wrong.py"
    wrong.write_text(
        "from dask_ddict import AsyncDDict\n"
        "async def f(ad: AsyncDDict) -> None:\n"
        "    n: str = await ad.length()\n"  # length() gives an int
        "    await ad.fetch_add('k', 'one')\n"  # fetch_add takes an int
        "    await ad.fetch_add('k', val='one')\n"  # ...also under Dragon's name
    )
    out = _mypy("--config-file", str(ROOT / "pyproject.toml"), str(wrong))
    assert out.returncode == 1, out.stdout
    assert 'expression has type "int", variable has type "str"' in out.stdout
    assert 'wrong.py:4: error: Argument 2 has incompatible type "str"; expected "int"' in out.stdout
    assert (
        'wrong.py:5: error: Argument "val" has incompatible type "str"; expected "int | None"'
        in out.stdout
    )
