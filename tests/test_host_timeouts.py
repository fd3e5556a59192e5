"""A supervisor's control calls and their deadlines: a host process that does not
answer in time is killed and replayed, never left out of step; a copy is given the
time a copy may take.

Each test stops a real host process (SIGSTOP) under a short ``ddict.host.start-timeout``
(read in this process: a local cluster's nannies, and so their supervisors, live here).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import dask
import pytest
from distributed import Client

from dask_ddict import DDict, DDictError
from dask_ddict.host import control
from dask_ddict.host.control_calls import ControlCalls
from dask_ddict.host.supervisor import HostSupervisor
from tests.support.cluster import local_cluster
from tests.support.polling import poll_for
from tests.support.shards import shards, shm_entries


def _supervisors(cluster, d: DDict, mid: int) -> tuple[HostSupervisor, HostSupervisor | None]:  # noqa: ANN001
    """The supervisor that serves manager ``mid``, and another one (if any)."""
    mine = d._core.layout.managers[mid].supervisor
    sups = {n.address: n.plugins["ddict"].supervisor for n in cluster.workers.values()}
    others = [s for a, s in sups.items() if a != mine]
    return sups[mine], (others[0] if others else None)


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # (killed meanwhile)
        pass


def _answers(sup: HostSupervisor) -> bool:
    try:
        return bool(sup.call(control.Ping()) == sup.proc.pid)
    except DDictError:  # (this incarnation may be starting, or be killed again)
        return False


@contextlib.contextmanager
def _stopped(pid: int, resume_after: float | None = None) -> Iterator[None]:
    """Host process ``pid`` stopped (SIGSTOP) under a 1 s ``ddict.host.start-timeout``,
    resumed ``resume_after`` seconds in, or at the end (unless it was killed)."""
    with dask.config.set({"ddict.host.start-timeout": "1 s"}):
        os.kill(pid, signal.SIGSTOP)
        timer = None if resume_after is None else threading.Timer(resume_after, _resume, (pid,))
        if timer is not None:
            timer.start()
        try:
            yield
        finally:
            if timer is not None:
                timer.join()
            _resume(pid)


def _replaced(sup: HostSupervisor) -> None:
    """Wait for an incarnation that answers (a restart under the 1 s deadline may itself
    time out: the next one, under the usual one, does not)."""
    poll_for(lambda: sup.restart_count >= 1 and _answers(sup), 30, "an incarnation that answers")


def test_a_host_that_does_not_answer_in_time_is_restarted_never_left_out_of_step():
    """Before, the timed-out call's late answer stayed in the pipe and answered the next
    call (a shard-size table read as a process id), and whatever the late call did was
    unknown to the supervisor's registry."""
    with local_cluster(1) as cl, Client(cl) as c:
        d = DDict(total_mem="16 MiB", client=c)
        mine = shards(d)
        for i in range(200):
            d[i] = i
        sup, _ = _supervisors(cl, d, 0)
        uid = d._core.layout.uid
        pid = sup.proc.pid
        with _stopped(pid):
            with pytest.raises(DDictError, match="did not answer within 1.0 s; it was killed"):
                sup.call(control.ShardBytes(uid))
        _replaced(sup)
        assert sup.proc.pid != pid
        sizes = sup.call(control.ShardBytes(uid))  # each call its own answer
        assert isinstance(sizes, dict) and set(sizes) == set(range(d._core.layout.num_managers))
        assert [d[i] for i in range(200)] == list(range(200))  # the shards were replayed
        d.destroy()
        assert not (mine & shm_entries())


def test_a_copy_of_a_shard_is_waited_for_past_the_start_timeout():
    """A new replica's copy from a primary that is slow to send (stopped for 3 s here;
    a shard of gigabytes over a slow link) gets ``ddict.move.timeout`` more than
    ``host.start-timeout``: before, the supervisor gave up after ``start-timeout``."""
    with local_cluster(2) as cl, Client(cl) as c:
        d = DDict(total_mem="32 MiB", n_workers=2, client=c)
        mine = shards(d)
        for i in range(300):
            d[i] = i
        layout = d._core.layout
        sup_a, sup_b = _supervisors(cl, d, 0)
        assert sup_b is not None
        a, b = ControlCalls(sup_a), ControlCalls(sup_b)
        held = a.replica_hold(layout.uid, 0)
        pid = sup_a.proc.pid
        with _stopped(pid, resume_after=3.0):
            t0 = time.monotonic()
            info = b.replica_seed(
                held["spec"], 0, asdict(layout.managers[0]), held["used_bytes"], held["map_size"]
            )
            took = time.monotonic() - t0
        assert took >= 2.5  # it waited for the copy, and the copy came
        assert info["manager_id"] == 0
        assert sup_a.restart_count == sup_b.restart_count == 0  # nobody was killed
        a.replica_targets(layout.uid, 0, release=True)
        assert b.replica_drop(layout.uid, 0)
        assert [d[i] for i in range(300)] == list(range(300))
        d[300] = 300  # writes resumed
        d.destroy()
        assert not (mine & shm_entries())


def test_each_control_message_is_given_the_time_it_may_take():
    """``answer_within`` (the one declaration of a control message's deadline): what moves
    a shard's bytes gets ``move.timeout`` more than ``start-timeout``; what waits on
    storage as long as it takes (a close waits for its persists; an opening that
    restores) is never cut short by a kill; the rest gets ``start-timeout``."""
    from dask_ddict.options import DDictOptions

    def spec(**options: Any) -> control.DictSpec:
        return control.DictSpec("d", "ab" * 8, "s", DDictOptions(**options), 1 << 20, 2)

    source = {"manager_id": 0}
    with dask.config.set({"ddict.host.start-timeout": "7 s", "ddict.move.timeout": "100 s"}):
        for msg, want in [
            (control.Ping(), 7.0),
            (control.ShardBytes("u"), 7.0),
            (control.OpenManagers(spec(), (0,)), 7.0),
            (control.MoveIn(spec(), 0, path="/p"), 7.0),  # (same machine: no copy)
            (control.MoveIn(spec(), 0, source=source), 107.0),
            (control.ReplicaSeed(spec(), 0, source, 1, 2), 107.0),
            (control.MovePrepare("d", 0, 1 << 20, 1 << 10), 107.0),
            (control.CloseManagers("u"), None),
            (control.OpenManagers(spec(restore_from=3, persist_path="/p"), (0,)), None),
        ]:
            assert control.answer_within(msg) == want, msg
    with dask.config.set({"ddict.move.timeout": None}):
        assert control.answer_within(control.ReplicaSeed(spec(), 0, source, 1, 2)) is None


def test_a_move_aborted_while_its_host_does_not_answer_is_served_by_the_next_one():
    """A move's abort (its manager serves on here) whose host does not answer in time:
    the host is killed, and the abort returns (before, it sent the manager's re-opening
    to the killed pipe and failed); the next incarnation, replayed from the registry,
    serves the manager with every key, and writes go on."""
    with local_cluster(1) as cl, Client(cl) as c:
        d = DDict(total_mem="16 MiB", client=c)
        mine = shards(d)
        for i in range(100):
            d[i] = i
        sup, _ = _supervisors(cl, d, 0)
        calls, uid, pid = ControlCalls(sup), d._core.layout.uid, sup.proc.pid
        calls.move_out(uid, 0, copy=False)  # (paused, as a move to this machine pauses it)
        with _stopped(pid):
            assert calls.move_abort(uid, 0) is None
        _replaced(sup)
        assert [d[i] for i in range(100)] == list(range(100))
        d[100] = 100  # (manager 0's writes go on: it serves again, not paused)
        assert all(d[i] == i for i in range(101))
        d.destroy()
        assert not (mine & shm_entries())
