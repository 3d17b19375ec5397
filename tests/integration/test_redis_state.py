"""Two routers sharing routing state through a real redis-server started by the test."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from aiohttp import web
from chat import turn
from conftest import WORKERS_TOKEN
from redis.exceptions import RedisError
from waiting import took, until

from router.bench.common import free_port
from router.config import load
from router.health.states import RAMP_STEPS
from router.keys import RoutingKey
from router.node import Node
from router.proxy.app import build_app

AUTH = {"Authorization": "Bearer tttttttttttttttt"}


async def reconnect(router: Node) -> None:
    """What a router's follow loop does when it finds Redis back, at once (and again, as the loop
    would, while a connection from before the outage is still in its pool)."""
    for _ in range(100):
        try:
            await router.redis._connect()  # type: ignore[union-attr]
            return
        except RedisError:
            await asyncio.sleep(0.02)
    raise AssertionError("Redis did not come back")


async def in_redis(router: Node, sessions: list[str]) -> dict[str, str | None]:
    """Where the session records in Redis itself (not a router's writes still waiting for their
    batch) say each session was served last."""
    assert router.redis is not None
    values = await router.redis.redis.mget([router.redis.sessions._key(s.encode()) for s in sessions])
    return {
        s: (v if isinstance(v, bytes) else str(v).encode()).partition(b"\0")[0].decode() if v else None
        for s, v in zip(sessions, values, strict=True)
    }


async def test_two_routers_decide_alike_and_survive_redis_going_away(start_fleet, start_router, redis_server) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(5)
    named = [f"{r.options.replica_id}={r.url}" for r in fleet.replicas]
    settings = {
        "state": redis_server.url,
        "admin_token": "tttttttttttttttt",
        "health_checks": "false",
        "rebalance": "false",
    }
    a, url_a = await start_router(named[:3], **settings)
    b, url_b = await start_router(named[:3], **settings)
    await until(lambda: a.redis.online and b.redis.online, "both routers on Redis")
    await until(lambda: a.redis.leader != b.redis.leader, "one leader of the two", 3)  # exactly one of them rebalances

    def members(router: Any) -> list[str]:
        return sorted(r.id for r in router.fleet.replicas)

    # sessions served through A are known to B
    sessions = [f"s{i}" for i in range(30)]
    served = {s: await turn(url_a, s) for s in sessions}

    async def written() -> bool:  # session writes are batched every 100 ms
        return await in_redis(a, sessions) == served

    await until(written, "the sessions served through A written to Redis")
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
    elapsed = await took(
        lambda: members(b) == members(a) and b.fleet.ring.overrides == a.fleet.ring.overrides,
        "members(b) == members(a) and b.fleet.ring.overrides == a.fleet.ring.overrides",
    )
    assert elapsed < 1.0 and members(b) == ["emu-0", "emu-1", "emu-2", "emu-3"]
    # the same inputs give the same decisions on both
    keys = [RoutingKey(f"user-{i}".encode(), "header", "x-session-id") for i in range(10_000)]
    assert [a.policy.pick(k, None, ()).index for k in keys] == [b.policy.pick(k, None, ()).index for k in keys]  # type: ignore[union-attr]
    assert [a.fleet.replicas[i].id for i in range(4)] == [b.fleet.replicas[i].id for i in range(4)]
    # a session served (or moved by the scale-out) through A goes where its cache is through B,
    # although its vnode may have moved since

    async def moved_and_written() -> bool:  # the scale-out's moves (if any) done, and in Redis
        return not a.balancer.tasks and await in_redis(a, sessions) == {s: a.sessions.get(s.encode()) for s in sessions}

    await until(moved_and_written, "A's scale-out moves done and its session records written to Redis")
    expected = {s: a.sessions.get(s.encode()) for s in sessions}
    assert expected[moved_session] in (served[moved_session], "emu-3")
    for s in sessions:
        assert await turn(url_b, s) == expected[s]

    # Redis goes away: both keep routing on what they know; a change made meanwhile is kept
    await redis_server.stop()
    await until(lambda: not a.redis.online and not b.redis.online, "both routers off Redis", 5)
    async with aiohttp.ClientSession() as http, http.delete(url_a + "/admin/replicas/emu-1", headers=AUTH) as r:
        assert r.status == 200
    for i in range(10):
        await turn(url_a, f"offline-{i}")
        await turn(url_b, f"offline-{i}")
    assert "emu-1" in members(b)  # B cannot know yet
    # Redis comes back, empty: the routers write back what they know and B learns of the removal,
    # even when both find it back at the same moment (each one's loop may, by chance)
    await redis_server.start()
    await asyncio.gather(reconnect(b), reconnect(a))
    await until(lambda: a.redis.online and b.redis.online, "both routers on Redis", 10)
    await until(
        lambda: members(b) == members(a) == ["emu-0", "emu-2", "emu-3"],
        "the removal made while Redis was away, on both",
        5,
    )
    assert b.fleet.ring.overrides == a.fleet.ring.overrides


async def test_workers_share_sessions_via_redis(start_fleet, start_router, serve_workers, redis_server) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3)
    named = [f"{r.options.replica_id}={r.url}" for r in fleet.replicas]
    lone, url_lone = await start_router(
        named, state=redis_server.url, admin_token="tttttttttttttttt", health_checks="false", rebalance="false"
    )
    workers = await serve_workers(named, "--state", redis_server.url, "--no-health-checks", "--no-rebalance")
    await until(lambda: lone.redis.online, "lone.redis.online")
    ring = lone.fleet.ring
    # sessions served by either side, then their vnodes handed elsewhere: the ring now says go
    # elsewhere, and only the session records in Redis say where their caches are
    through_workers = {f"w{i}": await turn(workers.url, f"w{i}") for i in range(12)}
    through_lone = {f"l{i}": await turn(url_lone, f"l{i}") for i in range(12)}
    everyone = through_workers | through_lone

    async def written() -> bool:  # session writes are batched every 100 ms, in each process
        return await in_redis(lone, list(everyone)) == everyone

    await until(written, "the sessions served by the workers and by the lone router written to Redis")
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
    # the control process follows Redis, the workers follow the control process: wait until both
    # worker processes' rings give every session's vnode to its new owner
    owners = {s: moved[ring.locate(s.encode())[1:]] for s in everyone}  # type: ignore[index]
    seen: dict[tuple[int, str], str] = {}  # (worker, session): its ring owner, as last explained

    async def workers_follow() -> bool:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            for session in owners:  # a connection each: the kernel picks the worker per connection
                async with http.get(
                    workers.url + "/admin/route",
                    params={"key": session},
                    headers={"Authorization": f"Bearer {WORKERS_TOKEN}"},
                ) as r:
                    assert r.status == 200
                    answer = await r.json()
                seen[(answer["worker"], session)] = answer["ring_owner"]
        answered = {w for w, _ in seen}
        return len(answered) == 2 and all(seen.get((w, s)) == owner for w in answered for s, owner in owners.items())

    await until(workers_follow, "both worker processes following the overrides made on the lone router", 10)
    for session, replica in through_workers.items():  # the lone router has never seen these
        assert await turn(url_lone, session) == replica
    for session, replica in through_lone.items():  # nor have the workers seen these
        assert await turn(workers.url, session) == replica


class Served:
    """A router in this event loop, stopped and started again on the same port as a restart would."""

    def __init__(self, replicas: list[str], settings: dict[str, str]) -> None:
        self.config = load(None, {}, {"replicas": replicas, "state": "none", **settings})
        self.url = f"http://127.0.0.1:{self.config.port}"
        self.node: Node | None = None
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        self.node = Node(self.config)
        self.runner = web.AppRunner(build_app(self.node), handle_signals=False, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.config.port, reuse_address=True).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


async def _routes(http: aiohttp.ClientSession, url: str, keys: list[str]) -> list[tuple[Any, Any]]:
    """Where `url`'s router sends each key, and its ring owner, as /admin/route says."""
    limit = asyncio.Semaphore(32)

    async def one(key: str) -> tuple[Any, Any]:
        async with limit, http.get(url + "/admin/route", params={"key": key}, headers=AUTH) as r:
            assert r.status == 200
            answer = await r.json()
            return answer["replica"], answer["ring_owner"]

    return list(await asyncio.gather(*(one(k) for k in keys)))


async def test_routers_agree_at_once_after_a_restart(start_fleet, redis_server) -> None:  # type: ignore[no-untyped-def]
    """A slow start, a drain and an override are fleet-wide facts: a router that restarts while a
    replica added through its peer ramps up routes like its peer from its first answer on."""
    fleet = await start_fleet(5)
    named = [f"{r.options.replica_id}={r.url}" for r in fleet.replicas]
    # a 120 s slow start climbs in steps of 12 s (RAMP_STEPS): the checks below fall between steps
    settings = {
        "state": redis_server.url,
        "admin_token": "tttttttttttttttt",
        "health_checks": "false",
        "recovery_ramp_s": "120",
    }
    a = Served(named[:4], {**settings, "port": str(free_port())})
    b = Served(named[:4], {**settings, "port": str(free_port())})
    routers = [a, b]
    keys = [f"user-{i}" for i in range(1000)]
    step_s = 120 / RAMP_STEPS
    try:
        for router in routers:
            await router.start()
        assert a.node is not None and a.node.redis is not None
        await until(
            lambda: all(r.node is not None and r.node.redis is not None and r.node.redis.online for r in routers),
            "all(r.node is not None and r.node.redis is not None and r.node.redis.online for r in routers)",
        )
        async with aiohttp.ClientSession() as http:
            async with http.post(
                a.url + "/admin/replicas", json={"id": "emu-4", "url": fleet.replicas[4].url}, headers=AUTH
            ) as r:
                assert r.status == 201
                since = (await r.json())["slow_start_since"]
            assert since is not None

            async def restart_b_between_steps() -> float:
                """Restart B just after a step of the slow start; how long its /health took to answer."""
                into_step = (time.time() - since) % step_s
                await asyncio.sleep(step_s - into_step + 1.3)  # A's balance loop has stepped it by then
                await b.stop()
                started = time.monotonic()
                await b.start()
                async with http.get(b.url + "/health") as r:
                    assert r.status == 200
                return time.monotonic() - started

            async def agree() -> None:
                on_a, on_b = await asyncio.gather(_routes(http, a.url, keys), _routes(http, b.url, keys))
                # A's answers taken again: no step of the ramp fell within the comparison
                assert await _routes(http, a.url, keys) == on_a
                assert sum(x != y for x, y in zip(on_a, on_b, strict=True)) == 0
                assert {replica for replica, _ in on_a} >= {"emu-4"}  # the new replica takes a share already

            await asyncio.sleep(step_s)  # into the ramp's second step: a fresh slow start would differ
            assert await restart_b_between_steps() < step_s / 4
            assert b.node is not None and b.node.fleet.find("emu-4") is not None
            assert b.node.fleet.find("emu-4").state == "warming"  # type: ignore[union-attr]
            await agree()
            weights = [(r.id, a.node.fleet.ring.weights[r.index]) for r in a.node.fleet.replicas]  # type: ignore[index]
            assert [(r.id, b.node.fleet.ring.weights[r.index]) for r in b.node.fleet.replicas] == weights  # type: ignore[index]
            # a drain and an override, made on A: followed by B at once, and still after B restarts
            async with http.post(a.url + "/admin/replicas/emu-1/drain", headers=AUTH) as r:
                assert r.status == 200
            ring = a.node.fleet.ring
            _, origin, number = ring.locate(b"user-7")
            owner = next(rid for rid in ("emu-0", "emu-2", "emu-3") if rid != ring.replica_ids[origin])
            override = {"origin": ring.replica_ids[origin], "vnode": number, "owner": owner}
            async with http.post(a.url + "/admin/overrides", json=override, headers=AUTH) as r:
                assert r.status == 200
            node_b = b.node
            await until(
                lambda: node_b.fleet.ring.overrides == ring.overrides,
                "node_b.fleet.ring.overrides == ring.overrides",
                2,
            )
            assert node_b.fleet.find("emu-1").state == "draining"  # type: ignore[union-attr]
            await restart_b_between_steps()
            assert b.node.fleet.ring.overrides == ring.overrides and b.node.fleet.find("emu-1").state == "draining"  # type: ignore[union-attr]
            await agree()
    finally:
        for router in routers:
            await router.stop()


async def test_routers_on_one_redis_share_where_they_placed_new_prefixes(
    start_fleet, start_router, redis_server
) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(4)
    named = [f"{r.options.replica_id}={r.url}" for r in fleet.replicas]
    settings = {"state": redis_server.url, "health_checks": "false"}
    a, url_a = await start_router(named, **settings)
    b, url_b = await start_router(named, **settings)
    await until(lambda: a.redis.online and b.redis.online, "both routers on Redis")
    system = {"role": "system", "content": "Answer from the document. " * 8}
    documents = [f"Document {i}: " + f"paragraph {i} of a long report. " * 300 for i in range(6)]
    placed = {}
    async with aiohttp.ClientSession() as http:

        async def ask(url: str, doc: str, question: str) -> tuple[str, float]:
            body = {"max_tokens": 4, "messages": [system, {"role": "user", "content": doc + question}]}
            async with http.post(url + "/v1/chat/completions", json=body) as r:  # no session key at all
                reply = await r.json()
                usage = reply["usage"]
                return r.headers["X-Router-Replica"], usage["prompt_tokens_details"]["cached_tokens"] / usage[
                    "prompt_tokens"
                ]

        for doc in documents:  # the first reader of each document comes through router A
            placed[doc], _ = await ask(url_a, doc, "\nWhat is it about?")
        # B learns A's placements from Redis, never having routed a request
        await until(
            lambda: b.placements is not None and b.placements.learnt >= len(documents),
            "b.placements is not None and b.placements.learnt >= len(documents)",
        )
        for doc in documents:  # a second reader of each comes through B: it goes where A put the document
            replica, hit = await ask(url_b, doc, "\nAnd who wrote it?")
            assert replica == placed[doc] and hit > 0.9
    assert a.placements is not None and a.placements.told >= len(documents)


async def test_a_decode_replica_reaches_other_routers_with_its_role(start_fleet, start_router, redis_server) -> None:  # type: ignore[no-untyped-def]
    """A disaggregated fleet's decode replica added on one router (by discovery, which names its
    role) is a decode replica on every router on the same Redis, and after a restart from Redis:
    taken for an aggregated one, it would be sent requests whole as if it could prefill for itself."""
    from router.config import ReplicaSpec  # noqa: PLC0415

    fleet = await start_fleet(4)
    decode = [f"{r.options.replica_id}={r.url}" for r in fleet.replicas[:2]]
    settings = {
        "state": redis_server.url,
        "health_checks": "false",
        "rebalance": "false",
        "decode": decode,
        "prefill": [f"{fleet.replicas[3].options.replica_id}={fleet.replicas[3].url}"],
    }
    a, _ = await start_router([], **settings)
    b, _ = await start_router([], **settings)
    await until(lambda: a.redis.online and b.redis.online, "both routers on Redis")
    added = fleet.replicas[2]
    await a.membership.add(ReplicaSpec(added.options.replica_id, added.url, "decode"), discovered=True)
    await until(lambda: b.fleet.find(added.options.replica_id) is not None, "the replica added on A, on B")
    assert b.fleet.find(added.options.replica_id).role == "decode"  # type: ignore[union-attr]
    assert sorted((r.id, r.role) for r in b.fleet.replicas) == sorted((r.id, r.role) for r in a.fleet.replicas)
    c, _ = await start_router([], **settings)  # a router that joins later reads it from Redis
    await until(lambda: c.fleet.find(added.options.replica_id) is not None, "the replica added on A, on C")
    assert c.fleet.find(added.options.replica_id).role == "decode"  # type: ignore[union-attr]
