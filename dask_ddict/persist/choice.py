"""Which persister a dictionary's managers use: ``persister_class=``, and Dragon's names.

A dictionary's options carry the choice as a name (:func:`persister_name`), which
every host process turns back into the class (:func:`persister_for`):

* ``None`` (the default), :class:`~.zarr_store.ZarrPersister` or ``"zarr"``: a zarr
  store (a directory or an fsspec URL);
* :class:`~.directory_store.DirectoryPersister` or ``"directory"``, and Dragon's
  ``PosixCheckpointPersister`` (the same class): plain files in a directory;
  without ``persist_path`` it is the current directory, as Dragon's is;
* Dragon's ``NULLCheckpointPersister``: nothing persisted (Dragon's default; what
  ``persist_path=""`` means here too): ``persist_freq`` and ``restore_from`` are
  refused with it, as Dragon refuses them;
* Dragon's ``DAOSCheckpointPersister``: refused, saying what to use instead;
* a subclass of :class:`~.interface.CheckpointPersister` from a module the workers
  can import: by ``module:qualname``.

Nothing here imports zarr: the client resolves the name, the host imports the class.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, cast

from .interface import CheckpointPersister

if TYPE_CHECKING:
    from .versioned import VersionedPersister

#: The built-in persisters by name, and where each lives.
BUILT_IN = {
    "zarr": "dask_ddict.persist.zarr_store:ZarrPersister",
    "directory": "dask_ddict.persist.directory_store:DirectoryPersister",
}
#: The name of "nothing persisted" (Dragon's NULLCheckpointPersister).
NULL = "null"


class NULLCheckpointPersister:
    """Dragon's default persister: retired checkpoints are freed, nothing is persisted.

    Accepted as ``persister_class=`` for Dragon's programs; the same as giving no
    ``persist_path``."""


class DAOSCheckpointPersister:
    """Dragon's DAOS persister, which this package does not have: refused as
    ``persister_class=``, with what to use instead."""


def persister_name(persister_class: Any) -> str:
    """The name of ``persister_class=`` that a dictionary's options carry.

    Raises
    ------
    TypeError
        Not a persister class, nor a built-in's name.
    ValueError
        Dragon's DAOS persister, or a class the workers could not import.
    """
    if persister_class is None:
        return "zarr"
    if isinstance(persister_class, str):
        if persister_class in BUILT_IN or persister_class == NULL:
            return persister_class
        if ":" in persister_class:  # (a class's reference: a copy of a dictionary's options)
            return persister_name(persister_for(persister_class))
        raise ValueError(
            f"persister_class={persister_class!r}: the persisters are named "
            f"{', '.join(repr(n) for n in [*BUILT_IN, NULL])}, or given as "
            "classes"
        )
    if persister_class is NULLCheckpointPersister:
        return NULL
    if persister_class is DAOSCheckpointPersister:
        raise ValueError(
            "persister_class=DAOSCheckpointPersister: there is no DAOS persister here. "
            "For object storage give persist_path= an fsspec URL (s3://bucket/ckpt.zarr, "
            "with storage_options=) and keep persister_class=None (zarr); for a shared file "
            "system use persister_class=DirectoryPersister (PosixCheckpointPersister)"
        )
    if not (isinstance(persister_class, type) and issubclass(persister_class, CheckpointPersister)):
        raise TypeError(
            f"persister_class must be None, a persister's name or a subclass of "
            f"dask_ddict.CheckpointPersister, got {persister_class!r:.80}"
        )
    ref = f"{persister_class.__module__}:{persister_class.__qualname__}"
    for name, where in BUILT_IN.items():
        if ref == where:
            return name
    if persister_class.__module__ == "__main__" or "<locals>" in ref:
        raise ValueError(
            f"persister_class={persister_class.__qualname__}: the workers' host processes "
            "import it by name; define it in a module that they can import"
        )
    return ref


def persister_for(name: str) -> type[CheckpointPersister]:
    """The class that ``name`` (:func:`persister_name`) stands for, imported."""
    module, _, qualname = BUILT_IN.get(name, name).partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, CheckpointPersister)):
        raise TypeError(f"persister {name!r} is not a CheckpointPersister")
    return obj


def detect(path: str) -> type[VersionedPersister]:
    """The persister that wrote the store at ``path`` (for the command line): a
    directory marked as the directory persister's is its, anything else zarr's."""
    import os

    from ..arguments import local_store
    from .directory_store import MARK

    local = local_store(path)
    name = (
        "directory" if local is not None and os.path.exists(os.path.join(local, MARK)) else "zarr"
    )
    return cast("type[VersionedPersister]", persister_for(name))
