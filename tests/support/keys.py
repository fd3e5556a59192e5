"""Keys for tests: any key a user may pass, and a key class placed by its own hash.

:data:`keys` draws nested containers of scalars, hashable or not (a dictionary key
may be a list: its canonical bytes are what is hashed).  :class:`Placed` keys have a
``__hash__`` of their own, which places them instead of the digest.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

atoms = (
    st.text(max_size=8)
    | st.integers()
    | st.floats(allow_nan=False)
    | st.binary(max_size=8)
    | st.booleans()
    | st.none()
)
hashables = st.recursive(
    atoms, lambda c: st.tuples(c, c) | st.frozensets(c, max_size=4), max_leaves=12
)
keys = st.recursive(
    hashables,
    lambda c: (
        st.lists(c, max_size=4)
        | st.tuples(c, c)
        | st.dictionaries(hashables, c, max_size=4)
        | st.sets(hashables, max_size=4)
        | st.frozensets(hashables, max_size=4)
    ),
    max_leaves=16,
)


class Placed:
    """A key class with its own ``__hash__`` (placed by it, not by the digest)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __hash__(self) -> int:
        return self.n * 7

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Placed) and other.n == self.n

    def __reduce__(self) -> Any:
        return (Placed, (self.n,))
