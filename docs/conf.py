"""Sphinx configuration: the dask_ddict / dask_dap documentation site.

Build: ``sphinx-build -W -b html docs docs/_build/html`` (``tests/test_docs.py``
runs exactly that, warnings as errors).  Pages are MyST markdown; the API
reference comes from the numpydoc docstrings; ``_ext/generated.py`` writes
the configuration reference (from ``ddict.yaml``) and the DAP distribution
pictures (matplotlib) at build time.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

project = "dask-ddict"
author = "the dask-ddict developers"
copyright = "2026, the dask-ddict developers"  # noqa: A001 - Sphinx's name

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "generated",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "_generated_cache"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "groupwise"
autodoc_typehints = "none"  # numpydoc's Parameters sections say it, once
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_validation_checks: set[str] = set()

html_theme = "pydata_sphinx_theme"
html_title = "dask-ddict"
html_static_path = ["_static"]
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "footer_start": ["copyright"],
}
