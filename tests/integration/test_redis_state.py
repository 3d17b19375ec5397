"""Two routers sharing routing state through a real redis-server started by the test."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from chat import turn

from router.bench.faults import RedisServer
from router.keys import RoutingKey

AUTH = {"Authorization": "Bearer t"}


@pytest.fixture
async def redis_server() -> AsyncIterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    server = RedisServer(binary)
    await server.start()
    yield server
    await server.stop()


async def wait_for(predicate: Any, timeout: float = 5.0) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def test_two_routers_decide_alike_and_survive_redis_going_away(start_fleet, start_router, redis_server) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(5)
    named = [f"{r.options.replica_id}={r.url}" for r in fleet.replicas]
    settings = {"state": redis_server.url, "admin_token": "t", "health_checks": "false", "rebalance": "false"}
    a, url_a = await start_router(named[:3], **settings)
    b, url_b = await start_router(named[:3], **settings)
    await wait_for(lambda: a.redis.online and b.redis.online)
    await wait_for(lambda: a.redis.leader != b.redis.leader, 3)  # exactly one of them rebalances

    def members(router: Any) -> list[str]:
        return sorted(r.id for r in router.fleet.replicas)

    # sessions served through A are known to B
    sessions = [f"s{i}" for i in range(30)]
    served = {s: await turn(url_a, s) for s in sessions}
    await asyncio.sleep(0.3)  # session writes are batched every 100 ms
    # a membership change and an override made on A reach B within a second
    async with aiohttp.ClientSession() as http:
        async with http.post(
            url_a + "/admin/replicas", json={"id": "emu-3", "url": fleet.replicas[3].url}, headers=AUTH
        ) as r:
            assert r.status == 201
        moved_session = sessions[0]
        _, origin, number = a.fleet.ring.locate(moved_session.encode())
        new_owner = next(rid for rid in ("emu-0", "emu-1", "emu-2") if rid != served[moved_session])
        override = {"origin": a.fleet.ring.replica_ids[origin], "vnode": number, "owner": new_owner}
        async with http.post(url_a + "/admin/overrides", json=override, headers=AUTH) as r:
            assert r.status == 200
    took = await wait_for(lambda: members(b) == members(a) and b.fleet.ring.overrides == a.fleet.ring.overrides)
    assert took < 1.0 and members(b) == ["emu-0", "emu-1", "emu-2", "emu-3"]
    # the same inputs give the same decisions on both
    keys = [RoutingKey(f"user-{i}".encode(), "header", "x-session-id") for i in range(10_000)]
    assert [a.policy.pick(k, None, ()).index for k in keys] == [b.policy.pick(k, None, ()).index for k in keys]  # type: ignore[union-attr]
    assert [a.fleet.replicas[i].id for i in range(4)] == [b.fleet.replicas[i].id for i in range(4)]
    # a session served (or moved by the scale-out) through A goes where its cache is through B,
    # although its vnode may have moved since
    await asyncio.sleep(0.3)
    expected = {s: a.sessions.get(s.encode()) for s in sessions}
    assert expected[moved_session] in (served[moved_session], "emu-3")
    for s in sessions:
        assert await turn(url_b, s) == expected[s]

    # Redis goes away: both keep routing on what they know; a change made meanwhile is kept
    await redis_server.stop()
    await wait_for(lambda: not a.redis.online and not b.redis.online, 5)
    async with aiohttp.ClientSession() as http, http.delete(url_a + "/admin/replicas/emu-1", headers=AUTH) as r:
        assert r.status == 200
    for i in range(10):
        await turn(url_a, f"offline-{i}")
        await turn(url_b, f"offline-{i}")
    assert "emu-1" in members(b)  # B cannot know yet
    # Redis comes back, empty: the routers write back what they know and B learns of the removal
    await redis_server.start()
    await wait_for(lambda: a.redis.online and b.redis.online, 10)
    await wait_for(lambda: members(b) == members(a) == ["emu-0", "emu-2", "emu-3"], 5)
    assert b.fleet.ring.overrides == a.fleet.ring.overrides


async def test_workers_share_sessions_via_redis(start_fleet, start_router, serve_workers, redis_server) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3)
    named = [f"{r.options.replica_id}={r.url}" for r in fleet.replicas]
    lone, url_lone = await start_router(
        named, state=redis_server.url, admin_token="t", health_checks="false", rebalance="false"
    )
    workers = await serve_workers(named, "--state", redis_server.url, "--no-health-checks", "--no-rebalance")
    await wait_for(lambda: lone.redis.online)
    ring = lone.fleet.ring
    # sessions served by either side, then their vnodes handed elsewhere: the ring now says go
    # elsewhere, and only the session records in Redis say where their caches are
    through_workers = {f"w{i}": await turn(workers.url, f"w{i}") for i in range(12)}
    through_lone = {f"l{i}": await turn(url_lone, f"l{i}") for i in range(12)}
    await asyncio.sleep(0.5)  # session writes are batched every 100 ms
    moved: dict[tuple[int, int], str] = {}
    for session, replica in (through_workers | through_lone).items():
        _, origin, number = ring.locate(session.encode())
        if (origin, number) not in moved:
            moved[(origin, number)] = next(r for r in ("emu-0", "emu-1", "emu-2") if r != replica)
    async with aiohttp.ClientSession() as http:
        for (origin, number), owner in moved.items():
            override = {"origin": ring.replica_ids[origin], "vnode": number, "owner": owner}
            async with http.post(url_lone + "/admin/overrides", json=override, headers=AUTH) as r:
                assert r.status == 200
    await asyncio.sleep(1.5)  # the control process follows Redis, the workers follow the control process
    for session, replica in through_workers.items():  # the lone router has never seen these
        assert await turn(url_lone, session) == replica
    for session, replica in through_lone.items():  # nor have the workers seen these
        assert await turn(workers.url, session) == replica
