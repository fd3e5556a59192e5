"""A dictionary across two hosts: this one and a network namespace (see ``tests/support/twohost.py``).

Shared memory only between processes of one host; TCP between hosts; losing a
host gives clear errors for its managers while the rest keeps working.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from distributed import Client, Security

from dask_ddict import DDict, DDictError, Policy
from dask_ddict.client.workers import scheduler_workers
from dask_ddict.errors import raise_from_wire
from dask_ddict.transport.protocol import HELLO_MAGIC
from tests.support import twohost
from tests.support.polling import poll_for

pytestmark = pytest.mark.skipif(
    twohost.unavailable() is not None, reason=f"two-host fixture: {twohost.unavailable()}"
)


@pytest.fixture(scope="module")
def hosts():
    with twohost.TwoHosts() as h:
        with Client(h.scheduler_address) as c:
            c.wait_for_workers(2, timeout=90)
            yield h, c


def _split(d: DDict) -> tuple[int, int]:
    """(a manager on this host, a manager on host 2)."""
    by_host = {m.hostname: m.manager_id for m in d._core.layout.managers}
    (m2,) = [m for name, m in by_host.items() if name == twohost.HOSTNAME2]
    (m1,) = [m for name, m in by_host.items() if name != twohost.HOSTNAME2]
    return m1, m2


_ON_HOST2 = """
import json, socket, sys
from dask_ddict import DDict
d = DDict.attach(sys.argv[1] if len(sys.argv) > 1 else {handle!r})
d[("from", "host2")] = socket.gethostname()
out = {{
    "hostname": socket.gethostname(),
    "local": d.local_managers, "main": d.main_manager,
    "kinds": {{m: d._core.channel(m).kind for m in range(d.num_managers)}},
    "seen": d.manager({m1})["written on host 1"],
    "len": len(d),
}}
print(json.dumps(out))
d.detach()
"""


def test_each_host_uses_shared_memory_only_for_its_own_managers(hosts):
    h, c = hosts
    d = DDict(total_mem="64 MiB", client=c, lifetime="cluster")
    try:
        m1, m2 = _split(d)
        # This process is on host 1: its manager is local (shared memory), host 2's is TCP.
        assert d.local_managers == [m1] and d.main_manager == m1
        d.manager(m1)["written on host 1"] = "hello"
        d.manager(m2)["written on host 1"] = "hello too"
        kinds = {m: d._core.channel(m).kind for m in (m1, m2)}
        assert kinds[m1] in ("shm", "uds") and kinds[m2] == "tcp"
        host2_shard = d._core.layout.managers[m2].store_path
        assert not os.path.exists(host2_shard)  # host 2's /dev/shm is its own
        # A process on host 2: the mirror image.
        out = h.on_host2(_ON_HOST2.format(handle=d.serialize(), m1=m1))
        assert out.returncode == 0, out.stderr
        seen = json.loads(out.stdout)
        assert seen["hostname"] == twohost.HOSTNAME2
        assert seen["local"] == [m2] and seen["main"] == m2
        assert seen["kinds"][str(m1)] == "tcp" and seen["kinds"][str(m2)] in ("shm", "uds")
        assert seen["seen"] == "hello" and seen["len"] == 3  # its own put included
        assert d[("from", "host2")] == twohost.HOSTNAME2
    finally:
        d.destroy()


def _in_a_task(d: DDict, n: int) -> dict:  # runs on host 2's worker
    import socket

    for i in range(n):
        d[("task", i)] = i * i
    d.checkpoint()
    d["versioned"] = "new"
    d.rollback()
    return {"host": socket.gethostname(), "old": d["versioned"], "count": d.fetch_add("n", n)}


def test_core_dict_and_checkpoint_operations_span_both_hosts(hosts, tmp_path):
    h, c = hosts
    d = DDict(
        total_mem="64 MiB",
        client=c,
        working_set_size=2,
        persist_path=str(tmp_path / "s"),
        persist_count=-1,
        lifetime="cluster",
    )
    try:
        m1, m2 = _split(d)
        data = {f"k{i}": i for i in range(200)}
        d.update(data)
        assert {d.which_manager(k) for k in data} == {m1, m2}  # both hosts hold keys
        d["versioned"] = "old"
        worker2 = [w for w in scheduler_workers(c) if f"//{h.host2}:" in w]
        got = c.submit(_in_a_task, d, 50, workers=worker2, pure=False).result(timeout=60)
        assert got == {"host": twohost.HOSTNAME2, "old": "old", "count": 0}
        assert d[("task", 7)] == 49 and d["n"] == 50 and d.fetch_add("n", 1) == 50
        assert len(d) == 200 + 50 + 2 and dict((k, d[k]) for k in data) == data
        assert d.pop("k3") == 3 and "k3" not in d
        d.checkpoint()
        assert d["versioned"] == "new"  # written by the task at checkpoint 1
        d.persist()
        d.sync()
        assert d.persisted_ids() == [1]
        assert sorted(s.manager_id for s in d.stats) == [m1, m2]
        assert {s.hostname for s in d.stats} == {os.uname().nodename, twohost.HOSTNAME2}
    finally:
        d.destroy()


def _host_and_keys(dd: DDict, out) -> None:  # noqa: ANN001 - a filter's mgr_code
    import socket

    mid = dd._target
    out.put((mid, socket.gethostname(), dd._core.channel(mid).kind))
    for k in sorted(dd.keys()):
        out.put(k)


def _sorted_keys(dd: DDict, out) -> None:  # noqa: ANN001
    for k in sorted(dd.keys()):
        out.put(k)


def _hostname(dd_or_part) -> list[str]:  # noqa: ANN001 - a map_shards task, a bag partition
    import socket

    return [socket.gethostname()]


def test_filter_map_shards_and_to_bag_run_beside_the_shards_on_both_hosts(hosts):
    h, c = hosts
    d = DDict(managers_per_worker=2, total_mem="64 MiB", client=c, lifetime="cluster")
    try:
        data = {f"k{i}": i for i in range(300)}
        d.update(data)
        host_of = [m.hostname for m in d._core.layout.managers]
        assert set(host_of) == {os.uname().nodename, twohost.HOSTNAME2}
        with d.filter(_host_and_keys, branching_factor=2) as results:  # merge tasks on both
            got = list(results)
        assert sorted(x for x in got if not isinstance(x, tuple)) == sorted(data)
        where = sorted(x for x in got if isinstance(x, tuple))
        assert [mid for mid, _, _ in where] == list(range(d.num_managers))
        for mid, host, kind in where:  # each ran on its manager's host, reading its shard
            assert host == host_of[mid] and kind == "shm", where
        with d.filter(_sorted_keys, comparator=lambda x, y: x < y, branching_factor=3) as results:
            assert list(results) == sorted(data)
        assert [w[0] for w in c.gather(d.map_shards(_hostname))] == host_of
        assert sum(d.to_bag("values").compute()) == sum(data.values())
        assert d.to_bag("keys").map_partitions(_hostname).compute() == host_of
    finally:
        d.destroy()


def test_losing_host2_then_repairing_from_a_parallel_dict(hosts):
    """Host 2 dies: its managers fail fast with clear errors, the rest works; a new host 2
    restarts them empty, and ``synchronize_ddicts`` refills them from a parallel dict
    whose copies of those managers lived on host 1."""
    h, c = hosts
    w1, w2 = sorted(scheduler_workers(c), key=lambda w: f"//{h.host2}:" in w)
    data = {f"k{i}": i for i in range(300)}
    a = DDict(
        total_mem="64 MiB",
        client=c,
        timeout=5,
        workers=[w1, w2],
        name="parallel-a",
        lifetime="cluster",
    )
    b = DDict(
        total_mem="64 MiB",
        client=c,
        timeout=5,
        workers=[w2, w1],
        name="parallel-b",
        lifetime="cluster",
    )
    for d in (a, b):
        d.update(data)
    a_on_2, b_on_2 = _split(a)[1], _split(b)[1]
    assert (a_on_2, b_on_2) == (1, 0)  # manager i of one dict lives where the other's does not

    h.kill("worker2", signal.SIGKILL)  # the whole host: nanny, worker, host process
    start = time.monotonic()
    with pytest.raises(DDictError) as info:
        a.manager(a_on_2)["k0"]
    assert time.monotonic() - start < 5 + 2  # within the timeout (and its slack)
    text = str(info.value)
    assert f"manager {a_on_2}" in text and h.host2 in text, text
    a.manager(1 - a_on_2)["still"] = "served"  # the other host serves on
    assert a.manager(1 - a_on_2)["still"] == "served"

    for d in (a, b):
        d.destroy(allow_restart=True)
    h.start_host2()  # a new machine at the same address, with an empty /dev/shm
    poll_for(
        lambda: sum(f"//{h.host2}:" in w for w in scheduler_workers(c)) == 1,
        90,
        lambda: f"host 2's worker to join: {h.log('worker2')}",
        0.5,
    )
    a2 = DDict(total_mem="64 MiB", client=c, name="parallel-a", restart=True, lifetime="cluster")
    b2 = DDict(total_mem="64 MiB", client=c, name="parallel-b", restart=True, lifetime="cluster")
    try:
        assert a2.empty_managers == [a_on_2] and b2.empty_managers == [b_on_2]
        assert len(a2) < len(data) and len(b2) < len(data)  # each lost a shard
        DDict.synchronize_ddicts([a2.serialize(), b2.serialize()])
        # Manager 0 of both now comes from a's (it holds "still"), manager 1 from b's.
        expected = {**data, "still": "served"}
        for d in (a2, b2):
            assert dict(d.items()) == expected
    finally:
        a2.destroy()
        b2.destroy()


def _received(h: twohost.TwoHosts) -> int:
    """Bytes this host has received from host 2: the counter of its end of the veth pair
    (every frame that crossed, headers included)."""
    with open(f"/sys/class/net/{h.veth[0]}/statistics/rx_bytes") as f:
        return int(f.read())


def test_one_inner_chunk_of_a_shard_on_host2_moves_the_chunk_not_the_shard(hosts):
    """zarr's sharding codec reads an inner chunk by byte range: host 2 cuts it out of
    the 16 MiB shard, and only it (and the shard's index) crosses the wire."""
    import zarr

    from dask_ddict import DDictStore

    h, c = hosts
    d = DDict(total_mem="128 MiB", client=c, lifetime="cluster")
    try:
        _, m2 = _split(d)
        store = DDictStore(d.manager(m2))  # (every key on host 2's manager)
        n, inner = 1 << 21, 1 << 15  # float64: a 16 MiB shard of 64 inner chunks of 256 KiB
        x = np.random.default_rng(0).random(n)
        z = zarr.create_array(
            store, name="s", shape=(n,), shards=(n,), chunks=(inner,), dtype="f8", compressors=None
        )
        z[:] = x
        assert d._core.channel(m2).kind == "tcp"
        z = zarr.open_array(store, path="s", mode="r")  # (its metadata: read before counting)
        before = _received(h)
        part = z[7 * inner : 8 * inner]
        moved = _received(h) - before
        before = _received(h)
        whole = z[:]  # (every chunk: zarr reads the shard whole)
        whole_moved = _received(h) - before
        np.testing.assert_array_equal(part, x[7 * inner : 8 * inner])
        np.testing.assert_array_equal(whole, x)
        print(
            f"host 2 -> host 1: one {inner * 8} B inner chunk moved {moved} B; "
            f"the whole {n * 8} B shard {whole_moved} B"
        )
        assert whole_moved >= n * 8  # (the counter counts what crosses)
        assert inner * 8 <= moved < 2 * inner * 8, (moved, inner * 8)
    finally:
        d.destroy()


# -- TLS across both hosts ----------------------------------------------------------------

_NO_CERTIFICATES = """
import json, socket, ssl, sys
from dask_ddict import DDict, DDictError
from dask_ddict.errors import raise_from_wire
d = DDict.attach({handle!r})
out = {{}}
try:
    d.manager({m1})["k"]
    out["library"] = "answered"
except DDictError as e:
    out["library"] = str(e)
ctx = ssl.create_default_context()
ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
answer = b""
try:
    with ctx.wrap_socket(socket.create_connection(({host!r}, {port}), timeout=10)) as s:
        s.sendall({magic!r} + bytes(48))
        answer = s.recv(1)
except (ssl.SSLError, OSError):
    pass
out["raw"] = answer.hex()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def tls_hosts(tmp_path_factory):
    sec = Security.temporary()
    folder = tmp_path_factory.mktemp("tls")
    files = {"ca": sec.tls_ca_file, "cert": sec.tls_worker_cert, "key": sec.tls_worker_key}
    for name, pem in files.items():
        (folder / f"{name}.pem").write_text(pem)
    args = (
        "--protocol",
        "tls",
        "--tls-ca-file",
        str(folder / "ca.pem"),
        "--tls-cert",
        str(folder / "cert.pem"),
        "--tls-key",
        str(folder / "key.pem"),
    )
    with twohost.TwoHosts(security_args=args) as h:
        with Client(h.scheduler_address, security=sec) as c:
            c.wait_for_workers(2, timeout=90)
            yield h, c


def test_a_tls_cluster_across_both_hosts_refuses_clients_without_certificates(tls_hosts):
    h, c = tls_hosts
    assert h.scheduler_address.startswith("tls://")
    d = DDict(total_mem="64 MiB", client=c, lifetime="cluster")
    try:
        m1, m2 = _split(d)
        d.manager(m2)["over tls"] = np.arange(10_000)
        assert (d.manager(m2)["over tls"] == np.arange(10_000)).all()
        assert d._core.channel(m2).kind == "tls"  # to the other host: TLS, never plain TCP
        info = d._core.layout.managers[m1]
        out = h.on_host2(
            _NO_CERTIFICATES.format(
                handle=d.serialize(),
                m1=m1,
                host=info.tcp_host,
                port=info.tcp_port,
                magic=HELLO_MAGIC,
            )
        )
        assert out.returncode == 0, out.stderr
        seen = json.loads(out.stdout)
        assert "requires TLS" in seen["library"] and "certificate" in seen["library"]
        assert seen["raw"] == ""  # a TLS peer without a client certificate gets nothing
    finally:
        d.destroy()


# -- soak ------------------------------------------------------------------------------------

_SOAK_CLIENT = """
import json, sys, time, zlib
import numpy as np
from dask_ddict import DDict, DDictCheckpointSyncError
me, n_ops, seconds = {me}, {ops}, {seconds}
plain, ckd = DDict.attach({plain!r}), DDict.attach({ckd!r})
rng = np.random.default_rng(me)
acked, popped, counted, retired = {{}}, set(), 0, 0
def value(j):  # a torn value shows as a wrong length or a wrong fill
    return np.full(int(rng.integers(1, 40_000)), (me * 7919 + j) % 251, dtype="u1")
def check(v, j):
    assert v.size and (v == (me * 7919 + j) % 251).all(), (me, j, v.size)
start, j = time.monotonic(), 0
while j < n_ops and time.monotonic() - start < seconds:
    op = j % 6
    if op in (0, 1, 2):
        v = value(j)
        plain[(me, j)] = v
        acked[j] = v.size
    elif op == 3:
        k = int(rng.choice(list(acked)))
        got = plain[(me, k)]
        check(got, k)
        assert got.size == acked[k]
    elif op == 4:
        counted += 1
        plain.fetch_add(("count", me % 2), 1)
    else:  # a checkpoint: write at the next one, read it back there
        ckd.checkpoint()
        for attempt in range(50):  # the others may move on again while this one catches up
            try:
                ckd[("ck", me)] = (ckd.checkpoint_id, j)
                break
            except DDictCheckpointSyncError:  # the others moved on: catch up, as Dragon's do
                ckd.sync_to_newest_checkpoint()
        else:
            raise AssertionError("never caught up with the others' checkpoints")
        try:
            assert ckd[("ck", me)] == (ckd.checkpoint_id, j)
        except DDictCheckpointSyncError:  # retired since (a window of 4): nothing to check
            retired += 1
        if acked and j % 12 == 5:  # and take one key back out
            k = int(rng.choice(list(acked)))
            check(plain.pop((me, k)), k)
            del acked[k]
            popped.add(k)
    j += 1
print(json.dumps({{"acked": acked, "popped": sorted(popped), "counted": counted,
                  "checkpoint": ckd.checkpoint_id, "ops": j, "retired": retired}}))
plain.detach(); ckd.detach()
"""


def _host_usage(pids: set[int]) -> dict[int, tuple[int, int]]:
    import psutil

    return {
        pid: (psutil.Process(pid).memory_info().rss, psutil.Process(pid).num_fds()) for pid in pids
    }


@pytest.mark.slow
def test_soak_eight_clients_on_both_hosts(hosts):
    """8 client processes (4 per host), mixed operations with checkpoints, bounded in
    count and time.  Nothing acknowledged is lost or torn; the host processes' memory
    and descriptors stay bounded; nothing is left over."""
    h, c = hosts
    plain = DDict(managers_per_worker=2, total_mem="512 MiB", client=c, lifetime="cluster")
    ckd = DDict(total_mem="64 MiB", client=c, working_set_size=4, lifetime="cluster")
    try:
        pids = {s.pid for s in plain.stats}
        before = _host_usage(pids)
        ops, seconds = 3000, 120
        procs = [
            h.popen(
                1 + i % 2,
                _SOAK_CLIENT.format(
                    me=i, ops=ops, seconds=seconds, plain=plain.serialize(), ckd=ckd.serialize()
                ),
            )
            for i in range(8)
        ]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=seconds + 120)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out))
        after = _host_usage(pids)
        total_ops = sum(r["ops"] for r in results)
        for me, r in enumerate(results):
            for j, size in r["acked"].items():  # every acknowledged write, whole
                v = plain[(me, int(j))]
                assert v.size == size and (v == (me * 7919 + int(j)) % 251).all()
            for j in r["popped"]:
                assert (me, j) not in plain
        assert plain[("count", 0)] + plain[("count", 1)] == sum(r["counted"] for r in results)
        for pid, (rss, fds) in after.items():
            assert rss - before[pid][0] < 512 << 20, (pid, rss, before[pid])
            assert fds - before[pid][1] < 64, (pid, fds, before[pid])
        print(
            f"soak: {total_ops} operations by 8 clients on 2 hosts; host processes "
            f"{ {p: (round(a[0] / 2**20), a[1]) for p, a in after.items()} } (MiB, fds) after, "
            f"{ {p: (round(b[0] / 2**20), b[1]) for p, b in before.items()} } before"
        )
    finally:
        plain.destroy()
        ckd.destroy()


@pytest.mark.slow
def test_the_core_dict_and_checkpoint_tests_pass_across_two_hosts():
    """``tests/test_ddict.py`` and ``tests/test_checkpoints.py``, with the session cluster
    spanning two hosts: every dictionary they make has a manager on each."""
    tests = os.path.dirname(__file__)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            os.path.join(tests, "test_ddict.py"),
            os.path.join(tests, "test_checkpoints.py"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=os.path.dirname(tests),
        env={**os.environ, "DDICT_TEST_TWO_HOSTS": "1"},
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "failed" not in out.stdout
    assert "9 skipped" in out.stdout  # the one_host tests: test_two_hosts.py covers them


def test_retiring_host2_copies_its_managers_to_host1_and_rebalance_brings_them_back(hosts):
    """The worker on host 2 retires: its managers' shards are copied to host 1 over TCP
    (writers on both hosts keep going), nothing acknowledged is lost; a new worker on
    host 2 then gets managers back with ``rebalance()``."""
    h, c = hosts
    w1, w2 = sorted(scheduler_workers(c), key=lambda w: f"//{h.host2}:" in w)
    d = DDict(
        managers_per_worker=2,
        total_mem="128 MiB",
        client=c,
        timeout=60,
        workers=[w1, w2],
        lifetime="cluster",
    )
    try:
        big = np.arange(1 << 20, dtype=np.float64)  # 8 MiB per manager: pages to copy
        for m in range(d.num_managers):
            d.manager(m)[("big", m)] = big + m
        d.update({i: i for i in range(500)})
        on2 = [m.manager_id for m in d._core.layout.managers if m.hostname == twohost.HOSTNAME2]
        assert len(on2) == 2
        c.retire_workers([w2])

        def moved_off() -> bool:
            if w2 not in d._core.fresh(force=True).manager_workers:
                return True
            d[("during", time.monotonic())] = 1  # writes go on meanwhile
            return False

        poll_for(moved_off, 120, lambda: f"managers off {w2}: {h.log('worker2')}", 0.1)
        moves = [m for m in d.moves if m["source"] == w2]
        assert {m["manager_id"] for m in moves} == set(on2)
        assert all(m["copied"] and m["target"] == w1 and m["nbytes"] > 8 << 20 for m in moves)
        assert all(d[i] == i for i in range(500))
        for m in range(d.num_managers):
            assert np.array_equal(d.manager(m)[("big", m)], big + m)
            d.manager(m)["after"] = m  # every manager takes writes on host 1
        assert set(d.local_managers) == set(range(d.num_managers))
        h.start_host2()
        c.wait_for_workers(2, timeout=90)
        back = d.rebalance()
        assert len(back) == 2 and all(m["copied"] for m in back)
        assert sum(m.hostname == twohost.HOSTNAME2 for m in d._core.layout.managers) == 2
        assert all(d[i] == i for i in range(500))
        for m in range(d.num_managers):
            assert np.array_equal(d.manager(m)[("big", m)], big + m)
            assert d.manager(m)["after"] == m
    finally:
        d.destroy()
        if len(scheduler_workers(c)) < 2:
            h.start_host2()
            c.wait_for_workers(2, timeout=90)


def test_a_manager_persisting_to_a_host_local_path_does_not_move_to_another_machine(hosts):
    """Each host has its own /dev/shm: a persist path there is host-local.  A move of a
    manager that persists there to the other host is refused (its persisted checkpoints
    would stay behind), saying why and what to do; the manager serves on where it was."""
    h, c = hosts
    w1, w2 = sorted(scheduler_workers(c), key=lambda w: f"//{h.host2}:" in w)
    path = f"/dev/shm/persist-{os.getpid()}-{time.monotonic_ns()}"
    d = DDict(
        managers_per_worker=1,
        total_mem="64 MiB",
        client=c,
        timeout=60,
        workers=[w1, w2],
        persist_path=path,
        persist_freq=1,
    )
    try:
        m1, m2 = _split(d)
        d.update({i: i for i in range(100)})
        with pytest.raises(DDictError, match="persisted checkpoints behind") as info:
            raise_from_wire(
                c.sync(c.scheduler.ddict_move, name=d.get_name(), manager_id=m2, worker=w1)
            )
        assert path in str(info.value) and "object store" in str(info.value)
        assert d.manager_workers[m2] == w2 and not d.moves  # nothing paused, nothing moved
        assert all(d[i] == i for i in range(100))
        d.manager(m2)["after"] = 2
        assert d.manager(m2)["after"] == 2
    finally:
        d.destroy()
        h.on_host2(f"import shutil; shutil.rmtree({path!r}, ignore_errors=True)")
        subprocess.run(["rm", "-rf", path], check=False)


def test_with_a_replica_on_the_other_host_losing_host2_loses_nothing(hosts):
    """``replicas=1`` across two machines: each manager's replica is on the other host.
    Every process of host 2 is SIGKILLed (and its /dev/shm goes with its namespace):
    host 2's managers answer again from their replicas on host 1, with every key and
    the exact counters, and writers on this host keep going."""
    h, c = hosts
    w1, w2 = sorted(scheduler_workers(c), key=lambda w: f"//{h.host2}:" in w)
    d = DDict(
        managers_per_worker=2,
        total_mem="128 MiB",
        client=c,
        timeout=60,
        workers=[w1, w2],
        replicas=1,
        lifetime="cluster",
    )
    try:
        reps = c.sync(c.scheduler.ddict_replicas, name=d.get_name())
        for m in d._core.layout.managers:  # on the other machine
            assert list(reps[m.manager_id]) == [w2 if m.worker == w1 else w1], (m, reps)
        d.update({i: i for i in range(400)})
        on2 = [m.manager_id for m in d._core.layout.managers if m.worker == w2]
        for m in on2:
            d.manager(m).fetch_add("n", 5)
        h.kill("worker2", signal.SIGKILL)  # the whole host: nanny, worker, host process
        for m in on2:  # (the first operation waits for the failover)
            assert d.manager(m).fetch_add("n", 1) == 5
        assert all(d[i] == i for i in range(400))
        assert set(d._core.fresh(force=True).manager_workers) == {w1}
        assert {m["manager_id"] for m in d.moves if m["why"].startswith("failover")} == set(on2)
        for m in range(d.num_managers):
            d.manager(m)["after"] = m
            assert d.manager(m)["after"] == m
    finally:
        d.destroy()
        h.start_host2()
        c.wait_for_workers(2, timeout=90)


def test_managers_pinned_by_host_name_are_placed_and_kept_on_their_machine(hosts):
    """``Policy(host=...)`` matches a machine's host name: each dictionary's managers go to
    the worker of its machine only, rebalance() leaves them there (the other worker hosts
    none), and a move by hand to the other machine is refused naming the policy."""
    import socket

    h, c = hosts
    w1, w2 = sorted(scheduler_workers(c), key=lambda w: f"//{h.host2}:" in w)
    on2 = DDict(
        policy=Policy(host=twohost.HOSTNAME2),
        managers_per_worker=2,
        client=c,
        total_mem="64 MiB",
        timeout=60,
    )
    on1 = DDict(
        policy=Policy(host=socket.gethostname()),
        managers_per_worker=2,
        client=c,
        total_mem="64 MiB",
        timeout=60,
    )
    try:
        assert on2.manager_workers == [w2, w2] and on1.manager_workers == [w1, w1]
        on2.update({i: i for i in range(100)})
        assert on2.rebalance() == [] and on1.rebalance() == []
        with pytest.raises(
            DDictError,
            match=r"does not satisfy manager 0's placement policy "
            r"Policy\(host='ddict-host2'\)",
        ):
            raise_from_wire(
                c.sync(c.scheduler.ddict_move, name=on2.get_name(), manager_id=0, worker=w1)
            )
        assert on2.manager_workers == [w2, w2] and all(on2[i] == i for i in range(100))
    finally:
        on2.destroy()
        on1.destroy()
