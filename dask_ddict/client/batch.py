"""Batch put: puts streamed to each manager without a reply per put.

Between :meth:`DDict.start_batch_put` and :meth:`DDict.end_batch_put`, puts
are buffered per manager and sent in chunks of ``ddict.batch.flush-bytes``;
the managers apply them as they arrive and keep the batch's state under its
id.  The end asks every manager how many puts it stored, so a batch cut by a
host restart is reported, never half-applied in silence.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from .. import config
from .._serialize import Framed
from ..errors import DDictError, DDictFullError
from ..transport import ops


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

    def __init__(self, persist: bool, channel: Callable[[int], Any], client_id: int,
                 named: Callable[[DDictFullError, int], DDictFullError] | None = None,
                 ) -> None:  # fmt: skip
        self.id = secrets.randbits(63)  # the managers keep this batch's state under it
        self.persist = persist
        self.flush_bytes = config.get_bytes("batch.flush-bytes")
        self.records: dict[int, list[tuple[bytes, bytes, Framed]]] = {}
        self.sizes: dict[int, int] = {}
        self.sent: dict[int, int] = {}  # puts sent per manager, checked at the end
        self.error: BaseException | None = None
        self._channel = channel
        self._client_id = client_id
        self._named = named
        self._chkpt = 0  # the handle's checkpoint at the latest put

    def __repr__(self) -> str:
        pending = sum(len(r) for r in self.records.values())
        return f"<BatchPut persist={self.persist} sent={sum(self.sent.values())} pending={pending}>"

    def add(self, mid: int, digest: bytes, kb: bytes, framed: Framed, chkpt: int) -> None:
        self._chkpt = chkpt
        own = framed.nbytes + len(kb) + 32
        if own >= self.flush_bytes and mid in self.records:
            self.flush(mid)  # a large value travels alone: the puts before it never wait on it
        self.records.setdefault(mid, []).append((digest, kb, framed))
        size = self.sizes[mid] = self.sizes.get(mid, 0) + own
        if size >= self.flush_bytes:
            self.flush(mid)

    def flush(self, mid: int) -> None:
        records = self.records.pop(mid, None)
        self.sizes.pop(mid, None)
        if not records:
            return
        self.sent[mid] = self.sent.get(mid, 0) + len(records)
        try:
            self._channel(mid).call(ops.BatchPut(records, self._chkpt, self._client_id,
                                                 self.persist, self.id))  # fmt: skip
        except DDictError as e:
            self._failed(e, mid)

    def __enter__(self) -> None:
        """``with batch:`` around a put: see :meth:`__exit__`."""

    def __exit__(self, kind: Any, error: Any, tb: Any) -> bool:
        """Keep a ``DDictFullError`` raised inside (a value the client refuses before
        sending) for :meth:`end`, as a manager's own refusal would be: a batch's errors
        surface at its end, and the puts around it go on.  (A class, not a generator
        context manager: it wraps every put of a batch.)"""
        if isinstance(error, DDictFullError):
            self.error = self.error or error
            return True
        return False

    def _failed(self, e: DDictError, mid: int) -> None:
        """Keep the batch's first error (a full shard's, naming its manager)."""
        if isinstance(e, DDictFullError) and self._named is not None:
            e = self._named(e, mid)
        self.error = self.error or e

    def end(self) -> None:
        """Send what is buffered, check every manager's count, raise the first error."""
        for mid in list(self.records):
            self.flush(mid)
        for mid in sorted(self.sent):
            try:
                stored = self._channel(mid).call(ops.BatchEnd(self._client_id, self.id))
            except DDictError as e:
                self._failed(e, mid)
                continue
            if stored != self.sent[mid] and self.error is None:
                self.error = DDictError(
                    f"batch put: manager {mid} stored {stored} of the {self.sent[mid]} puts "
                    "sent to it (its host process restarted during the batch); the "
                    "others may or may not have been applied: put them again",
                    "MANAGER_UNAVAILABLE",
                )
        if self.error is not None:
            raise self.error
