"""A broadcast served by its host process: the operation on each of its managers, and
the answers the host keeps.

A :class:`~dask_ddict.transport.ops.FanOut` runs one operation on several managers of
this host process and answers every manager's ``(mid, status, ival, payload)`` in one
reply; a tree broadcast's host serves its own managers the same way (:mod:`.forward`).
An operation that only computes an answer (:class:`~dask_ddict.transport.operation.Answered`:
``len``, ``stats``, ``clear``) is answered by each manager directly; any other is
dispatched to each as a plain request would be.

**Kept answers.**  The answer of a read-only broadcast (an operation marked
``cacheable``: ``len``, ``stats``, the newest checkpoint, first pages) is kept with
the managers' generation words (:mod:`~dask_ddict.shard.generations`), read before any
manager answers.  Every commit to a shard, its manager's or a same-host client's direct
put, changes the manager's word before the write is acknowledged, so an answer kept
under words that are still current misses nothing acknowledged: a repeated broadcast
on an unchanged dictionary is one comparison.  An answer that reports pinned memory
(``stats``) is kept under what else it reports and no commit here changes too (``pins``:
``HostedDict.changes``, the host's pin boards, requests served, replica sets, deferred
operations and the checkpoints persisted by every manager).  A
word 0 (a manager not hosted here) keeps nothing.  A dictionary's answers are kept in
its ``HostedDict.answers``, at most :data:`ANSWERS_KEPT` of them, each at most
:data:`ANSWER_KEEP_BYTES`.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..errors import wire_error
from ..transport.operation import Answerer, Reply, Request
from ..transport.ops import unpack_fan_out
from ..transport.protocol import Op
from ..transport.table import ANSWERERS, OPERATIONS

if TYPE_CHECKING:
    from ..shard.generations import Generations
    from ..shard.manager import Manager

#: A host keeps at most this many broadcast answers per dictionary, each at most this big.
ANSWERS_KEPT, ANSWER_KEEP_BYTES = 16, 256 << 10

_new_request = tuple.__new__  # a Request from its fields, without NamedTuple's checks


def serve(
    dispatch: Callable[[Request, Reply], None],
    r: Request,
    reply: Reply,
    managers: Mapping[int, Manager] | None = None,
    generations: Generations | None = None,
    answers: dict[Any, Any] | None = None,
    answerers: Mapping[int, Answerer] | None = None,
    pins: Callable[[], int] | None = None,
) -> None:
    """Serve the broadcast ``r``: its inner operation on each of its managers.

    ``dispatch(request, reply)`` serves one manager's part as a plain request would;
    ``managers`` (the host's) lets an ``Answered`` one be answered directly (through the
    host's ``answerers``, :data:`~dask_ddict.transport.table.ANSWERERS` unless given);
    a ``cacheable`` one is answered from ``answers`` while the managers' ``generations``
    words are those it was computed under (and, for an answer that reports pinned
    memory, ``pins()`` too: see the module's doc).
    """
    keysec = r.digest + r.key
    arg, mids, rest = unpack_fan_out(keysec)
    # The inner request, built once; only its manager changes (field 2).
    fields = list(r._replace(op=r.arg, arg=arg, digest=rest[:16], key=rest[16:]))
    code = cast(Op, r.arg)  # (IntEnum keys: a plain int finds them)
    words, key = None, None
    if generations is not None and answers is not None:
        words = _words(code, mids, generations, pins)
        if words is not None:
            key = (r.arg, r.chkpt, r.flags, r.client, r.timeout, keysec)
            kept = answers.get(key)
            if kept is not None and np.array_equal(kept[0], words):
                reply(0, kept[1])
                return
    direct = None if managers is None else (answerers or ANSWERERS).get(code)
    payload = pickle.dumps(_each(dispatch, fields, mids, managers, direct))
    if words is not None and answers is not None:
        _keep(answers, key, words, payload)
    reply(0, payload)


def _words(
    code: Op, mids: tuple[int, ...], generations: Generations, pins: Callable[[], int] | None
) -> np.ndarray[Any, Any] | None:
    """What an answer of operation ``code`` on ``mids`` is kept under: their generation
    words (a copy, read before any manager answers), and the pins' word for one that
    reports pinned memory; ``None``: an operation whose answers are not kept."""
    inner = OPERATIONS.get(code)
    if not getattr(inner, "cacheable", False):
        return None
    words = generations.words[list(mids)]
    if pins is not None and getattr(inner, "pinned", False):
        words = np.append(words, (pins() << 1) | 1)  # (never a word 0, see _keep)
    return words


def _keep(answers: dict[Any, Any], key: Any, words: np.ndarray[Any, Any], payload: bytes) -> None:
    """Keep ``payload`` under ``words``, unless a word is 0 (a manager not hosted here)
    or it is over :data:`ANSWER_KEEP_BYTES`; past :data:`ANSWERS_KEPT` answers, the
    others are forgotten first."""
    if words.all() and len(payload) <= ANSWER_KEEP_BYTES:
        if len(answers) >= ANSWERS_KEPT:
            answers.clear()
        answers[key] = (words, payload)


def _each(
    dispatch: Callable[[Request, Reply], None],
    fields: list[Any],
    mids: tuple[int, ...],
    managers: Mapping[int, Manager] | None,
    direct: Answerer | None,
) -> list[tuple[int, int, int, bytes]]:
    """Every manager's ``(mid, status, ival, payload)``: the inner request (``fields``)
    answered by ``direct(manager, request)`` where it can be, else dispatched."""
    out: list[tuple[int, int, int, bytes]] = []
    got: list[tuple[int, bytes]] = []

    def answer(ival: int = 0, payload: Any = b"") -> None:
        t = type(payload)
        got.append(
            (ival, payload if t is bytes else b"".join(payload) if t is list else bytes(payload))
        )

    shared = _new_request(Request, fields)  # what an Answered operation reads (not manager)
    for mid in mids:
        try:
            m = None if direct is None or managers is None else managers.get(mid)
            if m is not None and direct is not None:
                out.append((mid, 0, *direct(m, shared)))
                continue
            fields[2] = mid
            dispatch(_new_request(Request, fields), answer)
            out.append((mid, 0, *got.pop()) if got else (mid, 0, 0, b""))
        except Exception as e:  # this manager's answer: the others still run
            got.clear()
            status, msg = wire_error(e)
            out.append((mid, int(status), 0, msg))
    return out
