"""Files in a memory-backed folder (/dev/shm) that one process writes and others on its host map.

Unlike the replica table's segment (router.shm.table, Python's SharedMemory), these are opened,
mapped and closed at once: a mapping holds no descriptor, so a thousand of them (the event-fed
index's regions, router.kvevents.shared, and its roster) cost no open files. A file is created whole and
zero-filled (`ftruncate`): its pages are taken only as they are written.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

from router.errors import RouterError

SHM_DIR = "/dev/shm"


class SharedFileError(RouterError, RuntimeError):
    """A file in shared memory could not be laid out, or is not what its reader expects."""


def map_file(path: Path, size: int, write: bool) -> mmap.mmap:
    """A new file of `size` bytes mapped read-write (it must not exist), or an existing one mapped
    read-only whole (`size` unused). OSError as the system says."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL if write else os.O_RDONLY
    fd = os.open(path, flags, 0o600)
    try:
        if write:
            os.ftruncate(fd, size)
        else:
            size = os.fstat(fd).st_size
        return mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if write else mmap.ACCESS_READ)
    finally:
        os.close(fd)


def unlink_file(path: Path) -> None:
    """Removes `path` if it is there (its readers keep what they mapped)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


__all__ = ["SHM_DIR", "SharedFileError", "map_file", "unlink_file"]
