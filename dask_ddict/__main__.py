"""``python -m dask_ddict``: the ``dask ddict`` command line (see :mod:`dask_ddict.cli`)."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    main()
