"""`router-bench health`: how fast the router takes a slow replica out and brings it back, and
whether it leaves a replica that is merely busy alone. Default health settings unless `--setting`.

One process runs an emulated fleet, router-serve's application in front of it and a client:
- steady multi-turn sessions with short streamed replies, spread over every replica by the ring;
- on the "busy" replica, many long replies at once, all the time (a full batch: busy, not sick).
Timeline: warm-up; the "victim" replica is made slow (the emulator's `slow` fault: every engine
step takes N times longer); the run waits until the router removes it, heals it at once, and
waits until it is back (`recovering`) and until its ring weight has ramped to full.

Reported: seconds from fault to removal, from heal to return and to full weight; state changes
of the busy replica and of the other healthy replicas over the run (goal: 0); requests sent and
failed. A removed replica gets no traffic, so the latency samples that removed it must age out
(5 probe intervals, at least 10 s) before its probes can bring it back: time to return is about
that window plus `return_after` probes, whenever the fault actually cleared.

The run has no fixed length: the warm-up, then each of the three steps waits at most `--timeout`
(the bound is printed up front). A progress line on a terminal says which step it waits for.
SIGINT or SIGTERM print the steps reached so far and the timeline, marked partial, and exit 130
or 143.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from router.bench.common import free_port, measure, parse_settings
from router.bench.live import Progress, partial_headline
from router.config import load
from router.emulator.server import Fleet as EmulatorFleet
from router.emulator.server import Replica, ReplicaOptions
from router.node import Node
from router.proxy.app import build_app


@dataclass
class Timeline:
    start: float = field(default_factory=time.monotonic)
    events: list[tuple[float, str, str, float]] = field(default_factory=list)  # (t, replica, state, weight)

    def at(self) -> float:
        return round(time.monotonic() - self.start, 3)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "health",
        help="time to remove a slow replica and to restore it; state changes of a busy one",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--replicas", type=int, default=4, help="emulated replicas (default 4)")
    p.add_argument("--slow", type=float, default=20.0, help="the victim's slowdown factor (default 20)")
    p.add_argument("--sessions", type=int, default=16, help="clients holding short multi-turn sessions (default 16)")
    p.add_argument("--busy", type=int, default=48, help="long replies kept running on the busy replica (default 48)")
    p.add_argument("--busy-tokens", type=int, default=400, help="tokens per long reply (default 400)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of traffic before the fault (default 10)")
    p.add_argument("--timeout", type=float, default=180.0, help="longest wait for each step, seconds (default 180)")
    p.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a router setting for the run, e.g. probe_interval_s=1 (repeatable; default: the router's defaults)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run_cli)


async def _chat(http: aiohttp.ClientSession, url: str, key: str, text: str, max_tokens: int) -> int:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": True}
    try:
        async with http.post(url, data=orjson.dumps(body), headers={"X-Session-ID": key}) as r:
            await r.read()
            return r.status
    except (aiohttp.ClientError, OSError, TimeoutError):
        return 0


async def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The benchmark, filling `result` as each step is reached (a caller stopped early keeps those)."""
    if args.replicas < 3:
        raise ValueError("--replicas must be at least 3 (a victim, a busy one, and a healthy one)")
    settings = parse_settings(args.setting)
    ports = [free_port() for _ in range(args.replicas)]
    replicas = [f"emu-{i}=http://127.0.0.1:{p}" for i, p in enumerate(ports)]
    config = load(None, {}, {"replicas": replicas, "state": "none", **settings})
    emulators = EmulatorFleet([Replica(ReplicaOptions(replica_id=f"emu-{i}", port=p)) for i, p in enumerate(ports)])
    await emulators.start()
    router = Node(config)
    runner = web.AppRunner(build_app(router), handle_signals=False, access_log=None, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    busy_id, victim_id = "emu-0", "emu-1"
    busy_keys = [k for k in (f"busy-{i}" for i in range(10_000)) if router.fleet.ring.lookup(k.encode()) == 0][:64]
    timeline = Timeline()
    counts = {"sent": 0, "failed": 0}
    stop = asyncio.Event()

    async def sessions(task: int) -> None:
        async with aiohttp.ClientSession() as http:
            for n in itertools.count():
                if stop.is_set():
                    return
                key = f"s{task}-{n // 8}"  # eight turns per session
                status = await _chat(http, url, key, f"turn {n} of {key}", 16)
                counts["sent"] += 1
                counts["failed"] += status != 200
                await asyncio.sleep(0.2)

    async def busy(task: int) -> None:
        async with aiohttp.ClientSession() as http:
            for n in itertools.count():
                if stop.is_set():
                    return
                status = await _chat(http, url, busy_keys[task % len(busy_keys)], f"long {n}", args.busy_tokens)
                counts["sent"] += 1
                counts["failed"] += status != 200

    peak = {"running": 0.0, "waiting": 0.0}

    last: dict[str, tuple[str, float]] = {}

    def sample() -> None:
        engine = router.fleet.find(busy_id).engine  # type: ignore[union-attr]
        peak["running"] = max(peak["running"], engine.running or 0.0)
        peak["waiting"] = max(peak["waiting"], engine.waiting or 0.0)
        for r in router.fleet.replicas:
            assert r.index is not None
            now = (r.state, router.fleet.routing_weight(r.index))
            if last.get(r.id, ("", -1.0))[0] != now[0] or (r.id == victim_id and last[r.id][1] != now[1]):
                timeline.events.append((timeline.at(), r.id, *now))
            last[r.id] = now

    async def watch() -> None:
        while not stop.is_set():
            sample()
            await asyncio.sleep(0.05)

    async def until(predicate: Any, what: str) -> float:
        deadline = time.monotonic() + args.timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not happen within {args.timeout:.0f} s")
            await asyncio.sleep(0.05)
        return timeline.at()

    victim = router.fleet.find(victim_id)
    assert victim is not None
    tasks = [asyncio.create_task(sessions(i)) for i in range(args.sessions)]
    tasks += [asyncio.create_task(busy(i)) for i in range(args.busy)]
    tasks.append(asyncio.create_task(watch()))
    result |= {
        "settings": {
            k: getattr(config, k)
            for k in (
                "probe_interval_s",
                "remove_below",
                "remove_after",
                "return_above",
                "return_after",
                "recovery_ramp_s",
            )
        },
        "replicas": args.replicas,
        "slow_factor": args.slow,
        "timeline": timeline.events,
    }
    progress = Progress()
    progress.note(
        f"router-bench health: {args.warmup:g} s of warm-up, then removal, return and full weight, each waited "
        f"for at most {args.timeout:g} s: at most {(args.warmup + 3 * args.timeout) / 60:.1f} min"
    )
    step = ["warm-up"]

    def describe() -> str:
        return f"{timeline.at():.0f} s: {step[0]}  requests {counts['sent']}  failed {counts['failed']}"

    try:
        async with progress.ticking(describe):
            await asyncio.sleep(args.warmup)
            emulators.replicas[1].set_faults({"slow": args.slow})
            fault_at = timeline.at()
            step[0] = "waiting for the slow replica's removal"
            removed_at = await until(lambda: victim.state == "removed", "removal of the slow replica")
            result["seconds_to_remove"] = round(removed_at - fault_at, 2)
            emulators.replicas[1].set_faults({"slow": 1.0})
            healed_at = timeline.at()
            step[0] = "healed; waiting for its return"
            back_at = await until(lambda: victim.state in ("recovering", "healthy"), "return of the healed replica")
            result["seconds_to_return"] = round(back_at - healed_at, 2)
            step[0] = "back; waiting for its full weight"
            full_at = await until(
                lambda: (
                    victim.state == "healthy"
                    and victim.index is not None
                    and router.fleet.routing_weight(victim.index) == 1.0
                ),
                "full weight of the returned replica",
            )
            result["seconds_to_full_weight"] = round(full_at - healed_at, 2)
    finally:
        sample()  # the final state, whatever the watcher's phase
        others = [r for r in router.fleet.replicas if r.id not in (busy_id, victim_id)]
        result |= {
            "busy_replica_state_changes": router.fleet.find(busy_id).health.transitions,  # type: ignore[union-attr]
            "busy_replica_peak_running": peak["running"],
            "busy_replica_peak_waiting": peak["waiting"],
            "other_replicas_state_changes": sum(r.health.transitions for r in others),
            "requests_sent": counts["sent"],
            "requests_failed": counts["failed"],
            "run_seconds": timeline.at(),
        }
        stop.set()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await runner.cleanup()
        await emulators.stop()


def run_cli(args: argparse.Namespace) -> int:
    out, stopped = measure("health", lambda result: run(args, result))
    if out is None or "settings" not in out:
        return stopped.exit_status if stopped is not None else 1
    if stopped is not None:
        stopped.mark(out)
    if args.json:
        print(json.dumps(out))
        return stopped.exit_status if stopped is not None else 0
    if stopped is not None:
        print(partial_headline(out))
    s = out["settings"]

    def seconds(key: str) -> str:
        return f"{out[key]:7.2f} s" if key in out else "    not reached"

    print(
        f"health, {out['replicas']} emulated replicas, slow factor {out['slow_factor']:g}, probe every "
        f"{s['probe_interval_s']:g} s, remove after {s['remove_after']} scores < {s['remove_below']}, return after "
        f"{s['return_after']} > {s['return_above']}, ramp {s['recovery_ramp_s']:g} s"
    )
    print(f"  slow replica removed after          {seconds('seconds_to_remove')}")
    print(f"  healed replica back (recovering) in {seconds('seconds_to_return')}")
    print(f"  ... at full weight in               {seconds('seconds_to_full_weight')}")
    print(
        f"  busy replica state changes          {out['busy_replica_state_changes']:7d}   (goal 0; it ran up to "
        f"{out['busy_replica_peak_running']:g} requests at once, {out['busy_replica_peak_waiting']:g} waiting)"
    )
    print(f"  other healthy replicas' changes     {out['other_replicas_state_changes']:7d}   (goal 0)")
    print(f"  requests sent / failed              {out['requests_sent']:7d} / {out['requests_failed']}")
    print("  timeline (s, replica, state, ring weight):")
    for at, rid, state, weight in out["timeline"]:
        print(f"    {at:8.2f}  {rid:8s}  {state:10s}  {weight:.2f}")
    return stopped.exit_status if stopped is not None else 0
