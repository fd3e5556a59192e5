"""Batch puts and broadcasts: many pairs in one stream, one pair on every manager,
and freezing every manager (a base of :class:`~dask_ddict.DDict`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._hashing import key_digest
from .._keys import dumps_key
from .._serialize import Framed, KeyPickler, ValuePickler, loads_value
from ..arguments import check_bool
from ..errors import DDictError, DDictKeyError
from ..transport.ops import Freeze, Get, Put, Unfreeze
from .batch import BatchPut

if TYPE_CHECKING:
    from ..stats import DDictManagerStats
    from .core import _Core


class Bulk:
    """Batch puts, ``bput``/``bget`` and ``freeze`` of a handle."""

    _core: _Core
    _chkpt: int
    _timeout: float | None
    _client_id: int
    _target: int | None
    _kp: KeyPickler | None
    _vp: ValuePickler | None
    _batch: BatchPut | None

    if TYPE_CHECKING:  # provided by the handle

        def _check(self) -> None: ...
        def _no_batch(self, what: str) -> None: ...
        def _managers(self) -> list[int]: ...
        def _framed(self, mid: int | None, kb: bytes, value: Any) -> Framed: ...
        @property
        def main_manager(self) -> int: ...
        @property
        def stats(self) -> list[DDictManagerStats]: ...

    def start_batch_put(self, persist: bool = False) -> None:
        """Stream the following puts without per-put replies (until :meth:`end_batch_put`)."""
        self._check()
        self._no_batch("start_batch_put()")
        self._batch = BatchPut(check_bool("persist", persist), self._core.channel,
                               self._client_id, self._core.full)  # fmt: skip

    def end_batch_put(self) -> None:
        """Send what is buffered and raise the first error any manager saw."""
        b = self._batch
        if b is None:
            raise DDictError("end_batch_put() without start_batch_put()", "INVALID_OPERATION")
        self._batch = None
        b.end()

    def bput(self, key: Any, value: Any) -> None:
        """Store a copy of the pair on every manager (read it with :meth:`bget`)."""
        if self._batch is not None and self._batch.persist:
            raise DDictError("bput inside a persistent batch", "INVALID_OPERATION")
        self._check()
        kb = dumps_key(key, self._kp)
        digest = key_digest(kb)
        every = list(range(self._core.layout.num_managers))
        if self._batch is not None:
            with self._batch:
                framed = self._framed(None, kb, value)
                for mid in every:
                    self._batch.add(mid, digest, kb, framed, self._chkpt)
        else:  # one request per host process, all hosts at once
            self._core.each(Put(digest, kb, self._framed(None, kb, value), self._chkpt,
                                self._client_id, False, self._timeout), every)  # fmt: skip

    def bget(self, key: Any) -> Any:
        """Read a broadcast value from this handle's main manager."""
        self._check()
        kb = dumps_key(key, self._kp)
        mid = self._target if self._target is not None else self.main_manager
        try:
            frame = self._core.channel(mid).call(Get(key_digest(kb), self._chkpt, self._timeout))
        except DDictKeyError:
            raise DDictKeyError(key) from None
        return loads_value(frame, self._vp)

    def freeze(self) -> None:
        """Make every manager read-only: writes raise ``DDictError`` (INVALID_OPERATION)."""
        self._core.each(Freeze(), self._managers())

    def unfreeze(self) -> None:
        self._core.each(Unfreeze(), self._managers())

    @property
    def is_frozen(self) -> bool:
        return all(s.frozen for s in self.stats)
