"""A broadcast along a tree of host processes (:class:`~dask_ddict.transport.ops.TreeOut`).

The sender sends one request, to the tree's root.  A host that receives one sends
it on to the roots of its subtrees first (each with that subtree's own subtrees),
then serves its own managers as a :class:`~dask_ddict.transport.ops.FanOut` (the same
code, kept answers and counts included), then reads its children's answers, and
answers every manager of its subtree in one list.  A child that cannot be reached
or fails answers for every manager below it with its error, which names that
host: nothing it may have written is reported as written.

Forwarding uses the client's own links (:class:`~dask_ddict.transport.socket_client.HostLink`)
with the dictionary's secret, which this host holds; TCP (with TLS where this host
serves TLS), kept per child between broadcasts.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

from .. import config
from ..errors import wire_error
from ..layout import ManagerInfo
from ..transport.operation import Encoded, Kind, Request
from ..transport.ops import Relayed, TreeOut, pack_fan_out, subtree_mids, unpack_tree
from ..transport.protocol import Op
from ..transport.socket_client import HostLink
from ..transport.table import OPERATIONS


class HostedDict(Protocol):
    """What forwarding needs of the dictionary it serves (``hosted.HostedDict``)."""

    uid: str
    secret: bytes
    name: str


_links: dict[tuple[str, str, int], HostLink] = {}
_lock = threading.Lock()
#: Most child links kept per host process (a tree node has few children).
MOST_LINKS = 64
#: Shares of ``ddict.transport.timeout-slack``: a host waits for a child whose subtree is
#: ``h`` levels deep until ``(h + 1) / LEVELS`` of it past the operation's timeout (the
#: sender waits the whole slack for the root).
LEVELS = 16


def _link(hosted: HostedDict, where: tuple[str, int, str, str], tls: bool) -> HostLink:
    """The kept link to the child host at ``where`` for ``hosted``'s dictionary."""
    host, port, hostname, worker = where
    key = (hosted.uid, host, port)
    with _lock:
        link = _links.get(key)
        if link is None or link.closed:
            ssl_context = None
            if tls:
                from ..transport.tls_settings import default_security

                ssl_context = default_security().get_connection_args("client")["ssl_context"]
            info = ManagerInfo(0, worker, hostname, "", 0, "", host, port, "")
            if len(_links) >= MOST_LINKS:
                for old in _links.values():
                    old.close()
                _links.clear()
            link = _links[key] = HostLink(
                info,
                hosted.uid,
                hosted.secret.decode(),
                hosted.name,
                use_uds=False,
                ssl_context=ssl_context,
            )
    return link


def height(children: tuple[Any, ...]) -> int:
    """How many levels of hosts are below a host of ``children`` (0: none)."""
    return 1 + max(height(c[2]) for c in children) if children else 0


def forget(uid: str) -> None:
    """Close the child links of a dictionary this host no longer serves."""
    with _lock:
        for key in [k for k in _links if k[0] == uid]:
            _links.pop(key).close()


def serve_tree(
    hosted: HostedDict,
    req: Request,
    reply: Callable[..., None],
    fan_out: Callable[[Request, Callable[..., None]], None],
    tls: bool,
) -> None:
    """Serve a :class:`~dask_ddict.transport.ops.TreeOut` ``req``: forward, serve this
    host's managers through ``fan_out(request, reply)`` (the host's ``FanOut``), answer
    the whole subtree's ``(mid, status, ival, payload)`` list."""
    keysec = req.digest + req.key
    arg, mids, children, inner = unpack_tree(keysec)
    code = req.arg
    kind = getattr(OPERATIONS.get(cast(Op, code)), "kind", Kind.IDEMPOTENT)
    if not isinstance(kind, Kind):
        kind = Kind.IDEMPOTENT
    value = req.value
    parts = () if value is None or not len(value) else (value,)
    relayed = Relayed(
        code,
        kind,
        Encoded(
            req.flags,
            inner,
            parts,
            len(value) if parts else 0,
            req.chkpt,
            arg,
            req.client,
            req.timeout,
        ),
    )
    # A child's wait ends before its parent's (each level keeps a share of the slack, the
    # deepest the least), so that the host that did not answer is the one named.
    slack = config.get_seconds("transport.timeout-slack") or 0.0
    now = time.monotonic()
    pending: list[tuple[Any, Callable[[], tuple[int, Any]] | BaseException]] = []
    for child in children:
        where, ms, grand = child
        try:
            link = _link(hosted, where, tls)
            began = now - slack + slack * min(height(grand) + 1, LEVELS - 1) / LEVELS
            pending.append(
                (child, link.send(TreeOut(relayed, tuple(ms), tuple(grand)), ms[0], began))
            )
        except Exception as e:  # noqa: BLE001 - (connecting) answered for its subtree
            pending.append((child, e))
    out: list[tuple[int, int, int, bytes]] = []
    if mids:
        got: list[bytes] = []
        fields = list(req)
        fields[0], fields[2] = int(Op.FANOUT), mids[0]
        ks = pack_fan_out(arg, mids, inner)
        fields[7], fields[8] = ks[:16], ks[16:]
        try:
            fan_out(Request(*fields), lambda ival=0, payload=b"": got.append(bytes(payload)))
            out += pickle.loads(got[0])
        except Exception as e:  # noqa: BLE001 - every manager of this host: its error
            status, msg = wire_error(e)
            out += [(m, int(status), 0, msg) for m in mids]
    for child, answer in pending:
        where, ms, grand = child
        try:
            if isinstance(answer, BaseException):
                raise answer
            out += pickle.loads(answer()[1])
        except Exception as e:  # noqa: BLE001 - the child's subtree: its error, naming it
            status, msg = wire_error(e)
            msg = (
                f"host process {where[0]}:{where[1]} (worker {where[3]}) did not answer a "
                f"broadcast forwarded to it: "
            ).encode() + msg
            out += [(m, int(status), 0, msg) for m in list(ms) + subtree_mids(grand)]
    reply(0, pickle.dumps(out))
