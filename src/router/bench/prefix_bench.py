"""`router-bench prefix`: speed of the prefix index (block keys, match_all, price, insert) and its memory per block.

For each prompt size (4 bytes a token, cut into --block-bytes blocks) the prompt is a chat
rendering, ["<|system|>", system, "<|end|>", "<|user|>", document, "<|end|>"] (ASCII text). It
times block_chain of the prompt's bytes; chain_of_parts of its parts (the same keys, never
joined); match_all against --replicas holders, each filled to capacity with other chains, that
hold this prompt fully on holder 0 and half of it on holder 1; price, the routing decision over
those replicas (matches, waits, costs, the pick and its near-ties); insert of a prompt the
holder does not hold (it evicts as many blocks); and insert of one it holds (a refresh). The
index's memory per block is taken once filled, and again after the inserts.
`decision` is the router's whole decision past parsing the JSON body, through the `ttft` policy
itself on a fleet of --replicas whose index is filled alike: the prompt cut into blocks from the
request body (router.prompt.prompt_of) and the policy's pick (the gate, the costs, the choice);
it runs on the implementation router.prefix selects.
Each figure is the median, over up to --repeat batches, of µs per call, a batch being enough
calls to take at least 100 µs; a timing stops early once it has used --max-seconds.
With --shared the same is timed on the event-fed index in shared memory (router.kvevents.shared):
a worker's match_all on its reader, and the writer's insert.

It is past 450 lines because it is one benchmark whole: the indexes filled alike, each call timed
the same way on each, and the table; split, each part would need the others' arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import random
import statistics
import string
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from typing import Any, NamedTuple

from router import _prefix_py, prefix
from router.bench.common import positive_int
from router.config import RouterConfig, parse_replica
from router.fleet import Fleet
from router.keys import RoutingKey
from router.kvevents.mapped import SHM_DIR
from router.kvevents.shared import SharedIndex, SharedIndexReader
from router.policy.ttft import Ttft
from router.prefix import PrefixIndex
from router.prompt import prompt_of

MODEL_SEED = 0x5EED  # the first block's seed, as a per-model seed would be
FILL_CHAIN_TOKENS = 2048  # the other chains that fill each holder: conversations of this length
MIN_BATCH_NS = 100_000
MARKERS = ("<|system|>", "<|end|>", "<|user|>", "<|end|>")
SYSTEM_SHARE = 8  # the system prompt is an eighth of the text, the document the rest


class Keys(NamedTuple):
    """One implementation's block-key functions."""

    block_chain: Callable[..., array[int]]
    chain_of_parts: Callable[..., tuple[array[int], int, int]]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "prefix",
        help="time the prefix index (block keys, match_all, price, insert) and report its memory per block",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--impl", choices=("compiled", "python"), default="compiled", help="index implementation")
    p.add_argument("--replicas", type=positive_int, default=8, help="holders in the index (default 8)")
    p.add_argument("--block-bytes", type=positive_int, default=64, help="bytes per KV block (default 64: 16 tokens)")
    p.add_argument(
        "--fill",
        type=positive_int,
        default=1 << 20,
        help="blocks the index holds, all holders together; each holder's capacity is its share (default 1,048,576)",
    )
    p.add_argument(
        "--tokens", type=_sizes, default=(1024, 8192, 32768), help="prompt sizes in tokens (default 1024,8192,32768)"
    )
    p.add_argument(
        "--repeat", type=positive_int, default=25, help="batches per timing; the median is reported (default 25)"
    )
    p.add_argument("--max-seconds", type=float, default=1.0, help="time budget of one timing (default 1.0)")
    p.add_argument(
        "--decision",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the ttft policy's whole decision on a second, equally filled index (default on)",
    )
    p.add_argument(
        "--shared",
        action="store_true",
        help="also the event-fed index in shared memory (router.kvevents.shared), filled alike: a worker's "
        "match_all on its reader, the writer's insert, its memory",
    )
    p.add_argument("--seed", type=int, default=1, help="random seed for the prompts (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run)


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(positive_int(part) for part in text.split(",") if part.strip())


def median_us_per_call(make_batch: Callable[[int], Callable[[], object]], repeat: int, budget_s: float) -> float:
    """`make_batch(k)` prepares k calls (untimed) and returns the function that makes them."""
    k = 1
    gc.collect()
    gc.disable()
    try:
        while True:  # calibrate: double the batch until one takes MIN_BATCH_NS
            batch = make_batch(k)
            t0 = time.perf_counter_ns()
            batch()
            elapsed = time.perf_counter_ns() - t0
            if elapsed >= MIN_BATCH_NS or k >= 1 << 16:
                break
            k *= 2
        samples = [elapsed / k]
        deadline = time.monotonic() + budget_s
        while len(samples) < repeat and (len(samples) < 3 or time.monotonic() < deadline):
            batch = make_batch(k)
            t0 = time.perf_counter_ns()
            batch()
            samples.append((time.perf_counter_ns() - t0) / k)
    finally:
        gc.enable()
    return statistics.median(samples) / 1000


def repeated(fn: Callable[[], object]) -> Callable[[int], Callable[[], object]]:
    def make(k: int) -> Callable[[], object]:
        def batch() -> None:
            for _ in range(k):
                fn()

        return batch

    return make


def fill(
    index: PrefixIndex | SharedIndex, block_chain: Callable[..., array[int]], args: argparse.Namespace, capacity: int
) -> None:
    """Every holder full of its own conversations: distinct seeds give chains that share nothing."""
    filler = random.Random(args.seed + 1).randbytes(FILL_CHAIN_TOKENS * 4)
    seed = MODEL_SEED + 1
    for h in range(index.n_holders):
        while index.size(h) < capacity:
            index.insert(h, block_chain(filler, args.block_bytes, seed))
            seed += 1


def chat_parts(tokens: int, seed: int) -> list[str]:
    """A system prompt and a document rendered as the router renders chat messages, in parts:
    tokens x 4 bytes in all (more only when that is shorter than the role markers)."""
    body = max(tokens * 4 - sum(map(len, MARKERS)), 0)
    text = "".join(random.Random(seed).choices(string.ascii_letters + "      .,", k=body))
    system, document = text[: body // SYSTEM_SHARE], text[body // SYSTEM_SHARE :]
    return [MARKERS[0], system, MARKERS[1], MARKERS[2], document, MARKERS[3]]


def bench_prompt(
    index: PrefixIndex,
    keys: Keys,
    tokens: int,
    args: argparse.Namespace,
    progress: Callable[[str], None],
    decider: Callable[[list[str]], Callable[[], object]] | None = None,
    shared: tuple[SharedIndex, SharedIndexReader] | None = None,
) -> dict[str, Any]:
    parts = chat_parts(tokens, args.seed * 1_000_003 + tokens)
    prompt = "".join(parts).encode()
    chain = keys.block_chain(prompt, args.block_bytes, MODEL_SEED)
    n = len(chain)
    row: dict[str, Any] = {"tokens": tokens, "bytes": len(prompt), "blocks": n}
    progress(f"{tokens} tokens: block_chain")
    row["block_chain_us"] = median_us_per_call(
        repeated(lambda: keys.block_chain(prompt, args.block_bytes, MODEL_SEED)), args.repeat, args.max_seconds
    )
    mark = len(parts) - 3  # before the user's message: what the session's last server holds for sure
    if keys.chain_of_parts(parts, args.block_bytes, MODEL_SEED, mark)[:2] != (chain, len(prompt)):
        raise SystemExit("router-bench prefix: chain_of_parts disagrees with block_chain; refusing to report")
    progress(f"{tokens} tokens: chain_of_parts")
    row["chain_of_parts_us"] = median_us_per_call(
        repeated(lambda: keys.chain_of_parts(parts, args.block_bytes, MODEL_SEED, mark)), args.repeat, args.max_seconds
    )
    index.insert(0, chain)
    if index.n_holders > 1:
        index.insert(1, chain, n // 2)
    out = array("i", [0] * index.n_holders)
    progress(f"{tokens} tokens: match_all")
    row["match_all_us"] = median_us_per_call(
        repeated(lambda: index.match_all(chain, out)), args.repeat, args.max_seconds
    )
    cap = index.capacity(0)
    expected = [min(n, cap), min(n // 2, cap), *[0] * (index.n_holders - 2)][: index.n_holders]
    if list(out) != expected:
        raise SystemExit(f"router-bench prefix: match_all gave {list(out)}, not {expected}; refusing to report")
    row["matched"] = list(out)
    if shared is not None:
        writer, reader = shared
        writer.insert(0, chain)
        if writer.n_holders > 1:
            writer.insert(1, chain, n // 2)
        theirs = array("i", [0] * reader.n_holders)
        progress(f"{tokens} tokens: match_all, shared")
        row["shared_match_all_us"] = median_us_per_call(
            repeated(lambda: reader.match_all(chain, theirs)), args.repeat, args.max_seconds
        )
        if list(theirs) != list(out):
            raise SystemExit(f"router-bench prefix: the shared index matched {list(theirs)}, not {list(out)}")

    progress(f"{tokens} tokens: price")
    price = pricing(index, chain, tokens, args.block_bytes / 4)
    best, near, _ = price()
    if best != 0:
        raise SystemExit(f"router-bench prefix: price picked {best}, not holder 0 (it holds all); refusing to report")
    row["price_us"] = median_us_per_call(repeated(price), args.repeat, args.max_seconds)
    row["price_near"] = near
    if decider is not None:
        progress(f"{tokens} tokens: decision")
        row["decision_us"] = median_us_per_call(repeated(decider(parts)), args.repeat, args.max_seconds)

    # insert of a prompt the holder does not hold: each call gets a fresh chain of the same length
    target = index.n_holders - 1
    fresh = [MODEL_SEED + (1 << 40)]

    progress(f"{tokens} tokens: insert")
    row["insert_us"] = median_us_per_call(
        lambda k: _inserts(index, keys, prompt, args, target, fresh, k), args.repeat, args.max_seconds
    )
    if shared is not None:
        progress(f"{tokens} tokens: insert, shared")
        row["shared_insert_us"] = median_us_per_call(
            lambda k: _inserts(shared[0], keys, prompt, args, target, fresh, k), args.repeat, args.max_seconds
        )
    progress(f"{tokens} tokens: insert, held")
    row["insert_held_us"] = median_us_per_call(repeated(lambda: index.insert(0, chain)), args.repeat, args.max_seconds)
    return row


def _inserts(
    index: PrefixIndex | SharedIndex,
    keys: Keys,
    prompt: bytes,
    args: argparse.Namespace,
    target: int,
    fresh: list[int],
    k: int,
) -> Callable[[], object]:
    """k inserts of chains the holder does not hold (fresh seeds: chains of the prompt's length)."""
    chains = []
    for _ in range(k):
        fresh[0] += 1
        chains.append(keys.block_chain(prompt, args.block_bytes, fresh[0]))

    def batch() -> None:
        for c in chains:
            index.insert(target, c)

    return batch


def pricing(
    index: PrefixIndex, chain: array[int], tokens: int, block_tokens: float
) -> Callable[[], tuple[int, int, int]]:
    """price of `chain` over every holder as a fleet position, as the ttft policy asks for it (its
    interference, a session's replica credited with what any holds): equally fast, queued work
    and traffic on all but holder 0 (queue lengths known on every other replica), none at its cap."""
    n = index.n_holders
    holders = array("i", range(n))
    busy_until = array("d", [100.0 + 0.001 * i for i in range(n)])
    seconds_per_token = array("d", [5e-5] * n)
    loads = array("q", [i % 3 for i in range(n)])
    waiting = array("d", [float(i % 3 + 1) if i % 2 else -1.0 for i in range(n)])
    caps = array("q", [64] * n)
    excluded = array("B", [0] * n)
    cached, wait, cost = array("d", [0.0] * n), array("d", [0.0] * n), array("d", [0.0] * n)
    flags = array("B", [0] * n)
    total = float(tokens)

    def price() -> tuple[int, int, int]:
        return index.price(
            chain, holders, busy_until, seconds_per_token, loads, waiting, caps, excluded,
            100.0, 0.002, 400.0, block_tokens, total, 1, 0, 0.005, 0.05, cached, wait, cost, flags,
            interference=1.0, history_from_all=True,
        )  # fmt: skip

    return price


def decision_bench(args: argparse.Namespace, capacity: int) -> Callable[[list[str]], Callable[[], object]]:
    """A `ttft` policy over --replicas replicas whose index is filled as the bench's, and for a
    prompt (its chat parts) the call that times its decision: blocks from the body, then the pick.
    The prompt is held whole on the first replica, half on the second; the others have work queued."""
    specs = tuple(parse_replica(f"r{i}=http://127.0.0.1:{9000 + i}") for i in range(args.replicas))
    config = RouterConfig(
        replicas=specs,
        prefix_block_bytes=args.block_bytes,
        kv_capacity_tokens=(f"*={capacity * args.block_bytes // 4}",),
    )
    fleet = Fleet(specs, config.vnodes, config.hash_seed)
    policy = Ttft.from_config(fleet, config)
    placement = policy.placement
    holders = [placement.of(r).holder for r in fleet.replicas]
    fill(placement.index, prefix.block_chain, args, placement.index.capacity(holders[0]))
    now = placement.clock()
    for i, r in enumerate(fleet.replicas[2:], 2):
        placement.set_busy(placement.of(r), now + 0.001 * i)
        for _ in range(i % 3):
            fleet.acquire(r)

    def decide(parts: list[str]) -> Callable[[], object]:
        body = {
            "model": "bench",
            "messages": [{"role": "system", "content": parts[1]}, {"role": "user", "content": parts[4]}],
        }
        prompt = prompt_of(body, args.block_bytes)
        assert prompt is not None
        placement.index.insert(holders[0], prompt.chain)
        if len(holders) > 1:
            placement.index.insert(holders[1], prompt.chain, len(prompt.chain) // 2)
        key = RoutingKey(b"bench-session", "header", "x-session-id")

        def one() -> object:
            decision = policy.pick(
                RoutingKey(key.key, key.kind, key.source, prompt_of(body, args.block_bytes)), None, ()
            )
            assert decision is not None and decision.index == 0
            return decision

        return one

    return decide


def implementation(name: str) -> tuple[type[PrefixIndex], Keys]:
    if name == "python":
        return _prefix_py.PrefixIndex, Keys(_prefix_py.block_chain, _prefix_py.chain_of_parts)
    if prefix.IMPLEMENTATION != "compiled":
        raise SystemExit("router-bench prefix: --impl compiled, but ROUTER_NO_EXTENSIONS selects the Python twin")
    return prefix.PrefixIndex, Keys(prefix.block_chain, prefix.chain_of_parts)


def run(args: argparse.Namespace) -> int:
    live = not args.json and sys.stderr.isatty()
    show: Callable[[str], None] = (
        (lambda msg: print(f"\r\x1b[K  {msg} ...", end="", file=sys.stderr, flush=True)) if live else (lambda msg: None)
    )
    index_type, keys = implementation(args.impl)
    capacity = math.ceil(args.fill / args.replicas)
    index = index_type()
    for _ in range(args.replicas):
        index.add_holder(capacity)
    show(f"filling {args.replicas} holders with {capacity:,} blocks each")
    t0 = time.perf_counter()
    fill(index, keys.block_chain, args, capacity)
    fill_s = time.perf_counter() - t0
    decider = decision_bench(args, capacity) if args.decision else None
    with contextlib.ExitStack() as stack:
        shared = _shared(stack, args, keys, capacity, show) if args.shared else None
        return _measure(args, index, keys, capacity, fill_s, show, live, decider, shared)


def _shared(
    stack: contextlib.ExitStack, args: argparse.Namespace, keys: Keys, capacity: int, show: Callable[[str], None]
) -> tuple[SharedIndex, SharedIndexReader]:
    """A shared index filled as the bench's, in a folder of its own under /dev/shm, and a reader of it."""
    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvar-prefix-", dir=shm_folder()))
    writer = SharedIndex("bench", folder)
    stack.callback(writer.close)
    for _ in range(args.replicas):
        writer.add_holder(capacity)
    show(f"filling {args.replicas} shared holders with {capacity:,} blocks each")
    fill(writer, keys.block_chain, args, capacity)
    return writer, SharedIndexReader("bench", folder)


def shm_folder() -> str | None:
    """/dev/shm where this host has it (memory-backed, as the router uses it), else the default temp folder."""
    return SHM_DIR if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else None


def _measure(
    args: argparse.Namespace,
    index: PrefixIndex,
    keys: Keys,
    capacity: int,
    fill_s: float,
    show: Callable[[str], None],
    live: bool,
    decider: Callable[[list[str]], Callable[[], object]] | None,
    shared: tuple[SharedIndex, SharedIndexReader] | None,
) -> int:
    memory = index.memory_bytes()
    total = index.total()
    result = {
        "benchmark": "prefix",
        "implementation": args.impl,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {_cpus()} CPUs",
        "block_bytes": args.block_bytes,
        "replicas": args.replicas,
        "capacity": capacity,
        "blocks_held": total,
        "fill_seconds": fill_s,
        "repeat": args.repeat,
        "memory_bytes": memory,
        "memory_bytes_per_block": memory / total,
        "memory_mib_per_million_blocks": memory / total * 1e6 / 2**20,
        "memory_is_estimate": args.impl == "python",
        "decision_implementation": prefix.IMPLEMENTATION,
        "prompts": [bench_prompt(index, keys, t, args, show, decider, shared) for t in args.tokens],
    }
    if shared is not None:
        result["shared_memory_bytes_per_block"] = shared[0].memory_bytes() / shared[0].total()
    # after the inserts have churned every holder: what a running router's index looks like
    result["memory_bytes_per_block_churned"] = index.memory_bytes() / index.total()
    if live:
        print("\r\x1b[K", end="", file=sys.stderr)
    print(json.dumps(result, indent=1) if args.json else render(result))
    return 0


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def render(result: dict[str, Any]) -> str:
    lines = [
        f"prefix index: {result['implementation']}, {result['replicas']} holders × {result['capacity']:,} blocks "
        f"of {result['block_bytes']} bytes ({result['blocks_held']:,} held), median µs per call of up to "
        f"{result['repeat']} batches, Python {result['python']}, {result['machine']}",
        "",
        "| prompt (tokens) | blocks | block_chain (µs) | chain_of_parts (µs) | match_all (µs) | price (µs) "
        "| insert (µs) | insert, held (µs) | decision (µs) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["prompts"]:
        decision = f"{r['decision_us']:,.2f}" if "decision_us" in r else "—"
        lines.append(
            f"| {r['tokens']:,} | {r['blocks']:,} | {r['block_chain_us']:,.2f} | {r['chain_of_parts_us']:,.2f} "
            f"| {r['match_all_us']:,.2f} | {r['price_us']:,.2f} | {r['insert_us']:,.2f} | {r['insert_held_us']:,.2f} "
            f"| {decision} |"
        )
    estimate = " (an estimate: the Python twin)" if result["memory_is_estimate"] else ""
    lines += [
        "",
        f"chain_of_parts keys the prompt as its 6 chat parts; price decides over the {result['replicas']} "
        "holders as replicas (matches, waits, costs, the pick and its near-ties); decision is the ttft "
        f"policy's own (blocks from the body, then its pick), on the {result['decision_implementation']} index.",
        f"memory: {result['memory_bytes_per_block']:.1f} bytes a block, "
        f"{result['memory_mib_per_million_blocks']:.1f} MiB per million blocks{estimate}; "
        f"{result['memory_bytes_per_block_churned']:.1f} bytes a block after the inserts; "
        f"filled in {result['fill_seconds']:.2f} s",
    ]
    if "shared_memory_bytes_per_block" in result:
        lines += ["", "The event-fed index in shared memory, filled alike (router.kvevents.shared):", ""]
        lines += [
            "| prompt (tokens) | match_all, a worker's reader (µs) | insert, the writer (µs) |",
            "|---:|---:|---:|",
        ]
        for r in result["prompts"]:
            lines.append(f"| {r['tokens']:,} | {r['shared_match_all_us']:,.2f} | {r['shared_insert_us']:,.2f} |")
        lines.append(f"\nmemory: {result['shared_memory_bytes_per_block']:.1f} bytes a block (its files' length)")
    return "\n".join(lines)
