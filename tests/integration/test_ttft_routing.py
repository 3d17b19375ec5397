"""The `ttft` policy in front of emulated replicas: keyless conversations reach their cache, the index
learns the engines' KV size and prefill speed, /admin/route explains, /metrics counts."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from router.emulator.engine import EngineConfig

MODEL = "emulated-llm"
SYSTEM = {"role": "system", "content": "You answer questions about the document the user gives. " * 4}
AUTH = {"Authorization": "Bearer t0k-admin-token-0"}


def named(replicas: Any) -> list[str]:
    return [f"{r.options.replica_id}={r.url}" for r in replicas]


def document(i: int, tokens: int = 1500) -> str:
    return (f"Document {i}: " + f"section {i} says something particular. " * tokens)[: tokens * 4]


async def ask(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], stream: bool = False
) -> tuple[str, dict[str, Any], str]:
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with http.post(url + "/v1/chat/completions", data=orjson.dumps(body)) as r:
        assert r.status == 200, await r.text()
        replica = r.headers["X-Router-Replica"]
        if not stream:
            reply = orjson.loads(await r.read())
            return replica, reply["usage"], reply["choices"][0]["message"]["content"]
        usage: dict[str, Any] = {}
        text = []
        async for line in r.content:
            if line.startswith(b"data: {"):
                event = orjson.loads(line[6:])
                usage = event.get("usage") or usage
                text += [c["delta"].get("content", "") for c in event.get("choices", [])]
        return replica, usage, "".join(text)


async def test_keyless_conversations_reach_their_cache(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(4, EngineConfig(num_blocks=4000))
    router, url = await start_router(named(fleet.replicas), admin_token="t0k-admin-token-0", probe_interval_s=0.2)
    later_hits = []
    first_hits = []
    homes: dict[int, set[str]] = {}
    async with aiohttp.ClientSession() as http:
        for i in range(6):  # six documents, two conversations each, three turns, no session key at all
            for who in range(2):
                history = [SYSTEM, {"role": "user", "content": document(i) + f"\nReader {who}: what is it about?"}]
                for turn in range(3):
                    replica, usage, text = await ask(http, url, history, stream=turn == 1)
                    cached = usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"]
                    (later_hits if turn else first_hits).append(cached)
                    homes.setdefault(i, set()).add(replica)
                    history = [*history, {"role": "assistant", "content": text}, {"role": "user", "content": "and?"}]
        assert min(later_hits) > 0.9, later_hits  # every later turn found its history
        # the second reader of each document found it too, on its first turn: no key said where
        assert sorted(first_hits)[len(first_hits) // 2] > 0.8, first_hits
        assert len(set().union(*homes.values())) >= 2  # documents spread over the fleet
        # the index learnt the engines' KV size from vllm:cache_config_info
        placement = router.placement
        for _ in range(50):
            if all(r.engine.kv_tokens for r in router.fleet.replicas):
                break
            await asyncio.sleep(0.1)
        assert all(r.engine.kv_tokens == 4000 * 16 for r in router.fleet.replicas)
        # 64 bytes a block at the bytes per token the answers showed (the emulator's: 4)
        assert abs(placement.of(router.fleet.replicas[0]).engine_blocks - 4000 * 16 * 4 // 64) <= 40
        figures = placement.figures()
        assert figures["predicted_hit_rate"] is not None and figures["prediction_error"] < 0.2
        # /admin/route explains the decision for a new reader of document 0
        probe = {"model": MODEL, "messages": [SYSTEM, {"role": "user", "content": document(0) + "\nNew reader?"}]}
        async with http.post(url + "/admin/route", data=orjson.dumps(probe), headers=AUTH) as r:
            assert r.status == 200
            explained = await r.json()
        assert explained["policy"] == "ttft" and explained["reason"] == "prefix"
        assert router.balancer.migrates is False  # vnode migration is the ring policies'
        best = explained["candidates"][0]
        assert best["replica"] == explained["replica"] and best["replica"] in homes[0]
        assert best["cached_tokens"] > 1400 and best["cost_s"] <= explained["candidates"][-1]["cost_s"]
        assert {"wait_s", "uncached_tokens", "gated", "prefill_tokens_per_s"} <= set(best)
        async with http.post(url + "/admin/route", data=b"[1", headers=AUTH) as r:
            assert r.status == 400 and "error" in await r.json()
        async with http.get(url + "/metrics") as r:
            metrics = await r.text()
        assert "router_prefix_index_blocks{" in metrics
        assert "router_prefix_predicted_tokens_total{" in metrics


async def test_streamed_answers_teach_each_replica_its_prefill_speed(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2, EngineConfig(num_blocks=4000, prefill_tokens_per_s=2000), time_scale=20.0)
    router, url = await start_router(named(fleet.replicas), prefill_tokens_per_s=1_000_000)
    async with aiohttp.ClientSession() as http:
        for i in range(8):
            messages = [SYSTEM, {"role": "user", "content": document(100 + i, 800)}]
            await ask(http, url, messages, stream=True)
    placement = router.placement
    learnt = [1 / placement.of(r).seconds_per_token for r in router.fleet.replicas if r.requests]
    # 2,000 engine tokens/s at 20 engine seconds per wall second: about 40,000 tokens per wall second
    assert learnt and all(10_000 < speed < 200_000 for speed in learnt), learnt
