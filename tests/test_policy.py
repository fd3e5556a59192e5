"""Placement policies: managers pinned to workers by a worker, a host or Dask resources,
kept there by the orchestrator's moves, adoptions and replicas (``dask_ddict.placement``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from distributed import Client, LocalCluster

from dask_ddict import DDict, DDictManagerUnavailableError, DDictUnableToCreateError, Policy
from dask_ddict.client.workers import scheduler_workers
from dask_ddict.cluster.moves import Candidate
from dask_ddict.layout import Layout, ManagerInfo
from dask_ddict.options import DDictOptions
from dask_ddict.placement import WorkerView, assign, policy_groups
from tests.support.cluster import local_cluster
from tests.support.polling import poll_for

GPU = Policy(resources={"GPU": 1})

# -- pure: matching, groups, assignment ------------------------------------------------


def test_a_policy_matches_a_worker_by_address_name_host_and_resources():
    w = WorkerView("tcp://10.0.0.5:1", "gpu0", "10.0.0.5", "node5", {"GPU": 2, "MEM": 1})
    assert Policy().matches("tcp://x:1")  # (no field: any worker)
    assert w.satisfies(None) and w.satisfies(GPU) and w.satisfies(Policy(resources={"GPU": 2}))
    assert not w.satisfies(Policy(resources={"GPU": 3}))
    assert not w.satisfies(Policy(resources={"TPU": 1}))
    assert w.satisfies(Policy(worker="gpu0")) and w.satisfies(Policy(worker="tcp://10.0.0.5:1"))
    assert not w.satisfies(Policy(worker="gpu1"))
    assert w.satisfies(Policy(host="node5")) and w.satisfies(Policy(host="10.0.0.5"))
    assert not w.satisfies(Policy(host="node6"))
    assert not w.satisfies(Policy(host="node5", resources={"TPU": 1}))  # (every field holds)
    assert WorkerView("tcp://a:1", 0).satisfies(Policy(worker="0"))  # (LocalCluster's names)


def test_a_policy_is_checked_hashable_and_round_trips():
    p = Policy(host="node1", resources=[("GPU", 1)])
    assert p == Policy(host="node1", resources={"GPU": 1.0}) and hash(p) == hash(
        Policy(host="node1", resources={"GPU": 1})
    )
    assert Policy.from_dict(p.to_dict()) == p
    assert repr(p) == "Policy(host='node1', resources={'GPU': 1.0})"
    for bad in ({"GPU": 0}, {"GPU": -1}, {"": 1}, {"GPU": True}):
        with pytest.raises(ValueError, match="positive amount"):
            Policy(resources=bad)
    with pytest.raises(TypeError, match="mapping"):
        Policy(resources=5)
    with pytest.raises(TypeError, match="host must be"):
        Policy(host="")


def test_policy_groups_follow_dragon():
    a, b = Policy(host="a"), Policy(host="b")
    assert policy_groups(None, None, None) == []
    assert policy_groups(a, None, 2) == [(a, None)]  # one policy: every manager
    assert policy_groups([a, b], None, None) == [(a, 1), (b, 1)]  # (Dragon's default 1)
    assert policy_groups([a, b], 3, None) == [(a, 3), (b, 3)]
    assert policy_groups({a: 2, b: 1}, None, None) == [(a, 2), (b, 1)]
    with pytest.raises(ValueError, match="managers_per_worker .* must be None"):
        policy_groups([a], 2, 2)
    with pytest.raises(ValueError, match="no manager"):
        policy_groups([], None, None)
    with pytest.raises(ValueError, match="goes with a list"):
        policy_groups(a, 2, None)
    with pytest.raises(ValueError, match="managers_per_policy must be in"):
        policy_groups([a], 0, None)
    with pytest.raises(TypeError, match="not a dask_ddict.Policy"):
        policy_groups(["a"], 1, None)


def test_assign_spreads_each_policys_managers_over_the_workers_that_satisfy_it():
    views = [
        WorkerView("tcp://c:1", resources={}),
        WorkerView("tcp://g:1", resources={"GPU": 1}),
        WorkerView("tcp://g:2", resources={"GPU": 1}),
    ]
    assert assign([(GPU, None)], views, 2) == [("tcp://g:1", GPU)] * 2 + [("tcp://g:2", GPU)] * 2
    anyw = Policy()
    placed = assign([(GPU, 3), (anyw, 3)], views, 1)
    assert [w for w, _ in placed] == [
        "tcp://g:1",
        "tcp://g:2",
        "tcp://g:1",
        "tcp://c:1",
        "tcp://c:1",
        "tcp://g:2",
    ]
    assert [p for _, p in placed] == [GPU] * 3 + [anyw] * 3
    with pytest.raises(ValueError, match=r"no worker satisfies Policy\(host='elsewhere'\)"):
        assign([(Policy(host="elsewhere"), 1)], views, 1)


def test_a_managers_policy_travels_in_its_layout_and_candidates_check_it():
    m = ManagerInfo(0, "w", "h", "h:1", 1, "/s", "127.0.0.1", 1, "/d", policy=GPU)
    layout = Layout(
        "n",
        "00" * 16,
        "s",
        False,
        DDictOptions(),
        (m, ManagerInfo(1, "w", "h", "h:1", 1, "/s1", "127.0.0.1", 1, "/d1")),
        64 << 20,
    )
    again = Layout.deserialize(layout.serialize())
    assert again.managers[0].policy == GPU and again.managers[1].policy is None
    assert Layout.from_dict(layout.to_dict()) == layout
    plain = Candidate("tcp://c:1", "tcp://c:1", "node1:boot", 0, 0, name=0, host="10.0.0.1")
    gpu = Candidate("tcp://g:1", "tcp://g:1", "node2:boot", 0, 0, resources=(("GPU", 1),))
    assert plain.satisfies(None) and not plain.satisfies(GPU) and gpu.satisfies(GPU)
    assert plain.satisfies(Policy(host="node1")) and not gpu.satisfies(Policy(host="node1"))


# -- a cluster with GPU workers ---------------------------------------------------------


def _add_worker(cl: LocalCluster, name: str, **resources: float) -> None:
    spec = cl.new_worker_spec()
    (base,) = spec.values()
    cl.worker_spec[name] = {
        "cls": base["cls"],
        "options": {**base["options"], "resources": resources},
    }
    cl.sync(cl._correct_state)


def _by_name(c: Client) -> dict[str, str]:
    return {str(w["name"]): a for a, w in scheduler_workers(c).items()}


def _until(what: str, ok, seconds: float = 60) -> None:  # noqa: ANN001
    poll_for(ok, seconds, what, 0.2)


@contextlib.contextmanager
def _one_cpu_two_gpus() -> Iterator[tuple[LocalCluster, Client, dict[str, str]]]:
    """A cluster of a CPU worker ("0") and two GPU workers ("gpu0", "gpu1"): the cluster,
    a client, and the workers' addresses by name."""
    with (
        local_cluster(1, memory_limit="1GiB") as cl,
        Client(cl) as c,
    ):
        _add_worker(cl, "gpu0", GPU=1)
        _add_worker(cl, "gpu1", GPU=1)
        c.wait_for_workers(3, timeout=60)
        yield cl, c, _by_name(c)


def test_pinned_managers_move_only_to_workers_that_satisfy_their_policy_else_park():
    """Managers pinned to GPU workers: created only there, moved on retirement only to
    another GPU worker (not the idle CPU worker), parked saying which policy no worker
    satisfies once none is left, and taken by a GPU worker that joins."""
    with _one_cpu_two_gpus() as (cl, c, names):
        gpu0, gpu1, cpu = names["gpu0"], names["gpu1"], names["0"]
        refused = r"no worker satisfies Policy\(resources=\{'TPU': 1.0\}\)"
        with pytest.raises(DDictUnableToCreateError, match=refused):
            DDict(policy=Policy(resources={"TPU": 1}), total_mem="16 MiB", client=c)
        mixed = DDict(policy={Policy(worker="0"): 1, GPU: 2}, total_mem="48 MiB", client=c)
        try:
            first, *rest = mixed.manager_workers  # (one per GPU worker: by address)
            assert first == cpu and sorted(rest) == sorted([gpu0, gpu1])
        finally:
            mixed.destroy()
        d = DDict(policy=GPU, total_mem="32 MiB", client=c, timeout=30)
        try:
            assert sorted(d.manager_workers) == sorted([gpu0, gpu1])
            assert all(m.policy == GPU for m in d._core.layout.managers)
            d.update({i: i for i in range(200)})
            c.retire_workers([gpu0])
            _until("not moved", lambda: gpu0 not in d._core.fresh(force=True).manager_workers)
            assert d.manager_workers == [gpu1, gpu1]  # (not the CPU worker, which has none)
            assert [m["target"] for m in d.moves] == [gpu1]
            assert all(d[i] == i for i in range(200))
            c.retire_workers([gpu1])
            _until("not parked", lambda: all(m.parked for m in d._core.fresh(force=True).managers))
            # (a park is in the layout before its host confirmed it, and in moves after)
            _until("parks recorded", lambda: len([m for m in d.moves if not m["target"]]) >= 2)
            parked = [m for m in d.moves if not m["target"]]
            assert len(parked) == 2 and all(
                "no other worker satisfies its placement policy Policy(resources={'GPU': 1.0})"
                in m["why"]
                for m in parked
            ), parked
            assert d.manager_workers.count(cpu) == 0
            with pytest.raises(DDictManagerUnavailableError, match="parked"):
                d[0]
            _add_worker(cl, "gpu2", GPU=1)
            c.wait_for_workers(2, timeout=60)
            gpu2 = _by_name(c)["gpu2"]
            _until(
                "not adopted", lambda: not any(m.lost for m in d._core.fresh(force=True).managers)
            )
            assert d.manager_workers == [gpu2, gpu2]
            assert all(d[i] == i for i in range(200))
            assert d.rebalance() == []  # (the CPU worker does not satisfy their policy)
        finally:
            d.destroy()


def test_replicas_of_pinned_managers_are_kept_only_by_workers_that_satisfy_the_policy():
    """A replica may take over its manager (failover): it is placed under the same policy,
    on the other GPU worker, never on the idle CPU worker."""
    with _one_cpu_two_gpus() as (cl, c, names):
        d = DDict(policy=GPU, replicas=1, total_mem="32 MiB", client=c, timeout=30)
        try:
            d.update({i: i for i in range(50)})
            reps = c.sync(c.scheduler.ddict_replicas, name=d.get_name())
            primaries = d.manager_workers
            assert sorted(primaries) == sorted([names["gpu0"], names["gpu1"]])
            assert {int(k): list(v) for k, v in reps.items()} == {
                mid: [names["gpu1"] if w == names["gpu0"] else names["gpu0"]]
                for mid, w in enumerate(primaries)
            }
        finally:
            d.destroy()


def test_a_restarted_dictionary_keeps_its_managers_policies():
    """``restart=True`` takes no policy (as in Dragon): the kept managers come back where
    their shards are, with the policies and the count they had."""
    with (
        local_cluster(1, memory_limit="1GiB") as cl,
        Client(cl) as c,
    ):
        _add_worker(cl, "gpu0", GPU=1)
        c.wait_for_workers(2, timeout=60)
        gpu0 = _by_name(c)["gpu0"]
        d = DDict(policy=[GPU], managers_per_policy=3, name="pinned", total_mem="48 MiB", client=c)
        d.update({i: i for i in range(30)})
        d.destroy(allow_restart=True)
        d = DDict(name="pinned", restart=True, total_mem="48 MiB", client=c)
        try:
            assert d.manager_workers == [gpu0] * 3
            assert all(m.policy == GPU for m in d._core.layout.managers)
            assert all(d[i] == i for i in range(30))
        finally:
            d.destroy()
