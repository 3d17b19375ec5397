"""`router-bench overload`: goodput when more is offered than the fleet can serve.

One emulated fleet (`--replicas`, each running `--slots` requests at once). Its capacity is
measured first: requests per second with every slot busy, sent straight to the replicas. Then each
contender in turn is offered `--loads` times that (open-loop: Poisson arrivals for `--duration-s`,
each a new conversation's streamed chat turn, whatever came of the ones before). Every request is
counted once, by the client:

- good: answered whole, its first token within `--ttft-target-s`;
- late: answered whole, its first token later than that;
- shed: refused before any byte with a clean 429 or 503 (a client can retry elsewhere or later), or
  smg's 408 for a queue time-out;
- failed: anything else (an error status, a cut stream, the client's own time-out).

Goodput is good requests a second, to the last answer; steady goodput counts only the requests
sent at least STEADY_EDGE_S (5 s, at most a quarter of the run) from either end of the arrivals,
over that window, so the drain after the last arrival does not count. Contenders: `router-serve`
with admission (a queue of `--max-queued`, by default what the fleet finishes in
`--queue-timeout-s`, itself by default half the TTFT target in whole seconds; a replica full at
`--full-waiting` queued), `router-serve` as shipped (everything forwarded), round robin from the
client, and smg with its bounded queue (`--max-concurrent-requests` the fleet's slots plus
`--full-waiting` per replica, the same `--queue-size` and `--queue-timeout-secs`) and worker
overload protection with shedding. Routers probe at their default interval (2 s). Between
contenders the fleet drains until every replica is idle, and every replica's prefix cache is
emptied: each contender is offered the same prompts. `--contenders` runs only those it names
(admission, shipped, off: router-serve with admission off, round-robin, smg, smg-priority).

`--mix` makes the traffic two clients and conversations: a heavy client (`user` "heavy") sends
three requests for every one of a light client ("light"), and each request is, with probability
`--turn-share`, the next turn of one of that client's conversations whose last turn has ended
(its session key and history), else a new conversation. The figures are then also kept per
client and per kind (turn, new): with admission, the light client's share of the goodput should
stay near half (fair queueing, not first come first served) and turns should fare better than
new conversations (their cache is warm and their users are mid-conversation).

`--priorities` makes the traffic two priority classes: a quarter of the requests `interactive`,
the rest `bulk` (each request names its class in X-Priority, router-serve's header, and in
x-smg-priority, smg's); figures are kept per class, and smg runs a second time with its priority
scheduler (`--priority-scheduler-enabled`, every class allowed). With priorities honoured, the
interactive class keeps its goodput at 3x while bulk gives way.

How long it takes is printed up front: the capacity measurement, then each run's `--duration-s`
of arrivals and its drain (the requests still queued finish, each within CLIENT_TIMEOUT_S), then
the wait for an idle fleet. A progress line on a terminal says where the run under way stands.
SIGINT or SIGTERM print the runs that finished, marked partial (the one under way is left out:
its figures would cover another window), and exit 130 or 143.
"""

# It is past 450 lines as one benchmark: the offered load, its contenders, the tally and the report
# read together, and the docstring above is `router-bench overload --help`.

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from router.bench.common import measure
from router.bench.contenders import Contender, start_contender
from router.bench.live import Progress, partial_headline
from router.bench.proxy_bench import cpu_seconds, peer_installed
from router.bench.replicas import Child, Fleet, start_fleet
from router.measures import percentile

CLIENT_TIMEOUT_S = 60.0
IDLE_TIMEOUT_S = 60.0  # the longest wait, between runs, for every replica to be idle
STEADY_EDGE_S = 5.0  # the steady goodput leaves out requests sent this close to either end of a run
CLIENTS = (("heavy", 0.75), ("light", 0.25))  # --mix: who sends, and their shares of the arrivals
CLASSES = ("heavy", "light", "turn", "new")
PRIORITY_CLIENTS = (("interactive", 0.25), ("bulk", 0.75))  # --priorities: each class's share of the arrivals
# smg's priority classes: (name, its built-in starvation threshold in seconds, whether it may preempt)
SMG_CLASSES = (("system", 5, "true"), ("interactive", 5, "true"), ("default", 30, "false"), ("bulk", 120, "false"))


@dataclass
class Tally:
    good: int = 0
    late: int = 0
    shed: int = 0
    failed: int = 0
    ttfts: list[float] = field(default_factory=list)  # of the whole answers
    good_sent: list[float] = field(default_factory=list)  # when each good one was sent (monotonic)

    @property
    def sent(self) -> int:
        return self.good + self.late + self.shed + self.failed

    def steady_goodput(self, start: float, duration_s: float) -> float:
        """Good requests a second among those sent away from both ends of the run (STEADY_EDGE_S,
        at most a quarter of it, from each): once the queues are full, and before the arrivals'
        end lets the last held requests through. What the whole run gives (good over the time to
        the last answer) also counts the drain: a router whose last answer comes later reads as
        slower for the same answers."""
        edge = min(STEADY_EDGE_S, duration_s / 4)
        lo, hi = start + edge, start + duration_s - edge
        return sum(lo <= t < hi for t in self.good_sent) / (hi - lo)


async def one(
    http: aiohttp.ClientSession,
    url: str,
    body: bytes,
    target_s: float,
    tally: Tally,
    session: str | None = None,
    also: tuple[Tally, ...] = (),
    headers: dict[str, str] | None = None,
) -> bool:
    """Send one streamed chat turn and count it in `tally` (and in each of `also`); True when it
    was answered whole."""
    return await _one(http, url, body, target_s, _Counted((tally, *also)), session or uuid.uuid4().hex, headers)


class _Counted:
    """Counts into several tallies at once."""

    def __init__(self, tallies: tuple[Tally, ...]) -> None:
        self.tallies = tallies

    def add(self, outcome: str, ttft: float | None = None, sent_at: float | None = None) -> None:
        for t in self.tallies:
            setattr(t, outcome, getattr(t, outcome) + 1)
            if ttft is not None:
                t.ttfts.append(ttft)
            if outcome == "good" and sent_at is not None:
                t.good_sent.append(sent_at)


async def _one(
    http: aiohttp.ClientSession,
    url: str,
    body: bytes,
    target_s: float,
    tally: _Counted,
    session: str,
    headers: dict[str, str] | None = None,
) -> bool:
    t0 = time.monotonic()
    first: float | None = None
    try:
        async with http.post(
            url + "/v1/chat/completions",
            data=body,
            headers={"X-Session-ID": session, "Content-Type": "application/json", **(headers or {})},
            timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S),
        ) as r:
            if r.status in (408, 429, 503):
                data = await r.read()
                clean = data.startswith(b"{") and b'"error"' in data
                tally.add("shed" if clean else "failed")
                return False
            if r.status != 200:
                await r.read()
                tally.add("failed")
                return False
            done = broke = False
            async for chunk in r.content.iter_any():
                if first is None and b'"content":"' in chunk.replace(b'"content":""', b""):
                    first = time.monotonic() - t0
                broke = broke or b'"error"' in chunk  # an SSE error event: the stream was cut
                done = done or b"[DONE]" in chunk
            if not done or broke or first is None:
                tally.add("failed")
                return False
    except (aiohttp.ClientError, OSError, TimeoutError):
        tally.add("failed")
        return False
    tally.add("good" if first <= target_s else "late", first, t0)
    return True


def words_of(rng: random.Random, chars: int) -> str:
    return " ".join(f"w{rng.randrange(1_000_000)}" for _ in range(chars // 8))[:chars]


def chat_body(
    rng: random.Random, max_tokens: int, prompt_chars: int, history: list[dict[str, str]] | None = None, **extra: str
) -> bytes:
    messages = [*(history or ()), {"role": "user", "content": words_of(rng, prompt_chars)}]
    return orjson.dumps(
        {
            "model": "emulated-llm",  # smg refuses a request without one
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": True,
            **extra,
        }
    )


@dataclass
class Conversation:
    session: str
    client: str
    history: list[dict[str, str]] = field(default_factory=list)


async def offer(
    targets: list[str], rate: float, duration_s: float, args: argparse.Namespace, seed: int, tally: Tally | None = None
) -> tuple[Tally, float, float, dict[str, Tally]]:
    """Poisson arrivals at `rate` a second for `duration_s`, spread over `targets` in turn; with
    `--mix`, from two clients and partly turns of their conversations, tallied per class too.
    Returns the tally (`tally`, if given: it fills as answers end), when the arrivals began
    (monotonic), the seconds to the last answer, and the tallies by class."""
    rng = random.Random(seed)
    tally = tally if tally is not None else Tally()
    classes = {name: Tally() for name in CLASSES} if args.mix else {}
    if args.priorities:
        classes = {name: Tally() for name, _ in PRIORITY_CLIENTS}
    idle_talks: dict[str, list[Conversation]] = {name: [] for name, _ in CLIENTS}
    tasks: list[asyncio.Task[bool | None]] = []

    async def turn(url: str, talk: Conversation, body: bytes, kind: str) -> None:
        if await one(http, url, body, args.ttft_target_s, tally, talk.session, (classes[talk.client], classes[kind])):
            talk.history.append({"role": "assistant", "content": "(the reply)"})
        idle_talks[talk.client].append(talk)  # its next turn may come once this one has ended

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as http:
        start = time.monotonic()
        at = 0.0
        i = 0
        while True:
            at += rng.expovariate(rate)
            if at >= duration_s:
                break
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            url = targets[i % len(targets)]
            i += 1
            if args.priorities:
                rank = PRIORITY_CLIENTS[0][0] if rng.random() < PRIORITY_CLIENTS[0][1] else PRIORITY_CLIENTS[1][0]
                body = chat_body(rng, args.max_tokens, args.prompt_chars)
                asks = {"X-Priority": rank, "x-smg-priority": rank}
                job = one(http, url, body, args.ttft_target_s, tally, None, (classes[rank],), asks)
                tasks.append(asyncio.create_task(job))
                continue
            if not args.mix:
                body = chat_body(rng, args.max_tokens, args.prompt_chars)
                tasks.append(asyncio.create_task(one(http, url, body, args.ttft_target_s, tally)))
                continue
            client = "heavy" if rng.random() < CLIENTS[0][1] else "light"
            waiting = idle_talks[client]
            if waiting and rng.random() < args.turn_share:
                talk = waiting.pop(rng.randrange(len(waiting)))
                kind = "turn"
            else:
                talk, kind = Conversation(uuid.uuid4().hex, client), "new"
            body = chat_body(rng, args.max_tokens, args.prompt_chars, talk.history, user=client)
            talk.history.append({"role": "user", "content": "(the question)"})
            tasks.append(asyncio.create_task(turn(url, talk, body, kind)))
        await asyncio.gather(*tasks)
    return tally, start, time.monotonic() - start, classes


async def idle(fleet: Fleet, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Until every replica has nothing running or waiting."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            sample = await fleet.read(http, 0.0)
            if not any(sample.queued):
                return
            await asyncio.sleep(0.2)
    raise RuntimeError("the fleet did not drain between contenders")


async def forget(fleet: Fleet) -> None:
    """Empty every replica's prefix cache: each contender is offered the same prompts, which the
    one before it left cached (the contender run last would be served the cheapest)."""
    assert fleet.control is not None
    async with aiohttp.ClientSession() as http:
        for i in range(len(fleet.urls)):
            async with http.post(f"{fleet.control}/replicas/{i}/reset-cache") as r:
                if r.status >= 300:
                    raise RuntimeError(f"the emulator did not empty replica {i}'s cache: HTTP {r.status}")


async def capacity(fleet: Fleet, args: argparse.Namespace) -> float:
    """Requests a second the fleet finishes with every slot busy (closed loop, straight to the replicas)."""
    slots = args.replicas * args.slots
    rng = random.Random(1)
    tally = Tally()
    stop_at = time.monotonic() + args.calibrate_s

    async def worker(http: aiohttp.ClientSession, url: str) -> None:
        while time.monotonic() < stop_at:
            await one(http, url, chat_body(rng, args.max_tokens, args.prompt_chars), 1e9, tally)

    start = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(worker(http, fleet.urls[i % len(fleet.urls)]) for i in range(slots)))
    if tally.failed:
        raise RuntimeError(f"{tally.failed} requests failed while measuring the fleet's capacity")
    return (tally.good + tally.late) / (time.monotonic() - start)


def contenders(args: argparse.Namespace, capacity_rps: float) -> list[Contender]:
    wait_s = args.queue_timeout_s or max(1.0, round(args.ttft_target_s / 2))
    # by default, as many as the fleet finishes in that wait: a longer queue only makes every answer later
    queue = args.max_queued or max(1, math.ceil(capacity_rps * wait_s))
    timeout = f"{wait_s:g}"
    held = (
        "--max-queued",
        str(queue),
        "--queue-timeout-s",
        timeout,
        "--full-waiting",
        str(args.full_waiting),
    )
    out = [
        Contender("admission", "router-serve, admission", "router", held),
        Contender("shipped", "router-serve as shipped (admission: max_queued auto)", "router"),
        Contender("off", "router-serve, admission off (max_queued 0)", "router", ("--max-queued", "0")),
        Contender("round-robin", "round-robin (client, no router)", "direct"),
    ]
    if not args.no_peers and peer_installed("smg"):
        concurrent = args.replicas * (args.slots + args.full_waiting)
        out.append(
            Contender(
                "smg",
                "smg cache_aware, bounded queue, overload shedding",
                "smg",
                (
                    "--policy",
                    "cache_aware",
                    "--max-concurrent-requests",
                    str(concurrent),
                    "--queue-size",
                    str(queue),
                    "--queue-timeout-secs",
                    str(max(1, math.ceil(wait_s))),  # whole seconds only
                    "--worker-overload-shed",
                    "--worker-overload-waiting-requests",
                    str(args.full_waiting),
                ),
            )
        )
        if args.priorities:
            # its built-in classes reserve 160 slots, more than this fleet has: it would fall back to
            # its legacy admission (and say so only on its log). Each class as the other queues are
            # (the same depth and wait), nothing reserved, its own starvation thresholds and
            # preemption (smg 1.13's fields: each must be given)
            timeout_s = max(1, math.ceil(wait_s))
            classes = "".join(
                f"  {name}:\n    reserved_floor: 0\n    reserved_per_slot: 0\n    queue_size: {queue}\n"
                f"    queue_timeout_secs: {timeout_s}\n    starvation_threshold_secs: {starve}\n"
                f"    can_preempt: {preempt}\n"
                for name, starve, preempt in SMG_CLASSES
            )
            config = Path(tempfile.mkdtemp(prefix="router-bench-")) / "smg-priority.yaml"
            config.write_text("classes:\n" + classes)
            flags = (
                *out[-1].args,
                "--priority-scheduler-enabled",
                "--priority-scheduler-default-max-class",
                "system",
                "--priority-scheduler-config",
                str(config),
            )
            out.append(Contender("smg-priority", "smg cache_aware, priority scheduler", "smg", flags))
    if args.contenders:
        out = [c for c in out if c.name in args.contenders]
    return out


CONTENDER_NAMES = ("admission", "shipped", "off", "round-robin", "smg", "smg-priority")


def named_contenders(args: argparse.Namespace) -> str | None:
    """`--contenders` read into a list (empty: every one); why not, where it names one unknown or
    one this run cannot have."""
    names = [n.strip() for n in args.contenders.split(",") if n.strip()] if args.contenders else []
    unknown = [n for n in names if n not in CONTENDER_NAMES]
    if unknown:
        return f"unknown contender {unknown[0]!r} (known: {', '.join(CONTENDER_NAMES)})"
    if "smg-priority" in names and not args.priorities:
        return "smg-priority runs only with --priorities"
    if any(n.startswith("smg") for n in names) and (args.no_peers or not peer_installed("smg")):
        return "smg is named, but " + ("--no-peers leaves it out" if args.no_peers else "it is not installed")
    args.contenders = names
    return None


def figures(tally: Tally, elapsed_s: float, offered: float, start: float, duration_s: float) -> dict[str, Any]:
    sent = max(tally.sent, 1)
    ttfts = tally.ttfts

    def pct(q: float) -> float | None:
        return round(percentile(ttfts, q), 3) if ttfts else None

    return {
        "offered_rps": round(offered, 2),
        "sent": tally.sent,
        "goodput_rps": round(tally.good / elapsed_s, 2),
        "steady_goodput_rps": round(tally.steady_goodput(start, duration_s), 2),
        "good": round(tally.good / sent, 4),
        "late": round(tally.late / sent, 4),
        "shed": round(tally.shed / sent, 4),
        "failed": round(tally.failed / sent, 4),
        "ttft_p50_s": pct(50),
        "ttft_p99_s": pct(99),
    }


def run_status(what: str, duration_s: float, tally: Tally) -> Callable[[], str]:
    """A progress line for a run that starts now: its arrivals' time, then its answers so far."""
    began = time.monotonic()

    def describe() -> str:
        t = time.monotonic() - began
        when = f"{t:.0f} of {duration_s:g} s" if t < duration_s else "arrivals over, draining"
        return (
            f"{what}: {when}  done {tally.sent}  good {tally.good}  late {tally.late}  shed {tally.shed}  "
            f"failed {tally.failed}"
        )

    return describe


def plan_line(args: argparse.Namespace, runs: int) -> str:
    most_s = args.calibrate_s + runs * (args.duration_s + CLIENT_TIMEOUT_S + IDLE_TIMEOUT_S)
    return (
        f"{runs} runs of {args.duration_s:g} s of arrivals after {args.calibrate_s:g} s measuring capacity; "
        f"each run then drains (a few seconds when the fleet keeps up; each request at most "
        f"{CLIENT_TIMEOUT_S:g} s): about {(args.calibrate_s + runs * args.duration_s) / 60:.1f} min, "
        f"at most {most_s / 60:.0f} min, plus starting each contender"
    )


async def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The benchmark, filling `result` as each run ends (a caller stopped early keeps those)."""
    shape = ["--max-num-seqs", str(args.slots), "--num-blocks", "20000"]
    fleet_args = argparse.Namespace(engine="emulator", time_scale=args.time_scale, stream_interval=args.stream_interval)
    progress = Progress()
    fleet = await start_fleet(args.replicas, fleet_args, shape)
    result |= {
        "benchmark": "overload",
        "replicas": args.replicas,
        "slots": args.slots,
        "ttft_target_s": args.ttft_target_s,
        "duration_s": args.duration_s,
        "max_tokens": args.max_tokens,
        "runs": [],
    }
    try:
        rate = await capacity(fleet, args)
        result["capacity_rps"] = round(rate, 2)
        await idle(fleet)
        runs = [(load, c) for load in args.loads for c in contenders(args, rate)]
        progress.note(f"router-bench overload: {plan_line(args, len(runs))}")
        for k, (load, c) in enumerate(runs, 1):
            await forget(fleet)
            child: Child | None
            child, targets = await start_contender(c, fleet.urls, {})
            try:
                # on this machine the replicas and the client share the CPUs with the router
                router_cpu = cpu_seconds(child.pid) if child is not None else 0.0
                fleet_cpu = cpu_seconds(fleet.pids[0])
                live = Tally()
                describe = run_status(f"run {k}/{len(runs)} {load:g}x {c.name}", args.duration_s, live)
                async with progress.ticking(describe):
                    tally, start, elapsed, classes = await offer(
                        targets, rate * load, args.duration_s, args, seed=int(load * 100), tally=live
                    )
                used = {
                    "router_cpu_s": round(cpu_seconds(child.pid) - router_cpu, 2) if child is not None else None,
                    "fleet_cpu_s": round(cpu_seconds(fleet.pids[0]) - fleet_cpu, 2),
                }
            finally:
                if child is not None:
                    child.stop()
            row = {
                "load": load,
                "contender": c.name,
                "label": c.label,
                **figures(tally, elapsed, rate * load, start, args.duration_s),
                **used,
            }
            if classes:
                row["classes"] = {name: _class(t, elapsed, start, args.duration_s) for name, t in classes.items()}
            result["runs"].append(row)
            progress.note(
                f"  {load:g}x {c.label}: goodput {row['goodput_rps']}/s (steady {row['steady_goodput_rps']}/s), "
                f"good {row['good']:.0%}, "
                f"shed {row['shed']:.0%}, late {row['late']:.0%}, failed {row['failed']:.0%}"
            )
            await idle(fleet, IDLE_TIMEOUT_S)
    finally:
        fleet.stop()


def _class(tally: Tally, elapsed_s: float, start: float, duration_s: float) -> dict[str, Any]:
    sent = max(tally.sent, 1)
    return {
        "sent": tally.sent,
        "goodput_rps": round(tally.good / elapsed_s, 2),
        "steady_goodput_rps": round(tally.steady_goodput(start, duration_s), 2),
        "good": round(tally.good / sent, 4),
        "shed": round(tally.shed / sent, 4),
        "late": round(tally.late / sent, 4),
        "ttft_p50_s": round(percentile(tally.ttfts, 50), 3) if tally.ttfts else None,
        "ttft_p99_s": round(percentile(tally.ttfts, 99), 3) if tally.ttfts else None,
    }


def render(result: dict[str, Any]) -> str:
    lines = [partial_headline(result)] if "partial" in result else []
    lines += [
        f"{result['replicas']} emulated replicas x {result['slots']} slots: capacity "
        f"{result.get('capacity_rps', '(not measured)')} requests/s; TTFT target {result['ttft_target_s']:g} s; "
        f"{result['duration_s']:g} s per run",
        "",
        "| offered | contender | goodput / s | steady goodput / s | good | late | shed (429/503) | failed | TTFT P50 "
        "| TTFT P99 | router CPU s | replicas' CPU s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['load']:g}x | {r['label']} | {r['goodput_rps']} | {r['steady_goodput_rps']} | {r['good']:.1%} "
            f"| {r['late']:.1%} | "
            f"{r['shed']:.1%} | {r['failed']:.1%} | {r['ttft_p50_s']} | {r['ttft_p99_s']} "
            f"| {r['router_cpu_s'] if r['router_cpu_s'] is not None else '—'} | {r['fleet_cpu_s']} |"
        )
    ranked = [r for r in result["runs"] if "interactive" in r.get("classes", {})]
    if ranked:
        lines += [
            "",
            "Per priority class (--priorities): goodput / s (the share of the class's requests answered within the "
            "target), and its TTFT P50 / P99",
            "",
            "| offered | contender | interactive | bulk | interactive TTFT P50 / P99 | bulk TTFT P50 / P99 |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in ranked:
            c = r["classes"]
            i, b = c["interactive"], c["bulk"]
            lines.append(
                f"| {r['load']:g}x | {r['label']} | {i['goodput_rps']} ({i['good']:.0%}) "
                f"| {b['goodput_rps']} ({b['good']:.0%}) | {i['ttft_p50_s']} / {i['ttft_p99_s']} "
                f"| {b['ttft_p50_s']} / {b['ttft_p99_s']} |"
            )
    mixed = [r for r in result["runs"] if "heavy" in r.get("classes", {})]
    if mixed:
        lines += [
            "",
            "Per client and kind (--mix): goodput / s, and the share of each class's requests answered within "
            "the target",
            "",
            "| offered | contender | heavy | light | light's share of goodput | turns | new | turns ÷ new (good) |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in mixed:
            c = r["classes"]
            both = c["heavy"]["goodput_rps"] + c["light"]["goodput_rps"]
            share = f"{c['light']['goodput_rps'] / both:.0%}" if both else "—"
            ratio = f"{c['turn']['good'] / c['new']['good']:.2f}" if c["new"]["good"] else "—"
            lines.append(
                f"| {r['load']:g}x | {r['label']} | {c['heavy']['goodput_rps']} ({c['heavy']['good']:.0%}) "
                f"| {c['light']['goodput_rps']} ({c['light']['good']:.0%}) | {share} "
                f"| {c['turn']['goodput_rps']} ({c['turn']['good']:.0%}) | {c['new']['goodput_rps']} "
                f"({c['new']['good']:.0%}) | {ratio} |"
            )
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "overload",
        help="goodput at 0.8, 1.5 and 3 times a fleet's capacity: router-serve with and without admission, "
        "round robin, smg",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--replicas", type=int, default=4, help="emulated replicas (default 4)")
    p.add_argument("--slots", type=int, default=4, help="requests each replica runs at once (default 4)")
    p.add_argument("--loads", default="0.8,1.5,3", help="offered load, in capacities (default 0.8,1.5,3)")
    p.add_argument("--duration-s", type=float, default=20.0, help="seconds of arrivals per run (default 20)")
    p.add_argument("--ttft-target-s", type=float, default=2.0, help="a good answer's first token within (default 2)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per reply (default 32)")
    p.add_argument("--prompt-chars", type=int, default=400, help="characters per prompt (default 400)")
    p.add_argument("--time-scale", type=float, default=0.5, help="the emulator's time scale (default 0.5)")
    p.add_argument("--stream-interval", type=int, default=4, help="tokens per streamed chunk (default 4)")
    p.add_argument("--calibrate-s", type=float, default=8.0, help="seconds of the capacity measurement (default 8)")
    p.add_argument(
        "--max-queued",
        type=int,
        default=0,
        help="admission: requests held at most (default: what the fleet finishes in the queue's time-out)",
    )
    p.add_argument(
        "--queue-timeout-s",
        type=float,
        default=0.0,
        help="admission: the longest wait (default: half the TTFT target, in whole seconds, at least 1)",
    )
    p.add_argument("--full-waiting", type=int, default=2, help="admission: a replica's queue when full (default 2)")
    p.add_argument(
        "--mix",
        action="store_true",
        help="two clients (3:1) and conversations: figures per client and for turns against new conversations",
    )
    p.add_argument(
        "--turn-share",
        type=float,
        default=0.5,
        help="--mix: the chance that a request continues one of its client's conversations (default 0.5)",
    )
    p.add_argument(
        "--priorities",
        action="store_true",
        help="two priority classes (interactive 1 : bulk 3, named in X-Priority and x-smg-priority): figures per "
        "class, and smg with its priority scheduler too",
    )
    p.add_argument(
        "--contenders",
        default="",
        metavar="NAMES",
        help="only these, comma-separated, of admission, shipped, off, round-robin, smg, smg-priority "
        "(default: every one)",
    )
    p.add_argument("--no-peers", action="store_true", help="leave smg out")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    try:
        args.loads = [float(x) for x in args.loads.split(",") if x.strip()]
    except ValueError:
        print(f"router-bench overload: --loads {args.loads!r} is not a list of numbers", file=sys.stderr)
        return 2
    for name in ("replicas", "slots", "max_tokens", "full_waiting"):
        if getattr(args, name) < 1:
            print(f"router-bench overload: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if args.mix and args.priorities:
        print("router-bench overload: --mix and --priorities are two different workloads: choose one", file=sys.stderr)
        return 2
    why = named_contenders(args)
    if why is not None:
        print(f"router-bench overload: {why}", file=sys.stderr)
        return 2
    if not 0 <= args.turn_share <= 1:
        print("router-bench overload: --turn-share must be in [0, 1]", file=sys.stderr)
        return 2
    if args.max_queued < 0 or args.queue_timeout_s < 0:
        print("router-bench overload: --max-queued and --queue-timeout-s must not be negative", file=sys.stderr)
        return 2
    if not args.loads or min(args.loads) <= 0 or args.duration_s <= 0 or args.ttft_target_s <= 0:
        print("router-bench overload: loads, --duration-s and --ttft-target-s must be positive", file=sys.stderr)
        return 2
    result, stopped = measure("overload", lambda result: run(args, result))
    if result is None or "runs" not in result:
        return stopped.exit_status if stopped is not None else 1
    if stopped is not None:
        stopped.mark(result)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return stopped.exit_status if stopped is not None else 0
