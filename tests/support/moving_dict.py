"""The dictionary as a hypothesis state machine whose steps include moving managers.

Puts, pops, ``fetch_add`` and batches from the client and from a stale handle (one that
never asks where managers are, so it meets every move at the old place and follows it),
interleaved with moves of a random manager to a random worker, evacuations of a
worker's host (what its retirement does before it leaves) and moves of every manager at
once.  After every step the dictionary equals a plain dict.  The moves' tests run it
(``tests/test_moves_state.py``), and the replicas' tests add host kills to it
(``tests/test_replicas_state.py``); the class attribute :attr:`MovingDict.client` is the
cluster's client, set by the test that runs it.
"""

from __future__ import annotations

from typing import Any

from distributed import Client
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dask_ddict import DDict
from dask_ddict.client.workers import scheduler_workers
from dask_ddict.errors import raise_from_wire

keys = st.one_of(st.integers(-50, 50), st.text(max_size=4))
values = st.one_of(st.integers(), st.binary(max_size=64), st.text(max_size=8))


class MovingDict(RuleBasedStateMachine):
    client: Client

    @initialize()
    def start(self) -> None:
        self.d = DDict(managers_per_worker=1, total_mem="48 MiB", client=self.client, timeout=30)
        self.stale = DDict.attach(self.d.serialize())  # never asks where managers are
        self.model: dict[Any, Any] = {}
        self.client.wait_for_workers(3, timeout=60)  # (a scaling step may have just run)
        self.workers = sorted(scheduler_workers(self.client))

    def teardown(self) -> None:
        if hasattr(self, "d"):
            self.stale.detach()
            self.d.destroy()

    def _handle(self, stale: bool) -> DDict:
        return self.stale if stale else self.d

    @rule(k=keys, v=values, stale=st.booleans())
    def put(self, k: Any, v: Any, stale: bool) -> None:
        self._handle(stale)[k] = v
        self.model[k] = v

    @rule(k=keys, stale=st.booleans())
    def pop(self, k: Any, stale: bool) -> None:
        assert self._handle(stale).pop(k, None) == self.model.pop(k, None)

    @rule(k=keys, n=st.integers(-5, 5), stale=st.booleans())
    def fetch_add(self, k: Any, n: int, stale: bool) -> None:
        key = ("counter", k)
        assert self._handle(stale).fetch_add(key, n) == self.model.get(key, 0)
        self.model[key] = self.model.get(key, 0) + n

    @rule(items=st.dictionaries(keys, values, max_size=20), stale=st.booleans())
    def batch_across_a_move(self, items: dict[Any, Any], stale: bool) -> None:
        h = self._handle(stale)
        h.start_batch_put()
        half = len(items) // 2
        for i, (k, v) in enumerate(items.items()):
            if i == half:
                self.move(0, 1)
            h[k] = v
        h.end_batch_put()
        self.model.update(items)

    @rule(mid=st.integers(0, 2), to=st.integers(0, 2))
    def move(self, mid: int, to: int) -> None:
        worker = self.workers[to]
        reply = self.client.sync(
            self.client.scheduler.ddict_move, name=self.d.get_name(), manager_id=mid, worker=worker
        )
        raise_from_wire(reply)
        assert reply is None or reply["target"] == worker

    @rule(w=st.integers(0, 2))
    def evacuate(self, w: int) -> None:
        """A retirement's part here: every manager of worker ``w``'s host moves off it
        (the worker stays, to take managers again later)."""
        nanny = scheduler_workers(self.client)[self.workers[w]]["nanny"]
        said = self.client.sync(
            self.client.scheduler.ddict_evacuate,
            supervisor=nanny,
            why="a step of the state machine",
        )
        assert said["parked"] == 0
        assert self.workers[w] not in self.d._core.fresh(force=True).manager_workers

    @rule()
    def rotate_every_manager(self) -> None:
        for mid in range(self.d.num_managers):
            self.move(
                mid,
                (self.workers.index(self.d._core.fresh(force=True).managers[mid].worker) + 1)
                % len(self.workers),
            )

    @invariant()
    def equals_the_model(self) -> None:
        if hasattr(self, "d"):
            assert dict(self.stale.items()) == self.model
            assert len(self.d) == len(self.model)
