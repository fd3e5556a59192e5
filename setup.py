"""Build hook: compile the key path's kernels (``dask_ddict/kernels/_compiled.pyx``).

Everything else about the package is declared in ``pyproject.toml``.  The kernels
are optional: where the build has no C compiler, or ``DASK_DDICT__COMPILED=false``
is set when installing, the install still succeeds and the package runs their
pure-Python reference (``dask_ddict/kernels/pure.py``); ``dask_ddict.kernels.COMPILED``
says which a process runs.
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNELS = "dask_ddict.kernels._compiled"


def wanted() -> bool:
    """False where ``DASK_DDICT__COMPILED`` says false (as dask.config reads it)."""
    return os.environ.get("DASK_DDICT__COMPILED", "").strip().lower() not in {
        "false",
        "0",
        "no",
        "off",
    }


def extensions() -> list[Any]:
    if not wanted():
        print("dask-ddict: DASK_DDICT__COMPILED is false: pure-Python kernels", file=sys.stderr)
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("dask-ddict: no Cython: pure-Python kernels", file=sys.stderr)
        return []
    source = KERNELS.replace(".", "/") + ".pyx"
    here = os.path.dirname(source)
    included = sorted(glob.glob(os.path.join(here, "*.pxi")) + glob.glob(os.path.join(here, "*.h")))
    kernels = Extension(
        KERNELS, [source], include_dirs=[here], depends=included, extra_compile_args=["-O2"]
    )
    return cythonize([kernels], quiet=True)


class OptionalBuildExt(build_ext):
    """``build_ext`` that leaves the kernels in Python where they cannot be compiled."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - no compiler at all
            print(f"dask-ddict: kernels not compiled ({e}): pure Python", file=sys.stderr)

    def build_extension(self, ext: Any) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001 - a compiler that failed
            print(f"dask-ddict: {ext.name} not compiled ({e}): pure Python", file=sys.stderr)


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
