"""`router-bench events`: the KV-event plane at fleet scale, one router process's subscriber against
many light publishers that speak vLLM's wire.

Each publisher is an engine's KV-event sockets (router.emulator.kvevents.Publisher: a PUB socket
numbering its messages from 0, a replay ROUTER socket keeping the last `--replay-steps`) driven by a
light model of an engine's prefix cache (router.bench.event_publishers): every `--batch-blocks /
--blocks-per-s` seconds, one scheduler step's message storing `--batch-blocks` full blocks of `--block-size`
tokens (a request's chain, a new one every `--chain-blocks`), and once the cache holds
`--capacity-blocks`, one `BlockRemoved` per block it evicts (oldest first), as vLLM sends them. The
defaults are an H200 serving an 8B model: about 20,000 prompt tokens a second, 16-token blocks, a
step of 64 blocks, 80,000 blocks of KV (80 million for a thousand replicas). The publishers run in
`--publisher-procs` child processes, started before the router joins.

The subscriber is the router's own (router.engines.kvfeed.Feed, its index router.kvevents), in
this process, configured as `router-serve` would be with `kv_event_endpoints` naming each
publisher; it joins `--join-after` seconds after the publishers start, and asks each replay socket
for what it missed. For each fleet size in `--publishers` the table shows: the time until it
believes every replica (its events followed with no gap), the blocks a second the publishers sent
and the share of them the index applied, messages a second, the lag from a message's timestamp to
its application (P50, P99), the subscriber's CPU (cores, and microseconds a block) and its memory
growth per million blocks held (and, in brackets, the compiled index's own bytes). The publishers
share this machine's cores with the subscriber: where they cannot send at the asked rate, the
table says how much they sent. It exits 1 only when the subscriber met a message it could not read.

With `--routers N`, N routers' subscribers (each its own fleet, index and sockets, as N router
processes would have) follow the same publishers from this process, and with `--late-router` one
more joins halfway through the run; a second table says how often they decide alike on keyless
traffic while events are in flight (router.bench.event_agreement), and how long the late one took
to believe every replica. CPU and memory are then this process's: every router's together. With
`--router-procs` the routers after the first each run in a process of their own, asked over a pipe
(router.bench.event_remote): their skew is then between processes, not one loop's turns. With
`--shared-index` as well, only the first router follows the engines, into an index in shared
memory (router.kvevents.shared), and the other processes read it: one subscriber a host.

With `--serve-workers N` (comma-separated counts) the subscriber is `router-serve --workers N`
itself, started as an operator would start it, and the table is what the host pays for it: the
CPU and memory of its whole process tree, the time until its /metrics say every replica is
believed, and its lag histogram's percentiles (router.bench.event_serve). `--followers K`
(comma-separated) runs each with its `kv_event_followers` at K: the control process and K - 1
processes beside it, each following a shard of the publishers.

With `--index-max-mib N` this process's subscriber runs under the router's `kv_events_max_mib`:
the publishers whose KV capacity would take its index past N MiB are not followed, and the
table counts only those followed (and says how many were).

It is past 450 lines because it is one benchmark whole: the run of a fleet size (publishers,
subscribers, the routers compared), its table and its command line; what other parts could use
is apart already (event_publishers, event_agreement, event_remote, event_serve).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import math
import os
import sys
import time
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from router._runtime import raise_open_files
from router.bench.common import free_port, positive_float, positive_int
from router.bench.event_agreement import Agreement, Recorder, figure, gpu_holders, render_agreement, sample
from router.bench.event_publishers import Shape, end_publishers, start_publishers, stop_publishers
from router.bench.event_remote import Remote, decide_all, subscriber
from router.bench.event_serve import measure_serve, render_serve
from router.config import ReplicaSpec, RouterConfig
from router.engines.kvfeed import Feed
from router.kvevents.shared import SharedIndex
from router.kvevents.truth import Truth
from router.kvevents.wire import Batch
from router.measures import percentile
from router.metrics import RouterMetrics

MIB = 1 << 20
SETTLE_S = 0.5  # after the run, the subscriber is done once nothing arrived for this long
SETTLE_MAX_S = 10.0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Routers:
    """The subscribers: how many join together, and whether one more joins halfway through."""

    together: int = 1
    late: bool = False
    procs: bool = False  # the routers after the first each in a process of its own (router.bench.event_remote)
    shared: bool = False  # ... reading the first router's index in shared memory (router.kvevents.shared)


async def measure(
    publishers: int,
    shape: Shape,
    duration_s: float,
    join_after_s: float,
    procs: int,
    routers: Routers = Routers(),
    serve_workers: int = 0,
    max_mib: int = 0,
    followers: int = 1,
) -> dict[str, Any]:
    """One fleet size: publishers started, the subscribers joining (this process's, or with
    `serve_workers` a `router-serve --workers N` child: router.bench.event_serve), the run, and
    what it measured."""
    base = free_port(2 * publishers)
    ports = [(base + 2 * i, base + 2 * i + 1) for i in range(publishers)]
    specs = tuple(ReplicaSpec(f"r{i}", f"http://127.0.0.1:9/r{i}") for i in range(publishers))
    config = RouterConfig(
        replicas=specs,
        health_checks=False,
        kv_event_endpoints=tuple(f"r{i}=tcp://127.0.0.1:{p};tcp://127.0.0.1:{q}" for i, (p, q) in enumerate(ports)),
        kv_events_max_mib=max_mib,
    )
    start_at = time.time() + 1.0 + publishers / 500  # every child opened its sockets by then
    children = start_publishers(ports, shape, procs, start_at)
    remotes: list[Remote] = []
    try:
        if serve_workers:
            endpoints = [(f"r{i}", p, q) for i, (p, q) in enumerate(ports)]
            return await measure_serve(
                endpoints,
                shape,
                serve_workers,
                start_at + join_after_s,
                start_at + duration_s,
                lambda: stop_publishers(children),
                followers,
            )
        shared = f"kvar-bench-{os.getpid()}" if routers.shared else None
        if routers.procs:  # the routers after the first, each in a process of its own
            remotes = [Remote(config, shape, shared) for _ in range(routers.together - 1)]
        row = await _subscribe(config, shape, duration_s, join_after_s, start_at, children, routers, remotes, shared)
    finally:
        cpus = [await r.end() for r in remotes]
        end_publishers(children)
    # each other router process's CPU, from its joining to its end (the settling after the run included)
    row["router_procs_cpu_s"] = sum(cpus) / len(cpus) if cpus else math.nan
    row["router_procs_rss_mib"] = sum(r.rss_mib for r in remotes) / len(remotes) if remotes else math.nan
    row["router_procs_private_mib"] = sum(r.private_mib for r in remotes) / len(remotes) if remotes else math.nan
    return row


async def _subscribe(
    config: RouterConfig,
    shape: Shape,
    duration_s: float,
    join_after_s: float,
    start_at: float,
    children: list[tuple[Any, Connection]],
    routers: Routers,
    remotes: list[Remote],
    shared: str | None = None,
) -> dict[str, Any]:
    metrics = RouterMetrics()
    lags = array("d")
    applied = [0]
    last = [time.monotonic()]
    compared = routers.together > 1 or routers.late
    recorder = Recorder(shape.block_size)

    def heard(rid: str, batch: Batch) -> None:
        applied[0] += 1
        last[0] = time.monotonic()
        if batch.ts > 0:
            lags.append(time.time() - batch.ts)
        if compared:
            recorder.heard(rid, batch)

    async def remote_sure() -> int:
        """The fewest replicas a router in another process believes (every one, with none)."""
        counts = await asyncio.gather(*(r.ask(("sure",)) for r in remotes))
        return min(counts, default=len(ids))

    async with aiohttp.ClientSession() as http:
        index = SharedIndex(shared) if shared is not None else None
        feeds = [
            subscriber(config, shape, metrics, http, index if i == 0 else None)
            for i in range(routers.together - len(remotes))
        ]
        feed = feeds[0]
        feed.applied = heard
        ids = [r.id for r in feed.fleet.replicas]
        end = start_at + duration_s  # wall clock
        late: list[Feed] = []
        late_believe = [math.nan]

        async def join_late() -> None:
            await asyncio.sleep(max(start_at + duration_s / 2 - time.time(), 0.0))
            late.append(subscriber(config, shape, metrics, http))
            at = time.monotonic()
            await late[0].find()
            while time.time() < end and not all(late[0].truth.sure(rid) for rid in ids):
                await asyncio.sleep(0.02)
            if all(late[0].truth.sure(rid) for rid in ids):
                late_believe[0] = time.monotonic() - at

        def late_truth() -> Truth | None:
            return late[0].truth if late and not math.isnan(late_believe[0]) else None

        await asyncio.sleep(max(start_at + join_after_s - time.time(), 0.0))
        gc.collect()
        rss0, cpu0, joined = _rss(), time.process_time(), time.monotonic()
        for f in feeds:
            await f.find()
        ids = [rid for rid in ids if rid not in feed.unfollowed]  # (past kv_events_max_mib: never followed)
        for r in remotes:
            await r.ask(("join",))
        joining = asyncio.create_task(join_late()) if routers.late else None
        # joining: until every router believes every replica (its replay applied), or the run ends first
        believe_s = math.nan
        while time.time() < end:
            if all(f.truth.sure(rid) for f in feeds for rid in ids) and await remote_sure() == len(ids):
                believe_s = time.monotonic() - joined
                break
            await asyncio.sleep(0.02)
        believed = min(min(sum(f.truth.sure(rid) for rid in ids) for f in feeds), await remote_sure())
        # steady: from then to the end of the run (empty when it never caught up)
        del lags[:]
        n1, cpu1, t1, stored1 = applied[0], time.process_time(), time.monotonic(), _stored(feed, ids)
        agreement = Agreement()
        together = [f.truth for f in feeds]
        if compared and believed == len(ids):
            holders = functools.partial(gpu_holders, feed.truth, ids) if index is not None else None
            asked = functools.partial(decide_all, remotes, holders=holders) if remotes else None
            await sample(recorder, together, late_truth, ids, agreement, end, time.time, remote=asked)
        await asyncio.sleep(max(end - time.time(), 0.0))
        n2, cpu2, t2, stored2 = applied[0], time.process_time(), time.monotonic(), _stored(feed, ids)
        if joining is not None:
            joining.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await joining
        steady_lags = array("d", lags)
        sent = stop_publishers(children)
        settle = time.monotonic()
        while time.monotonic() - max(last[0], settle) < SETTLE_S and time.monotonic() - settle < SETTLE_MAX_S:
            await asyncio.sleep(0.05)
        held = sum(h.blocks() for rid in ids for h in feed.truth.of(rid))
        figures = [h.figures for rid in ids for h in feed.truth.of(rid)]
        rss = _rss()
        index_bytes = feed.truth.index.memory_bytes()
        late_believed = sum(late[0].truth.sure(rid) for rid in ids) if late else 0
        for f in feeds + late:
            await f.close()
        if index is not None:
            index.close()
    whole = t2 - joined
    # steady only once every replica was believed before the run's end (else there is no such window)
    steady = t2 - t1 if believed == len(ids) else 0.0
    blocks = stored2 - stored1 if steady else 0
    return {
        "publishers": len(config.replicas),
        "followed": len(ids),
        "believed": believed,
        "believe_s": believe_s,
        "sent_blocks_per_s": sent["stored"] / sent["seconds"] if sent["seconds"] else 0.0,
        "asked_blocks_per_s": shape.blocks_per_s * len(config.replicas),
        "skipped_steps": sent["skipped_steps"],
        "sent_messages": sent["messages"],
        "sent_stored": sent["stored"],
        "applied_by_end": stored2,  # stored blocks the index had applied when the publishers stopped
        "applied_stored": sum(f.stored for f in figures),  # ... and once it had drained what was left
        # from joining to the end: the replays and whatever backlog, and the subscriber's CPU for it
        "whole_s": whole,
        "whole_blocks_per_s": stored2 / whole if whole > 0 else 0.0,
        "whole_cpu_cores": (cpu2 - cpu0) / whole if whole > 0 else 0.0,
        "whole_cpu_us_per_block": (cpu2 - cpu0) / stored2 * 1e6 if stored2 else math.nan,
        # steady: every replica believed, to the end of the run
        "steady_s": steady,
        "absorbed_blocks_per_s": blocks / steady if steady > 0 else math.nan,
        "messages_per_s": (n2 - n1) / steady if steady > 0 else math.nan,
        "lag_p50_s": percentile(steady_lags, 50) if steady else math.nan,
        "lag_p99_s": percentile(steady_lags, 99) if steady else math.nan,
        "cpu_cores": (cpu2 - cpu1) / steady if steady > 0 else math.nan,
        "cpu_us_per_block": (cpu2 - cpu1) / blocks * 1e6 if blocks else math.nan,
        "held_blocks": held,
        "rss_growth_mib": (rss - rss0) / MIB,
        "mib_per_million_blocks": (rss - rss0) / MIB / (held / 1e6) if held else math.nan,
        # the compiled index alone (blocks, their engines' names, both tables), one router's
        "index_mib_per_million_blocks": index_bytes / MIB / (held / 1e6) if held else math.nan,
        "index_mib": index_bytes / MIB,
        "budget_mib": feed.budget.blocks * feed.budget.per_block / MIB,
        "gaps": sum(f.gaps for f in figures),
        "duplicates": sum(f.duplicates for f in figures),
        "restarts": sum(f.restarts for f in figures),
        "orphans": sum(f.orphans for f in figures),
        "unsure_episodes": sum(f.unsure_episodes for f in figures),
        "bad_messages": sum(f.bad_messages for f in feeds + late),
        "routers": routers.together,
        "router_procs": len(remotes),  # of them, each in a process of its own
        "shared_index": shared is not None,  # ... reading the first one's index in shared memory
        "late_router": routers.late,
        "decisions_compared": agreement.samples,
        "decisions_by_index": agreement.held,
        "decisions_identical": agreement.identical,
        "agreement": agreement.share,
        "late_believe_s": late_believe[0],
        "late_believed": late_believed,
        "late_compared": agreement.late_samples,
        "late_agreement": agreement.late_share,
    }


def _stored(feed: Feed, ids: list[str]) -> int:
    return sum(h.figures.stored for rid in ids for h in feed.truth.of(rid))


def render(shape: Shape, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"Publishers: {shape.blocks_per_s:,.0f} blocks a second asked of each, {shape.batch_blocks} a message, "
        f"{shape.block_size}-token blocks, {shape.capacity_blocks:,} blocks of KV each; one subscriber "
        f"(this process, the router's Feed); {os.cpu_count()} CPUs shared with the publishers. Believed: "
        "seconds from joining until every replica's replay was applied (— : not by the run's end). Steady: "
        "from then to the run's end. Whole: from joining to the run's end.",
        "",
        "| publishers | blocks/s sent (asked) | believed (s) | applied by the end | whole: blocks/s, cores, µs/block "
        "| steady: blocks/s | lag P50 (ms) | lag P99 (ms) | cores | µs CPU/block | blocks held "
        "| MiB per million blocks: process (index) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        share = r["applied_by_end"] / r["sent_stored"] if r["sent_stored"] else math.nan
        believe = f"{r['believe_s']:.2f}" if r["believed"] == r["followed"] else f"— ({r['believed']:,} believed)"
        if r["followed"] < r["publishers"]:
            believe += f" ({r['followed']:,} followed)"
        lines.append(
            f"| {r['publishers']:,} | {r['sent_blocks_per_s']:,.0f} ({r['asked_blocks_per_s']:,.0f}) | {believe} "
            f"| {share:.1%} | {r['whole_blocks_per_s']:,.0f}, {r['whole_cpu_cores']:.2f}, "
            f"{figure(r['whole_cpu_us_per_block'], '.2f')} "
            f"| {figure(r['absorbed_blocks_per_s'], ',.0f')} | {figure(r['lag_p50_s'] * 1e3, ',.1f')} "
            f"| {figure(r['lag_p99_s'] * 1e3, ',.1f')} | {figure(r['cpu_cores'], '.2f')} "
            f"| {figure(r['cpu_us_per_block'], '.2f')} | {r['held_blocks']:,} "
            f"| {r['mib_per_million_blocks']:,.1f} ({r['index_mib_per_million_blocks']:,.1f}) |"
        )
    lines += render_agreement(rows)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        shape = Shape(
            blocks_per_s=args.blocks_per_s,
            batch_blocks=args.batch_blocks,
            block_size=args.block_size,
            capacity_blocks=args.capacity_blocks,
            chain_blocks=args.chain_blocks,
            replay_steps=args.replay_steps,
        )
    except ValueError as exc:
        print(f"router-bench events: {exc}", file=sys.stderr)
        return 2
    if args.router_procs and args.routers < 2:
        print("router-bench events: --router-procs needs --routers 2 or more (the first stays here)", file=sys.stderr)
        return 2
    if args.shared_index and not args.router_procs:
        print(
            "router-bench events: --shared-index needs --router-procs (its readers are the other processes)",
            file=sys.stderr,
        )
        return 2
    if args.index_max_mib < 0 or (args.index_max_mib and args.serve_workers):
        print(
            "router-bench events: --index-max-mib is a number of MiB >= 0, for this process's subscriber "
            "(not --serve-workers)",
            file=sys.stderr,
        )
        return 2
    raise_open_files()  # as router-serve does
    if args.followers != [1] and not args.serve_workers:
        print(
            "router-bench events: --followers needs --serve-workers (router-serve's kv_event_followers)",
            file=sys.stderr,
        )
        return 2
    if args.serve_workers:
        return _run_serve(args, shape)
    rows = []
    for n in args.publishers:
        routers = Routers(args.routers, args.late_router, args.router_procs, args.shared_index)
        try:
            size = measure(
                n, shape, args.duration, args.join_after, args.publisher_procs, routers, 0, args.index_max_mib
            )
            row = uvloop.run(size)
        except RuntimeError as exc:  # a router process that died or fell silent (router.bench.event_remote)
            print(f"router-bench events: {exc}", file=sys.stderr)
            return 1
        rows.append(row)
        if not args.json:
            print(
                f"{n} publishers: {row['followed']} followed, {row['believed']} believed after "
                f"{row['believe_s']:.2f} s, "
                f"{row['whole_blocks_per_s']:,.0f} blocks/s applied, lag P99 {row['lag_p99_s'] * 1e3:.1f} ms",
                file=sys.stderr,
            )
    _show(args, "events", {"shape": asdict(shape), "cpus": os.cpu_count(), "rows": rows}, render(shape, rows))
    # a subscriber that falls behind is a result (the table says how far); a message it could not read is not
    return 1 if any(r["bad_messages"] for r in rows) else 0


def _run_serve(args: argparse.Namespace, shape: Shape) -> int:
    rows = []
    for n in args.publishers:
        for workers in args.serve_workers:
            for followers in args.followers:
                run = measure(
                    n, shape, args.duration, args.join_after, args.publisher_procs, Routers(), workers, 0, followers
                )
                row = uvloop.run(run)
                rows.append(row)
                if not args.json:
                    print(
                        f"{n} publishers, router-serve --workers {workers}, {followers} followers: "
                        f"{row['believed']} believed after {row['believe_s']:.2f} s, "
                        f"{row['host_cpu_cores']:.2f} cores, lag P99 <= {row['lag_p99_le_s'] * 1e3:.0f} ms",
                        file=sys.stderr,
                    )
    result = {"shape": asdict(shape), "cpus": os.cpu_count(), "serve_rows": rows}
    _show(args, "events-serve", result, render_serve(rows))
    return 0


def _show(args: argparse.Namespace, name: str, result: dict[str, Any], table: str) -> None:
    """The results printed (a table, or JSON with --json), and with --out kept as NAME.json and NAME.md."""
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
        (args.out / f"{name}.md").write_text(table + "\n")
    print(json.dumps(result, indent=1) if args.json else table)


def _counts(what: str, example: str, most: int) -> Callable[[str], list[int]]:
    """An argument's parser: comma-separated counts of `what`, each in 1..most."""

    def parse(text: str) -> list[int]:
        try:
            counts = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {what} counts, comma-separated ({example})") from None
        if not counts or any(n < 1 or n > most for n in counts):
            raise argparse.ArgumentTypeError(f"{text!r}: each count must be in 1..{most}")
        return counts

    return parse


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "events",
        help="the KV-event plane: many light publishers of vLLM's events against one router's subscriber",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    publishers = _counts("publisher", "100,300,1000", 5000)
    p.add_argument("--publishers", type=publishers, default=[100, 300, 1000], help="fleet sizes, comma-separated")
    p.add_argument("--blocks-per-s", type=positive_float, default=Shape.blocks_per_s, help="stored a second, each")
    p.add_argument("--batch-blocks", type=positive_int, default=Shape.batch_blocks, help="blocks a message stores")
    p.add_argument("--block-size", type=positive_int, default=Shape.block_size, help="tokens a block")
    p.add_argument("--capacity-blocks", type=positive_int, default=Shape.capacity_blocks, help="KV blocks each")
    p.add_argument("--chain-blocks", type=positive_int, default=Shape.chain_blocks, help="blocks a request's chain")
    p.add_argument("--replay-steps", type=positive_int, default=Shape.replay_steps, help="messages kept for replay")
    p.add_argument("--duration", type=positive_float, default=10.0, help="seconds each fleet size publishes")
    p.add_argument("--join-after", type=float, default=1.0, help="seconds the publishers run before the router joins")
    p.add_argument("--publisher-procs", type=positive_int, default=1, help="child processes the publishers run in")
    p.add_argument("--routers", type=positive_int, default=1, help="routers' subscribers joining together")
    p.add_argument("--late-router", action="store_true", help="one more router joins halfway through the run")
    p.add_argument(
        "--router-procs",
        action="store_true",
        help="the routers after the first each in a process of its own, asked over a pipe (router.bench.event_remote)",
    )
    p.add_argument(
        "--shared-index",
        action="store_true",
        help="with --router-procs: the first router's index in shared memory, the other processes only "
        "reading it (router.kvevents.shared), instead of each following the engines itself",
    )
    p.add_argument(
        "--serve-workers",
        type=_counts("worker", "1,2", 64),
        default=[],
        help="instead of this process's subscriber, router-serve --workers N as a child, for each N "
        "(comma-separated): the host's CPU and memory for it (router.bench.event_serve)",
    )
    p.add_argument(
        "--followers",
        type=_counts("follower", "1,2", 64),
        default=[1],
        help="with --serve-workers: its kv_event_followers, for each K (comma-separated): the processes that "
        "follow the engines' events, each a shard of them (1: the control process alone)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="folder for events.json and .md (events-serve.* with --serve-workers)"
    )
    p.add_argument(
        "--index-max-mib",
        type=int,
        default=0,
        help="the router's kv_events_max_mib: its event-fed index's budget (0: its default, a quarter of "
        "this host's memory); the replicas past it are not followed (not with --serve-workers)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


__all__ = ["Routers", "add_parser", "measure", "render", "run"]
