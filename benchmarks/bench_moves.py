"""Moving managers between host processes: one command, one table.

    python benchmarks/bench_moves.py [--quick] [--gib 1.0] [--two-host-mib 512]
                                     [--no-two-hosts]

Each row prints the measured value, its target and whether it is met:

* ``move of a manager holding N GiB within one machine``: a 2-worker
  LocalCluster (worker processes), a DDict with one manager per worker; manager
  0 is filled with N GiB of 16 MiB numpy arrays (1 GiB; ``--quick``: 256 MiB)
  and moved to the other worker with the scheduler's ``ddict_move``: the
  ``seconds`` its writes were paused (target <= 0.1 s whatever its size), and
  the same for the manager while it was nearly empty, for comparison.
* ``p99 put 100 B to a manager that does not move, during moves``: 100 B puts
  to manager 1, from a thread of this process (whose LocalCluster scheduler runs
  the moves) and from a client process of its own: for 2 s (``--quick``: 1 s)
  with no move, then during 8 (3) moves of manager 0 (N GiB) into and out of
  manager 1's host process; only the puts that start while a ``ddict_move``
  call is under way count as "during".  Target: p99 during <= 2x p99 without.
* ``retire_workers of a worker whose managers hold N GiB``: a fresh 2-worker
  LocalCluster, two managers per worker; the two managers of one worker hold
  N GiB together; ``client.retire_workers([w])``, then until no manager is on
  ``w``: the total time against the sum of the moves' own ``seconds`` (on one
  machine a move hands the shard over, nothing is copied); target: total <= 2x
  the moves' time.  Bytes per second, and when the first move began, are printed.
* ``move of a manager holding N MiB across the two-host fixture``: only where
  ``tests/support/twohost.py`` can run (root, ``ip``, ``unshare``, ``nsenter``): a
  manager on host 2 (a network namespace with its own 1 GiB ``/dev/shm``)
  holding 512 MiB (``--quick``: 128 MiB) moves to host 1's worker, its shard
  copied over the veth pair; bytes/s = ``nbytes / seconds`` against plain TCP
  over the same path in the same run (a sender process on host 2, a receiver
  thread here bound to host 1's address, the same number of bytes, best of 2);
  target >= 0.5x.  A nearly empty manager's move across is printed first (the
  fixed cost of a copy).

Two probes of what a move must get right are rows too:

* a move straight back to the host process the manager left (that process still
  holds the old shard open for ``dask_ddict.host.moves.LET_GO_AFTER`` s): done,
  or refused with the manager serving where it is.  Every other move here waits
  ``LET_GO_AFTER`` + 0.5 s after the last one of the same manager;
* the first request of a handle attached before a move is a 1 MiB put (a
  handle with ``timeout=3``): it should follow the move as small requests do.
  (Every other handle here takes the new layout right after each move.)

Everything is destroyed and closed at the end.  Absolute numbers on 2-core VMs
are noisy (and the LocalCluster's scheduler shares this process with the
client): read the ratios, and rerun a row that misses narrowly.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np
from common import Row, p99, print_table, verdict  # beside this script (sys.path[0])
from distributed import Client, LocalCluster

from dask_ddict import DDict
from dask_ddict.client.workers import scheduler_workers
from dask_ddict.errors import raise_from_wire
from dask_ddict.host.moves import LET_GO_AFTER

MiB, GiB = 1 << 20, 1 << 30
VALUE = 16 * MiB  # the arrays that fill a manager


# -- helpers -------------------------------------------------------------------------------


def size_label(nbytes: int) -> str:
    return f"{nbytes / GiB:g} GiB" if nbytes >= GiB else f"{nbytes / MiB:g} MiB"


def capacity_for(fill: int) -> int:
    """A manager's share of ``total_mem`` that takes ``fill`` bytes of 16 MiB values
    below the default ``manager_pool_full_thresh`` (0.9)."""
    return int(fill / 0.85) + 64 * MiB


def fill_manager(m: DDict, nbytes: int, tag: Any) -> int:
    """Put ``nbytes`` of 16 MiB float64 arrays into the one-manager handle ``m``."""
    arr = np.ones(VALUE // 8, dtype="f8")
    n = max(1, nbytes // VALUE)
    for i in range(n):
        arr[0] = i
        m[(tag, i)] = arr
    return n


def check_filled(m: DDict, n: int, tag: Any) -> None:
    """A few of the arrays read back whole (first, middle, last)."""
    for i in sorted({0, n // 2, n - 1}):
        v = m[(tag, i)]
        assert v.shape == (VALUE // 8,) and v[0] == i and v[1:].min() == 1.0, (tag, i)


def move(c: Client, d: DDict, mid: int, worker: str) -> dict[str, Any]:
    """Move manager ``mid`` of ``d`` to ``worker``; the orchestrator's move record plus
    ``wall`` (the call's time as this client saw it)."""
    t0 = time.perf_counter()
    reply = c.sync(c.scheduler.ddict_move, name=d.get_name(), manager_id=mid, worker=worker)
    returned = time.perf_counter()
    raise_from_wire(reply)
    assert reply is not None, f"manager {mid} is hosted for {worker} already"
    # this handle takes the new layout now, as ``rebalance()`` does: a handle that has not
    # seen a move yet follows it on a small request, but not on a large first one (see
    # stale_big_put_row)
    d._core.fresh(force=True)
    return {**reply, "wall": returned - t0, "returned": returned}


#: A manager returns to a host process it left only once that process let its shard go
#: (``dask_ddict.host.moves.LET_GO_AFTER`` s after the move; sooner is refused: see
#: :func:`back_at_once_row`).
LET_GO = LET_GO_AFTER + 0.5


def settle(last: dict[str, Any]) -> None:
    """Wait until :data:`LET_GO` seconds passed since move ``last`` returned."""
    time.sleep(max(0.0, last["returned"] + LET_GO - time.perf_counter()))


def back_at_once_row(c: Client, d: DDict, w0: str, w1: str) -> Row:
    """Manager 0 just moved from ``w0`` to ``w1``: move it straight back (its shard is
    still open in ``w0``'s host process for LET_GO_AFTER s).  Target: the move is done,
    or refused with the manager still serving where it is."""
    name = "move straight back to the host it just left (nearly empty)"
    try:
        r = move(c, d, 0, w0)
    except Exception as e:  # noqa: BLE001 - the row says what happened
        err = " ".join(str(e).split())[:160]
        where = d._core.fresh(force=True).manager_workers[0]
        d.manager(0)["still serving"] = 1
        ok = where == w1 and d.manager(0)["still serving"] == 1
        return (
            name,
            "refused",
            "done, or refused cleanly",
            verdict(ok),
            f"{type(e).__name__}: {err}; manager 0 stays on "
            f"{'the worker it moved to' if where == w1 else where} and serves: {ok}",
        )
    return (
        name,
        f"{r['seconds']:.3f} s paused",
        "done, or refused cleanly",
        "met",
        "moved back at once",
    )


def stale_big_put_row(d: DDict, stale: DDict, mid: int, nbytes: int) -> Row:
    """``stale`` was attached before manager ``mid`` moved: its first request to it is
    a ``nbytes`` put.  Target: done (the handle follows the move, as it does for small
    requests)."""
    name = f"first put of {size_label(nbytes)} through a handle that has not seen the move"
    t0 = time.perf_counter()
    try:
        stale.manager(mid)[("stale", nbytes)] = np.ones(nbytes // 8, dtype="f8")
    except Exception as e:  # noqa: BLE001 - the row says what happened
        spent = time.perf_counter() - t0
        err = " ".join(str(e).split())[:160]
        return (
            name,
            f"failed after {spent:.1f} s",
            "done (follows the move)",
            "MISSED",
            f"{type(e).__name__}: {err} (handle timeout={stale._timeout} s; with "
            "timeout=None it does not return)",
        )
    spent = time.perf_counter() - t0
    ok = d.manager(mid)[("stale", nbytes)].shape == (nbytes // 8,)
    return (name, f"{spent:.3f} s", "done (follows the move)", verdict(ok), "")


class Putter(threading.Thread):
    """Puts 100 B values to ``m`` in a loop; ``lat`` holds (start, seconds) of each
    (``time.monotonic``: the system's clock, the same in every process)."""

    def __init__(self, m: DDict) -> None:
        super().__init__(daemon=True)
        self.m = m
        self.stop = threading.Event()
        self.lat: list[tuple[float, float]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        v = b"x" * 100
        i = 0
        try:
            while not self.stop.is_set():
                t0 = time.monotonic()
                self.m[("small", i % 1000)] = v
                self.lat.append((t0, time.monotonic() - t0))
                i += 1
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = e

    def finish(self) -> list[tuple[float, float]]:
        self.stop.set()
        self.join(60)
        if self.error is not None:
            raise self.error
        return self.lat


#: A client process of its own: puts to one manager and reports latencies (its docstring).
_PUTTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "children", "putter.py")


def p99_row(
    who: str,
    c: Client,
    d: DDict,
    workers: tuple[str, str],
    n_moves: int,
    base_seconds: float,
    label: str,
) -> tuple[Row, list[Any], dict[str, Any]]:
    """p99 of 100 B puts to manager 1 by ``who`` ("client thread": a thread of this
    process; "client process": a process of its own), for ``base_seconds`` with no
    move, then during ``n_moves`` moves of manager 0 between ``workers`` (one every
    :data:`LET_GO` s).  Returns the row, the moves' spans and the last move."""
    proc = putter = None
    if who == "client thread":
        putter = Putter(d.manager(1))
        putter.start()
        time.sleep(0.3)  # (warm)
    else:
        proc = subprocess.Popen(
            [sys.executable, _PUTTER, d.serialize(), "1"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    try:
        if proc is not None:
            assert proc.stdout is not None and proc.stdin is not None
            ready = proc.stdout.readline()
            assert ready.strip() == "ready", f"the putter process said {ready!r}"
        a = time.monotonic()
        time.sleep(base_seconds)
        b = time.monotonic()
        spans: list[tuple[float, float, float]] = []
        into: list[bool] = []  # the move is into manager 1's host process (else out of it)
        last: dict[str, Any] = {}
        for _ in range(n_moves):
            if last:
                settle(last)
            to = workers[0] if d.manager_workers[0] == workers[1] else workers[1]
            t = time.monotonic()
            last = move(c, d, 0, to)
            spans.append((t, time.monotonic(), last["seconds"]))
            into.append(to == workers[1])
        if putter is not None:
            lat = putter.finish()
            putter = None
            without = [s for t, s in lat if a <= t <= b]
            per_span = [[s for t, s in lat if x <= t <= y] for x, y, _ in spans]
        else:
            assert proc is not None and proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(
                json.dumps({"base": [a, b], "spans": [[x, y] for x, y, _ in spans]}) + "\n"
            )
            proc.stdin.flush()
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"the putter process failed ({proc.returncode})"
            got = json.loads(out.strip().splitlines()[-1])
            without, per_span = got["without"], got["during"]
    finally:
        if putter is not None:
            putter.stop.set()
            putter.join(60)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    in_ = [s for span, i in zip(per_span, into) if i for s in span]
    out_ = [s for span, i in zip(per_span, into) if not i for s in span]
    during = in_ + out_
    ratio = p99(during) / p99(without)
    row = (
        f"p99 put 100 B to a manager that does not move, during moves ({who})",
        f"{p99(during) * 1e3:.2f} ms during vs {p99(without) * 1e3:.2f} ms without ({ratio:.2f}x)",
        "<= 2x without",
        verdict(ratio <= 2.0),
        f"{n_moves} moves of manager 0 ({label}) into and out of manager 1's host "
        f"process, one every {LET_GO:.1f} s; {len(during)} puts started during the "
        f"{sum(y - x for x, y, _ in spans):.2f} s of move calls, {len(without)} in "
        f"{base_seconds:g} s without; median {statistics.median(during) * 1e3:.2f} vs "
        f"{statistics.median(without) * 1e3:.2f} ms, max {max(during) * 1e3:.1f} vs "
        f"{max(without) * 1e3:.1f} ms; p99 during moves into its host process "
        f"{p99(in_) * 1e3:.2f} ms ({len(in_)} puts), out of it {p99(out_) * 1e3:.2f} ms "
        f"({len(out_)})",
    )
    return row, spans, last


# -- 1 and 2: moves within one machine -------------------------------------------------------


def one_machine_rows(fill: int, n_moves: int, base_seconds: float) -> list[Row]:
    rows: list[Row] = []
    label = size_label(fill)
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cl,
        Client(cl) as c,
    ):
        cap = capacity_for(fill)
        d = DDict(managers_per_worker=1, n_workers=2, total_mem=2 * cap, client=c, timeout=60)
        try:
            w0, w1 = d.manager_workers
            m0, m1 = d.manager(0), d.manager(1)
            for i in range(100):
                m0[("tiny", i)] = i
                m1[("tiny", i)] = i
            # nearly empty: manager 0 to w1; straight back (its old host still holds the
            # shard open for LET_GO_AFTER s); back again once that host let it go
            empty = [move(c, d, 0, w1)]
            rows.append(back_at_once_row(c, d, w0, w1))
            settle(empty[-1])
            if d.manager_workers[0] != w0:
                empty.append(move(c, d, 0, w0))
            worst = max(e["seconds"] for e in empty)
            each = ", ".join(f"{e['seconds']:.3f}" for e in empty)
            calls = ", ".join(f"{e['wall']:.3f}" for e in empty)
            rows.append(
                (
                    "move of a nearly empty manager within one machine",
                    f"{worst:.3f} s paused",
                    "<= 0.1 s",
                    verdict(worst <= 0.1),
                    f"{len(empty)} moves: {each} s paused, {calls} s per call; "
                    f"{empty[0]['nbytes'] / MiB:.1f} MiB shard",
                )
            )
            t0 = time.perf_counter()
            n = fill_manager(m0, fill, "big")
            fill_s = time.perf_counter() - t0
            settle(empty[-1])
            stale = DDict.attach(d.serialize(), timeout=3, client=c)
            big = move(c, d, 0, w1)
            assert not big["copied"] and big["nbytes"] >= fill, big
            rows.append(
                (
                    f"move of a manager holding {label} within one machine",
                    f"{big['seconds']:.3f} s paused",
                    "<= 0.1 s whatever its size",
                    verdict(big["seconds"] <= 0.1),
                    f"nbytes {big['nbytes'] / MiB:,.0f} MiB, handed over (copied="
                    f"{big['copied']}), {big['wall']:.3f} s per call; filled in "
                    f"{fill_s:.1f} s",
                )
            )
            check_filled(d.manager(0), n, "big")
            rows.append(stale_big_put_row(d, stale, 0, MiB))
            stale.detach()

            # 2: p99 of puts to manager 1 (which stays on w1), without and during moves
            last, spans = big, []
            for who in ("client thread", "client process"):
                settle(last)
                row, more, last = p99_row(who, c, d, (w0, w1), n_moves, base_seconds, label)
                rows.append(row)
                spans += more
            paused = [s for _, _, s in spans]
            rows.append(
                (
                    f"moves of a manager holding {label} back and forth (same machine)",
                    f"max {max(paused):.3f} s paused",
                    "<= 0.1 s",
                    verdict(max(paused) <= 0.1),
                    f"median {statistics.median(paused):.3f} s over {len(paused)} moves "
                    "(those of the p99 rows)",
                )
            )
            check_filled(d.manager(0), n, "big")
            assert all(d.manager(1)[("tiny", i)] == i for i in range(100))
            d.manager(0)["after"] = 1  # takes writes where it is now
        finally:
            d.destroy()
    return rows


# -- 3: retire_workers ----------------------------------------------------------------------


def retire_rows(fill: int) -> list[Row]:
    label = size_label(fill)
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cl,
        Client(cl) as c,
    ):
        cap = capacity_for(fill // 2)
        d = DDict(managers_per_worker=2, n_workers=2, total_mem=4 * cap, client=c, timeout=60)
        try:
            workers = d.manager_workers
            leaving = workers[0]
            mine = [m for m, w in enumerate(workers) if w == leaving]
            filled = {m: fill_manager(d.manager(m), fill // len(mine), ("big", m)) for m in mine}
            for i in range(200):
                d[("small", i)] = i
            t0, t0_wall = time.perf_counter(), time.time()
            c.retire_workers([leaving])
            retired = time.perf_counter() - t0
            deadline = time.monotonic() + 120
            while leaving in d._core.fresh(force=True).manager_workers:
                assert time.monotonic() < deadline, f"managers still on {leaving}"
                time.sleep(0.02)
            total = time.perf_counter() - t0
            moves = [m for m in d.moves if m["source"] == leaving]
            assert {m["manager_id"] for m in moves} == set(mine), moves
            moved_s = sum(m["seconds"] for m in moves)
            began = min(m["at"] - m["seconds"] for m in moves) - t0_wall
            ended = max(m["at"] for m in moves) - t0_wall
            nbytes = sum(m["nbytes"] for m in moves)
            ratio = total / moved_s
            for m, n in filled.items():
                check_filled(d.manager(m), n, ("big", m))
            assert all(d[("small", i)] == i for i in range(200))
            row = (
                f"retire_workers of a worker whose managers hold {label}",
                f"{total:.2f} s total vs {moved_s:.3f} s of moves ({ratio:.1f}x)",
                "<= 2x the moves' time",
                verdict(ratio <= 2.0),
                f"{len(moves)} managers, {nbytes / MiB:,.0f} MiB handed over "
                f"(copied={any(m['copied'] for m in moves)}); retire_workers returned "
                f"after {retired:.2f} s, the first move began after {began:.2f} s (the worker's "
                f"nanny closing), the last ended after {ended:.2f} s; "
                f"{nbytes / total / 1e9:.2f} GB/s over the whole "
                f"retirement, {nbytes / moved_s / 1e9:.2f} GB/s over the moves' "
                "time",
            )
        finally:
            d.destroy()
    return [row]


# -- 4: across two hosts --------------------------------------------------------------------

# Runs on host 2 (``str.format``ted): sends ``nbytes`` to host 1, ``reps`` times, one
# connection each, waiting for host 1's one-byte acknowledgement after each.
#: The TCP reference's sender, run on host 2 (a file, like the benchmarks' other children).
_SENDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "children", "tcp_sender.py")


def tcp_seconds(h: Any, nbytes: int, reps: int) -> list[float]:
    """Seconds to receive ``nbytes`` over TCP from a process on host 2 (per connection,
    from accept to the last byte, into a warm buffer here on host 1)."""
    lsock = socket.socket()
    lsock.bind((h.host1, 0))
    lsock.listen(1)
    lsock.settimeout(120)
    port = lsock.getsockname()[1]
    buf = bytearray(nbytes)
    buf[::4096] = b"\x00" * len(buf[::4096])  # (fault its pages in before timing)
    view = memoryview(buf)
    times: list[float] = []
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            for _ in range(reps):
                conn, _ = lsock.accept()
                with conn:
                    t0 = time.perf_counter()
                    got = 0
                    while got < nbytes:
                        k = conn.recv_into(view[got:])
                        if not k:
                            raise ConnectionError(f"sender closed after {got} bytes")
                        got += k
                    times.append(time.perf_counter() - t0)
                    conn.sendall(b"k")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    try:
        out = h.on_host2(
            "import runpy, sys; "
            f"sys.argv = [{_SENDER!r}, {h.host1!r}, '{port}', '{nbytes}', '{reps}']; "
            f"runpy.run_path({_SENDER!r}, run_name='__main__')",
            timeout=180,
        )
        t.join(60)
    finally:
        lsock.close()
    if out.returncode != 0:
        raise RuntimeError(f"the TCP sender on host 2 failed: {out.stderr[-2000:]}")
    if errors:
        raise errors[0]
    return times


def two_host_rows(fill: int) -> list[Row]:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    if root not in sys.path:
        sys.path.insert(0, root)  # (the repository: tests.support)
    twohost = importlib.import_module("tests.support.twohost")  # (the tests' fixture)

    label = size_label(fill)
    name = f"move of a manager holding {label} across the two-host fixture"
    why = twohost.unavailable()
    if why is not None:
        return [(name, "n/a", ">= 0.5x TCP", "skipped", f"two-host fixture: {why}")]
    with twohost.TwoHosts() as h, Client(h.scheduler_address) as c:
        c.wait_for_workers(2, timeout=90)
        w1, w2 = sorted(scheduler_workers(c), key=lambda w: f"//{h.host2}:" in w)
        # host 2's /dev/shm is a 1 GiB tmpfs: one dictionary at a time, one manager, on
        # host 2 only; first nearly empty (the fixed cost of a copy: the new file
        # reserved, the link, the layout), then filled
        cap = max(capacity_for(fill), fill + 150 * MiB)
        moved: dict[str, dict[str, Any]] = {}
        for what in ("empty", "filled"):
            if moved:  # (host 2 deletes the moved shard's old file LET_GO_AFTER s after)
                settle(moved["empty"])
            d = DDict(managers_per_worker=1, total_mem=cap, client=c, timeout=120, workers=[w2])
            try:
                assert d.num_managers == 1 and d.manager_workers == [w2], d.manager_workers
                m = d.manager(0)
                t0 = time.perf_counter()
                n = fill_manager(m, fill, "big") if what == "filled" else 0
                m["tiny"] = 1
                fill_s = time.perf_counter() - t0
                r = moved[what] = move(c, d, 0, w1)
                assert r["copied"] and d.manager_workers == [w1], (r, d.manager_workers)
                if n:
                    check_filled(d.manager(0), n, "big")
                assert d.manager(0)["tiny"] == 1
                d.manager(0)["after"] = 1
            finally:
                d.destroy()
        r, e = moved["filled"], moved["empty"]
        tcp = tcp_seconds(h, r["nbytes"], 2)
    move_bw = r["nbytes"] / r["seconds"]
    tcp_bw = r["nbytes"] / min(tcp)
    ratio = move_bw / tcp_bw
    net = (
        f"{(r['nbytes'] - e['nbytes']) / (r['seconds'] - e['seconds']) / 1e9:.2f} GB/s net "
        "of the empty move's time"
        if r["seconds"] > e["seconds"]
        else "the empty move took longer: noise"
    )
    return [
        (
            "move of a nearly empty manager across the two-host fixture",
            f"{e['seconds']:.3f} s paused",
            "n/a (the fixed cost)",
            "-",
            f"nbytes {e['nbytes'] / MiB:.1f} MiB copied, {e['wall']:.3f} s per call; its copy's "
            f"file ({(cap + max(MiB, cap // 16)) / MiB:,.0f} MiB map) is reserved whole on "
            "host 1 as for the filled one",
        ),
        (
            name,
            f"{move_bw / 1e9:.2f} GB/s ({ratio:.2f}x TCP)",
            ">= 0.5x TCP",
            verdict(ratio >= 0.5),
            f"nbytes {r['nbytes'] / MiB:,.0f} MiB copied in {r['seconds']:.2f} s paused "
            f"({r['wall']:.2f} s per call; {net}); plain TCP host 2 -> host 1 over the veth, "
            "into a warm buffer: "
            f"{tcp_bw / 1e9:.2f} GB/s (best of {', '.join(f'{t:.2f}' for t in tcp)} s); "
            f"filled over TCP in {fill_s:.1f} s",
        ),
    ]


# -- main -------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller managers, fewer moves")
    ap.add_argument(
        "--gib",
        type=float,
        default=None,
        help="GiB in the managers that move on one machine (default 1; --quick 0.25)",
    )
    ap.add_argument(
        "--two-host-mib",
        type=int,
        default=None,
        help="MiB in the manager that moves across hosts (default 512; --quick 128)",
    )
    ap.add_argument("--no-two-hosts", action="store_true", help="skip the two-host row")
    args = ap.parse_args()
    fill = int((args.gib if args.gib is not None else 0.25 if args.quick else 1.0) * GiB)
    fill2 = (args.two_host_mib or (128 if args.quick else 512)) * MiB
    n_moves = 3 if args.quick else 8
    base_seconds = 1.0 if args.quick else 2.0

    started = time.perf_counter()
    rows: list[Row] = []
    sections = [
        ("moves within one machine", lambda: one_machine_rows(fill, n_moves, base_seconds)),
        ("retire_workers", lambda: retire_rows(fill)),
    ]
    if not args.no_two_hosts:
        sections.append(("a move across the two-host fixture", lambda: two_host_rows(fill2)))
    for what, section in sections:
        try:
            rows += section()
        except Exception as e:  # noqa: BLE001 - the other sections still run; trace on stderr
            traceback.print_exc()
            rows.append(
                (
                    what,
                    "error",
                    "-",
                    "FAILED",
                    f"{type(e).__name__}: {' '.join(str(e).split())[:300]}",
                )
            )

    print_table(
        rows,
        f"\n(python {sys.version.split()[0]}, {os.cpu_count()} cores, "
        f"{time.perf_counter() - started:.0f} s in all{', --quick' if args.quick else ''})",
    )
    if any(r[3] == "FAILED" for r in rows):
        sys.exit(1)  # (a section did not run to its end: its trace is on stderr)


if __name__ == "__main__":
    main()
