"""Health in the loop: sick replicas leave routing and come back with a ramp; busy ones stay."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from waiting import until

from router.emulator.engine import EngineConfig

FAST_PROBES = {"probe_interval_s": 0.05, "probe_timeout_s": 0.5, "recovery_ramp_s": 0.5}


def named(replicas: Any) -> list[str]:
    return [f"{r.options.replica_id}={r.url}" for r in replicas]


async def chat(url: str, session: str, max_tokens: int = 8, stream: bool = True) -> tuple[int, str]:
    body = {
        "messages": [{"role": "user", "content": f"hello from {session}"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers={"X-Session-ID": session}) as r,
    ):
        await r.read()
        return r.status, r.headers.get("X-Router-Replica", "")


async def test_a_crashed_replica_is_removed_and_returns_with_a_ramp(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(4)
    router, url = await start_router(named(fleet.replicas), **FAST_PROBES)
    victim = fleet.replicas[1]
    state = router.fleet.find("emu-1")
    assert state is not None
    owned = [f"s{i}" for i in range(400) if router.fleet.ring.lookup(f"s{i}".encode()) == 1]
    keys, fresh = owned[:5], owned[5:10]
    await victim.crash()
    await until(lambda: state.state == "removed", 'state.state == "removed"', 5)
    assert not router.fleet.ring.available[1]
    for key in keys:  # its sessions go to their ring successors and keep working
        status, served = await chat(url, key)
        assert status == 200 and served != "emu-1"
    await victim.restart()
    await until(lambda: state.state == "recovering", 'state.state == "recovering"', 5)
    assert 0 < router.fleet.ring.weights[1] < 1  # ramping, not its whole share at once
    await until(
        lambda: state.state == "healthy" and router.fleet.ring.weights[1] == 1.0,
        "the replica healthy at full weight",
        5,
    )
    # its keys come back: new sessions land on it again; sessions that moved while it was out stay
    # where their cache now is (sticky) until their entry expires
    assert all(router.fleet.ring.lookup(k.encode()) == 1 for k in keys)
    for key in fresh:
        assert (await chat(url, key))[1] == "emu-1"


async def test_a_slow_replica_is_removed_by_its_latency(start_fleet, start_router, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="router.health")
    fleet = await start_fleet(4, time_scale=10.0)
    router, url = await start_router(named(fleet.replicas), **FAST_PROBES)
    fleet.replicas[2].set_faults({"slow": 20})
    state = router.fleet.find("emu-2")
    assert state is not None
    deadline = time.monotonic() + 20
    batch = 0
    while state.state != "removed" and time.monotonic() < deadline:
        await asyncio.gather(*(chat(url, f"b{batch}-{i}") for i in range(16)))
        batch += 1
    assert state.state == "removed"
    assert all(r.state in ("healthy", "suspect") for r in router.fleet.replicas if r.id != "emu-2")
    # the log says why, with the score's inputs
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("replica emu-2: ")]
    assert any("-> removed" in line and "latency_ratio" in line for line in said), said


async def test_a_busy_replica_is_never_removed(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3, time_scale=10.0)
    router, url = await start_router(named(fleet.replicas), **FAST_PROBES)
    key = next(f"k{i}" for i in range(200) if router.fleet.ring.lookup(f"k{i}".encode()) == 0)
    # eight long replies at once on one replica, short ones elsewhere, for ~2 s of probing
    long = [asyncio.ensure_future(chat(url, key, max_tokens=200)) for _ in range(8)]
    end = time.monotonic() + 2.0
    i = 0
    while time.monotonic() < end:
        await chat(url, f"short-{i}")
        i += 1
    assert all(status == 200 for status, _ in await asyncio.gather(*long))
    assert router.monitor.rounds > 20
    assert [r.health.transitions for r in router.fleet.replicas] == [0, 0, 0]


async def test_a_surge_that_queues_every_replica_removes_none(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    # two sequences at a time each: 210 long replies at once leave tens waiting on every replica,
    # past the queue penalty's midpoint: overload, not sickness, so routing keeps all three
    fleet = await start_fleet(3, EngineConfig(num_blocks=4000, max_num_seqs=2, max_num_batched_tokens=256))
    # the surge must reach the engines' queues: the router's overload hold (max_queued auto) would keep
    # it at the edge, and on a busy machine refuse part of it (429s) as past its TTFT target
    router, url = await start_router(named(fleet.replicas), max_queued=0, **FAST_PROBES)
    deepest = [0.0, 0.0, 0.0]
    states: set[str] = set()

    def watch() -> None:
        for i, r in enumerate(router.fleet.replicas):
            states.add(r.state)
            if r.inputs is not None and r.inputs.waiting is not None:
                deepest[i] = max(deepest[i], r.inputs.waiting)

    router.monitor.after_round = watch
    answers = await asyncio.gather(*(chat(url, f"surge-{i}", max_tokens=100) for i in range(210)))
    assert all(status == 200 for status, _ in answers), Counter(status for status, _ in answers)
    # every replica queued, and the deepest queues alone would have scored them below removal
    assert min(deepest) > 8 and max(deepest) > 36
    # the deepest of the moment may be suspect for a probe or two (it is past its peers), never out
    assert states <= {"healthy", "suspect"}
    assert all(r.state in ("healthy", "suspect") for r in router.fleet.replicas)


async def test_admin_and_metrics_show_health(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    router, url = await start_router(named(fleet.replicas), admin_token="tttttttttttttttt", **FAST_PROBES)
    await until(lambda: router.monitor.rounds >= 2, "router.monitor.rounds >= 2", 5)
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/admin/replicas", headers={"Authorization": "Bearer tttttttttttttttt"}) as r:
            listed = await r.json()
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    assert listed[0]["score"] == 1.0 and listed[0]["state"] == "healthy"
    assert listed[0]["engine"]["waiting"] == 0 and listed[0]["engine"]["kv_usage"] == 0
    assert 'router_replica_score{replica="emu-0"} 1.0' in text
    assert 'router_replica_routable{replica="emu-1"} 1.0' in text
    assert listed[0]["inputs"]["probe_ok"] is True and listed[0]["inputs"]["waiting"] == 0
    assert listed[0]["inputs"]["gpu_temperature_c"] is None  # no agent: unknown, not zero
    assert 'router_replica_state{replica="emu-0",state="healthy"} 1.0' in text
    assert 'router_replica_state{replica="emu-0",state="removed"} 0.0' in text
    assert 'router_replica_health_input{input="probe_ok",replica="emu-1"} 1.0' in text
    assert 'router_replica_health_input{input="kv_usage",replica="emu-1"} 0.0' in text
    assert 'input="gpu_temperature_c"' not in text


async def test_agent_figures_join_the_score(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    gpu: dict[str, Any] = {"temperature_c": 60.0, "throttle_reasons": 0x4, "ecc_uncorrected": 0}
    taken_at = {"delta": 0.0}

    async def stats(request: web.Request) -> web.Response:
        body = {
            "replica_id": "emu-0",
            "taken_at": time.time() - taken_at["delta"],
            "gpus": [gpu],
            "engine": {},
            "missing": [],
        }
        return web.json_response(body)

    app = web.Application()
    app.router.add_get("/stats", stats)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    agent_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        fleet = await start_fleet(2)
        router, _ = await start_router(named(fleet.replicas), agents=[f"emu-0={agent_url}"], **FAST_PROBES)
        state = router.fleet.find("emu-0")
        assert state is not None
        await until(lambda: router.monitor.rounds >= 5, "router.monitor.rounds >= 5", 5)
        assert state.state == "healthy" and state.health.score == 1.0  # a power cap alone is normal
        gpu["ecc_uncorrected"] = 2
        await until(lambda: state.state == "removed", 'state.state == "removed"', 5)  # failing GPU memory takes it out
        taken_at["delta"] = 3600.0  # a stale reading (ECC errors and all) is ignored, not trusted
        await until(lambda: state.state in ("recovering", "healthy"), 'state.state in ("recovering", "healthy")', 5)
    finally:
        await runner.cleanup()


async def test_each_jump_is_counted_with_its_reason(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(4)
    router, url = await start_router(named(fleet.replicas), admin_token="tttttttttttttttt", **FAST_PROBES)
    owned = {i: [f"j{k}" for k in range(400) if router.fleet.ring.lookup(f"j{k}".encode()) == i][:3] for i in range(4)}
    for keys in owned.values():
        for key in keys:
            assert (await chat(url, key))[0] == 200

    def jumps() -> dict[str, float]:
        return {
            labels["reason"]: value
            for labels, value in (
                (s.labels, s.value)
                for metric in router.metrics.jumps.collect()
                for s in metric.samples
                if s.name.endswith("_total")
            )
        }

    await fleet.replicas[1].crash()  # health
    await until(lambda: router.fleet.find("emu-1").state == "removed", "emu-1 removed", 5)  # type: ignore[union-attr]
    for key in owned[1]:
        assert (await chat(url, key))[1] != "emu-1"
    auth = {"Authorization": "Bearer tttttttttttttttt"}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/admin/replicas/emu-2/drain", headers=auth) as r:  # drain
            assert r.status == 200 and (await r.json())["sessions_to_move"] >= 3  # with some of emu-1's
        await until(lambda: not router.balancer.tasks, "the moves done", 5)  # warmed on their new owners, then moved
        for key in owned[2]:
            assert (await chat(url, key))[1] != "emu-2"
        async with s.delete(url + "/admin/replicas/emu-3", headers=auth) as r:  # membership
            assert r.status == 200
    for key in owned[3]:
        assert (await chat(url, key))[1] != "emu-3"
    assert jumps() == {"health": 3.0, "drain": 3.0, "membership": 3.0}
    for key in owned[0]:
        assert (await chat(url, key))[1] == "emu-0"  # sticky: no jump
    assert jumps() == {"health": 3.0, "drain": 3.0, "membership": 3.0}
