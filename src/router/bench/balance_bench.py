"""`router-bench balance`: rebalancing under skewed users, scale-out with and without warm-up,
and a drain under streaming load. Each scenario runs twice, side by side in one process: an
emulated fleet, router-serve's application in front of it, and multi-turn chat sessions.

- `skew`: most sessions think between turns; a few ("hot") keep several requests in flight
  all the time (an agent's parallel calls), each sent as soon as the last one ends. Run with
  rebalancing off, then on (fresh fleet each time). Reported for the second half of each run:
  load CV (per-replica requests), KV hit rate, jump rate (turns of a session, in order).
- `scale-out`: sessions on N replicas, then one replica is added through the admin API. Run with
  warm-up off, then on. Reported: share of live sessions whose next turn went to the new replica
  (and to any other one), and the time to first token and KV hit rate of those next turns.
- `drain`: streaming sessions; one replica is drained with `remove=true` through the admin API.
  Reported: requests failed and streams cut (goal 0), and whether the replica left the fleet.

The settings the scenarios use (short rebalancing window and cooldown so that a run takes a
minute, not an hour) are printed with the results; `--setting NAME=VALUE` overrides them.
With `--workers N` the router is `router-serve --workers N` in a child process (the same
settings, as ROUTER_* variables), so the control process balances what the workers served.

Every run lasts `--duration` (what is in flight at its end is cut off with the harness); the
runs' count and total are printed up front, and a progress line on a terminal says where the
run under way stands. SIGINT or SIGTERM print the runs that finished, marked partial (the one
under way is left out), and exit 130 or 143.
"""

# It is past 450 lines as one benchmark: its three scenarios share the harness that runs them side
# by side, and the docstring above is `router-bench balance --help`.

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
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
from router.measures import coefficient_of_variation, kv_hit_rate
from router.node import Node
from router.proxy.app import build_app

ADMIN_TOKEN = "bench-admin-token"
SCENARIOS = ("skew", "scale-out", "drain")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "balance",
        help="rebalancing under skew, scale-out with and without warm-up, drain under load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--scenario", choices=(*SCENARIOS, "all"), default="all", help="which to run (default all)")
    p.add_argument("--replicas", type=int, default=8, help="emulated replicas (default 8)")
    p.add_argument("--sessions", type=int, default=48, help="concurrent sessions (default 48)")
    p.add_argument("--hot", type=int, default=4, help="skew: busy sessions (default 4)")
    p.add_argument("--hot-streams", type=int, default=4, help="skew: requests each busy session keeps in flight (4)")
    p.add_argument("--think", type=float, default=2.0, help="mean think time between turns, seconds (default 2)")
    p.add_argument("--hot-think", type=float, default=0.5, help="skew: busy sessions' mean think time (default 0.5)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per run, whole (default 60; 'all' is 5 runs)")
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="router worker processes (default 1: the router runs in this process; more: "
        "router-serve --workers N is started as a child process)",
    )
    p.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE", help="a router setting")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run_cli)


BASE_SETTINGS = {
    "probe_interval_s": "1",
    "rebalance_window_s": "5",
    "rebalance_cooldown_s": "10",
    "recovery_ramp_s": "5",
    "admin_token": ADMIN_TOKEN,
    "state": "none",
}


@dataclass
class Turn:
    at: float
    session: str
    replica: str
    status: int
    ttft_s: float | None
    prompt_tokens: int
    cached_tokens: int
    cut: bool


@dataclass
class Run:
    turns: list[Turn] = field(default_factory=list)

    def since(self, t: float) -> list[Turn]:
        return [x for x in self.turns if x.at >= t]


async def _turn(http: aiohttp.ClientSession, url: str, session: str, messages: list[dict[str, str]]) -> Turn:
    body = {
        "messages": messages,
        "max_tokens": 24,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    ttft = None
    usage: dict[str, Any] = {}
    done = False
    try:
        async with http.post(url, data=orjson.dumps(body), headers={"X-Session-ID": session}) as r:
            replica = r.headers.get("X-Router-Replica", "")
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: {"):
                    event = orjson.loads(line[6:])
                    if event.get("usage"):
                        usage = event["usage"]
                    choices = event.get("choices") or [{}]
                    if ttft is None and (choices[0].get("delta") or {}).get("content"):
                        ttft = time.monotonic() - t0  # the first token, not the role-only first chunk
                    if "error" in event:
                        done = False
                        break
            status = r.status
    except (aiohttp.ClientError, OSError, TimeoutError):
        return Turn(time.monotonic(), session, "", 0, None, 0, 0, True)
    details = usage.get("prompt_tokens_details") or {}
    return Turn(
        time.monotonic(),
        session,
        replica,
        status,
        ttft,
        int(usage.get("prompt_tokens") or 0),
        int(details.get("cached_tokens") or 0),
        status == 200 and not done,
    )


class Harness:
    """An emulated fleet and a router (in this process, or `router-serve --workers N` as a child
    process), and sessions driving them."""

    def __init__(self, replicas: int, settings: dict[str, str], workers: int = 1) -> None:
        self.n = replicas
        self.settings = settings
        self.workers = workers
        self.router: Node | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.runner: web.AppRunner | None = None
        self.run = Run()
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.t0 = time.monotonic()

    def describe(self, what: str, duration_s: float) -> str:
        """A progress line: the run's time, turns answered and failed, KV hit rate so far."""
        turns = self.run.turns
        ok = [t for t in turns if t.status == 200 and not t.cut]
        hit = kv_hit_rate(sum(t.cached_tokens for t in ok), sum(t.prompt_tokens for t in ok))
        return (
            f"{what}: {time.monotonic() - self.t0:.0f} of {duration_s:g} s  turns {len(ok)}  "
            f"failed {len(turns) - len(ok)}  KV hit {hit:.1%}"
        )

    async def __aenter__(self) -> Harness:
        # the emulators take ports the kernel gives them (picked ahead, one could be taken meanwhile)
        self.emulators = EmulatorFleet(
            [Replica(ReplicaOptions(replica_id=f"emu-{i}", port=0)) for i in range(self.n + 1)]  # one spare
        )
        await self.emulators.start()
        self.ports = ports = [r.port for r in self.emulators.replicas]
        specs = [f"emu-{i}=http://127.0.0.1:{p}" for i, p in enumerate(ports[: self.n])]
        self.config = load(None, {}, {"replicas": specs, **self.settings})
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        if self.workers > 1:
            await self._start_workers(port, specs)
        else:
            self.router = Node(self.config)
            self.runner = web.AppRunner(build_app(self.router), handle_signals=False, access_log=None)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.t0 = time.monotonic()
        return self

    async def _start_workers(self, port: int, specs: list[str]) -> None:
        """router-serve --workers N with the same settings (as ROUTER_* variables), ready to serve."""
        args = [sys.executable, "-m", "router.proxy.cli", "--workers", str(self.workers), "--port", str(port)]
        for spec in specs:
            args += ["--replica", spec]
        env = os.environ | {"ROUTER_" + name.upper(): value for name, value in self.settings.items()}
        self.proc = await asyncio.create_subprocess_exec(
            *args, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.returncode is None:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with self.http.get(self.base + "/health") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
        problem = b""
        if self.proc.returncode is not None and self.proc.stderr is not None:
            problem = await self.proc.stderr.read()
        raise RuntimeError(f"router-serve --workers {self.workers} did not start: {problem.decode().strip()}")

    async def metric(self, name: str) -> float:
        """A label-less sample of the router's /metrics (0 while absent)."""
        async with self.http.get(self.base + "/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith(name + " "):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    async def has_replica(self, replica_id: str) -> bool:
        replicas = await self.admin("GET", "/admin/replicas")
        return any(r["id"] == replica_id for r in replicas)

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.http.close()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()  # our own child, by its PID: it drains and exits
            try:
                await asyncio.wait_for(self.proc.wait(), 40)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        await self.emulators.stop()

    def session(self, name: str, think_s: float, rng: random.Random) -> None:
        async def loop() -> None:
            system = {"role": "system", "content": "You are a careful assistant. " * 40}
            messages = [system]
            for n in itertools.count():
                if self.stop.is_set():
                    return
                words = " ".join(f"{name}-{n}-{k}" for k in range(rng.randint(20, 60)))
                messages.append({"role": "user", "content": words})
                turn = await _turn(self.http, self.base + "/v1/chat/completions", name, messages)
                self.run.turns.append(turn)
                if len(messages) > 30:  # keep prompts bounded: the conversation starts over
                    messages = [system]
                await asyncio.sleep(rng.expovariate(1 / think_s) if think_s > 0 else 0.0)

        self.tasks.append(asyncio.create_task(loop()))

    async def admin(self, method: str, path: str, body: Any = None) -> Any:
        async with self.http.request(
            method, self.base + path, json=body, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ) as r:
            answer = await r.json()
            if r.status >= 400:
                raise RuntimeError(f"{method} {path}: {r.status} {answer}")
            return answer


def _later_turn_hit_rate(turns: list[Turn]) -> float:
    later = [t for t in turns if t.cached_tokens or t.prompt_tokens > 0]
    return kv_hit_rate(sum(t.cached_tokens for t in later), sum(t.prompt_tokens for t in later))


def _jumps(turns: list[Turn]) -> tuple[int, int]:
    last: dict[str, str] = {}
    followups = jumps = 0
    for t in sorted(turns, key=lambda x: x.at):
        if t.status != 200:
            continue
        if t.session in last:
            followups += 1
            jumps += last[t.session] != t.replica
        last[t.session] = t.replica
    return jumps, followups


async def skew(args: argparse.Namespace, rebalance: bool, watch: Watch | None = None) -> dict[str, Any]:
    settings = {**BASE_SETTINGS, "rebalance": str(rebalance).lower(), **_settings(args)}
    rng = random.Random(args.seed)
    async with Harness(args.replicas, settings, args.workers) as h:
        if watch is not None:
            watch.harness = h
        for i in range(args.sessions):
            for _ in range(args.hot_streams if i < args.hot else 1):
                h.session(f"s{i}", args.hot_think if i < args.hot else args.think, rng)
        await asyncio.sleep(args.duration)
        half = h.t0 + args.duration / 2
        turns = [t for t in h.run.since(half) if t.status == 200]
        per = {f"emu-{i}": 0 for i in range(args.replicas)}
        for t in turns:
            per[t.replica] = per.get(t.replica, 0) + 1
        jumps, followups = _jumps(h.run.turns)
        return {
            "rebalance": rebalance,
            "load_cv": round(coefficient_of_variation(per.values()), 4),
            "kv_hit_rate": round(_later_turn_hit_rate(turns), 4),
            "requests_per_replica": per,
            "jump_rate": round(jumps / followups, 4) if followups else 0.0,
            "vnodes_moved": int(await h.metric("router_vnode_migrations_total")),
            "failed": sum(t.status != 200 or t.cut for t in h.run.turns),
        }


async def scale_out(args: argparse.Namespace, warmup: bool, watch: Watch | None = None) -> dict[str, Any]:
    settings = {**BASE_SETTINGS, "warmup": str(warmup).lower(), "rebalance": "false", **_settings(args)}
    rng = random.Random(args.seed)
    async with Harness(args.replicas, settings, args.workers) as h:
        if watch is not None:
            watch.harness = h
        for i in range(args.sessions):
            h.session(f"s{i}", args.think, rng)
        await asyncio.sleep(args.duration / 2)
        added_at = time.monotonic()
        before = {t.session: t.replica for t in sorted(h.run.turns, key=lambda x: x.at)}
        new_id = f"emu-{args.replicas}"
        answer = await h.admin("POST", "/admin/replicas", {"id": new_id, "url": f"http://127.0.0.1:{h.ports[-1]}"})
        await asyncio.sleep(args.duration / 2)
        next_turn: dict[str, Turn] = {}
        for t in sorted(h.run.since(added_at), key=lambda x: x.at):
            if t.session in before and t.session not in next_turn and t.status == 200:
                next_turn[t.session] = t
        moved = [t for s, t in next_turn.items() if t.replica == new_id]
        elsewhere = [t for s, t in next_turn.items() if t.replica not in (before[s], new_id)]
        stayed = [t for s, t in next_turn.items() if t.replica == before[s]]

        def median_ttft(turns: list[Turn]) -> float | None:
            values = [t.ttft_s for t in turns if t.ttft_s is not None]
            return round(statistics.median(values) * 1000, 2) if values else None

        return {
            "warmup": warmup,
            "sessions_live": len(next_turn),
            "moved": len(moved),
            "moved_share": round(len(moved) / len(next_turn), 4) if next_turn else 0.0,
            "moved_share_goal": round(1.15 / (args.replicas + 1), 4),
            "moved_elsewhere": len(elsewhere),
            "moved_next_turn_ttft_ms": median_ttft(moved),
            "moved_next_turn_hit_rate": round(_later_turn_hit_rate(moved), 4) if moved else None,
            "stayed_next_turn_ttft_ms": median_ttft(stayed),
            "sessions_to_warm": answer.get("sessions_to_warm"),
            "failed": sum(t.status != 200 or t.cut for t in h.run.turns),
        }


async def drain(args: argparse.Namespace, watch: Watch | None = None) -> dict[str, Any]:
    settings = {**BASE_SETTINGS, "rebalance": "false", **_settings(args)}
    rng = random.Random(args.seed)
    async with Harness(args.replicas, settings, args.workers) as h:
        if watch is not None:
            watch.harness = h
        for i in range(args.sessions):
            h.session(f"s{i}", args.think / 4, rng)
        await asyncio.sleep(args.duration / 3)
        answer = await h.admin("POST", "/admin/replicas/emu-0/drain?remove=true")
        drained_at = time.monotonic()
        gone_at = None
        while time.monotonic() - drained_at < args.duration * 2 / 3:
            if gone_at is None and not await h.has_replica("emu-0"):
                gone_at = time.monotonic()
            await asyncio.sleep(0.1)
        after = h.run.since(drained_at + 1.0)
        return {
            "sessions_to_move": answer.get("sessions_to_move"),
            "removed_after_s": round(gone_at - drained_at, 2) if gone_at is not None else None,
            "requests": len(h.run.turns),
            "failed": sum(t.status != 200 for t in h.run.turns),
            "cut_streams": sum(t.cut for t in h.run.turns),
            "served_by_drained_after_1s": sum(t.replica == "emu-0" for t in after),
        }


def _settings(args: argparse.Namespace) -> dict[str, str]:
    return parse_settings(args.setting)


@dataclass
class Watch:
    """The harness of the run under way, for the progress line."""

    harness: Harness | None = None


async def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The runs, filling `result` as each ends (a caller stopped early keeps those)."""
    which = SCENARIOS if args.scenario == "all" else (args.scenario,)
    result |= {
        "settings": {**BASE_SETTINGS, **_settings(args)},
        "replicas": args.replicas,
        "workers": args.workers,
    }
    result["settings"].pop("admin_token", None)
    runs: list[tuple[str, str, Callable[[Watch], Awaitable[dict[str, Any]]]]] = []
    if "skew" in which:
        runs += [
            ("skew", "skew, rebalance off", lambda w: skew(args, False, w)),
            ("skew", "skew, rebalance on", lambda w: skew(args, True, w)),
        ]
    if "scale-out" in which:
        runs += [
            ("scale_out", "scale-out, warm-up off", lambda w: scale_out(args, False, w)),
            ("scale_out", "scale-out, warm-up on", lambda w: scale_out(args, True, w)),
        ]
    if "drain" in which:
        runs.append(("drain", "drain", lambda w: drain(args, w)))
    progress = Progress()
    progress.note(
        f"router-bench balance: {len(runs)} runs of {args.duration:g} s: about {len(runs) * args.duration / 60:.1f} "
        "min, plus starting each fleet"
    )
    for k, (key, what, measure_one) in enumerate(runs, 1):
        watch = Watch()

        def describe(what: str = f"run {k}/{len(runs)} {what}", watch: Watch = watch) -> str:
            return watch.harness.describe(what, args.duration) if watch.harness else f"{what}: starting"

        async with progress.ticking(describe):
            row = await measure_one(watch)
        if key == "drain":
            result["drain"] = row
        else:
            result.setdefault(key, []).append(row)


def run_cli(args: argparse.Namespace) -> int:
    if args.replicas < 2 or args.sessions < 1 or args.duration <= 0 or args.workers < 1:
        print("router-bench balance: need --replicas >= 2, --sessions >= 1, --duration > 0 and --workers >= 1")
        return 2
    out, stopped = measure("balance", lambda result: run(args, result))
    if out is None or "settings" not in out:
        return stopped.exit_status if stopped is not None else 1
    if stopped is not None:
        stopped.mark(out)
    if args.json:
        print(json.dumps(out))
        return stopped.exit_status if stopped is not None else 0
    if stopped is not None:
        print(partial_headline(out))
    router = f"router-serve --workers {out['workers']}" if out["workers"] > 1 else "the router in this process"
    print(f"balance, {out['replicas']} emulated replicas, {router}, settings {out['settings']}")
    for row in out.get("skew", []):
        print(
            f"  skew, rebalance {'on ' if row['rebalance'] else 'off'}: load CV {row['load_cv']:.3f}, "
            f"KV hit {row['kv_hit_rate']:.1%}, jump rate {row['jump_rate']:.1%}, vnodes moved "
            f"{row['vnodes_moved']}, failed {row['failed']}"
        )
    for row in out.get("scale_out", []):
        print(
            f"  scale-out, warm-up {'on ' if row['warmup'] else 'off'}: moved to the new replica "
            f"{row['moved']}/{row['sessions_live']} ({row['moved_share']:.1%}, goal <= {row['moved_share_goal']:.1%}; "
            f"{row['moved_elsewhere']} elsewhere); next-turn TTFT moved "
            f"{row['moved_next_turn_ttft_ms']} ms (KV hit {row['moved_next_turn_hit_rate']}) vs stayed "
            f"{row['stayed_next_turn_ttft_ms']} ms; failed {row['failed']}"
        )
    if "drain" in out:
        d = out["drain"]
        print(
            f"  drain: {d['requests']} requests, failed {d['failed']}, cut streams {d['cut_streams']}; "
            f"{d['sessions_to_move']} sessions moved; removed after {d['removed_after_s']} s"
        )
    return stopped.exit_status if stopped is not None else 0
