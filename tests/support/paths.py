"""Where the tests are, and the ``PYTHONPATH`` a child process needs to import them.

Test modules import as top-level modules (``test_x``: ``tests/`` has no
``__init__.py``) and helpers as ``tests.support.x``; a child process that runs a
helper, or unpickles a task function defined in either (cloudpickle sends functions of
importable modules by reference), needs both directories on its path.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The tests' directory.
TESTS = Path(__file__).resolve().parent.parent
#: The repository's root (``tests.support`` imports from here).
ROOT = TESTS.parent


def pythonpath() -> str:
    """``PYTHONPATH`` for a child process: the tests, the root, then what was set."""
    path = [str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in path if p)
