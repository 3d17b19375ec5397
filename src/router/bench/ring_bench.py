"""`router-bench ring`: lookup speed of the compiled ring, its Python twin and uhashring, and keys moved on a join.

Every contender runs in this one process on the same keys; each timing is the median of
`--repeat` runs, and ratios are taken between medians of the same run, so a noisy machine
shifts all figures together rather than one contender.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import uuid
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from router import _ring_py
from router.bench.common import positive_int
from router.ring import IMPLEMENTATION, Ring

FLEETS = ((20, 128), (200, 160))


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "ring",
        help="time ring lookups (compiled, batch, pure Python, uhashring) and keys moved on a join",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--keys", type=positive_int, default=1_000_000, help="UUID-like keys to route (default 1,000,000)")
    p.add_argument(
        "--slow-keys",
        type=positive_int,
        default=100_000,
        help="keys for the slow contenders (pure Python, uhashring); default 100,000",
    )
    p.add_argument("--repeat", type=positive_int, default=5, help="runs per timing; the median is reported (default 5)")
    p.add_argument("--seed", type=int, default=1, help="random seed for the keys (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run)


def uuid_keys(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(count)]


def median_ns_per_key(fn: Callable[[], object], n_keys: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / n_keys)
    return statistics.median(times)


def per_key(lookup: Callable[[str], object], keys: Sequence[str]) -> Callable[[], object]:
    # map() drives the calls from C, so the figure is the call itself, not a Python for-loop
    return lambda: deque(map(lookup, keys), maxlen=0)


def for_loop(lookup: Callable[[str], object], keys: Sequence[str]) -> Callable[[], object]:
    def run() -> None:
        for key in keys:
            lookup(key)

    return run


def bench_fleet(
    n: int, vnodes: int, keys: list[str], slow: list[str], repeat: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    ids = [f"replica-{i}" for i in range(n)]
    ring = Ring(ids, vnodes)
    twin = _ring_py.Ring(ids, vnodes)
    loads = array("q", [0] * n)
    row: dict[str, Any] = {"fleet": f"{n}x{vnodes}", "replicas": n, "vnodes": vnodes, "points": ring.size}
    progress(f"{n}x{vnodes}: compiled per-key")
    row["compiled_ns"] = median_ns_per_key(per_key(ring.lookup, keys), len(keys), repeat)
    row["compiled_for_loop_ns"] = median_ns_per_key(for_loop(ring.lookup, keys), len(keys), repeat)
    progress(f"{n}x{vnodes}: compiled batch")
    row["batch_ns"] = median_ns_per_key(lambda: ring.lookup_many(keys), len(keys), repeat)
    progress(f"{n}x{vnodes}: compiled bounded")
    row["bounded_ns"] = median_ns_per_key(
        per_key(lambda k: ring.lookup_bounded(k, loads), keys[: len(slow)]), len(slow), repeat
    )
    progress(f"{n}x{vnodes}: pure Python twin")
    row["python_ns"] = median_ns_per_key(per_key(twin.lookup, slow), len(slow), repeat)
    try:
        import uhashring  # noqa: PLC0415 -- optional (the bench extra): its row is n/a without it
    except ImportError:
        row["uhashring_ns"] = None
    else:
        progress(f"{n}x{vnodes}: uhashring")
        other = uhashring.HashRing(nodes=ids, vnodes=vnodes)
        row["uhashring_ns"] = median_ns_per_key(per_key(other.get_node, slow), len(slow), repeat)
    row["speedup_vs_python"] = row["python_ns"] / row["compiled_ns"]
    row["speedup_vs_uhashring"] = (row["uhashring_ns"] / row["compiled_ns"]) if row["uhashring_ns"] else None
    # agreement check: the twin must give the compiled answers (a benchmark of wrong answers is worthless)
    if list(ring.lookup_many(slow[:20000])) != list(twin.lookup_many(slow[:20000])):
        raise SystemExit("router-bench: compiled and pure-Python rings disagree; refusing to report")
    return row


def bench_join(keys: list[str]) -> dict[str, Any]:
    ring = Ring([f"replica-{i}" for i in range(20)], 128)
    before = ring.lookup_many(keys)
    moved = ring.add_replica("replica-20")
    after = ring.lookup_many(keys)
    changed = sum(1 for b, a in zip(before, after, strict=True) if b != a)
    return {
        "replicas_before": 20,
        "keys_moved_share": changed / len(keys),
        "hash_space_moved_share": sum(r.width for r in moved) / 2**64,
        "ideal_share": 1 / 21,
        "moved_only_to_new_replica": all(a == 20 for b, a in zip(before, after, strict=True) if b != a),
    }


def run(args: argparse.Namespace) -> int:
    live = not args.json and sys.stderr.isatty()
    show = (
        (lambda msg: print(f"\r\x1b[K  {msg} ...", end="", file=sys.stderr, flush=True)) if live else (lambda msg: None)
    )
    keys = uuid_keys(args.keys, args.seed)
    slow = keys[: min(args.slow_keys, len(keys))]
    result = {
        "benchmark": "ring",
        "implementation": IMPLEMENTATION,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {_cpus()} CPUs",
        "keys": len(keys),
        "slow_keys": len(slow),
        "repeat": args.repeat,
        "fleets": [bench_fleet(n, v, keys, slow, args.repeat, show) for n, v in FLEETS],
        "join": bench_join(keys),
    }
    if live:
        print("\r\x1b[K", end="", file=sys.stderr)
    print(json.dumps(result, indent=1) if args.json else render(result))
    return 0


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def render(result: dict[str, Any]) -> str:
    def ns(x: float | None) -> str:
        return "n/a" if x is None else f"{x:,.1f}"

    lines = [
        f"ring lookups: {result['keys']:,} UUID keys ({result['slow_keys']:,} for the slow contenders), "
        f"median of {result['repeat']} runs, {result['implementation']} ring, Python {result['python']}, "
        f"{result['machine']}",
        "",
        "| fleet | per-key (ns) | per-key, for-loop (ns) | batch (ns/key) | bounded (ns) | pure Python (ns) "
        "| uhashring (ns) | × Python | × uhashring |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["fleets"]:
        ratio = "n/a" if r["speedup_vs_uhashring"] is None else f"{r['speedup_vs_uhashring']:.0f}×"
        lines.append(
            f"| {r['fleet']} | {ns(r['compiled_ns'])} | {ns(r['compiled_for_loop_ns'])} | {ns(r['batch_ns'])} "
            f"| {ns(r['bounded_ns'])} | {ns(r['python_ns'])} | {ns(r['uhashring_ns'])} "
            f"| {r['speedup_vs_python']:.0f}× | {ratio} |"
        )
    j = result["join"]
    lines += [
        "",
        f"replica-20 joins 20 replicas: {j['keys_moved_share']:.2%} of keys moved "
        f"({j['hash_space_moved_share']:.2%} of the hash space; ideal {j['ideal_share']:.2%}), "
        f"all to the new replica: {'yes' if j['moved_only_to_new_replica'] else 'NO'}",
    ]
    return "\n".join(lines)
