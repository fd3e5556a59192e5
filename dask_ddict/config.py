"""Load the ``ddict`` namespace defaults into ``dask.config``.

Downstream-library convention (see dask's "Downstream Libraries" docs): the
defaults live in ``ddict.yaml`` beside this module and are merged into the
global configuration at import, so users override them with ``dask.config.set``,
YAML files in ``~/.config/dask`` or ``DASK_DDICT__...`` environment variables.
"""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

_fn = os.path.join(os.path.dirname(__file__), "ddict.yaml")
with open(_fn) as f:
    defaults = yaml.safe_load(f)

dask.config.update_defaults(defaults)


_MISSING = object()


def get(key: str, default: Any = None) -> Any:
    """Read ``ddict.<key>`` from dask's configuration, else its default from the YAML.

    The fallback matters: a ``dask.config.set({"ddict.…": …})`` block entered before
    this package was imported removes the whole ``ddict`` section when it exits
    (dask restores the section as it found it: absent), defaults included.
    """
    value = dask.config.get(f"ddict.{key}", default=_MISSING)
    if value is _MISSING:
        value = defaults.get("ddict", {})
        for part in key.split("."):
            value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
        if value is _MISSING:
            return default
    return value


def get_bytes(key: str) -> int:
    """Read a byte-size setting (``"4 MiB"`` or an int)."""
    return int(parse_bytes(get(key)))


def get_seconds(key: str) -> float | None:
    """Read a duration setting (``"10 s"``, a number, or null)."""
    value = get(key)
    return None if value is None else float(parse_timedelta(value))
