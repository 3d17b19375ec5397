"""`router-bench fleet`: the same traffic through every contender, on the same emulated fleet.

For each workload and each contender, one run: a fresh emulated fleet (`router-emulator`, cold
caches, its own process), the contender in front of it (its own process), and the replayer in
this process sending the workload. Contenders:

- `round-robin`: the client sends each request to the next replica (the baseline, no router);
- `least_load`, `consistent_hash`: `router-serve` with that policy, rebalancing and warm-up off;
- `full`: `router-serve` as shipped (no `--policy`: its default policy), with health, rebalancing
  and warm-up; `affinity`: the same with `--policy affinity` (sticky sessions, ring, bounded
  load), to compare with the default; `full-capacity-blind`: `affinity` with `--no-capacity-caps`
  (bounded load that ignores how many requests each replica runs at once, as before that setting);
  `full-no-kv-wait`: `full` with `--no-ttft-kv-wait` (no wait for room in a full KV cache);
  `full-no-queue-lag`: `full` with `--ttft-queue-gain 0` (first tokens' lag does not move the queues);
  `full-model`: `full` with `--no-kv-events` (priced by the router's own model of what it sent, even
  where the engines publish what they hold); `full-tokenizer` (`--engine vllm` only): `full` with
  `--tokenizer-dirs` naming the served model's folder by hand (what `full` finds on its own from the
  replicas' `/v1/models`);
- `sglang-cache-aware`, `sglang-header`: `sglang-router` with `--policy cache_aware`, and with
  `--policy manual` and the session id in `X-SMG-Routing-Key` (when sglang-router is installed);
- `smg-cache-aware`, `smg-header`: `smg` 1.13, the Shepherd Model Gateway (sglang-router's
  successor), with `--policy cache_aware`, and with `--policy consistent_hashing
  --routing-key-headers x-session-id`, the session id in `X-Session-ID` (when smg is installed).
  It runs as `python -m smg.launch_router`: its `smg` script shares its name with one of
  sglang-router's (router.bench.proxy_bench). It finds neither `/version` (vLLM) nor
  `/server_info` (SGLang) on an emulated replica, registers it as a generic OpenAI-compatible
  backend and fetches no loads from it (its log says so): its worker overload protection (8
  waiting requests, 80 % KV) has no engine figures to act on, and its load gate balances on what
  smg counts itself. Requests without a key under `consistent_hashing` are spread, not hashed;
- `vllm-consistent-hash`: `vllm-router --policy consistent_hash`, session id in `x-session-id`
  (when vllm-router is installed); `vllm-cache-aware`: `vllm-router --policy cache_aware`, with
  `--engine vllm` only: it posts every request to `/v1/chat/completions/render` on every replica
  (served with vLLM's `--enable-scale-out`; else it asks `/tokenize`) to place it by the tokens it
  shares with what each replica saw;
- `oracle`: the client pins each session to one replica by hash, with no router: the hit rate a
  sticky router could reach, with no regard for load;
- prefill/decode disaggregation, run only when named: the first half of the replicas prefill, the
  others decode, through vLLM's `kv_transfer_params` hand-off (the emulator speaks it; real vLLM
  needs NIXL, router.bench.vllm). `disagg`: router-serve as shipped with `--prefill`/`--decode`,
  splitting a request only when its decode replica would prefill at least
  `disagg_min_prompt_tokens` (conditional); `disagg-p25`, `disagg-p75`: the same with a quarter
  or three quarters of the replicas prefilling; `disagg-always`: every request split; `anywhere`:
  no roles, every replica serving and prefilling for another where that costs the fleet less
  waiting (`--prefill-anywhere`, vLLM's kv_both); `vllm-pd`:
  `vllm-router --vllm-pd-disaggregation --policy consistent_hash` (session id in
  `x-session-id`). With any of them, each table also shows TTFT P50, time per output token (after
  the first) P50 and P99, and goodput: answers within `--slo-ttft` and `--slo-tpot` a second
  (engine seconds of the run), and their share.

Workloads (`--workloads`; by default `sessions`, and the traces with `--trace-dir`):
- `sessions@R`: synthetic multi-turn chats, R new sessions per engine second for `--duration`;
  `sessions` is one workload per `--rate`. `sessions-keyless@R` (`sessions-keyless`: one per
  `--rate`): the same chats with no session key at all, neither header nor `user` field;
- `agents@R` (and `agents-keyless@R`): coding agents, R new sessions per engine second: two long
  tool prompts that every session shares (12,000 tokens: an agent's instructions and tool
  definitions), a task with files opened (2,000-8,000 tokens), then 8-30 turns of tool loops whose
  results are long (100-3,000 tokens) and whose pauses are short (1.5 s on average: the tools
  running), each request with Claude Code's `x-claude-code-session-id` beside the contender's key;
  on router-emulator (started with vLLM's tool flags) each turn but a session's last requires a
  tool, and the next turn sends the call back with its result as a `tool` message;
- `session-replay@R`: the shape of Dynamo's session-replay study (many concurrent sessions of 20
  turns on few replicas): the chats of `sessions`, 20 turns each, 1 s pauses; run it with few
  `--replicas` and a rate that keeps hundreds of sessions open. Both fix their own turns and
  pauses (`--turns` and `--think` are for `sessions` and `longdoc`);
- `longdoc`: long-document question answering (router.bench.workloads): `--docs` documents of
  `--doc-tokens` tokens, `--doc-rate` new sessions per engine second for `--duration`, each
  asking `--doc-turns` questions about one document (Zipf popularity: sessions share documents).
  Its fleet has a long-context engine shape, `LONGDOC_ENGINE`: a 70B-class model with KV room for
  98,304 tokens, prefill at 4,000 tokens/s in chunks of 2,048, 25 ms steps (`--emulator-arg`
  comes after it, so it can change the shape). By default the documents a run asks about hold
  more tokens than one replica's KV and fewer than a fleet of 8's; each table says how many.
  `longdoc-keyless`: the same sessions with no session key, so only the prompt tells a router
  where the context is. The figures that matter there: KV hit rate, later-turn TTFT P99 and
  multi-turn P99;
- `mooncake-conversation`, `mooncake-synthetic` (with `--trace-dir`): the Mooncake traces,
  `--trace-window` seconds from their start, `--trace-speedup` times faster (one speed-up per
  run: 2× and 5× are two runs).

Each table opens with its workload's engine: the emulator's arguments, KV per replica and in the
fleet, and the working set against them. Everything the client measures (KV hit rate from
`usage`, latencies, jumps from `X-Replica-Id`) is as in `router-bench replay`; load per replica
(requests each replica finished, and its requests running + waiting over time) and the emulated
GPU busy share (engine time spent in steps while arrivals last) come from the emulators' own
counters (`GET /replicas` on the fleet's control port, every `--sample-s`). Latencies are engine
seconds (wall seconds x `--time-scale`); "multi-turn" and "later-turn" are a session's turns
after its first. Router timers (health probes, the rebalancing window) run on the wall clock,
so at time scale 2 they span twice as many engine seconds.

For router-serve's contenders, its /metrics is read before and after each run: "exact predicted"
is the share of its answers whose cached tokens it predicted to the token
(`router_prefix_prediction_error_tokens`, the bucket (-0.5, 0.5]), of those it priced by the
engine's KV events and of those it priced by its own model, with the whole histogram of errors
and the replicas whose events it believed at the end in the JSON; where requests failed, the
progress line adds the attempts router-serve retried, by cause (`router_retries_total`:
timeout, connect, reset, http_5xx), which the JSON keeps for every run (`router_retries`), and
the path where the router's standard error (its log, the last MiB) was kept for that run
(`--out`/logs/, `router_log`). The JSON also keeps its sessions' jumps by reason
(`jumps_by_reason`) and the answers it counted as their client gone (`client_gone`, status 499:
none where the run waits for every answer's end, as it does unless cut off at its duration).

Replicas needed: for the contenders in `--size-search`, the smallest fleet (down to half of
`--replicas`) whose multi-turn P99 on the busiest keyed `sessions@R` stays within `--p99-target`
(default: the P99 round-robin reaches on the full fleet in this run), by bisection, one run per
probed size.

`--rounds K` runs every (workload, contender) K times, contenders taking turns, and reports
medians. Results go to `--out` as fleet.json, fleet.md and PNG plots (matplotlib, from the
`bench` extra). It exits 1 when a request failed for a fault (an error, a cut stream, a status
other than a router's 429) or a run could not be made; a router's overload hold refusing a request
(429) is one of its results, counted among the failed as refused in the tables, and exits 0.

`--engine llama-server` runs the same contenders in front of real llama.cpp `llama-server`
processes instead (scripts/build-llama-server.sh builds the binary; a random-weight model is
written for the run, router.bench.llama_server): `--slots` each, one CPU thread each, in real time
(time scale 1). Their figures come from each server's `/metrics`: requests running + deferred
for the spread, slot-seconds spent on prompts and generation for the busy share, and generated
tokens per replica for the load CV (llama-server counts no finished requests). llama-server sends
no replica header, so jumps are known only through router-serve (`X-Router-Replica`) and the
client-side contenders (a peer's jump rate is n/a). The longdoc workloads need the emulator (their
engine shape is an emulator's).

`--engine vllm` runs them in front of real vLLM replicas: vLLM's CPU build serving a tiny random-
weight Llama (scripts/build-vllm.sh builds both; router.bench.vllm), `--max-num-seqs` requests at
once and `--kv-blocks` KV blocks of 32 tokens each, `--enforce-eager`, the render endpoints off as
vLLM ships (`vllm-cache-aware` then asks `/tokenize`; router-serve finds the model's tokenizer from
`/v1/models`; `--vllm-arg=--enable-scale-out` turns them on), KV-cache events published on ZMQ with
a replay socket (router-serve reads them unless `--no-kv-events`; a run of a contender that reads
them starts once it believes every replica's), in real time. A replica takes a minute or two to
start on a few shared cores, so the replicas start once and are kept for the whole benchmark: before
each run they are left to go idle and their prefix caches are emptied (`POST /reset_prefix_cache`,
served in vLLM's dev mode, `VLLM_SERVER_DEV_MODE=1`), so every contender meets cold caches, as on a
fresh fleet. Each replica's worker runs one OpenMP thread bound to no CPU
(`VLLM_CPU_OMP_THREADS_BIND=nobind`, unless the environment sets it; vLLM's own default binds every
replica to the same CPU). Every request asks for `ignore_eos`, so that the random model's replies
are max_tokens long for every contender, and the sessions' text is cut to `--prompt-scale` of its
length (0.25 by default here): the tiny model's tokenizer counts about 3.8 tokens in the 4
characters of an emulator token, so a quarter of the text holds about as many real tokens as the
emulator counts in the whole. Figures from each replica's `/metrics`: the KV hit rate from the
engines' own prefix-cache counters (hit ÷ queried tokens, their changes over the run; the client's
`cached_tokens` share beside it), requests running + waiting for the spread, requests finished for
the load CV, preemptions, and the share of sampled time a replica ran a request for "busy". Each
table opens with the engine settings, the KV per replica and in the fleet, and the tokens the run's
conversations hold against them. vLLM sends no replica header either (a peer's jump rate is n/a).
Sessions workloads only: the Mooncake traces' prompts (a median of 7,000-12,000 tokens) outgrow the
model's 8,192-token context."""

# This module is the command line: its options, their checks, and the command that runs the benchmark
# and writes what it found (router.bench.fleet_runs drives the runs, router.bench.fleet_report writes
# the results). It is past 450 lines because the docstring above is `router-bench fleet --help`.

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import uvloop

from router.bench.common import parse_settings
from router.bench.contenders import CONTENDERS, ENGINES, available
from router.bench.fleet_report import make_tables, render_markdown, write_plots
from router.bench.fleet_runs import new_result, plan_line, run_all
from router.bench.fleet_workloads import TRACES, WORKLOAD_NAMES, Workload
from router.bench.live import Progress, Stopped
from router.bench.llama_server import NotBuilt, find_binary
from router.bench.vllm import VLLM_BLOCK, VllmReplicas, find_vllm
from router.bench.vllm import NotBuilt as VllmNotBuilt
from router.bench.workloads import TraceError
from router.config import FIELDS, ConfigError, load

# --engine vllm: the tiny model's context (max_position_embeddings), which caps --max-model-len; the
# prompt scale by default (its tokenizer counts about 3.8 tokens in the 4 characters of one emulator token)
VLLM_CONTEXT = 8192
VLLM_PROMPT_SCALE = 0.25
VLLM_RATE = "0.3"  # new sessions a second, by default: about 70 % of two shared cores (docs/benchmarks.md)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "fleet",
        help="the same traffic through round-robin, this router's policies, the peer routers and an oracle",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--replicas", type=int, default=20, help="replicas (default 20)")
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="emulator",
        help="what the replicas are: router-emulator (default), real llama.cpp llama-server processes "
        "(scripts/build-llama-server.sh), or real vLLM servers, its CPU build (scripts/build-vllm.sh); "
        "the real engines serve a random-weight model, in real time",
    )
    p.add_argument("--slots", type=int, default=2, help="llama-server: slots (requests run at once) each (default 2)")
    p.add_argument(
        "--slot-context", type=int, default=16384, help="llama-server: context tokens per slot (default 16384)"
    )
    p.add_argument(
        "--llama-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra llama-server argument, one word each (it takes no --flag=value): "
        "--llama-arg=--cache-ram --llama-arg=64; repeatable",
    )
    p.add_argument("--max-num-seqs", type=int, default=8, help="vllm: requests each replica runs at once (default 8)")
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=256,
        help=f"vllm: KV blocks of {VLLM_BLOCK} tokens each replica holds (default 256: 8,192 tokens); "
        f"the longest request it takes (--max-model-len) is one block less, at most {VLLM_CONTEXT:,} tokens",
    )
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra vLLM server argument, one word each: --vllm-arg=--max-num-batched-tokens --vllm-arg=1024; "
        "repeatable",
    )
    p.add_argument(
        "--prompt-scale",
        type=float,
        default=None,
        metavar="F",
        help="sessions: system prompts, opening and user messages F times their default length "
        f"(default 1; {VLLM_PROMPT_SCALE:g} with --engine vllm, whose tokenizer counts about 3.8 tokens in the "
        "4 characters of an emulator token)",
    )
    p.add_argument(
        "--contenders",
        default=None,
        metavar="A,B,...",
        help="which to run, in order (default: those installed that run with --engine, but the "
        f"prefill/decode ones, which run when named; of {', '.join(CONTENDERS)})",
    )
    p.add_argument(
        "--workloads",
        default=None,
        metavar="A,B,...",
        help=f"{WORKLOAD_NAMES} (default: sessions, and the traces with --trace-dir); "
        "sessions and sessions-keyless mean one workload per --rate",
    )
    p.add_argument(
        "--rate",
        default=None,
        metavar="R[,R...]",
        help="sessions, sessions-keyless: new sessions per engine second; each rate is a workload, sessions@R "
        f"(default 4,16; {VLLM_RATE} with --engine vllm)",
    )
    p.add_argument("--turns", default="3-8", metavar="MIN-MAX", help="sessions: turns per session (default 3-8)")
    p.add_argument("--think", type=float, default=8.0, help="sessions, longdoc: mean think time, engine s (default 8)")
    p.add_argument(
        "--duration", type=float, default=120.0, help="sessions, longdoc: engine seconds of arrivals (default 120)"
    )
    p.add_argument("--doc-rate", type=float, default=0.5, help="longdoc: new sessions per engine second (default 0.5)")
    p.add_argument("--docs", type=int, default=24, help="longdoc: documents (default 24)")
    p.add_argument(
        "--doc-tokens",
        default="6000-12000",
        metavar="MIN-MAX",
        help="longdoc: tokens per document (default 6000-12000)",
    )
    p.add_argument("--doc-turns", default="3-6", metavar="MIN-MAX", help="longdoc: questions per session (default 3-6)")
    p.add_argument("--trace-dir", default=None, metavar="DIR", help="where the Mooncake trace files are")
    p.add_argument(
        "--trace-window", type=float, default=600.0, metavar="S", help="trace seconds replayed (default 600)"
    )
    p.add_argument("--trace-speedup", type=float, default=5.0, help="trace clock compression (default 5)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="engine seconds per wall second (default 2; the real engines run in real time: 1)",
    )
    p.add_argument(
        "--stream-interval", type=int, default=4, help="tokens per streamed chunk after the first (default 4)"
    )
    p.add_argument(
        "--emulator-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra router-emulator argument, e.g. --emulator-arg=--num-blocks=20000, after the workload's "
        "engine shape (longdoc's); repeatable",
    )
    p.add_argument(
        "--setting", action="append", default=[], metavar="NAME=VALUE", help="router-serve setting for its contenders"
    )
    p.add_argument("--rounds", type=int, default=1, help="runs per contender and workload; medians (default 1)")
    p.add_argument(
        "--size-search",
        default=None,
        metavar="A,B,...",
        help="contenders whose fleet size for the P99 target is searched ('' for none; default round-robin,full)",
    )
    p.add_argument("--p99-target", type=float, default=None, metavar="S", help="multi-turn P99 target, engine seconds")
    p.add_argument(
        "--slo-ttft",
        type=float,
        default=5.0,
        metavar="S",
        help="goodput's target for time to first token, engine seconds (default 5); tables with "
        "prefill/decode contenders show goodput: answers within both targets a second",
    )
    p.add_argument(
        "--slo-tpot",
        type=float,
        default=0.1,
        metavar="S",
        help="goodput's target for time per output token after the first, engine seconds (default 0.1)",
    )
    p.add_argument("--sample-s", type=float, default=1.0, help="wall seconds between fleet samples (default 1)")
    p.add_argument("--seed", type=int, default=1, help="workload seed (default 1)")
    p.add_argument("--out", default="fleet-results", metavar="DIR", help="where results go (default fleet-results)")
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the Markdown tables")
    p.set_defaults(run=run_cli)


RESERVED_SETTINGS = ("policy", "rebalance", "warmup", "replicas", "host", "port", "state")  # set per contender


def _range(text: str, flag: str) -> tuple[int, int]:
    """`3-8` -> (3, 8), `5` -> (5, 5); ValueError unless 1 <= MIN <= MAX."""
    low, sep, high = text.partition("-")
    try:
        span = (int(low), int(high if sep else low))
    except ValueError:
        raise ValueError(f"{flag} must look like 3-8 or 5, got {text!r}") from None
    if not 1 <= span[0] <= span[1]:
        raise ValueError(f"{flag} must be MIN-MAX with 1 <= MIN <= MAX")
    return span


def _names(text: str, what: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{what} names {repeated[0]!r} twice")
    return names


def check_args(args: argparse.Namespace) -> None:
    """Validate and normalise; ValueError with a readable message."""
    args.llama_model = None  # written once for the run, by the first llama fleet
    args.vllm_replicas = None  # started by the first vLLM fleet, kept until the end (run_cli stops them)
    if args.engine != "emulator":
        if args.time_scale not in (None, 1.0):
            raise ValueError(f"--engine {args.engine} runs in real time: --time-scale must be 1 (or left out)")
        if args.emulator_arg:
            raise ValueError("--emulator-arg is for --engine emulator")
        args.time_scale = 1.0
    if args.engine == "llama-server":
        if not (1 <= args.slots <= 64 and 256 <= args.slot_context <= 131072):
            raise ValueError("need 1 <= --slots <= 64 and 256 <= --slot-context <= 131072")
    elif args.llama_arg:
        raise ValueError("--llama-arg is for --engine llama-server")
    if args.engine == "vllm":
        if not (1 <= args.max_num_seqs <= 256 and 17 <= args.kv_blocks <= 1_000_000):
            raise ValueError("need 1 <= --max-num-seqs <= 256 and 17 <= --kv-blocks (a 512-token context)")
        args.vllm_replicas = VllmReplicas(
            kv_blocks=args.kv_blocks,
            max_num_seqs=args.max_num_seqs,
            max_model_len=min(VLLM_CONTEXT, (args.kv_blocks - 1) * VLLM_BLOCK),  # vLLM refuses a longer one
            extra=tuple(args.vllm_arg),
        )
    elif args.vllm_arg:
        raise ValueError("--vllm-arg is for --engine vllm")
    if args.time_scale is None:
        args.time_scale = 2.0
    if args.rate is None:
        args.rate = VLLM_RATE if args.engine == "vllm" else "4,16"
    if args.prompt_scale is None:
        args.prompt_scale = VLLM_PROMPT_SCALE if args.engine == "vllm" else 1.0
    if not (math.isfinite(args.prompt_scale) and 0 < args.prompt_scale <= 10):
        raise ValueError("--prompt-scale must be a number above 0, at most 10")
    positive = ("duration", "doc_rate", "trace_window", "trace_speedup", "time_scale", "sample_s", "slo_ttft")
    for name in ("think", *positive, "slo_tpot"):
        value = getattr(args, name)
        if not (math.isfinite(value) and (value >= 0 if name == "think" else value > 0)):
            raise ValueError(f"--{name.replace('_', '-')} must be a {'' if name == 'think' else 'positive '}number")
    if not (2 <= args.replicas <= 1000) or args.rounds < 1 or args.stream_interval < 1:
        raise ValueError("need 2 <= --replicas <= 1000, --rounds >= 1 and --stream-interval >= 1")
    if args.p99_target is not None and not (math.isfinite(args.p99_target) and args.p99_target > 0):
        raise ValueError("--p99-target must be a positive number")
    args.turns_range = _range(args.turns, "--turns")
    args.doc_turns_range = _range(args.doc_turns, "--doc-turns")
    args.doc_tokens_range = _range(args.doc_tokens, "--doc-tokens")
    if not 1 <= args.docs <= 10000:
        raise ValueError("need 1 <= --docs <= 10000")
    names = (
        _names(args.contenders, "--contenders")
        if args.contenders
        else [n for n, c in CONTENDERS.items() if available(n) and args.engine in c.engines and not c.splits]
    )
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise ValueError(f"unknown contender {unknown[0]!r}; choose from {', '.join(CONTENDERS)}")
    elsewhere = [n for n in names if args.engine not in CONTENDERS[n].engines]
    if elsewhere:
        c = CONTENDERS[elsewhere[0]]
        raise ValueError(f"contender {c.name!r} runs with --engine {' or '.join(c.engines)} only")
    missing = [n for n in names if not available(n)]
    if missing:
        raise ValueError(f"contender {missing[0]!r} is not installed (pip install '.[bench]')")
    args.contenders = names
    # the engine's build is looked for last: a user is not sent to build one for a run refused anyway
    try:
        if args.engine == "llama-server":
            find_binary()
        elif args.engine == "vllm":
            find_vllm()
    except (NotBuilt, VllmNotBuilt) as exc:
        raise ValueError(str(exc)) from None
    if args.vllm_replicas is not None:  # prefill/decode contenders: NIXL in every replica
        args.vllm_replicas.nixl = any(CONTENDERS[n].splits for n in names)
    try:
        args.rate = [float(r) for r in _names(str(args.rate), "--rate")]
    except ValueError as exc:
        if "twice" in str(exc):
            raise
        raise ValueError(f"--rate must be numbers separated by commas, got {args.rate!r}") from None
    if not args.rate or not all(math.isfinite(r) and r > 0 for r in args.rate):
        raise ValueError("--rate must be positive numbers")
    asked = (
        _names(args.workloads, "--workloads") if args.workloads else ["sessions", *(TRACES if args.trace_dir else ())]
    )
    workloads = []
    for w in asked:
        if w in ("sessions", "sessions-keyless"):
            workloads += [f"{w}@{r:g}" for r in args.rate]
            continue
        kind = Workload.parse(w).kind  # ValueError if unknown
        if kind == "longdoc" and args.engine != "emulator":
            raise ValueError(f"workload {w} needs --engine emulator (its engine shape is an emulator's)")
        if kind == "trace" and args.engine == "vllm":
            raise ValueError(f"workload {w}: its prompts outgrow the context of --engine vllm's tiny model")
        if kind == "trace":
            if not args.trace_dir:
                raise ValueError(f"workload {w} needs --trace-dir")
            path = Path(args.trace_dir) / TRACES[w]
            if not path.is_file():
                raise ValueError(f"no trace file {path}")
        workloads.append(w)
    args.workloads = _names(",".join(workloads), "--workloads")
    if args.size_search is None:  # by default, those of round-robin and full that run
        args.size_search = [n for n in ("round-robin", "full") if n in names]
    else:
        args.size_search = _names(args.size_search, "--size-search")
        for n in args.size_search:
            if n not in names:
                raise ValueError(f"--size-search names {n!r}, which is not among the contenders")
    settings = parse_settings(args.setting)
    for name in settings:
        if name in RESERVED_SETTINGS:
            raise ValueError(f"--setting {name} is set by each contender; it cannot be overridden here")
    try:
        load(None, {"ROUTER_" + k.upper(): v for k, v in settings.items()}, {"replicas": ["http://127.0.0.1:1"]})
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    unknown = [k for k in settings if k not in FIELDS]
    if unknown:
        raise ValueError(f"--setting {unknown[0]}: unknown router setting")
    args.settings = settings


def run_cli(args: argparse.Namespace) -> int:
    try:
        check_args(args)
    except ValueError as exc:
        print(f"router-bench fleet: {exc}", file=sys.stderr)
        return 2
    progress = Progress()
    note = progress.note

    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"router-bench fleet: cannot write to {out}: {exc.strerror}", file=sys.stderr)
        return 2

    signals: list[int] = []
    started = time.monotonic()

    def terminated(signum: int, frame: Any) -> None:
        signals.append(signum)
        raise KeyboardInterrupt  # unwinds like Ctrl-C: every child is stopped, finished runs are written

    previous = signal.signal(signal.SIGTERM, terminated)
    result = new_result(args)
    status = 0
    note(f"router-bench fleet: {plan_line(args)}")
    try:
        uvloop.run(run_all(args, result, note, progress.show if progress.enabled else None))
    except KeyboardInterrupt:
        stopped = Stopped(signals[0] if signals else signal.SIGINT, time.monotonic() - started)
        stopped.mark(result)
        note(f"router-bench fleet: {stopped.name}; writing the runs that finished")
        status = stopped.exit_status
    except (RuntimeError, TraceError, OSError) as exc:
        note(f"router-bench fleet: {exc}; writing the runs that finished")
        status = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        if args.llama_model is not None:
            shutil.rmtree(args.llama_model.parent, ignore_errors=True)
        if args.vllm_replicas is not None:
            args.vllm_replicas.stop()
    if not result["complete"]:
        make_tables(result)
    (out / "fleet.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    markdown = render_markdown(result)
    (out / "fleet.md").write_text(markdown + "\n")
    plots = write_plots(result, out)
    note(
        f"wrote {out}/fleet.json, fleet.md"
        + "".join(f", {p}" for p in plots or ())
        + (" (no plots: matplotlib is not installed)" if plots is None else "")
    )
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1) if args.json else markdown)
    if status:
        return status
    # a router's 429s are its overload hold's decisions, reported as refused: only faults fail the run
    broken = [
        f
        for t in result["tables"].values()
        for f in t.values()
        if f.get("error") or f.get("failed", 0) - f.get("refused", 0) > 0
    ]
    return 1 if broken else 0
