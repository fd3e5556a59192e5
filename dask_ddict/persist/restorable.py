"""Whether a persisted checkpoint can be restored, found by reading the store only.

A restore (``DDict(..., restore_from=k)``, ``dask ddict restore``) first checks,
in each manager's host process, that its checkpoint is committed in the store.
It only reads: a wrong ``name=`` or a ``persist_path`` that does not exist must
leave the store and the path exactly as they were (opening the store for
writing, as persisting does, would create the dictionary's groups), and the
error says what was looked for, where, and what is there instead.
"""

from __future__ import annotations

import os
from typing import Any

from ..arguments import local_store
from ..errors import DDictPersistCheckpointError
from .interface import CheckpointPersister


def check_restorable(
    kind: type[CheckpointPersister],
    path: str,
    name: str,
    manager_id: int,
    num_managers: int,
    chkpt: int,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Raise :class:`DDictPersistCheckpointError` unless checkpoint ``chkpt`` of manager
    ``manager_id`` of dictionary ``name`` is committed in the store ``path`` (written by
    persister ``kind``).

    The message names the store, the dictionary and what the store holds (the
    dictionaries in it, or this manager's persisted ids).
    """
    what = f"restore_from={chkpt} of {name!r} (manager {manager_id}): checkpoint {chkpt} is not persisted"
    local = local_store(path)
    if local is not None and not os.path.isdir(local):
        raise DDictPersistCheckpointError(
            f"{what}: persist_path {path!r} does not exist (nothing was created there); "
            "pass the path the dictionary was persisted to"
        )
    try:
        names = kind.dictionaries(path, storage_options)
    except DDictPersistCheckpointError as e:
        raise DDictPersistCheckpointError(f"{what}: {e.message}") from None
    if name not in names:
        held = ", ".join(repr(n) for n in names) or "none"
        raise DDictPersistCheckpointError(
            f"{what}: the store {path!r} holds no dictionary named {name!r} (it holds: "
            f"{held}); pass the name it was persisted under (name=...)"
        )
    store = kind(
        path, name, manager_id, num_managers, writable=False, storage_options=storage_options
    )
    complete = store.complete_ids()
    if chkpt not in complete:
        mine = store.ids()
        also = (
            "; this manager has it, but not every manager has the same version of it"
            if chkpt in mine
            else ""
        )
        raise DDictPersistCheckpointError(
            f"{what} in the store {path!r} (persisted on every manager there: {complete}; "
            f"by this manager: {mine}{also})"
        )
