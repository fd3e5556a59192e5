"""The environment a host process starts with (:func:`host_environ`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

#: The directory that holds ``dask_ddict``: put first on a host process's ``PYTHONPATH``,
#: so ``python -m dask_ddict.host`` finds this very copy of the package.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def host_environ(base: Mapping[str, str], changes: Mapping[str, Any]) -> dict[str, str]:
    """The environment a host process starts with: ``base`` (its supervisor's) with
    ``changes`` made (``ddict.host.environ``: a ``None`` value removes a variable), and
    this package importable.

    The supervisor's environment is a Dask worker's, made for a worker's heap.  By
    default the host drops the nanny's ``MALLOC_TRIM_THRESHOLD_``
    (``distributed.nanny.pre-spawn-environ``): set at all, it also fixes glibc's
    ``mmap`` threshold at 128 KiB, so every buffer of 128 KiB or more (the reply to a
    1,000-key ``get_many``) was mapped, faulted in page by page and unmapped again,
    about a quarter of the host's CPU for such a request.

    Raises
    ------
    TypeError
        ``changes`` is not a mapping (``ddict.host.environ`` set to something else).
    """
    if not isinstance(changes, Mapping):
        raise TypeError(
            f"ddict.host.environ must map variable names to values (or null), "
            f"not {type(changes).__name__}"
        )
    env = dict(base)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
    return env
