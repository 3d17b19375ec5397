"""Token budgets shared through a real redis-server by two Budgets, each standing for a router pod."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from router.bench.faults import RedisServer
from router.tenancy.budgets import Budgets, RedisStore, Reservation


@pytest.fixture(scope="module")
def shared_redis() -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    server = RedisServer(binary)
    asyncio.run(server.start())
    yield server
    asyncio.run(server.stop())


@pytest.fixture
async def clients(shared_redis: RedisServer) -> AsyncIterator[list[aioredis.Redis]]:
    """One client per pod, each with its own connections: a pool that waits for one of its 20, as
    the router's does (a plain pool refuses a burst beyond its size, which would pass uncharged)."""
    made = [
        aioredis.Redis(
            connection_pool=aioredis.BlockingConnectionPool.from_url(
                shared_redis.url, max_connections=20, timeout=2, socket_timeout=2
            )
        )
        for _ in range(2)
    ]
    yield made
    for client in made:
        await client.aclose()


def pods(clients: list[aioredis.Redis], limits: dict[str, int], prefix: str) -> list[Budgets]:
    return [Budgets(limits, RedisStore(client, prefix), reserve_tokens=1024) for client in clients]


async def test_concurrent_pods_never_grant_more_than_the_budget(clients: list[aioredis.Redis]) -> None:
    a, b = pods(clients, {"acme": 1000}, "race:")  # refills 1000 / 60 a second: one request of 10 in 0.6 s
    start = time.monotonic()
    answers = await asyncio.gather(*((a if i % 2 else b).reserve("acme", 10) for i in range(300)))
    elapsed = time.monotonic() - start
    granted = [r for r in answers if isinstance(r, Reservation)]
    assert all(r.charged for r in granted)
    assert all(isinstance(r, int) and r >= 1 for r in answers if not isinstance(r, Reservation))
    assert 100 <= len(granted) <= 100 + int(elapsed * 1000 / 60 / 10), elapsed


async def test_a_settlement_on_one_pod_is_seen_by_the_other(clients: list[aioredis.Redis]) -> None:
    a, b = pods(clients, {"acme": 1000}, "settle:")
    taken = await a.reserve("acme", 1000)
    assert isinstance(taken, Reservation)
    assert await b.reserve("acme", 10) == 1
    a.settle_now(taken, 0)
    assert isinstance(a.store, RedisStore)
    await a.store.flush()  # (settlements go summed, every 100 ms)
    overrun = await b.reserve("acme", 1000)
    assert isinstance(overrun, Reservation)
    b.settle_now(overrun, 1100)
    await asyncio.sleep(0.3)  # sent on its own, within 100 ms
    assert await a.reserve("acme", 100) == 12  # 200 tokens short, 1000 / 60 a second


async def test_a_tenants_settlements_go_summed_in_one_script_and_closing_sends_what_is_owed(
    clients: list[aioredis.Redis],
) -> None:
    (a,) = pods(clients[:1], {"acme": 6000, "zeta": 6000}, "sum:")
    store = a.store
    assert isinstance(store, RedisStore)
    taken = [await a.reserve("acme", 100) for _ in range(30)] + [await a.reserve("zeta", 500)]
    assert all(isinstance(r, Reservation) and r.charged for r in taken)
    answered = store.answered  # the 31 reservations
    for reservation in taken:  # each used 40 tokens: acme is owed 30 x 60, zeta 460
        a.settle_now(reservation, 40)  # type: ignore[arg-type]
    assert store.answered == answered  # nothing sent yet ...
    await asyncio.sleep(0.3)
    assert store.answered == answered + 2  # ... then one script a tenant
    level = float((await clients[0].hget("sum:budget:acme", "level")) or 0)
    # (and what refilled meanwhile, 100 a second; without the settlements it would be near 3,000)
    assert level == pytest.approx(6000 - 30 * 40, abs=60)
    zeta = float((await clients[0].hget("sum:budget:zeta", "level")) or 0)
    assert zeta == pytest.approx(6000 - 40, abs=40)
    last = await a.reserve("acme", 1000)
    assert isinstance(last, Reservation)
    a.settle_now(last, 0)
    await store.close()  # sends the 1000 owed without waiting for the round
    assert float((await clients[0].hget("sum:budget:acme", "level")) or 0) == pytest.approx(6000 - 30 * 40, abs=120)


async def test_a_bucket_is_one_hash_that_expires_once_full_again(clients: list[aioredis.Redis]) -> None:
    (a,) = pods(clients[:1], {"slow": 60, "big": 1000}, "keys:")
    assert isinstance(await a.reserve("slow", 30), Reservation)
    level, at = await clients[0].hmget("keys:budget:slow", ["level", "at"])
    assert level is not None and at is not None
    assert float(level) == pytest.approx(30, abs=0.1)
    assert float(at) == pytest.approx(time.time(), abs=5)
    assert 140 <= await clients[0].ttl("keys:budget:slow") <= 150  # 30 s to refill, then two minutes
    assert isinstance(await a.reserve("big", 5000), Reservation)  # larger than the budget, from full
    assert await a.reserve("big", 10) == 241  # 4010 short, 1000 / 60 a second


async def test_fails_open_and_counts_when_redis_is_gone(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    client = aioredis.from_url(redis_server.url, socket_timeout=0.2, socket_connect_timeout=0.2)
    store = RedisStore(client, "gone:")
    budgets = Budgets({"acme": 1000}, store, reserve_tokens=1024)
    try:
        before = await budgets.reserve("acme", 10)
        assert before == Reservation("acme", 10)
        await redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="router.tenancy.budgets"):
            for _ in range(3):
                assert await budgets.reserve("acme", 5000) == Reservation("acme", 5000, charged=False)
            budgets.settle_now(before, 500)
            await store.flush()  # dropped: counted, not raised
        assert store.errors == 4
        assert len(caplog.records) == 1, caplog.records  # one warning a minute at most
    finally:
        await client.aclose()
