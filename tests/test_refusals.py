"""A user's mistake at creation is an error in the client, not a traceback in the scheduler's
log (which is the user's terminal when the cluster runs in their process)."""

from __future__ import annotations

import logging

import pytest
from distributed import Client

from dask_ddict import (
    DDict,
    DDictError,
    DDictFullError,
    DDictPersistCheckpointError,
    DDictUnableToCreateError,
)
from tests.support.cluster import local_cluster


@pytest.fixture(scope="module")
def in_process():
    """A cluster whose scheduler runs in this process, so its log is this process's."""
    with (
        local_cluster(1, processes=False) as cl,
        Client(cl) as c,
    ):
        d = DDict(total_mem="16 MiB", client=c, name="taken")
        yield c
        d.destroy()


@pytest.fixture
def logs(caplog):
    """Every record of dask_ddict and of distributed (which does not propagate to the root)."""
    dist = logging.getLogger("distributed")
    dist.addHandler(caplog.handler)
    caplog.set_level(logging.INFO)
    try:
        yield caplog
    finally:
        dist.removeHandler(caplog.handler)


CASES = {
    "a name that exists": (dict(name="taken"), DDictUnableToCreateError, "already exists"),
    "restart of an unknown name": (
        dict(name="nope", restart=True),
        DDictUnableToCreateError,
        "allow_restart=True",
    ),
    "a checkpoint not persisted": (
        dict(name="p", persist_freq=1, restore_from=3),
        DDictPersistCheckpointError,
        "not persisted",
    ),
    "total_mem over /dev/shm": (dict(total_mem="4000 GiB"), DDictFullError, "cannot hold"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_creation_is_an_error_reply_logged_at_info(in_process, logs, tmp_path, case):
    kwargs, error, text = CASES[case]
    if "persist_freq" in kwargs:
        kwargs = {**kwargs, "persist_path": str(tmp_path)}
    kwargs.setdefault("total_mem", "16 MiB")
    with pytest.raises(error, match=text):
        DDict(client=in_process, **kwargs)
    loud = [
        (r.name, r.levelname, r.getMessage()) for r in logs.records if r.levelno >= logging.WARNING
    ]
    assert loud == []  # no "Exception while handling op ddict_create", no traceback
    said = [r for r in logs.records if r.name.startswith("dask_ddict") and "refused" in r.message]
    assert len(said) == 1 and said[0].levelno == logging.INFO and text in said[0].message
    assert said[0].exc_info is None
    assert DDict.list(in_process) == ["taken"]  # and nothing was left half-created


def test_attaching_to_an_unknown_name_is_an_error_reply_logged_at_info(in_process, logs):
    with pytest.raises(DDictError, match="no DDict named 'nope'"):
        DDict.from_name("nope", in_process)
    loud = [r.getMessage() for r in logs.records if r.levelno >= logging.WARNING]
    assert loud == []  # no "Exception while handling op ddict_attach"
    said = [r for r in logs.records if r.name.startswith("dask_ddict") and "refused" in r.message]
    assert len(said) == 1 and said[0].levelno == logging.INFO
