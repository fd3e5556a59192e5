"""Values for tests that compare two read paths: what a dictionary stores, of the kinds
that take different paths (small pickles, raw bytes, numpy arrays, values around a
size limit), and an equality that tells them apart by type too."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st


def values(*sizes: int) -> st.SearchStrategy[Any]:
    """Ints, text, bytes, ``None`` and small numpy arrays, and raw bytes of each of
    ``sizes`` (around the limits the paths under test switch at)."""
    return st.one_of(
        st.integers(),
        st.text(max_size=20),
        st.binary(max_size=200),
        st.none(),
        st.integers(0, 40).map(np.arange),
        st.sampled_from(sizes).map(b"v".__mul__),
    )


def same(a: Any, b: Any) -> bool:
    """Whether two values read back are the same: of one type, and equal (arrays: every
    element)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and (a == b).all()
    return type(a) is type(b) and a == b
