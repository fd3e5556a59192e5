"""The one error type of ``dask_dap``."""

from __future__ import annotations


class DAPValidationError(ValueError):
    """A DAP dict (or a set of them) breaks the Distributed Array Protocol 0.10.0.

    The message names the rank (when known), the dimension, the key and the
    offending value, so a producer's bug can be found from the message alone.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        dim: int | None = None,
        key: str | None = None,
    ) -> None:
        where = []
        if rank is not None:
            where.append(f"rank {rank}")
        if dim is not None:
            where.append(f"dimension {dim}")
        if key is not None:
            where.append(f"key {key!r}")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)
        self.rank = rank
        self.dim = dim
        self.key = key
