"""The sessions of a lone router, as the balance loop asks for them: its own table, prompts and counters.

A lone router proxies every request itself, so its own session table and prompt store are the
whole truth. With worker processes each worker keeps its own, and the control process asks them
over their private sockets (router.balance.link.WorkerLink); both answer the same questions
(router.sessions.SessionSource), so the balance loop does not care which it has.
"""

from __future__ import annotations

from collections import Counter

from router.balance.warmup import PromptStore
from router.sessions import SessionEntry, SessionTable


class LocalSessions:
    def __init__(self, sessions: SessionTable, prompts: PromptStore) -> None:
        self.sessions = sessions
        self.store = prompts

    async def live(self, replica: str | None = None) -> list[SessionEntry]:
        return self.sessions.live(replica)

    async def prompts(self, keys: list[bytes]) -> dict[bytes, tuple[str, bytes]]:
        store = self.store
        return {key: stored for key in keys if (stored := store.get(key)) is not None}

    async def move(self, keys: list[bytes], replica: str, reason: str) -> list[tuple[bytes, int]]:
        sessions = self.sessions
        return [(key, sessions.written_ms(key)) for key in keys if sessions.move(key, replica, reason)]

    async def restore(self, entries: list[SessionEntry]) -> None:
        for key, replica, left, written in entries:
            self.sessions.restore(key, replica, left, written)

    async def traffic(self) -> Counter[tuple[str, int]]:
        return Counter()  # the balancer counts this process's requests itself

    async def version(self) -> int:
        return self.sessions.version
