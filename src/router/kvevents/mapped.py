"""Files in a memory-backed folder (/dev/shm) that one process writes and others on its host map.

Unlike the replica table's segment (router.shm.table, Python's SharedMemory), these are opened,
mapped and closed at once: a mapping holds no descriptor, so a thousand of them (the event-fed
index's regions, router.kvevents.shared, and its roster) cost no open files.

A file is created at its whole length (`ftruncate`), but a page of a memory-backed file is taken
only when it is first written, and a write that finds the folder full kills the process with
SIGBUS: a container's /dev/shm (64 MiB unless it is given more) fills long before its host's
memory does. So the writer takes a file's pages before it writes them (`posix_fallocate`): a
region whole when it is laid out, a directory's or roster's rows in steps as they come into use
(`Taken`). A folder without room is then an OSError when a file is laid out or grows, which the
writers turn into `SharedFileError` and survive, never a signal in the middle of a write.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

from router.errors import RouterError

SHM_DIR = "/dev/shm"
TAKE_STEP = 64 << 10  # a directory's or roster's pages are taken this many bytes at a time


class SharedFileError(RouterError, RuntimeError):
    """A file in shared memory could not be laid out, or is not what its reader expects."""


def map_file(path: Path, size: int, write: bool, take: int | None = None) -> mmap.mmap:
    """A new file of `size` bytes mapped read-write (it must not exist), its first `take` bytes'
    pages taken now (None: all of them), or an existing one mapped read-only whole (`size` unused).
    OSError as the system says: ENOSPC where its folder has no room (the new file is removed)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL if write else os.O_RDONLY
    fd = os.open(path, flags, 0o600)
    try:
        if write:
            try:
                os.ftruncate(fd, size)
                if size and take != 0:
                    os.posix_fallocate(fd, 0, size if take is None else min(take, size))
            except OSError:
                unlink_file(path)
                raise
        else:
            size = os.fstat(fd).st_size
        return mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if write else mmap.ACCESS_READ)
    finally:
        os.close(fd)


def take_pages(path: Path, start: int, end: int) -> None:
    """Takes the pages of bytes [start, end) of the file at `path` now, before they are written.
    OSError as the system says: ENOSPC where its folder has no room."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, start, end - start)
    finally:
        os.close(fd)


class Taken:
    """How much of a file's front the writer has taken pages for, grown in TAKE_STEP steps (and
    never past `size`) before a row beyond it is written: `cover(end)` before writing [.., end)."""

    def __init__(self, path: Path, size: int, upto: int) -> None:
        self.path = path
        self.size = size
        self.upto = upto

    def cover(self, end: int) -> None:
        """Takes the pages up to `end` (SharedFileError where the folder has no room for them)."""
        if end <= self.upto:
            return
        upto = min(self.size, -(-end // TAKE_STEP) * TAKE_STEP)
        try:
            take_pages(self.path, self.upto, upto)
        except OSError as exc:
            raise SharedFileError(f"no room in {self.path.parent} for {self.path.name}'s next rows: {exc}") from None
        self.upto = upto


def unlink_file(path: Path) -> None:
    """Removes `path` if it is there (its readers keep what they mapped)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


__all__ = ["SHM_DIR", "TAKE_STEP", "SharedFileError", "Taken", "map_file", "take_pages", "unlink_file"]
