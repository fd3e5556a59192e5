"""Reads of a handle: one key, many keys per round trip, copied or zero-copy
(a base of :class:`~dask_ddict.DDict`).

``d[k]`` and ``d.get(k)`` read one key; ``d.get_many(keys)`` reads many with
one request per host process (:mod:`~dask_ddict.transport.many_key_reads`), and reads
the shards of managers on this host directly.  ``copy=False`` lends the
shard's pages on the manager's host (:mod:`~dask_ddict.transport.lending`):
numpy arrays come back as read-only views that never change.
"""

from __future__ import annotations

import builtins
import functools
from collections.abc import Callable, Iterable
from typing import Any

from .. import kernels
from .._serialize import loads_value
from ..arguments import check_bool, check_keys
from ..errors import DDictKeyError, DDictTimeoutError
from ..kernels import NO_KEY, Resend
from ..transport.ops import Get
from .base import HandleBase
from .core import MISSING
from .lane import LANE

_MISSING = MISSING
#: What :meth:`Reads._many` gives for an absent key, and for one whose reader must wait.
ABSENT: Any = object()
WAIT: Any = object()


class Reads(HandleBase):
    """``d[k]``, :meth:`get` and :meth:`get_many` of a handle."""

    def __getitem__(self, key: Any) -> Any:
        got = LANE.get(self, key)  # (the common case over TCP in one call: lane.py)
        if got is NotImplemented:
            return self._get(key, None)
        if got is NO_KEY:
            raise DDictKeyError(key)
        if type(got) is Resend:  # (sent, and to be sent again within its deadline)
            return self._get(key, None, got.began)
        return got

    def _get(self, key: Any, lend: bool | None, began: float | None = None) -> Any:
        mid, digest, _ = self._route(key)
        try:
            frame = self._core.channel(mid).call(
                Get(digest, self._chkpt, self._timeout, lend and self._vp is None, began)
            )
        except DDictKeyError:
            raise DDictKeyError(key) from None
        except DDictTimeoutError as e:
            raise self._no_writer(key, e) from None
        vp = self._vp  # (without a value pickler: the compiled kernels decode common frames)
        return kernels.decoded(frame, loads_value) if vp is None else loads_value(frame, vp)

    def _no_writer(self, key: Any, e: DDictTimeoutError) -> DDictTimeoutError:
        """A read's timeout, saying why under ``wait_for_keys``."""
        if not self._core.layout.options.wait_for_keys:
            return e
        return DDictTimeoutError(
            f"reading {key!r:.80} at checkpoint {self._chkpt}: no writer put it there "
            f"within {self._timeout} s (wait_for_keys=True: a non-persistent key is "
            f"visible only once written at the reader's checkpoint; {e.message})"
        )

    def get(self, key: Any, default: Any = None, copy: bool | None = None) -> Any:
        """``self[key]`` if present, else ``default``.

        ``copy=False``: on the manager's host, numpy arrays and other out-of-band
        buffers of the value are read-only views of the shard's pages, with no
        copy; they never change and stay valid whatever happens to the key or the
        dictionary later (see "Zero-copy reads" in the docs).  ``None`` (and
        ``d[key]``): zero-copy only when the dictionary is frozen, as in Dragon.
        Over TCP the received buffer is the value's either way.
        """
        lend = None if copy is None else not check_bool("copy", copy)
        got = LANE.get(self, key)  # (over TCP the received buffer is the value's either way)
        if got is NotImplemented or type(got) is Resend:
            try:
                return self._get(key, lend, None if got is NotImplemented else got.began)
            except DDictKeyError:
                return default
        return default if got is NO_KEY else got

    def get_many(
        self, keys: Iterable[Any], default: Any = _MISSING, copy: bool | None = True
    ) -> builtins.list[Any]:
        """The values of ``keys``, in their order, with one request per host.

        Keys are grouped by manager; each host process reads its managers' keys
        in one pass, and managers on this host are read from their shards
        directly.  A missing key gives ``default``, or, with no default, raises
        :class:`DDictKeyError` naming it.  ``copy=False``: values read on the
        manager's host are zero-copy views, as with :meth:`get` (``None``: only
        a frozen dictionary's).  Under ``wait_for_keys``, a key not yet written
        at this checkpoint is waited for as :meth:`get` waits.
        """
        keys = list(check_keys("keys", keys))
        found = LANE.get_many(self, keys, ABSENT) if copy is True else NotImplemented
        began = None
        if type(found) is Resend:  # (sent, and to be read again within its deadline)
            began, found = found.began, NotImplemented
        if found is NotImplemented:  # (the common case over TCP in one call: lane.py)
            routes = self._routes(keys)
            if self._vp is None:  # (every shard mapped here: read in place)
                found = self._core.read_here(routes, self._chkpt, ABSENT, self._lending(copy))
            if found is NotImplemented:
                decode, small = self._decoder(None)  # (values in key order, no pairs)
                got = self._fetched(routes, copy, None, began)
                found = kernels.decode_values(routes, got, decode, ABSENT, WAIT, small)
        out, marked = found
        for i in marked:
            key, got = keys[i], out[i]
            if got is WAIT:  # (wait_for_keys: not written at this checkpoint yet) waits alone
                try:
                    got = self._get(key, None if copy is None else not copy)
                except DDictKeyError:
                    got = ABSENT
            if got is ABSENT:
                if default is _MISSING:
                    raise DDictKeyError(key)
                got = default
            out[i] = got
        return out

    def _many(
        self,
        keys: Iterable[Any],
        copy: bool | None,
        routes: builtins.list[tuple[int, bytes]] | None = None,
        decode: Callable[[Any], Any] | None = None,
    ) -> builtins.list[tuple[Any, Any]]:
        """``(key, value)`` for each key: the value, :data:`ABSENT`, or :data:`WAIT`
        (a reader of it must wait for a writer: :meth:`_get` it alone).  ``routes``:
        the keys' ``(manager, digest)`` when the caller has them already; ``decode``:
        what turns a frame into the value (default: :func:`loads_value`, or the
        handle's value pickler), e.g. :func:`~dask_ddict._serialize.bytes_view`."""
        keys = list(keys)
        routes = self._routes(keys) if routes is None else routes
        return self._decoded(keys, routes, self._fetched(routes, copy, decode), decode)

    def _fetched(
        self,
        routes: builtins.list[tuple[int, bytes]],
        copy: bool | None,
        decode: Callable[[Any], Any] | None,
        began: float | None = None,
    ) -> dict[int, builtins.list[Any]]:
        """The answers for the keys of ``routes`` by manager, one request per host: frames,
        or (read on this host, to be decoded by the frames' own decoder, ``decode``
        ``None``) values decoded in the shard's snapshot.  ``began``: when the operation's
        time began, if before (see :class:`~dask_ddict.kernels.Resend`)."""
        lend, groups = self._many_request(copy, routes)
        if not groups:
            return {}
        own = self._decoder(decode)[1]  # (the frames' own decoder: decodable where read)
        absent = ABSENT if lend is False and own else None
        return self._core.get_many(
            groups, self._chkpt, self._timeout, lend, absent=absent, began=began
        )

    async def _many_async(
        self,
        keys: builtins.list[Any],
        routes: builtins.list[tuple[int, bytes]],
        copy: bool | None,
        decode: Callable[[Any], Any] | None = None,
    ) -> builtins.list[tuple[Any, Any]]:
        """:meth:`_many` from an event loop (:class:`~dask_ddict.AsyncDDict`'s gets):
        pipelined where it can be (:meth:`~dask_ddict.transport.channels.Channels.
        get_many_async`), never blocking the loop.  Keys whose shards are all mapped here
        are read on the loop itself (:meth:`~dask_ddict.transport.channels.Channels.
        read_here`, channels made already: a snapshot's read of small values takes
        microseconds, a worker thread's round trip tens of them; nothing there waits)."""
        lend, groups = self._many_request(copy, routes)
        if decode is None and self._vp is None and not lend:
            found = self._core.read_here(routes, self._chkpt, ABSENT, lend, made=True)
            if found is not NotImplemented:
                return list(zip(keys, found[0]))
        got = await self._core.get_many_async(groups, self._chkpt, self._timeout, lend)
        return self._decoded(keys, routes, got, decode)

    def _many_request(
        self, copy: bool | None, routes: builtins.list[tuple[int, bytes]]
    ) -> tuple[bool | None, dict[int, builtins.list[bytes]]]:
        """What to lend (see :meth:`get`), and the digests to read, by manager."""
        return self._lending(copy), kernels.group(routes)

    def _lending(self, copy: bool | None) -> bool | None:
        """What a read with ``copy`` lends (see :meth:`get`): never with a value pickler
        of the handle's own, whose values are not pickle-5 frames."""
        lend = None if copy is None else not check_bool("copy", copy)
        return False if self._vp is not None else lend

    def _decoded(
        self,
        keys: builtins.list[Any],
        routes: builtins.list[tuple[int, bytes]],
        got: dict[int, builtins.list[Any]],
        decode: Callable[[Any], Any] | None,
    ) -> builtins.list[tuple[Any, Any]]:
        """``(key, value)`` pairs of :meth:`_many` from the frames ``got`` by manager."""
        decoder, small = self._decoder(decode)
        return kernels.decode_frames(keys, routes, got, decoder, ABSENT, WAIT, small)

    def _decoder(self, decode: Callable[[Any], Any] | None) -> tuple[Callable[[Any], Any], bool]:
        """What turns a frame into a value (``decode``, or by default :func:`loads_value`
        with the handle's value pickler), and whether it is the value frames' own decoder
        (which the compiled kernels inline)."""
        vp = self._vp
        if decode is not None:
            return decode, False
        if vp is None:
            return loads_value, True
        return functools.partial(loads_value, pickler=vp), False
