"""`router-bench redis --rates R1,R2,...`: the shared state's own code at thousands of requests a second.

The five phases of `router-bench redis` go through whole routers in front of emulated replicas,
which this machine drives at a few dozen requests a second. Here `--procs` processes (routers
without HTTP or replicas) each run what a request asks of Redis, with the router's own objects,
at an open-loop Poisson rate:

- its tenant's budget reserved (`Budgets.admit` on a `RedisStore`: the reserve script), on its path;
- its session looked up (`RedisSessions.lookup`: one GET, given up after 50 ms), on its path. The
  sessions are drawn from one population that the processes share, so a turn mostly comes to a
  process that did not serve the one before, as when turns go round routers;
- where it was served written (`RedisSessions.served`: SETs in batches every 100 ms), and its
  prompt's placement told to the others (`RedisPlacements.placed`: PUBLISH in batches);
- its reservation settled with what it used (`Budgets.settle_now`: off its path, summed with the
  process's other settlements of the tenant and sent as one settle script every 100 ms).

Each rate is a phase of `--phase-s`. With `--faults`, three more at the last rate: `slowed` (Redis
holds every command `--stall-ms` of every `--stall-every-ms`), `stopped` (killed), `back` (a
fresh, empty Redis on the same port). Every phase ends with the processes' requests finished and
their batches written, so Redis' own counts for it are whole: the budget scripts it ran are
checked against those whose answers reached the processes (none run unbeknown to them),
and after `back` every session served while Redis was stopped must be in the new one.

Reported a phase: requests a second asked and started (a process more than MAX_IN_FLIGHT behind
skips an arrival and counts it), the on-path time (reserve and lookup) P50/P99, Redis' commands
a request by feature, Redis' CPU a second and a request, and the processes' own CPU a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing as mp
import random
import shutil
import time
from array import array
from collections import Counter
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import redis.asyncio as aioredis
import uvloop

from router.bench.faults import RedisServer
from router.measures import percentile
from router.state.redis import FLUSH_S, RedisPlacements, RedisSessions
from router.tenancy.budgets import Budgets, RedisStore, Reservation

NAMESPACE = "bench"
TENANT = "team"
MAX_IN_FLIGHT = 2_000  # requests a process has under way at most; an arrival past it is skipped
ANSWER_S = 60.0  # the longest a process may take past its phase to answer
SCRIPTS = ("EVALSHA", "EVAL")
FEATURES = {
    "budgets": frozenset(SCRIPTS),
    "sessions": frozenset({"GET", "SET"}),
    "placements": frozenset({"PUBLISH"}),
}
OWN = frozenset({"INFO", "CLIENT|PAUSE", "SCAN"})  # the bench's own commands
BODY = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 200}
RAW_SIZE = 480


# ---- one process: a router's shared state, driven


def process_main(url: str, seed: int, sessions: int, conn: Connection) -> None:
    uvloop.run(_process(url, seed, sessions, conn))


async def _process(url: str, seed: int, sessions: int, conn: Connection) -> None:
    rng = random.Random(seed)
    store = RedisStore.connect(url, f"kvar:{NAMESPACE}:")
    budgets = Budgets({TENANT: 10**15}, store, reserve_tokens=256)
    directory = RedisSessions.connect(url, NAMESPACE, ttl_s=3600)
    learnt = [0]
    placements = RedisPlacements(url, NAMESPACE, lambda replica, chain: learnt.__setitem__(0, learnt[0] + 1))
    background = [asyncio.create_task(directory.run()), asyncio.create_task(placements.run())]
    deadline = time.monotonic() + 10
    while not directory.online and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    conn.send(("ready", directory.online))
    try:
        while True:
            message = await asyncio.to_thread(conn.recv)
            if message[0] == "end":
                break
            _, rate, seconds, track = message
            conn.send(await _phase(rng, sessions, budgets, store, directory, placements, learnt, rate, seconds, track))
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await directory.close(own_client=True)
        await placements.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(store.redis.aclose(), 1)


async def _phase(
    rng: random.Random,
    sessions: int,
    budgets: Budgets,
    store: RedisStore,
    directory: RedisSessions,
    placements: RedisPlacements,
    learnt: list[int],
    rate: float,
    seconds: float,
    track: bool,
) -> dict[str, Any]:
    """Requests at `rate` a second (Poisson) for `seconds`; then every one finished and the batches written."""
    on_path: list[float] = []
    counts: Counter[str] = Counter()
    served: set[str] = set()
    errors0, answered0, told0, learnt0 = store.errors, store.answered, placements.told, learnt[0]
    in_flight: set[asyncio.Task[None]] = set()

    async def request(session: int) -> None:
        key = b"s%d" % session
        t0 = time.perf_counter()
        admitted = await budgets.admit(TENANT, BODY, RAW_SIZE)
        found = await directory.lookup(key)
        on_path.append(time.perf_counter() - t0)
        counts["found"] += found is not None
        replica = f"r{session % 64}"
        directory.served(key, replica, int(time.time() * 1000))
        placements.placed(replica, array("Q", (rng.getrandbits(64) for _ in range(8))))
        if track:
            served.add(key.hex())
        if not isinstance(admitted, Reservation):
            counts["refused"] += 1
            return
        counts["charged"] += admitted.charged
        budgets.settle_now(admitted, admitted.tokens - 1)  # it used one token less than reserved: a settlement

    cpu0, start = time.process_time(), time.perf_counter()
    due = start
    end = start + seconds
    while True:
        due += rng.expovariate(rate)
        if due >= end:
            break
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        counts["asked"] += 1
        if len(in_flight) >= MAX_IN_FLIGHT:
            counts["skipped"] += 1
            continue
        task = asyncio.create_task(request(rng.randrange(sessions)))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    sent_s = time.perf_counter() - start
    if in_flight:
        await asyncio.wait(in_flight)
    await store.flush()  # the settlements owed
    await asyncio.sleep(3 * FLUSH_S)  # the sessions' and placements' last batches
    return {
        "asked": counts["asked"],
        "started": counts["asked"] - counts["skipped"],
        "sent_s": sent_s,
        "charged": counts["charged"],
        "refused": counts["refused"],
        "found": counts["found"],
        "failed_calls": store.errors - errors0,  # reservations let through uncharged, settlements dropped
        "answered": store.answered - answered0,  # budget scripts whose answer came back
        "told": placements.told - told0,
        "learnt": learnt[0] - learnt0,
        "on_path_s": on_path,
        "cpu_s": time.process_time() - cpu0,
        "served": sorted(served),
    }


class Driver:
    """One process, asked over its pipe; one that dies or falls silent ends the run with one line."""

    def __init__(self, url: str, seed: int, sessions: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc: BaseProcess = ctx.Process(target=process_main, args=(url, seed, sessions, child), daemon=True)
        self.proc.start()
        child.close()

    def receive(self, within_s: float) -> Any:
        try:
            if not self.conn.poll(within_s):
                raise RuntimeError(f"a load process did not answer within {within_s:.0f} s")
            return self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(1.0)
            raise RuntimeError(f"a load process ended (exit code {self.proc.exitcode})") from None

    def end(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("end",))
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# ---- the run


async def _stats(probe: aioredis.Redis) -> tuple[Counter[str] | None, float]:
    """Redis' calls by command and CPU seconds since it started (None and nan while it is away)."""
    try:
        commands = await asyncio.wait_for(probe.info("commandstats"), 2)
        cpu = await asyncio.wait_for(probe.info("cpu"), 2)
    except (OSError, TimeoutError, aioredis.RedisError):
        return None, math.nan
    calls = Counter({name.removeprefix("cmdstat_").upper(): int(v["calls"]) for name, v in commands.items()})
    return calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


async def stall(probe: aioredis.Redis, stall_ms: int, every_ms: int, stop: asyncio.Event) -> None:
    """Every `every_ms`, hold every client's commands for `stall_ms` (CLIENT PAUSE ALL), until `stop`."""
    while not stop.is_set():
        with contextlib.suppress(OSError, TimeoutError, aioredis.RedisError):
            await probe.client_pause(stall_ms, all=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every_ms / 1000)


async def measure(
    rates: list[int],
    procs: int = 2,
    phase_s: float = 4.0,
    sessions: int = 100_000,
    faults: bool = False,
    stall_ms: int = 200,
    stall_every_ms: int = 250,
    seed: int = 1,
) -> dict[str, Any]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
    redis = RedisServer(binary)
    await redis.start()
    drivers: list[Driver] = []
    probe = aioredis.from_url(redis.url, socket_timeout=2, socket_connect_timeout=1)
    phases: list[dict[str, Any]] = []
    try:
        drivers = [Driver(redis.url, seed + i, sessions) for i in range(procs)]
        ready = [await asyncio.to_thread(d.receive, 30) for d in drivers]
        if not all(online for _, online in ready):
            raise RuntimeError("the load processes did not reach redis-server")

        async def phase(name: str, rate: int, seconds: float, track: bool = False) -> dict[str, Any]:
            before, cpu0 = await _stats(probe)
            t0 = time.monotonic()
            for d in drivers:
                d.conn.send(("phase", rate / procs, seconds, track))
            parts = await asyncio.gather(*(asyncio.to_thread(d.receive, seconds + ANSWER_S) for d in drivers))
            after, cpu1 = await _stats(probe)
            row = _row(name, rate, time.monotonic() - t0, parts, before, after, cpu1 - cpu0)
            phases.append(row)
            return row

        await phase("warm-up", rates[0], 1.0)
        phases.clear()
        for rate in rates:
            await phase(f"{rate:,}/s", rate, phase_s)
        lost: dict[str, int] = {}
        if faults:
            top = rates[-1]
            stop = asyncio.Event()
            stalling = asyncio.create_task(stall(probe, stall_ms, stall_every_ms, stop))
            try:
                await phase("slowed", top, phase_s)
            finally:
                stop.set()
                await stalling
            await asyncio.sleep(stall_ms / 1000)
            await redis.stop()
            stopped = await phase("stopped", top, phase_s, track=True)
            await redis.start()
            await phase("back", top, phase_s)
            held: set[bytes] = set()
            async for key in probe.scan_iter(match=f"kvar:{NAMESPACE}:s:*", count=1000):
                held.add(key.rpartition(b":s:")[2])
            during = stopped.pop("served_while")
            lost = {"served_while_stopped": len(during), "missing_after": sum(k.encode() not in held for k in during)}
    finally:
        for d in drivers:
            await asyncio.to_thread(d.end)
        with contextlib.suppress(Exception):
            await probe.aclose()
        await redis.stop()
    for p in phases:
        p.pop("served_while", None)
    return {
        "procs": procs,
        "phase_s": phase_s,
        "sessions": sessions,
        "stall": f"{stall_ms} ms of every {stall_every_ms} ms" if faults else None,
        "phases": phases,
        "sessions_lost": lost,
    }


def _row(
    name: str,
    rate: int,
    seconds: float,
    parts: list[dict[str, Any]],
    before: Counter[str] | None,
    after: Counter[str] | None,
    redis_cpu_s: float,
) -> dict[str, Any]:
    started = sum(p["started"] for p in parts)
    away = after is None or before is None  # Redis was away at either end: nothing known of the phase
    calls: Counter[str] = Counter()
    if after is not None and before is not None:
        calls.update({c: n for c, n in (after - before).items() if c not in OWN})
    on_path = [x for p in parts for x in p["on_path_s"]]
    charged = sum(p["charged"] for p in parts)
    failed = sum(p["failed_calls"] for p in parts)
    trips = {
        f: sum(n for c, n in calls.items() if c in cmds) / started if started else math.nan
        for f, cmds in FEATURES.items()
    }
    sent_s = max(p["sent_s"] for p in parts)
    reservations_failed = started - charged - sum(p["refused"] for p in parts)
    # every script Redis ran should have answered its process: one run whose answer was lost
    # (a time-out after it was sent) would be a tenant charged for a request let through uncharged
    expected_scripts = sum(p["answered"] for p in parts)
    scripts = sum(calls[c] for c in SCRIPTS) - calls["SCRIPT|LOAD"]  # a script reloaded into a new Redis runs twice
    return {
        "phase": name,
        "rate_asked": rate,
        "seconds": seconds,
        "asked": sum(p["asked"] for p in parts),
        "started": started,
        "started_per_s": started / sent_s if sent_s else math.nan,
        "on_path_p50_ms": percentile(on_path, 50) * 1e3,
        "on_path_p99_ms": percentile(on_path, 99) * 1e3,
        "charged": charged,
        "uncharged": reservations_failed,
        "settlements_dropped": failed - reservations_failed,
        "sessions_found": sum(p["found"] for p in parts),
        "placements_told": sum(p["told"] for p in parts),
        "commands": dict(calls),
        "commands_per_request": sum(n for c, n in calls.items()) / started if not away and started else math.nan,
        "round_trips_per_request": {} if away else trips,
        "scripts_run": None if away else scripts,
        "scripts_expected": expected_scripts,
        "redis_cpu_ms_per_s": redis_cpu_s / seconds * 1e3,
        "redis_cpu_us_per_request": redis_cpu_s / started * 1e6 if started else math.nan,
        "procs_cpu_us_per_request": sum(p["cpu_s"] for p in parts) / started * 1e6 if started else math.nan,
        "served_while": [k for p in parts for k in p["served"]],
    }


def render(result: dict[str, Any]) -> str:
    lines = [
        f"{result['procs']} processes running a request's shared state (budget reserved and settled, session "
        f"looked up and written, placement told) on one redis-server; {result['sessions']:,} sessions; phases of "
        f"{result['phase_s']:g} s" + (f"; slowed: Redis paused {result['stall']}." if result["stall"] else "."),
        "",
        "| phase | started/s (asked) | on-path P50 / P99 (ms) | Redis commands a request | round trips: budgets, "
        "sessions, placements | Redis CPU: ms/s, µs a request | processes' CPU µs a request | scripts run (expected) "
        "| uncharged, settlements dropped |",
        "|---|---:|---|---:|---|---|---:|---|---|",
    ]
    for p in result["phases"]:
        trips = ", ".join(f"{v:.2f}" for v in p["round_trips_per_request"].values()) or "—"
        scripts = "—" if p["scripts_run"] is None else f"{p['scripts_run']:,} ({p['scripts_expected']:,})"
        lines.append(
            f"| {p['phase']} | {p['started_per_s']:,.0f} ({p['rate_asked']:,}) | {p['on_path_p50_ms']:.2f} / "
            f"{p['on_path_p99_ms']:.2f} | {_num(p['commands_per_request'])} | {trips} | "
            f"{_num(p['redis_cpu_ms_per_s'])}, {_num(p['redis_cpu_us_per_request'])} | "
            f"{_num(p['procs_cpu_us_per_request'])} | {scripts} | {p['uncharged']:,}, {p['settlements_dropped']:,} |"
        )
    lost = result["sessions_lost"]
    if lost:
        lines += [
            "",
            f"Sessions served while Redis was stopped: {lost['served_while_stopped']:,}; missing from the new Redis "
            f"after it came back: {lost['missing_after']:,}.",
        ]
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:,.2f}"


def faulty(result: dict[str, Any]) -> str | None:
    """What went wrong, in one line (a script run twice or missing, a session lost), or None."""
    for p in result["phases"]:
        if p["scripts_run"] is not None and p["scripts_run"] != p["scripts_expected"]:
            return (
                f"phase {p['phase']}: Redis ran {p['scripts_run']} budget scripts, "
                f"the processes counted {p['scripts_expected']}"
            )
    if result["sessions_lost"].get("missing_after"):
        return f"{result['sessions_lost']['missing_after']} sessions served while Redis was stopped are not in it after"
    return None


__all__ = ["faulty", "measure", "render", "stall"]
