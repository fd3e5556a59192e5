"""``python -m dask_ddict.host UDS_FD TCP_FD``: a host process (started by a supervisor)."""

import sys

from .process import main

sys.exit(main(sys.argv[1:]))
