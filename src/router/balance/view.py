"""Where the balance loop finds sessions, their prompts and per-vnode traffic, and how it moves
sessions.

A lone router proxies every request itself, so its own session table, prompt store and traffic
counters are the whole truth (`LocalSessions`). With worker processes the requests pass through
the workers, and each keeps its own; the control process asks them over their private Unix
sockets (`router.proxy.internal.WorkerLink`). Both answer the same questions, so the balance loop
does not care which it has.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from router.proxy.app import Router

# (key, replica, seconds left, written unix ms)
SessionEntry = tuple[bytes, str, float, int]


class LinkDown(RuntimeError):
    """No worker answered: what they know cannot be had now (they are stopping, or starting)."""


class SessionSource(Protocol):
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


class LocalSessions:
    """The sessions of a lone router: its own table, prompt store and counters."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def live(self, replica: str | None = None) -> list[SessionEntry]:
        return self.router.sessions.live(replica)

    async def prompts(self, keys: list[bytes]) -> dict[bytes, tuple[str, bytes]]:
        store = self.router.balancer.prompts
        return {key: stored for key in keys if (stored := store.get(key)) is not None}

    async def move(self, keys: list[bytes], replica: str, reason: str) -> list[tuple[bytes, int]]:
        sessions = self.router.sessions
        return [(key, sessions.written_ms(key)) for key in keys if sessions.move(key, replica, reason)]

    async def restore(self, entries: list[SessionEntry]) -> None:
        for key, replica, left, written in entries:
            self.router.sessions.restore(key, replica, left, written)

    async def traffic(self) -> Counter[tuple[str, int]]:
        return Counter()  # the balancer counts this process's requests itself

    async def version(self) -> int:
        return self.router.sessions.version
