"""The changes of a write transaction: recorded on a primary, applied on its replicas.

A replicated manager (``DDict(..., replicas=k)``) ships every write it commits to
the host processes that keep its replicas before it answers.  What travels is
not the operation but its effect on the shard: the ``put``/``delete``/``drop``
calls that the transaction made on LMDB, in order (:class:`Recording` wraps
the transaction and notes them).  A replica applies them in one transaction of
its own (:func:`apply`), so it holds the same records as the primary (every
checkpoint's versions, counts, frozen and batch state, request ids, pending
persists: everything that is the manager, see :mod:`.moving`) whatever the
operation was, and no operation needs replicating code of its own.

Wire form of a change set: records ``[u8 code][u8 db][u32 key length][u64 value
length] key value``, one after the other.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import lmdb

from .._blocking import acquire, locked
from ..errors import DDictError, DDictFullError, DDictLeaseError

T = TypeVar("T")


class ShardStore(Protocol):
    """What a replicated write needs of its ``store.ShardStore`` (not imported: it imports
    this module)."""

    path: str
    env: lmdb.Environment
    _data: Any
    _index: Any
    _meta: Any
    shipping: Any
    fenced: str
    replicate: Callable[[list[Any], bool], None] | None
    on_commit: Callable[[], None] | None
    later: bool


PUT, DELETE, DROP = 1, 2, 3
_HEAD = struct.Struct("<BBIQ")

#: A recorded change: (code, database number, key, value).
Change = tuple[int, int, bytes, Any]


def databases(store: ShardStore) -> list[Any]:
    """The store's databases, by the number that names them on the wire."""
    return [store._data, store._index, store._meta]


def _number(dbs: dict[Any, int], db: Any) -> int:
    try:
        return dbs[db]
    except KeyError:
        raise DDictError(
            "a replicated write used a database the replicas do not know", "INTERNAL"
        ) from None


class _Cursor:
    """A cursor of a :class:`Recording`: its deletes are noted."""

    __slots__ = ("_cur", "_changes", "_db")

    def __init__(self, cur: lmdb.Cursor, changes: list[Change], db: int) -> None:
        self._cur, self._changes, self._db = cur, changes, db

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)

    def __iter__(self) -> Any:
        return iter(self._cur)

    def delete(self, dupdata: bool = False) -> bool:
        key = bytes(self._cur.key())
        done = self._cur.delete(dupdata)
        self._changes.append((DELETE, self._db, key, b""))
        return bool(done)

    def put(self, key: Any, value: Any, **kwargs: Any) -> bool:
        done = self._cur.put(key, value, **kwargs)
        if done:
            self._changes.append((PUT, self._db, bytes(key), bytes(value)))
        return bool(done)

    def replace(self, key: Any, value: Any) -> Any:
        old = self._cur.replace(key, value)
        self._changes.append((PUT, self._db, bytes(key), bytes(value)))
        return old

    def putmulti(self, *args: Any, **kwargs: Any) -> Any:
        raise DDictError(
            "a replicated write cannot putmulti (its puts would not be noted)", "INTERNAL"
        )

    pop = putmulti  # (nor pop: every write of a cursor is noted, or refused)


class Recording:
    """A write transaction that notes its changes in :attr:`changes` (reads pass through)."""

    __slots__ = ("_txn", "_dbs", "changes", "get", "id")

    def __init__(self, txn: lmdb.Transaction, dbs: list[Any]) -> None:
        self._txn, self._dbs = txn, {db: i for i, db in enumerate(dbs)}
        self.changes: list[Change] = []
        self.get, self.id = txn.get, txn.id  # (the reads of every write: no indirection)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)

    def put(self, key: Any, value: Any, *, db: Any = None, **kwargs: Any) -> bool:
        done = self._txn.put(key, value, db=db, **kwargs)
        if done:
            v = value if type(value) is bytes else bytes(value)  # (a scratch buffer: copied)
            self.changes.append((PUT, _number(self._dbs, db), bytes(key), v))
        return bool(done)

    def delete(self, key: Any, value: Any = b"", *, db: Any = None) -> bool:
        done = self._txn.delete(key, value, db=db)
        if done:
            self.changes.append((DELETE, _number(self._dbs, db), bytes(key), b""))
        return bool(done)

    def drop(self, db: Any, delete: bool = True) -> None:
        if delete:
            raise DDictError("a replicated write cannot delete a database", "INTERNAL")
        self._txn.drop(db, delete=False)
        self.changes.append((DROP, _number(self._dbs, db), b"", b""))

    def cursor(self, db: Any = None) -> _Cursor:
        return _Cursor(self._txn.cursor(db), self.changes, _number(self._dbs, db))


def compact(changes: list[Change]) -> list[Change]:
    """``changes`` without those a later one of the same record makes moot (a key's count
    rewritten for every put of a batch travels once), in order: the same end state."""
    last: dict[tuple[int, bytes], int] = {}
    keep: list[Change | None] = list(changes)
    for i, (code, db, key, _) in enumerate(changes):
        if code == DROP:  # (everything of that database before it is gone)
            for (d, k), j in list(last.items()):
                if d == db:
                    keep[j] = None
                    del last[(d, k)]
            continue
        prior = last.get((db, key))
        if prior is not None:
            keep[prior] = None
        last[(db, key)] = i
    return [c for c in keep if c is not None]


def encode(changes: list[Change]) -> tuple[list[Any], int]:
    """The wire parts of ``changes`` (compacted) and their total length."""
    parts: list[Any] = []
    total = 0
    for code, db, key, value in compact(changes) if len(changes) > 2 else changes:
        n = len(value)
        parts += (_HEAD.pack(code, db, len(key), n), key, value)
        total += _HEAD.size + len(key) + n
    return parts, total


def apply(store: ShardStore, txn: lmdb.Transaction, payload: Any) -> int:
    """Apply the change set ``payload`` (from :func:`encode`) in ``txn``; how many changes."""
    view = memoryview(payload).cast("B")
    dbs = databases(store)
    at, n, end = 0, 0, len(view)
    run: list[tuple[Any, Any]] = []  # consecutive puts into one database: one putmulti
    run_db = -1
    head, unpack = _HEAD.size, _HEAD.unpack_from
    try:
        while at < end:
            code, db, klen, vlen = unpack(view, at)
            at += head
            key = view[at : at + klen]
            at += klen
            if code == PUT and db == run_db:
                run.append((key, view[at : at + vlen]))
                at += vlen
                n += 1
                continue
            if run:
                txn.cursor(dbs[run_db]).putmulti(run)
                run, run_db = [], -1
            if code == PUT:
                run, run_db = [(key, view[at : at + vlen])], db
                at += vlen
            elif code == DELETE:
                txn.delete(key, db=dbs[db])
            elif code == DROP:
                txn.drop(dbs[db], delete=False)
            else:
                raise DDictError(f"unknown replicated change {code}", "INTERNAL")
            n += 1
        if run:
            txn.cursor(dbs[run_db]).putmulti(run)
    except lmdb.MapFullError as e:
        raise DDictFullError(
            f"replica {store.path} is full: it cannot take its primary's "
            "write (a replica's shard is as large as its primary's)"
        ) from e
    return n


class Hooked:
    """``with store.write() as txn``: commit, then the store's ``on_commit``; or abort."""

    __slots__ = ("txn", "hook")

    def __init__(self, txn: lmdb.Transaction, hook: Callable[[], None]) -> None:
        self.txn, self.hook = txn, hook

    def __enter__(self) -> lmdb.Transaction:
        return self.txn

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        if kind is None:
            self.txn.commit()
            self.hook()
        else:
            self.txn.abort()


class Shipped:
    """``with store.write() as txn`` on a replicated shard: the changes are recorded,
    committed, shipped (``store.replicate``) and then ``store.on_commit`` runs, all
    under the store's shipping lock, so the replicas apply the writes in the order of
    the primary's commits."""

    __slots__ = ("store", "txn", "rec")

    def __init__(self, store: ShardStore) -> None:
        self.store = store

    def __enter__(self) -> Recording:
        store = self.store
        acquire(store.shipping)  # (a host's event loop moves on rather than wait for it)
        if store.fenced:
            store.shipping.release()
            raise fenced(store)
        store.later = False
        try:
            self.txn = store.env.begin(write=True, buffers=True)
        except BaseException:
            store.shipping.release()
            raise
        self.rec = Recording(self.txn, databases(store))
        return self.rec

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        store = self.store
        try:
            if kind is not None:
                self.txn.abort()
                return
            self.txn.commit()
            ship(store, self.rec.changes)
        finally:
            store.shipping.release()


def fenced(store: ShardStore) -> DDictLeaseError:
    """The error of a write that found its shard's replicas in doubt (nothing written)."""
    return DDictLeaseError(f"shard {store.path} takes no write now: {store.fenced}")


def ship(store: ShardStore, changes: list[Change]) -> None:
    """After a commit: the changes to the replicas (waiting for them unless the write set
    ``store.later``), then the commit's own hook."""
    replicate = store.replicate
    if changes and replicate is not None:
        replicate(changes, store.later)
    if store.on_commit is not None:
        store.on_commit()


def transact(store: ShardStore, fn: Callable[[Any], T], run: Callable[..., Any]) -> T:
    """``store.transact(fn)`` on a replicated shard: ``run`` (the store's own
    transaction runner) with a recording transaction, then the changes shipped, all
    under the store's shipping lock."""
    with locked(store.shipping):  # (a host's event loop moves on rather than wait for it)
        if store.fenced:
            raise fenced(store)
        store.later = False
        rec: list[Recording] = []

        def recorded(txn: lmdb.Transaction) -> T:
            r = Recording(txn, databases(store))
            rec.append(r)
            return fn(r)

        result: T = run(recorded, hook=False)
        ship(store, rec[-1].changes if rec else [])
        return result
