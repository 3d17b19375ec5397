"""Balance with worker processes: the control process moves the sessions the workers saw.

Scale-out, drain and overheat migration warm and move sessions served by either worker; the
moves, warm-ups and jumps show in any worker's /metrics; a restart brings the workers' sessions
back from the state file. Sessions are placed by the ring (`--policy affinity`) here: where
each lands, which vnode it is on, what overheats, is then known in advance.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

TOKEN = "workers-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = "tell me more " * 150


def named(fleet: Any) -> list[str]:
    return [f"{r.options.replica_id}={r.url}" for r in fleet.replicas]


async def ask(url: str, session: str, text: str = PROMPT, max_tokens: int = 4) -> tuple[str, str]:
    """One chat turn on a fresh connection (the kernel picks the worker): (worker, replica)."""
    body = {"messages": [{"role": "user", "content": f"{session}: {text}"}], "max_tokens": max_tokens, "stream": True}
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
        s.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers={"X-Session-ID": session}) as r,
    ):
        await r.read()
        assert r.status == 200
        return r.headers["X-Router-Worker"], r.headers["X-Router-Replica"]


async def admin(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, url + path, json=body, headers=AUTH) as r,
    ):
        return r.status, await r.json()


async def scrape(url: str) -> dict[str, float]:
    """Every sample of a worker's /metrics, by its line's name and labels."""
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
        s.get(url + "/metrics") as r,
    ):
        text = await r.text()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


async def settled(url: str, sent: int) -> None:
    """Every request sent is booked (a worker books a turn just after its client read the end)."""
    deadline = time.monotonic() + 10
    while True:
        samples = await scrape(url)
        if sum(v for k, v in samples.items() if k.startswith("router_requests_total{")) >= sent:
            return
        assert time.monotonic() < deadline, "requests sent were never counted"
        await asyncio.sleep(0.05)


async def until(url: str, name: str, at_least: float, timeout: float = 15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        samples = await scrape(url)
        if samples.get(name, 0.0) >= at_least:
            return samples
        assert time.monotonic() < deadline, f"{name} stayed at {samples.get(name, 0.0)}, below {at_least}"
        await asyncio.sleep(0.1)


async def test_scale_out_and_drain_move_what_both_workers_served(start_fleet, serve_workers) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(4)
    served = await serve_workers(
        named(fleet)[:3], "--policy", "affinity", "--no-health-checks", "--recovery-ramp-s", "0.5"
    )
    url = served.url
    sessions = [f"w{i}" for i in range(60)]
    workers = set()
    for s in sessions:
        worker, _ = await ask(url, s)
        workers.add(worker)
    assert workers == {"0", "1"}
    await settled(url, len(sessions))

    # scale-out: the sessions whose keys now belong to emu-3 are found on both workers, warmed, moved
    status, added = await admin(url, "POST", "/admin/replicas", {"id": "emu-3", "url": fleet.replicas[3].url})
    assert status == 201 and added["state"] == "warming"
    moving = added["sessions_to_warm"]
    assert 0 < moving < len(sessions) / 2
    await until(url, 'router_sessions_moved_total{reason="scale_out"}', moving)
    samples = await scrape(url)
    assert samples['router_sessions_moved_total{reason="scale_out"}'] == moving
    assert samples['router_warmup_requests_total{result="ok"}'] == moving
    where = {s: (await ask(url, s, PROMPT + " again"))[1] for s in sessions}
    assert list(where.values()).count("emu-3") == moving  # exactly the warmed ones moved
    await settled(url, 2 * len(sessions))
    samples = await scrape(url)
    assert samples['router_session_jumps_total{reason="scale_out"}'] == moving  # counted by whichever worker
    assert 'router_session_jumps_total{reason="spill"}' not in samples

    # drain: emu-0's sessions (served by either worker) move to their ring owners, then it leaves
    on_emu0 = [s for s, r in where.items() if r == "emu-0"]
    assert on_emu0
    status, drained = await admin(url, "POST", "/admin/replicas/emu-0/drain?remove=true")
    assert status == 200 and drained["sessions_to_move"] == len(on_emu0)
    await until(url, 'router_sessions_moved_total{reason="drain"}', len(on_emu0))
    deadline = time.monotonic() + 10
    while "emu-0" in {r["id"] for r in (await admin(url, "GET", "/admin/replicas"))[1]}:
        assert time.monotonic() < deadline, "the drained replica was never removed"
        await asyncio.sleep(0.1)
    for s in sessions:
        assert (await ask(url, s, PROMPT + " again and again"))[1] != "emu-0"
    # a turn's jump is counted as its answer ends: the last one may land a moment after the client has it
    samples = await until(url, 'router_session_jumps_total{reason="drain"}', len(on_emu0))
    assert samples['router_session_jumps_total{reason="drain"}'] == len(on_emu0)
    assert not any(name.startswith("router_replica_load{") and "emu-0" in name for name in samples)
    # the console of whichever worker answers shows the whole router: the moves, and emu-0 gone
    deadline = time.monotonic() + 10
    while True:
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
            s.get(url + "/console/api/state", headers=AUTH) as r,
        ):
            console = await r.json()
        texts = " | ".join(e["text"] for e in console["events"])
        states = {row["id"]: row["state"] for row in console["replicas"]}
        if "emu-0 left the fleet" in texts and "session(s) moved (drain)" in texts and states.get("emu-0") == "left":
            break
        assert time.monotonic() < deadline, (texts, states)
        await asyncio.sleep(0.5)


async def test_an_overheated_replica_hands_a_vnode_over_with_workers(start_fleet, serve_workers) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3, time_scale=10.0)  # a 200-token reply takes about half a second
    served = await serve_workers(
        named(fleet),
        "--policy",
        "affinity",
        "--no-health-checks",
        "--rebalance-threshold",
        "0.3",
        "--rebalance-window-s",
        "1",
        "--rebalance-cooldown-s",
        "30",
        "--bounded-load-c",
        "100",  # no spills: the heat stays where the sessions are
    )
    url = served.url
    # hot sessions on four different vnodes of emu-0, as the router's own explain says
    hot: dict[tuple[str, int], str] = {}
    for i in range(400):
        async with (
            aiohttp.ClientSession() as s,
            s.get(url + "/admin/route", params={"key": f"h{i}"}, headers=AUTH) as r,
        ):
            route = await r.json()
        vnode = (route["vnode"]["origin"], route["vnode"]["number"])
        if route["ring_owner"] == "emu-0" and vnode not in hot:
            hot[vnode] = f"h{i}"
        if len(hot) == 4:
            break
    assert len(hot) == 4
    stop = time.monotonic() + 20

    async def keep_busy(session: str) -> None:
        while time.monotonic() < stop:
            await ask(url, session, max_tokens=200)

    load = [asyncio.create_task(keep_busy(s)) for s in hot.values() for _ in range(3)]
    try:
        samples = await until(url, "router_vnode_migrations_total", 1, timeout=18)
    finally:
        stop = 0.0
        await asyncio.gather(*load)
    assert samples['router_warmup_requests_total{result="ok"}'] >= 1
    assert samples['router_sessions_moved_total{reason="migration"}'] >= 1
    # the control process's gauges reach the workers' /metrics (the workers' own copies read 0)
    assert samples["router_scale_recommended_replicas"] >= 1
    moved = [s for s in hot.values() if (await ask(url, s))[1] != "emu-0"]
    assert moved and len(moved) < len(hot)  # some vnodes moved, not the whole hot replica
    # a turn's jump is counted as its answer ends: the last one may land a moment after the client has it
    await until(url, 'router_session_jumps_total{reason="migration"}', len(moved), timeout=5)


async def test_a_restart_brings_back_the_workers_sessions(start_fleet, serve_workers, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3)
    state = ["--state", f"file:{tmp_path}", "--no-health-checks", "--policy", "affinity"]
    first = await serve_workers(named(fleet), *state)
    url = first.url
    port = int(url.rsplit(":", 1)[1])
    sessions = [f"r{i}" for i in range(30)]
    where = {s: (await ask(url, s))[1] for s in sessions}
    # hand each session's vnode to another replica: the ring says go elsewhere, the sticky table
    # says stay where the cache is
    pinned: dict[str, str] = {}
    vnodes = set()
    for s in sessions[:6]:
        async with (
            aiohttp.ClientSession() as http,
            http.get(url + "/admin/route", params={"key": s}, headers=AUTH) as r,
        ):
            vnode = (await r.json())["vnode"]
        if (vnode["origin"], vnode["number"]) in vnodes:
            continue
        vnodes.add((vnode["origin"], vnode["number"]))
        other = next(r.options.replica_id for r in fleet.replicas if r.options.replica_id != where[s])
        status, _ = await admin(
            url, "POST", "/admin/overrides", {"origin": vnode["origin"], "vnode": vnode["number"], "owner": other}
        )
        if status == 200:
            pinned[s] = other
    assert pinned
    first.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(first.proc.wait, 30) == 0
    second = await serve_workers(named(fleet), *state, port=port)
    line = next(line for line in second.history if line.startswith("routing state: saved to"))
    assert re.search(rf"restored: .*{len(pinned)} overrides, {len(sessions)} sessions", line), line
    for s in sessions:
        assert (await ask(url, s))[1] == where[s]  # back where its cache is, whichever worker asks
    async with (
        aiohttp.ClientSession() as http,
        http.get(url + "/admin/route", params={"key": next(iter(pinned))}, headers=AUTH) as r,
    ):
        assert (await r.json())["ring_owner"] == next(iter(pinned.values()))  # the overrides are back too
