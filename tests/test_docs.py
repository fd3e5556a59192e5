"""The documentation site builds with warnings as errors, and its tables are complete."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

#: Dragon's DDict API (0.14/0.15): every name must be in the migration table
#: (``docs/dragon.md``), with what it is here.
DRAGON_ARGUMENTS = [
    "managers_per_node",
    "n_nodes",
    "total_mem",
    "working_set_size",
    "wait_for_keys",
    "wait_for_writers",
    "policy",
    "managers_per_policy",
    "orc_policy",
    "persist_freq",
    "persist_count",
    "persist_path",
    "persister_class",
    "name",
    "timeout",
    "trace",
    "restart",
    "read_only",
    "restore_from",
    "streams_per_manager",
    "manager_pool_full_thresh",
]
DRAGON_METHODS = [
    "pput",
    "get",
    "pop",
    "clear",
    "keys",
    "values",
    "items",
    "update",
    "popitem",
    "fetch_add",
    "wait_for",
    "which_manager",
    "checkpoint",
    "rollback",
    "checkpoint_id",
    "sync_to_newest_checkpoint",
    "advance",
    "persist",
    "restore",
    "persisted_ids",
    "sync",
    "start_batch_put",
    "end_batch_put",
    "bput",
    "bget",
    "serialize",
    "attach",
    "detach",
    "destroy",
    "get_name",
    "copy",
    "clone",
    "synchronize_ddicts",
    "empty_managers",
    "manager",
    "pickler",
    "local_managers",
    "local_manager",
    "main_manager",
    "manager_nodes",
    "local_keys",
    "local_values",
    "local_items",
    "local_len",
    "freeze",
    "unfreeze",
    "is_frozen",
    "stats",
    "dstats",
    "profile",
    "profile_reset",
    "filter",
]
#: Dragon's DDict errors (its ``LostKeysError`` is documented but never raised, and never
#: defined in its code).
DRAGON_ERRORS = [
    "DDictError",
    "DDictKeyError",
    "DDictFullError",
    "DDictTimeoutError",
    "DDictCheckpointSyncError",
    "DDictFutureCheckpointError",
    "DDictPersistCheckpointError",
    "DDictSyncError",
    "DDictUnableToCreateError",
]
#: Dragon's keyword arguments of its methods that a Dragon program may name.
DRAGON_KEYWORDS = {
    "fetch_add": ["val"],
    "sync": ["timeout"],
    "attach": ["timeout", "trace"],
    "wait_for": ["timeout"],
    "get": ["default"],
    "pop": ["default"],
    "copy": ["name"],
    "clone": ["clone_list"],
    "destroy": ["allow_restart"],
    "start_batch_put": ["persist"],
    "pickler": ["key_pickler", "value_pickler"],
    "synchronize_ddicts": ["serialized_ddicts"],
    "filter": ["mgr_code", "mgr_code_args", "comparator", "branching_factor"],
}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            str(DOCS),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    return out


def test_the_site_builds_with_api_config_and_pictures(site):
    api = (site / "api.html").read_text()
    for name in ("DDict.persist", "AsyncDDict.put", "DDict.from_name", "to_zarr", "DDictArray"):
        assert name in api, name
    config = (site / "generated" / "config.html").read_text()
    yaml_text = (ROOT / "dask_ddict" / "ddict.yaml").read_text()
    leaves = re.findall(r"^\s+([a-z0-9-]+): \S", yaml_text, flags=re.M)
    assert len(leaves) > 25
    for leaf in leaves:
        assert f".{leaf}</span></code>" in config or f".{leaf}<" in config, leaf
    assert (site / "_static" / "generated" / "dap-distributions.png").stat().st_size > 10_000
    assert (site / "_images" / "dashboard.png").is_file() or (
        site / "_static" / "dashboard.png"
    ).is_file()


def test_the_dragon_table_covers_every_method_and_argument():
    text = (DOCS / "dragon.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    first_cells = " ".join(line.split("|")[1] for line in rows)
    for name in DRAGON_ARGUMENTS + DRAGON_METHODS:
        assert re.search(rf"`(DDict\.)?{name}\b", first_cells), name
    errors = text[text.index("### Errors") : text.index("## Where we differ")]
    for name in DRAGON_ERRORS:
        assert f"`{name}`" in errors, name
    assert "## Moving from Dragon" in text
    assert "docs/dragon.md" in (ROOT / "README.md").read_text()


def test_every_dragon_name_is_accepted_here():
    """What the table lists exists: each of Dragon's constructor arguments is one of
    ``DDict``'s (ours or Dragon's name of it), each method and property is ``DDict``'s,
    each error is exported, and Dragon's keyword arguments are taken by name."""
    import inspect

    import dask_ddict
    from dask_ddict import DDict

    params = inspect.signature(DDict.__init__).parameters
    assert [a for a in DRAGON_ARGUMENTS if a not in params] == []
    assert [m for m in DRAGON_METHODS if not hasattr(DDict, m)] == []
    assert [e for e in DRAGON_ERRORS if not hasattr(dask_ddict, e)] == []
    for method, names in DRAGON_KEYWORDS.items():
        taken = inspect.signature(getattr(DDict, method)).parameters
        assert [n for n in names if n not in taken] == [], method


def test_the_readme_links_to_files_that_exist():
    """The README is read on GitHub and PyPI, outside the site's build: its links to the
    docs and examples are checked here instead."""
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)", text)
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert "docs/index.md" in local
    assert [t for t in local if not (ROOT / t).exists()] == []
