"""A Dragon program's DDict calls run here with only the import changed (issue 54, item 1).

Dragon's names are accepted beside ours, with Dragon's meanings: ``managers_per_node``
and ``n_nodes`` (a Dask worker stands for a node), ``fetch_add(key, val=...)``,
``sync(timeout=...)``, ``manager_nodes``, ``trace``, ``streams_per_manager`` (without
effect), ``DDictUnableToCreateError``, ``profile()``/``profile_reset()``.  Dragon's
arguments that mean nothing here yet (placement policies, persister classes) are
refused with what to use instead.  Last, Dragon's documented examples run.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
from distributed import Client

from dask_ddict import (
    AsyncDDict,
    DDict,
    DDictError,
    DDictPersistCheckpointError,
    DDictTimeoutError,
    DDictUnableToCreateError,
    Policy,
)
from dask_ddict.client.creation import (
    DRAGON_NAMES,
    DRAGON_PLACEMENT,
    create_request,
    created_layout,
    trace_logging,
)
from dask_ddict.client.handle import CREATE_ARGUMENTS, CREATE_SIGNATURE
from dask_ddict.client.workers import scheduler_workers
from dask_ddict.errors import error_to_wire
from dask_ddict.transport import timing
from tests.support.processes import stop_process

DEFAULTS = {k: CREATE_SIGNATURE.parameters[k].default for k in CREATE_ARGUMENTS} | {
    "total_mem": "64 MiB"
}


def request(**given):
    return create_request({**DEFAULTS, **given})


@pytest.fixture
def timings():
    """Timings reset and on for the test, off and empty after it (they are the process's)."""
    timing.reset(True)
    yield
    timing.reset(False)


# -- the constructor's arguments (no cluster: refused or taken before anything is sent) --


def test_dragons_names_of_our_arguments_mean_ours():
    assert DRAGON_NAMES == {"managers_per_node": "managers_per_worker", "n_nodes": "n_workers"}
    req = request(managers_per_node=3, n_nodes=2)
    assert (req["managers_per_worker"], req["n_workers"]) == (3, 2)
    assert request(managers_per_worker=3, n_workers=2) == req
    for dragon, ours in DRAGON_NAMES.items():
        with pytest.raises(
            TypeError,
            match=rf"got both {ours}= and {dragon}= \({dragon} is "
            rf"Dragon's name of {ours}\)",
        ):
            request(**{dragon: 1, ours: 1})  # (equal values too: one name, once)
    with pytest.raises(TypeError, match="managers_per_worker must be an int"):
        request(managers_per_node="2")  # (checked under our name: the one the docs use)


def test_dragons_arguments_without_meaning_here_are_refused_saying_what_to_use():
    from dask_ddict import (
        DAOSCheckpointPersister,
        NULLCheckpointPersister,
        PosixCheckpointPersister,
    )

    with pytest.raises(ValueError, match=r"^persister_class=DAOS.*persist_path=.*s3://"):
        request(persister_class=DAOSCheckpointPersister)
    with pytest.raises(TypeError, match=r"^persister_class must be .*CheckpointPersister"):
        request(persister_class=type("PosixCheckpointPersister", (), {}))  # (not ours)
    request(policy=None, managers_per_policy=None, orc_policy=None, persister_class=None)
    # (Dragon's own persister names are taken: tests/test_persisters.py)
    assert request(persister_class=NULLCheckpointPersister)["options"]["persister"] == "null"
    assert (
        request(persister_class=PosixCheckpointPersister, persist_path="/tmp/x", persist_freq=1)[
            "options"
        ]["persister"]
        == "directory"
    )


def test_dragons_placement_arguments_place_managers_by_policy():
    """``policy=``/``managers_per_policy=`` are taken (as groups for the orchestrator);
    ``orc_policy`` is accepted without effect; a wrong type is refused saying what to give."""
    assert DRAGON_PLACEMENT == ("policy", "managers_per_policy", "orc_policy")
    gpu = Policy(resources={"GPU": 1})
    assert request(policy=gpu)["policies"] == [[gpu.to_dict(), None]]
    req = request(policy=[gpu, Policy(host="node1")], managers_per_policy=2)
    assert [c for _, c in req["policies"]] == [2, 2]
    assert "policies" not in request(orc_policy=gpu)  # (without effect)
    for name in ("policy", "orc_policy"):
        with pytest.raises(TypeError, match=rf"{name} must be a .*Policy"):
            request(**{name: object()})
    with pytest.raises(ValueError, match=r"managers_per_policy=2 needs policy=\[\.\.\.\]"):
        request(managers_per_policy=2)
    with pytest.raises(ValueError, match="restart=True .* policy must be None"):
        request(policy=gpu, restart=True, name="x")
    with pytest.raises(ValueError, match=r"n_workers \(n_nodes\) must be None"):
        request(policy=[gpu], n_nodes=2)
    assert request(policy=gpu, n_nodes=2)["n_workers"] == 2  # (one policy: its first 2 workers)


def test_trace_and_streams_per_manager_are_checked_and_accepted():
    for value in (0, 5, None):
        request(streams_per_manager=value)  # (accepted; without effect)
    with pytest.raises(ValueError, match="streams_per_manager"):
        request(streams_per_manager=-1)
    with pytest.raises(TypeError, match="streams_per_manager must be an int"):
        request(streams_per_manager="5")
    with pytest.raises(TypeError, match="trace must be True or False"):
        request(trace="yes")
    level = logging.getLogger("dask_ddict").level
    assert "trace" not in request(trace=True)  # (not the orchestrator's)
    assert logging.getLogger("dask_ddict").level == level  # (validating turns nothing on)


def test_the_async_face_takes_the_same_names():
    """``AsyncDDict.create`` binds to the constructor's signature: Dragon's names too."""
    assert {
        "managers_per_node",
        "n_nodes",
        "trace",
        "streams_per_manager",
        "policy",
        "persister_class",
    } <= CREATE_ARGUMENTS
    bound = CREATE_SIGNATURE.bind(None, managers_per_node=2, n_nodes=1, trace=False)
    assert bound.arguments["managers_per_node"] == 2


def test_trace_turns_on_this_processs_debug_logging():
    logger = logging.getLogger("dask_ddict")
    level, handlers = logger.level, list(logger.handlers)
    try:
        trace_logging(False)
        assert logger.level == level  # (False turns nothing on, or off)
        trace_logging(True)
        assert logger.isEnabledFor(logging.DEBUG)
        assert logging.getLogger("dask_ddict.client.core").isEnabledFor(logging.DEBUG)
    finally:
        logger.setLevel(level)
        logger.handlers[:] = handlers


# -- DDictUnableToCreateError ---------------------------------------------------------------


def test_a_refused_creation_is_unable_to_create_a_ddict_error_with_its_code():
    assert issubclass(DDictUnableToCreateError, DDictError)
    reply = error_to_wire(DDictError("a DDict named 'x' already exists", "INVALID_ARGUMENT"))
    with pytest.raises(DDictUnableToCreateError, match="already exists") as e:
        created_layout(reply)
    assert e.value.code == "INVALID_ARGUMENT" and e.value.lib_err == "DRAGON_INVALID_ARGUMENT"
    # refusals of a more precise type keep it (existing `except` clauses keep working)
    for error in (
        ValueError("n_workers=3 but only 2 workers are available"),
        DDictPersistCheckpointError("checkpoint 3 is not persisted"),
    ):
        with pytest.raises(type(error)) as kept:
            created_layout(error_to_wire(error))
        assert type(kept.value) is type(error)


def test_a_name_taken_is_unable_to_create_and_still_a_ddict_error(client):
    with DDict(total_mem="16 MiB", client=client, name="taken"):
        with pytest.raises(DDictUnableToCreateError, match="'taken' already exists"):
            DDict(total_mem="16 MiB", client=client, name="taken")
        try:
            DDict(total_mem="16 MiB", client=client, name="taken")
        except DDictError as e:  # (what a program caught before the name existed)
            assert e.lib_err == "DRAGON_INVALID_ARGUMENT"
        with pytest.raises(DDictUnableToCreateError):
            DDict(total_mem="16 MiB", client=client, name="gone", restart=True)


# -- on a cluster: the names do what Dragon's do ----------------------------------------


def test_managers_per_node_n_nodes_and_manager_nodes_on_a_cluster(client):
    workers = sorted(scheduler_workers(client))
    with DDict(
        managers_per_node=2,
        n_nodes=1,
        total_mem="32 MiB",
        client=client,
        trace=False,
        streams_per_manager=5,
        policy=None,
        managers_per_policy=None,
        orc_policy=None,
        persister_class=None,
    ) as d:
        assert d.num_managers == 2  # managers_per_node * n_nodes, as in Dragon
        assert d.manager_nodes == d.manager_workers == [workers[0]] * 2
        d["k"] = 1
        assert d["k"] == 1
    with DDict(managers_per_node=1, total_mem="32 MiB", client=client) as d:  # every node
        assert sorted(d.manager_nodes) == workers


def test_fetch_add_takes_dragons_val(client):
    with DDict(total_mem="16 MiB", client=client) as d:
        assert d.fetch_add("c", val=5) == 0
        assert d.fetch_add("c", 2) == 5
        assert d.fetch_add("c", n=-1) == 7
        assert d.fetch_add("c") == 6  # (n's default: 1)
        assert d.fetch_add("c", val=0) == 7
        with pytest.raises(TypeError, match=r"got both n= and val="):
            d.fetch_add("c", 1, val=1)
        with pytest.raises(TypeError, match="val must be an int"):
            d.fetch_add("c", val=1.5)
        assert d.fetch_add("c", 0) == 7  # the refused calls changed nothing


def test_the_async_face_takes_val_and_has_manager_nodes(cluster):
    async def body() -> None:
        async with Client(cluster.scheduler_address, asynchronous=True) as c:
            ad = await AsyncDDict.create(
                managers_per_node=1, n_nodes=1, total_mem="16 MiB", client=c, trace=False
            )
            assert await ad.fetch_add("c", val=4) == 0
            assert await ad.fetch_add("c", 1) == 4
            with pytest.raises(TypeError, match="got both n= and val="):
                await ad.fetch_add("c", n=1, val=1)
            assert ad.manager_nodes == ad.manager_workers and len(ad.manager_nodes) == 1
            await ad.sync(timeout=10)
            assert isinstance(ad.profile(), timing.Profile)
            await ad.destroy()

    asyncio.run(body())


def test_sync_waits_within_its_timeout(client, tmp_path):
    """``sync(timeout=...)`` bounds the wait for the managers' background persists:
    a host process that does not answer (stopped) costs the timeout plus the slack,
    then ``DDictTimeoutError`` naming the sync and the manager; nothing is lost, and
    a later ``sync()`` completes."""
    with DDict(
        n_workers=1,
        total_mem="16 MiB",
        client=client,
        persist_path=str(tmp_path / "p"),
        name="synced",
    ) as d:
        d["k"] = 1
        d.persist()
        d.sync(timeout=30)
        d.sync(timeout="30s")
        assert d.persisted_ids() == [0]
        host = psutil.Process(d.stats[0].pid)
        stop_process(host)
        try:
            began = time.monotonic()
            with pytest.raises(DDictTimeoutError) as e:
                d.sync(timeout=0.5)
            took = time.monotonic() - began
        finally:
            host.resume()
        text = str(e.value)
        assert text.startswith(
            "sync() of DDict 'synced': background persistence was not done "
            "on every manager within 0.5 s"
        )
        assert "SYNC" in text and "manager 0" in text and "[TIMEOUT]" in text
        assert 0.5 <= took < 0.5 + 1.0 + 5.0  # (the timeout, the slack, a busy CI machine)
        assert isinstance(e.value, TimeoutError)
        d.sync()  # no timeout: as long as it takes (here: at once)
        with pytest.raises(ValueError, match="timeout"):
            d.sync(timeout=-1)


def test_profile_times_each_operation_of_this_process(client, timings):
    with DDict(total_mem="32 MiB", client=client) as d:
        d.profile_reset()  # (what a Dragon program calls first)
        for i in range(50):
            d[i] = i
        for i in range(50):
            assert d[i] == i
        assert 3 in d
        assert len(d) == 50
        d.get_many(range(10))
        d.fetch_add("c", val=1)
        p = d.profile()
        ops = p.operations
        assert ops["put"].count == 50 and ops["get"].count == 50
        assert ops["contains"].count == 1 and ops["fetch_add"].count == 1
        assert ops["len (broadcast)"].count == 1 and ops["get_many"].count == 1
        assert "stats" not in ops  # (nothing else, and a broadcast once, not once per host)
        for t in ops.values():
            assert 0 < t.p50 <= t.p99 <= t.max and t.mean == pytest.approx(t.total / t.count)
        text = str(p)
        assert text.startswith(f"DDict client timings of process {p.pid}")
        assert re.search(r"^put\s+50\s", text, flags=re.M) and "p99 us" in text
        d.profile_reset(False)  # off: nothing is timed, and the report says how to turn it on
        d["x"] = 1
        assert d.profile().operations == {} and "profile_reset()" in str(d.profile())
        with pytest.raises(TypeError, match="enable must be True or False"):
            d.profile_reset("yes")


def test_profiles_percentiles_come_from_a_bounded_reservoir(timings):
    for i in range(timing.RESERVOIR * 3):
        timing._record("op", i * 1e-6)
    t = timing.report().operations["op"]
    assert t.count == timing.RESERVOIR * 3 and t.max == pytest.approx((t.count - 1) * 1e-6)
    assert len(timing._table["op"].samples) == timing.RESERVOIR
    assert 1.0e-3 < t.p50 < 2.0e-3  # (uniform over the whole run: its median, about 1.5 ms)
    calls: list[str] = []

    def outer() -> None:  # an operation timed inside another counts once, as the outer one
        timing.timed("inner", calls.append, "x")

    timing.timed("outer", outer)
    assert calls == ["x"] and "inner" not in timing.report().operations
    assert timing.report().operations["outer"].count == 1


# -- Dragon's documented examples -------------------------------------------------------


def test_dragons_batch_put_example_from_its_developer_guide(client):
    """Dragon's developer guide, "Batch Put Example" (``doc/devguide/ddict.rst``,
    /work/shared/reference), as printed there but for its typo (``"value"git``) and the
    import line: positional constructor arguments, no client (the current one)."""
    ddict = DDict(1, 1, 3000000, working_set_size=2, wait_for_keys=True)

    # writes non-persistent keys using batch put
    ddict.start_batch_put(persist=False)  # batch put starts
    ddict["key1"] = "value"
    ddict["key2"] = "value"
    ddict.end_batch_put()  # batch put ends

    assert (ddict.num_managers, ddict["key1"], len(ddict)) == (1, "value", 2)  # (ours)
    ddict.destroy()


class System:
    """Stands for ``dragon.native.machine.System`` (the import line): a Dask worker is a
    node here."""

    @property
    def nnodes(self) -> int:
        from distributed import get_client

        from dask_ddict.client.workers import scheduler_workers

        return len(scheduler_workers(get_client()))


def _smooth(segment: np.ndarray, left: float | None, right: float | None) -> np.ndarray:
    """One step of the 3-point average, a missing neighbour standing for the edge."""
    padded = np.concatenate(
        ([segment[0] if left is None else left], segment, [segment[-1] if right is None else right])
    )
    return (padded[:-2] + padded[1:-1] + padded[2:]) / 3.0


def _worker_smooth(ddict: DDict, chunk_id: int, iterations: int, checkpoint_id: int) -> None:
    # Dragon's worker's DDict calls, in its order: each step reads its neighbours' chunks
    # at its checkpoint (waited for: wait_for_keys), moves on, and writes its own there.
    ddict.checkpoint_id = checkpoint_id
    num_chunks = ddict["num_chunks"]
    current = np.array(ddict[f"chunk_{chunk_id}"])
    for _ in range(iterations):
        left = np.array(ddict[f"chunk_{chunk_id - 1}"])[-1] if chunk_id > 0 else None
        right = np.array(ddict[f"chunk_{chunk_id + 1}"])[0] if chunk_id < num_chunks - 1 else None
        current = _smooth(current, left, right)
        ddict.checkpoint()
        ddict[f"chunk_{chunk_id}"] = current
    ddict.detach()


@pytest.mark.filterwarnings("ignore:host .* its DDict shards:RuntimeWarning")  # (8 GiB: 2 x 4)
def test_dragons_ddict_smoothing_example_gives_dragons_documented_result(client):
    """Dragon's cookbook "DDict Function Smoothing Example" (``doc/cbook/dragon_dict.rst``,
    ``examples/dragon_data/ddict/ddict_smoothing.py``), validate mode, ``--size 128
    --chunks 4 --iterations 10``: its DDict calls as it makes them (the constructor with
    ``nnodes`` from ``System()`` and 4 GiB per node, ``wait_for_keys``, ``pput`` of the
    constants, workers that set ``checkpoint_id``, read their neighbours, ``checkpoint()``,
    write and ``detach()``, then ``sync_to_newest_checkpoint()`` and the reads), its
    worker processes as tasks (``client.submit`` for ``mp.Process``).  The result is the
    one Dragon's documentation prints: "checkpoint=10 result min=0.012784 max=0.987216"."""
    args = SimpleNamespace(
        managers_per_node=1, working_set_size=3, size=128, chunks=4, iterations=10
    )
    nnodes = System().nnodes
    kwargs = {"wait_for_keys": True, "working_set_size": args.working_set_size, "timeout": 200}
    ddict = DDict(args.managers_per_node, nnodes, nnodes * int(4 * 1024 * 1024 * 1024), **kwargs)
    try:
        chunk_size = args.size // args.chunks
        ddict.pput("num_chunks", args.chunks)
        ddict.pput("chunk_size", chunk_size)
        values = np.linspace(0.0, 1.0, args.size, dtype=np.float64)
        for chunk_id in range(args.chunks):
            ddict[f"chunk_{chunk_id}"] = values[chunk_id * chunk_size : (chunk_id + 1) * chunk_size]
        # (mp.Process per chunk: a task each, all running at once as Dragon's processes
        # do, so spread over the workers' threads: a chunk waits for its neighbours)
        slots = [w for w, n in sorted(client.nthreads().items()) for _ in range(n)]
        assert len(slots) >= args.chunks
        tasks = [
            client.submit(
                _worker_smooth,
                ddict,
                chunk_id,
                args.iterations,
                0,
                pure=False,
                workers=[slots[chunk_id]],
                allow_other_workers=False,
            )
            for chunk_id in range(args.chunks)
        ]
        client.gather(tasks)
        ddict.sync_to_newest_checkpoint()
        result = np.concatenate([np.array(ddict[f"chunk_{c}"]) for c in range(ddict["num_chunks"])])
        assert (
            f"checkpoint={ddict.checkpoint_id} result min={result.min():.6f} max={result.max():.6f}"
        ) == "checkpoint=10 result min=0.012784 max=0.987216"
    finally:
        ddict.destroy()
