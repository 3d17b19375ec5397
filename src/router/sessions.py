"""Where each session was served last: a bounded LRU with a time to live.

The affinity policy sends a session back to its last replica while the entry lives (its KV
cache is there); every policy uses it to count jumps (a session's request served by a different
replica than its previous one). Memory is bounded by `max_sessions`; an entry older than `ttl_s`
is gone, as the replica's cache will have evicted the conversation by then.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class SessionTable:
    def __init__(self, max_sessions: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> str | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        replica, expires = entry
        if expires < self._clock():
            del self._entries[key]
            return None
        return replica

    def put(self, key: bytes, replica: str) -> None:
        self._entries[key] = (replica, self._clock() + self.ttl_s)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_sessions:
            self._entries.popitem(last=False)

    def forget_replica(self, replica: str) -> int:
        """Drop the sessions of a replica that left; returns how many."""
        gone = [k for k, (r, _) in self._entries.items() if r == replica]
        for k in gone:
            del self._entries[k]
        return len(gone)
