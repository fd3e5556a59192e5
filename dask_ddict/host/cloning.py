"""Cloning a manager's shard: what ``clone``, ``copy`` and ``synchronize_ddicts`` run.

A target manager pulls a source manager's whole shard (every version of
every key, so every checkpoint of the working set) page by page from one
snapshot, straight over the key path (in-process, Unix socket or TCP+TLS,
whatever reaches the source from the target's worker).  No data goes through
the client or the scheduler: the client only tells each target manager
which source to pull from (:mod:`dask_ddict.client.cloning`).

A clone is a copy made once, of another dictionary; a *replica* (:mod:`.replicas`) is a
copy of one of this dictionary's own shards that another host keeps up to date with
every write.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..layout import Layout
from ..transport.channels import Channels
from ..transport.whole_checkpoints import DumpPage

if TYPE_CHECKING:
    from ..shard.manager import Manager

logger = logging.getLogger(__name__)


def pull_shard(target: Manager, source: str, manager_id: int) -> int:
    """Replace ``target``'s shard by manager ``manager_id`` of the serialized ``source``.

    Returns the number of records copied.
    """
    core = Channels(Layout.deserialize(source))
    try:
        channel = core.channel(manager_id)

        def pages() -> Iterator[tuple[list[tuple[bytes, bytes]], dict[str, Any]]]:
            token, after, more = None, None, True
            while more:
                records, more, state, token = channel.call(DumpPage(token, after))
                if records:
                    after = records[-1][0]
                yield records, state

        n = target.replace_with(pages())
    finally:
        core.close()
    logger.info(
        "ddict: manager %d pulled %d records from %s", target.manager_id, n, core.layout.name
    )
    return n
