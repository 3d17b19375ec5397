"""Where each session was served last, shared by the worker processes of one host (router.shm).

With `--workers N` every worker answers turns of the same sessions; this table in the shared
segment lets a turn served or moved by one worker be followed by all (router.routing.directory
reads it as the sibling workers' sessions). The replica table itself is router.state.replica_table's.
"""

from __future__ import annotations

import time

from router.fleet import Fleet, ReplicaState
from router.ring import xxh3_64
from router.shm.table import SlotTable

PROBES = 8  # entries looked at from a key's home position, in each worker's table
ENTRY = 3  # uint64s per entry: tag, when it was written (ms), epoch << 16 | slot


class SharedSessions:
    """Where each session was served last, shared by the worker processes of one host.

    Each worker writes only its own open-addressing table in the segment; a lookup reads every
    worker's table and takes the most recently written live entry, so a session served or moved
    by one worker is followed by all. An entry is three uint64s: the key's XXH3 (never 0: 0 marks
    an empty entry), when it was written (unix milliseconds), and `epoch & 0xffff << 16 | slot`
    (the replica's slot and the low bits of its epoch, so an entry never names a replica that
    reused the slot). A writer clears the tag, writes the rest, then the tag; a reader accepts an
    entry only if the tag reads the same before and after. Entries are overwritten in place, never
    deleted, so a probe stops at the first empty entry; a full neighbourhood overwrites its oldest
    entry, so memory stays fixed.
    """

    def __init__(self, table: SlotTable, worker: int, fleet: Fleet, ttl_s: float) -> None:
        self.fleet = fleet
        self.tables = [table.sessions(w) for w in range(table.workers)]
        self.mine = self.tables[worker]
        self.mask = table.sticky_entries - 1
        self.ttl_ms = int(ttl_s * 1000)

    @staticmethod
    def _tag(key: bytes) -> int:
        return xxh3_64(key) or 1

    def put(self, key: bytes, replica: ReplicaState, written_ms: int | None = None) -> None:
        if replica.slot is None or self.mask < 0:
            return
        tag = self._tag(key)
        now = int(time.time() * 1000) if written_ms is None else written_ms
        table, mask = self.mine, self.mask
        home = tag & mask
        victim, oldest = home, None
        for step in range(PROBES):
            i = (home + step) & mask
            current = table[ENTRY * i]
            if current == tag or current == 0:
                victim = i
                break
            written = table[ENTRY * i + 1]
            if oldest is None or written < oldest:
                victim, oldest = i, written
        at = ENTRY * victim
        table[at] = 0  # readers skip the entry while it changes
        table[at + 1] = now
        table[at + 2] = (replica.epoch & 0xFFFF) << 16 | replica.slot
        table[at] = tag

    def get(self, key: bytes) -> tuple[ReplicaState, int] | None:
        """The replica that served the session most recently, on any worker, and when (unix ms),
        while the entry lives."""
        if self.mask < 0:
            return None
        tag = self._tag(key)
        home = tag & self.mask
        best_written, best_where = 0, 0
        for table in self.tables:
            for step in range(PROBES):
                at = ENTRY * ((home + step) & self.mask)
                current = table[at]
                if current == 0:
                    break  # nothing is ever deleted: the key is not further along
                if current != tag:
                    continue
                written, where = table[at + 1], table[at + 2]
                if table[at] == tag and written > best_written:
                    best_written, best_where = written, where
                break
        if not best_written or best_written + self.ttl_ms < time.time() * 1000:
            return None
        replica = self.fleet.by_slot.get(best_where & 0xFFFF)
        if replica is None or replica.index is None or replica.epoch & 0xFFFF != best_where >> 16 & 0xFFFF:
            return None
        return replica, best_written
