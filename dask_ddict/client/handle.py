"""DDict: the user's handle on a distributed dictionary.

A handle knows the dictionary's :class:`~dask_ddict.layout.Layout` and its own
checkpoint id, serializes keys and values, hashes each key to its manager and
talks to that manager's host process through a channel (same host: the shard
read directly and writes over a Unix socket; other hosts: TCP): never through
the scheduler.  Dask's comms are used only for control
(create, destroy), through the scheduler plugin.

Handles derived from one another (:meth:`DDict.manager`, :meth:`DDict.pickler`)
share a :class:`~dask_ddict.client.core.HandleCore` (layout, channels, closed state)
so that destroying through one closes them all.  The handle's state and its key
routing are declared in :class:`~dask_ddict.client.base.HandleBase`, which every
part of ``DDict`` (reads, bulk, checkpoints, ...) inherits.
"""

from __future__ import annotations

import builtins  # DDict.list shadows the builtin in the class body
import inspect
import itertools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from dask.typing import no_default
from dask.utils import format_bytes
from distributed import Client

from .. import config, kernels
from .._keys import loads_key
from .._serialize import KeyPickler, ValuePickler, dumps_value, loads_value
from ..arguments import Timeout, check_bool, check_client, check_int, check_timeout
from ..errors import (
    DDictError,
    DDictFullError,
    DDictKeyError,
    DDictTimeoutError,
)
from ..layout import Layout
from ..placement import Policy
from ..transport import timing
from ..transport.ops import (
    Clear,
    Contains,
    FetchAdd,
    GetRange,
    Length,
    Pop,
    Put,
    SetDefault,
    WaitFor,
)
from . import embedded
from .bulk import Bulk
from .checkpoints import Checkpoints
from .cloning import Cloning
from .compute import Compute
from .core import MISSING, HandleCore, current_client, install_orchestrator
from .creation import (
    create_request,
    created_layout,
    initial_checkpoint,
    keywords_checked,
    trace_logging,
)
from .introspection import Introspection
from .lane import LANE
from .layouts import LayoutRef, forget, layout_reply
from .mapping import MappingMethods
from .placement import Placement
from .reads import Reads
from .views import (
    DDictItemsView,
    DDictKeysView,
    DDictValuesView,
    first_pages,
    iter_pages,
)

logger = logging.getLogger(__name__)

_MISSING = MISSING


class DDict(Reads, Checkpoints, Introspection, MappingMethods, Cloning, Bulk, Compute, Placement):
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
        Persistence and restart (see the docs).  A relative local ``persist_path``
        is made absolute in this process.
    storage_options
        fsspec options for a URL ``persist_path`` (credentials, ``endpoint_url``,
        ...), passed to the filesystem in every host process.  They stay out of
        the layout, serialized handles, logs and reprs.
    name
        Name of the dictionary; generated when empty (:meth:`get_name`).
    timeout
        Seconds (or a duration such as ``"30s"``) for every blocking operation of
        this handle; ``None``: forever.  Default: ``ddict.timeout`` from dask.config
        (``null``, i.e. forever, unless configured).
    manager_pool_full_thresh
        Fraction of a shard above which puts raise ``DDictFullError``.
    lifetime
        ``"client"`` (default ``ddict.lifetime``): the dictionary is destroyed once
        the client that created it, and every client that attached with
        :meth:`from_name`, has left the scheduler (closed, crashed or killed) for
        ``ddict.lifetime-grace-period``, as Dask releases a client's futures.
        ``"cluster"``: it lives until :meth:`destroy`, whoever leaves; use it for
        dictionaries that outlive their creator (``restart``, services).
    client
        The Dask client; ``None``: the current client, else an embedded
        ``LocalCluster`` that this handle owns and closes on :meth:`destroy`.
    workers
        Worker addresses to host managers (default: all, see ``n_workers``).
    replicas
        Copies of each shard kept by other workers' hosts, written before a write is
        acknowledged: a host lost suddenly loses nothing acknowledged (docs: "Replicas").
    managers_per_node, n_nodes
        Dragon's names of ``managers_per_worker`` and ``n_workers``, with their
        meaning: a Dask worker stands for a Dragon node (its host process serves the
        managers placed on it), so ``DDict(managers_per_node=2, n_nodes=1, ...)``
        runs as in Dragon.  Either name of one argument, not both (``TypeError``).
    policy, managers_per_policy
        Placement policies (:class:`~dask_ddict.Policy`: a worker, a host, Dask worker
        resources such as ``{"GPU": 1}``), Dragon's way: one ``Policy`` places every
        manager on the workers that satisfy it (``managers_per_worker`` each); a list
        places ``managers_per_policy`` (default 1) per policy, and a mapping
        ``{Policy: count}`` its count per policy.  A manager keeps its policy: it moves,
        is adopted and replicated only onto workers that satisfy it, else it is parked,
        saying which policy no worker satisfies.
    orc_policy
        Accepted (a ``Policy`` or ``None``), without effect: the orchestrator is the
        scheduler plugin, it runs in the scheduler.
    persister_class
        What writes ``persist_path`` (docs: "Persisters"): ``None`` (a zarr store, a
        directory or an fsspec URL), :class:`~dask_ddict.persist.DirectoryPersister`
        (plain files in a directory; Dragon's ``PosixCheckpointPersister``, whose
        ``persist_path`` defaults to the current directory), Dragon's
        ``NULLCheckpointPersister`` (nothing persisted), or a subclass of
        :class:`~dask_ddict.persist.CheckpointPersister` that the workers can import.
        Dragon's ``DAOSCheckpointPersister`` is refused (``ValueError``, saying what
        to use).
    trace
        ``True``: DEBUG logging of the ``dask_ddict`` loggers in this process, the
        nearest meaning of Dragon's verbose client and manager logging (the host
        processes that serve the managers log their warnings beside their workers').
    streams_per_manager
        Accepted for Dragon's programs, without effect: connections to host
        processes are pooled and multiplexed, there are no per-manager streams.

    Notes
    -----
    All methods are synchronous and thread-safe.  From asyncio code use
    :class:`~dask_ddict.AsyncDDict`.
    """

    @keywords_checked  # DDict(total_memory=...): "did you mean 'total_mem'?"
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
        storage_options: dict[str, Any] | None = None,
        name: str = "",
        timeout: Timeout = no_default,
        restart: bool = False,
        read_only: bool = False,
        restore_from: int | None = None,
        manager_pool_full_thresh: float | None = None,
        lifetime: str | None = None,
        client: Client | None = None,
        workers: list[str] | None = None,
        replicas: int = 0,
        managers_per_node: int | None = None,
        n_nodes: int | None = None,
        policy: Policy | list[Policy] | Mapping[Policy, int] | None = None,
        managers_per_policy: int | None = None,
        orc_policy: Policy | None = None,
        persister_class: Any = None,
        trace: bool = False,
        streams_per_manager: int | None = None,
    ) -> None:
        # The signature is the constructor arguments' one declaration: take them by name.
        args = {k: v for k, v in locals().items() if k in CREATE_ARGUMENTS}
        check_client(client)
        timeout = check_timeout(timeout)
        request = create_request(args)
        trace_logging(trace)  # (before the request: the creation is logged too)
        if workers is not None and client is None and current_client() is None:
            raise ValueError("workers= names workers of a cluster: pass client= too")

        cluster = None
        if client is None:
            client = current_client()
            if client is None:
                client, cluster = embedded.start(request["total_mem"])
        if client.asynchronous:
            raise TypeError("DDict needs a synchronous Client; use `await AsyncDDict.create(...)`")
        try:
            install_orchestrator(client)
            layout = created_layout(
                client.sync(client.scheduler.ddict_create, **request, client=client.id)
            )
        except BaseException:
            if cluster is not None:
                client.close()
                cluster.close()
            raise
        self._setup(HandleCore(layout, client, cluster), creator=True, chkpt=0, timeout=timeout)
        initial_checkpoint(self, request)

    # -- attach, pickle, lifecycle ------------------------------------------------

    def serialize(self) -> str:
        """A string from which any process that reaches the cluster can attach."""
        self._check()
        return self._core.layout.serialize()

    @classmethod
    def attach(
        cls,
        serialized: str,
        *,
        timeout: Timeout = no_default,
        client: Client | None = None,
        trace: bool = False,
    ) -> DDict:
        """Attach to a dictionary from :meth:`serialize`'s string.

        No message goes to the scheduler: the string holds the layout.
        ``trace``: as the constructor's (Dragon's ``attach`` takes it too).
        """
        timeout = check_timeout(timeout)
        trace_logging(check_bool("trace", trace))
        layout = Layout.deserialize(serialized)
        return cls._from_core(
            HandleCore(layout, check_client(client)), creator=False, chkpt=0, timeout=timeout
        )

    @classmethod
    def from_name(
        cls, name: str, client: Client | None = None, *, timeout: Timeout = no_default
    ) -> DDict:
        """Attach to the dictionary named ``name`` on ``client``'s cluster (one scheduler call).

        ``client`` then holds the dictionary: one with ``lifetime="client"`` lives
        while any of its holders is connected (see the constructor's ``lifetime``).
        """
        client = check_client(client) or current_client()
        if client is None:
            raise ValueError("from_name needs client= (or a current dask Client)")
        install_orchestrator(client)
        layout = layout_reply(
            client.sync(client.scheduler.ddict_attach, name=name, client=client.id)
        )
        return cls._from_core(
            HandleCore(layout, client), creator=False, chkpt=0, timeout=check_timeout(timeout)
        )

    @staticmethod
    def list(client: Client | None = None, *, kept: bool = False) -> list[str]:
        """Names of the dictionaries on ``client``'s cluster, sorted.

        ``kept=True``: instead, the names of those destroyed with
        ``allow_restart=True``, whose shards wait for ``DDict(name=...,
        restart=True)`` (``dask ddict list`` shows both, the kept ones marked
        "kept for restart").  The two are apart because they are used apart: a
        live name can be attached to (:meth:`from_name`), a kept one only
        restarted.
        """
        check_bool("kept", kept)
        client = check_client(client) or current_client()
        if client is None:
            raise ValueError("list needs client= (or a current dask Client)")
        install_orchestrator(client)
        call = client.scheduler.ddict_list_kept if kept else client.scheduler.ddict_list
        return list(client.sync(call))

    def __reduce__(self) -> Any:
        # A reference, not the layout: the size of a pickled handle does not grow with
        # the managers (see client/layouts.py); serialize() stays self-contained.
        self._check()  # (a closed handle's task would fail far from the cause)
        return (
            _rebuild,
            (self._core.ref, self._chkpt, self._timeout, self._target, self._kp, self._vp),
        )

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
        forget(core.ref.uid)
        try:
            client = core.client
            client.sync(
                client.scheduler.ddict_destroy,
                name=core.ref.name,
                uid=core.ref.uid,
                allow_restart=allow_restart,
            )
        finally:
            core.close_cluster()

    def __enter__(self) -> DDict:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._creator:
            self.destroy()
        else:
            self.detach()

    def __repr__(self) -> str:
        lay = self._core._layout
        state = (
            "closed"
            if self._core.closed
            else "detached"
            if self._detached
            else f"checkpoint={self._chkpt}"
        )
        target = f" manager={self._target}" if self._target is not None else ""
        if lay is None:  # unpickled, not used yet: no call to resolve it just for a repr
            return f"<DDict {self._core.name!r} {state}{target} (attaches on first use)>"
        hosts = len({m.host_id for m in lay.managers})
        return (
            f"<DDict {lay.name!r} managers={lay.num_managers} hosts={hosts} "
            f"total_mem={format_bytes(lay.total_mem)} {state}{target}>"
        )

    def get_name(self) -> str:
        return self._core.name

    # -- routing ----------------------------------------------------------------

    def which_manager(self, key: Any) -> int:
        """Id of the manager that holds ``key``."""
        return self._route(key)[0]

    # -- the dict protocol ----------------------------------------------------------

    def _put(self, key: Any, value: Any, persistent: bool, began: float | None = None) -> None:
        batch = self._batch
        if self._core.closed or self._detached:
            self._check()
        if batch is not None and batch.persist != persistent:
            raise DDictError(
                f"{'pput' if persistent else 'put'} inside a batch started with "
                f"persist={batch.persist}",
                "INVALID_OPERATION",
            )
        router, dumps = self._routed or self._routing()
        try:  # (routed and framed in one call: a batch's puts are the hot path)
            mid, digest, kb, framed = router.record(key, value, dumps)
        except kernels.KeyTooLong as e:
            raise self._too_long(e.args[0]) from None
        if self._target is not None:
            mid = self._target
        if batch is None:
            self._core.write(
                mid,
                Put(
                    digest,
                    kb,
                    self._fits(mid, kb, framed),
                    self._chkpt,
                    self._client_id,
                    persistent,
                    self._timeout,
                    began,
                ),
            )
            return
        try:
            batch.add(mid, digest, kb, self._fits(mid, kb, framed), self._chkpt)
        except DDictFullError as e:  # a value refused here is said at the batch's end
            batch.refused(e)

    def __setitem__(self, key: Any, value: Any) -> None:
        # (the lane's, lane.py: sent, or buffered in an open batch; else _put's)
        if self._batch is None:
            got = LANE.put(self, key, value, False)
        else:
            got = LANE.batch_put(self, key, value, False)
        if got is not None:
            self._put(key, value, False, None if got is NotImplemented else got.began)

    def pput(self, key: Any, value: Any) -> None:
        """Persistent put: survives retirement under ``wait_for_keys``."""
        if self._batch is None:
            got = LANE.put(self, key, value, True)
        else:
            got = LANE.batch_put(self, key, value, True)
        if got is not None:
            self._put(key, value, True, None if got is NotImplemented else got.began)

    def _get_range(self, key: Any, start: int, stop: int) -> tuple[int, Any]:
        """``(size, value[start:stop])`` of ``key``'s raw-bytes value, sliced where it
        lives: only the part crosses a socket (:class:`~..transport.ops.GetRange`, for
        :class:`~dask_ddict.DDictStore`'s byte ranges and sizes).  Raises
        ``DDictKeyError`` if absent, ``DDictSerializationError`` if not raw bytes."""
        mid, digest, _ = self._route(key)
        return self._core.channel(mid).call(
            GetRange(digest, self._chkpt, start, stop, self._timeout)
        )

    def _range_here(self, key: Any, start: int, stop: int) -> Any:
        """:meth:`_get_range` from an event loop, where the key's shard is read on this
        host through a channel made already: ``(size, part)``, ``None`` if absent, or
        ``NotImplemented`` (read it in a thread by :meth:`_get_range`; see
        :meth:`~dask_ddict.transport.shared.SharedChannel.range_here`)."""
        mid, digest, _ = self._route(key)
        ch = self._core.made(mid)
        if timing.on or ch is None or ch.kind != "shm":  # (timed: one operation, timed)
            return NotImplemented
        return ch.range_here(GetRange(digest, self._chkpt, start, stop, self._timeout))

    def __contains__(self, key: Any) -> bool:
        got = LANE.contains(self, key)  # (lane.py)
        if got is True or got is False:
            return got
        began = None if got is NotImplemented else got.began
        mid, digest, _ = self._route(key)
        return self._core.channel(mid).call(Contains(digest, self._chkpt, self._timeout, began))

    def pop(self, key: Any, default: Any = _MISSING) -> Any:
        """Remove ``key`` and return its value (``default`` if absent and given)."""
        got = LANE.pop(self, key)  # (the common case over TCP in one call: lane.py)
        if type(got) is tuple:  # (the value, in a tuple of one: whatever it is)
            return got[0]
        if got is NotImplemented or type(got) is kernels.Resend:
            began, rid = (None, 0) if got is NotImplemented else got  # (sent: its id again)
            mid, digest, _ = self._route(key)
            try:
                frame = self._core.channel(mid).call(
                    Pop(digest, self._chkpt, self._client_id, self._timeout, began, rid)
                )
            except DDictKeyError:
                pass  # (absent: as NO_KEY)
            else:
                return loads_value(frame, self._vp)
        if default is not _MISSING:  # (NO_KEY, or absent)
            return default
        raise DDictKeyError(key)

    def __delitem__(self, key: Any) -> None:
        self.pop(key)

    def _length(self, managers: builtins.list[int]) -> int:
        """Keys visible at this handle's checkpoint on ``managers``."""
        return sum(self._core.each(Length(self._chkpt, self._timeout), managers))

    def __len__(self) -> int:
        return self._length(self._managers())

    def clear(self) -> None:
        """Empty the client's current checkpoint on every manager (or the chosen one)."""
        self._core.each(Clear(self._chkpt, self._client_id, self._timeout), self._managers())

    def keys(self) -> DDictKeysView:
        return DDictKeysView(self, self._managers())

    def values(self) -> DDictValuesView:
        return DDictValuesView(self, self._managers())

    def items(self) -> DDictItemsView:
        return DDictItemsView(self, self._managers())

    def __iter__(self) -> Iterator[Any]:
        return iter(self.keys())

    def local_keys(self) -> DDictKeysView:
        return DDictKeysView(self, self._local_ids(), local=True)

    def local_values(self) -> DDictValuesView:
        return DDictValuesView(self, self._local_ids(), local=True)

    def local_items(self) -> DDictItemsView:
        return DDictItemsView(self, self._local_ids(), local=True)

    def local_len(self) -> int:
        return self._length(self._local_ids())

    def _local_ids(self) -> builtins.list[int]:
        self._check()
        local = set(self.local_managers)
        return [m for m in self._managers() if m in local]

    def setdefault(self, key: Any, default: Any = None) -> Any:
        """``self[key]`` if present, else put ``default`` and return it, in one atomic step."""
        self._no_batch("setdefault()")
        mid, digest, kb = self._route(key)
        op = SetDefault(
            digest, kb, self._framed(mid, kb, default), self._chkpt, self._client_id, self._timeout
        )
        return loads_value(self._core.write(mid, op), self._vp)

    def fetch_add(self, key: Any, n: int = _MISSING, *, val: int | None = None) -> int:
        """Atomically add ``n`` to the int at ``key`` and return its previous value.

        The previous value, not the new one, as C's ``atomic_fetch_add``: of
        processes that race on a counter with ``n=1``, each gets a distinct value
        (a ticket), and the new value is ``returned + n``.  An absent key
        starts at 0: the first ``d.fetch_add("c", 5)`` returns 0 and leaves 5.  The
        manager applies it once, also when it is retried across a host restart.

        Parameters
        ----------
        key
            The counter's key; its value must be an int.
        n
            What to add (a signed 64-bit int; negative subtracts); 1 if not given.
        val
            Dragon's name of ``n`` (``d.fetch_add(key, val=1)``); give one of them,
            not both (``TypeError``).

        Returns
        -------
        int
            The value before the addition (0 for an absent key).
        """
        if val is not None:  # (Dragon's name; ``n`` given too, even as 1, is ambiguous)
            if n is not _MISSING:
                raise TypeError(
                    "fetch_add() got both n= and val= (val is Dragon's name of n): give one of them"
                )
            n = check_int("val", val)
        else:
            n = 1 if n is _MISSING else check_int("n", n)
        got = LANE.fetch_add(self, key, n)  # (the common case over TCP in one call: lane.py)
        if got is not NotImplemented and type(got) is not kernels.Resend:
            return got
        began, rid = (None, 0) if got is NotImplemented else got  # (sent: its id again)
        mid, digest, kb = self._route(key)
        frame = self._core.write(
            mid, FetchAdd(digest, kb, self._chkpt, self._client_id, n, self._timeout, began, rid)
        )
        return loads_value(frame)

    def wait_for(self, key: Any, value: Any, timeout: float | None = _MISSING) -> None:
        """Block until ``self[key] == value`` (compared as serialized bytes).

        Raises :class:`~dask_ddict.DDictTimeoutError` naming the key when
        ``timeout`` runs out first: the manager only ever sees the key's
        digest, so its own message could not say which wait gave up.
        """
        timeout = self._timeout if timeout is _MISSING else check_timeout(timeout)
        mid, digest, _ = self._route(key)
        frame = dumps_value(value, self._vp).join()
        try:
            self._core.channel(mid).call(WaitFor(digest, self._chkpt, frame, timeout))
        except DDictTimeoutError as e:
            raise DDictTimeoutError(
                f"wait_for({key!r:.80}) at checkpoint {self._chkpt}: the key did not take "
                f"the value waited for within {timeout} s ({e.message})"
            ) from None

    def _iter(
        self, managers: builtins.list[int], want: int, lend: bool = False
    ) -> Iterator[tuple[Any, Any]]:
        """``(key, value)`` of ``managers`` (``None`` for what ``want`` leaves out);
        ``lend``: values of a same-host shard zero-copy, as ``get(copy=False)``."""
        page = config.get("iteration.page-items")
        lend = lend and self._vp is None
        self._check()
        firsts = first_pages(
            self._core.each,
            managers,
            self._chkpt,
            want,
            page,
            self._timeout,
            config.get_bytes("iteration.page-bytes"),
            lend,
        )
        for mid, (items, last, more) in zip(managers, firsts):
            if not (items or more):
                continue  # (an empty manager)
            self._check()
            rest = (
                iter_pages(
                    self._core.channel(mid), self._chkpt, want, page, last, self._timeout, lend
                )
                if more
                else ()
            )
            for k, v in itertools.chain(items, rest):
                yield (
                    None if k is None else loads_key(k, self._kp),
                    None if v is None else loads_value(v, self._vp),
                )

    # -- handles, locality, introspection --------------------------------------------

    def _derive(self) -> DDict:
        self._check()
        h = DDict._from_core(
            self._core,
            creator=False,
            chkpt=self._chkpt,
            timeout=self._timeout,
            client_id=self._client_id,
        )
        h._aim(self._target, self._kp, self._vp)
        h._derived = True
        return h

    def manager(self, manager_id: int) -> DDict:
        """A handle whose key operations, len, keys, clear and stats go to one manager."""
        self._check()
        n = self._core.layout.num_managers
        check_int("manager_id", manager_id)
        if not 0 <= manager_id < n:  # Dragon's error for a bad id
            raise DDictError(
                f"manager_id must be in [0, {n - 1}], got {manager_id}", "INVALID_ARGUMENT"
            )
        h = self._derive()
        h._aim(manager_id, h._kp, h._vp)
        return h

    def pickler(
        self, key_pickler: KeyPickler | None = None, value_pickler: ValuePickler | None = None
    ) -> DDict:
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
        h._aim(h._target, key_pickler, value_pickler)
        return h


#: The constructor's arguments, the client aside (``AsyncDDict.create`` takes the same).
CREATE_SIGNATURE = inspect.signature(DDict.__init__)
CREATE_ARGUMENTS = frozenset(CREATE_SIGNATURE.parameters) - {"self", "client"}


def _rebuild(
    ref: LayoutRef, chkpt: int, timeout: float | None, target: int | None, kp: Any, vp: Any
) -> DDict:
    """Unpickling a handle attaches (a task starts at the parent's checkpoint); nothing
    is sent here: the layout is resolved on the handle's first use."""
    h = DDict._from_core(HandleCore(ref), creator=False, chkpt=chkpt, timeout=timeout)
    h._aim(target, kp, vp)
    return h
