"""A filter's tasks: a manager's leaf and a merge task, each streaming up to its parent.

A leaf runs ``mgr_code(dd, out_queue, *args)`` on the worker that hosts its
manager, so ``dd``'s reads come from the shard itself; a merge task merges its
children's streams and sends the result up.  Every task first asks the caller
(the root) where its parent listens (:func:`join`): merge tasks bind their port
only once they run.

Tasks that stream for long would hold worker threads: a merge task leaves its
worker's thread pool (:func:`distributed.secede`) as it starts, and a leaf just
before it would first wait (see :func:`run_leaf`), so a filter of any number of
managers runs on workers with one thread each, and a worker's leaves scan one
at a time per thread until they wait.
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable
from typing import Any

import distributed
from distributed.comm import get_address_host

from ..errors import DDictTaskError
from ..transport.sockets import connect, shut
from .plan import Plan
from .receiving import Receiver
from .streams import (
    ERROR,
    HELLO,
    PARENT,
    ROOT,
    Failed,
    Failure,
    Sender,
    Stopped,
    hello,
    recv_frame,
    send_frame,
)

logger = logging.getLogger(__name__)

#: Seconds a leaf waits in its worker's thread pool, at its first flush, for its join
#: to its parent (begun as it started) to end; then it secedes (a merge task that has
#: not started yet: the caller can say where it listens only once it runs).
ANSWER_SOON = 0.01

#: Seconds a task waits for the caller's answer beyond ``connect-timeout``, which is how
#: long the caller waits for the task's parent merge task to start: so the caller's
#: word that it gave up (an ``ERROR``) arrives before the task's own timeout.
ANSWER_GRACE = 5.0


def join(
    plan: Plan,
    node: int,
    address: tuple[str, int] | None,
    ssl_context: ssl.SSLContext | None = None,
) -> Any:
    """A socket to ``node``'s parent: asked of the caller, which may be the parent;
    ``None`` if the caller has left (a task that starts late has nothing to do)."""
    timeout = plan.limits.connect_timeout
    leaf = node if node < plan.leaves else None  # (a leaf's node number is its manager's)
    try:
        sock = connect(plan.root, timeout, ssl_context)
        send_frame(sock, HELLO, hello(plan.token, node, address))
        sock.settimeout(timeout + ANSWER_GRACE)  # (the caller gives up first, and says so)
        kind, payload = recv_frame(sock)
        if kind == ERROR:  # the caller gave up on this node's parent: it fails, loudly
            shut(sock)
            raise DDictTaskError(
                f"filter: node {node} cannot join its parent: {payload.decode(errors='replace')}",
                manager_id=leaf,
            )
        if kind != PARENT:
            shut(sock)
            raise EOFError(f"unexpected frame {kind}")
        if payload:
            shut(sock)
            host, port = payload.decode().rsplit("|", 1)
            sock = connect((host, int(port)), timeout, ssl_context)
            send_frame(sock, HELLO, hello(plan.token, node, None))
    except (ConnectionError, EOFError) as e:  # the caller has left (refused, reset): nothing to do
        logger.debug("ddict filter: node %d starts after its caller left (%r)", node, e)
        return None
    except OSError as e:
        raise DDictTaskError(
            f"filter: node {node} cannot reach its parent (the caller at "
            f"{plan.root[0]}:{plan.root[1]} left, or is unreachable): {e}",
            manager_id=leaf,
        ) from e
    sock.settimeout(None)
    return sock


class Joining:
    """A leaf's join to its parent (:func:`join`), in a thread of its own while
    ``mgr_code`` runs: the leaf's first flush then finds it joined."""

    def __init__(self, plan: Plan, node: int, ssl_context: ssl.SSLContext | None = None) -> None:
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._sock: Any = None
        self.error: BaseException | None = None
        self._taken = self._dropped = False
        threading.Thread(
            target=self._run,
            args=(plan, node, ssl_context),
            daemon=True,
            name=f"ddict-filter-join-{node}",
        ).start()

    def _run(self, plan: Plan, node: int, ssl_context: ssl.SSLContext | None) -> None:
        try:
            sock = join(plan, node, None, ssl_context)
        except BaseException as e:  # noqa: BLE001 - raised in the leaf, at its first flush
            sock, self.error = None, e
        with self._lock:
            self._sock = sock
            self._done.set()
            if not self._dropped:
                return
        if sock is not None:  # (the leaf ended without it)
            shut(sock)

    def result(self, before_wait: Callable[[], None] | None) -> Any:
        """The socket (``None``: the caller has left); ``before_wait`` is called if it
        is not there within :data:`ANSWER_SOON` (its parent has not started yet)."""
        if not self._done.wait(ANSWER_SOON):
            if before_wait is not None:
                before_wait()
            self._done.wait()
        self._taken = True
        if self.error is not None:
            raise self.error
        return self._sock

    def drop(self) -> None:
        """The leaf ends: a socket it never took is closed (now, or once joined)."""
        with self._lock:
            self._dropped = True
            sock = self._sock if self._done.is_set() and not self._taken else None
        if sock is not None:
            shut(sock)


def run_leaf(
    dd: Any, mgr_code: Callable[..., Any], args: tuple[Any, ...], plan: Plan, node: int
) -> None:
    """A manager's task: ``mgr_code(dd, out_queue, *args)``, its results sent up.

    It runs in its worker's thread pool, so a worker's leaves scan one after
    another per thread, and leaves the pool (once) only just before it would
    wait: for its parent merge task to say where it listens (one that has not
    started yet: holding the only thread while waiting for it would deadlock),
    or for a credit.  It joins its parent in a thread while ``mgr_code`` runs,
    and takes the socket at its first flush: a leaf whose results fit its
    credit window never leaves the pool (merge tasks start first).
    """
    seceded = False

    def leave_pool() -> None:
        nonlocal seceded
        if not seceded:
            seceded = True
            distributed.secede()

    joining = Joining(plan, node, plan.ssl_context(listen=False))
    out = Sender(
        None,
        plan.limits,
        lambda: joining.result(None if plan.parents[node] == ROOT else leave_pool),
        leave_pool,
    )
    try:
        mgr_code(dd, out, *args)
        out.end()
    except EOFError as e:
        if not out.left:  # mgr_code's own EOFError, not the caller's leaving
            out.fail(Failure.of(node, node, e))
    except Exception as e:  # noqa: BLE001 - raised in the caller, naming the manager
        out.fail(Failure.of(node, node, e))
        if out.left and joining.error is not None:
            raise joining.error from None  # (its parent unreachable: the task fails instead)
    finally:
        out.close()
        joining.drop()


def run_merge(plan: Plan, node: int, comparator: Callable[[Any, Any], bool] | None) -> None:
    """A merge task: its children's results, merged, sent up."""
    distributed.secede()
    host = get_address_host(distributed.get_worker().address)
    receiver = Receiver(
        host,
        plan.token,
        plan.children(node),
        plan.leaves,
        plan.limits,
        ssl_context=plan.ssl_context(listen=True),
    )
    sock = None
    try:
        sock = join(plan, node, receiver.address, plan.ssl_context(listen=False))
        if sock is None:
            return
        out = Sender(sock, plan.limits)
        try:
            for _, blob in receiver.merged(comparator, out.gone):
                if blob is None:  # (IDLE: its children have nothing yet)
                    out.flush()
                else:
                    out.put_pickled(blob)
            out.end()
        except (EOFError, Stopped):
            pass  # the caller left
        except Failed as f:
            out.fail(f.failure)
        except Exception as e:  # noqa: BLE001 - e.g. the comparator raised
            out.fail(Failure.of(node, None, e))
    finally:
        receiver.close()
        if sock is not None:
            shut(sock)
