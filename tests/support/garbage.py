"""Anything a user might pass by mistake, as a hypothesis strategy.

The argument checks (``dask_ddict.arguments``) and the fuzz tests feed it to every
entry point: each must answer with a typed error, never a crash or a silent default.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

#: Anything a user might pass by mistake.
garbage = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from(["10s", "1 GiB", "-1", "inf", "nan", "no", "", "x" * 300, "a/b", "__x"]),
    st.just(float("inf")),
    st.just(np.int64(3)),
    st.just(object()),
)
