"""DDict: the user's handle on a distributed dictionary.

A handle knows the dictionary's :class:`~dask_ddict.layout.Layout` and its own
checkpoint id, serializes keys and values, hashes each key to its manager and
talks to that manager's host process through a channel (same host: the shard
read directly and writes over a Unix socket; other hosts: TCP): never through
the scheduler.  Dask's comms are used only for control
(create, destroy), through the orchestrator.

Handles derived from one another (:meth:`DDict.manager`, :meth:`DDict.pickler`)
share a :class:`_Core` (layout, channels, closed state) so that destroying
through one closes them all.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import distributed
from distributed import Client, LocalCluster

from . import config
from ._hashing import custom_placement, key_digest, manager_for_digest, seed_warning
from ._keys import dumps_key, loads_key
from ._serialize import Framed, KeyPickler, ValuePickler, dumps_value, loads_value
from .errors import (
    DDictClosedError,
    DDictError,
    DDictKeyError,
    DDictManagerUnavailableError,
    DDictPersistCheckpointError,
    DDictSyncError,
)
from .layout import Layout, ManagerInfo, host_id
from .arguments import (
    MAX_MANAGERS,
    check_bool,
    check_client,
    check_int,
    check_name,
    check_timeout,
)
from .options import DDictOptions, parse_total_mem
from .stats import DDictManagerStats
from .transport import HostLink, SocketChannel
from .transport.shared import SharedChannel
from .views import DDictItemsView, DDictKeysView, DDictValuesView, iter_pages

logger = logging.getLogger(__name__)

_MISSING: Any = object()
_DEFAULT_SECURITY: Any = None


def set_default_security(security: Any) -> None:
    """TLS certificates for processes with neither a client nor a worker (host processes)."""
    global _DEFAULT_SECURITY
    _DEFAULT_SECURITY = security


def _current_client() -> Client | None:
    try:
        return distributed.get_client()
    except ValueError:
        return None


def _embedded_client(total_mem: int) -> tuple[Client, LocalCluster]:
    """Start the LocalCluster (worker processes) that ``DDict()`` owns.

    Shards live beside the workers, not in them, so the workers' memory limits
    share what the host has left after ``total_mem``.
    """
    from distributed.deploy.utils import nprocesses_nthreads
    from distributed.system import MEMORY_LIMIT

    n_workers = config.get("embedded.n-workers")
    n = n_workers or nprocesses_nthreads()[0]
    memory_limit = max(256 << 20, (MEMORY_LIMIT - total_mem) // max(1, n))
    cluster = LocalCluster(
        n_workers=n_workers,
        threads_per_worker=config.get("embedded.threads-per-worker"),
        processes=True,
        dashboard_address=":0",
        memory_limit=memory_limit,
    )
    return Client(cluster, set_as_default=False), cluster


class _Core:
    """What all handles of one attached dictionary share."""

    layout: Layout
    closed: bool

    def __init__(
        self,
        layout: Layout,
        client: Client | None = None,
        cluster: LocalCluster | None = None,
    ) -> None:
        self.layout = layout
        self._client = client
        self.cluster = cluster
        self.closed = False
        self._channels: dict[int, Any] = {}
        self._links: dict[tuple[str, ...], HostLink] = {}
        self._lock = threading.Lock()
        # A handle that is dropped (e.g. at the end of a task) releases its
        # connections and shard views, also without detach().
        self._finalizer = weakref.finalize(self, _Core._release, self._channels, self._links)
        self._host = host_id()
        self.seed_checked = False

    def check_hash_seed(self, cls: type) -> None:
        """Warn once if keys placed by ``cls.__hash__`` here may land elsewhere in tasks."""
        self.seed_checked = True
        text = seed_warning(cls, {m.hash_seed for m in self.layout.managers})
        if text is not None:
            warnings.warn(text, RuntimeWarning, stacklevel=4)

    def __repr__(self) -> str:
        return f"<_Core {self.layout.name!r} managers={self.layout.num_managers} closed={self.closed}>"

    @property
    def client(self) -> Client:
        """A Dask client for control operations, found lazily."""
        if self._client is None:
            self._client = _current_client()
            if self._client is None:
                raise DDictError(
                    "this operation needs a dask Client: pass client= to DDict.attach or "
                    "create one in this process",
                    "INVALID_OPERATION",
                )
        return self._client

    def _security(self) -> Any:
        if self._client is not None:
            return self._client.security
        if _DEFAULT_SECURITY is not None:
            return _DEFAULT_SECURITY
        try:
            return distributed.get_worker().security
        except ValueError:
            pass
        client = _current_client()
        if client is not None:
            return client.security
        return distributed.Security()

    def is_local(self, info: ManagerInfo) -> bool:
        """Whether a manager shares this host (and so its /dev/shm)."""
        return info.host_id == self._host

    def channel(self, mid: int) -> Any:
        ch = self._channels.get(mid)
        if ch is not None:
            return ch
        with self._lock:
            if self.closed:
                raise DDictClosedError("the DDict was destroyed or detached")
            ch = self._channels.get(mid)
            if ch is None:
                ch = self._channels[mid] = self._make_channel(self.layout.managers[mid])
        return ch

    def _link(self, info: ManagerInfo, use_uds: bool, ssl_context: Any = None) -> HostLink:
        """The link to ``info``'s host process, shared by all managers it serves."""
        key = ("uds", info.uds_path) if use_uds else ("tcp", info.tcp_host, str(info.tcp_port))
        link = self._links.get(key)
        if link is None:
            lay = self.layout
            link = self._links[key] = HostLink(
                info, lay.uid, lay.secret, lay.name, use_uds=use_uds, ssl_context=ssl_context
            )
        return link

    def _make_channel(self, info: ManagerInfo) -> Any:
        if info.lost:
            raise DDictManagerUnavailableError(
                f"manager {info.manager_id} of {self.layout.name!r} was lost with its host "
                f"{info.hostname} ({info.worker})"
            )
        if config.get("local-transport") and self.is_local(info) and os.path.exists(info.uds_path):
            sock = SocketChannel(self._link(info, use_uds=True), info)
            if config.get("local-read") and os.path.isdir(info.store_path):
                capacity = self.layout.total_mem // self.layout.num_managers
                try:
                    return SharedChannel(sock, info.store_path, capacity, self.layout.options,
                                         bool(config.get("local-write")))  # fmt: skip
                except Exception as e:  # e.g. no permission: reads go over the socket
                    logger.info("ddict: direct reads of %s unavailable: %r", info.store_path, e)
            return sock
        ssl_context = None
        if self.layout.tls:
            ssl_context = self._security().get_connection_args("client")["ssl_context"]
            if ssl_context is None:
                raise DDictError(
                    "the cluster requires TLS but this process has no client certificate "
                    "(configure distributed.comm.tls or pass a client with security=)",
                    "INVALID_OPERATION",
                )
        return SocketChannel(self._link(info, use_uds=False, ssl_context=ssl_context), info)

    def close(self) -> None:
        with self._lock:
            self.closed = True
        self._finalizer()

    @staticmethod
    def _release(channels: dict[int, Any], links: dict[tuple[str, ...], HostLink]) -> None:
        chans, hosts = list(channels.values()), list(links.values())
        channels.clear()
        links.clear()
        for ch in chans:
            ch.close()
        for link in hosts:
            link.close()


class _Batch:
    """Client-side buffers of a batch put: one list of records per manager."""

    __slots__ = ("id", "persist", "records", "sizes", "sent", "error", "flush_bytes")

    def __init__(self, persist: bool) -> None:
        self.id = secrets.randbits(63)  # the managers keep this batch's state under it
        self.persist = persist
        self.flush_bytes = config.get_bytes("batch.flush-bytes")
        self.records: dict[int, list[tuple[bytes, bytes, Framed]]] = {}
        self.sizes: dict[int, int] = {}
        self.sent: dict[int, int] = {}  # puts sent per manager, checked at the end
        self.error: BaseException | None = None


class DDict:
    """A distributed dictionary sharded over managers hosted by Dask workers.

    Parameters
    ----------
    managers_per_worker
        Shards hosted by each chosen worker (default ``ddict.managers-per-worker``).
    n_workers
        How many workers host managers; ``None``: every connected worker.
    total_mem
        Bytes (int or a string such as ``"1 GiB"``) split evenly over the managers.
    working_set_size, wait_for_keys, wait_for_writers
        Checkpoint window and retirement rules (Dragon's model).
    persist_freq, persist_count, persist_path, read_only, restore_from, restart
        Persistence and restart (see the docs).
    name
        Name of the dictionary; generated when empty (:meth:`get_name`).
    timeout
        Seconds for every blocking operation of this handle; ``None``: forever.
    manager_pool_full_thresh
        Fraction of a shard above which puts raise ``DDictFullError``.
    client
        The Dask client; ``None``: the current client, else an embedded
        ``LocalCluster`` that this handle owns and closes on :meth:`destroy`.
    workers
        Worker addresses to host managers (default: all, see ``n_workers``).

    Notes
    -----
    All methods are synchronous and thread-safe.  From asyncio code use
    :class:`~dask_ddict.AsyncDDict`.
    """

    _core: _Core
    _creator: bool
    _chkpt: int
    _timeout: float | None
    _client_id: int
    _target: int | None
    _kp: KeyPickler | None
    _vp: ValuePickler | None
    _batch: _Batch | None
    _derived: bool
    _detached: bool

    def __init__(
        self,
        managers_per_worker: int | None = None,
        n_workers: int | None = None,
        total_mem: int | str | None = None,
        *,
        working_set_size: int = 1,
        wait_for_keys: bool = False,
        wait_for_writers: bool = False,
        persist_freq: int = 0,
        persist_count: int = 0,
        persist_path: str = "",
        name: str = "",
        timeout: float | None = None,
        restart: bool = False,
        read_only: bool = False,
        restore_from: int | None = None,
        manager_pool_full_thresh: float | None = None,
        client: Client | None = None,
        workers: list[str] | None = None,
    ) -> None:
        check_client(client)
        timeout = check_timeout(timeout)
        request = create_request(
            managers_per_worker, n_workers, total_mem, working_set_size=working_set_size,
            wait_for_keys=wait_for_keys, wait_for_writers=wait_for_writers,
            persist_freq=persist_freq, persist_count=persist_count, persist_path=persist_path,
            name=name, timeout=timeout, restart=restart, read_only=read_only,
            restore_from=restore_from, manager_pool_full_thresh=manager_pool_full_thresh,
            workers=workers,
        )  # fmt: skip
        if workers is not None and client is None and _current_client() is None:
            raise ValueError("workers= names workers of a cluster: pass client= too")

        cluster = None
        if client is None:
            client = _current_client()
            if client is None:
                client, cluster = _embedded_client(request["total_mem"])
        if client.asynchronous:
            raise TypeError("DDict needs a synchronous Client; use `await AsyncDDict.create(...)`")
        try:
            from .orchestrator import DDictSchedulerPlugin

            client.register_plugin(DDictSchedulerPlugin())
            layout_d = client.sync(client.scheduler.ddict_create, **request, client=client.id)
        except BaseException:
            if cluster is not None:
                client.close()
                cluster.close()
            raise
        self._setup(_Core(Layout.from_dict(layout_d), client, cluster), creator=True,
                    chkpt=0, timeout=timeout)  # fmt: skip
        initial_checkpoint(self, request)

    def _setup(self, core: _Core, *, creator: bool, chkpt: int, timeout: float | None,
               client_id: int | None = None) -> None:  # fmt: skip
        self._core = core
        self._creator = creator
        self._chkpt = chkpt
        self._timeout = timeout
        self._client_id = secrets.randbits(63) if client_id is None else client_id
        self._target = None
        self._kp = None
        self._vp = None
        self._batch = None
        self._derived = False
        self._detached = False

    @classmethod
    def _from_core(cls, core: _Core, **kwargs: Any) -> DDict:
        self = cls.__new__(cls)
        self._setup(core, **kwargs)
        return self

    # -- attach, pickle, lifecycle ------------------------------------------------

    def serialize(self) -> str:
        """A string from which any process that reaches the cluster can attach."""
        return self._core.layout.serialize()

    @classmethod
    def attach(cls, serialized: str, *, timeout: float | None = None,
               client: Client | None = None) -> DDict:  # fmt: skip
        """Attach to a dictionary from :meth:`serialize`'s string.

        No message goes to the scheduler: the string holds the layout.
        """
        timeout = check_timeout(timeout)
        layout = Layout.deserialize(serialized)
        return cls._from_core(
            _Core(layout, check_client(client)), creator=False, chkpt=0, timeout=timeout
        )

    def __reduce__(self) -> Any:
        return (_rebuild, (self.serialize(), self._chkpt, self._timeout, self._target,
                           self._kp, self._vp))  # fmt: skip

    def detach(self) -> None:
        """Stop using the dictionary from this handle (it stays alive).

        The creator's handle stays attached (it should :meth:`destroy`); a handle
        from :meth:`manager`/:meth:`pickler` detaches alone, not its parent.
        """
        if self._creator:
            return
        if self._derived:
            self._detached = True
        else:
            self._core.close()

    def destroy(self, allow_restart: bool = False) -> None:
        """Remove every manager and its shard; idempotent.

        With ``allow_restart=True`` every shard (the whole working set) stays
        in shared memory on its host, and ``DDict(..., name=n, restart=True)``
        brings it back, also after the worker processes were restarted.  With
        an embedded cluster this also closes the cluster (and so its shards).
        """
        core = self._core
        if core.closed:
            return
        if allow_restart and core.cluster is not None:
            raise DDictError(
                "destroy(allow_restart=True) on the embedded cluster, which closes with the "
                "dictionary: nothing could restart it (pass client= for a cluster that lives on)",
                "INVALID_OPERATION",
            )
        core.close()
        try:
            client = core.client
            client.sync(
                client.scheduler.ddict_destroy,
                name=core.layout.name, uid=core.layout.uid, allow_restart=allow_restart,
            )  # fmt: skip
        finally:
            if core.cluster is not None:
                core.client.close()
                core.cluster.close()
                core.cluster = None

    def __enter__(self) -> DDict:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._creator:
            self.destroy()
        else:
            self.detach()

    def __repr__(self) -> str:
        lay = self._core.layout
        state = "closed" if self._core.closed else f"checkpoint={self._chkpt}"
        target = f" manager={self._target}" if self._target is not None else ""
        return f"<DDict {lay.name!r} managers={lay.num_managers} {state}{target}>"

    def get_name(self) -> str:
        return self._core.layout.name

    # -- routing ----------------------------------------------------------------

    def _check(self) -> None:
        if self._core.closed or self._detached:
            raise DDictClosedError(f"DDict {self._core.layout.name!r} was destroyed or detached")

    def _route(self, key: Any) -> tuple[int, bytes, bytes]:
        self._check()
        kb = dumps_key(key, self._kp)
        digest = key_digest(kb)
        if self._target is not None:
            return self._target, digest, kb
        n = self._core.layout.num_managers
        mid = custom_placement(key, n)
        if mid is None:
            return manager_for_digest(digest, n), digest, kb
        if not self._core.seed_checked:
            self._core.check_hash_seed(type(key))
        return mid, digest, kb

    def _managers(self) -> list[int]:
        self._check()
        if self._target is not None:
            return [self._target]
        return list(range(self._core.layout.num_managers))

    def which_manager(self, key: Any) -> int:
        """Id of the manager that holds ``key``."""
        return self._route(key)[0]

    # -- the dict protocol ----------------------------------------------------------

    def _put(self, key: Any, value: Any, persistent: bool) -> None:
        mid, digest, kb = self._route(key)
        framed = dumps_value(value, self._vp)
        if self._batch is not None:
            if self._batch.persist != persistent:
                raise DDictError(
                    f"{'pput' if persistent else 'put'} inside a batch started with "
                    f"persist={self._batch.persist}",
                    "INVALID_OPERATION",
                )
            self._batch_add(mid, digest, kb, framed)
            return
        self._core.channel(mid).put(
            digest, kb, framed, self._chkpt, self._client_id, persistent, self._timeout
        )

    def __setitem__(self, key: Any, value: Any) -> None:
        self._put(key, value, False)

    def pput(self, key: Any, value: Any) -> None:
        """Persistent put: survives retirement under ``wait_for_keys``."""
        self._put(key, value, True)

    def __getitem__(self, key: Any) -> Any:
        mid, digest, _ = self._route(key)
        try:
            frame = self._core.channel(mid).get(digest, self._chkpt, self._timeout)
        except DDictKeyError:
            raise DDictKeyError(key) from None
        return loads_value(frame, self._vp)

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return self[key]
        except DDictKeyError:
            return default

    def __contains__(self, key: Any) -> bool:
        mid, digest, _ = self._route(key)
        return self._core.channel(mid).contains(digest, self._chkpt)

    def pop(self, key: Any, default: Any = _MISSING) -> Any:
        """Remove ``key`` and return its value (``default`` if absent and given)."""
        mid, digest, _ = self._route(key)
        try:
            frame = self._core.channel(mid).pop(digest, self._chkpt, self._client_id, self._timeout)
        except DDictKeyError:
            if default is not _MISSING:
                return default
            raise DDictKeyError(key) from None
        return loads_value(frame, self._vp)

    def __delitem__(self, key: Any) -> None:
        self.pop(key)

    def _length(self, managers: list[int]) -> int:
        """Keys visible at this handle's checkpoint on ``managers``."""
        return sum(self._core.channel(m).length(self._chkpt) for m in managers)

    def __len__(self) -> int:
        return self._length(self._managers())

    def clear(self) -> None:
        """Empty the client's current checkpoint on every manager (or the chosen one)."""
        for m in self._managers():
            self._core.channel(m).clear(self._chkpt, self._client_id, self._timeout)

    def keys(self) -> DDictKeysView:
        return DDictKeysView(self, self._managers())

    def values(self) -> DDictValuesView:
        return DDictValuesView(self, self._managers())

    def items(self) -> DDictItemsView:
        return DDictItemsView(self, self._managers())

    def __iter__(self) -> Iterator[Any]:
        return iter(self.keys())

    def update(self, other: Mapping[Any, Any] | Any = (), **kwargs: Any) -> None:
        """Put every pair (as one batch unless a batch is already open)."""
        pairs = other.items() if isinstance(other, Mapping) else other
        own = self._batch is None
        if own:
            self.start_batch_put()
        try:
            for k, v in pairs:
                self[k] = v
            for k, v in kwargs.items():
                self[k] = v
        finally:
            if own:
                self.end_batch_put()

    def popitem(self) -> Any:
        raise NotImplementedError("DDict has no order, so popitem is not supported")

    def fetch_add(self, key: Any, n: int = 1) -> int:
        """Atomically add ``n`` to an int value (absent: starts at 0); return the old value."""
        check_int("n", n)
        mid, digest, kb = self._route(key)
        frame = self._core.channel(mid).fetch_add(
            digest, kb, self._chkpt, self._client_id, n, self._timeout
        )
        return loads_value(frame)

    def wait_for(self, key: Any, value: Any, timeout: float | None = _MISSING) -> None:
        """Block until ``self[key] == value`` (compared as serialized bytes)."""
        timeout = self._timeout if timeout is _MISSING else check_timeout(timeout)
        mid, digest, _ = self._route(key)
        frame = dumps_value(value, self._vp).join()
        self._core.channel(mid).wait_for(digest, self._chkpt, frame, timeout)

    def _iter(self, managers: list[int], want: int) -> Iterator[tuple[Any, Any]]:
        page = config.get("iteration.page-items")
        for mid in managers:
            self._check()
            for k, v in iter_pages(self._core.channel(mid), self._chkpt, want, page):
                yield (
                    None if k is None else loads_key(k, self._kp),
                    None if v is None else loads_value(v, self._vp),
                )

    # -- checkpoints --------------------------------------------------------------

    @property
    def checkpoint_id(self) -> int:
        return self._chkpt

    @checkpoint_id.setter
    def checkpoint_id(self, value: int) -> None:
        self._chkpt = check_int("checkpoint_id", value, 0)

    def _no_batch(self, what: str) -> None:
        if self._batch is not None:
            raise DDictError(f"{what} is not allowed inside a batch put", "INVALID_OPERATION")

    def checkpoint(self) -> None:
        """Move this handle to the next checkpoint (no message is sent)."""
        self._no_batch("checkpoint()")
        self._chkpt += 1

    def rollback(self) -> None:
        """Move this handle to the previous checkpoint (floored at 0)."""
        self._no_batch("rollback()")
        self._chkpt = max(0, self._chkpt - 1)

    def sync_to_newest_checkpoint(self) -> None:
        """Move to the newest checkpoint any manager (or the chosen one) holds."""
        self._chkpt = max(self._core.channel(m).newest_checkpoint() for m in self._managers())

    # -- persistence ---------------------------------------------------------------

    def _admin(self, name: str, *args: Any) -> list[Any]:
        """Call a manager control method on every manager (or the chosen one)."""
        return [self._core.channel(m).admin(name, *args) for m in self._managers()]

    def persist(self) -> None:
        """Persist this handle's current checkpoint to ``persist_path`` now.

        Written in the background on every manager (see :meth:`sync`),
        whatever ``persist_freq`` and ``persist_count`` say.
        """
        self._no_batch("persist()")
        self._admin("persist", self._chkpt)

    def persisted_ids(self) -> list[int]:
        """Checkpoint ids persisted (and committed) on every manager, ascending."""
        sets = [set(ids) for ids in self._admin("persisted_ids")]
        return sorted(set.intersection(*sets)) if sets else []

    def sync(self) -> None:
        """Wait until background persistence is done on every manager."""
        self._admin("sync")

    def restore(self, chkpt: int) -> None:
        """Load persisted checkpoint ``chkpt`` on every manager and move this handle to it.

        Outside read-only mode, persisted checkpoints newer than ``chkpt`` are
        discarded (the history continues from it).  Other handles keep their
        own checkpoint ids.

        Raises
        ------
        DDictPersistCheckpointError
            If some manager has not persisted ``chkpt``.
        """
        check_int("chkpt", chkpt, 0)
        self._no_batch("restore()")
        self.sync()
        ids = self.persisted_ids()
        if chkpt not in ids:
            raise DDictPersistCheckpointError(
                f"checkpoint {chkpt} is not persisted on every manager (persisted: {ids})"
            )
        self._admin("restore", chkpt)
        self._chkpt = chkpt

    def advance(self) -> int:
        """Read-only replay: load the next persisted checkpoint (``+ persist_freq``).

        Returns the new checkpoint id (this handle moves to it).
        """
        new = self._admin("advance")
        self._chkpt = max(new)
        return self._chkpt

    # -- batch and broadcast ------------------------------------------------------------

    def start_batch_put(self, persist: bool = False) -> None:
        """Stream the following puts without per-put replies (until :meth:`end_batch_put`)."""
        self._check()
        self._no_batch("start_batch_put()")
        self._batch = _Batch(bool(persist))

    def _batch_add(self, mid: int, digest: bytes, kb: bytes, framed: Framed) -> None:
        b = self._batch
        assert b is not None
        b.records.setdefault(mid, []).append((digest, kb, framed))
        size = b.sizes[mid] = b.sizes.get(mid, 0) + framed.nbytes + len(kb) + 32
        if size >= b.flush_bytes:
            self._batch_flush(mid)

    def _batch_flush(self, mid: int) -> None:
        b = self._batch
        assert b is not None
        records = b.records.pop(mid, None)
        b.sizes.pop(mid, None)
        if not records:
            return
        b.sent[mid] = b.sent.get(mid, 0) + len(records)
        try:
            self._core.channel(mid).batch_put(records, self._chkpt, self._client_id, b.persist,
                                              b.id)  # fmt: skip
        except DDictError as e:
            b.error = b.error or e

    def end_batch_put(self) -> None:
        """Send what is buffered and raise the first error any manager saw."""
        b = self._batch
        if b is None:
            raise DDictError("end_batch_put() without start_batch_put()", "INVALID_OPERATION")
        try:
            for mid in list(b.records):
                self._batch_flush(mid)
            for mid in sorted(b.sent):
                try:
                    stored = self._core.channel(mid).batch_end(self._client_id, b.id)
                except DDictError as e:
                    b.error = b.error or e
                    continue
                if stored != b.sent[mid] and b.error is None:
                    b.error = DDictError(
                        f"batch put: manager {mid} stored {stored} of the {b.sent[mid]} puts "
                        "sent to it (its host process restarted during the batch); the "
                        "others may or may not have been applied: put them again",
                        "MANAGER_UNAVAILABLE",
                    )
        finally:
            self._batch = None
        if b.error is not None:
            raise b.error

    def bput(self, key: Any, value: Any) -> None:
        """Store a copy of the pair on every manager (read it with :meth:`bget`)."""
        if self._batch is not None and self._batch.persist:
            raise DDictError("bput inside a persistent batch", "INVALID_OPERATION")
        self._check()
        kb = dumps_key(key, self._kp)
        digest = key_digest(kb)
        framed = dumps_value(value, self._vp)
        for mid in range(self._core.layout.num_managers):
            if self._batch is not None:
                self._batch_add(mid, digest, kb, framed)
            else:
                self._core.channel(mid).put(
                    digest, kb, framed, self._chkpt, self._client_id, False, self._timeout
                )

    def bget(self, key: Any) -> Any:
        """Read a broadcast value from this handle's main manager."""
        self._check()
        kb = dumps_key(key, self._kp)
        mid = self._target if self._target is not None else self.main_manager
        try:
            frame = self._core.channel(mid).get(key_digest(kb), self._chkpt, self._timeout)
        except DDictKeyError:
            raise DDictKeyError(key) from None
        return loads_value(frame, self._vp)

    def freeze(self) -> None:
        """Make every manager read-only: writes raise ``DDictError`` (INVALID_OPERATION)."""
        for m in self._managers():
            self._core.channel(m).freeze()

    def unfreeze(self) -> None:
        for m in self._managers():
            self._core.channel(m).unfreeze()

    @property
    def is_frozen(self) -> bool:
        return all(self._core.channel(m).stats()["frozen"] for m in self._managers())

    # -- handles, locality, introspection --------------------------------------------

    def _derive(self) -> DDict:
        h = DDict._from_core(self._core, creator=False, chkpt=self._chkpt,
                             timeout=self._timeout, client_id=self._client_id)  # fmt: skip
        h._target, h._kp, h._vp = self._target, self._kp, self._vp
        h._derived = True
        return h

    def manager(self, manager_id: int) -> DDict:
        """A handle whose key operations, len, keys, clear and stats go to one manager."""
        n = self._core.layout.num_managers
        check_int("manager_id", manager_id)
        if not 0 <= manager_id < n:  # Dragon's error for a bad id
            raise DDictError(f"manager_id must be in [0, {n - 1}], got {manager_id}",
                             "INVALID_ARGUMENT")  # fmt: skip
        h = self._derive()
        h._target = manager_id
        return h

    def pickler(self, key_pickler: KeyPickler | None = None,
                value_pickler: ValuePickler | None = None) -> DDict:  # fmt: skip
        """A handle that serializes keys with ``key_pickler.dumps/loads`` and values
        with ``value_pickler.dump(obj, file)/load(file)``."""
        if key_pickler is not None and not (
            hasattr(key_pickler, "dumps") and hasattr(key_pickler, "loads")
        ):
            raise TypeError("key_pickler needs dumps() and loads()")
        if value_pickler is not None and not (
            hasattr(value_pickler, "dump") and hasattr(value_pickler, "load")
        ):
            raise TypeError("value_pickler needs dump(obj, file) and load(file)")
        h = self._derive()
        h._kp, h._vp = key_pickler, value_pickler
        return h

    @property
    def client(self) -> Client:
        """The Dask client of this handle (the embedded cluster's, if it owns one)."""
        return self._core.client

    @property
    def timeout(self) -> float | None:
        return self._timeout

    @property
    def wait_for_keys(self) -> bool:
        return self._core.layout.options.wait_for_keys

    @property
    def wait_for_writers(self) -> bool:
        return self._core.layout.options.wait_for_writers

    @property
    def working_set_size(self) -> int:
        return self._core.layout.options.working_set_size

    @property
    def num_managers(self) -> int:
        return self._core.layout.num_managers

    @property
    def manager_workers(self) -> list[str]:
        """Address of the worker hosting each manager."""
        return self._core.layout.manager_workers

    @property
    def local_managers(self) -> list[int]:
        """Managers on this host."""
        return [m.manager_id for m in self._core.layout.managers if self._core.is_local(m)]

    @property
    def local_manager(self) -> int | None:
        """A manager hosted for this worker (in a task), else one on this host, else ``None``.

        Managers run in a host process beside their worker, not in it; "hosted
        for" survives worker restarts (it follows the worker's nanny).
        """
        try:
            w = distributed.get_worker()
        except ValueError:
            w = None
        if w is not None:
            for m in self._core.layout.managers:
                if m.worker == w.address or (w.nanny and m.supervisor == w.nanny):
                    return m.manager_id
        local = self.local_managers
        return local[0] if local else None

    @property
    def main_manager(self) -> int:
        """The local manager if any, else one chosen from this handle's client id."""
        local = self.local_manager
        return local if local is not None else self._client_id % self.num_managers

    @property
    def empty_managers(self) -> list[int]:
        """Managers that came back empty after a restart (none without restart)."""
        return list(self._core.layout.extra.get("empty_managers", []))

    def local_keys(self) -> DDictKeysView:
        return DDictKeysView(self, self._local_ids(), local=True)

    def local_values(self) -> DDictValuesView:
        return DDictValuesView(self, self._local_ids(), local=True)

    def local_items(self) -> DDictItemsView:
        return DDictItemsView(self, self._local_ids(), local=True)

    def local_len(self) -> int:
        return self._length(self._local_ids())

    def _local_ids(self) -> list[int]:
        self._check()
        local = set(self.local_managers)
        return [m for m in self._managers() if m in local]

    @property
    def stats(self) -> list[DDictManagerStats]:
        """One entry per manager (or the chosen one), sorted by manager id."""
        return [DDictManagerStats.from_dict(self._core.channel(m).stats()) for m in self._managers()]

    @property
    def dstats(self) -> dict[int, DDictManagerStats]:
        return {s.manager_id: s for s in self.stats}

    # -- replication ----------------------------------------------------------------

    def clone(self, clone_list: list[str]) -> None:
        """Make every dictionary in ``clone_list`` (serialized) an exact copy of this one.

        Each target manager pulls its counterpart's whole shard (all
        checkpoints of the working set) directly from this dictionary's
        manager: no data goes through this process or the scheduler.  The
        targets need the same number of managers and working-set size.
        """
        self._check()
        if isinstance(clone_list, str) or not isinstance(clone_list, (list, tuple)):
            raise TypeError("clone needs a list of serialized DDicts (DDict.serialize())")
        source = self.serialize()
        for s in clone_list:
            target = Layout.deserialize(s)
            _check_parallel(self._core.layout, target)
            _pull_into(target, source, range(self.num_managers), self._core._client)

    def copy(self, name: str = "") -> DDict:
        """A new dictionary (creator: the caller) with this one's options and content.

        It has the same managers on the same workers, and every checkpoint
        of the working set is copied manager to manager.
        """
        self._check()
        if not self._creator:
            raise DDictError("copy() is for the creator's handle", "INVALID_OPERATION")
        lay = self._core.layout
        workers = list(dict.fromkeys(lay.manager_workers))
        per_worker = {w: lay.manager_workers.count(w) for w in workers}
        if len(set(per_worker.values())) != 1:
            raise DDictError(
                "copy() needs the same number of managers on every worker "
                f"(this dictionary has {per_worker})",
                "INVALID_OPERATION",
            )
        opts = lay.options
        new = DDict(
            next(iter(per_worker.values())), total_mem=lay.total_mem, workers=workers,
            working_set_size=opts.working_set_size, wait_for_keys=opts.wait_for_keys,
            wait_for_writers=opts.wait_for_writers, persist_freq=opts.persist_freq,
            persist_count=opts.persist_count, persist_path=opts.persist_path, name=name,
            timeout=self._timeout, manager_pool_full_thresh=opts.manager_pool_full_thresh,
            client=self.client,
        )  # fmt: skip
        try:
            self.clone([new.serialize()])
        except BaseException:
            new.destroy()
            raise
        new._chkpt = self._chkpt
        return new

    @classmethod
    def synchronize_ddicts(cls, serialized_ddicts: list[str]) -> None:
        """Rebuild the empty managers of parallel dictionaries from the others.

        After a restart, a manager whose shard was lost comes back empty
        (``empty_managers``).  For each manager id, every dictionary whose
        manager is empty pulls that manager from a dictionary where it is not.

        Raises
        ------
        DDictSyncError
            If a manager id is empty in every dictionary.
        """
        if isinstance(serialized_ddicts, str) or not isinstance(serialized_ddicts, (list, tuple)):
            raise TypeError("synchronize_ddicts needs a list of serialized DDicts")
        layouts = [Layout.deserialize(s) for s in serialized_ddicts]
        if not layouts:
            return
        for lay in layouts[1:]:
            _check_parallel(layouts[0], lay)
        for mid in range(layouts[0].num_managers):
            empty = [i for i, lay in enumerate(layouts) if mid in lay.extra.get("empty_managers", ())]
            if not empty:
                continue
            full = [i for i in range(len(layouts)) if i not in empty]
            if not full:
                raise DDictSyncError(
                    f"manager {mid} is empty in every dictionary: nothing to synchronize from"
                )
            for i in empty:
                _pull_into(layouts[i], serialized_ddicts[full[0]], [mid])


def _pull_into(target: Layout, source: str, managers: Any, client: Client | None = None) -> None:
    """Have ``target``'s managers pull their counterparts' shards from ``source``.

    Only the request goes from here; the data flows manager to manager.
    """
    core = _Core(target, client)
    try:
        for mid in managers:
            core.channel(mid).admin("copy_from", source, mid)
    finally:
        core.close()


def _check_parallel(a: Layout, b: Layout) -> None:
    """Two dictionaries whose managers correspond one to one."""
    if a.num_managers != b.num_managers:
        raise DDictError(
            f"{b.name!r} has {b.num_managers} managers and {a.name!r} has {a.num_managers}: "
            "replication copies manager i to manager i, so the counts must match",
            "INVALID_ARGUMENT",
        )
    if a.options.working_set_size != b.options.working_set_size:
        raise DDictError(
            f"{b.name!r} has working_set_size={b.options.working_set_size} and {a.name!r} "
            f"has {a.options.working_set_size}",
            "INVALID_ARGUMENT",
        )


def create_request(
    managers_per_worker: int | None,
    n_workers: int | None,
    total_mem: int | str | None,
    *,
    name: str,
    timeout: float | None,
    restart: bool,
    manager_pool_full_thresh: float | None,
    workers: list[str] | None,
    **checkpoint_options: Any,
) -> dict[str, Any]:
    """Validate the constructor's arguments into the orchestrator's ``ddict_create`` call.

    Shared by :class:`DDict` and :class:`~dask_ddict.AsyncDDict` so that both
    reject the same mistakes, with the same messages, before any message is sent.
    """
    mpw = config.get("managers-per-worker") if managers_per_worker is None else managers_per_worker
    check_int("managers_per_worker", mpw, 1, MAX_MANAGERS)
    check_int("n_workers", n_workers, 1, MAX_MANAGERS, allow_none=True)
    if workers is not None and (
        isinstance(workers, (str, bytes)) or not isinstance(workers, (list, tuple))
        or not all(isinstance(w, str) for w in workers)
    ):  # fmt: skip
        raise TypeError(f"workers must be a list of worker addresses or None, got {workers!r:.80}")
    mem = parse_total_mem(config.get("total-mem") if total_mem is None else total_mem)
    check_name(name)
    check_timeout(timeout)
    check_bool("restart", restart)
    if manager_pool_full_thresh is None:
        manager_pool_full_thresh = config.get("manager-pool-full-thresh")
    options = DDictOptions(manager_pool_full_thresh=manager_pool_full_thresh, **checkpoint_options)
    options.validate(name=name, restart=restart)
    return dict(
        name=name, options=options.to_dict(), total_mem=mem, managers_per_worker=mpw,
        n_workers=n_workers, workers=None if workers is None else list(workers),
        restart=restart,
    )  # fmt: skip


def initial_checkpoint(h: DDict, request: dict[str, Any]) -> None:
    """Where a creator's handle starts: ``restore_from``, the newest restored
    checkpoint after a restart, else 0.  Also shows the orchestrator's warnings."""
    for text in h._core.layout.extra.get("warnings", ()):
        warnings.warn(text, RuntimeWarning, stacklevel=3)
    restore_from = request["options"]["restore_from"]
    if request["restart"]:
        h.sync_to_newest_checkpoint()
    elif restore_from is not None:
        h._chkpt = restore_from


def _rebuild(serialized: str, chkpt: int, timeout: float | None, target: int | None,
             kp: Any, vp: Any) -> DDict:  # fmt: skip
    """Unpickling a handle attaches (a task starts at the parent's checkpoint)."""
    h = DDict.attach(serialized, timeout=timeout)
    h._chkpt = chkpt
    h._target, h._kp, h._vp = target, kp, vp
    return h
