"""Pages and pictures made at build time, so they cannot drift from the code.

* ``generated/config.md``: every ``ddict.*`` option, its default and its comment,
  read from ``dask_ddict/ddict.yaml`` (the one declaration of the defaults);
* ``_static/generated/dap-*.png``: which rank owns which cell for each DAP
  distribution type, computed by ``dask_dap.protocol.dims.global_indices``
  (the code that reads sections) and drawn with matplotlib.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent.parent


def _options(path: Path) -> list[tuple[str, Any, str]]:
    """``(dotted key, default, comment)`` for every leaf of a commented YAML file."""
    defaults = yaml.safe_load(path.read_text())
    out: list[tuple[str, Any, str]] = []
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("# ").rstrip())
            continue
        m = re.match(r"^(\s*)([A-Za-z0-9_-]+):(.*)$", line)
        if not m:
            comment = []
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3).strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        dotted = ".".join(k for _, k in stack)
        if rest:  # a leaf
            value: Any = defaults
            for _, k in stack:
                value = value[k]
            out.append((dotted, value, " ".join(comment)))
        comment = []
    return out


def write_config_page(app: Any) -> None:
    import dask_ddict

    yaml_path = Path(dask_ddict.__file__).parent / "ddict.yaml"
    rows = []
    for key, value, text in _options(yaml_path):
        env = "DASK_" + key.upper().replace(".", "__").replace("-", "_")
        shown = (
            "null" if value is None else str(value).lower() if isinstance(value, bool) else value
        )
        text = text.replace("|", "\\|")
        rows.append(f"| `{key}` | `{shown}` | `{env}` | {text} |")
    page = "\n".join(
        [
            "# Configuration reference",
            "",
            "Every option of `dask_ddict`, with its default, the environment variable that",
            "sets it, and what it does. Set them like any Dask option: in a YAML file under",
            "`~/.config/dask/`, with `dask.config.set({...})`, or through the environment.",
            "This page is generated from `dask_ddict/ddict.yaml` at build time.",
            "",
            "| option | default | environment | meaning |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
    )
    _write(HERE / "generated" / "config.md", page)


def draw_distributions(app: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from dask_dap.protocol.dims import global_indices

    out = HERE / "_static" / "generated"
    out.mkdir(parents=True, exist_ok=True)
    n, ranks = 16, 4
    rng = np.random.default_rng(7)
    scattered = rng.permutation(n)
    kinds = {
        "block (b)": [
            dict(
                dist_type="b",
                size=n,
                proc_grid_size=ranks,
                proc_grid_rank=r,
                start=r * n // ranks,
                stop=(r + 1) * n // ranks,
            )
            for r in range(ranks)
        ],
        "cyclic (c)": [
            dict(dist_type="c", size=n, proc_grid_size=ranks, proc_grid_rank=r, start=r)
            for r in range(ranks)
        ],
        "block-cyclic (c, block_size=2)": [
            dict(
                dist_type="c",
                size=n,
                proc_grid_size=ranks,
                proc_grid_rank=r,
                start=2 * r,
                block_size=2,
            )
            for r in range(ranks)
        ],
        "unstructured (u)": [
            dict(
                dist_type="u",
                size=n,
                proc_grid_size=ranks,
                proc_grid_rank=r,
                indices=np.sort(scattered[r::ranks]),
            )
            for r in range(ranks)
        ],
    }
    colors = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(len(kinds), 1, figsize=(8, 0.9 * len(kinds) + 0.4))
    for ax, (title, dims) in zip(axes, kinds.items()):
        owner = np.full(n, -1)
        for r, dim in enumerate(dims):
            owner[global_indices(dim)] = r
        for i, r in enumerate(owner):
            ax.add_patch(plt.Rectangle((i, 0), 1, 1, color=colors[r], ec="white"))
            ax.text(i + 0.5, 0.5, str(r), ha="center", va="center", fontsize=8, color="white")
        ax.set_xlim(0, n), ax.set_ylim(0, 1), ax.set_yticks([])
        ax.set_xticks(np.arange(n) + 0.5, [str(i) for i in range(n)], fontsize=7)
        ax.set_title(f"{title}: which of 4 ranks owns each of 16 cells", fontsize=9, loc="left")
    fig.tight_layout()
    fig.savefig(out / "dap-distributions.png", dpi=110)
    plt.close(fig)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:  # unchanged: no rebuild
        path.write_text(text)


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", write_config_page)
    app.connect("builder-inited", draw_distributions)
    return {"parallel_read_safe": True, "version": os.environ.get("DDICT_VERSION", "1")}
