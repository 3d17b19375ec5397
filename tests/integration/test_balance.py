"""The balance loop on emulated replicas: migration with warm-up, scale-out, autoscaler signals."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import aiohttp
import chat
import orjson
from waiting import until

from router.balance.controller import Balancer
from router.balance.rebalance import Move
from router.balance.view import LocalSessions
from router.metrics import RouterMetrics
from router.sessions import LinkDown


def named(fleet: Any) -> list[str]:
    return [f"{r.options.replica_id}={r.url}" for r in fleet.replicas]


async def turn(url: str, session: str, text: str = "") -> str:
    return await chat.turn(url, session, f"{session} says " + (text or "hello " * 200))


def jumps(router: Any) -> dict[str, float]:
    return {
        s.labels["reason"]: s.value
        for metric in router.metrics.jumps.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    }


async def test_a_migration_warms_the_new_owner_then_moves_the_vnode_and_its_sessions(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3)
    # vnode migration is the ring policy's (under ttft, placement by cost steers work off a hot replica)
    router, url = await start_router(named(fleet), health_checks="false", policy="affinity")
    ring = router.fleet.ring
    sessions = [f"m{i}" for i in range(60)]
    for s in sessions:
        await turn(url, s)
    # the vnode of the first session served by emu-0, handed to emu-1
    key = next(s for s in sessions if ring.lookup(s.encode()) == 0)
    _, origin, number = ring.locate(key.encode())  # type: ignore[misc]
    on_vnode = [s for s in sessions if ring.locate(s.encode())[1:] == (origin, number)]  # type: ignore[index]
    target = fleet.replicas[1].engine
    before = target.prompt_tokens_total
    await router.balancer.migrate(Move(ring.replica_ids[origin], number, "emu-0", "emu-1", 0.5))
    assert ring.overrides == {(ring.replica_ids[origin], number): "emu-1"}
    assert target.prompt_tokens_total > before  # warmed: their prompts were computed on emu-1 first
    assert router.metrics.warmups.labels("ok")._value.get() == len(on_vnode)
    for s in on_vnode:  # their next turns go to the new owner and find their prefix cached
        cached = fleet.replicas[1].engine.cached_tokens_total
        assert await turn(url, s, "hello " * 200 + "and more") == "emu-1"
        assert fleet.replicas[1].engine.cached_tokens_total > cached
    assert jumps(router) == {"migration": float(len(on_vnode))}


async def test_scale_out_slow_start_and_warm_moves(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(4)
    router, url = await start_router(
        named(fleet)[:3], admin_token="tttttttttttttttt", health_checks="false", recovery_ramp_s="0.5"
    )
    sessions = [f"o{i}" for i in range(80)]
    for s in sessions:
        await turn(url, s)
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            url + "/admin/replicas",
            json={"id": "emu-3", "url": fleet.replicas[3].url},
            headers={"Authorization": "Bearer tttttttttttttttt"},
        ) as r,
    ):
        added = await r.json()
    assert r.status == 201 and added["state"] == "warming" and added["weight"] < 0.5
    moving = added["sessions_to_warm"]
    assert 0 < moving < len(sessions) / 2  # about a quarter of the keys now belong to it
    deadline = time.monotonic() + 5
    while router.balancer.tasks or router.fleet.find("emu-3").state != "healthy":  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert router.metrics.sessions_moved.labels("scale_out")._value.get() == moving
    served = [await turn(url, s, "hello " * 200 + "next") for s in sessions]
    assert served.count("emu-3") == moving  # exactly the warmed sessions moved; the rest stayed
    assert jumps(router) == {"scale_out": float(moving)}


async def test_autoscaler_signals(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    router, _ = await start_router(
        named(fleet), health_checks="false", scale_target_load="4", rebalance_window_s="10", rebalance="false"
    )
    # this test ticks a balancer of its own, on its own clock, into metrics of its own
    m = RouterMetrics()
    balancer = Balancer(
        router.config.balance,
        router.fleet,
        m,
        router.membership,
        router.view.current,
        router.upstream_client,
        sticky_ttl_s=router.config.sticky_ttl_s,
        prefill_anywhere=False,
    )
    await balancer.tick(100.0)
    assert m.scale_recommended._value.get() == 1 and m.scale_idle._value.get() == 0
    await balancer.tick(111.0)  # idle for a whole window
    assert m.scale_idle._value.get() == 1
    for r in router.fleet.replicas:
        r.inflight = 6  # as if 12 requests were in flight
    for t in range(112, 140):
        await balancer.tick(float(t))
    assert m.scale_recommended._value.get() == 3 and m.scale_idle._value.get() == 0
    for r in router.fleet.replicas:
        r.inflight = 0


async def test_a_drain_is_not_undone_by_a_request_still_running_there(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3, time_scale=1.0)  # real time: a long reply takes seconds
    router, url = await start_router(named(fleet), admin_token="tttttttttttttttt", health_checks="false")
    session = next(f"d{i}" for i in range(200) if router.fleet.ring.lookup(f"d{i}".encode()) == 0)
    assert await turn(url, session) == "emu-0"
    body = {"messages": [{"role": "user", "content": f"{session} says go on"}], "max_tokens": 150, "stream": True}
    async with aiohttp.ClientSession() as http:
        long = asyncio.ensure_future(
            http.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers={"X-Session-ID": session})
        )
        await until(fleet.replicas[0].engine.has_work, "the long reply running on emu-0")
        async with http.post(
            url + "/admin/replicas/emu-0/drain", headers={"Authorization": "Bearer tttttttttttttttt"}
        ) as r:
            assert r.status == 200
        deadline = time.monotonic() + 5
        while router.sessions.get(session.encode()) == "emu-0":  # warmed elsewhere and moved
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        moved_to = router.sessions.get(session.encode())
        resp = await long
        await resp.read()  # the long reply on the draining replica ends after the move
        resp.release()
    assert router.sessions.get(session.encode()) == moved_to != "emu-0"
    assert await turn(url, session, "hello " * 200 + "next") == moved_to


async def test_a_scale_out_whose_warm_up_fails_moves_nobody(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    router, url = await start_router(named(fleet), admin_token="tttttttttttttttt", health_checks="false")
    for i in range(40):
        await turn(url, f"w{i}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # nothing listens there
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            url + "/admin/replicas",
            json={"id": "dead", "url": f"http://127.0.0.1:{dead}"},
            headers={"Authorization": "Bearer tttttttttttttttt"},
        ) as r,
    ):
        assert (await r.json())["sessions_to_warm"] > 0
    deadline = time.monotonic() + 5
    while router.balancer.tasks:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert router.metrics.warmups.labels("failed")._value.get() > 0
    assert all(router.sessions.get(f"w{i}".encode()) != "dead" for i in range(40))  # they stay with their caches


async def test_a_migration_is_not_undone_by_a_request_running_there(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3, time_scale=1.0)  # real time: a long reply takes seconds
    router, url = await start_router(named(fleet), health_checks="false")
    ring = router.fleet.ring
    session = next(f"g{i}" for i in range(200) if ring.lookup(f"g{i}".encode()) == 0)
    assert await turn(url, session) == "emu-0"
    _, origin, number = ring.locate(session.encode())  # type: ignore[misc]
    body = {"messages": [{"role": "user", "content": f"{session} says go on"}], "max_tokens": 150, "stream": True}
    async with aiohttp.ClientSession() as http:
        long = asyncio.ensure_future(
            http.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers={"X-Session-ID": session})
        )
        await until(fleet.replicas[0].engine.has_work, "the long reply running on emu-0")
        await router.balancer.migrate(Move(ring.replica_ids[origin], number, "emu-0", "emu-2", 0.5))
        assert router.sessions.get(session.encode()) == "emu-2"
        resp = await long
        assert resp.headers["X-Router-Replica"] == "emu-0"
        await resp.read()  # the reply on the old owner ends after the move
        resp.release()
    assert router.sessions.get(session.encode()) == "emu-2"
    assert await turn(url, session, "hello " * 200 + "next") == "emu-2"
    assert jumps(router) == {"migration": 1.0}


async def test_a_drain_waits_to_know_the_sessions_before_it_removes(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3)
    router, url = await start_router(named(fleet), health_checks="false")
    sessions = [f"u{i}" for i in range(30)]
    where = {s: await turn(url, s) for s in sessions}
    on_emu0 = [s for s, r in where.items() if r == "emu-0"]
    assert on_emu0

    class Silent(LocalSessions):  # workers that do not answer at first, as while they start
        calls = 0

        async def live(self, replica: str | None = None) -> Any:
            Silent.calls += 1
            if Silent.calls <= 2:
                raise LinkDown("not yet")
            return await super().live(replica)

    router.view.attach(Silent(router.sessions, router.balancer.prompts))
    assert (await router.membership.drain("emu-0", remove=True))[1] is None
    # the drain asks again (a second "not yet"): one that took "unknown" for "none" would have removed it by now
    await until(lambda: Silent.calls >= 2 or router.fleet.find("emu-0") is None, "the drain asking again")
    assert router.fleet.find("emu-0") is not None  # not removed blind
    deadline = time.monotonic() + 10
    while router.fleet.find("emu-0") is not None:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert router.metrics.sessions_moved.labels("drain")._value.get() == len(on_emu0)  # moved, then removed
