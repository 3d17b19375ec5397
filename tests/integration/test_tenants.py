"""Tenants of a shared fleet, on emulated replicas: priority classes through a saturated fleet, a
sheddable request refused for a time-to-first-token target no replica can meet, token budgets
shared by two routers on a real redis-server, and the overload held by the router as shipped."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from waiting import probe_rounds

from router.emulator.engine import EngineConfig
from router.emulator.server import Fleet, Replica

SLOW = 1.0  # engine seconds per wall second: a 20-token reply takes about 0.2 s


def keys_file(path: Path, keys: list[tuple[str, str, str]], tenants: str = "") -> str:
    text = "".join(
        f'[[keys]]\nid = "{kid}"\ntenant = "{tenant}"\nsha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'
        for key, kid, tenant in keys
    )
    path.write_text(text + tenants)
    return str(path)


async def post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, Any, dict[str, Any], float]:
    """(status, headers, JSON body, seconds to the answer)."""
    start = time.monotonic()
    async with http.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers) as r:
        return r.status, r.headers, await r.json(content_type=None), time.monotonic() - start


def chat(text: str, max_tokens: int = 20) -> dict[str, Any]:
    return {"model": "emulated-llm", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}


async def small_fleet(make_replica: Callable[..., Replica]) -> Fleet:
    """Two replicas of two slots each: four requests at once, about twenty a second."""
    fleet = Fleet(
        [make_replica(f"emu-{i}", EngineConfig(num_blocks=4000, max_num_seqs=2), time_scale=SLOW) for i in range(2)]
    )
    await fleet.start()
    return fleet


async def test_a_higher_class_is_served_ahead_of_a_batch_flood_at_three_times_capacity(
    make_replica: Callable[..., Replica], start_router: Callable[..., Any], tmp_path: Path
) -> None:
    tenants = '[[tenants]]\nname = "batch"\npriority = "bulk"\n[[tenants]]\nname = "chat"\npriority = "interactive"\n'
    path = keys_file(tmp_path / "keys.toml", [("sk-batch", "b", "batch"), ("sk-chat", "c", "chat")], tenants)
    fleet = await small_fleet(make_replica)
    try:
        node, url = await start_router(
            [r.url for r in fleet.replicas],
            client_keys_file=path,
            admin_token="tttttttttttttttt",
            full_waiting=1,
            max_queued=16,  # held by count: the order is the subject, not the time each may wait
            queue_timeout_s=10.0,
            probe_interval_s=0.1,
        )
        await probe_rounds(node)  # the engines' queues are known
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            # the batch tenant floods first: 36 requests where the fleet runs 4 at once and queues 2
            began = time.monotonic()
            flood = [
                asyncio.create_task(post(http, url, chat(f"batch {i}"), {"Authorization": "Bearer sk-batch"}))
                for i in range(36)
            ]
            await asyncio.sleep(0.3)
            # then the chat tenant, once the flood waits in the router; four more ask below its class
            wanted = {"Authorization": "Bearer sk-chat"}
            later = time.monotonic() - began  # when the chat tenant's requests (and those after) were sent
            asked = [asyncio.create_task(post(http, url, chat(f"chat {i}"), wanted)) for i in range(4)]
            lower = [
                asyncio.create_task(post(http, url, chat(f"chat low {i}"), wanted | {"X-Priority": "bulk"}))
                for i in range(4)
            ]
            # and a header never lifts a request above its tenant's class
            lifted = asyncio.create_task(
                post(http, url, chat("batch lifted"), {"Authorization": "Bearer sk-batch", "X-Priority": "system"})
            )
            chats = await asyncio.wait_for(asyncio.gather(*asked), 30)
            floods = await asyncio.wait_for(asyncio.gather(*flood, *lower, lifted), 60)
    finally:
        await fleet.stop()
    assert all(status == 200 for status, *_ in chats), [c[:1] for c in chats]
    # when each answer ended, counted from the flood's start (the order matters here, not how long a
    # round of the fleet's work takes on a busy machine)
    chat_ends = sorted(later + t for *_, t in chats)
    flood_ends = sorted(t for status, *_, t in floods[:36] if status == 200)
    # every flood request the router admitted was waiting before the chat tenant asked; the chat
    # tenant's requests went ahead of those still waiting in the router: at least a whole round of
    # the fleet's (four) ended after the last chat request (eight here, six on CI once), where first
    # come, first served would end none
    assert sum(end > chat_ends[-1] for end in flood_ends) >= 4, (chat_ends, flood_ends)
    # asked bulk: went with the flood, behind the whole chat class; the bulk class shares its turns
    # between tenants, so they alternate with the batch tenant's (the last of them comes seven
    # releases after the last chat request, more than the fleet runs and queues at once)
    lows = floods[36:40]
    assert all(status == 200 for status, *_ in lows) and max(later + t for *_, t in lows) > chat_ends[-1]
    assert floods[40][0] in (200, 429)


async def test_a_sheddable_request_is_refused_for_a_target_no_replica_can_meet(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    fleet = await start_fleet(2)
    # a slow prefill, as the router guesses it before it has learnt: 1,000 tokens a second
    node, url = await start_router([r.url for r in fleet.replicas], policy="ttft", prefill_tokens_per_s=1000)
    long = chat("lorem ipsum dolor sit amet " * 300, max_tokens=4)  # about 2,000 tokens: two seconds to predict
    async with aiohttp.ClientSession() as http:
        sheddable = {"X-Priority": "sheddable", "x-slo-ttft-ms": "100"}
        status, headers, body, _ = await post(http, url, long, sheddable)
        assert status == 429 and body["error"]["code"] == "ttft_target_unmet", body
        assert int(headers["Retry-After"]) >= 1 and "x-slo-ttft-ms" in body["error"]["message"]
        assert all(r.engine.prompt_tokens_total == 0 for r in fleet.replicas)  # nothing reached a replica
        # a request of another class with the same target is served, late rather than never
        status, *_ = await post(http, url, long, {"x-slo-ttft-ms": "100"})
        assert status == 200
        # and a sheddable one whose target is met
        status, *_ = await post(http, url, chat("short"), {"X-Priority": "sheddable", "x-slo-ttft-ms": "60000"})
        assert status == 200
        # a target or class that is no value is the client's error, in its API's shape
        status, _, body, _ = await post(http, url, chat("x"), {"x-slo-ttft-ms": "soon"})
        assert status == 400 and body["error"]["code"] == "invalid_ttft_target"
        status, _, body, _ = await post(http, url, chat("x"), {"X-Priority": "urgent"})
        assert status == 400 and body["error"]["code"] == "invalid_priority"
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        assert 'router_shed_total{model="emulated-llm",priority="sheddable",reason="target"} 1.0' in await r.text()
    assert node.admission.queued == 0


async def test_a_budget_is_shared_by_two_routers_on_redis(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any], redis_server: Any, tmp_path: Path
) -> None:
    # 600 tokens a minute (10 a second) for team-a; team-b has none
    tenants = '[[tenants]]\nname = "team-a"\ntokens_per_minute = 600\n'
    path = keys_file(tmp_path / "keys.toml", [("sk-a", "a", "team-a"), ("sk-b", "b", "team-b")], tenants)
    fleet = await start_fleet(2)
    urls = [r.url for r in fleet.replicas]
    shared = {
        "state": redis_server.url,
        "client_keys_file": path,
        "admin_token": "tttttttttttttttt",
        "health_checks": "false",
    }
    _, one = await start_router(urls, **shared)
    _, two = await start_router(urls, **shared)
    used = 0
    refused: list[tuple[int, Any, dict[str, Any]]] = []
    start = time.monotonic()
    async with aiohttp.ClientSession() as http:
        for i in range(40):  # each reserves its prompt and 40 tokens, and uses about 30
            status, headers, body, _ = await post(
                http, (one, two)[i % 2], chat(f"turn {i}", 40), {"Authorization": "Bearer sk-a"}
            )
            if status == 200:
                used += body["usage"]["total_tokens"]
            else:
                refused.append((status, headers, body))
        elapsed = time.monotonic() - start
        # the other tenant has no budget: it is served however much team-a used
        for url in (one, two):
            status, *_ = await post(http, url, chat("b", 40), {"Authorization": "Bearer sk-b"})
            assert status == 200
    assert refused, "team-a was never refused: no budget held"
    for status, headers, body in refused:
        assert status == 429 and body["error"]["code"] == "tokens_per_minute_exceeded"
        assert "team-a" in body["error"]["message"] and 1 <= int(headers["Retry-After"]) <= 60
    # both routers drew from one bucket: served no more than it held, what refilled, and one
    # request's worth of estimates (each taken whole from a bucket that held enough)
    assert used <= 600 + 10 * elapsed + 100, (used, elapsed)
    assert used >= 300, used  # usage settled the reservations: refunds let more through than the estimates


async def test_the_router_as_shipped_holds_an_overload(
    make_replica: Callable[..., Replica], start_router: Callable[..., Any]
) -> None:
    fleet = await small_fleet(make_replica)
    try:
        node, url = await start_router([r.url for r in fleet.replicas], probe_interval_s=0.1)  # no max_queued
        assert node.admission.on and node.admission.auto
        await probe_rounds(node)
        assert node.admission.max_queued == 16  # four slots in all, the floor of sixteen
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, *(len(r.engine.waiting) for r in fleet.replicas))
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            results = await asyncio.gather(*(post(http, url, chat(f"r{i}"), {}) for i in range(60)))
        watcher.cancel()
    finally:
        await fleet.stop()
    statuses = [status for status, *_ in results]
    # the engines' queues stay at full_waiting (8) and a few sent as they filled; what the router
    # cannot hold gets its 429 at once instead of waiting in an engine's queue
    assert peak <= 10, peak
    assert 429 in statuses and statuses.count(200) >= 20, statuses


async def test_at_three_times_a_small_fleets_capacity_as_shipped_few_answers_are_late(
    make_replica: Callable[..., Replica], start_router: Callable[..., Any]
) -> None:
    # the fleet: two replicas of four slots; a 64-token reply in about 0.65 s: about 12 a second
    fleet = Fleet(
        [make_replica(f"emu-{i}", EngineConfig(num_blocks=4000, max_num_seqs=4), time_scale=SLOW) for i in range(2)]
    )
    await fleet.start()
    results: list[tuple[int, float | None, str | None]] = []  # status, time to first byte, Retry-After

    async def one(http: aiohttp.ClientSession, i: int) -> None:
        start = time.monotonic()
        body = chat(f"request {i}", 64) | {"stream": True}
        ttft = None
        async with http.post(url + "/v1/chat/completions", data=orjson.dumps(body)) as r:
            async for chunk in r.content.iter_any():  # its first token (not the opening role event)
                if ttft is None and r.status == 200 and b'"content":"' in chunk.replace(b'"content":""', b""):
                    ttft = time.monotonic() - start
            results.append((r.status, ttft, r.headers.get("Retry-After")))

    try:
        node, url = await start_router([r.url for r in fleet.replicas])  # the router as shipped
        assert node.admission.auto
        rng = random.Random(7)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            tasks = []
            end = time.monotonic() + 6.0
            while time.monotonic() < end and len(tasks) < 400:  # Poisson arrivals at about 36 a second
                tasks.append(asyncio.create_task(one(http, len(tasks))))
                await asyncio.sleep(rng.expovariate(36.0))
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
    finally:
        await fleet.stop()
    late = [t for status, t, _ in results if status == 200 and t is not None and t > 2.0]
    served = [t for status, t, _ in results if status == 200]
    shed = [after for status, _, after in results if status == 429]
    assert len(served) + len(shed) == len(results), sorted({s for s, *_ in results})
    assert all(after is not None and int(after) >= 1 for after in shed)
    # what the router cannot start in time it refuses at once; of all answers, 5 % at most came late
    assert len(late) <= 0.05 * len(results), (len(late), len(served), len(shed))
    print(f"{len(results)} requests: {len(served) - len(late)} in time, {len(late)} late, {len(shed)} refused")
    assert len(served) >= 40 and shed, (len(served), len(shed))  # the fleet was kept busy, the rest refused


async def test_a_request_is_held_through_a_scale_up_from_zero(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any], tmp_path: Path
) -> None:
    fleet = await start_fleet(1)
    admin = {"Authorization": "Bearer tttttttttttttttt"}
    # a fleet scaled to zero: discovery finds no replica, as DNS finds none of a Deployment at 0
    found = tmp_path / "replicas.txt"
    found.write_text("")
    node, url = await start_router(
        [],
        discovery=f"file:{found}",
        discovery_interval_s=0.1,
        admin_token="tttttttttttttttt",
        scale_from_zero_s=30,
        rebalance_window_s=0.2,
        probe_interval_s=0.1,
    )
    async with aiohttp.ClientSession() as http:

        async def scale() -> dict[str, Any]:
            async with http.get(url + "/admin/scale", headers=admin) as r:
                assert r.status == 200
                return await r.json()  # type: ignore[no-any-return]

        async with http.get(url + "/health") as r:  # ready to hold requests, though no replica is
            assert r.status == 200 and (await r.json())["status"] == "scaled_to_zero"
        deadline = time.monotonic() + 10
        while (signal := await scale())["recommended_replicas"] != 0:  # idle for a window: it may go to zero
            assert time.monotonic() < deadline, signal
            await asyncio.sleep(0.05)
        waiting = asyncio.create_task(post(http, url, chat("first after a quiet night", 4), {}))
        while (signal := await scale())["held"] != 1 or signal["recommended_replicas"] < 1:
            assert time.monotonic() < deadline and not waiting.done(), signal  # held, and a replica asked for
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert not waiting.done()  # it waits while none is ready
        found.write_text(f"emu-0={fleet.replicas[0].url}\n")  # the autoscaler started one; discovery finds it
        status, headers, body, _ = await asyncio.wait_for(waiting, 20)
    assert status == 200 and headers["X-Router-Replica"] == "emu-0", body
    assert node.admission.queued == 0


async def test_a_request_no_replica_starts_for_gets_a_503_with_retry_after(
    start_router: Callable[..., Any], tmp_path: Path
) -> None:
    found = tmp_path / "replicas.txt"
    found.write_text("")
    _, url = await start_router([], discovery=f"file:{found}", scale_from_zero_s=0.5)
    async with aiohttp.ClientSession() as http:
        status, headers, body, took = await post(http, url, chat("anyone there?", 4), {})
    assert status == 503 and body["error"]["code"] == "no_replica_ready", body
    assert int(headers["Retry-After"]) >= 1 and took >= 0.5
