"""Where each session was served last: a bounded LRU with a time to live.

The affinity policy sends a session back to its last replica while the entry lives (its KV
cache is there); every policy uses it to count jumps (a session's request served by a different
replica than its previous one). Memory is bounded by `max_sessions`; an entry older than `ttl_s`
is gone, as the replica's cache will have evicted the conversation by then.

When the router itself moves a session (a migration of its vnode, a scale-out, a drain), it
rewrites the entry to the new replica, after warming that replica's cache, and marks it with the
reason; the session's next request goes there and its jump is counted under that reason.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Protocol

from router.errors import RouterError

# (key, replica, seconds left, written unix ms)
SessionEntry = tuple[bytes, str, float, int]


def wall_ms() -> int:
    """Now, in unix milliseconds: what session entries are stamped with (newest wins)."""
    return int(time.time() * 1000)


class SessionTable:
    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], int] = wall_ms,
    ) -> None:
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._clock = clock
        self._wall = wall
        # key -> (replica, expires, why the router moved it there or None, when written: unix ms)
        self._entries: OrderedDict[bytes, tuple[str, float, str | None, int]] = OrderedDict()
        self.version = 0  # goes up with every change (for saving only when something changed)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> str | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[1] < self._clock():
            del self._entries[key]
            return None
        return entry[0]

    def moved(self, key: bytes) -> str | None:
        """Why the router moved this session to its current replica, if it did (asked once per move)."""
        entry = self._entries.get(key)
        return entry[2] if entry is not None else None

    def written_ms(self, key: bytes) -> int:
        """When the entry was written (unix ms; 0 without one): newer news from elsewhere wins."""
        entry = self._entries.get(key)
        return entry[3] if entry is not None else 0

    def put(self, key: bytes, replica: str) -> None:
        self.version += 1
        now = self._clock()
        self._entries[key] = (replica, now + self.ttl_s, None, self._wall())
        self._entries.move_to_end(key)
        self._drop_expired(now)
        while len(self._entries) > self.max_sessions:
            self._entries.popitem(last=False)

    def _drop_expired(self, now: float) -> None:
        """Forget expired entries at the old end, so that memory follows the sessions alive within
        the TTL rather than filling up to `max_sessions` (amortised O(1) per put)."""
        entries = self._entries
        while entries:
            key = next(iter(entries))
            if entries[key][1] >= now:
                return
            del entries[key]

    def move(self, key: bytes, replica: str, reason: str, written_ms: int | None = None) -> bool:
        """The router moved a live session to `replica` (its cache has been warmed there)."""
        entry = self._entries.get(key)
        if entry is None or entry[1] < self._clock():
            return False
        self._entries[key] = (replica, entry[1], reason, self._wall() if written_ms is None else written_ms)
        self.version += 1
        return True

    def place(self, key: bytes, replica: str, reason: str, seconds_left: float, written_ms: int) -> None:
        """Another process moved this session to `replica`: enter it here too, marked with the
        reason, so the jump is counted by whichever process serves its next turn."""
        if seconds_left > 0:
            self._entries[key] = (replica, self._clock() + min(seconds_left, self.ttl_s), reason, written_ms)
            self._entries.move_to_end(key)
            self.version += 1
            while len(self._entries) > self.max_sessions:
                self._entries.popitem(last=False)

    def live(self, replica: str | None = None) -> list[tuple[bytes, str, float, int]]:
        """(key, replica, seconds left, written unix ms) of the live sessions (last served by
        `replica`, if given), oldest first."""
        now = self._clock()
        return [
            (k, r, expires - now, written)
            for k, (r, expires, _, written) in self._entries.items()
            if expires >= now and (replica is None or r == replica)
        ]

    def snapshot(self) -> tuple[float, list[tuple[bytes, tuple[str, float, str | None, int]]]]:
        """(now, every entry as (key, (replica, expires, moved reason, written ms))), copied at
        once, for work on it elsewhere (another thread) while the table goes on changing."""
        return self._clock(), list(self._entries.items())

    def restore(self, key: bytes, replica: str, seconds_left: float, written_ms: int | None = None) -> None:
        if seconds_left > 0:
            written = self._wall() if written_ms is None else written_ms
            self._entries[key] = (replica, self._clock() + min(seconds_left, self.ttl_s), None, written)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_sessions:
                self._entries.popitem(last=False)


class LinkDown(RouterError, RuntimeError):
    """No worker answered: what they know cannot be had now (they are stopping, or starting)."""


class SessionSource(Protocol):
    """Where the balance loop and the saved state find sessions, their prompts and per-vnode
    traffic: this process's own table (router.balance.view.LocalSessions) or, for the control
    process of worker processes, the workers' (router.balance.link.WorkerLink)."""

    async def live(self, replica: str | None = None) -> list[SessionEntry]:
        """The live sessions last served by `replica` (all, if None), oldest first."""
        ...

    async def prompts(self, keys: list[bytes]) -> dict[bytes, tuple[str, bytes]]:
        """The latest stored request (path, body) of each of `keys` that has one."""
        ...

    async def move(self, keys: list[bytes], replica: str, reason: str) -> list[tuple[bytes, int]]:
        """Point live sessions at `replica` (their caches were warmed there); (key, written ms)
        of those moved."""
        ...

    async def restore(self, entries: list[SessionEntry]) -> None:
        """Sessions from a saved routing state."""
        ...

    async def traffic(self) -> Counter[tuple[str, int]]:
        """Keyed requests per vnode counted elsewhere since the last call."""
        ...

    async def version(self) -> int:
        """Changes whenever a session entry does (to save the routing state only then)."""
        ...


class SessionView:
    """This node's `SessionSource` once it answers: a lone router's own at once; the control
    process's (its workers) once they have started; a worker has none."""

    def __init__(self, source: SessionSource | None, lone: bool) -> None:
        self.source = source
        self.lone = lone  # the source is this process's own table
        self.ready = asyncio.Event()
        if source is not None:
            self.ready.set()

    def attach(self, source: SessionSource, ready: bool = True) -> None:
        self.source = source
        if ready:
            self.ready.set()

    def current(self) -> SessionSource | None:
        """The source, if it answers now."""
        return self.source if self.ready.is_set() else None
