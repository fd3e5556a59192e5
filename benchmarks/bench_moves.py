"""Moving managers between host processes: one command, one table.

    python benchmarks/bench_moves.py [--quick] [--gib 1.0] [--no-two-hosts]

Each row prints the measured value, its target and whether it is met:

* ``move of a manager holding N GiB within one machine``: a 2-worker
  LocalCluster (worker processes), a DDict with one manager per worker; manager
  0 is filled with N GiB of 16 MiB numpy arrays (1 GiB; ``--quick``: 256 MiB)
  and moved to the other worker with the scheduler's ``ddict_move``: the
  ``seconds`` its writes were paused (target <= 0.1 s whatever its size), and
  the same for the manager while it was nearly empty, for comparison.
* ``p99 put 100 B to a manager that does not move, during moves``: a client
  thread puts 100 B values to manager 1, first with no move (the reference),
  then while manager 0 (N GiB) moves back and forth between the two workers,
  back to back; target: p99 during <= 2x p99 without.
* ``retire_workers of a worker whose managers hold N GiB``: a fresh 2-worker
  LocalCluster, two managers per worker; the two managers of one worker hold
  N GiB together; ``client.retire_workers([w])``, then until no manager is on
  ``w``: the total time against the sum of the moves' own ``seconds`` (on one
  machine a move hands the shard over, nothing is copied); target: total <= 2x
  the moves' time.  Bytes per second of the whole retirement are printed too.
* ``move of N MiB across the two-host fixture``: only where
  ``tests/twohost.py`` can run (root, ``ip``, ``unshare``, ``nsenter``): a
  manager on host 2 (a network namespace with its own 1 GiB ``/dev/shm``)
  holding 512 MiB (``--quick``: 128 MiB) moves to host 1's worker, its shard
  copied over the veth pair; bytes/s = ``nbytes / seconds`` against plain TCP
  over the same path in the same run (a sender process on host 2, a receiver
  thread here on host 1, the same number of bytes, best of 2); target >= 0.5x.

Everything is destroyed and closed at the end.  Absolute numbers on 2-core VMs
are noisy (the LocalCluster's scheduler shares this process with the client):
read the ratios.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np
from distributed import Client, LocalCluster

from dask_ddict import DDict
from dask_ddict.errors import raise_from_wire
from dask_ddict.host.moves import LET_GO_AFTER

MiB, GiB = 1 << 20, 1 << 30
VALUE = 16 * MiB  # the arrays that fill a manager
Row = tuple[str, str, str, str, str]  # measurement, value, target, result, notes


# -- helpers -------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


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
        return (name, "refused", "done, or refused cleanly", verdict(ok),
                f"{type(e).__name__}: {err}; manager 0 stays on "
                f"{'the worker it moved to' if where == w1 else where} and serves: {ok}")
    return (name, f"{r['seconds']:.3f} s paused", "done, or refused cleanly", "met",
            "moved back at once")


def p99(xs: list[float]) -> float:
    return float(np.percentile(xs, 99)) if xs else float("nan")


class Putter(threading.Thread):
    """Puts 100 B values to ``m`` in a loop; ``lat`` holds (start, seconds) of each."""

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
                t0 = time.perf_counter()
                self.m[("small", i % 1000)] = v
                self.lat.append((t0, time.perf_counter() - t0))
                i += 1
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = e

    def finish(self) -> list[tuple[float, float]]:
        self.stop.set()
        self.join(60)
        if self.error is not None:
            raise self.error
        return self.lat


def timed_puts(m: DDict, seconds: float) -> list[float]:
    p = Putter(m)
    p.start()
    time.sleep(seconds)
    return [s for _, s in p.finish()]


# -- 1 and 2: moves within one machine -------------------------------------------------------


def one_machine_rows(fill: int, n_moves: int, base_seconds: float) -> list[Row]:
    rows: list[Row] = []
    label = size_label(fill)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cl, Client(cl) as c:  # fmt: skip
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
            paused = ", ".join(f"{e['seconds']:.3f}" for e in empty)
            calls = ", ".join(f"{e['wall']:.3f}" for e in empty)
            rows.append(("move of a nearly empty manager within one machine",
                         f"{worst:.3f} s paused", "<= 0.1 s", verdict(worst <= 0.1),
                         f"{len(empty)} moves: {paused} s paused, {calls} s per call; "
                         f"{empty[0]['nbytes'] / MiB:.1f} MiB shard"))  # fmt: skip
            t0 = time.perf_counter()
            n = fill_manager(m0, fill, "big")
            fill_s = time.perf_counter() - t0
            settle(empty[-1])
            big = move(c, d, 0, w1)
            assert not big["copied"] and big["nbytes"] >= fill, big
            rows.append((f"move of a manager holding {label} within one machine",
                         f"{big['seconds']:.3f} s paused", "<= 0.1 s whatever its size",
                         verdict(big["seconds"] <= 0.1),
                         f"nbytes {big['nbytes'] / MiB:,.0f} MiB, handed over (copied="
                         f"{big['copied']}), {big['wall']:.3f} s per call; filled in "
                         f"{fill_s:.1f} s"))  # fmt: skip
            check_filled(d.manager(0), n, "big")

            # 2: p99 of puts to manager 1 (which stays on w1), without and during moves
            m1 = d.manager(1)
            timed_puts(m1, 0.3)  # warm
            without = timed_puts(m1, base_seconds)
            p = Putter(m1)
            p.start()
            spans = []
            last = big
            where = [w0, w1]
            for k in range(n_moves):
                settle(last)
                t = time.perf_counter()
                last = move(c, d, 0, where[k % 2])
                spans.append((t, time.perf_counter(), last["seconds"]))
            lat = p.finish()
            during = [s for t, s in lat if any(a <= t <= b for a, b, _ in spans)]
            ratio = p99(during) / p99(without)
            paused = [s for _, _, s in spans]
            rows.append(("p99 put 100 B to a manager that does not move, during moves",
                         f"{p99(during) * 1e3:.2f} ms during vs {p99(without) * 1e3:.2f} ms "
                         f"without ({ratio:.2f}x)", "<= 2x without", verdict(ratio <= 2.0),
                         f"{n_moves} moves of manager 0 ({label}) into and out of manager 1's "
                         f"host process, each {LET_GO:.1f} s after the last; {len(during)} puts started during the "
                         f"{sum(b - a for a, b, _ in spans):.2f} s of move calls, "
                         f"{len(without)} in {base_seconds:.0f} s without; median "
                         f"{statistics.median(during) * 1e3:.2f} vs "
                         f"{statistics.median(without) * 1e3:.2f} ms, max "
                         f"{max(during) * 1e3:.1f} vs {max(without) * 1e3:.1f} ms"))  # fmt: skip
            rows.append((f"moves of a manager holding {label} back and forth (same machine)",
                         f"max {max(paused):.3f} s paused", "<= 0.1 s",
                         verdict(max(paused) <= 0.1),
                         f"median {statistics.median(paused):.3f} s over {n_moves} "
                         "moves"))  # fmt: skip
            check_filled(d.manager(0), n, "big")
            assert all(d.manager(1)[("tiny", i)] == i for i in range(100))
            d.manager(0)["after"] = 1  # takes writes where it is now
        finally:
            d.destroy()
    return rows


# -- 3: retire_workers ----------------------------------------------------------------------


def retire_rows(fill: int) -> list[Row]:
    label = size_label(fill)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cl, Client(cl) as c:  # fmt: skip
        cap = capacity_for(fill // 2)
        d = DDict(managers_per_worker=2, n_workers=2, total_mem=4 * cap, client=c, timeout=60)
        try:
            workers = d.manager_workers
            leaving = workers[0]
            mine = [m for m, w in enumerate(workers) if w == leaving]
            filled = {m: fill_manager(d.manager(m), fill // len(mine), ("big", m)) for m in mine}
            for i in range(200):
                d[("small", i)] = i
            t0 = time.perf_counter()
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
            nbytes = sum(m["nbytes"] for m in moves)
            ratio = total / moved_s
            for m, n in filled.items():
                check_filled(d.manager(m), n, ("big", m))
            assert all(d[("small", i)] == i for i in range(200))
            row = (f"retire_workers of a worker whose managers hold {label}",
                   f"{total:.2f} s total vs {moved_s:.3f} s of moves ({ratio:.1f}x)",
                   "<= 2x the moves' time", verdict(ratio <= 2.0),
                   f"{len(moves)} managers, {nbytes / MiB:,.0f} MiB handed over "
                   f"(copied={any(m['copied'] for m in moves)}); retire_workers returned "
                   f"after {retired:.2f} s; {nbytes / total / 1e9:.2f} GB/s over the whole "
                   f"retirement, {nbytes / moved_s / 1e9:.2f} GB/s over the moves' "
                   "time")  # fmt: skip
        finally:
            d.destroy()
    return [row]


# -- 4: across two hosts --------------------------------------------------------------------

# Runs on host 2 (``str.format``ted): sends ``nbytes`` to host 1, ``reps`` times, one
# connection each, waiting for host 1's one-byte acknowledgement after each.
_SENDER = """
import socket
host, port, n, reps = {host!r}, {port}, {nbytes}, {reps}
buf = memoryview(b"\\x01" * (4 << 20))
for _ in range(reps):
    s = socket.create_connection((host, port), timeout=60)
    left = n
    while left:
        k = min(left, len(buf))
        s.sendall(buf[:k])
        left -= k
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    s.close()
"""


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
        out = h.on_host2(_SENDER.format(host=h.host1, port=port, nbytes=nbytes, reps=reps),
                         timeout=180)
        t.join(60)
    finally:
        lsock.close()
    if out.returncode != 0:
        raise RuntimeError(f"the TCP sender on host 2 failed: {out.stderr[-2000:]}")
    if errors:
        raise errors[0]
    return times


def two_host_rows(fill: int) -> list[Row]:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import twohost

    label = size_label(fill)
    name = f"move of a manager holding {label} across the two-host fixture"
    why = twohost.unavailable()
    if why is not None:
        return [(name, "n/a", ">= 0.5x TCP", "skipped", f"two-host fixture: {why}")]
    with twohost.TwoHosts() as h, Client(h.scheduler_address) as c:
        c.wait_for_workers(2, timeout=90)
        w1, w2 = sorted(c.scheduler_info()["workers"], key=lambda w: f"//{h.host2}:" in w)
        # host 2's /dev/shm is a 1 GiB tmpfs: one manager, on host 2 only
        cap = max(capacity_for(fill), fill + 150 * MiB)
        d = DDict(managers_per_worker=1, total_mem=cap, client=c, timeout=120, workers=[w2])
        try:
            assert d.num_managers == 1 and d.manager_workers == [w2], d.manager_workers
            m = d.manager(0)
            t0 = time.perf_counter()
            n = fill_manager(m, fill, "big")
            fill_s = time.perf_counter() - t0
            r = move(c, d, 0, w1)
            assert r["copied"] and d.manager_workers == [w1], (r, d.manager_workers)
            check_filled(d.manager(0), n, "big")
            d.manager(0)["after"] = 1
            tcp = tcp_seconds(h, r["nbytes"], 2)
        finally:
            d.destroy()
    move_bw = r["nbytes"] / r["seconds"]
    tcp_bw = r["nbytes"] / min(tcp)
    ratio = move_bw / tcp_bw
    return [(name, f"{move_bw / 1e9:.2f} GB/s ({ratio:.2f}x TCP)", ">= 0.5x TCP",
             verdict(ratio >= 0.5),
             f"nbytes {r['nbytes'] / MiB:,.0f} MiB copied in {r['seconds']:.2f} s paused "
             f"({r['wall']:.2f} s per call); plain TCP host 2 -> host 1 over the veth: "
             f"{tcp_bw / 1e9:.2f} GB/s (best of {', '.join(f'{t:.2f}' for t in tcp)} s); "
             f"filled over TCP in {fill_s:.1f} s")]  # fmt: skip


# -- main -------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller managers, fewer moves")
    ap.add_argument("--gib", type=float, default=None,
                    help="GiB in the managers that move on one machine (default 1; --quick 0.25)")
    ap.add_argument("--two-host-mib", type=int, default=None,
                    help="MiB in the manager that moves across hosts (default 512; --quick 128)")
    ap.add_argument("--no-two-hosts", action="store_true", help="skip the two-host row")
    args = ap.parse_args()
    fill = int((args.gib if args.gib is not None else 0.25 if args.quick else 1.0) * GiB)
    fill2 = (args.two_host_mib or (128 if args.quick else 512)) * MiB
    n_moves = 3 if args.quick else 6
    base_seconds = 1.0 if args.quick else 2.0

    started = time.perf_counter()
    rows: list[Row] = []
    rows += one_machine_rows(fill, n_moves, base_seconds)
    rows += retire_rows(fill)
    if not args.no_two_hosts:
        rows += two_host_rows(fill2)

    head = ("measurement", "value", "target", "result", "notes")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(4)]
    line = " | ".join(h.ljust(w) for h, w in zip(head[:4], widths)) + " | " + head[4]
    print(line)
    print("-" * len(line))
    for r in rows:
        print(" | ".join(str(x).ljust(w) for x, w in zip(r[:4], widths)) + " | " + r[4])
    print(f"\n(python {sys.version.split()[0]}, {os.cpu_count()} cores, "
          f"{time.perf_counter() - started:.0f} s in all{', --quick' if args.quick else ''})")


if __name__ == "__main__":
    main()
