"""`router-bench faults`: what clients lose when replicas, agents, Redis or the router itself fail.

Each scenario starts its own world: emulated replicas (in this process, real time), the router
in front of them (in this process, or as a `router-serve` child where it must be restarted) and
clients that hold multi-turn chat sessions, three requests in four streamed. After a warm-up the
fault is injected while the clients keep going, and every answer is sorted into one of:

- succeeded: the whole answer: HTTP 200, every token asked for, one finish reason, `[DONE]`;
- failed clean: an OpenAI-shaped error, as an HTTP status or as an SSE error event;
- cut silently: anything else (a stream that stops, a truncated or doubled answer, a bare
  connection reset, an error that is not OpenAI-shaped). The goal is 0;
- refused: the connection to the router itself was refused (only while a router is down).

A request still unanswered 10 s after the clients stop is given up and counted as cut. Resumed
streams and retried attempts are read from router-serve's own `/metrics`.

`--routers sglang,smg,vllm` puts the peer routers (`sglang-router --policy manual` and `smg
--policy consistent_hashing`, each keyed by its session header, `vllm-router --policy
consistent_hash`, as `router-bench fleet` runs them) through the replica faults too, in front of
the same emulated fleet, with their default settings.

Scenarios (the victim is one replica; the others stay well):
- `crash-before-first-byte`: the victim accepts requests and sits on them, then crashes before
  answering any: they must be retried elsewhere, as must the new ones it refuses;
- `crash-mid-stream`: the victim crashes while streams run on it, and restarts cold later;
- `stall-mid-stream`: every stream on the victim stops after a few tokens with its connection
  open (for a while), so the router's idle time-out ends it;
- `hang`: the victim accepts and never answers (for good): first-byte time-out, retry, removal;
- `flapping`: the victim crashes and comes back every `--flap-s` seconds: hysteresis and the
  flap back-off must keep it out, so its state changes stay few;
- `agent-gone`: every replica has a `router-agent`; one agent stops, another's reading freezes
  an hour old and claims GPU memory errors. Both readings must age out, not remove a replica;
- `redis-gone` (needs `redis-server`): two routers share state in Redis; Redis stops, one router
  removes a replica meanwhile, Redis comes back empty and the other router must learn of it;
- `router-restart`: `router-serve` (state in a file) is stopped with SIGTERM under load and
  started again: streams in flight finish, clients are refused only while it is down, the saved
  state holds every session at the replica that served it last, and the sessions go back to the
  replicas that hold their caches (under `ttft` one may move on, knowingly: the restarted router
  counts it as a session jump, as it would not for a session it had forgotten).

The router's time-outs and probe interval are shortened (`FAULT_SETTINGS`, shown in the output)
so each scenario takes seconds; `--setting` overrides them.

Each scenario runs `--warmup`, then `--duration` after the fault, then waits at most 10 s for
the last answers (the total is printed up front; setting up each world comes on top). SIGINT or
SIGTERM print the scenarios that finished (and write them to `--json PATH`), marked partial,
and exit 130 or 143; the scenario under way is left out.
"""

# It is past 450 lines as one benchmark: each scenario is a short function over one shared world
# (replicas, router, clients, Redis), and the docstring above is `router-bench faults --help`.

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router.bench.common import free_port, measure, parse_settings
from router.bench.contenders import CONTENDERS, available, start_contender
from router.bench.live import Progress, partial_headline
from router.bench.replicas import Child
from router.config import load
from router.emulator.engine import EngineConfig
from router.emulator.server import Fleet as EmulatorFleet
from router.emulator.server import Replica, ReplicaOptions
from router.node import Node
from router.proxy.app import build_app
from router.proxy.workers import runner_for
from router.state.file import StateFile

SCENARIOS = (
    "crash-before-first-byte",
    "crash-mid-stream",
    "stall-mid-stream",
    "hang",
    "flapping",
    "agent-gone",
    "redis-gone",
    "router-restart",
)

# shortened so that a scenario takes seconds; the router's defaults are in docs/router.md
FAULT_SETTINGS = {
    "probe_interval_s": "0.25",
    "probe_timeout_s": "0.5",
    "connect_timeout_s": "0.5",
    "first_byte_timeout_s": "2",
    "idle_timeout_s": "1",
    "recovery_ramp_s": "2",
    "drain_timeout_s": "10",
    "state": "none",
}
# what each scenario sets for itself (where the router listens, its state, its admin API)
SCENARIO_OWNED = frozenset(
    {"host", "port", "state", "state_namespace", "admin_token", "admin_host", "admin_port", "workers", "demo"}
)
TOKEN = "faults-bench-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
VICTIM = "emu-0"
# the session id in every request, under the names router-serve, sglang-router (policy manual),
# smg (consistent_hashing, --routing-key-headers x-session-id) and vllm-router (consistent_hash)
# read it from
SESSION_HEADERS = ("X-Session-ID", "X-SMG-Routing-Key")
ROUTERS = ("router-serve", "sglang", "smg", "vllm")
# from router.bench.contenders
PEER_CONTENDERS = {"sglang": "sglang-header", "smg": "smg-header", "vllm": "vllm-consistent-hash"}
# the replica faults, which any router in front of the fleet can be put through
PEER_SCENARIOS = ("crash-before-first-byte", "crash-mid-stream", "stall-mid-stream", "hang", "flapping")


@dataclass
class Tally:
    sent: int = 0
    succeeded: int = 0
    failed_clean: int = 0
    cut_silently: int = 0
    refused: int = 0
    resumed: int | None = 0  # None: the router does not say (a peer)
    retried: int | None = 0
    lost: list[str] = field(default_factory=list)  # what the first few silent cuts looked like

    def add(self, verdict: str, detail: str = "") -> None:
        self.sent += 1
        setattr(self, verdict, getattr(self, verdict) + 1)
        if verdict == "cut_silently" and len(self.lost) < 5:
            self.lost.append(detail)


def _openai_shaped(body: Any) -> bool:
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and "message" in body["error"]


def _pieces(events: list[Any]) -> tuple[int, list[str], bool, bool, bool]:
    """(content pieces, finish reasons, [DONE] seen, OpenAI-shaped error event seen, anything odd:
    an event after [DONE], an error event of another shape, an event that is not an object)."""
    pieces, reasons, done, error, odd = 0, [], False, False, False
    for event in events:
        if done and not error:
            odd = True  # nothing may follow [DONE]
        if event == "[DONE]":
            done = True
            continue
        if not isinstance(event, dict):
            odd = True
            continue
        if "error" in event:
            error = error or _openai_shaped(event)
            odd = odd or not _openai_shaped(event)
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or choice.get("text"):
                pieces += 1
            if choice.get("finish_reason"):
                reasons.append(choice["finish_reason"])
    return pieces, reasons, done, error, odd


def _openai_error(raw: bytes) -> bool:
    try:
        return _openai_shaped(orjson.loads(raw))
    except orjson.JSONDecodeError:
        return False


def classify(status: int, raw: bytes, stream: bool, max_tokens: int) -> tuple[str, str]:
    """The verdict on one answer (a `Tally` field) and, for a silent cut, what it looked like."""
    if status != 200:
        if _openai_error(raw):
            return "failed_clean", ""
        return "cut_silently", f"HTTP {status} without an OpenAI error: {raw[:80]!r}"
    if not stream:
        try:
            body = orjson.loads(raw)
            tokens = body["usage"]["completion_tokens"]
            (choice,) = body["choices"]
            content, finish = choice["message"]["content"], choice["finish_reason"]
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return "cut_silently", f"unreadable answer: {raw[:80]!r}"
        if tokens == max_tokens and isinstance(content, str) and content and finish:
            return "succeeded", ""
        return "cut_silently", f"{tokens} of {max_tokens} tokens, finish {finish!r}"
    events: list[Any] = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:].strip()
            try:
                events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
            except orjson.JSONDecodeError:
                return "cut_silently", f"a broken event: {payload[:80]!r}"
    pieces, reasons, done, error, odd = _pieces(events)
    if error and not odd:
        return "failed_clean", ""
    if done and not odd and pieces == max_tokens and len(reasons) == 1:
        return "succeeded", ""
    return "cut_silently", f"stream with {pieces} of {max_tokens} tokens, finish {reasons}, [DONE] {done}, odd {odd}"


class Clients:
    """Users holding multi-turn chat sessions against the router URLs (taken in turn), every
    answer classified into a `Tally`. Each user waits `think_s` between turns."""

    def __init__(
        self,
        urls: list[str],
        users: int,
        max_tokens: int,
        think_s: float,
        tag: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.urls = urls
        self.headers = headers or {}  # sent with every request (an API key)
        self.users = users
        self.max_tokens = max_tokens
        self.think_s = think_s
        self.tag = tag
        self.tally = Tally()
        # session -> (when it was sent, replica) of each turn: a turn sent before a router stops is that
        # router's to place, even when its answer comes while the router drains
        self.served: dict[str, list[tuple[float, str]]] = {}
        self.refused_at: list[float] = []
        self.answers: list[tuple[float, float, str]] = []  # (sent, seconds to the whole answer, verdict)
        self.streaming: Counter[str] = Counter()  # streams under way, by the replica serving them
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._user(i)) for i in range(self.users)]

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop the users; a request still unanswered `grace_s` later is given up (and counted as cut)."""
        self._stop.set()
        if not self._tasks:
            return
        _, late = await asyncio.wait(self._tasks, timeout=grace_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _user(self, user: int) -> None:
        timeout = aiohttp.ClientTimeout(total=60)
        n, turns = 0, 3 + user % 4  # sessions of 3 to 6 turns, users starting apart: no common beat
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), 0.04 * user)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while not self._stop.is_set():
                session = f"{self.tag}-u{user}-s{n // turns}"
                history: list[dict[str, str]] = [{"role": "system", "content": "You are terse. " * 8}]
                for turn in range(turns):
                    if self._stop.is_set():
                        return
                    history.append({"role": "user", "content": f"turn {turn} of {session}: " + "tell me more " * 6})
                    url = self.urls[(user + n) % len(self.urls)]
                    stream = n % 4 != 3
                    n += 1
                    reply = await self._turn(http, url, session, history, stream)
                    while reply is None and not self._stop.is_set():  # refused: the same turn again
                        reply = await self._turn(http, url, session, history, stream)
                    history.append({"role": "assistant", "content": reply or "..."})
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), self.think_s)

    async def _turn(
        self, http: aiohttp.ClientSession, url: str, session: str, history: list[dict[str, str]], stream: bool
    ) -> str | None:
        """One request, classified; its reply ("" if it failed), or None if the router refused the connection."""
        body = {"model": "emulated-llm", "messages": history, "max_tokens": self.max_tokens, "stream": stream}
        sent = time.monotonic()
        headers = {"Content-Type": "application/json", **{name: session for name in SESSION_HEADERS}, **self.headers}
        try:
            async with http.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers) as r:
                # the emulated replica that answered names itself, through any router
                status, replica = r.status, r.headers.get("X-Replica-Id", "")
                opened = stream and status == 200
                self.streaming[replica] += opened  # past its first byte: a scenario may break it now
                try:
                    raw = await r.read()
                finally:
                    self.streaming[replica] -= opened
        except aiohttp.ClientConnectorError:
            self.tally.add("refused")
            self.refused_at.append(time.monotonic())
            await asyncio.sleep(0.05)  # a client backs off a little before trying again
            return None
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            self.tally.add("cut_silently", f"{type(exc).__name__}: {exc}"[:120])
            return ""
        except asyncio.CancelledError:
            self.tally.add("cut_silently", "no answer by the end of the run")
            raise
        verdict, detail = classify(status, raw, stream, self.max_tokens)
        self.tally.add(verdict, detail)
        self.answers.append((sent, time.monotonic() - sent, verdict))
        if verdict == "succeeded" and replica:
            self.served.setdefault(session, []).append((sent, replica))
        return "" if verdict != "succeeded" else "ok " * 8


# -- the world of one scenario ----------------------------------------------------------------------------


@dataclass
class Options:
    replicas: int = 4
    users: int = 12
    max_tokens: int = 40
    think_s: float = 0.05
    warmup_s: float = 2.0
    fault_s: float = 6.0  # how long the clients go on after the fault
    flap_s: float = 1.0
    router: str = "router-serve"  # or a peer: sglang, smg, vllm
    settings: dict[str, str] = field(default_factory=dict)


class World:
    """What a scenario runs in; `close` stops every part of it, whatever happened."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.fleet: EmulatorFleet | None = None
        self.routers: list[tuple[Node, web.AppRunner, str]] = []
        self.closers: list[Callable[[], Awaitable[None]]] = []

    async def start_fleet(self) -> EmulatorFleet:
        # port 0: the kernel picks a free port as each binds (one picked ahead may be taken meanwhile)
        replicas = [
            Replica(ReplicaOptions(replica_id=f"emu-{i}", port=0), EngineConfig(num_blocks=4000))
            for i in range(self.opts.replicas)
        ]
        self.fleet = EmulatorFleet(replicas)
        await self.fleet.start()
        return self.fleet

    @property
    def named(self) -> list[str]:
        assert self.fleet is not None
        return [f"{r.options.replica_id}={r.url}" for r in self.fleet.replicas]

    def settings(self, **more: Any) -> dict[str, Any]:
        return {**FAULT_SETTINGS, "admin_token": TOKEN, **self.opts.settings, **more}

    async def start_router(self, **more: Any) -> tuple[Node, str]:
        config = load(None, {}, {"replicas": self.named, **self.settings(**more)})
        router = Node(config)
        runner = runner_for(build_app(router), config)  # as router-serve serves it: its limits and time-outs
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        self.routers.append((router, runner, url))
        return router, url

    async def start_peer(self) -> str:
        """The peer router `opts.router` in front of the fleet, as `router-bench fleet` runs it."""
        name = PEER_CONTENDERS[self.opts.router]
        if not available(name):
            raise RuntimeError(f"{CONTENDERS[name].label} is not installed (pip install '.[bench]')")
        assert self.fleet is not None
        child, urls = await start_contender(CONTENDERS[name], [r.url for r in self.fleet.replicas], {})
        assert child is not None
        self.closers.append(lambda: asyncio.to_thread(child.stop))
        return urls[0]

    def clients(self, urls: list[str], tag: str) -> Clients:
        return Clients(urls, self.opts.users, self.opts.max_tokens, self.opts.think_s, tag)

    async def close(self) -> None:
        for closer in reversed(self.closers):
            with contextlib.suppress(Exception):
                await closer()
        for _, runner, _ in self.routers:
            with contextlib.suppress(Exception):
                await runner.cleanup()
        if self.fleet is not None:
            await self.fleet.stop()


async def metric_sum(url: str, name: str, label: str = "") -> float:
    """Σ of a counter family on a router's `/metrics` (series with `label` in their labels only)."""
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics", headers=AUTH) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}/metrics answered HTTP {r.status}")
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}_total(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m and label in (m.group(1) or ""):
            total += float(m.group(2))
    return total


async def router_counts(url: str) -> tuple[int, int]:
    """(streams resumed, attempts retried) so far, from a router's metrics."""
    resumed = await metric_sum(url, "router_stream_resumes", 'outcome="resumed"')
    retried = await metric_sum(url, "router_retries")
    return int(resumed), int(retried)


async def ring_shares(url: str) -> dict[str, float]:
    """Each replica's share of the ring (overrides included), from the admin API."""
    async with aiohttp.ClientSession(headers=AUTH) as http, http.get(url + "/admin/ring") as r:
        if r.status != 200:
            raise RuntimeError(f"{url}/admin/ring answered HTTP {r.status}")
        return {e["id"]: round(e["share"], 9) for e in (await r.json())["replicas"]}


async def wait_until(predicate: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until `predicate` held, or None if it did not within `timeout`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            return None
        await asyncio.sleep(0.02)
    return round(time.monotonic() - start, 3)


def running_on(world: World, index: int) -> int:
    assert world.fleet is not None
    return int(world.fleet.replicas[index].engine.stats().get("running", 0))


# -- scenarios ------------------------------------------------------------------------------------------
# Each returns (the clients' tally, figures of its own). The victim is replica 0 (for a peer crashed mid-stream:
# the replica carrying streams first).


async def _simple(
    world: World, inject: Callable[[Node | None, Clients], Awaitable[dict[str, Any]]]
) -> tuple[Tally, dict[str, Any]]:
    """A replica fault: the fleet, the router under test (ours in this process, whose state the
    figures then include, or a peer), the clients, and `inject` after the warm-up."""
    await world.start_fleet()
    router: Node | None = None
    if world.opts.router == "router-serve":
        router, url = await world.start_router()
    else:
        url = await world.start_peer()
    clients = world.clients([url], "f")
    clients.start()
    world.closers.append(clients.stop)
    await asyncio.sleep(world.opts.warmup_s)
    extra = await inject(router, clients)
    await clients.stop()
    if router is None:
        clients.tally.resumed = clients.tally.retried = None
        return clients.tally, extra
    clients.tally.resumed, clients.tally.retried = await router_counts(url)
    victim = router.fleet.find(VICTIM)
    if victim is not None:
        extra["victim_state"] = victim.state
        extra["victim_state_changes"] = victim.health.transitions
    extra["other_state_changes"] = sum(r.health.transitions for r in router.fleet.replicas if r.id != VICTIM)
    return clients.tally, extra


async def crash_before_first_byte(world: World) -> tuple[Tally, dict[str, Any]]:
    async def inject(router: Node | None, clients: Clients) -> dict[str, Any]:
        assert world.fleet is not None
        victim = world.fleet.replicas[0]
        victim.set_faults({"hang": True})  # it takes new requests and sits on them, before any byte ...
        # ... until the streams it had have ended and new requests wait on it (within the first-byte time-out)
        await wait_until(lambda: running_on(world, 0) == 0 and victim.held >= 2, 1.5)
        held = victim.held
        await victim.crash()  # ... then it dies: they must go elsewhere, as must those it now refuses
        victim.set_faults({"hang": False})
        await asyncio.sleep(world.opts.fault_s)
        return {"held_at_crash": held}

    return await _simple(world, inject)


async def crash_mid_stream(world: World) -> tuple[Tally, dict[str, Any]]:
    async def inject(router: Node | None, clients: Clients) -> dict[str, Any]:
        assert world.fleet is not None
        if router is None:
            # a peer hashes sessions by its workers' URLs, whose ports differ run to run, so emu-0 may carry
            # no session at all: the one to crash is whichever replica first carries two streams
            await wait_until(lambda: max(clients.streaming.values(), default=0) >= 2, 10)
            victim = max(world.fleet.replicas, key=lambda r: clients.streaming[r.options.replica_id])
        else:  # router-serve's ring places the same sessions on the same emu-N every run
            await wait_until(lambda: clients.streaming[VICTIM] >= 2, 10)
            victim = world.fleet.replicas[0]
        streams = clients.streaming[victim.options.replica_id]
        await victim.crash()
        await asyncio.sleep(world.opts.fault_s / 2)
        await victim.restart()
        if router is None:
            await asyncio.sleep(world.opts.fault_s / 2)
            return {"streams_on_victim_at_crash": streams, "victim_id": victim.options.replica_id}
        back = await wait_until(lambda: (r := router.fleet.find(VICTIM)) is not None and r.health.routable, 10)
        await asyncio.sleep(world.opts.fault_s / 2)
        return {"streams_on_victim_at_crash": streams, "back_after_restart_s": back}

    return await _simple(world, inject)


async def stall_mid_stream(world: World) -> tuple[Tally, dict[str, Any]]:
    async def inject(router: Node | None, clients: Clients) -> dict[str, Any]:
        assert world.fleet is not None
        world.fleet.replicas[0].set_faults({"stall_after": 5})
        await asyncio.sleep(world.opts.fault_s / 2)
        world.fleet.replicas[0].set_faults({"stall_after": None})
        await asyncio.sleep(world.opts.fault_s / 2)
        return {}

    return await _simple(world, inject)


async def hang(world: World) -> tuple[Tally, dict[str, Any]]:
    async def inject(router: Node | None, clients: Clients) -> dict[str, Any]:
        assert world.fleet is not None
        world.fleet.replicas[0].set_faults({"hang": True})
        if router is None:
            await asyncio.sleep(world.opts.fault_s)
            return {}
        victim = router.fleet.find(VICTIM)
        assert victim is not None
        removed = await wait_until(lambda: victim.state == "removed", world.opts.fault_s)
        await asyncio.sleep(max(world.opts.fault_s - (removed or world.opts.fault_s), 1.0))
        return {"removed_after_s": removed}

    return await _simple(world, inject)


async def flapping(world: World) -> tuple[Tally, dict[str, Any]]:
    async def inject(router: Node | None, clients: Clients) -> dict[str, Any]:
        assert world.fleet is not None
        victim = world.fleet.replicas[0]
        flips = 0
        end = time.monotonic() + world.opts.fault_s
        state = router.fleet.find(VICTIM) if router is not None else None
        before, requests_before = (state.health.transitions, state.requests) if state is not None else (0, 0)
        while time.monotonic() < end:
            await victim.crash()
            await asyncio.sleep(world.opts.flap_s)
            await victim.restart()
            await asyncio.sleep(world.opts.flap_s)
            flips += 2
        if state is None:
            return {"flips": flips}
        return {
            "flips": flips,
            "victim_state_changes_during": state.health.transitions - before,
            "relapses": state.health.relapses,
            "return_needed": state.health.return_needed,
            "victim_requests_during": state.requests - requests_before,
        }

    return await _simple(world, inject)


async def agent_gone(world: World) -> tuple[Tally, dict[str, Any]]:
    readings: dict[str, dict[str, Any]] = {}

    async def start_agent(replica_id: str) -> tuple[str, web.AppRunner]:
        readings[replica_id] = {"age": 0.0, "ecc": 0}

        async def stats(request: web.Request) -> web.Response:
            r = readings[replica_id]
            gpu = {"temperature_c": 55.0, "throttle_reasons": 0, "ecc_uncorrected": r["ecc"]}
            body = {"replica_id": replica_id, "taken_at": time.time() - r["age"], "gpus": [gpu], "engine": {}}
            return web.json_response(body)

        app = web.Application()
        app.router.add_get("/stats", stats)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        world.closers.append(runner.cleanup)
        return f"http://127.0.0.1:{port}", runner

    fleet = await world.start_fleet()
    agents = {r.options.replica_id: await start_agent(r.options.replica_id) for r in fleet.replicas}
    router, url = await world.start_router(agents=[f"{rid}={u}" for rid, (u, _) in agents.items()])
    clients = world.clients([url], "a")
    clients.start()
    world.closers.append(clients.stop)
    await asyncio.sleep(world.opts.warmup_s)
    seen_fresh = sorted(r.agent for r in router.fleet.replicas)
    await agents[VICTIM][1].cleanup()  # the victim's agent is gone
    readings["emu-1"].update(age=3600.0, ecc=4)  # emu-1's agent answers with an hour-old reading of ECC errors
    await asyncio.sleep(world.opts.fault_s)
    await clients.stop()
    clients.tally.resumed, clients.tally.retried = await router_counts(url)
    states = {r.id: (r.state, r.agent) for r in router.fleet.replicas}
    return clients.tally, {
        "agents_before": seen_fresh,
        "victim": states[VICTIM],
        "stale_one": states["emu-1"],
        "state_changes": sum(r.health.transitions for r in router.fleet.replicas),
    }


class RedisServer:
    """A `redis-server` child on a loopback port, stopped by its PID."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            while self.proc.poll() is None:
                await asyncio.sleep(0.01)


async def redis_gone(world: World) -> tuple[Tally, dict[str, Any]]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
    redis = RedisServer(binary)
    await redis.start()
    world.closers.append(redis.stop)
    await world.start_fleet()
    a, url_a = await world.start_router(state=redis.url)
    b, url_b = await world.start_router(state=redis.url)
    if (
        await wait_until(lambda: a.redis is not None and b.redis is not None and a.redis.online and b.redis.online, 10)
        is None
    ):
        raise RuntimeError("the routers did not reach redis-server")
    clients = world.clients([url_a, url_b], "r")
    clients.start()
    world.closers.append(clients.stop)
    await asyncio.sleep(world.opts.warmup_s)
    await redis.stop()
    assert a.redis is not None and b.redis is not None
    noticed = await wait_until(lambda: not a.redis.online and not b.redis.online, 10)  # type: ignore[union-attr]
    async with aiohttp.ClientSession() as http, http.delete(url_a + f"/admin/replicas/{VICTIM}", headers=AUTH) as r:
        removed = r.status == 200
    await asyncio.sleep(world.opts.fault_s / 2)
    b_knew_during = b.fleet.find(VICTIM) is None
    await redis.start()  # empty: the routers write back what they know

    def members(router: Node) -> list[str]:
        return sorted(r.id for r in router.fleet.replicas)

    reconciled = await wait_until(lambda: members(a) == members(b) and VICTIM not in members(b), 15)
    await asyncio.sleep(world.opts.fault_s / 2)
    await clients.stop()
    resumed_a, retried_a = await router_counts(url_a)
    resumed_b, retried_b = await router_counts(url_b)
    clients.tally.resumed, clients.tally.retried = resumed_a + resumed_b, retried_a + retried_b
    return clients.tally, {
        "outage_noticed_after_s": noticed,
        "removed_during_outage": removed,
        "other_router_knew_during_outage": b_knew_during,
        "reconciled_after_s": reconciled,
        "members": members(b),
    }


async def _stop_child(proc: subprocess.Popen[bytes], grace_s: float) -> float:
    """SIGTERM to our child router, then wait (without blocking the loop); seconds it took."""
    start = time.monotonic()
    if proc.poll() is not None:
        return 0.0  # exited and reaped: its pid may be someone else's by now
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    while proc.poll() is None and time.monotonic() - start < grace_s:
        await asyncio.sleep(0.01)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        while proc.poll() is None:
            await asyncio.sleep(0.01)
    return round(time.monotonic() - start, 3)


async def router_restart(world: World) -> tuple[Tally, dict[str, Any]]:
    await world.start_fleet()
    state_dir = tempfile.mkdtemp(prefix="faults-state-")
    world.closers.append(lambda: asyncio.to_thread(shutil.rmtree, state_dir, True))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    settings = world.settings(state=f"file:{state_dir}", port=port, host="127.0.0.1")
    cmd = [sys.executable, "-m", "router.proxy.cli", *(f"--replica={r}" for r in world.named)]
    env = {f"ROUTER_{k.upper()}": str(v) for k, v in settings.items()}  # strings, as an operator would set them
    children: list[Child] = []

    async def start() -> None:
        child = Child.spawn(cmd, "router-serve", env)
        children.append(child)
        await child.wait_up(url, "/health", timeout=30)

    async def stop_all() -> None:
        for child in children:
            await _stop_child(child.proc, 10)
            child.stderr.close()

    world.closers.append(stop_all)
    await start()
    clients = world.clients([url], "x")
    clients.start()
    world.closers.append(clients.stop)
    await asyncio.sleep(world.opts.warmup_s)
    async with aiohttp.ClientSession(headers=AUTH) as http:
        for vnode in range(8):  # routing state beyond the ring's own placement: vnode overrides
            override = {"origin": "emu-1", "vnode": vnode, "owner": "emu-2"}
            async with http.post(url + "/admin/overrides", json=override) as r:
                if r.status != 200:
                    raise RuntimeError(f"the override was refused: HTTP {r.status} {await r.text()}")
    ring_before = await ring_shares(url)
    resumed, retried = await router_counts(url)
    down_at = time.monotonic()
    stop_took = await _stop_child(children[-1].proc, 15)
    saved = StateFile(state_dir, "127.0.0.1", port).load()
    saved_sessions = {key.decode(errors="replace"): replica for key, replica, _ in saved.sessions} if saved else {}
    await start()
    downtime = round(time.monotonic() - down_at, 3)
    up_at = time.monotonic()
    ring_after = await ring_shares(url)
    await asyncio.sleep(world.opts.fault_s)
    await clients.stop()
    more_resumed, more_retried = await router_counts(url)
    jumps = await metric_sum(url, "router_session_jumps")  # the restarted router's: it counts from 0
    clients.tally.resumed, clients.tally.retried = resumed + more_resumed, retried + more_retried
    # sessions that had turns before and after the restart: did they come back to the same replica?
    # (by when each turn was sent: the old router placed those sent before it was stopped, the
    # restarted one those sent once it was up; a turn sent in between may meet either, or neither)
    kept = moved = saved_right = 0
    for session, turns in clients.served.items():
        before = [rep for t, rep in turns if t < down_at]
        after = [rep for t, rep in turns if t > up_at]
        if before and after:
            kept += after[0] == before[-1]
            moved += after[0] != before[-1]
            saved_right += saved_sessions.get(session) == before[-1]
    return clients.tally, {
        "stop_took_s": stop_took,
        "down_s": downtime,
        "refused_outside_downtime": sum(not down_at <= t <= up_at for t in clients.refused_at),
        "ring_with_overrides_back": ring_after == ring_before,
        "sessions_across_restart": kept + moved,
        "saved_at_last_replica": saved_right,
        "same_replica_after_restart": kept,
        "session_jumps_after_restart": jumps,  # by the restarted router, of sessions it knew
    }


RUNNERS: dict[str, Callable[[World], Awaitable[tuple[Tally, dict[str, Any]]]]] = {
    "crash-before-first-byte": crash_before_first_byte,
    "crash-mid-stream": crash_mid_stream,
    "stall-mid-stream": stall_mid_stream,
    "hang": hang,
    "flapping": flapping,
    "agent-gone": agent_gone,
    "redis-gone": redis_gone,
    "router-restart": router_restart,
}


async def run_scenario(name: str, opts: Options) -> dict[str, Any]:
    """One scenario in a world of its own: its tally and figures (or the reason it could not run)."""
    world = World(opts)
    start = time.monotonic()
    try:
        tally, extra = await RUNNERS[name](world)
    finally:
        await world.close()
    wall = round(time.monotonic() - start, 1)
    return {"scenario": name, "router": opts.router, **asdict(tally), "figures": extra, "wall_s": wall}


# -- command line -------------------------------------------------------------------------------------


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "faults",
        help="inject replica, agent, Redis and router faults under load; count what clients lose",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"comma-separated, from: {', '.join(SCENARIOS)} (default: all)",
    )
    p.add_argument(
        "--routers",
        default="router-serve",
        help="comma-separated routers to put through the scenarios: router-serve, sglang, smg, vllm; the peers "
        f"take the replica faults only ({', '.join(PEER_SCENARIOS)}) (default: router-serve)",
    )
    p.add_argument("--replicas", type=int, default=4, help="emulated replicas (default 4)")
    p.add_argument("--users", type=int, default=12, help="clients holding sessions (default 12)")
    p.add_argument("--max-tokens", type=int, default=40, help="tokens per answer (default 40)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of load before the fault (default 2)")
    p.add_argument("--duration", type=float, default=6.0, help="seconds of load after the fault (default 6)")
    p.add_argument("--flap-s", type=float, default=1.0, help="flapping: seconds down, then as long up (default 1)")
    p.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a router setting for every scenario (repeatable; default FAULT_SETTINGS, shown in the output)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.set_defaults(run=run_cli)


def options_from(args: argparse.Namespace) -> tuple[list[tuple[str, str]], Options]:
    """The (router, scenario) runs asked for, and the options they share; ValueError if bad."""
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [n for n in names if n not in RUNNERS]
    if unknown or not names:
        raise ValueError(f"unknown scenario(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(SCENARIOS)}")
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    if not routers or any(r not in ROUTERS for r in routers):
        raise ValueError(f"--routers {args.routers!r}: choose from {', '.join(ROUTERS)}")
    runs = [(r, n) for r in routers for n in names if r == "router-serve" or n in PEER_SCENARIOS]
    if not runs:
        raise ValueError(f"the peers take only these scenarios: {', '.join(PEER_SCENARIOS)}")
    if args.replicas < 3:
        raise ValueError("--replicas must be at least 3 (a victim, a stale agent's replica and a healthy one)")
    for flag in ("users", "max_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    for flag in ("warmup", "duration", "flap_s"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be a number of seconds > 0")
    settings = parse_settings(args.setting)
    owned = sorted(set(settings) & SCENARIO_OWNED)
    if owned:
        raise ValueError(f"--setting {', '.join(owned)}: the scenarios set these themselves")
    load(None, {}, {"replicas": ["x=http://127.0.0.1:1"], **FAULT_SETTINGS, **settings})  # one line if bad
    opts = Options(
        replicas=args.replicas,
        users=args.users,
        max_tokens=args.max_tokens,
        warmup_s=args.warmup,
        fault_s=args.duration,
        flap_s=args.flap_s,
        settings=settings,
    )
    return runs, opts


COLUMNS = ("sent", "succeeded", "resumed", "retried", "failed_clean", "cut_silently", "refused")


def render(results: list[dict[str, Any]]) -> str:
    head = "| scenario | router | " + " | ".join(c.replace("_", " ") for c in COLUMNS) + " | figures |"
    lines = [head, "|---|---|" + "---:|" * len(COLUMNS) + "---|"]
    for r in results:
        first = f"| {r['scenario']} | {r['router']} | "
        if "error" in r:
            lines.append(first + " | ".join("" for _ in COLUMNS) + f" | not run: {r['error']} |")
            continue
        figures = ", ".join(f"{k} {v}" for k, v in r["figures"].items())
        cells = ("—" if r[c] is None else str(r[c]) for c in COLUMNS)
        lines.append(first + " | ".join(cells) + f" | {figures} |")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    try:
        runs, opts = options_from(args)
    except ValueError as exc:  # ConfigError is a ValueError
        print(f"router-bench faults: {exc}", file=sys.stderr)
        return 2
    settings = {**FAULT_SETTINGS, **opts.settings}
    print("router settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()), flush=True)
    results: list[dict[str, Any]] = []

    progress = Progress()
    each_s = opts.warmup_s + opts.fault_s + 10.0
    progress.note(
        f"router-bench faults: {len(runs)} scenarios of {opts.warmup_s:g} s warm-up + {opts.fault_s:g} s after the "
        f"fault + at most 10 s for the last answers: at most {len(runs) * each_s / 60:.1f} min, plus setting up each"
    )

    async def all_scenarios() -> None:
        for k, (router, name) in enumerate(runs, 1):
            began = time.monotonic()

            def describe(what: str = f"scenario {k}/{len(runs)} {name} ({router})", began: float = began) -> str:
                return f"{what}: {time.monotonic() - began:.0f} s of at most {each_s:g} s plus setting up"

            try:
                async with progress.ticking(describe):
                    result = await run_scenario(name, dataclasses.replace(opts, router=router))
            except RuntimeError as exc:  # it cannot run here (no redis-server, a peer not installed, ...)
                result = {"scenario": name, "router": router, "error": str(exc)}
            results.append(result)
            progress.clear()
            if "error" in result:
                print(f"{name} ({router}): not run: {result['error']}", flush=True)
            else:
                print(f"{name} ({router}): " + ", ".join(f"{c} {result[c]}" for c in COLUMNS), flush=True)
                for lost in result["lost"]:
                    print(f"  cut: {lost}", flush=True)

    done, stopped = measure("faults", lambda _: all_scenarios())
    saved: dict[str, Any] = {"settings": settings, "options": asdict(opts), "results": results}
    if stopped is not None:
        stopped.mark(saved)
        print(partial_headline(saved))
    print(render(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(saved, f, indent=1)
    if stopped is not None:
        return stopped.exit_status
    lost = sum(r.get("cut_silently", 0) for r in results)
    return 1 if done is None or lost else 0
