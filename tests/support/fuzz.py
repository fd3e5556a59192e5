"""Hypothesis settings shared by the fuzz tests.

The default run is derandomized (CI sees the same inputs every time) and
short; ``--runslow`` multiplies every budget by ten (``conftest.py`` sets
``DDICT_FUZZ_SCALE``).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SCALE = int(os.environ.get("DDICT_FUZZ_SCALE", "1"))


def fuzz(n: int) -> settings:
    """Settings for ``n`` inputs (``10 * n`` with ``--runslow``)."""
    return settings(
        max_examples=n * SCALE,
        derandomize=SCALE == 1,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.function_scoped_fixture,
            HealthCheck.data_too_large,
        ],
    )
