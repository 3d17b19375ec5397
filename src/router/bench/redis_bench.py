"""`router-bench redis`: what the state shared through Redis costs a request, and what a slow or gone Redis does.

`--routers` routers (two by default) share one `redis-server` (a child of this process, on a
loopback port) for their sessions, membership and tenants' token budgets, in front of emulated
replicas; clients hold multi-turn chat sessions through them (a session's turns go round the
routers), with an API key whose tenant has a budget (large enough
never to refuse: every request is charged, none is refused). The run goes through five phases of
`--phase-s` each:

- `idle`: no clients: what the routers ask of Redis on their own (membership, the leader's lease);
- `healthy`: the clients start;
- `slowed`: Redis stalls `--stall-ms` of every `--stall-every-ms` (CLIENT PAUSE, every command held);
- `stopped`: Redis is killed;
- `back`: a fresh, empty Redis on the same port (no data kept): the routers reconnect and write
  back what they know.

For each phase: the requests answered, how (whole, failed clean; a cut one is a fault), their
latency P50/P99, Redis' own CPU (INFO cpu: a second, and a request's net of the routers' background),
and Redis' commands by name (INFO commandstats), a second and per request. Per
request they are counted net of the routers' own background (the idle phase's rate) and by the
feature behind them: budgets (EVALSHA: one script to reserve before the request, and one a
router sends every 100 ms to settle its requests of a tenant, summed; each one round trip running
TIME, HMGET, HSET and EXPIRE inside), sessions (GET: a
session this router has not seen is looked up; SET: where each was served, written in batches
every 100 ms), placements (PUBLISH: under `ttft`, the prompts a router placed, told to the
others in batches), and the rest (new connections' HELLO, membership followed, the leader's
lease). This bench's own commands (INFO, CLIENT PAUSE) are not counted. After the run: whether
every session served while Redis was stopped is in the new Redis (its writes kept and flushed on
return), and how many budget reservations went uncharged while it was away (the budgets fail
open, by design). It exits 1 when a request was cut (an answer that is neither whole nor a clean
error) or a session was lost.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from router.bench import redis_load
from router.bench.common import positive_float, positive_int
from router.bench.faults import Options, RedisServer, World, wait_until
from router.measures import percentile
from router.node import Node
from router.tenancy.budgets import RedisStore

PHASES = ("idle", "healthy", "slowed", "stopped", "back")
INSIDE_SCRIPTS = frozenset({"TIME", "HMGET", "HSET", "EXPIRE"})  # what the budget scripts run (no round trip)
OWN = frozenset({"INFO", "CLIENT|PAUSE"})  # this bench's own commands, not counted
FEATURES = {
    "budgets": frozenset({"EVALSHA", "EVAL"}),
    "sessions": frozenset({"GET", "SET"}),
    "placements": frozenset({"PUBLISH"}),  # (and membership's announcements, which are rare)
}
API_KEY = "sk-redis-bench"


def _keys_file(folder: Path) -> str:
    """The bench's one API key, its tenant's budget so large that no request is refused."""
    path = folder / "keys.toml"
    path.write_text(
        f'[[keys]]\nid = "bench"\ntenant = "team"\nsha256 = "{hashlib.sha256(API_KEY.encode()).hexdigest()}"\n'
        '[[tenants]]\nname = "team"\ntokens_per_minute = 1000000000\n'
    )
    return str(path)


async def _commandstats(client: aioredis.Redis) -> Counter[str]:
    """Calls by command since the server started (0 for a server that is away)."""
    try:
        info = await asyncio.wait_for(client.info("commandstats"), 2)
    except (OSError, TimeoutError, aioredis.RedisError):
        return Counter()
    return Counter({name.removeprefix("cmdstat_").upper(): int(v["calls"]) for name, v in info.items()})


async def _cpu(client: aioredis.Redis) -> float:
    """Seconds of CPU redis-server has used since it started (user and system; nan while it is away)."""
    try:
        info = await asyncio.wait_for(client.info("cpu"), 2)
    except (OSError, TimeoutError, aioredis.RedisError):
        return math.nan
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def measure(users: int, phase_s: float, stall_ms: int, every_ms: int, routers: int = 2) -> dict[str, Any]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
    folder = Path(tempfile.mkdtemp(prefix="redis-bench-"))
    world = World(Options(users=users, think_s=0.05))
    redis = RedisServer(binary)
    try:
        await redis.start()
        world.closers.append(redis.stop)
        await world.start_fleet()
        shared = {"state": redis.url, "client_keys_file": _keys_file(folder)}
        started = [await world.start_router(**shared) for _ in range(routers)]
        nodes = [node for node, _ in started]
        if await wait_until(lambda: all(n.redis is not None and n.redis.online for n in nodes), 10) is None:
            raise RuntimeError("the routers did not reach redis-server")
        probe = aioredis.from_url(redis.url, socket_timeout=2, socket_connect_timeout=1)
        world.closers.append(probe.aclose)
        clients = world.clients([url for _, url in started], "redis")
        clients.headers = {"Authorization": f"Bearer {API_KEY}"}
        phases: list[dict[str, Any]] = []
        windows: dict[str, tuple[float, float]] = {}

        async def phase(name: str) -> None:
            before, cpu0, t0 = await _commandstats(probe), await _cpu(probe), time.monotonic()
            await asyncio.sleep(phase_s)
            after, cpu1, t1 = await _commandstats(probe), await _cpu(probe), time.monotonic()
            windows[name] = (t0, t1)
            calls = Counter({c: n for c, n in (after - before).items() if c not in OWN}) if after else Counter()
            # (a server that was away at either end has no CPU figure for the phase)
            phases.append({"phase": name, "seconds": t1 - t0, "commands": dict(calls), "redis_cpu_s": cpu1 - cpu0})

        await phase("idle")
        clients.start()
        world.closers.append(clients.stop)
        await asyncio.sleep(1.0)  # sessions under way
        await phase("healthy")
        stop_stall = asyncio.Event()
        stalling = asyncio.create_task(redis_load.stall(probe, stall_ms, every_ms, stop_stall))
        await phase("slowed")
        stop_stall.set()
        await stalling
        await asyncio.sleep(stall_ms / 1000)  # the last pause ends
        await redis.stop()
        await phase("stopped")
        await redis.start()  # empty: nothing was saved
        rejoined = await wait_until(lambda: all(n.redis is not None and n.redis.online for n in nodes), 10)
        await phase("back")
        await clients.stop()
        await asyncio.sleep(0.3)  # the last session writes (every 100 ms)
        lost = await _sessions_lost(probe, clients.served, windows["stopped"])
        uncharged = sum(_uncharged(n) for n in nodes)
    finally:
        await world.close()
        shutil.rmtree(folder, ignore_errors=True)
    idle = phases[0]
    for p in phases:
        t0, t1 = windows[p["phase"]]
        answers = [(took, verdict) for sent, took, verdict in clients.answers if t0 <= sent < t1]
        whole = [took for took, verdict in answers if verdict == "succeeded"]
        p["answered"] = len(answers)
        p["succeeded"] = len(whole)
        p["failed_clean"] = sum(verdict == "failed_clean" for _, verdict in answers)
        p["p50_s"] = percentile(whole, 50)
        p["p99_s"] = percentile(whole, 99)
        total = sum(p["commands"].values())
        p["commands_per_s"] = total / p["seconds"]
        p["commands_per_request"] = total / len(answers) if answers else math.nan
        # per request, net of the background (the idle phase's rate), by feature; round trips only
        net = {
            cmd: max(0.0, n - idle["commands"].get(cmd, 0) / idle["seconds"] * p["seconds"]) / len(answers)
            for cmd, n in p["commands"].items()
            if answers and cmd not in INSIDE_SCRIPTS
        }
        by_feature = {f: sum(v for c, v in net.items() if c in cmds) for f, cmds in FEATURES.items()}
        by_feature["other"] = sum(v for c, v in net.items() if not any(c in cmds for cmds in FEATURES.values()))
        p["round_trips_per_request"] = by_feature if answers else {}
        # Redis' own CPU: a second of the phase, and a request's net of the routers' background
        p["redis_cpu_ms_per_s"] = p["redis_cpu_s"] / p["seconds"] * 1e3
        background = idle["redis_cpu_s"] / idle["seconds"] * p["seconds"]
        p["redis_cpu_us_per_request"] = (p["redis_cpu_s"] - background) / len(answers) * 1e6 if answers else math.nan
    return {
        "routers": routers,
        "users": users,
        "phase_s": phase_s,
        "stall": f"{stall_ms} ms of every {every_ms} ms",
        "phases": phases,
        "cut_silently": clients.tally.cut_silently,
        "lost_detail": clients.tally.lost,
        "sessions_served_while_stopped": lost[0],
        "sessions_lost": lost[1],
        "rejoined_after_s": rejoined,
        "uncharged_while_away": uncharged,
    }


async def _sessions_lost(
    probe: aioredis.Redis, served: dict[str, list[tuple[float, str]]], window: tuple[float, float]
) -> tuple[int, int]:
    """(sessions served while Redis was stopped, of them those the new Redis does not hold)."""
    during = {s for s, turns in served.items() if any(window[0] <= t < window[1] for t, _ in turns)}
    held: set[bytes] = set()
    async for key in probe.scan_iter(match="kvar:*:s:*", count=1000):
        held.add(key.rpartition(b":s:")[2])
    missing = sum(s.encode().hex().encode() not in held for s in during)
    return len(during), missing


def _uncharged(node: Node) -> int:
    store = node.budgets.store if node.budgets is not None else None
    return store.errors if isinstance(store, RedisStore) else 0


def render(result: dict[str, Any]) -> str:
    lines = [
        f"{result['routers']} routers on one redis-server, {result['users']} users holding chat sessions "
        f"through them, every request charged to a tenant's budget; phases of {result['phase_s']:g} s; slowed: "
        f"Redis paused {result['stall']}. Redis CPU: ms a second of the phase, and µs a request net of the "
        "routers' background (the idle phase's).",
        "",
        "| phase | answered | whole | failed clean | P50 (ms) | P99 (ms) | Redis commands/s | per request "
        "| round trips a request: budgets, sessions, placements, other | Redis CPU: ms/s, µs a request "
        "| by command (per request) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for p in result["phases"]:
        n = p["answered"]
        top = sorted(p["commands"].items(), key=lambda kv: -kv[1])[:6]
        by = ", ".join(f"{k} {v / n:.2f}" if n else f"{k} {v / p['seconds']:.1f}/s" for k, v in top) or "—"
        lines.append(
            f"| {p['phase']} | {n:,} | {p['succeeded']:,} | {p['failed_clean']:,} | {_ms(p['p50_s'])} "
            f"| {_ms(p['p99_s'])} | {p['commands_per_s']:,.1f} | {_num(p['commands_per_request'])} "
            f"| {', '.join(f'{v:.2f}' for v in p['round_trips_per_request'].values()) or '—'} "
            f"| {_num(p['redis_cpu_ms_per_s'])}, {_num(p['redis_cpu_us_per_request'])} | {by} |"
        )
    lines += [
        "",
        f"Cut (neither whole nor a clean error): {result['cut_silently']}. Sessions served while Redis was "
        f"stopped: {result['sessions_served_while_stopped']}, missing from the new Redis after it came back: "
        f"{result['sessions_lost']}. Budget reservations let through uncharged while Redis was away: "
        f"{result['uncharged_while_away']}. Routers back on Redis {_num(result['rejoined_after_s'])} s after it "
        "restarted.",
    ]
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return "—" if math.isnan(seconds) else f"{seconds * 1e3:,.0f}"


def _num(value: float | None) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:.2f}"


def run(args: argparse.Namespace) -> int:
    if args.rates is not None:
        return _run_rates(args)
    try:
        result = asyncio.run(measure(args.users, args.phase_s, args.stall_ms, args.stall_every_ms, args.routers))
    except RuntimeError as exc:
        print(f"router-bench redis: {exc}", file=sys.stderr)
        return 2
    _show(args, "redis", result, render(result))
    return 1 if result["cut_silently"] or result["sessions_lost"] else 0


def _show(args: argparse.Namespace, name: str, result: dict[str, Any], table: str) -> None:
    """Print the run (its table, or its JSON with --json), and keep both in --out."""
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
        (args.out / f"{name}.md").write_text(table + "\n")
    print(json.dumps(result, indent=1) if args.json else table)


def _run_rates(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(
            redis_load.measure(
                args.rates, args.procs, args.phase_s, args.sessions, args.faults, args.stall_ms, args.stall_every_ms
            )
        )
    except RuntimeError as exc:
        print(f"router-bench redis: {exc}", file=sys.stderr)
        return 2
    _show(args, "redis-rates", result, redis_load.render(result))
    wrong = redis_load.faulty(result)
    if wrong is not None:
        print(f"router-bench redis: {wrong}", file=sys.stderr)
        return 1
    return 0


def _rates(text: str) -> list[int]:
    try:
        rates = [positive_int(x) for x in text.split(",") if x.strip()]
    except argparse.ArgumentTypeError:
        rates = []
    if not rates:
        raise argparse.ArgumentTypeError(f"{text!r}: requests a second, comma-separated (1000,2000,4000)")
    return rates


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "redis",
        help="the state shared through Redis: commands per request, and requests while Redis is slow or gone",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--routers", type=positive_int, default=2, help="routers sharing the one Redis")
    p.add_argument("--users", type=positive_int, default=12, help="users holding chat sessions")
    p.add_argument("--phase-s", type=positive_float, default=4.0, help="seconds each phase lasts")
    p.add_argument("--stall-ms", type=positive_int, default=200, help="how long each pause of the slowed phase is")
    p.add_argument("--stall-every-ms", type=positive_int, default=250, help="a pause begins this often")
    p.add_argument(
        "--rates",
        type=_rates,
        default=None,
        help="instead of routers: drive a request's shared state (router.bench.redis_load) at these requests a "
        "second, comma-separated, one phase each",
    )
    p.add_argument("--procs", type=positive_int, default=2, help="with --rates: processes driving it")
    p.add_argument("--sessions", type=positive_int, default=100_000, help="with --rates: sessions drawn from")
    p.add_argument("--faults", action="store_true", help="with --rates: slowed, stopped and back at the last rate")
    p.add_argument("--out", type=Path, default=None, help="folder for redis.json and redis.md (redis-rates.*)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


__all__ = ["add_parser", "measure", "render", "run"]
