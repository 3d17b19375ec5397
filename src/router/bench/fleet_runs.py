"""How `router-bench fleet` drives its runs: one run (a fresh fleet, a contender in front of it,
the workload replayed through it, the counters read around it), every run in turn, and the search
for the smallest fleet that meets a P99 target."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from router.bench.bound import bound_figures
from router.bench.contenders import CONTENDERS, Contender, peer_versions, start_contender
from router.bench.fleet_counters import Sampler, events_believed, fleet_figures, prediction_figures, router_counts
from router.bench.fleet_report import exact_cell, make_tables
from router.bench.fleet_workloads import (
    Workload,
    arrivals_s,
    emulated_engine,
    emulator_args,
    engine_shape,
    size_workload,
    vllm_shape,
    workload_options,
)
from router.bench.proxy_bench import cpu_seconds
from router.bench.replay import DRAIN_FACTOR, Replayer
from router.bench.replicas import Child, start_fleet
from router.bench.vllm import VLLM_BLOCK


def plan_line(args: argparse.Namespace) -> str:
    """How long the runs take at most, said up front: each run's arrivals span `--duration` (or the
    trace window), and the sessions started in it then play all their turns, so that every contender
    is judged on the same conversations; DRAIN_FACTOR caps that."""
    runs = args.rounds * len(args.contenders)
    bound = 0.0
    traces = False
    for w in args.workloads:
        if Workload.parse(w).kind == "trace":
            traces = True
            bound += runs * arrivals_s(w, args) / args.time_scale
        else:
            bound += runs * DRAIN_FACTOR * arrivals_s(w, args) / args.time_scale
    return (
        f"{runs * len(args.workloads)} runs; each starts sessions for its --duration and lets them finish, "
        f"at most {DRAIN_FACTOR:g} x as long: about {bound / 60:.0f} min at most in all"
        + (" (trace runs: their requests' own time after the window)" if traces else "")
        + ", plus starting each run's fleet and contender"
        + (", plus the size search's runs" if args.size_search and size_workload(args.workloads) else "")
    )


def fleet_cpu_seconds(pids: list[int]) -> float:
    """CPU seconds the fleet's processes have used (one that has exited counts no more)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


async def run_one(
    args: argparse.Namespace,
    c: Contender,
    workload: str,
    replicas: int,
    progress: Callable[[str], None] | None,
) -> dict[str, Any]:
    fleet = await start_fleet(replicas, args, emulator_args(workload, args))
    router: Child | None = None
    try:
        router, targets = await start_contender(c, fleet.urls, args.settings)
        reads = c.kind == "router"  # router-serve: its predictions, from its /metrics, before and after
        ready_s = None
        if reads and fleet.events and "--no-kv-events" not in c.args:
            ready_s = await events_believed(targets[0], len(fleet.urls))
        before = await router_counts(targets[0]) if reads else None
        opts = workload_options(workload, args, targets, c)
        engine = emulated_engine(workload, args)
        if engine is not None:  # the run's requests are kept for its bound
            opts = dataclasses.replace(opts, bound_block_size=engine.block_size)
        replayer = Replayer(opts, progress)
        sampler = Sampler(fleet, args.sample_s)
        cpu_fleet0 = fleet_cpu_seconds(fleet.pids)
        cpu_router0 = cpu_seconds(router.pid) if router else 0.0
        t0 = time.perf_counter()
        sampling = asyncio.ensure_future(sampler.run(t0))
        try:
            await sampler.first.wait()  # the counters before the first request: changes are the run's
            result = await replayer.run()
        finally:
            sampler.stop()
            await sampling
        wall = time.perf_counter() - t0
        result["emulator_cpu_share"] = (fleet_cpu_seconds(fleet.pids) - cpu_fleet0) / wall
        result["router_cpu_share"] = (cpu_seconds(router.pid) - cpu_router0) / wall if router else None
        if before is not None:
            await asyncio.sleep(0.5)  # the last answers' usage is checked after their last byte
            after = await router_counts(targets[0])
            if after is not None:
                result |= prediction_figures(before, after)
                result["kv_events_ready_s"] = ready_s
        if result.get("errors") and router is not None:  # what the router said of the failures, kept
            name = f"{workload}-{c.name}-{replicas}.log".replace("/", "_").replace("@", "-")
            result["router_log"] = str(router.keep_log(Path(args.out) / "logs" / name))
    finally:
        try:
            if router is not None:
                router.stop()
        finally:
            fleet.stop()
    window_wall = arrivals_s(workload, args) / args.time_scale
    result.update(fleet_figures(sampler.samples, window_wall))
    if router is not None and set(result["per_replica"]) <= set(targets):
        result["jump_rate"] = math.nan  # no answer named its replica (a peer in front of a real engine)
    if engine is not None and replayer.bound is not None:
        records = replayer.records
        bound = bound_figures(replayer.bound, [r.ok for r in records], [r.turn > 1 for r in records], replicas, engine)
        result["bound"] = bound
        hit, limit = result.get("kv_hit_rate", math.nan), bound["bound_hit_rate"]
        result["hit_share_of_bound"] = hit / limit if limit > 0 else math.nan
    result["contender"] = c.name
    result["replicas"] = replicas
    result["load_timeline"] = {
        "t_s": [round(s.wall_s * args.time_scale, 2) for s in sampler.samples],
        "queued": [s.queued for s in sampler.samples],
    }
    result.pop("targets", None)
    return result


def failed_why(run: dict[str, Any]) -> str:
    """What the failed requests of a run said, for its progress line: " (HTTP 502 x2)", and for
    a router the attempts router-serve retried by cause and where the router's log was kept
    (" (HTTP 502 x1; router-serve retried: reset 1; its log: DIR/logs/RUN.log)"); empty if none
    failed."""
    errors = run.get("errors") or {}
    if not errors:
        return ""
    retries = run.get("router_retries") or {}
    said = "; router-serve retried: " + ", ".join(f"{c} {n:g}" for c, n in sorted(retries.items())) if retries else ""
    log = f"; its log: {run['router_log']}" if run.get("router_log") else ""
    return " (" + ", ".join(f"{e} x{n}" for e, n in sorted(errors.items())) + said + log + ")"


async def bisect_size(lo: int, hi: int, meets: Callable[[int], Awaitable[bool]]) -> int | None:
    """The smallest n in [lo, hi] with meets(n), assuming meets is monotone (more replicas, lower
    P99); None when even hi does not. Each size is probed at most once."""
    if not await meets(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if await meets(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


async def size_search(
    args: argparse.Namespace,
    name: str,
    workload: str,
    full: dict[str, Any],
    target: float,
    progress: Callable[[str], None] | None,
    note: Callable[[str], None],
) -> dict[str, Any]:
    """A size meets the target when its multi-turn P99 is within it and no request failed and no
    session was cut (an overloaded fleet must not pass by dropping its slowest turns)."""
    probes: dict[int, dict[str, Any]] = {args.replicas: full}

    async def meets(n: int) -> bool:
        if n not in probes:
            run = await run_one(args, CONTENDERS[name], workload, n, progress)
            probes[n] = {
                "multi_turn_p99_s": float(run["e2e_later_turns_s"].get("p99", math.inf)),
                "failed": run["requests"] - run["ok"],
                "sessions_cut": run.get("sessions_cut", 0),
            }
            note(
                f"size search {name}: {n} replicas -> multi-turn P99 {probes[n]['multi_turn_p99_s']:.3f} s "
                f"(target {target:.3f}), {probes[n]['failed']} failed, {probes[n]['sessions_cut']} sessions cut"
            )
        p = probes[n]
        return bool(p["multi_turn_p99_s"] <= target and not p["failed"] and not p["sessions_cut"])

    lowest = max(2, args.replicas // 2)
    needed = await bisect_size(lowest, args.replicas, meets)
    return {"needed": needed, "lowest_probed": lowest, "probes": dict(sorted(probes.items()))}


def engine_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    """The real engines' settings, for the results (the emulator's are in engine_shapes)."""
    if args.engine == "llama-server":
        return {"slots": args.slots, "slot_context": args.slot_context, "llama_args": args.llama_arg}
    if args.engine == "vllm":
        kept = args.vllm_replicas
        return {
            "max_num_seqs": kept.max_num_seqs,
            "kv_blocks": kept.kv_blocks,
            "block_size": VLLM_BLOCK,
            "max_model_len": kept.max_model_len,
            "vllm_args": args.vllm_arg,
            "cpu_binding": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind, OMP_NUM_THREADS=1"),
            "kv_events": "ZMQ, with a replay socket; render endpoints off unless --vllm-arg adds --enable-scale-out",
            "prompt_scale": args.prompt_scale,
        }
    return None


def new_result(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "benchmark": "fleet",
        "engine": args.engine,
        "engine_settings": engine_settings(args),
        "replicas": args.replicas,
        "time_scale": args.time_scale,
        "stream_interval": args.stream_interval,
        "rounds": args.rounds,
        "workloads": {
            "sessions": {
                "rates": args.rate,
                "duration_s": args.duration,
                "think_s": args.think,
                "turns": args.turns,
                "seed": args.seed,
            },
            "longdoc": {
                "rate": args.doc_rate,
                "documents": args.docs,
                "doc_tokens": args.doc_tokens,
                "turns": args.doc_turns,
                "duration_s": args.duration,
                "think_s": args.think,
                "seed": args.seed,
            },
            "traces": {"window_s": args.trace_window, "speedup": args.trace_speedup, "dir": args.trace_dir},
        },
        "settings": args.settings,
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        # prefill/decode contenders among them: their tables show TPOT and goodput
        "disagg": any(CONTENDERS[n].splits for n in args.contenders),
        "emulator_args": args.emulator_arg,
        # per workload: what its replicas are (emulator arguments, KV capacity, working set)
        "engine_shapes": {w: engine_shape(w, args) for w in args.workloads} if args.engine == "emulator" else {},
        "peer_versions": peer_versions(args.contenders),
        "contenders": {n: CONTENDERS[n].label for n in args.contenders},
        "runs": {w: {n: [] for n in args.contenders} for w in args.workloads},
        "tables": {},
        "replicas_needed": {},
        "complete": False,
    }


async def run_all(
    args: argparse.Namespace,
    result: dict[str, Any],
    note: Callable[[str], None],
    bar: Callable[[str], None] | None,
) -> None:
    """Every run, filling `result` as they finish (a caller interrupted keeps what was done)."""
    started = time.perf_counter()
    if args.engine == "vllm":  # the engine's version and each workload's working set, from a replica
        servers = await args.vllm_replicas.ready(args.replicas)
        try:
            async with aiohttp.ClientSession() as http, http.get(servers[0].url + "/version") as r:
                result["engine_settings"]["vllm_version"] = (await r.json())["version"]
            for workload in args.workloads:
                result["engine_shapes"][workload] = await vllm_shape(workload, args, servers[0].url)
        except (TimeoutError, aiohttp.ClientError, KeyError) as exc:
            raise RuntimeError(f"vLLM did not tell its version or tokenize a workload: {exc!r}") from None
    total = args.rounds * len(args.workloads) * len(args.contenders)
    k = 0
    for rnd in range(args.rounds):
        for workload in args.workloads:
            for name in args.contenders:
                k += 1
                prefix = f"[{k}/{total}] {workload} · {name}"

                def progress(msg: str, prefix: str = prefix) -> None:
                    if bar is not None:
                        bar(f"{prefix}  {msg}")

                t = time.perf_counter()
                try:
                    run = await run_one(args, CONTENDERS[name], workload, args.replicas, progress)
                except RuntimeError as exc:  # this contender could not run; the others still do
                    result["runs"][workload][name].append({"error": str(exc)})
                    note(f"{prefix} round {rnd + 1}: did not run: {exc}")
                    continue
                result["runs"][workload][name].append(run)
                p99 = run["e2e_later_turns_s"].get("p99", math.nan)
                note(
                    f"{prefix} round {rnd + 1}: {run['requests']} requests, {run['requests'] - run['ok']} failed"
                    + failed_why(run)
                    + ", "
                    f"KV hit {run['kv_hit_rate']:.1%}, multi-turn P99 {p99:.3f} s, "
                    f"GPU busy {run['gpu_busy']:.0%}, client CPU {run['client_cpu_share']:.0%}"
                    + (f", exact predicted {exact_cell(run)}" if "predictions" in run else "")
                    + f" ({time.perf_counter() - t:.0f} s)"
                )
    make_tables(result)
    searched = size_workload(args.workloads)
    if args.size_search and searched is not None:
        table = result["tables"][searched]
        target = args.p99_target or table.get("round-robin", {}).get("multi_turn_p99_s")
        if target and not math.isnan(target):
            sizes: dict[str, Any] = {"workload": searched, "target_p99_s": target, "contenders": {}}
            result["replicas_needed"] = sizes
            for name in args.size_search:
                f = table.get(name, {})
                if "multi_turn_p99_s" not in f:
                    continue
                full = {
                    "multi_turn_p99_s": f["multi_turn_p99_s"],
                    "failed": f["failed"],
                    "sessions_cut": f["sessions_cut"],
                }
                try:
                    sizes["contenders"][name] = await size_search(args, name, searched, full, target, bar, note)
                except RuntimeError as exc:
                    sizes["contenders"][name] = {"needed": None, "error": str(exc)}
    result["wall_s"] = time.perf_counter() - started
    result["complete"] = True
