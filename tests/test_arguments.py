"""Bad arguments get a typed error naming the argument; nothing is left behind or lost."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import dask.config
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dask_ddict import (
    DDict,
    DDictError,
    DDictFullError,
    DDictPersistCheckpointError,
    DDictTimeoutError,
)
from dask_ddict.arguments import check_timeout
from dask_ddict.client import create_request
from dask_ddict.client.handle import CREATE_ARGUMENTS, CREATE_SIGNATURE
from tests.support.fuzz import fuzz
from tests.support.garbage import garbage
from tests.support.shards import shm_entries

#: Every constructor argument (its signature is their one declaration), with its default.
ARGS = sorted(CREATE_ARGUMENTS)
DEFAULTS = {k: CREATE_SIGNATURE.parameters[k].default for k in ARGS} | {"total_mem": "64 MiB"}


@fuzz(400)
@given(st.dictionaries(st.sampled_from(ARGS), garbage, min_size=1, max_size=3))
def test_constructor_arguments_are_checked_before_anything_is_sent(bad):
    """Either a valid request (plain types, in range) or TypeError/ValueError naming one argument."""
    try:
        req = create_request({**DEFAULTS, **bad})
    except (TypeError, ValueError) as e:
        text = str(e)
        assert any(a in text for a in ARGS), text
        return
    opts = req["options"]
    for k in ("working_set_size", "persist_freq", "persist_count"):
        assert type(opts[k]) is int and -1 <= opts[k] < 1 << 63
    for k in ("wait_for_keys", "wait_for_writers", "read_only"):
        assert type(opts[k]) is bool
    assert type(req["restart"]) is bool and 0 < req["total_mem"] < 1 << 63
    assert isinstance(req["name"], str) and "/" not in req["name"]
    assert req["lifetime"] in ("client", "cluster")


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(wait_for_keys="no", working_set_size=2), TypeError, "wait_for_keys must be True"),
        (dict(client="tcp://127.0.0.1:1"), TypeError, "client must be a distributed.Client"),
        (dict(name="n" * 300, persist_path="/tmp/x"), ValueError, "name must be at most 200"),
        (dict(name="a/b"), ValueError, "name 'a/b' must not contain"),
        (dict(timeout=float("inf")), ValueError, r"timeout must be in \[0, 1e\+09\]"),
        (dict(timeout="soon"), ValueError, "timeout 'soon' is not a duration"),
        (dict(working_set_size=1 << 64), ValueError, "working_set_size must be in"),
        (dict(restore_from=1 << 64, name="x", persist_path="/tmp/x"), ValueError, "restore_from"),
        (
            dict(total_memory="1 GiB"),
            TypeError,
            r"DDict\(\) got an unexpected keyword argument 'total_memory'; did you mean "
            r"'total_mem'\?",
        ),
        (dict(managers_per_workers=2), TypeError, "did you mean 'managers_per_worker'"),
        (
            dict(colour="red"),
            TypeError,
            "'colour'; it takes client, lifetime, .*workers, working_set_size$",
        ),
    ],
)
def test_constructor_mistakes_name_the_argument(client, kwargs, error, match):
    before = shm_entries()
    with pytest.raises(error, match=match):
        DDict(total_mem="32 MiB", **{"client": client, **kwargs})
    assert shm_entries() - before == set()


def test_durations_as_strings():
    assert check_timeout("10s") == 10.0
    assert check_timeout("250ms") == 0.25
    assert check_timeout(3) == 3.0 and check_timeout(None) is None
    for bad in (-1, math.nan, math.inf, "-3s", True, [1]):
        with pytest.raises((TypeError, ValueError), match="timeout"):
            check_timeout(bad)


def test_timeout_defaults_to_dask_config(client, ddict):
    """``ddict.timeout`` is every handle's default; an explicit ``None`` still waits forever."""
    assert ddict.timeout is None  # the shipped default: forever, as in Dragon
    with dask.config.set({"ddict.timeout": "2.5s"}):
        assert DDict.attach(ddict.serialize()).timeout == 2.5
        assert DDict.from_name(ddict.get_name(), client).timeout == 2.5
        assert DDict.attach(ddict.serialize(), timeout=None).timeout is None
        assert DDict.attach(ddict.serialize(), timeout=7).timeout == 7.0
        d = DDict(total_mem="32 MiB", client=client)
        try:
            assert d.timeout == 2.5
            with pytest.raises(DDictTimeoutError, match="wait"):
                d.wait_for("never", 1)  # the configured timeout applies to every operation
        finally:
            d.destroy()
    with dask.config.set({"ddict.timeout": "soon"}):
        with pytest.raises(ValueError, match="ddict.timeout 'soon'"):
            DDict.attach(ddict.serialize())


def test_method_mistakes_name_the_argument_and_change_nothing(ddict):
    ddict["n"] = 5
    ddict["keep"] = "me"
    cases = [
        (lambda: ddict.fetch_add("n", 1 << 64), ValueError, r"n must be in \[-9223372036854775808"),
        (lambda: ddict.fetch_add("n", 1.5), TypeError, "n must be an int"),
        (lambda: setattr(ddict, "checkpoint_id", 1 << 64), ValueError, "checkpoint_id must be"),
        (lambda: setattr(ddict, "checkpoint_id", -1), ValueError, "checkpoint_id must be"),
        (lambda: ddict.wait_for("n", 5, timeout=float("inf")), ValueError, "timeout"),
        (lambda: ddict.wait_for("n", 6, timeout="x"), ValueError, "timeout 'x'"),
        (lambda: DDict.attach(ddict.serialize(), timeout=-2), ValueError, "timeout"),
        (lambda: ddict.manager(1 << 64), ValueError, "manager_id"),
        (lambda: ddict.manager(ddict.num_managers), DDictError, r"manager_id must be in \[0, 1\]"),
        (lambda: ddict.manager("0"), TypeError, "manager_id must be an int"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
    assert ddict["n"] == 5 and ddict["keep"] == "me" and ddict.checkpoint_id == 0
    ddict.wait_for("n", 5, timeout="1s")
    assert ddict.fetch_add("n", (1 << 63) - 1) == 5


def test_a_restore_path_that_is_a_file(client, tmp_path):
    f = tmp_path / "not-a-store"
    f.write_text("x")
    before = shm_entries()
    with pytest.raises((ValueError, DDictPersistCheckpointError), match="persist_path"):
        DDict(total_mem="32 MiB", client=client, name="rf", persist_path=str(f), restore_from=0)
    assert shm_entries() - before == set()
    assert f.read_text() == "x"


def test_a_persist_path_that_cannot_be_written(client, tmp_path):
    """Refused when the arguments are checked, naming persist_path and the OS's reason
    (not, from every host process, the store's "unreadable group metadata")."""
    before = shm_entries()
    with pytest.raises(
        ValueError,
        match=r"persist_path '/proc/x.zarr' cannot be written: a "
        r"directory cannot be created in /proc \(No such file or directory",
    ):
        DDict(total_mem="32 MiB", client=client, persist_path="/proc/x.zarr")
    assert shm_entries() - before == set()
    for path in ("/sys/x.zarr", "file:///proc/x.zarr", f"{tmp_path}/file/x.zarr"):
        (tmp_path / "file").write_text("x")
        with pytest.raises(ValueError, match="persist_path .* cannot be written"):
            create_request({**DEFAULTS, "persist_path": path, "persist_freq": 1})
    # A dictionary that never writes its store is not asked to be able to.
    replay = dict(name="r", restore_from=0, read_only=True, persist_path="/proc/x.zarr")
    create_request({**DEFAULTS, **replay})
    create_request({**DEFAULTS, **replay, "read_only": False})  # a restore may only read
    with pytest.raises(ValueError, match="cannot be written"):  # ... but persists: writes
        create_request({**DEFAULTS, **replay, "read_only": False, "persist_freq": 1})
    # The probe leaves nothing behind, in the store's nearest parent or in the store.
    (tmp_path / "store.zarr").mkdir()
    for path in (tmp_path / "new" / "x.zarr", tmp_path / "store.zarr"):
        create_request({**DEFAULTS, "persist_path": str(path)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "store.zarr"]
    assert list((tmp_path / "store.zarr").iterdir()) == []


def test_total_mem_beyond_the_host_leaves_nothing(client, ddict):
    ddict["k"] = 1
    before = shm_entries()
    with pytest.raises(DDictFullError, match="cannot hold"):
        DDict(total_mem="1 PiB", client=client)
    assert shm_entries() - before == set()
    assert ddict["k"] == 1  # the cluster and other dictionaries carry on
    with DDict(total_mem="32 MiB", client=client) as d:
        d["x"] = 2
        assert d["x"] == 2


def _edits(s: str):
    body, _, digest = s.rpartition(".")
    yield s[:-1]  # truncated
    yield s[:7] + s[8:]  # a character gone
    yield body + "." + ("0" if digest[0] != "0" else "1") + digest[1:]  # checksum altered
    yield s.replace("ddict3:", "ddict1:")  # older formats
    yield s.replace("ddict3:", "ddict2:")
    yield ""
    yield "ddict3:"


def test_edited_handles_are_refused(ddict):
    s = ddict.serialize()
    for bad in _edits(s):
        with pytest.raises(ValueError, match="serialized"):
            DDict.attach(bad)
    with pytest.raises(TypeError, match="serialized"):
        DDict.attach(b"ddict3:")


def _forged(ddict, edit) -> str:
    """A handle re-serialized after an edit: a valid checksum over an impossible layout."""
    import dataclasses

    from dask_ddict.layout import Layout

    lay = Layout.deserialize(ddict.serialize())
    return dataclasses.replace(lay, managers=edit(lay.managers)).serialize()


def test_impossible_layouts_are_refused_even_with_a_valid_checksum(ddict):
    import dataclasses

    with pytest.raises(ValueError, match="no managers"):
        DDict.attach(_forged(ddict, lambda ms: ()))
    with pytest.raises(ValueError, match="the same shard"):
        DDict.attach(
            _forged(
                ddict,
                lambda ms: tuple(dataclasses.replace(m, store_path=ms[0].store_path) for m in ms),
            )
        )
    with pytest.raises(ValueError, match="manager ids"):
        DDict.attach(_forged(ddict, lambda ms: tuple(reversed(ms))))


@fuzz(200)
@given(st.data())
def test_fuzzed_handles_are_refused_or_identical(ddict, data):
    s = ddict.serialize()
    pos = data.draw(st.integers(0, len(s) - 1))
    ch = data.draw(st.characters(codec="ascii"))
    bad = s[:pos] + ch + s[pos + 1 :]
    if bad == s:
        return
    try:
        lay = DDict.attach(bad)._core.layout
    except (TypeError, ValueError):
        return
    # base64 has slack bits: a few edits decode to the very same layout, which is fine.
    assert lay == ddict._core.layout


def test_swapped_store_paths_never_read_another_managers_shard(ddict):
    """Even a forged handle (valid checksum) cannot make same-host reads cross shards."""
    for i in range(40):
        ddict[f"k{i}"] = i
    swapped = _forged(
        ddict,
        lambda ms: tuple(
            __import__("dataclasses").replace(
                m, store_path=ms[(m.manager_id + 1) % len(ms)].store_path
            )
            for m in ms
        ),
    )
    h = DDict.attach(swapped)
    try:
        assert [h[f"k{i}"] for i in range(40)] == list(range(40))  # served by the right manager
    finally:
        h.detach()
    assert ddict["k0"] == 0


def test_settings_survive_a_config_block_entered_before_the_import():
    """dask restores a section it did not find by removing it: a ``dask.config.set``
    block around the first import of the package takes the ``ddict`` defaults with
    it when it exits; every setting then reads its default (a fresh process)."""
    code = (
        "import dask.config\n"
        "with dask.config.set({'ddict.batch.flush-bytes': '1 KiB'}):\n"
        "    from dask_ddict import config\n"
        "    assert config.get_bytes('batch.flush-bytes') == 1024\n"
        "assert dask.config.get('ddict', None) is None\n"
        "assert config.get_bytes('batch.flush-bytes') == 64 * 1024\n"
        "assert config.get('move.on-retire') is True and config.get('no.such', 3) == 3\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_DDICT__")}  # (a
    # DASK_DDICT__* variable, e.g. the pure-kernel run's, is a ddict section of its own)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.stdout.strip() == "ok", out.stderr
