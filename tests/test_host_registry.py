"""The books kept beside the processes, with none running: what a supervisor's host serves
(its registry) and how often it restarts it (the restart policy); the orchestrator's
plan for a restart over kept shards, and its words for why a worker left."""

from __future__ import annotations

import os
from typing import Any

import pytest

from dask_ddict.cluster.liveness import RETIRED, why_left
from dask_ddict.cluster.restart_plan import kept_for_restart, restart_plan
from dask_ddict.errors import DDictError
from dask_ddict.host import control, hygiene
from dask_ddict.host.control import DictSpec
from dask_ddict.host.registry import MOST_CLOSED, HostRegistry
from dask_ddict.host.supervisor import RestartPolicy
from dask_ddict.layout import Layout, ManagerInfo
from dask_ddict.options import DDictOptions


def _spec(uid: str = "ab" * 16, replicas: int = 0) -> DictSpec:
    return DictSpec("d", uid, "secret", DDictOptions(replicas=replicas), 1 << 20, 4)


def _shards(tmp_path: Any, *mids: int) -> list[dict[str, Any]]:
    """What a host answers for managers it opened: each one's id and shard path."""
    infos = []
    for mid in mids:
        path = tmp_path / f"shard-{mid}"
        path.mkdir()
        infos.append({"manager_id": mid, "store_path": str(path), "restarted": False})
    return infos


def test_a_registered_manager_is_replayed_its_shard_claimed_and_its_dictionary_alive(tmp_path):
    reg = HostRegistry()
    spec = _spec()
    reg.forget(spec.uid)  # destroyed here once...
    assert reg.closed == [spec.uid] and not reg.serving
    reg.register(spec, "tcp://w", _shards(tmp_path, 0, 1))  # ...served here again
    assert reg.closed == [] and reg.serving
    (served,) = reg.replay()
    assert (served.spec, served.worker, sorted(served.paths)) == (spec, "tcp://w", [0, 1])
    assert all(os.path.exists(os.path.join(p, hygiene.LOCK)) for p in served.paths.values())
    assert reg.shards() == [(spec.capacity, served.paths[0]), (spec.capacity, served.paths[1])]
    reg.release_all()


def test_a_manager_registered_again_over_another_shard_lets_the_old_one_go(tmp_path):
    """A manager served here again over another shard (moved away and back over a copy,
    promoted anew) leaves no owner lock on its old shard: a sweep may take that one."""
    reg = HostRegistry()
    spec = _spec()
    (old,) = _shards(tmp_path, 0)
    reg.register(spec, "tcp://w", [old])
    assert not hygiene.is_abandoned(old["store_path"])
    new = {**old, "store_path": str(tmp_path / "shard-0-again")}
    os.mkdir(new["store_path"])
    reg.register(spec, "tcp://w", [new])
    assert hygiene.is_abandoned(old["store_path"])
    assert not hygiene.is_abandoned(new["store_path"])
    reg.release_all()
    assert hygiene.is_abandoned(new["store_path"])


def test_a_manager_moving_out_is_not_replayed_until_its_move_is_aborted(tmp_path):
    reg = HostRegistry()
    spec = _spec()
    reg.register(spec, "tcp://w", _shards(tmp_path, 0))
    reg.moving_out(spec.uid, 0)
    assert reg.replay() == [] and reg.serving  # (moving: still this host's to lose)
    assert reg.spec(spec.uid) == spec
    served = reg.move_aborted(spec.uid, 0)
    assert served is not None and sorted(served.paths) == [0]
    assert [s.spec for s in reg.replay()] == [spec]
    reg.moving_out(spec.uid, 0)
    reg.moved(spec.uid, 0, park=False)
    assert reg.replay() == [] and not reg.serving and reg.spec(spec.uid) is None
    assert reg.move_aborted(spec.uid, 0) is None  # (done: nothing to abort)


def test_a_dictionary_not_served_here_is_refused_by_name():
    reg = HostRegistry()
    with pytest.raises(DDictError, match="no manager of u is hosted here"):
        reg.served("u")
    with pytest.raises(DDictError, match="manager 3 of u is not hosted here"):
        reg.served("u", 3)


def test_a_forgotten_dictionary_leaves_nothing_behind_and_the_closed_are_bounded(tmp_path):
    reg = HostRegistry()
    spec = _spec()
    reg.register(spec, "tcp://w", _shards(tmp_path, 0, 1))
    reg.moving_out(spec.uid, 1)
    reg.replica_kept(_spec(), 2, str(tmp_path / "replica"))
    reg.aside[(spec.uid, 3)] = str(tmp_path / "aside")
    served = reg.forget(spec.uid)
    assert served is not None and sorted(served.paths) == [0]
    assert (reg.dicts, reg.moving, reg.replicas, reg.aside) == ({}, {}, {}, {})
    reg.release(spec.uid)
    for i in range(MOST_CLOSED + 5):
        reg.forget(f"{i:032x}")
    assert len(reg.closed) == MOST_CLOSED and reg.closed[-1] == f"{MOST_CLOSED + 4:032x}"


def test_a_promoted_replica_is_served_and_a_deposed_primary_set_aside(tmp_path):
    reg = HostRegistry()
    spec = _spec(replicas=1)
    replica = _shards(tmp_path, 2)
    reg.replica_kept(spec, 2, replica[0]["store_path"])
    assert reg.replicated and reg.replica_taken(spec.uid, 9) is None
    assert reg.replica_taken(spec.uid, 2) == (spec, replica[0]["store_path"])
    reg.register(spec, "tcp://w", replica)
    assert reg.replicated  # (its managers have replicas elsewhere)
    path = replica[0]["store_path"]
    reg.note(control.Deposed(spec.uid, 2, path))
    assert reg.dicts == {} and reg.aside == {(spec.uid, 2): path}
    assert (hygiene.kept_record(path) or {}).get("why") == hygiene.ASIDE
    reg.note(control.Discarded(spec.uid, 2))
    assert reg.aside == {}


def test_the_restart_policy_gives_a_host_up_after_its_most_restarts_within_the_window():
    now = [0.0]
    policy = RestartPolicy(lambda: now[0])
    assert policy.restart(2, 60.0) and policy.restart(2, 60.0)
    assert not policy.restart(2, 60.0) and policy.deaths == 3
    assert policy.why(2, 60.0) == "died too often (3 times within 60 s)"
    now[0] = 61.0  # (the first two are out of the window now)
    assert policy.restart(2, 60.0) and policy.count == 3
    assert not RestartPolicy().restart(0, 60.0)  # ddict.host.max-restarts: 0


def test_the_restart_policy_gives_up_a_host_that_fails_to_start_however_slowly():
    """Incarnations killed one after another as their replay does not answer (each
    taking ``start-timeout``, as long as the window) are given up after ``most`` failed
    starts in a row; one that serves in between resets the count."""
    now = [0.0]
    policy = RestartPolicy(lambda: now[0])
    for _ in range(3):
        now[0] += 61.0  # (each death out of the window of the one before)
        assert policy.restart(3, 60.0)
        policy.started(False)
    now[0] += 61.0
    assert not policy.restart(3, 60.0)
    assert policy.why(3, 60.0) == "failed to start 3 times in a row"
    policy.started(True)  # (one that serves: the count starts over)
    assert policy.restart(3, 60.0) and policy.failed_starts == 0


def _kept(*where: tuple[str, str]) -> Layout:
    """A layout kept for a restart: manager i was served by worker ``where[i][0]`` under
    supervisor ``where[i][1]``."""
    managers = tuple(
        ManagerInfo(i, w, "h", "m", 1, "/s", "127.0.0.1", 1, f"/dev/shm/{i}", supervisor=s)
        for i, (w, s) in enumerate(where)
    )
    return Layout("d", "ab" * 16, "x", False, DDictOptions(), managers, 1 << 30)


def test_a_restart_puts_each_kept_manager_where_its_shard_is():
    kept = _kept(
        ("tcp://10.0.0.1:1", "tcp://10.0.0.1:9"),  # its nanny is back: its new worker
        ("tcp://10.0.0.1:2", "tcp://gone:9"),  # its worker lives on
        ("tcp://10.0.0.2:1", "tcp://gone:8"),  # a worker of its machine
        ("tcp://10.0.0.3:1", "tcp://gone:7"),  # none on its machine: the least loaded
    )
    workers = ["tcp://10.0.0.1:2", "tcp://10.0.0.1:5", "tcp://10.0.0.2:7"]
    nannies = {"tcp://10.0.0.1:5": "tcp://10.0.0.1:9"}
    plan, paths = restart_plan(kept, workers, lambda w: nannies.get(w, w), lambda w, policy: True)
    assert plan == {
        "tcp://10.0.0.1:5": [0],
        "tcp://10.0.0.1:2": [1, 3],
        "tcp://10.0.0.2:7": [2],
    }
    assert paths == {0: "/dev/shm/0", 1: "/dev/shm/1", 2: "/dev/shm/2"}  # (3 starts empty)


def test_a_restart_with_other_arguments_than_the_kept_ones_is_refused():
    kept = {"d": _kept(("tcp://a:1", "tcp://a:1"))}
    assert kept_for_restart(kept, "d", DDictOptions(), 1) is kept["d"]
    with pytest.raises(DDictError, match="no DDict named 'e' was destroyed"):
        kept_for_restart(kept, "e", DDictOptions(), 1)
    with pytest.raises(ValueError, match="needs 1 managers"):
        kept_for_restart(kept, "d", DDictOptions(), 2)
    with pytest.raises(ValueError, match="working_set_size=3 but it was created with"):
        kept_for_restart(kept, "d", DDictOptions(working_set_size=3), 1)


def test_why_a_worker_left_is_said_in_words():
    assert why_left("retire-workers-1712") == RETIRED
    assert why_left("handle-worker-cleanup-1.5") == "its worker's connection to the scheduler broke"
    assert why_left("something-else-17") == "its worker was removed (something-else)"
