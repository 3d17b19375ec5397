"""`router-serve --workers 2`: two proxy processes on one port, one control process, shared memory."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import aiohttp
import orjson
import pytest
from yarl import URL

from router.emulator.engine import EngineConfig

TOKEN = "workers-test-token"


def named(fleet: Any) -> list[str]:
    return [f"{r.options.replica_id}={r.url}" for r in fleet.replicas]


async def ask(url: str, session: str) -> tuple[int, str, str]:
    """One chat turn on a fresh connection (the kernel picks the worker per connection)."""
    body = {"messages": [{"role": "user", "content": f"hello from {session}"}], "max_tokens": 4, "stream": True}
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
        s.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers={"X-Session-ID": session}) as r,
    ):
        await r.read()
        return r.status, r.headers.get("X-Router-Worker", ""), r.headers.get("X-Router-Replica", "")


async def explain(url: str, key: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
        s.get(url + "/admin/route", params={"key": key}, headers={"Authorization": f"Bearer {TOKEN}"}) as r,
    ):
        assert r.status == 200
        answer: dict[str, Any] = await r.json()
        return answer


async def from_both_workers(url: str, key: str, tries: int = 200) -> dict[int, dict[str, Any]]:
    seen: dict[int, dict[str, Any]] = {}
    for _ in range(tries):
        answer = await explain(url, key)
        seen[answer["worker"]] = answer
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only workers {sorted(seen)} answered in {tries} connections")


async def test_two_workers_route_alike_see_removals_and_merge_metrics(start_fleet, serve_workers) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3)
    served = await serve_workers(
        named(fleet), "--probe-interval-s", "0.1", "--probe-timeout-s", "0.5", "--recovery-ramp-s", "0.5"
    )
    url = served.url
    routes: dict[str, set[str]] = {}
    workers: set[str] = set()
    sent = 0
    for i in range(600):  # 60 at least, and until both workers served (one may start late on a busy machine)
        key = f"s{i % 12}"
        status, worker, replica = await ask(url, key)
        sent += 1
        assert status == 200
        workers.add(worker)
        routes.setdefault(key, set()).add(replica)
        if i >= 59 and workers == {"0", "1"}:
            break
    assert workers == {"0", "1"}  # both workers served
    # a key goes to one replica, whichever worker took the connection
    assert all(len(replicas) == 1 for replicas in routes.values()), routes
    for key in ("s0", "s5"):
        both = await from_both_workers(url, key)
        assert both[0]["replica"] == both[1]["replica"] == next(iter(routes[key]))

    # a vnode override made through whichever worker answers is routed by both, and so is its removal
    auth = {"Authorization": f"Bearer {TOKEN}"}
    pinned = await explain(url, "s7")
    vnode = pinned["vnode"]
    assert vnode != (await explain(url, "s0"))["vnode"]
    other = next(r.options.replica_id for r in fleet.replicas if r.options.replica_id != pinned["ring_owner"])
    override = {"origin": vnode["origin"], "vnode": vnode["number"], "owner": other}
    async with aiohttp.ClientSession() as s, s.post(f"{url}/admin/overrides", json=override, headers=auth) as r:
        assert r.status == 200, await r.text()
    for expected in (other, pinned["ring_owner"]):
        deadline = time.monotonic() + 5
        # the ring owner (its session stays sticky where its cache is: that is affinity, not the ring)
        while not all(a["ring_owner"] == expected for a in (await from_both_workers(url, "s7")).values()):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        async with (
            aiohttp.ClientSession() as s,
            s.delete(f"{url}/admin/overrides/{vnode['origin']}/{vnode['number']}", headers=auth) as r,
        ):
            assert r.status == (200 if expected == other else 404)

    # one replica crashes: the control loop removes it, and both workers route its keys elsewhere
    victim_id = next(iter(routes["s0"]))
    victim = next(r for r in fleet.replicas if r.options.replica_id == victim_id)
    await victim.crash()
    deadline = time.monotonic() + 10
    while True:
        both = await from_both_workers(url, "s0")
        if all(a["replica"] != victim_id for a in both.values()):
            break
        assert time.monotonic() < deadline, "the workers never stopped routing to the crashed replica"
        await asyncio.sleep(0.1)
    assert both[0]["replica"] == both[1]["replica"]
    assert all(step["state"] == "removed" for a in both.values() for step in a["walk"] if step["replica"] == victim_id)
    for _ in range(10):
        status, _, replica = await ask(url, "s0")
        sent += 1
        assert status == 200 and replica == both[0]["replica"]

    # an admin removal through whichever worker answers reaches both
    keep = [r.options.replica_id for r in fleet.replicas if r.options.replica_id != victim_id]
    async with aiohttp.ClientSession() as s:
        # relayed as sent: an encoded "?" stays part of the id (no such replica), it is not a query
        async with s.delete(
            URL(f"{url}/admin/replicas/{keep[0]}%3Fx", encoded=True), headers={"Authorization": f"Bearer {TOKEN}"}
        ) as r:
            assert r.status == 404
        async with s.delete(f"{url}/admin/replicas/{keep[0]}", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 200
    deadline = time.monotonic() + 5
    counts: dict[int, int] = {}
    while len(counts) < 2 or any(n != 2 for n in counts.values()):
        assert time.monotonic() < deadline, counts
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
            s.get(url + "/health") as r,
        ):
            health = await r.json()
        counts[health["worker"]] = health["replicas"]

    # the control loop sees both workers' traffic, and any worker's /metrics counts all of it
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{url}/admin/replicas", headers={"Authorization": f"Bearer {TOKEN}"}) as r,
    ):
        listed = await r.json()
    assert {x["id"] for x in listed} == {victim_id, keep[1]}
    assert next(x for x in listed if x["id"] == victim_id)["state"] == "removed"
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    total = sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("router_requests_total{")
    )
    assert total == sent
    # health as the control loop sees it, from whichever worker is scraped
    assert f'router_replica_state{{replica="{victim_id}",state="removed"}} 1.0' in text
    assert f'router_replica_health_input{{input="probe_ok",replica="{victim_id}"}} 0.0' in text
    assert f'router_replica_health_input{{input="probe_ok",replica="{keep[1]}"}} 1.0' in text
    gauges = [line for line in text.splitlines() if line.startswith(("router_inflight{", "router_replica_"))]
    assert gauges and not [line for line in gauges if f'replica="{keep[0]}"' in line]  # gone from the gauges


async def test_a_killed_worker_is_replaced_and_stopping_cleans_up(start_fleet, serve_workers) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    served = await serve_workers(named(fleet))
    os.kill(served.pids[0], signal.SIGKILL)
    match = await asyncio.to_thread(served.line, r"worker 0 \(pid (\d+)\) exited \(-9\); restarting", 20)
    assert int(match[1]) == served.pids[0]
    for i in range(20):  # the other worker holds the port meanwhile; then both serve again
        status, _, _ = await ask(served.url, f"k{i}")
        assert status == 200
    workers: set[str] = set()
    deadline = time.monotonic() + 30  # the new worker starts in seconds, longer on a loaded machine
    for i in range(3000):
        _, worker, _ = await ask(served.url, f"k{i}")
        workers.add(worker)
        if workers == {"0", "1"} or time.monotonic() > deadline:
            break
        if i % 50 == 49:
            await asyncio.sleep(0.2)
    assert workers == {"0", "1"}
    served.proc.send_signal(signal.SIGTERM)
    began = r"router-serve: SIGTERM received: draining 2 worker processes: no new connections; 0 requests in flight"
    await asyncio.to_thread(served.line, began, 10)
    await asyncio.to_thread(served.line, r"router-serve: stopped after \d+\.\d s: every request in flight finished", 20)
    assert await asyncio.to_thread(served.proc.wait, 20) == 0
    assert not os.path.exists(f"/dev/shm/{served.shm}")  # the control process unlinked it
    for pid in served.pids[1:]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_capacities_the_control_process_reads_reach_every_worker(start_fleet, serve_workers) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2, EngineConfig(num_blocks=4000, max_num_seqs=4))
    served = await serve_workers(named(fleet), "--probe-interval-s", "0.1", "--replica-capacity", "emu-1=3")
    caps: dict[tuple[int, str], int] = {}
    for i in range(200):  # the emulators' max_num_seqs, read by the control process's probes
        for worker, answer in (await from_both_workers(served.url, f"k{i}")).items():
            first = answer["walk"][0]
            caps[(worker, first["replica"])] = first["load_cap"]
        if len(caps) == 4 and set(caps.values()) == {4}:
            break
        await asyncio.sleep(0.05)
    # in both workers, each replica's floor (8) is no higher than its capacity; the engine's own
    # figure (4) wins over the setting (3)
    assert caps == {(w, r): 4 for w in (0, 1) for r in ("emu-0", "emu-1")}
