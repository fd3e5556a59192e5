"""Durable local files: what a checkpoint's commit needs of a file system.

A commit must replace a file at once (a crash leaves the old one or the new one,
never half of either: write beside it, then ``os.replace``), and with
``ddict.persist.fsync`` reach the disk before anything that depends on it is
written (its data before its commit, the commit before its record).
"""

from __future__ import annotations

import os


def fsync_path(path: str) -> None:
    """Flush one file or directory to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """Flush a directory's files and directories to the disk."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fsync_path(os.path.join(dirpath, f))
        fsync_path(dirpath)


def replace_file(path: str, data: bytes, fsync: bool = False) -> None:
    """Write ``path`` whole at once: ``data`` beside it, flushed if ``fsync``, then
    renamed over it (and the directory flushed, so that the rename lasts)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_path(os.path.dirname(path) or ".")
