"""Where each session was served last, across this process, its sibling workers and other routers.

Three stores may know a session: this process's own table (`router.sessions.SessionTable`),
the shared-memory table the worker processes of one router write (`router.state.session_table.SharedSessions`),
and Redis, where several routers write (`router.state.redis.RedisSessions`). Every entry carries
the wall-clock time it was written; the newest wins. A turn served here is written to all three.
The directory knows the two shared stores only by the small protocols below, so it sits below them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from router.fleet import ReplicaState
from router.sessions import SessionTable, wall_ms


class SiblingSessions(Protocol):
    """The sessions the worker processes of one router share (in shared memory)."""

    def get(self, key: bytes) -> tuple[ReplicaState, int] | None: ...

    def put(self, key: bytes, replica: ReplicaState, written_ms: int) -> None: ...


class PeerSessions(Protocol):
    """The sessions several routers share (in Redis): looked up with a short time-out, written in batches."""

    async def lookup(self, key: bytes) -> tuple[str, int] | None: ...

    def served(self, key: bytes, replica: str, written_ms: int) -> None: ...


class SessionDirectory:
    def __init__(
        self,
        table: SessionTable,
        ttl_s: float,
        siblings: SiblingSessions | None = None,
        peers: PeerSessions | None = None,
        wall: Callable[[], int] = wall_ms,
    ) -> None:
        self.table = table
        self.ttl_s = ttl_s
        self.siblings = siblings
        self.peers = peers
        self._wall = wall

    @property
    def local_only(self) -> bool:
        """Whether this process's own table is all there is (no worker siblings, no peers): then
        `Routing.local_route` opens the same route as `Routing.route`, without awaiting."""
        return self.siblings is None and self.peers is None

    async def last_served(self, key: bytes, remember: bool = True) -> tuple[str | None, bool]:
        """Where the session was served last, and whether this process's own entry says so (else
        another worker's or router's newer news does). A session found only among the peers is
        entered here too, unless not `remember` (a lookup that routes nothing)."""
        table = self.table
        last = table.get(key)
        local = last is not None
        if self.siblings is None and self.peers is None:
            return last, local
        newest = table.written_ms(key) if last is not None else 0
        if self.siblings is not None:
            found = self.siblings.get(key)
            if found is not None and found[1] > newest:
                last, newest, local = found[0].id, found[1], False
        if self.peers is not None:
            shared = await self.peers.lookup(key)
            if shared is not None and shared[1] > newest:
                last, local = shared[0], False
                if remember:
                    table.restore(key, last, self.ttl_s - (self._wall() - shared[1]) / 1000, shared[1])
        return last, local

    def remember(self, key: bytes, replica: ReplicaState, started_ms: float) -> None:
        """`replica` served the session in a request that started at `started_ms` (wall clock): its
        next turn goes there, unless the router moved the session while the request ran."""
        table = self.table
        if table.moved(key) is not None and table.written_ms(key) > started_ms and table.get(key) != replica.id:
            return  # moved (drain, migration) while this request ran: its next turn goes where it was moved
        table.put(key, replica.id)
        written = table.written_ms(key)
        if self.siblings is not None:
            self.siblings.put(key, replica, written)
        if self.peers is not None:
            self.peers.served(key, replica.id, written)
