"""``dask ddict``: list, inspect, destroy and restore dictionaries from the command line.

Registered in the ``dask_cli`` entry-point group, so it sits beside
``dask scheduler`` and ``dask worker``; ``python -m dask_ddict`` runs it too.
Commands that talk to a cluster take ``--scheduler`` (default: Dask's
``scheduler-address`` config, i.e. ``DASK_SCHEDULER_ADDRESS``).  ``inspect``
reads a zarr store directly and needs no cluster; ``parked`` reads this machine's
shard directory, and asks each scheduler that keeps a shard there whether it does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import click
import dask.config


def _seconds(ctx: click.Context, param: click.Parameter, value: str) -> float | None:
    from .arguments import check_timeout

    try:
        return check_timeout(value)
    except (TypeError, ValueError) as e:
        raise click.BadParameter(str(e)) from None


def scheduler_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--scheduler ADDRESS`` and ``--timeout DURATION``: where the cluster is, and how
    long to try to reach it (an address where nothing listens is said at once, in one
    line, rather than after Dask's connect timeout and with its traceback)."""
    command = click.option(
        "--timeout",
        "timeout",
        default="5 s",
        show_default=True,
        metavar="DURATION",
        callback=_seconds,
        help="How long to try to reach the scheduler.",
    )(command)
    return click.option(
        "--scheduler",
        "scheduler",
        default=None,
        metavar="ADDRESS",
        help="Scheduler address (default: dask config 'scheduler-address').",
    )(command)


def _absolute_store(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from .arguments import absolute_store

    return absolute_store(value)


#: A zarr store: a relative path means what it means in the caller's working directory
#: (the cluster's host processes run elsewhere); an fsspec URL takes its options from
#: fsspec's environment variables (e.g. FSSPEC_S3_ENDPOINT_URL, AWS_ACCESS_KEY_ID).
store_argument = click.argument("store", callback=_absolute_store)


@contextlib.contextmanager
def _client(address: str | None, timeout: float | None) -> Iterator[Any]:
    from distributed import Client

    address = address or dask.config.get("scheduler-address", None)
    if not address:
        raise click.UsageError(
            "no scheduler: pass --scheduler ADDRESS or set DASK_SCHEDULER_ADDRESS"
        )
    from .client.core import install_orchestrator
    from .errors import DDictError

    try:
        client = Client(address, timeout=timeout)
    except (OSError, TimeoutError, ValueError) as e:  # (ValueError: an address Dask cannot read)
        said = " ".join(str(e).split()) or type(e).__name__
        raise click.ClickException(f"cannot reach the scheduler at {address}: {said}") from None
    with client:
        install_orchestrator(client)  # a cluster that never had a dictionary has none
        try:
            yield client
        except DDictError as e:  # e.g. no such dictionary: a message, not a traceback
            raise click.ClickException(e.message) from None


@click.group(name="ddict")
def ddict() -> None:
    """Distributed dictionaries (dask_ddict) on a Dask cluster."""


@ddict.command(name="list")
@scheduler_option
def list_(scheduler: str | None, timeout: float | None) -> None:
    """Dictionaries on the cluster (and those kept for restart)."""
    with _client(scheduler, timeout) as client:
        names = client.sync(client.scheduler.ddict_list)
        kept = client.sync(client.scheduler.ddict_list_kept)
        where = client.scheduler.address
    if not names and not kept:
        click.echo(f"no dictionaries on {where}")
    for name in names:
        click.echo(name)
    for name in kept:
        click.echo(f"{name}  (kept for restart)")


@ddict.command()
@click.argument("name")
@scheduler_option
def stats(name: str, scheduler: str | None, timeout: float | None) -> None:
    """One line per manager of dictionary NAME: host, keys, bytes, fill, window, and
    the bytes its host's processes hold as zero-copy values (pinned), and the
    operations waiting at it (``wait_for_keys``/``wait_for_writers``); a line per
    manager that is parked or lost (why), or short of its replicas; then a line per move of its managers
    (which, from where, to where, why)."""
    from .client import DDict

    with _client(scheduler, timeout) as client:
        d = DDict.from_name(name, client)
        try:
            click.echo(
                f"{'manager':>7}  {'host':<24} {'keys':>10} {'bytes':>14} {'fill':>6}  "
                f"{'window':<12} {'pinned':>14} {'waiting':>7}"
            )
            lost = {m.manager_id: m for m in d._core.fresh(force=True).managers if m.lost}
            for mid, info in sorted(lost.items()):  # (parked, or lost with their host)
                click.echo(
                    f"{mid:>7}  {info.hostname[:24]:<24} "
                    f"{'parked' if info.parked else 'lost'}: {info.lost_why}"
                )
            live = [m for m in range(d.num_managers) if m not in lost]
            for s in d.stats if not lost else [d.manager(m).stats[0] for m in live]:
                window = f"[{s.oldest_checkpoint}, {s.newest_checkpoint}]"
                click.echo(
                    f"{s.manager_id:>7}  {s.hostname[:24]:<24} {s.num_keys:>10} "
                    f"{s.total_used_bytes:>14} {s.pool_utilization:>6.1%}  "
                    f"{window:<12} {s.pinned_bytes:>14} {s.deferred_ops:>7}"
                )
            asked = d._core.layout.options.replicas
            for s in [s for s in d.stats if asked and s.replicas < asked] if not lost else []:
                click.echo(
                    f"short of replicas: manager {s.manager_id} has {s.replicas} of "
                    f"{asked} (a new one is made when a worker can keep it)"
                )
            for mv in d.moves:  # (the orchestrator's memory of its managers' moves)
                to = mv["target"] or "nowhere (parked on its machine)"
                click.echo(
                    f"moved: manager {mv['manager_id']} from {mv['source']} to {to}: {mv['why']}"
                )
        finally:
            d.detach()


@ddict.command()
@click.argument("name")
@scheduler_option
@click.option("--allow-restart", is_flag=True, help="Keep the shards for DDict(..., restart=True).")
def destroy(name: str, scheduler: str | None, timeout: float | None, allow_restart: bool) -> None:
    """Destroy dictionary NAME (every manager and its shard)."""
    from .client.layouts import layout_reply

    with _client(scheduler, timeout) as client:
        layout = layout_reply(client.sync(client.scheduler.ddict_attach, name=name))
        gone = client.sync(
            client.scheduler.ddict_destroy, name=name, uid=layout.uid, allow_restart=allow_restart
        )
    click.echo(f"destroyed {name}" if gone else f"{name} was already gone")


@ddict.command()
@click.option(
    "--remove",
    is_flag=True,
    help="Remove the shards whose cluster is gone (no live scheduler keeps them).",
)
@click.option(
    "--force",
    "forced",
    multiple=True,
    metavar="NAME",
    help="Remove the kept shards of dictionary NAME (or the shard directory NAME), "
    "whatever their cluster says; repeatable.",
)
@click.option(
    "--directory",
    default=None,
    metavar="DIR",
    help="The shard directory (default: dask config 'ddict.store.directory').",
)
@click.option(
    "--timeout",
    "timeout",
    default="3 s",
    show_default=True,
    metavar="DURATION",
    callback=_seconds,
    help="How long to wait for each scheduler's answer.",
)
def parked(
    remove: bool, forced: tuple[str, ...], directory: str | None, timeout: float | None
) -> None:
    """Parked shards on this machine, and the others kept in its shared memory.

    One line per shard that no process serves but that is kept: parked (no worker
    could take its manager), kept for a restart (``destroy(allow_restart=True)``),
    or kept aside (a deposed primary): its dictionary, manager, why, bytes, and
    whether the cluster that keeps it is alive (its scheduler answers that it keeps
    it), gone (its scheduler ended, or no longer keeps it), unknown (no answer) or
    in-use (a process holds it).
    A worker that starts on this machine removes those whose cluster is gone;
    ``--remove`` does it now.  Needs no cluster.
    """
    from distributed import Security

    from .host import hygiene

    base = directory or hygiene.shard_directory()
    shards = hygiene.kept_shards(base)
    if not shards:
        click.echo(f"no parked or kept shards in {base}")
        return
    states = hygiene.keeper_states([s for s in shards if not s.in_use], Security(), timeout)
    click.echo(
        f"{'dictionary':<20} {'manager':>7}  {'kept':<8} {'bytes':>12}  {'cluster':<8} "
        f"{'scheduler':<28} shard"
    )
    for s in shards:
        state = "in-use" if s.in_use else states.get(s.path, hygiene.UNKNOWN)
        manager = "?" if s.manager is None else str(s.manager)
        click.echo(
            f"{s.name[:20]:<20} {manager:>7}  {s.why or '?':<8} {s.nbytes:>12}  "
            f"{state:<8} {s.keeper:<28} {s.path}"
        )
    doomed = [
        s
        for s in shards
        if not s.in_use
        and (
            (remove and states.get(s.path) == hygiene.GONE)
            or any(f in (s.name, s.path, os.path.basename(s.path)) for f in forced)
        )
    ]
    hygiene.remove([s.path for s in doomed], kept=True)  # (never one a process holds)
    removed = [s for s in doomed if not os.path.exists(s.path)]
    for s in removed:
        click.echo(f"removed {s.path}")
    if remove or forced:
        click.echo(f"removed {len(removed)} shard(s), {sum(s.nbytes for s in removed)} bytes")


@ddict.command()
@store_argument
def inspect(store: str) -> None:
    """The checkpoints persisted in STORE (zarr, or a directory persister's), with their
    state and checksums."""
    from .errors import DDictPersistCheckpointError
    from .persist.choice import detect

    kind = detect(store)
    try:
        names = kind.dictionaries(store)
    except DDictPersistCheckpointError as e:
        raise click.ClickException(e.message) from None
    bad = 0
    for name in names:
        try:
            shapes = kind(store, name, 0, 1, writable=False).shapes()
        except DDictPersistCheckpointError as e:
            click.echo(f"{name}: {e.message}")
            bad += 1
            continue
        click.echo(f"{name}: {len(shapes)} managers")
        for mid, n in shapes.items():
            try:
                cs = kind(store, name, mid, n, writable=False)
            except DDictPersistCheckpointError as e:
                click.echo(f"  manager {mid}: {e.message}")
                bad += 1
                continue
            versions = cs.versions()
            for g in cs.generations():
                state = "committed" if g.committed else (g.problem or "not committed")
                check = ""
                v = versions.get(g.chkpt)
                if g.committed and v is not None and v.gens.get(mid) == g.gen:  # the checkpoint
                    try:
                        reader = (
                            cs
                            if v.managers == n
                            else kind(store, name, mid, v.managers, writable=False)
                        )
                        size = sum(memoryview(f).nbytes for _, f, _ in reader.read_generation(g))
                        check = f", {size} value bytes, checksums ok"
                    except DDictPersistCheckpointError as e:
                        check, bad = f", DAMAGED: {e.message}", bad + 1
                elif g.committed:
                    check = ", not (yet) part of a version every manager has"
                click.echo(f"  manager {mid}: checkpoint {g.chkpt} ({g.name}): {state}{check}")
    if bad:
        raise click.ClickException(f"{bad} damaged or unreadable checkpoint(s) in {store}")


@ddict.command()
@click.argument("name")
@click.option("--total-mem", default="256 MiB", show_default=True, help="Bytes over all managers.")
@click.option(
    "--managers-per-worker",
    type=int,
    default=None,
    help="Shards per worker (default: ddict.managers-per-worker).",
)
@click.option(
    "--working-set-size",
    type=int,
    default=1,
    show_default=True,
    help="Checkpoints kept (Dragon's working set).",
)
@click.option(
    "--replicas",
    type=int,
    default=0,
    show_default=True,
    help="Copies of each shard kept by other workers' hosts (a host lost suddenly "
    "loses nothing acknowledged).",
)
@scheduler_option
def create(
    name: str,
    total_mem: str,
    managers_per_worker: int | None,
    working_set_size: int,
    replicas: int,
    scheduler: str | None,
    timeout: float | None,
) -> None:
    """Create dictionary NAME on the cluster; print its handle (``DDict.attach``).

    It outlives this command (``lifetime="cluster"``): remove it with ``dask ddict
    destroy NAME``.
    """
    from .client import DDict

    with _client(scheduler, timeout) as client:
        try:
            d = DDict(
                managers_per_worker,
                total_mem=total_mem,
                name=name,
                client=client,
                working_set_size=working_set_size,
                replicas=replicas,
                lifetime="cluster",
            )
        except (TypeError, ValueError) as e:
            raise click.ClickException(str(e)) from None
        click.echo(d.serialize())
        d._core.close()  # the dictionary lives on; this process lets go of its handle


@ddict.command()
@store_argument
@click.option("--name", required=True, help="The dictionary's name in the store.")
@click.option("--checkpoint", type=int, default=None, help="Checkpoint id (default: newest).")
@click.option("--total-mem", default="1 GiB", show_default=True, help="Bytes over all managers.")
@click.option(
    "--managers-per-worker",
    type=int,
    default=None,
    help="Shards per worker (default: as many managers as persisted the checkpoint, "
    "if the workers can host them evenly, else ddict.managers-per-worker); "
    "a checkpoint restores onto any number of managers.",
)
@scheduler_option
def restore(
    store: str,
    name: str,
    checkpoint: int | None,
    total_mem: str,
    managers_per_worker: int | None,
    scheduler: str | None,
    timeout: float | None,
) -> None:
    """Create dictionary NAME on the cluster from its checkpoint in STORE; print its handle.

    The dictionary outlives this command (``lifetime="cluster"``): remove it with
    ``dask ddict destroy NAME``.
    """
    from .client import DDict
    from .persist.choice import detect

    kind = detect(store)
    try:
        if name not in kind.dictionaries(store):
            raise KeyError(f"it holds {kind.dictionaries(store)}")
        versions = kind(store, name, 0, 1, writable=False).versions()
    except Exception as e:  # noqa: BLE001
        raise click.ClickException(f"no dictionary {name!r} in {store}: {e}") from None
    if checkpoint is None:
        if not versions:
            raise click.ClickException(f"{name!r} has no checkpoint persisted on every manager")
        checkpoint = max(versions)
    from .client.workers import scheduler_workers

    with _client(scheduler, timeout) as client:
        workers = max(1, len(scheduler_workers(client)))
        wrote = versions[checkpoint].managers if checkpoint in versions else 0
        if managers_per_worker is None and wrote and wrote % workers == 0:
            managers_per_worker = wrote // workers  # (as persisted: nothing to re-shard)
        try:
            d = DDict(
                managers_per_worker,
                total_mem=total_mem,
                name=name,
                persist_path=store,
                restore_from=checkpoint,
                client=client,
                lifetime="cluster",
                persister_class=kind,
            )
        except (TypeError, ValueError) as e:
            raise click.ClickException(str(e)) from None
        click.echo(d.serialize())
        d._core.close()  # the dictionary lives on; this process lets go of its handle


def main() -> None:
    ddict()
