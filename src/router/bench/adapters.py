"""`router-bench adapters`: time to first token when requests name LoRA adapters that a replica
must load before it can run them.

One emulated fleet per contender (`--replicas`, each serving `model-b` with `--adapters` LoRA
adapters, `--max-loras` of them in GPU slots at once, least recently used out, and `--lora-load-ms`
added to the step that loads one, as vLLM pays to page an adapter in). Requests are streamed chat
turns, each a new conversation with no session key, naming adapter k with Zipf popularity
(`--zipf`: weight 1/k^s), Poisson arrivals at `--rate` a second for `--duration-s`. With more
adapters than the fleet's GPU slots, a router blind to them spreads every adapter over every
replica, and each replica keeps paging adapters in and out.

Contenders: router-serve `ttft` (its default: a replica without the adapter, where another has it,
costs `adapter_load_s` more), the same with that cost set to 0 (the preference off), router-serve
`affinity` (the first replica clockwise with the adapter loaded, under its load cap), round robin
from the client. smg is not among them: it registers a worker under one model, and answers a
request naming one of its adapters "No worker available for model". Figures: time to first token
(median and P99), adapter loads per 100 requests (the emulated engines' own count) and the share
of requests that are not whole answers.

Each contender's run is `--duration-s` of arrivals, then the requests still running finish (each
within the client's time-out); the count of runs is printed up front, and a progress line on a
terminal says where the run under way stands. SIGINT or SIGTERM print the contenders that
finished, marked partial (the one under way is left out), and exit 130 or 143.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

import aiohttp
import orjson

from router.bench.common import measure
from router.bench.contenders import Contender, start_contender
from router.bench.live import Progress, partial_headline
from router.bench.overload import CLIENT_TIMEOUT_S, Tally, chat_body, one, run_status
from router.bench.replicas import Child, Fleet, start_fleet
from router.measures import percentile

MODEL = "model-b"


def adapter_names(count: int) -> list[str]:
    return [f"lora-{k}" for k in range(count)]


def contenders(args: argparse.Namespace) -> list[Contender]:
    out = [
        Contender("ttft", "router-serve ttft (adapter preference)", "router"),
        Contender(
            "ttft-blind", "router-serve ttft, adapter_load_s 0 (no preference)", "router", ("--adapter-load-s", "0")
        ),
        Contender("affinity", "router-serve affinity", "router", ("--policy", "affinity")),
        Contender("round-robin", "round-robin (client, no router)", "direct"),
    ]
    return out


async def loads(fleet: Fleet) -> int:
    """Adapters loaded into GPU slots so far, over the fleet (the emulator's count)."""
    assert fleet.control is not None
    async with aiohttp.ClientSession() as http, http.get(fleet.control + "/replicas") as r:
        rows = await r.json(loads=orjson.loads)
    return sum(int(row["engine"].get("adapter_loads_total", 0)) for row in rows)


async def offer(targets: list[str], args: argparse.Namespace, tally: Tally) -> Tally:
    """Poisson arrivals for `--duration-s`, each naming an adapter drawn by Zipf popularity; counted
    into `tally` as they end."""
    rng = random.Random(7)  # every contender is offered the same requests
    names = adapter_names(args.adapters)
    weights = [1 / (k + 1) ** args.zipf for k in range(len(names))]
    tasks: list[asyncio.Task[bool]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        start = time.monotonic()
        at, i = 0.0, 0
        while True:
            at += rng.expovariate(args.rate)
            if at >= args.duration_s:
                break
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            adapter = rng.choices(names, weights)[0]
            body = chat_body(rng, args.max_tokens, args.prompt_chars, model=adapter)
            tasks.append(asyncio.create_task(one(http, targets[i % len(targets)], body, 1e9, tally)))
            i += 1
        await asyncio.gather(*tasks)
    return tally


async def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The benchmark, filling `result` as each contender's run ends (a caller stopped early keeps those)."""
    shape = [
        "--model",
        MODEL,
        "emulated-llm",  # also its name: the name a contender's readiness check asks for
        *(x for name in adapter_names(args.adapters) for x in ("--lora", name)),
        "--max-loras",
        str(args.max_loras),
        "--lora-load-ms",
        f"{args.lora_load_ms:g}",
        "--max-num-seqs",
        str(args.slots),
    ]
    fleet_args = argparse.Namespace(engine="emulator", time_scale=args.time_scale, stream_interval=args.stream_interval)
    result |= {
        "benchmark": "adapters",
        "replicas": args.replicas,
        "adapters": args.adapters,
        "max_loras": args.max_loras,
        "lora_load_ms": args.lora_load_ms,
        "rate": args.rate,
        "duration_s": args.duration_s,
        "zipf": args.zipf,
        "runs": [],
    }
    runs = contenders(args)
    progress = Progress()
    progress.note(
        f"router-bench adapters: {len(runs)} runs of {args.duration_s:g} s of arrivals, each then drains "
        f"(each request at most {CLIENT_TIMEOUT_S:g} s): about {len(runs) * args.duration_s / 60:.1f} min, "
        f"at most {len(runs) * (args.duration_s + CLIENT_TIMEOUT_S) / 60:.0f} min, plus starting each fleet"
    )
    for k, c in enumerate(runs, 1):
        fleet = await start_fleet(args.replicas, fleet_args, shape)  # every contender starts with no adapter loaded
        child: Child | None = None
        try:
            child, targets = await start_contender(c, fleet.urls, {})
            before = await loads(fleet)  # the contender's own first answer (start_contender) loaded one
            tally = Tally()
            async with progress.ticking(run_status(f"run {k}/{len(runs)} {c.name}", args.duration_s, tally)):
                await offer(targets, args, tally)
            loaded = await loads(fleet) - before
        finally:
            if child is not None:
                child.stop()
            fleet.stop()
        ttfts = tally.ttfts
        whole = tally.good + tally.late
        row = {
            "contender": c.name,
            "label": c.label,
            "sent": tally.sent,
            "failed": round(tally.failed / max(tally.sent, 1), 4),
            "ttft_p50_s": round(percentile(ttfts, 50), 3) if ttfts else None,
            "ttft_p99_s": round(percentile(ttfts, 99), 3) if ttfts else None,
            "loads_per_100": round(100 * loaded / max(whole, 1), 1),
        }
        result["runs"].append(row)
        progress.note(
            f"  {c.label}: TTFT P50 {row['ttft_p50_s']} s, P99 {row['ttft_p99_s']} s, "
            f"{row['loads_per_100']} adapter loads per 100 requests, failed {row['failed']:.0%}"
        )


def render(result: dict[str, Any]) -> str:
    lines = [partial_headline(result)] if "partial" in result else []
    lines += [
        f"{result['replicas']} emulated replicas, {result['adapters']} LoRA adapters (Zipf {result['zipf']:g}), "
        f"{result['max_loras']} GPU slots each, {result['lora_load_ms']:g} ms a load; {result['rate']:g} requests/s "
        f"for {result['duration_s']:g} s",
        "",
        "| contender | TTFT P50 (s) | TTFT P99 (s) | adapter loads / 100 requests | failed |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['label']} | {r['ttft_p50_s']} | {r['ttft_p99_s']} | {r['loads_per_100']} | {r['failed']:.1%} |"
        )
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "adapters",
        help="time to first token with LoRA adapters to load: router-serve with and without its adapter "
        "preference, affinity, round robin",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--replicas", type=int, default=4, help="emulated replicas (default 4)")
    p.add_argument("--slots", type=int, default=8, help="requests each replica runs at once (default 8)")
    p.add_argument("--adapters", type=int, default=16, help="LoRA adapters on the model (default 16)")
    p.add_argument("--max-loras", type=int, default=2, help="adapters in a replica's GPU slots at once (default 2)")
    p.add_argument("--lora-load-ms", type=float, default=300.0, help="engine time to load an adapter (default 300)")
    p.add_argument("--zipf", type=float, default=1.0, help="adapter popularity: weight 1/k^s (default 1)")
    p.add_argument("--rate", type=float, default=8.0, help="requests a second (default 8)")
    p.add_argument("--duration-s", type=float, default=30.0, help="seconds of arrivals per contender (default 30)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per reply (default 32)")
    p.add_argument("--prompt-chars", type=int, default=400, help="characters per prompt (default 400)")
    p.add_argument("--time-scale", type=float, default=1.0, help="the emulator's time scale (default 1)")
    p.add_argument("--stream-interval", type=int, default=4, help="tokens per streamed chunk (default 4)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    for name in ("replicas", "slots", "adapters", "max_loras", "max_tokens"):
        if getattr(args, name) < 1:
            print(f"router-bench adapters: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if min(args.rate, args.duration_s, args.time_scale) <= 0 or args.lora_load_ms < 0 or args.zipf < 0:
        print(
            "router-bench adapters: --rate, --duration-s and --time-scale must be positive, "
            "--lora-load-ms and --zipf not negative",
            file=sys.stderr,
        )
        return 2
    result, stopped = measure("adapters", lambda result: run(args, result))
    if result is None or "runs" not in result:
        return stopped.exit_status if stopped is not None else 1
    if stopped is not None:
        stopped.mark(result)
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() if args.json else render(result))
    return stopped.exit_status if stopped is not None else 0
