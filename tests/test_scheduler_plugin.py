"""The orchestrator's state machine alone, against a fake scheduler and fake supervisors."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from dask_ddict.cluster.refusals import refusing
from dask_ddict.cluster.scheduler_plugin import DDictSchedulerPlugin
from dask_ddict.errors import DDictError, DDictFullError, error_to_wire, raise_from_wire
from dask_ddict.layout import Layout
from dask_ddict.options import DDictOptions


class FakeSupervisors:
    """The control handlers of every nanny: records calls, answers like the real ones."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.gone: set[str] = set()
        self.full: set[str] = set()

    def rpc(self, address: str) -> Any:
        sup = self

        class Handlers:
            def __getattr__(self, op: str) -> Any:
                async def call(**kwargs: Any) -> Any:
                    sup.calls.append((op, address, kwargs))
                    if address in sup.gone:
                        raise OSError(f"{address} is gone")
                    return getattr(sup, op)(address, **kwargs)

                return call

        return Handlers()

    def ddict_create_managers(
        self, address: str, *, manager_ids: list[int], worker: str, **kw: Any
    ) -> Any:
        if address in self.full:
            return error_to_wire(DDictFullError("no room on " + address))  # as supervisors do
        return [
            {
                "manager_id": m,
                "worker": worker,
                "hostname": "h",
                "host_id": "h:boot",
                "pid": 1,
                "uds_path": f"/tmp/{address}.sock",
                "tcp_host": "127.0.0.1",
                "tcp_port": 1,
                "store_path": f"/dev/shm/ddict-{m}",
                "memory": 1 << 40,
                "available": 1 << 39,
                "shard_dir_free": 1 << 39,
                "shard_bytes": 1 << 30,
                "unbacked": 0,
            }
            for m in manager_ids
        ]

    def ddict_destroy_managers(self, address: str, **kw: Any) -> int:
        return 1

    def ddict_host_info(self, address: str) -> dict[str, Any]:
        return {"host_pid": 1}

    def ddict_remove_paths(self, address: str, paths: list[str]) -> int:
        return len(paths)


def worker(address: str, nanny: str) -> Any:
    """What the plugin reads of a ``WorkerState``."""
    return SimpleNamespace(address=address, nanny=nanny, host="127.0.0.1", memory_limit=0)


def scheduler(n: int = 2) -> Any:
    sups = FakeSupervisors()
    workers = {f"tcp://w{i}": worker(f"tcp://w{i}", f"tcp://n{i}") for i in range(n)}

    async def register(*args: Any, **kwargs: Any) -> None:
        return None

    return SimpleNamespace(
        handlers={},
        workers=workers,
        address="tcp://s",
        rpc=sups.rpc,
        sups=sups,
        security=SimpleNamespace(require_encryption=False),
        register_nanny_plugin=register,
        register_worker_plugin=register,
    )


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def started(n: int = 2) -> tuple[DDictSchedulerPlugin, Any]:
    s = scheduler(n)
    plugin = DDictSchedulerPlugin()
    await plugin.start(s)
    assert {"ddict_create", "ddict_attach", "ddict_destroy"} <= set(s.handlers)
    return plugin, s


async def create(plugin: DDictSchedulerPlugin, name: str = "d", **kw: Any) -> Layout:
    opts = DDictOptions(**kw).to_dict()
    return Layout.from_dict(
        await plugin.create(name=name, options=opts, total_mem=64 << 20, managers_per_worker=2)
    )


def test_create_places_managers_on_supervisors_and_refuses_a_second_of_a_name():
    async def main() -> None:
        plugin, s = await started()
        for w in ("tcp://w0", "tcp://w1", "tcp://gone"):  # what each worker's plugin reports
            s.handlers["ddict_hash_probe"](
                worker=w, probe=7 if w == "tcp://gone" else 5, seed="6640"
            )
        lay = await create(plugin)
        assert [m.manager_id for m in lay.managers] == [0, 1, 2, 3]
        assert [m.supervisor for m in lay.managers] == ["tcp://n0"] * 2 + ["tcp://n1"] * 2
        assert (lay.hash_probes, lay.hash_seed) == ((5,), "6640")  # connected workers only
        s.handlers["ddict_hash_probe"](worker="tcp://w1", probe=6, seed="")  # w1 restarted
        attached = Layout.from_dict(plugin.attach("d"))
        assert attached.uid == lay.uid
        assert (attached.hash_probes, attached.hash_seed) == ((5, 6), "")
        with pytest.raises(
            DDictError, match="already exists: attach with DDict.from_name.*dask ddict destroy d"
        ):
            await create(plugin)
        anonymous = await plugin.create(
            name="", options=DDictOptions().to_dict(), total_mem=64 << 20, managers_per_worker=1
        )
        assert anonymous["name"] and anonymous["name"] != "d"

    run(main())


def test_a_failed_creation_undoes_itself():
    async def main() -> None:
        plugin, s = await started()
        s.sups.full.add("tcp://n1")
        with pytest.raises(DDictFullError, match="no room"):
            await create(plugin)
        undone = {a for op, a, _ in s.sups.calls if op == "ddict_destroy_managers"}
        assert undone == {"tcp://n0", "tcp://n1"} and plugin.names() == []

    run(main())


def test_a_worker_restarted_by_its_nanny_loses_nothing():
    async def main() -> None:
        plugin, s = await started()
        lay = await create(plugin)
        await plugin.remove_worker(s, "tcp://w0", stimulus_id="x")
        assert not any(m.lost for m in Layout.from_dict(plugin.attach("d")).managers)
        s.workers["tcp://w9"] = worker("tcp://w9", "tcp://n0")
        plugin.add_worker(s, "tcp://w9")  # the same nanny's new worker
        now = Layout.from_dict(plugin.attach("d"))
        assert [m.worker for m in now.managers[:2]] == ["tcp://w9"] * 2
        assert now.epoch == lay.epoch + 1

    run(main())


def test_a_host_gone_with_its_nanny_marks_its_managers_lost_once():
    async def main() -> None:
        plugin, s = await started()
        await create(plugin)
        s.sups.gone.add("tcp://n1")
        await plugin.remove_worker(s, "tcp://w1", stimulus_id="x")
        lay = Layout.from_dict(plugin.attach("d"))
        assert [m.lost for m in lay.managers] == [False, False, True, True]
        probes = [c for c in s.sups.calls if c[0] == "ddict_host_info"]
        await plugin.remove_worker(s, "tcp://w1", stimulus_id="y")  # remembered: no new probe
        assert len([c for c in s.sups.calls if c[0] == "ddict_host_info"]) == len(probes)
        # every worker may be retired by adaptive scaling: its managers move first
        retirable = plugin.valid_workers_downscaling(s, list(s.workers.values()))
        assert [w.address for w in retirable] == sorted(s.workers)

    run(main())


def test_destroy_and_keep_for_restart():
    async def main() -> None:
        plugin, s = await started()
        lay = await create(plugin)
        assert not await plugin.destroy("d", "wrong-uid")
        assert await plugin.destroy("d", lay.uid, allow_restart=True)
        assert plugin.names() == [] and plugin.names_kept() == ["d"]
        assert not await plugin.destroy("d", lay.uid)  # already gone: idempotent
        with pytest.raises(DDictError, match="no DDict named 'd'"):
            plugin.attach("d")

    run(main())


def test_a_refusal_is_a_reply_and_a_bug_still_raises():
    """The ``ddict_create`` and ``ddict_attach`` handlers answer a user's mistake; a bug
    raises, so that Dask logs it with its traceback."""

    async def main() -> None:
        plugin, s = await started()
        await create(plugin)
        args = dict(
            name="d", options=DDictOptions().to_dict(), total_mem=64 << 20, managers_per_worker=2
        )
        reply = await s.handlers["ddict_create"](**args)
        assert reply["error"][0] == "DDictError" and "already exists" in reply["error"][1]
        with pytest.raises(DDictError, match="already exists"):
            raise_from_wire(reply)

        reply = s.handlers["ddict_attach"](name="nope")  # attach answers the same way
        with pytest.raises(DDictError, match="no DDict named 'nope'"):
            raise_from_wire(reply)

        async def bug(**kwargs: Any) -> Any:
            raise KeyError("a bug")

        def sync_bug(**kwargs: Any) -> Any:
            raise KeyError("a sync bug")

        with pytest.raises(KeyError, match="a bug"):
            await refusing(bug)(**args)
        with pytest.raises(KeyError, match="a sync bug"):
            refusing(sync_bug)(**args)

    run(main())


def test_why_a_host_is_gone_reaches_the_layout():
    """Clients read in the layout why managers were lost: the supervisor's word that it
    closes, made precise by how its worker left (retired), or the scheduler's own view."""

    async def main() -> None:
        plugin, s = await started(3)
        await create(plugin)  # managers 0-1 on n0, 2-3 on n1, 4-5 on n2

        def why() -> list[str]:
            return [m.lost_why for m in Layout.from_dict(plugin.attach("d")).managers]

        await plugin.remove_worker(s, "tcp://w0", stimulus_id="retire-workers-1.5")
        assert why() == [""] * 6  # its nanny still serves: nothing lost yet
        s.handlers["ddict_host_gone"](supervisor="tcp://n0", why="its nanny closed")
        assert why()[:2] == ["its worker was retired"] * 2 and why()[2:] == [""] * 4
        s.handlers["ddict_host_gone"](supervisor="tcp://n1", why="its nanny closed")
        assert why()[2:4] == ["its nanny closed"] * 2
        s.sups.gone.add("tcp://n2")
        await plugin.remove_worker(s, "tcp://w2", stimulus_id="handle-worker-cleanup-2.5")
        assert (
            why()[4:]
            == [
                "its worker's connection to the scheduler broke, and its nanny "
                "tcp://n2 does not answer"
            ]
            * 2
        )
        s.handlers["ddict_host_gone"](supervisor="tcp://n2", why="later")
        assert why()[4:] == [why()[4]] * 2  # the first reason stays

    run(main())


def test_a_supervisor_that_gave_up_is_lost_but_still_cleans_up():
    async def main() -> None:
        plugin, s = await started()
        lay = await create(plugin)
        s.handlers["ddict_host_gone"](supervisor="tcp://n1", why="it gave up", closing=False)
        now = Layout.from_dict(plugin.attach("d"))
        assert [m.lost for m in now.managers] == [False, False, True, True]
        assert now.managers[2].lost_why == "it gave up" and now.epoch == lay.epoch + 1
        assert await plugin.destroy("d", lay.uid, allow_restart=True)
        destroyed = {a for op, a, _ in s.sups.calls if op == "ddict_destroy_managers"}
        assert destroyed == {"tcp://n0", "tcp://n1"}  # (it lives: it keeps or removes its shards)

    run(main())
