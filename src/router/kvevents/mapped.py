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


def map_existing(path: Path) -> mmap.mmap:
    """An existing file mapped read-write whole: another process laid it out, and this one writes
    its share of it (a shard of a shared index: router.kvevents.shared). OSError as the system says."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_WRITE)
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


MAX_SHARDS = 64
FRONT_WORDS = 8 + 2 * MAX_SHARDS  # a shared file's front: its head, then each shard's generation and count
FRONT_BYTES = 8 * FRONT_WORDS


class Front:
    """The front of a file that a host's writers share, each writing its shard of the rows (shard
    k's are rows k, k + shards, k + 2 shards, ...): a 64-byte head (the file's magic, how many
    shards write it), then for each shard its generation (bumped after each change it makes; 0
    before its writer came) and count (one past the highest row it has used). A reader watches
    the generations' sum, which moves whenever any shard's moves, and reads rows up to the
    largest count."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.words = memoryview(buf)[:FRONT_BYTES].cast("Q")

    @classmethod
    def lay_out(cls, buf: mmap.mmap, magic: int, shards: int) -> Front:
        front = cls(buf)
        front.words[0], front.words[1] = magic, shards
        return front

    @classmethod
    def joined(cls, buf: mmap.mmap, magic: int, path: Path, shards: int | None = None) -> Front:
        """The front of a file another process laid out; SharedFileError if it is not one of
        `magic`'s (or not written by `shards` shards, where given)."""
        if len(buf) < FRONT_BYTES or buf[:8] != magic.to_bytes(8, "little"):
            raise SharedFileError(f"{path} is not a shared index's file of this version")
        front = cls(buf)
        if not 1 <= front.shards <= MAX_SHARDS or (shards is not None and front.shards != shards):
            raise SharedFileError(f"{path} is written by {front.shards} shards, not {shards}")
        return front

    @property
    def shards(self) -> int:
        return int(self.words[1])

    def generation(self) -> int:
        words = self.words
        if words[1] == 1:
            return int(words[8])
        return sum(words[8 : 8 + 2 * int(words[1]) : 2])

    def count(self) -> int:
        words = self.words
        if words[1] == 1:
            return int(words[9])
        return max(words[9 : 9 + 2 * int(words[1]) : 2])

    def of(self, shard: int) -> tuple[int, int]:
        """Shard `shard`'s (generation, count) as it last wrote them."""
        return int(self.words[8 + 2 * shard]), int(self.words[9 + 2 * shard])

    def set(self, shard: int, generation: int, count: int) -> None:
        """Shard `shard`'s generation and count: the count first, the generation last."""
        self.words[9 + 2 * shard] = count
        self.words[8 + 2 * shard] = generation


def shard_check(shard: int, shards: int) -> None:
    """ValueError unless 0 <= shard < shards <= MAX_SHARDS."""
    for name, value in (("shard", shard), ("shards", shards)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if not 1 <= shards <= MAX_SHARDS or not 0 <= shard < shards:
        raise ValueError(f"a shard must be in [0, shards) with shards in [1, {MAX_SHARDS}], got {shard} of {shards}")


def unlink_file(path: Path) -> None:
    """Removes `path` if it is there (its readers keep what they mapped)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


__all__ = [
    "FRONT_BYTES",
    "MAX_SHARDS",
    "SHM_DIR",
    "TAKE_STEP",
    "Front",
    "SharedFileError",
    "Taken",
    "map_existing",
    "map_file",
    "shard_check",
    "take_pages",
    "unlink_file",
]
