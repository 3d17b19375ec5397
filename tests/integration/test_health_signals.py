"""The health signal parser reads the emulator's (vLLM-named) metrics."""

from __future__ import annotations

import aiohttp

from router.health.signals import parse_engine_metrics


async def test_the_emulators_metrics_parse(replica) -> None:  # type: ignore[no-untyped-def]
    async with aiohttp.ClientSession() as s, s.get(replica.url + "/metrics") as resp:
        stats = parse_engine_metrics(await resp.text())
    assert stats.waiting == 0 and stats.running == 0 and stats.kv_usage == 0 and stats.fragmentation == 0
