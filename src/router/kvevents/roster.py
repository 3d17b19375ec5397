"""The roster of a shared event-fed index: what each followed engine's events say, for the readers.

The process that follows the engines (router.kvevents.shared.SharedIndex's writer) keeps one row
per replica's rank (its `Holdings`): whether its events are believed, its engine's block size and
capacity, its evictions (how many, the latest when), its last sequence number, its figures, and
which holders of the index are its tiers. `Roster.describe` rewrites a row after each message
applied; a reader process (a worker) builds its Truth's replicas from the rows in use
(`RosterReader.listed`) and reads each as a `Followed`, which answers what `Holdings` answers.

Several processes may write it, each following a shard of the engines (`shard` of `shards`): the
first lays it out, and each writes only its own rows (router.kvevents.mapped.Front), so readers
see one roster whoever follows which engine.

File: a front (router.kvevents.mapped.Front: magic, shards, each shard's generation and rows
used), then MAX_ROWS rows of 48 uint64 words:
generation (0: free), rank, believed, block size, capacity, evicted, when (a double: monotonic
seconds, the same clock in every process of a host), sequence + 2 (0: none), the eleven figures,
four (medium as 8 ASCII bytes, holder + 1) pairs, its eviction rate's window + 1, count at that
window's start and rate before it (a double), and the replica's id (UTF-8, 128 bytes). Each
word is whole to a reader; the words of a row may be a message apart, as an event in flight is.
A row's generation is written last when it is taken, and its shard's generation after it.
"""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import TYPE_CHECKING

from router.kvevents.holdings import Figures, MatchIndex, Rate, Tier, Tiers
from router.kvevents.mapped import (
    FRONT_BYTES,
    TAKE_STEP,
    Front,
    SharedFileError,
    Taken,
    map_existing,
    map_file,
    shard_check,
    unlink_file,
)

if TYPE_CHECKING:
    from router.kvevents.holdings import Holdings

MAX_ROWS = 16_384
_MAGIC = int.from_bytes(b"kvarros2", "little")
RESTART_GEN_STEP = 1 << 32  # a shard's writer restarted numbers its changes from this far past its predecessor's
_ROW_WORDS = 48
_R_GEN, _R_RANK, _R_SURE, _R_BLOCK, _R_CAPACITY, _R_EVICTED, _R_EVICTED_AT, _R_SEQ = range(8)
_R_FIGURES = 8  # Figures' counters, in their order, from here
_R_TIERS = 20  # four (medium, holder + 1) pairs: the medium as 8 bytes of ASCII
_MAX_TIERS = 4
_R_RATE_WINDOW, _R_RATE_START, _R_RATE_BEFORE = 28, 29, 30  # its eviction Rate's state (window + 1; a double)
_R_ID = 32  # the replica's id, UTF-8, NUL-padded
_ID_BYTES = 8 * (_ROW_WORDS - _R_ID)


class Roster:
    """A writer's roster file: shard 0 lays it out; shard k of `shards` writes rows k, k + shards, ...
    of the one shard 0 laid out (which must be there), clearing first what a writer of that shard
    before it left."""

    def __init__(self, path: Path, shard: int = 0, shards: int = 1) -> None:
        shard_check(shard, shards)
        self.path = path
        self.shard, self.shards = shard, shards
        size = FRONT_BYTES + MAX_ROWS * 8 * _ROW_WORDS
        try:
            self._file = map_file(path, size, True, TAKE_STEP) if shard == 0 else map_existing(path)
        except OSError as exc:
            raise SharedFileError(f"cannot lay out the roster {path}: {exc}") from None
        if shard == 0:
            self._front = Front.lay_out(self._file, _MAGIC, shards)
        else:
            self._front = Front.joined(self._file, _MAGIC, path, shards)
        # its rows' pages, taken as they come into use (a later shard's from the start: taking pages taken is a no-op)
        self._taken = Taken(path, size, min(TAKE_STEP, size) if shard == 0 else 0)
        self._rows = memoryview(self._file)[FRONT_BYTES:].cast("Q")
        self._floats = memoryview(self._file)[FRONT_BYTES:].cast("d")
        self._gen, self._count = self._front.of(shard)  # (0, 0), unless a writer of this shard was here before
        self._next = shard  # the next row never used
        self._free: list[int] = []
        if self._gen:  # what the writer before it left (also past the count it said, if it died between): no replica's
            for row in range(shard, MAX_ROWS, shards):
                if self._rows[row * _ROW_WORDS + _R_GEN]:
                    self._rows[row * _ROW_WORDS + _R_GEN] = 0
                    self._count = max(self._count, row + 1)
            self._gen += RESTART_GEN_STEP
            self._changed()

    def enlist(self, replica_id: str, rank: int) -> int:
        """A roster row for one replica's rank (its Holdings); `describe` fills it."""
        name = replica_id.encode()
        if len(name) > _ID_BYTES:
            raise SharedFileError(f"replica id {replica_id!r} is longer than {_ID_BYTES} bytes")
        row = min(self._free) if self._free else self._next
        if row >= MAX_ROWS:
            raise SharedFileError(f"the roster has room for {MAX_ROWS} replicas' ranks")
        at = row * _ROW_WORDS
        self._taken.cover(FRONT_BYTES + 8 * (at + _ROW_WORDS))  # (SharedFileError: no room; nothing taken)
        if self._free:
            self._free.remove(row)
        else:
            self._next += self.shards
            self._count = max(self._count, row + 1)
        self._rows[at : at + _ROW_WORDS] = array("Q", bytes(8 * _ROW_WORDS))
        self._rows[at + _R_RANK] = rank
        self._file[FRONT_BYTES + 8 * (at + _R_ID) : FRONT_BYTES + 8 * (at + _R_ID) + len(name)] = name
        self._gen += 1
        self._rows[at + _R_GEN] = self._gen  # last: the row is whole once it is in use
        self._changed()
        return row

    def delist(self, row: int) -> None:
        self._rows[row * _ROW_WORDS + _R_GEN] = 0
        self._free.append(row)
        self._gen += 1
        self._changed()

    def _changed(self) -> None:
        self._front.set(self.shard, self._gen, self._count)

    def describe(self, row: int, h: Holdings) -> None:
        """Writes what `h` says now into its row: believed or not, its engine's block size and
        capacity, its evictions, its last sequence number, its figures and its tiers' holders.
        Each word is whole to a reader; the words together may be a message apart."""
        rows, at = self._rows, row * _ROW_WORDS
        rows[at + _R_SURE] = 1 if h.sure else 0
        rows[at + _R_BLOCK] = h.block_size or 0
        rows[at + _R_CAPACITY] = h.capacity
        rows[at + _R_EVICTED] = h.evicted
        self._floats[at + _R_EVICTED_AT] = h.evicted_at
        rows[at + _R_SEQ] = 0 if h.seq is None else h.seq + 2  # (-1 after a replay from 0: 1)
        rate = h.rate
        rows[at + _R_RATE_START] = rate.start
        self._floats[at + _R_RATE_BEFORE] = rate.before
        rows[at + _R_RATE_WINDOW] = rate.window + 1
        f = h.figures
        rows[at + _R_FIGURES : at + _R_FIGURES + 11] = array(
            "Q",
            (
                f.batches,
                f.stored,
                f.removed,
                f.cleared,
                f.orphans,
                f.gaps,
                f.replayed,
                f.restarts,
                f.duplicates,
                f.unsure_episodes,
                f.long_way,
            ),
        )
        if rows[at + _R_TIERS + 2 * min(len(h.tiers), _MAX_TIERS) - 1] == 0:  # a tier it did not have before
            for k, (medium, tier) in enumerate(list(h.tiers.items())[:_MAX_TIERS]):
                rows[at + _R_TIERS + 2 * k] = int.from_bytes(medium.encode()[:8].ljust(8, b"\0"), "little")
                rows[at + _R_TIERS + 2 * k + 1] = tier.holder + 1

    def close(self) -> None:
        """The first shard's removes the file (its readers keep what they mapped); a later shard's
        clears its rows, for the others follow on."""
        if self.shard == 0:
            unlink_file(self.path)
            return
        for row in range(self.shard, self._count, self.shards):
            self._rows[row * _ROW_WORDS + _R_GEN] = 0
        self._gen += 1
        self._changed()


class RosterReader:
    """A reader's mapping of a roster file."""

    def __init__(self, path: Path) -> None:
        try:
            self._file = map_file(path, 0, False)
        except OSError as exc:
            raise SharedFileError(f"cannot read the roster {path}: {exc}") from None
        if len(self._file) < FRONT_BYTES + MAX_ROWS * 8 * _ROW_WORDS:
            raise SharedFileError(f"{path} is not a shared index's roster")
        self._front = Front.joined(self._file, _MAGIC, path)
        self.rows = memoryview(self._file)[FRONT_BYTES:].cast("Q")
        self.floats = memoryview(self._file)[FRONT_BYTES:].cast("d")

    @property
    def generation(self) -> int:
        """Moves whenever a replica's rank is enlisted or delisted (by any shard's writer)."""
        return self._front.generation()

    def listed(self) -> list[tuple[int, str, int]]:
        """(row, replica id, rank) of every replica's rank the writer follows now."""
        out = []
        for row in range(self._front.count()):
            at = row * _ROW_WORDS
            gen = self.rows[at + _R_GEN]
            if not gen:
                continue
            start = FRONT_BYTES + 8 * (at + _R_ID)
            name = bytes(self._file[start : start + _ID_BYTES]).rstrip(b"\0").decode(errors="replace")
            if self.rows[at + _R_GEN] == gen:  # not delisted and reused meanwhile
                out.append((row, name, int(self.rows[at + _R_RANK])))
        return out


class Followed(Tiers):
    """One replica's rank as a reader of the shared index sees it: what `Holdings` tells Truth,
    read from its roster row and its holders' regions (router.kvevents.truth, on a worker)."""

    words = _ROW_WORDS

    # the words of its row a read of it checks on every request (router.placement.events: believed,
    # block size, and the second tier's holder, which says its engine began another tier)
    SURE, BLOCK, SECOND_TIER = _R_SURE, _R_BLOCK, _R_TIERS + 3

    def __init__(self, roster: RosterReader, index: MatchIndex, row: int, changes: list[int] | None = None) -> None:
        self.rows, self.floats = roster.rows, roster.floats
        self.index = index
        self.at = row * _ROW_WORDS
        self.gen = int(self.rows[self.at + _R_GEN])  # the row's, when read: another replica's rank once it moves
        self.tiers: dict[str, Tier] = {}
        # bumped when what this process keeps of it changes (suspected, a tier found): as Holdings'
        self.changes = [0] if changes is None else changes
        self.suspect_seq: int | None = None  # its health went down here: the row's seq then
        self._tiers()

    @property
    def current(self) -> bool:
        """Its row still holds the rank it held when read (not delisted and enlisted again since:
        its holders may then be others)."""
        return bool(self.rows[self.at + _R_GEN] == self.gen)

    def _tiers(self) -> None:
        rows = self.rows
        for k in range(_MAX_TIERS):
            holder = rows[self.at + _R_TIERS + 2 * k + 1]
            if not holder:
                break
            medium = int(rows[self.at + _R_TIERS + 2 * k]).to_bytes(8, "little").rstrip(b"\0").decode()
            if medium not in self.tiers:
                self.tiers[medium] = Tier(holder - 1)
                self.changes[0] += 1

    @property
    def sure(self) -> bool:
        rows = self.rows
        if self.suspect_seq is not None:
            if rows[self.at + _R_SEQ] == self.suspect_seq:
                return False  # no message since its health went down
            self.suspect_seq = None
            self.changes[0] += 1
        if len(self.tiers) < _MAX_TIERS and rows[self.at + _R_TIERS + 2 * len(self.tiers) + 1]:
            self._tiers()  # its engine began another tier
        return bool(rows[self.at + _R_SURE])

    def suspect(self) -> None:
        """Its health went down: not believed here until its next message (the writer decides)."""
        if self.suspect_seq is None:
            self.suspect_seq = int(self.rows[self.at + _R_SEQ])
            self.changes[0] += 1

    @property
    def seq(self) -> int | None:
        seq = int(self.rows[self.at + _R_SEQ])
        return None if seq == 0 else seq - 2

    @property
    def block_size(self) -> int | None:
        return int(self.rows[self.at + _R_BLOCK]) or None

    @property
    def capacity(self) -> int:
        return int(self.rows[self.at + _R_CAPACITY])

    @property
    def evicted(self) -> int:
        return int(self.rows[self.at + _R_EVICTED])

    @property
    def evicted_at(self) -> float:
        return float(self.floats[self.at + _R_EVICTED_AT])

    @property
    def figures(self) -> Figures:
        start = self.at + _R_FIGURES
        return Figures(*(int(v) for v in self.rows[start : start + 11]))

    def eviction_rate(self, now: float) -> float:
        """As Holdings.eviction_rate, from the writer's Rate (its words may be a message apart:
        the rate then is one message off, as an event in flight makes it)."""
        rows, at = self.rows, self.at
        window = int(rows[at + _R_RATE_WINDOW]) - 1
        before = float(self.floats[at + _R_RATE_BEFORE])
        return Rate.of(now, window, int(rows[at + _R_RATE_START]), before, int(rows[at + _R_EVICTED]))


__all__ = ["MAX_ROWS", "Followed", "Roster", "RosterReader"]
