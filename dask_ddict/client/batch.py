"""Batch put: puts streamed to each host without a reply per put.

Between :meth:`DDict.start_batch_put` and :meth:`DDict.end_batch_put`, puts
are buffered per host process (the managers it serves share one buffer)
and sent in chunks of ``ddict.batch.flush-bytes``: one request per host per
chunk, whatever the number of its managers.  The host applies each
manager's records in one transaction and keeps the batch's state under its
id.  On the manager's host, in-window records are committed by the client
itself, in one LMDB transaction per shard and chunk (as a single small put
is, see :mod:`~dask_ddict.transport.shared`), by the compiled kernels' commit
thread while the next chunk is routed and framed where it can
(``ddict.batch.commit-behind``); only what it may not commit goes to the
manager, after what was committed.  The end asks every manager that received
records how many it stored, so a batch cut by a host restart is reported, never
half-applied in silence.  A manager that moved during the batch stored a prefix
of its records where it was (its old host stores none after the move, and keeps
the connection for the others'): the rest are sent again where it went.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from .. import config
from .._serialize import Framed
from ..errors import (
    DDictError,
    DDictFullError,
    DDictManagerMovedError,
    DDictManagerUnavailableError,
)
from ..transport import ops

Record = tuple[bytes, bytes, Framed]  # (digest, key, frame)


#: A record's bytes in a request beyond its key and value (its framing).
RECORD_FRAMING = 32


def _cost(kb: bytes, framed: Framed) -> int:
    """A record's bytes in a request (its key, its value and their framing)."""
    return framed.nbytes + len(kb) + RECORD_FRAMING


def _costs(records: list[Record]) -> int:
    return sum(_cost(r[1], r[2]) for r in records)


class BatchPut:
    """One open batch of a handle: client-side buffers, one list of records per manager.

    Parameters
    ----------
    persist
        Whether the batch's puts are persistent (``pput``).
    channel
        The channel of a manager, by id.
    client_id
        The handle's client id (the managers' writer bookkeeping).
    named
        Makes a manager's ``DDictFullError`` name the dictionary and the manager.
    """

    def __init__(
        self,
        persist: bool,
        channel: Callable[[int], Any],
        client_id: int,
        named: Callable[[DDictFullError, int], DDictFullError] | None = None,
    ) -> None:
        self.id = secrets.randbits(63)  # the managers keep this batch's state under it
        self.persist = persist
        self.flush_bytes = config.get_bytes("batch.flush-bytes")
        self.records: dict[int, list[Record]] = {}
        self.sizes: dict[Any, int] = {}  # bytes buffered per route (a host link, or a shard)
        self.sent: dict[int, int] = {}  # puts sent per manager, checked at the end
        self.error: BaseException | None = None
        self._failed_mids: set[int] = set()  # (a manager's first error ends its batch)
        # Managers that were sent records of this batch: their later records go to them
        # too, never committed here, so that none overtakes one still in flight.
        self._managed: set[int] = set()
        self._routes: dict[int, Any] = {}
        self._channel = channel
        self._client_id = client_id
        self._named = named
        self._chkpt = 0  # the handle's checkpoint at the latest put
        # Records sent to each manager's host, in order, while they fit in
        # ``ddict.batch.resend-bytes``: a manager that moves during the batch stores a
        # prefix of them where it was, and the rest are sent again where it went.
        self._kept: dict[int, list[Record]] | None = {}
        self._kept_bytes = 0
        self._sent_via: dict[int, Any] = {}  # the link that took each manager's latest records
        # A same-host shard's latest flush, committed behind the batch (by manager): its
        # outcome is taken before anything more of that manager is committed or sent.
        self._behind: dict[int, Any] = {}
        # Managers whose host was found gone while a message of this batch went to it:
        # their later records are held, not sent, so that the end sends them again where
        # they went after the ones that host never stored, in their order.
        self._moved: set[int] = set()
        self._resend_bytes = config.get_bytes("batch.resend-bytes")

    def __repr__(self) -> str:
        pending = sum(len(r) for r in self.records.values())
        return f"<BatchPut persist={self.persist} sent={sum(self.sent.values())} pending={pending}>"

    def _route(self, mid: int) -> Any:
        """What ``mid``'s records travel with: its shard (committed here), or its host."""
        route = self._routes.get(mid)
        if route is None:
            ch = self._channel(mid)
            route = self._routes[mid] = ("shard", mid) if ch.kind == "shm" else ch.link
        return route

    def add(self, mid: int, digest: bytes, kb: bytes, framed: Framed, chkpt: int) -> None:
        self._chkpt = chkpt
        route = self._routes.get(mid) or self._route(mid)
        own = _cost(kb, framed)
        if own >= self.flush_bytes and self.sizes.get(route):
            self.flush(route)  # a large value travels alone: the puts before it never wait on it
        records = self.records.get(mid)
        if records is None:
            records = self.records[mid] = []
        records.append((digest, kb, framed))
        size = self.sizes[route] = self.sizes.get(route, 0) + own
        if size >= self.flush_bytes:
            self.flush(route)

    def flush(self, route: Any) -> None:
        """Send (or commit) what is buffered for ``route``."""
        size = self.sizes.pop(route, 0)
        mids = [m for m in self.records if self._routes.get(m) == route]
        if isinstance(route, tuple):  # a shard on this host: commit what may be
            if not mids:
                return
            mid = mids[0]
            records = self._direct(mid, self.records.pop(mid))
            if records:
                self._send(self._channel(mid).link, {mid: records}, _costs(records))
            return
        for m in [m for m in mids if m in self._moved]:
            self._hold(m, self.records.pop(m))
        mids = [m for m in mids if m in self.records]
        left = {m: self._left_behind(m) for m in mids if m in self._behind}  # (before any pop)
        by_mid = {m: left.get(m, []) + self.records.pop(m) for m in mids}
        if by_mid:
            self._send(route, by_mid, size + sum(_costs(rs) for rs in left.values()))

    def _direct(self, mid: int, records: list[Record]) -> list[Record]:
        """Commit ``records`` into ``mid``'s shard here (or queue their commit behind the
        batch); the ones left are the manager's, after those its last commit left."""
        left = self._left_behind(mid)
        if mid in self._failed_mids:
            return []
        if mid in self._moved:  # (moved here while its records were sent: held, see _hold)
            self._hold(mid, left + records)
            return []
        if mid in self._managed:
            return left + records
        ch = self._channel(mid)
        try:
            behind = ch.put_batch_behind(records, self._chkpt)
            if behind is None:
                return self._committed(mid, records, *ch.put_batch(records, self._chkpt))
        except BaseException as e:
            self._broke(mid, e)
            raise
        self._behind[mid] = behind
        return []

    def _committed(
        self, mid: int, records: list[Record], done: int, error: DDictError | None
    ) -> list[Record]:
        """What ``put_batch`` said of ``records``: those left, the manager's (none after
        an error, which the batch keeps)."""
        if error is not None:
            self._failed_mids.add(mid)
            self._failed(error, mid)
            return []
        if done < len(records):
            self._managed.add(mid)
        return records[done:]

    def _left_behind(self, mid: int) -> list[Record]:
        """The records of ``mid``'s commit behind the batch (if one is out) that it left
        to the manager, once it is done."""
        behind = self._behind.pop(mid, None)
        if behind is None:
            return []
        try:
            return self._committed(mid, behind.records, *behind.collect())
        except BaseException as e:
            self._broke(mid, e)
            raise

    def _hold(self, mid: int, records: list[Record]) -> None:
        """Keep ``records`` of ``mid``, a manager that moved while the batch's records went
        to it, for the end to send after the ones its old host never stored (as if sent:
        :meth:`_resend` sends everything kept from the count where it went)."""
        if not records:
            return
        self.sent[mid] = self.sent.get(mid, 0) + len(records)
        self._keep({mid: records}, _costs(records))

    def _broke(self, mid: int, e: BaseException) -> None:
        """A commit of ``mid``'s records raised ``e`` (its host gone, ...): none of them
        is known stored, so the batch fails, and nothing more of it goes to ``mid``."""
        self._failed_mids.add(mid)
        if not isinstance(e, Exception):  # (an interrupt: the batch is still not whole)
            e = DDictError(f"batch put: manager {mid}'s puts were interrupted ({e!r})")
        self.error = self.error or e

    def _send(self, link: Any, by_mid: dict[int, list[Record]], keep: int | None = None) -> None:
        """One request to ``link``'s host with the records of its managers (``keep``: their
        buffered bytes, kept for a resend; ``None``: a resend, of records kept already)."""
        by_mid = {mid: rs for mid, rs in by_mid.items() if mid not in self._failed_mids}
        records = [(mid, *r) for mid, rs in by_mid.items() for r in rs]
        if not records:
            return
        for mid, rs in by_mid.items():
            self.sent[mid] = self.sent.get(mid, 0) + len(rs)
            self._sent_via[mid] = link
        if keep is not None:
            self._keep(by_mid, keep)
        first = records[0][0]
        try:
            try:
                link.call(
                    ops.BatchPut(records, self._chkpt, self._client_id, self.persist, self.id),
                    first,
                )
            except DDictError as broke:  # (a replicated manager's host lost: its replica
                raise self._taken_over(link, first, broke) from None  # takes over)
        except DDictManagerMovedError as e:
            # Its host is gone and its managers moved (a retired worker, a replica that
            # took over from a lost host): this message is sent again where they went, at
            # the end (kept), and the next ones too (held until then, see _hold).
            for mid in by_mid:
                self._routes.pop(mid, None)
            try:
                if self._kept is None:
                    raise e
                link.follow(first, None)
                self._moved.update(by_mid)
            except DDictError as gone:
                self._failed(gone, first)
        except DDictError as e:
            self._failed(e, first)

    def _taken_over(self, link: Any, mid: int, e: DDictError) -> DDictError:
        """``e``, or ``MOVED`` when the connection to a replicated manager's host broke
        and a replica took over from it (asked of the orchestrator, see
        ``HandleCore.explain``): a batch's records are not answered one by one, so a broken
        connection is all it sees of a lost host."""
        if (
            type(e) is not DDictError
            or e.code != "MANAGER_UNAVAILABLE"
            or self._kept is None
            or link.explain is None
        ):
            return e
        return link.explain(mid, DDictManagerUnavailableError(e.message), link.info.address)

    def _keep(self, by_mid: dict[int, list[Record]], nbytes: int) -> None:
        if self._kept is None:
            return
        self._kept_bytes += nbytes
        if self._kept_bytes > self._resend_bytes:
            self._kept = None  # (too much to hold: a move during the batch is reported)
            return
        for mid, rs in by_mid.items():
            self._kept.setdefault(mid, []).extend(rs)

    def _resend(self, mid: int, stored: int) -> int:
        """Send manager ``mid``'s records that it did not store again, if it moved since
        they were sent (it stored a prefix of them where it was); its new count."""
        kept = None if self._kept is None else self._kept.get(mid)
        if kept is None or len(kept) != self.sent[mid] or not 0 <= stored < len(kept):
            return stored
        link = self._channel(mid).link  # (the channel follows the move: see BatchEnd)
        if link is None or link is self._sent_via.get(mid):
            return stored  # (not moved: something else cut the batch)
        self.sent[mid] = stored
        chunk: list[Record] = []
        size = 0
        for r in kept[stored:]:  # (in messages of flush-bytes, as they were sent)
            chunk.append(r)
            size += _cost(r[1], r[2])
            if size >= self.flush_bytes:
                self._send(link, {mid: chunk})
                chunk, size = [], 0
        if chunk:
            self._send(link, {mid: chunk})
        # (its count restarted at the first end: what it stores now comes on top)
        return stored + int(self._channel(mid).call(ops.BatchEnd(self._client_id, self.id)))

    def __enter__(self) -> None:
        """``with batch:`` around a put: see :meth:`__exit__`."""

    def __exit__(self, kind: Any, error: Any, tb: Any) -> bool:
        """Keep a ``DDictFullError`` raised inside (a value the client refuses before
        sending) for :meth:`end`, as a manager's own refusal would be: a batch's errors
        surface at its end, and the puts around it go on.  (A class, not a generator
        context manager: it wraps every put of a batch.)"""
        if isinstance(error, DDictFullError):
            self.refused(error)
            return True
        return False

    def add_kept(self, mid: int, digest: bytes, kb: bytes, framed: Framed, chkpt: int) -> None:
        """:meth:`add`, a value refused meanwhile kept for :meth:`end`, as :meth:`add`'s
        caller keeps it (the key lane's, for a record it does not buffer itself)."""
        try:
            self.add(mid, digest, kb, framed, chkpt)
        except DDictFullError as e:
            self.refused(e)

    def filled(self, route: Any) -> None:
        """``route``'s buffer reached ``flush_bytes`` (a record the key lane added): sent, a
        value refused meanwhile kept for :meth:`end`, as :meth:`add`'s caller keeps it."""
        try:
            self.flush(route)
        except DDictFullError as e:
            self.refused(e)

    def refused(self, e: DDictFullError) -> None:
        """Keep ``e``, a value this client refused before sending it, for :meth:`end`."""
        self.error = self.error or e

    def _failed(self, e: DDictError, mid: int) -> None:
        """Keep the batch's first error (a full shard's, naming its manager)."""
        if isinstance(e, DDictFullError) and self._named is not None:
            e = self._named(e, mid)
        self.error = self.error or e

    def flush_all(self) -> None:
        """Send (or commit) everything buffered, and wait for the commits behind it: all
        of them, whatever the flushes raised."""
        try:
            for route in {self._route(m) for m in self.records}:
                self.flush(route)
        except BaseException:
            self._settle_behind(quiet=True)
            raise
        self._settle_behind()

    def _settle_behind(self, quiet: bool = False) -> None:
        """Wait for every commit behind the batch and send what each left to its manager;
        the first error raised once all are done (``quiet``: none, another is on its
        way)."""
        first: BaseException | None = None
        for mid in list(self._behind):
            try:
                left = self._left_behind(mid)
                if left:
                    self._send(self._channel(mid).link, {mid: left}, _costs(left))
            except BaseException as e:  # noqa: BLE001 - raised once the others are done
                first = first or e
        if first is not None and not quiet:
            raise first

    def end(self) -> None:
        """Send what is buffered, check every manager's count, raise the first error."""
        self.flush_all()
        for mid in sorted(self.sent):
            try:
                stored = self._channel(mid).call(ops.BatchEnd(self._client_id, self.id))
            except DDictError as e:
                self._failed(e, mid)
                continue
            if stored < self.sent[mid]:
                try:
                    stored = self._resend(mid, stored)
                except DDictError as e:
                    self._failed(e, mid)
                    continue
            if stored != self.sent[mid] and self.error is None:
                self.error = DDictManagerUnavailableError(
                    f"batch put: manager {mid} stored {stored} of the {self.sent[mid]} puts "
                    "sent to it (its host process restarted during the batch, or its "
                    "lease lapsed meanwhile: a replicated manager's host that could not "
                    "reach the orchestrator stored none); the others may or may not have "
                    "been applied: put them again"
                )
        if self.error is not None:
            raise self.error
