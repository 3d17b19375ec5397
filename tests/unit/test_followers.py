"""The control process's watch over its KV-event followers (router.proxy.followers): a follower
that keeps dying is started again less and less often, each shard on its own."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from router.config import ReplicaSpec, RouterConfig
from router.engines.kvfeed import IndexBudget
from router.proxy import followers
from router.proxy.followers import Followers


class Dead:
    pid = None
    exitcode = 1

    def is_alive(self) -> bool:
        return False


class Alive(Dead):
    def is_alive(self) -> bool:
        return True


async def test_a_follower_that_keeps_dying_is_started_less_and_less_often(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(followers, "WATCH_S", 0.01)
    monkeypatch.setattr(followers, "RESTART_BACKOFF_S", 0.05)
    monkeypatch.setattr(followers, "RESTART_BACKOFF_MAX_S", 0.4)
    config = RouterConfig(replicas=(ReplicaSpec("a", "http://a:1"),), workers=2, kv_event_followers=3)
    table: Any = SimpleNamespace(name="kvar-test-no-such-table")  # (no index: nothing to clear)
    watched = Followers(config, table, IndexBudget(1000), "/nonexistent")
    starts: dict[int, list[float]] = {1: [], 2: []}

    def start(shard: int) -> str | None:  # shard 1 dies at once every time; shard 2 lives once restarted
        starts[shard].append(time.monotonic())
        watched.procs[shard] = Dead() if shard == 1 else Alive()
        return "exited while starting" if shard == 1 else None

    monkeypatch.setattr(watched, "_start", start)
    watched.procs = {1: Dead(), 2: Dead()}
    watch = asyncio.create_task(watched.watch())
    await asyncio.sleep(1.6)
    watched.stopping = True
    await watch
    assert len(starts[2]) == 1  # started again once, and it lives
    gaps = [b - a for a, b in zip(starts[1], starts[1][1:], strict=False)]
    # 0.1, 0.2, 0.4, 0.4, ... (never the 0.05 of its first start again): without the doubling, 30
    assert 3 <= len(starts[1]) <= 8, starts[1]
    assert min(gaps) >= 0.09 and max(gaps) >= 0.35, gaps
