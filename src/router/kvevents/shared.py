"""The event-fed index in shared memory: one process on a host follows the engines, the others read.

`SharedIndex` answers what `PrefixIndex` answers for the event-fed index (router.kvevents.truth
and holdings use it in its place), but keeps each holder, one replica's medium, in a region of
its own: a file under a memory-backed directory (/dev/shm) that the process writing it maps
read-write and every other process on the host maps read-only (`SharedIndexReader`). The regions
are laid out and changed by `_kvshare` (its twin router/_kvshare_py.py): a reader never waits on
the writer, and a read that raced a change is read again (see src/_kvshare.pyx).

A roster file says what each followed engine's events say beside its blocks (router.kvevents.roster).
A directory file names each holder's current region. A holder starts in a small region and moves
to one twice as large as it fills, up to its capacity and a sixteenth of slack (so an index costs
what it holds, not what the engines could hold): the writer lays out the new file, copies the
blocks oldest first (the LRU order is kept), names it in the directory and unlinks the old one;
readers map the new one at their next read, and keep reading the old mapping until then. A region's
pages are taken when it is laid out, the directory's and roster's as their rows come into use
(router.kvevents.mapped): a /dev/shm without room is a SharedFileError there, never a SIGBUS.

A host may follow its engines in several processes, each a shard of them (`shard` of `shards`):
each writes a SharedIndex of the same name, the first laying out the directory and roster, each
the holders (k, k + shards, ...) and roster rows of its own shard (router.kvevents.mapped.Front).
A reader reads one index whoever writes which holder.

Directory file: a front (router.kvevents.mapped.Front: magic, shards, each shard's generation and
holders named) and a 64-byte row per holder (generation, pool, file name). A shard's generation
is bumped after every change it makes; a reader rescans only when their sum moved, and keeps a
scan only if it did not move during it.

It is past 450 lines because it is one file format whole: the writer that lays out, moves and
clears its rows and regions (a shard's among others'), and the reader that follows them; split,
the directory's layout and its order of writes would be spelled out in two places.
"""

from __future__ import annotations

import logging
import math
import mmap
import random
import struct
import time
from array import array
from pathlib import Path
from typing import TYPE_CHECKING

from router._compat import NO_EXTENSIONS
from router.kvevents.mapped import (
    FRONT_BYTES,
    SHM_DIR,
    TAKE_STEP,
    Front,
    SharedFileError,
    Taken,
    map_existing,
    map_file,
    shard_check,
    unlink_file,
)
from router.kvevents.roster import Roster, RosterReader
from router.ring import xxh3_64

if TYPE_CHECKING or NO_EXTENSIONS:
    from router._kvshare_py import Regions, region_bytes
else:
    from _kvshare import Regions, region_bytes

if TYPE_CHECKING:
    from collections.abc import Iterable

    from typing_extensions import Buffer

log = logging.getLogger("router.kvevents.shared")

MAX_HOLDERS = 32_768
# A holder starts in a region of FIRST_POOL entries (or what its capacity needs, if less) and moves
# to one twice as large as it fills. Moving copies its blocks while the writer waits: 100
# H200-shaped replicas filling in step, each moving as its region filled, held the writer long
# enough for a lag P99 of 84-128 ms; each now moves once it holds a share of its region drawn
# from [1/2, 1), and the moves spread out (P99 3 ms). A region laid out whole at the capacity
# from the start took 1 ms but twice the memory while the caches fill (the slot tables' pages are
# all taken at once).
FIRST_POOL = 4_096
GROW_RETRY_S = 30.0  # a holder whose larger region found no room (/dev/shm full) tries again after this long
RESTART_GEN_STEP = 1 << 32  # a shard's writer restarted numbers its changes from this far past its predecessor's
MIN_SLACK = 64  # a full holder's region keeps this many entries (or a sixteenth of its capacity) spare
_DIR_MAGIC = int.from_bytes(b"kvardir2", "little")
_ROW = struct.Struct("<QQ48s")  # generation (0: none), pool, file name
_ROW_TAIL = struct.Struct("<Q48s")
_NAME_MAX = 47


def shard_of(replica_id: str, shards: int) -> int:
    """Which of `shards` processes follows a replica's events: a hash of its id, the same in every
    process and run, and a replica's whatever else joins or leaves."""
    return 0 if shards == 1 else xxh3_64(replica_id) % shards


def max_pool(capacity: int) -> int:
    """The largest region a holder of `capacity` blocks moves to."""
    return max(1, capacity + max(MIN_SLACK, capacity // 16))


def first_pool(capacity: int) -> int:
    """The region a holder of `capacity` blocks starts in."""
    return min(FIRST_POOL, max_pool(capacity))


class SharedIndex:
    """The writer: a PrefixIndex's answers for the event-fed index, its holders in shared memory.

    `name` prefixes its files in `directory`; give readers the same two (router.kvevents.shared
    `SharedIndexReader`). Only this process changes its holders and rows; `close()` unlinks its files.

    Shard `shard` of `shards` (a host following its engines in several processes): shard 0 lays
    out the directory and roster, and must be made first; each other writes its own holders and
    rows in them, clearing first what a writer of its shard left before it (it was restarted,
    or killed: `clear_shard` does the same from another process, at once)."""

    def __init__(
        self,
        name: str,
        directory: str = SHM_DIR,
        max_holders: int = MAX_HOLDERS,
        shard: int = 0,
        shards: int = 1,
    ) -> None:
        if not name or "/" in name or len(name) > _NAME_MAX - 16:
            raise SharedFileError(f"a shared index's name must be 1 to {_NAME_MAX - 16} characters without '/'")
        shard_check(shard, shards)
        self.name = name
        self.shard, self.shards = shard, shards
        self.directory = Path(directory)
        self.max_holders = max_holders
        self.regions = Regions()
        self._maps: dict[int, tuple[mmap.mmap, Path]] = {}
        self._gen = 0
        self._count = 0  # one past the highest holder row this shard named in the directory
        self._next = shard  # the next holder never used: this shard's are shard, shard + shards, ...
        self._free: list[int] = []
        self._grow_at: dict[int, int] = {}  # holder -> the blocks past which it moves to a larger region
        self._spread = random.Random(0)
        self._stuck_until: dict[int, float] = {}  # holder -> when it may try to grow again (no room before)
        self._said_stuck_at = -math.inf
        self._dir_path = self.directory / f"{name}.dir"
        size = FRONT_BYTES + max_holders * _ROW.size
        try:
            self._dir = map_file(self._dir_path, size, True, TAKE_STEP) if shard == 0 else map_existing(self._dir_path)
        except OSError as exc:
            raise SharedFileError(f"cannot lay out the shared index {self._dir_path}: {exc}") from None
        if shard == 0:
            self._front = Front.lay_out(self._dir, _DIR_MAGIC, shards)
        else:
            self._front = Front.joined(self._dir, _DIR_MAGIC, self._dir_path, shards)
            if len(self._dir) < size:
                raise SharedFileError(f"{self._dir_path} has room for fewer than {max_holders} holders")
        # rows' pages, as holders come (a later shard's from the start: taking pages taken is a no-op)
        self._dir_taken = Taken(self._dir_path, size, min(TAKE_STEP, size) if shard == 0 else 0)
        self._gen, self._count = self._front.of(shard)  # (0, 0), unless a writer of this shard was here before
        try:
            self.roster = Roster(self.directory / f"{name}.roster", shard, shards)  # what each engine's events say
        except SharedFileError:
            if shard == 0:
                unlink_file(self._dir_path)
            raise
        if self._gen:  # what the writer before it left (its roster rows are cleared first: no replica points here)
            # past any generation it wrote into a row but had not said in the front when it died, so
            # that no reader takes a new region for the one it mapped
            self._gen += RESTART_GEN_STEP
            self._unname_all(self.max_holders)
            self._unlink_strays()

    def __repr__(self) -> str:
        return f"SharedIndex({self.name!r}, {len(self._maps)} holders, {self.total()} blocks)"

    # -- the directory -------------------------------------------------------------------------------

    def _publish(self, holder: int, pool: int, file: str) -> None:
        """Names `holder`'s region `file` ("": none): the pool and name first, the row's generation
        last, so a reader that sees the new generation reads the new name."""
        self._gen += 1
        gen = self._gen if file else 0
        at = FRONT_BYTES + holder * _ROW.size
        _ROW_TAIL.pack_into(self._dir, at + 8, pool, file.encode())
        struct.pack_into("<Q", self._dir, at, gen)
        self._count = max(self._count, holder + 1)
        self._front.set(self.shard, self._gen, self._count)

    def _unname_all(self, upto: int | None = None) -> None:
        """Names no region for any holder of this shard below `upto` (its count), removing the
        files named (a writer of this shard before this one left them, possibly beyond the count
        it said; or this one is closing while others write on)."""
        for holder in range(self.shard, self._count if upto is None else upto, self.shards):
            gen, _, file = _ROW.unpack_from(self._dir, FRONT_BYTES + holder * _ROW.size)
            if gen:
                self._publish(holder, 0, "")
                unlink_file(self.directory / file.rstrip(b"\0").decode(errors="replace"))

    def _unlink_strays(self) -> None:
        """Removes the region files of this shard's holders that no row names: one a writer
        killed while it moved a holder had laid out and not yet named."""
        for path in self.directory.glob(f"{self.name}-*-*"):
            parts = path.name[len(self.name) + 1 :].split("-")  # (holder, generation)
            if len(parts) == 2 and all(p.isdigit() for p in parts) and int(parts[0]) % self.shards == self.shard:
                unlink_file(path)

    def _region(self, holder: int, capacity: int, pool: int) -> None:
        """Lays out a fresh region of `pool` entries for `holder`, moving its blocks there."""
        self._dir_taken.cover(FRONT_BYTES + (holder + 1) * _ROW.size)  # (its row: before anything moves)
        self._gen += 1
        file = f"{self.name}-{holder}-{self._gen}"
        path = self.directory / file
        try:
            buf = map_file(path, region_bytes(pool), True)  # (its pages taken: no SIGBUS when it fills)
        except OSError as exc:
            raise SharedFileError(f"cannot lay out a region of the shared index ({path}): {exc}") from None
        old = self._maps.get(holder)
        if old is None:
            self.regions.format(holder, buf, capacity, pool)
        else:
            keys, aliases, named = self.regions.blocks(holder)
            moved = Regions()
            moved.format(0, buf, capacity, pool)
            _refile(moved, keys, aliases, named)
            del moved
            self.regions.retire(holder)
            self.regions.attach(holder, buf)
        self._maps[holder] = (buf, path)
        # it moves again once it holds a share of this pool drawn from [1/2, 1): holders filling in
        # step (a fleet started together) move at different times, not all in one turn of the loop
        self._grow_at[holder] = int(pool * (0.5 + 0.5 * self._spread.random()))
        self._publish(holder, pool, file)
        if old is not None:
            unlink_file(old[1])

    # -- holders -------------------------------------------------------------------------------------

    @property
    def n_holders(self) -> int:
        return self.regions.n_holders

    def add_holder(self, capacity: int) -> int:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be a non-negative int, got {capacity!r}")
        holder = min(self._free) if self._free else self._next
        if holder >= self.max_holders:
            raise SharedFileError(f"the shared index has room for {self.max_holders} holders")
        self._region(holder, capacity, first_pool(capacity))  # (SharedFileError: no room; nothing taken)
        if self._free:
            self._free.remove(holder)
        else:
            self._next += self.shards
        return holder

    def remove_holder(self, holder: int) -> None:
        self.regions.retire(holder)
        _, path = self._maps.pop(holder)
        self._publish(holder, 0, "")
        unlink_file(path)
        self._stuck_until.pop(holder, None)
        self._free.append(holder)

    def capacity(self, holder: int) -> int:
        return int(self.regions.capacity(holder))

    def set_capacity(self, holder: int, capacity: int) -> int:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be a non-negative int, got {capacity!r}")
        return int(self.regions.set_capacity(holder, capacity))

    def size(self, holder: int) -> int:
        return int(self.regions.size(holder))

    def clear(self, holder: int) -> int:
        return int(self.regions.clear(holder))

    def evict(self, holder: int, count: int) -> int:
        return int(self.regions.evict(holder, count))

    def total(self) -> int:
        return int(self.regions.total())

    def memory_bytes(self) -> int:
        """Bytes of the regions laid out (their files' length; pages are taken as they are written)."""
        return int(self.regions.memory_bytes())

    # -- blocks --------------------------------------------------------------------------------------

    def insert(self, holder: int, chain: Buffer, n: int = -1, aliases: Buffer | None = None) -> int:
        count = len(memoryview(chain)) if n == -1 else n
        regions = self.regions
        if isinstance(count, int) and regions.size(holder) + count > self._grow_at.get(holder, 0):
            self._grow(holder, count)
        return int(regions.insert(holder, chain, n, aliases))

    def _grow(self, holder: int, count: int) -> None:
        """Moves `holder` to a region twice as large (up to its capacity and slack), if it may grow."""
        regions = self.regions
        pool, size, capacity = regions.pool(holder), regions.size(holder), regions.capacity(holder)
        top = max_pool(capacity)
        if pool >= top:
            self._grow_at[holder] = pool  # as large as it gets: a full one evicts its oldest
            return
        now = time.monotonic()
        if now < self._stuck_until.get(holder, now):
            return  # its folder had no room a moment ago: it evicts its oldest until then
        try:
            self._region(holder, capacity, min(top, max(2 * pool, size + count)))
        except SharedFileError as exc:
            self._stuck_until[holder] = now + GROW_RETRY_S
            self._grow_at[holder] = pool
            if now - self._said_stuck_at >= GROW_RETRY_S:  # (one line, however many holders are stuck)
                self._said_stuck_at = now
                log.warning(
                    "%s: its blocks beyond %d are evicted oldest first, as any other replica's that cannot grow "
                    "(tried again every %.0f s; said once in that time)",
                    exc,
                    pool,
                    GROW_RETRY_S,
                )
            return
        self._stuck_until.pop(holder, None)

    def forget(self, holder: int, aliases: Buffer) -> int:
        return int(self.regions.forget(holder, aliases))

    def key_of(self, holder: int, alias: int) -> int | None:
        return self.regions.key_of(holder, alias)

    def match(self, holder: int, chain: Buffer) -> int:
        return int(self.regions.match(holder, chain))

    def match_after(self, holder: int, chain: Buffer, evicted: int) -> int:
        return int(self.regions.match_after(holder, chain, evicted))

    def match_after_many(self, holder: int, chains: Iterable[Buffer], evicted: Iterable[int]) -> list[int]:
        return self.regions.match_after_many(holder, chains, evicted)

    def match_all(self, chain: Buffer, out: Buffer) -> None:
        self.regions.match_all(chain, out)

    def close(self) -> None:
        """Unlinks its files (readers keep what they mapped until they let go): a later shard's
        holders are named no more, for the other shards write on."""
        self.roster.close()  # (first: no replica points at the holders named no more below)
        if self.shard != 0:
            self._unname_all()
        for holder in list(self._maps):
            _, path = self._maps.pop(holder)
            unlink_file(path)
        if self.shard == 0:
            unlink_file(self._dir_path)


def clear_shard(name: str, shard: int, shards: int, directory: str = SHM_DIR) -> None:
    """What shard `shard`'s writer left in the index `name`, cleared from another process: its
    process died, and until another takes its place its replicas are read as followed by none
    (priced by the router's model), not as it last left them. SharedFileError if there is no such index."""
    if shard != 0:
        SharedIndex(name, directory, shard=shard, shards=shards).close()


def _refile(regions: Regions, keys: array[int], aliases: array[int], named: bytes) -> None:
    """Files blocks given least recent first into holder 0 of `regions`, in that LRU order: each
    run of named (or unnamed) blocks in one insert, most recent first (insert touches its chain
    from the end, so the chain's first block ends the most recent)."""
    start = 0
    while start < len(keys):
        end = start + 1
        while end < len(keys) and named[end] == named[start]:
            end += 1
        chain = keys[start:end]
        chain.reverse()
        names = None
        if named[start]:
            names = aliases[start:end]
            names.reverse()
        regions.insert(0, chain, -1, names)
        start = end


class SharedIndexReader:
    """A reader of a SharedIndex another process on this host writes: `match`, `match_after`,
    `match_all`, `size`, `capacity` of its holders, as it stands at each question."""

    def __init__(self, name: str, directory: str = SHM_DIR) -> None:
        self.name = name
        self.directory = Path(directory)
        path = self.directory / f"{name}.dir"
        try:
            self._dir = map_file(path, 0, False)
        except OSError as exc:
            raise SharedFileError(f"cannot read the shared index {path}: {exc}") from None
        self._front = Front.joined(self._dir, _DIR_MAGIC, path)
        self.regions = Regions()
        self._known = -1  # the directory's generation last followed whole
        self._rows: dict[int, int] = {}  # holder -> the generation of the region mapped
        self._maps: dict[int, mmap.mmap] = {}
        self.roster = RosterReader(self.directory / f"{name}.roster")

    def follow(self) -> None:
        """Maps the regions the directory names now (a no-op while it has not changed)."""
        front = self._front
        gen = front.generation()
        if gen == self._known:
            return
        for holder in range(front.count()):
            row_gen, _, file = _ROW.unpack_from(self._dir, FRONT_BYTES + holder * _ROW.size)
            if row_gen == self._rows.get(holder, 0):
                continue
            if row_gen == 0:
                if self.regions.attached(holder):
                    self.regions.detach(holder)
                self._rows.pop(holder, None)
                self._maps.pop(holder, None)
                continue
            try:
                buf = map_file(self.directory / file.rstrip(b"\0").decode(), 0, False)
                self.regions.attach(holder, buf)
            except (OSError, ValueError):
                continue  # moved again meanwhile: the next look finds where
            self._rows[holder] = row_gen
            self._maps[holder] = buf
        if front.generation() == gen:
            self._known = gen

    @property
    def n_holders(self) -> int:
        self.follow()
        return int(self.regions.n_holders)

    def size(self, holder: int) -> int:
        self.follow()
        return int(self.regions.size(holder)) if self.regions.attached(holder) else 0

    def capacity(self, holder: int) -> int:
        self.follow()
        return int(self.regions.capacity(holder)) if self.regions.attached(holder) else 0

    def total(self) -> int:
        self.follow()
        return int(self.regions.total())

    def match(self, holder: int, chain: Buffer) -> int:
        self.follow()
        return int(self.regions.match(holder, chain)) if self.regions.attached(holder) else 0

    def match_after(self, holder: int, chain: Buffer, evicted: int) -> int:
        self.follow()
        return int(self.regions.match_after(holder, chain, evicted)) if self.regions.attached(holder) else 0

    def match_after_many(self, holder: int, chains: Iterable[Buffer], evicted: Iterable[int]) -> list[int]:
        self.follow()
        if self.regions.attached(holder):
            return self.regions.match_after_many(holder, chains, evicted)
        return [0] * (len(list(chains)) * len(list(evicted)))

    def match_all(self, chain: Buffer, out: Buffer) -> None:
        """Each holder's match into `out`, for the holders it has room for: one the writer laid
        out after the caller sized it (a shard's process adds holders at any time) is left out."""
        self.follow()
        room = len(memoryview(out))
        if room >= self.regions.n_holders:
            self.regions.match_all(chain, out)
            return
        whole = array("i", bytes(4 * self.regions.n_holders))
        self.regions.match_all(chain, whole)
        memoryview(out)[:] = memoryview(whole)[:room]

    def memory_bytes(self) -> int:
        return int(self.regions.memory_bytes())

    @property
    def torn(self) -> int:
        return int(self.regions.torn)

    def close(self) -> None:
        self.regions = Regions()
        self._maps.clear()
        self._rows.clear()
        self._known = -1


__all__ = ["MAX_HOLDERS", "SharedIndex", "SharedIndexReader", "clear_shard", "first_pool", "max_pool", "shard_of"]
