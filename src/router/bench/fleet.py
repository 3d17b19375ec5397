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
  `--tokenizer-dirs` naming the served model's folder, so that it cuts requests into the engine's
  tokens itself instead of asking a replica's render endpoint;
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
  (vLLM's `--enable-scale-out`) to place it by the tokens it shares with what each replica saw;
- `oracle`: the client pins each session to one replica by hash, with no router: the hit rate a
  sticky router could reach, with no regard for load.

Workloads (`--workloads`; by default `sessions`, and the traces with `--trace-dir`):
- `sessions@R`: synthetic multi-turn chats, R new sessions per engine second for `--duration`;
  `sessions` is one workload per `--rate`. `sessions-keyless@R` (`sessions-keyless`: one per
  `--rate`): the same chats with no session key at all, neither header nor `user` field;
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
and the replicas whose events it believed at the end in the JSON.

Replicas needed: for the contenders in `--size-search`, the smallest fleet (down to half of
`--replicas`) whose multi-turn P99 on the busiest keyed `sessions@R` stays within `--p99-target`
(default: the P99 round-robin reaches on the full fleet in this run), by bisection, one run per
probed size.

`--rounds K` runs every (workload, contender) K times, contenders taking turns, and reports
medians. Results go to `--out` as fleet.json, fleet.md and PNG plots (matplotlib, from the
`bench` extra).

`--engine llama-server` runs the same contenders in front of real llama.cpp `llama-server`
processes instead (scripts/build-llama-server.sh builds the binary; a random-weight model is
written for the run, router.bench.llama_server): `--slots` each, one CPU thread each, in real time
(time scale 1). Their figures come from each server's `/metrics`: requests running + deferred
for the spread, slot-seconds spent on prompts and generation for the busy share, and generated
tokens per replica for the load CV (llama-server counts no finished requests). llama-server sends
no replica header, so jumps are known only through router-serve (`X-Router-Replica`) and the
client-side contenders (a peer's jump rate is n/a). The longdoc workloads need the emulator (their
engine shape is an emulator's).

`--engine vllm` runs them in front of real vLLM replicas: vLLM's CPU build serving a tiny
random-weight Llama (scripts/build-vllm.sh builds both; router.bench.vllm), `--max-num-seqs`
requests at once and `--kv-blocks` KV blocks of 32 tokens each, `--enforce-eager`, the render
endpoints on (`--enable-scale-out`: `vllm-cache-aware` posts to them, router-serve tokenizes through
them), KV-cache events published on ZMQ with a replay socket (router-serve reads them unless
`--no-kv-events`; a run of a contender that reads them starts once it believes every replica's), in
real time. A replica takes a minute or two to start on a few shared cores, so the replicas start
once and are kept for the whole benchmark: before each run they are left to go idle and their prefix
caches are emptied (`POST /reset_prefix_cache`, served in vLLM's dev mode,
`VLLM_SERVER_DEV_MODE=1`), so every contender meets cold caches, as on a fresh fleet. Each replica's
worker runs one OpenMP thread bound to no CPU (`VLLM_CPU_OMP_THREADS_BIND=nobind`, unless the
environment sets it; vLLM's own default binds every replica to the same CPU). Every request asks for
`ignore_eos`, so that the random model's replies are max_tokens long for every contender, and the
sessions' text is cut to `--prompt-scale` of its length (0.25 by default here): the tiny model's
tokenizer counts about 3.8 tokens in the 4 characters of an emulator token, so a quarter of the text
holds about as many real tokens as the emulator counts in the whole. Figures from each replica's
`/metrics`: the KV hit rate from the engines' own prefix-cache counters (hit ÷ queried tokens, their
changes over the run; the client's `cached_tokens` share beside it), requests running + waiting for
the spread, requests finished for the load CV, preemptions, and the share of sampled time a replica
ran a request for "busy". Each table opens with the engine settings, the KV per replica and in the
fleet, and the tokens the run's conversations hold against them. vLLM sends no replica header either
(a peer's jump rate is n/a). Sessions workloads only: the Mooncake traces' prompts (a median of
7,000-12,000 tokens) outgrow the model's 8,192-token context.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from router.bench.common import free_port, parse_settings
from router.bench.live import Progress, Stopped
from router.bench.llama_server import LlamaServer, NotBuilt, find_binary, model_for
from router.bench.proxy_bench import PEERS, cpu_seconds, first_answer, peer_command, peer_installed, stop
from router.bench.replay import DRAIN_FACTOR, Replayer, ReplayOptions
from router.bench.vllm import NotBuilt as VllmNotBuilt
from router.bench.vllm import VllmServer, find_vllm, start_all
from router.bench.workloads import (
    LongDocSpec,
    SessionPlan,
    SessionsSpec,
    TraceError,
    generate_longdoc,
    generate_sessions,
    longdoc_documents,
)
from router.config import FIELDS, ConfigError, load
from router.emulator.engine import EngineConfig
from router.health.signals import samples
from router.measures import coefficient_of_variation

TRACES = {
    "mooncake-conversation": "mooncake_conversation_trace.jsonl",
    "mooncake-synthetic": "mooncake_synthetic_trace.jsonl",
}
# The engine shape of the longdoc workloads' fleets: a 70B-class model serving long contexts
# with little KV room (docs/emulator.md has the defaults, an 8B model on one H100). KV for 98,304
# tokens, 6,144 blocks of 16 (a 70B model's 320 KiB of KV a token makes that 30 GB): about ten of
# the documents, so the working set of a longdoc run outgrows one replica and fits a fleet of 8;
# prefill at 4,000 tokens/s, about a quarter of the 8B default, in chunks of 2,048 so decoding
# goes on beside a document's prefill; 25 ms steps (reading the weights); 95 ns per context token
# of attention (320 KiB of KV at 3.35 TB/s).
LONGDOC_ENGINE = (
    "--num-blocks=6144",
    "--max-num-batched-tokens=2048",
    "--prefill-tokens-per-s=4000",
    "--step-ms=25",
    "--attention-ns-per-token=95",
)
WORKLOAD_NAMES = "sessions, sessions-keyless, sessions@R, longdoc, longdoc-keyless, " + ", ".join(TRACES)
ENGINES = ("emulator", "llama-server", "vllm")
# --engine vllm: KV blocks of 32 tokens (CPU attention wants a multiple of 32); the tiny model's
# context (max_position_embeddings), which caps --max-model-len; the prompt scale by default (its
# tokenizer counts about 3.8 tokens in the 4 characters of one emulator token)
VLLM_BLOCK = 32
VLLM_CONTEXT = 8192
VLLM_PROMPT_SCALE = 0.25
VLLM_RATE = "0.3"  # new sessions a second, by default: about 70 % of two shared cores (docs/benchmarks.md)
VLLM_MODEL = "emulated-llm"  # the name the replay and the routers' first request ask for
VLLM_IDLE_S = 120.0  # a kept fleet not idle this long after a run has a stuck request: it is restarted


@dataclass(frozen=True)
class Workload:
    """A workload of the benchmark, read from its name: `sessions@4`, `sessions-keyless@4`, `longdoc`,
    `longdoc-keyless`, or a trace's."""

    name: str
    kind: str  # sessions | longdoc | trace
    keyed: bool = True  # False: no session key is sent at all
    rate: float | None = None  # sessions: new sessions per engine second

    @classmethod
    def parse(cls, name: str) -> Workload:
        if name in TRACES:
            return cls(name, "trace")
        base, at, rate = name.partition("@")
        keyed = not base.endswith("-keyless")
        base = base.removesuffix("-keyless")
        if base == "longdoc" and not at:
            return cls(name, "longdoc", keyed)
        if base == "sessions" and at:
            try:
                value = float(rate)
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"workload {name!r}: the rate after @ must be a positive number")
            return cls(name, "sessions", keyed, value)
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOAD_NAMES}")


@dataclass(frozen=True)
class Contender:
    name: str
    label: str
    kind: str  # direct | router | a peer router of router.bench.proxy_bench.PEERS: sglang | smg | vllm
    args: tuple[str, ...] = ()
    spread: str = "round-robin"  # direct contenders only
    key_headers: tuple[str, ...] = ("X-Session-ID",)
    engines: tuple[str, ...] = ENGINES  # the --engine values it runs in front of
    tokenizer: bool = False  # router-serve tokenizes requests itself, with the vLLM model's files (tokenizer_dirs)


PLAIN = ("--no-rebalance", "--no-warmup")  # least_load and consistent_hash run as plain policies
SHIPPED = ("--rebalance", "--warmup")

CONTENDERS = {
    c.name: c
    for c in (
        Contender("round-robin", "round-robin (client, no router)", "direct"),
        Contender("least_load", "router-serve least_load", "router", ("--policy", "least_load", *PLAIN)),
        Contender("consistent_hash", "router-serve consistent_hash", "router", ("--policy", "consistent_hash", *PLAIN)),
        Contender("full", "router-serve as shipped", "router", SHIPPED),  # its default policy
        # as shipped, but priced by the router's own model of what it sent, not by the engines' KV events
        Contender("full-model", "router-serve, KV events off", "router", (*SHIPPED, "--no-kv-events")),
        Contender(
            "full-tokenizer", "router-serve, own tokenizer", "router", SHIPPED, engines=("vllm",), tokenizer=True
        ),
        Contender("affinity", "router-serve affinity", "router", ("--policy", "affinity", *SHIPPED)),
        Contender("full-no-kv-wait", "router-serve, no KV-bound wait", "router", (*SHIPPED, "--no-ttft-kv-wait")),
        Contender(
            "full-no-queue-lag", "router-serve, queues not moved by lag", "router", (*SHIPPED, "--ttft-queue-gain", "0")
        ),
        Contender(
            "full-capacity-blind",
            "router-serve affinity, capacity-blind",
            "router",
            ("--policy", "affinity", *SHIPPED, "--no-capacity-caps"),
        ),
        Contender("sglang-cache-aware", "sglang-router cache_aware", "sglang", ("--policy", "cache_aware")),
        Contender(
            "sglang-header",
            "sglang-router manual (session header)",
            "sglang",
            ("--policy", "manual"),
            key_headers=("X-Session-ID", "X-SMG-Routing-Key"),
        ),
        Contender("smg-cache-aware", "smg cache_aware", "smg", ("--policy", "cache_aware")),
        Contender(
            "smg-header",
            "smg consistent_hashing (session header)",
            "smg",
            ("--policy", "consistent_hashing", "--routing-key-headers", "x-session-id"),
        ),
        Contender("vllm-consistent-hash", "vllm-router consistent_hash", "vllm", ("--policy", "consistent_hash")),
        # it asks every replica to render every request (/v1/chat/completions/render, else /tokenize):
        # only vLLM serves them, so on the others it would not be cache-aware at all
        Contender(
            "vllm-cache-aware", "vllm-router cache_aware", "vllm", ("--policy", "cache_aware"), engines=("vllm",)
        ),
        Contender("oracle", "sticky oracle (client pins sessions)", "direct", spread="session"),
    )
}


def available(name: str) -> bool:
    kind = CONTENDERS[name].kind
    return peer_installed(kind) if kind in PEERS else True


def peer_versions(names: list[str]) -> dict[str, str]:
    """The installed version of each peer router among the contenders `names`."""
    out = {}
    for kind in dict.fromkeys(CONTENDERS[n].kind for n in names if CONTENDERS[n].kind in PEERS):
        package = PEERS[kind].package
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[package] = importlib.metadata.version(package)
    return out


# -- processes ------------------------------------------------------------------------------------


def free_port_run(n: int) -> int:
    """The first of `n` consecutive ports that are free now (the emulator fleet binds a run)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


@dataclass
class Child:
    """A child process in its own process group, its stderr kept in a file for the error line."""

    proc: subprocess.Popen[bytes]
    stderr: Any  # a temporary file
    what: str

    @classmethod
    def spawn(cls, cmd: list[str], what: str, env: dict[str, str] | None = None) -> Child:
        """Start `cmd` with this environment, less any router setting (`ROUTER_<SETTING>`) that
        would change a router child behind the bench's back, plus `env`."""
        err = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        inherited = {k: v for k, v in os.environ.items() if not (k.startswith("ROUTER_") and k[7:].lower() in FIELDS)}
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
            env=inherited | (env or {}),
        )
        return cls(proc, err, what)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def problem(self) -> str:
        """The last line the child wrote to stderr (why it stopped), if any."""
        self.stderr.seek(0)
        lines = [ln.strip() for ln in self.stderr.read()[-4000:].decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1] if lines else "no message"

    async def wait_up(self, url: str, path: str, timeout: float) -> None:
        """Until `url + path` answers below 500; RuntimeError at once if the child exits meanwhile."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.what} exited with status {self.proc.returncode}: {self.problem()}")
                with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError):
                    async with http.get(url + path, timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status < 500:
                            return
                await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.what} did not answer {url}{path} within {timeout:g} s")

    def stop(self) -> None:
        try:
            stop(self.proc)
        finally:
            self.stderr.close()


@dataclass
class Fleet:
    """The replicas of one run: where they answer, their processes, how to read their counters."""

    urls: list[str]
    pids: list[int]
    read: Callable[[aiohttp.ClientSession, float], Awaitable[Sample]]  # (http, seconds since t0)
    stop: Callable[[], None]
    what: str  # for the tables: "emulated replicas", "llama-server replicas", "vLLM replicas"
    control: str | None = None  # the emulator's control URL (faults, crashes, caches); None for real engines
    events: bool = False  # its replicas publish KV-cache events (router-serve waits until it believes them)


async def start_fleet(replicas: int, args: argparse.Namespace, emulator_args: list[str]) -> Fleet:
    """The replicas of one run; `emulator_args` (the workload's engine shape and `--emulator-arg`)
    go to router-emulator."""
    if args.engine == "llama-server":
        return await start_llama_fleet(replicas, args)
    if args.engine == "vllm":
        return await start_vllm_fleet(replicas, args)
    problem = ""
    for _ in range(3):  # a port of the run can be taken between the check and the bind: try another run
        base, control = free_port_run(replicas), free_port()
        cmd = [
            sys.executable,
            "-m",
            "router.emulator.cli",
            "--replicas",
            str(replicas),
            "--base-port",
            str(base),
            "--control-port",
            str(control),
            "--time-scale",
            str(args.time_scale),
            "--stream-interval",
            str(args.stream_interval),
            *emulator_args,
        ]
        child = Child.spawn(cmd, "router-emulator")
        urls = [f"http://127.0.0.1:{p}" for p in range(base, base + replicas)]
        control_url = f"http://127.0.0.1:{control}"
        try:
            await child.wait_up(control_url, "/replicas", timeout=30)
            for url in urls:
                await child.wait_up(url, "/health", timeout=10)
        except RuntimeError as exc:
            child.stop()
            problem = str(exc)
            if child.proc.returncode not in (None, -signal.SIGTERM) and "address" not in problem.lower():
                break  # it refused its arguments: another port will not help
            continue
        except BaseException:  # cancelled, interrupted: no fleet left behind
            child.stop()
            raise

        async def read(http: aiohttp.ClientSession, wall_s: float, control_url: str = control_url) -> Sample:
            async with http.get(control_url + "/replicas", timeout=aiohttp.ClientTimeout(total=5)) as r:
                rows = await r.json(loads=orjson.loads)
            return Sample(
                wall_s=wall_s,
                engine_s=[float(x["engine_time_s"]) for x in rows],
                busy_s=[float(x["engine"]["busy_seconds"]) for x in rows],
                queued=[int(x["engine"]["running"]) + int(x["engine"]["waiting"]) for x in rows],
                finished=[int(x["engine"]["finished_total"]) for x in rows],
            )

        return Fleet(urls, [child.pid], read, child.stop, "emulated replicas", control_url)
    raise RuntimeError(f"the emulated fleet did not start: {problem}")


async def start_llama_fleet(replicas: int, args: argparse.Namespace) -> Fleet:
    """`replicas` llama-server processes of `--slots` slots, on the random model written for the run."""
    try:
        binary = find_binary()
    except NotBuilt as exc:
        raise RuntimeError(str(exc)) from None
    if args.llama_model is None:  # one model for the whole benchmark, removed when it ends (run_cli)
        args.llama_model = model_for(Path(tempfile.mkdtemp(prefix="kvar-llama-")), binary)
    servers = [
        LlamaServer(
            args.llama_model,
            free_port(),
            slots=args.slots,
            context=args.slots * args.slot_context,
            binary=binary,
            extra=tuple(args.llama_arg),
            name=f"llama-{i}",
        )
        for i in range(replicas)
    ]

    def stop_all() -> None:
        for server in servers:
            server.stop()

    try:
        await asyncio.gather(*(s.start() for s in servers))
    except BaseException:
        stop_all()
        raise

    async def read(http: aiohttp.ClientSession, wall_s: float) -> Sample:
        async def one(server: LlamaServer) -> dict[str, float]:
            async with http.get(server.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                values, _ = samples(await r.text())
            return {name: sum(series) for name, series in values.items()}  # a missing one: KeyError, no sample

        rows = await asyncio.gather(*(one(s) for s in servers))
        return Sample(
            wall_s=wall_s,
            # slot-seconds: a replica of k slots has k of them each wall second
            engine_s=[wall_s * args.slots] * len(rows),
            busy_s=[m["llamacpp:prompt_seconds_total"] + m["llamacpp:tokens_predicted_seconds_total"] for m in rows],
            queued=[int(m["llamacpp:requests_processing"] + m["llamacpp:requests_deferred"]) for m in rows],
            finished=[int(m["llamacpp:tokens_predicted_total"]) for m in rows],
        )

    return Fleet(
        [s.url for s in servers], [s.proc.pid for s in servers if s.proc], read, stop_all, "llama-server replicas"
    )


# what a run reads from each vLLM replica's /metrics: gauges for the spread, and counters of which
# the fleet's totals are kept (a run's figures are their changes over it)
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
VLLM_COUNTERS = (
    "vllm:request_success_total",  # every finished_reason
    # tokens of new requests only: a preempted request's second lookup is not counted (vLLM keeps it
    # apart and exports none of it), so these agree with the answers' usage
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_sum",  # from the API server's arrival to the first token
    "vllm:time_to_first_token_seconds_count",
    "vllm:request_queue_time_seconds_sum",  # waiting in the scheduler
    "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_sum",  # first scheduled to first token
    "vllm:request_prefill_time_seconds_count",
)
VLLM_METRICS = frozenset(VLLM_GAUGES + VLLM_COUNTERS)


async def vllm_metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The VLLM_METRICS of one replica, each summed over its series; KeyError if one is missing."""
    async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
        r.raise_for_status()
        values, _ = samples(await r.text(), VLLM_METRICS)
    return {name: sum(values[name]) for name in VLLM_METRICS}


def group_pids(pgid: int) -> list[int]:
    """The processes of process group `pgid` (a vLLM replica: its API server, engine core, worker)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry)) == pgid:
                    pids.append(int(entry))
    return pids


@dataclass
class VllmReplicas:
    """The vLLM replicas of a benchmark, kept from run to run (a start takes a minute or two on a
    few shared cores): `ready` hands them over idle, with empty prefix caches; `stop` ends them."""

    kv_blocks: int
    max_num_seqs: int
    max_model_len: int
    extra: tuple[str, ...] = ()
    servers: list[VllmServer] = field(default_factory=list)
    logs: Path | None = None

    def engine_args(self) -> list[str]:
        """The engine settings every replica gets (for the tables), less the bench's own flags."""
        return [
            *("--max-num-seqs", str(self.max_num_seqs), "--num-gpu-blocks-override", str(self.kv_blocks)),
            *("--block-size", str(VLLM_BLOCK), "--max-model-len", str(self.max_model_len), *self.extra),
        ]

    @staticmethod
    def environment() -> dict[str, str]:
        """A replica's environment: vLLM's dev mode (POST /reset_prefix_cache) and, unless the
        environment binds its workers itself, one unbound OpenMP thread in its worker, so that the
        kernel spreads the busy replicas over the CPUs. vLLM's own default ('auto') binds every
        replica's worker to the same CPU and leaves the others to the API servers; binding each to a
        CPU in turn can leave two busy replicas on one CPU while another idles (docs/benchmarks.md
        has the measurements)."""
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
        return env

    async def ready(self, replicas: int) -> list[VllmServer]:
        """`replicas` replicas, started (or restarted, when the number differs or one has died)
        and warmed up, idle, their prefix caches empty."""
        alive = all(s.proc is not None and s.proc.poll() is None for s in self.servers)
        if self.servers and (len(self.servers) != replicas or not alive):
            self.stop()
        if not self.servers:
            await self._start(replicas)
        try:
            await self._cold()
        except RuntimeError:
            self.stop()  # a request stuck in an engine: a fresh fleet, once
            await self._start(replicas)
            await self._cold()
        return self.servers

    async def _start(self, replicas: int) -> None:
        try:
            root = find_vllm()
        except VllmNotBuilt as exc:
            raise RuntimeError(str(exc)) from None
        self.logs = Path(tempfile.mkdtemp(prefix="kvar-vllm-"))
        servers = [
            VllmServer(
                root,
                free_port(),
                names=(VLLM_MODEL,),
                max_num_seqs=self.max_num_seqs,
                block_size=VLLM_BLOCK,
                kv_blocks=self.kv_blocks,
                max_model_len=self.max_model_len,
                scale_out=True,  # the render endpoints: vllm-router's cache_aware, router-serve's tokens
                events_port=free_port(),  # KV-cache events, which router-serve reads (unless --no-kv-events)
                replay_port=free_port(),
                extra=self.extra,
                env=self.environment(),
                name=f"vllm-{i}",
                log=self.logs / f"vllm-{i}.log",
            )
            for i in range(replicas)
        ]
        try:
            await start_all(servers)  # stops them all if one fails
        except RuntimeError as exc:
            lines = str(exc).splitlines()
            self.stop()
            raise RuntimeError(
                "the vLLM fleet did not start: "
                + lines[0]
                + (f" (its log ends: {lines[-1].strip()})" if lines[1:] else "")
            ) from None
        except BaseException:
            self.stop()
            raise
        self.servers = servers
        # the first requests of a fresh engine are slower than the rest: none of them in a run
        async with aiohttp.ClientSession() as http:
            for server in servers:
                for words in (8, 600):
                    body = {
                        "model": VLLM_MODEL,
                        "messages": [{"role": "user", "content": "warm up " * words}],
                        "max_tokens": 8,
                    }
                    with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                        async with http.post(server.url + "/v1/chat/completions", json=body) as r:
                            await r.read()

    async def _cold(self) -> None:
        """Until every replica is idle (a request of the last run may still be aborting), then empty
        their prefix caches; RuntimeError if that takes VLLM_IDLE_S."""
        deadline = time.monotonic() + VLLM_IDLE_S
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError, KeyError):
                    rows = await asyncio.gather(*(vllm_metrics(http, s.url) for s in self.servers))
                    if not any(m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] for m in rows):
                        done = []
                        for s in self.servers:  # success false while a block is still held: try again
                            async with http.post(
                                s.url + "/reset_prefix_cache", timeout=aiohttp.ClientTimeout(total=10)
                            ) as r:
                                r.raise_for_status()
                                done.append(bool((await r.json()).get("success")))
                        if all(done):
                            return
                await asyncio.sleep(0.25)
        raise RuntimeError(f"the vLLM replicas were not idle with empty caches within {VLLM_IDLE_S:g} s")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers = []
        if self.logs is not None:
            shutil.rmtree(self.logs, ignore_errors=True)
            self.logs = None


async def start_vllm_fleet(replicas: int, args: argparse.Namespace) -> Fleet:
    """The benchmark's kept vLLM replicas (args.vllm_replicas), idle and with cold caches, and how
    to read their counters during one run. Stopping this fleet leaves them running for the next."""
    servers = await args.vllm_replicas.ready(replicas)
    busy = [0.0] * len(servers)  # seconds each replica has had a request running, sampled
    previous: tuple[float, list[float]] | None = None  # the last sample's time and requests running

    async def read(http: aiohttp.ClientSession, wall_s: float) -> Sample:
        nonlocal previous
        rows = await asyncio.gather(*(vllm_metrics(http, s.url) for s in servers))
        running = [m["vllm:num_requests_running"] for m in rows]
        if previous is not None:  # by the trapezoid rule between samples
            then, before = previous
            for i, (a, b) in enumerate(zip(before, running, strict=True)):
                busy[i] += (wall_s - then) * ((a > 0) + (b > 0)) / 2
        previous = (wall_s, running)
        return Sample(
            wall_s=wall_s,
            engine_s=[wall_s] * len(rows),
            busy_s=list(busy),
            queued=[int(m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]) for m in rows],
            finished=[int(m["vllm:request_success_total"]) for m in rows],
            counters={name: sum(m[name] for m in rows) for name in VLLM_COUNTERS},
        )

    pids = [pid for s in servers if s.proc is not None for pid in group_pids(s.proc.pid)]
    return Fleet([s.url for s in servers], pids, read, lambda: None, "vLLM replicas", events=True)


async def start_contender(c: Contender, urls: list[str], settings: dict[str, str]) -> tuple[Child | None, list[str]]:
    """The contender's process (None for the client-side ones) and the targets to send to."""
    if c.kind == "direct":
        return None, urls
    port = free_port()
    env: dict[str, str] | None = None
    if c.kind == "router":
        cmd = [sys.executable, "-m", "router.proxy.cli", "--port", str(port), "--state", "none", *c.args]
        for url in urls:
            cmd += ["--replica", url]
        if c.tokenizer:  # the model's own tokenizer and chat template, not the replicas' render endpoints
            try:
                cmd += ["--tokenizer-dirs", f"*={find_vllm() / 'model'}"]
            except VllmNotBuilt as exc:
                raise RuntimeError(str(exc)) from None
        env = {"ROUTER_" + k.upper(): v for k, v in settings.items()}
    else:
        cmd, env = peer_command(c.kind, port, urls, c.args)
    child = Child.spawn(cmd, c.label, env)
    url = f"http://127.0.0.1:{port}"
    try:
        await child.wait_up(url, "/health", timeout=60)
        # a peer may answer /health before its workers are registered: wait for one real answer
        # (before the replay and its counters)
        await first_answer(url)
    except BaseException:
        child.stop()
        raise
    return child, [url]


# -- what router-serve says of its own decisions -----------------------------------------------------

PREDICTION_SOURCES = ("events", "model")  # router_prefix_prediction_error_tokens{source}
EVENTS_READY_S = 30.0  # router-serve believes every replica's KV events within this, or the run goes on without


@dataclass(frozen=True)
class RouterCounts:
    """What one read of router-serve's /metrics says of its predictions: per source, the answers
    checked and the cumulative counts of the error histogram (predicted minus reported cached
    tokens) by upper bound; per replica, whether its KV events are believed; per tokenizing source,
    the requests tokenized and their seconds; the router's own tokens checked against the engine's."""

    errors: dict[str, dict[float, float]]  # source -> {le: answers with an error <= le}
    believed: dict[str, float]  # replica -> router_kv_events_believed
    tokenized: dict[str, tuple[float, float]]  # source -> (count, seconds)
    checks: dict[str, float]  # router_token_checks by result: match, mismatch, error

    @classmethod
    def parse(cls, text: str) -> RouterCounts:
        errors: dict[str, dict[float, float]] = {}
        believed: dict[str, float] = {}
        tokenized: dict[str, list[float]] = {}
        checks: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sample.labels
                if sample.name == "router_prefix_prediction_error_tokens_bucket":
                    errors.setdefault(labels.get("source", ""), {})[float(labels["le"])] = sample.value
                elif sample.name == "router_kv_events_believed":
                    believed[labels.get("replica", "")] = sample.value
                elif sample.name in ("router_tokenize_seconds_count", "router_tokenize_seconds_sum"):
                    pair = tokenized.setdefault(labels.get("source", ""), [0.0, 0.0])
                    pair[sample.name.endswith("_sum")] = sample.value
                elif sample.name == "router_token_checks_total":
                    result = labels.get("result", "")
                    checks[result] = checks.get(result, 0.0) + sample.value
        return cls(errors, believed, {k: (v[0], v[1]) for k, v in tokenized.items()}, checks)

    def all_believed(self, replicas: int) -> bool:
        return len(self.believed) >= replicas and all(v == 1 for v in self.believed.values())


def prediction_figures(before: RouterCounts, after: RouterCounts) -> dict[str, Any]:
    """A run's predictions, per source (the histograms' changes between two reads): answers checked,
    those predicted to the token (the bucket (-0.5, 0.5]), under (the engine had more cached) and
    over, and the share exact; `exact_predicted_<source>` is that share (nan without answers)."""
    out: dict[str, Any] = {"predictions": {}}
    for source in PREDICTION_SOURCES:
        end, start = after.errors.get(source, {}), before.errors.get(source, {})
        cum = {le: n - start.get(le, 0.0) for le, n in end.items()}
        answers = cum.get(math.inf, 0.0)
        under, upto = cum.get(-0.5, 0.0), cum.get(0.5, 0.0)
        exact = upto - under
        out["predictions"][source] = {
            "answers": answers,
            "exact": exact,
            "under": under,
            "over": answers - upto,
            "buckets": {("+Inf" if math.isinf(le) else f"{le:g}"): n for le, n in sorted(cum.items())},
        }
        out[f"predicted_answers_{source}"] = answers
        out[f"exact_predicted_{source}"] = exact / answers if answers else math.nan
    out["kv_events_believed"] = dict(after.believed)
    out["tokenize"] = {
        source: {
            "count": count - before.tokenized.get(source, (0.0, 0.0))[0],
            "seconds": seconds - before.tokenized.get(source, (0.0, 0.0))[1],
        }
        for source, (count, seconds) in after.tokenized.items()
    }
    out["token_checks"] = {k: n - before.checks.get(k, 0.0) for k, n in after.checks.items()}
    return out


async def router_counts(url: str) -> RouterCounts | None:
    """One read of router-serve's /metrics; None when it did not answer."""
    with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError, ValueError):
        async with (
            aiohttp.ClientSession() as http,
            http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r,
        ):
            r.raise_for_status()
            return RouterCounts.parse(await r.text())
    return None


async def events_believed(url: str, replicas: int, timeout: float = EVENTS_READY_S) -> float | None:
    """Seconds until router-serve at `url` believes every replica's KV events (it finds them through
    /kv_event_sources every few seconds, then replays what they hold); None if not within `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        counts = await router_counts(url)
        if counts is not None and counts.all_believed(replicas):
            return time.monotonic() - t0
        await asyncio.sleep(0.25)
    return None


# -- the fleet's own counters ---------------------------------------------------------------------


@dataclass
class Sample:
    wall_s: float  # since the replay began
    engine_s: list[float]
    busy_s: list[float]
    queued: list[int]  # running + waiting
    finished: list[int]
    counters: dict[str, float] | None = None  # the real engine's own (VLLM_COUNTERS), the fleet's totals


@dataclass
class Sampler:
    fleet: Fleet
    interval_s: float
    samples: list[Sample] = field(default_factory=list)
    first: asyncio.Event = field(default_factory=asyncio.Event)  # the first sample was taken (or failed)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def take(self, http: aiohttp.ClientSession, t0: float) -> None:
        self.samples.append(await self.fleet.read(http, time.perf_counter() - t0))

    async def run(self, t0: float) -> None:
        async with aiohttp.ClientSession() as http:
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError, KeyError, ValueError):
                    try:
                        await self.take(http, t0)
                    finally:
                        self.first.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.interval_s)
            with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError, KeyError, ValueError):
                await self.take(http, t0)  # the final counters

    def stop(self) -> None:
        self._stop.set()


def fleet_figures(samples: list[Sample], window_end_wall_s: float) -> dict[str, Any]:
    """Load and busy figures from the emulators' counters: requests each replica finished (from the
    first sample, taken as the replay starts, to the last); GPU busy share and in-flight spread
    while arrivals lasted (first sample to the last one before `window_end_wall_s`)."""
    if len(samples) < 2:
        return {"gpu_busy": math.nan, "load_cv": math.nan, "inflight_cv": math.nan, "finished": []}
    window = [s for s in samples if s.wall_s <= window_end_wall_s] or samples[:2]
    if len(window) < 2:
        window = samples[:2]
    first, last = window[0], window[-1]
    busy = [
        (b1 - b0) / (e1 - e0) if e1 > e0 else 0.0
        for b0, b1, e0, e1 in zip(first.busy_s, last.busy_s, first.engine_s, last.engine_s, strict=True)
    ]
    # requests each replica finished from the replay's start (not the routers' readiness request)
    finished = [b - a for a, b in zip(samples[0].finished, samples[-1].finished, strict=True)]
    loaded = [s for s in window if sum(s.queued) > 0]
    out = {
        "gpu_busy": sum(busy) / len(busy),
        "gpu_busy_per_replica": busy,
        "finished": finished,
        "load_cv": coefficient_of_variation(finished),
        "inflight_cv": statistics.fmean(coefficient_of_variation(s.queued) for s in loaded) if loaded else math.nan,
    }
    if samples[0].counters is not None and samples[-1].counters is not None:
        out |= engine_figures(samples[0].counters, samples[-1].counters)
    return out


def engine_figures(start: dict[str, float], end: dict[str, float]) -> dict[str, float]:
    """A run's figures from vLLM's own counters (VLLM_COUNTERS, fleet totals at its start and end):
    its hit rate (hit ÷ queried prompt tokens), preemptions, and the mean time to first token, time
    waiting and time in prefill of the requests that finished."""
    d = {name: end[name] - start[name] for name in VLLM_COUNTERS}

    def ratio(a: str, b: str) -> float:
        return d[a] / d[b] if d[b] > 0 else math.nan

    return {
        "engine_cache_queries": d["vllm:prefix_cache_queries_total"],
        "engine_cache_hits": d["vllm:prefix_cache_hits_total"],
        "engine_kv_hit_rate": ratio("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
        "preemptions": d["vllm:num_preemptions_total"],
        "engine_ttft_mean_s": ratio("vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count"),
        "engine_queue_mean_s": ratio("vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count"),
        "engine_prefill_mean_s": ratio(
            "vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count"
        ),
    }


# -- one run --------------------------------------------------------------------------------------


def longdoc_spec(args: argparse.Namespace) -> LongDocSpec:
    return LongDocSpec(
        rate=args.doc_rate,
        documents=args.docs,
        doc_tokens=args.doc_tokens_range,
        turns_min=args.doc_turns_range[0],
        turns_max=args.doc_turns_range[1],
        think_s=args.think,
        seed=args.seed,
    )


def sessions_spec(w: Workload, args: argparse.Namespace) -> SessionsSpec:
    """A sessions workload's chats, their text `--prompt-scale` times the default length."""
    assert w.rate is not None
    default, scale = SessionsSpec, args.prompt_scale

    def scaled(span: tuple[int, int]) -> tuple[int, int]:
        return (max(1, round(span[0] * scale)), max(1, round(span[1] * scale)))

    return SessionsSpec(
        rate=w.rate,
        think_s=args.think,
        turns_min=args.turns_range[0],
        turns_max=args.turns_range[1],
        system_tokens=max(1, round(default.system_tokens * scale)),
        first_tokens=scaled(default.first_tokens),
        user_tokens=scaled(default.user_tokens),
        seed=args.seed,
    )


def session_plans(w: Workload, args: argparse.Namespace) -> Iterator[SessionPlan]:
    """The sessions a run of `w` starts (those that arrive within `--duration`)."""
    for plan in generate_sessions(sessions_spec(w, args)):
        if plan.start_s > args.duration:
            return
        yield plan


def workload_options(name: str, args: argparse.Namespace, targets: list[str], c: Contender) -> ReplayOptions:
    w = Workload.parse(name)
    common: dict[str, Any] = {
        "targets": tuple(targets),
        "spread": c.spread,
        "time_scale": args.time_scale,
        "seed": args.seed,
        "key_headers": c.key_headers,
        "session_keys": w.keyed,
        # a random model stops at its end-of-text token at random: every reply max_tokens long instead
        "body_fields": (("ignore_eos", True),) if args.engine == "vllm" else (),
    }
    if w.kind == "sessions":
        return ReplayOptions(workload="sessions", duration_s=args.duration, spec=sessions_spec(w, args), **common)
    if w.kind == "longdoc":
        return ReplayOptions(workload="longdoc", duration_s=args.duration, longdoc=longdoc_spec(args), **common)
    return ReplayOptions(
        workload=name,
        trace=str(Path(args.trace_dir) / TRACES[name]),
        speedup=args.trace_speedup,
        duration_s=args.trace_window / args.trace_speedup,
        **common,
    )


def session_rate(workload: str) -> float | None:
    """`sessions@8`, `sessions-keyless@8` -> 8.0 (new sessions per engine second); None for the others."""
    return Workload.parse(workload).rate


def size_workload(workloads: list[str]) -> str | None:
    """The sessions workload the fleet-size search runs: the busiest one that sends session keys."""
    rated = [w for w in workloads if (p := Workload.parse(w)).kind == "sessions" and p.keyed]
    return max(rated, key=lambda w: session_rate(w) or 0.0) if rated else None


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


def arrivals_s(name: str, args: argparse.Namespace) -> float:
    """Engine seconds over which requests arrive (the window for busy and spread figures)."""
    if Workload.parse(name).kind == "trace":
        return float(args.trace_window / args.trace_speedup)
    return float(args.duration)


def emulator_args(workload: str, args: argparse.Namespace) -> list[str]:
    """What router-emulator is given for a workload's fleet: its engine shape, then `--emulator-arg`."""
    shape = LONGDOC_ENGINE if Workload.parse(workload).kind == "longdoc" else ()
    return [*shape, *args.emulator_arg]


def _last_int(argv: list[str], flag: str, default: int) -> int | None:
    """The value the last `flag` in `argv` sets (`--flag=V` or `--flag V`); None if not an integer."""
    value: str | int = default
    for i, word in enumerate(argv):
        if word.startswith(flag + "="):
            value = word.partition("=")[2]
        elif word == flag and i + 1 < len(argv):
            value = argv[i + 1]
    try:
        return int(value)
    except ValueError:
        return None


def engine_shape(workload: str, args: argparse.Namespace) -> dict[str, Any]:
    """What a workload runs on (for the results): the emulator's arguments, its KV capacity, and for
    longdoc the working set, the tokens of the documents that the sessions arriving within
    `--duration` ask about."""
    longdoc = Workload.parse(workload).kind == "longdoc"
    argv = emulator_args(workload, args)
    blocks = _last_int(argv, "--num-blocks", EngineConfig.num_blocks)
    block_size = _last_int(argv, "--block-size", EngineConfig.block_size)
    kv = blocks * block_size if blocks is not None and block_size is not None else None
    shape: dict[str, Any] = {
        "engine": "70B-class, long context" if longdoc else "emulator defaults",
        "emulator_args": argv,
        "kv_tokens_per_replica": kv,
        "kv_tokens_fleet": kv * args.replicas if kv is not None else None,
    }
    if longdoc:
        spec = longdoc_spec(args)
        asked: set[int] = set()
        for plan in generate_longdoc(spec):
            if plan.start_s > args.duration:
                break
            if plan.document is not None:
                asked.add(plan.document)
        documents = longdoc_documents(spec)
        shape["documents_asked"] = len(asked)
        shape["working_set_tokens"] = sum(len(documents[d]) // 4 for d in asked)  # 4 bytes an emulator token
    return shape


async def vllm_shape(workload: str, args: argparse.Namespace, url: str) -> dict[str, Any]:
    """What a workload runs on with `--engine vllm`, and its working set: the tokens of the
    conversations that start within `--duration` as they end (their messages tokenized by a replica,
    `url`; each reply its max_tokens, which a random model nearly always reaches), the shared
    system prompts counted once."""
    kept = args.vllm_replicas
    kv = kept.kv_blocks * VLLM_BLOCK
    plans = list(session_plans(Workload.parse(workload), args))
    async with aiohttp.ClientSession() as http:

        async def tokens(messages: list[dict[str, str]]) -> int:
            body = {"model": VLLM_MODEL, "messages": messages}
            async with http.post(url + "/tokenize", json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
                r.raise_for_status()
                return int((await r.json())["count"])

        systems = {p.system: await tokens([{"role": "system", "content": p.system}]) for p in plans}
        held = sum(systems.values())
        for p in plans:
            users = [{"role": "user", "content": t.user_text} for t in p.turns]
            held += await tokens([{"role": "system", "content": p.system}, *users]) - systems[p.system]
            held += sum(t.max_tokens + 3 for t in p.turns)  # a reply and its role tags
    return {
        "engine": "vLLM (vllm-cpu), tiny random Llama",
        "engine_args": kept.engine_args(),
        "kv_tokens_per_replica": kv,
        "kv_tokens_fleet": kv * args.replicas,
        "sessions": len(plans),
        "working_set_tokens": held,
        "prompt_scale": args.prompt_scale,
    }


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
        sampler = Sampler(fleet, args.sample_s)
        cpu_fleet0 = fleet_cpu_seconds(fleet.pids)
        cpu_router0 = cpu_seconds(router.pid) if router else 0.0
        t0 = time.perf_counter()
        sampling = asyncio.ensure_future(sampler.run(t0))
        try:
            await sampler.first.wait()  # the counters before the first request: changes are the run's
            result = await Replayer(opts, progress).run()
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
    result["contender"] = c.name
    result["replicas"] = replicas
    result["load_timeline"] = {
        "t_s": [round(s.wall_s * args.time_scale, 2) for s in sampler.samples],
        "queued": [s.queued for s in sampler.samples],
    }
    result.pop("targets", None)
    return result


# -- the whole benchmark --------------------------------------------------------------------------

FIGURES: tuple[tuple[str, Callable[[dict[str, Any]], float]], ...] = (  # (figure, how to get it from a run)
    ("kv_hit_rate", lambda r: r["kv_hit_rate"]),
    ("multi_turn_mean_s", lambda r: r["e2e_later_turns_s"].get("mean", math.nan)),
    ("multi_turn_p99_s", lambda r: r["e2e_later_turns_s"].get("p99", math.nan)),
    ("ttft_p99_s", lambda r: r["ttft_s"].get("p99", math.nan)),
    ("ttft_later_p99_s", lambda r: r.get("ttft_later_turns_s", {}).get("p99", math.nan)),
    ("ttft_later_p50_s", lambda r: r.get("ttft_later_turns_s", {}).get("p50", math.nan)),
    ("engine_kv_hit_rate", lambda r: r.get("engine_kv_hit_rate", math.nan)),  # vLLM's own counters
    ("preemptions", lambda r: r.get("preemptions", math.nan)),
    ("load_cv", lambda r: r["load_cv"]),
    ("inflight_cv", lambda r: r["inflight_cv"]),
    ("jump_rate", lambda r: r["jump_rate"]),
    ("gpu_busy", lambda r: r["gpu_busy"]),
    ("requests", lambda r: r["requests"]),
    ("client_cpu_share", lambda r: r["client_cpu_share"]),
    ("emulator_cpu_share", lambda r: r["emulator_cpu_share"]),
    ("router_cpu_share", lambda r: r["router_cpu_share"] if r["router_cpu_share"] is not None else math.nan),
    # router-serve only: the share of its answers whose cached tokens it predicted to the token, by source
    ("exact_predicted_events", lambda r: r.get("exact_predicted_events", math.nan)),
    ("exact_predicted_model", lambda r: r.get("exact_predicted_model", math.nan)),
    ("predicted_answers_events", lambda r: r.get("predicted_answers_events", math.nan)),
    ("predicted_answers_model", lambda r: r.get("predicted_answers_model", math.nan)),
)


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over a contender's rounds; failed requests summed over them. A
    contender that could not run at all is {"error": why}."""
    done = [r for r in runs if "error" not in r]
    if not done:
        return {"error": runs[0]["error"] if runs else "not run", "rounds": 0}
    out: dict[str, Any] = {}
    for key, get in FIGURES:
        values = [float(get(r)) for r in done]
        values = [v for v in values if not math.isnan(v)]
        out[key] = statistics.median(values) if values else math.nan
    out["failed"] = sum(r["requests"] - r["ok"] for r in done)
    out["sessions_cut"] = sum(r.get("sessions_cut", 0) for r in done)
    out["rounds"] = len(done)
    if len(done) < len(runs):
        out["error"] = next(r["error"] for r in runs if "error" in r)
    return out


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
            "kv_events": "ZMQ, with a replay socket; render endpoints on (--enable-scale-out)",
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


def make_tables(result: dict[str, Any]) -> None:
    result["tables"] = {
        w: {name: summarize_runs(rs) for name, rs in by.items() if rs} for w, by in result["runs"].items()
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
                    f"{prefix} round {rnd + 1}: {run['requests']} requests, {run['requests'] - run['ok']} failed, "
                    f"KV hit {run['kv_hit_rate']:.1%}, multi-turn P99 {p99:.3f} s, "
                    f"GPU busy {run['gpu_busy']:.0%}, client CPU {run['client_cpu_share']:.0%}"
                    + (f", exact predicted {_exact(run)}" if "predictions" in run else "")
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


# -- output ---------------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.1%}"


def _num(x: float, digits: int = 3) -> str:
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


def _exact(f: dict[str, Any]) -> str:
    """router-serve's answers predicted to the token, by source: `99.4% of 160 / none`; n/a for the others."""
    cells = []
    for source in PREDICTION_SOURCES:
        answers = f.get(f"predicted_answers_{source}", math.nan)
        if math.isnan(answers):
            return "n/a"
        cells.append(f"{_pct(f[f'exact_predicted_{source}'])} of {answers:,.0f}" if answers else "none")
    return " / ".join(cells)


Column = tuple[str, Callable[[dict[str, Any]], str]]  # (title, the cell of a contender's figures)
COLUMNS: tuple[Column, ...] = (
    ("requests", lambda f: f"{f['requests']:,.0f}"),
    ("failed", lambda f: f"{f['failed']:,.0f}"),
    ("KV hit", lambda f: _pct(f["kv_hit_rate"])),
    ("multi-turn mean (s)", lambda f: _num(f["multi_turn_mean_s"])),
    ("multi-turn P99 (s)", lambda f: _num(f["multi_turn_p99_s"])),
    ("TTFT P99 (s)", lambda f: _num(f["ttft_p99_s"])),
    ("later-turn TTFT P99 (s)", lambda f: _num(f["ttft_later_p99_s"])),
    ("load CV", lambda f: _num(f["load_cv"])),
    ("in-flight CV", lambda f: _num(f["inflight_cv"])),
    ("jump rate", lambda f: _pct(f["jump_rate"])),
    ("GPU busy", lambda f: _pct(f["gpu_busy"])),
    ("exact predicted (events / model)", _exact),
)
VLLM_COLUMNS: tuple[Column, ...] = (
    ("requests", lambda f: f"{f['requests']:,.0f}"),
    ("failed", lambda f: f"{f['failed']:,.0f}"),
    ("KV hit (engine)", lambda f: _pct(f.get("engine_kv_hit_rate", math.nan))),
    ("KV hit (client)", lambda f: _pct(f["kv_hit_rate"])),
    ("later-turn TTFT P50 (s)", lambda f: _num(f.get("ttft_later_p50_s", math.nan))),
    ("later-turn TTFT P99 (s)", lambda f: _num(f["ttft_later_p99_s"])),
    ("TTFT P99 (s)", lambda f: _num(f["ttft_p99_s"])),
    ("multi-turn mean (s)", lambda f: _num(f["multi_turn_mean_s"])),
    ("multi-turn P99 (s)", lambda f: _num(f["multi_turn_p99_s"])),
    ("load CV", lambda f: _num(f["load_cv"])),
    ("jump rate", lambda f: _pct(f["jump_rate"])),
    ("preempted", lambda f: _num(f.get("preemptions", math.nan), 0)),
    ("busy", lambda f: _pct(f["gpu_busy"])),
    ("exact predicted (events / model)", _exact),
)


def render_markdown(result: dict[str, Any]) -> str:
    labels = result["contenders"]
    sizes = result.get("replicas_needed") or {}
    engine = result.get("engine", "emulator")
    settings = result.get("engine_settings") or {}
    if engine == "llama-server":
        what = f"llama-server replicas ({settings['slots']} slots each, real time)"
        notes = " Load CV: of generated tokens per replica; GPU busy: share of slot time busy."
    elif engine == "vllm":
        what = (
            f"vLLM replicas ({settings['max_num_seqs']} sequences and KV for "
            f"{settings['kv_blocks'] * settings['block_size']:,} tokens each, real time)"
        )
        notes = (
            " KV hit (engine): the replicas' own prefix-cache hits ÷ queries, in tokens, over the run;"
            " (client): `cached_tokens` ÷ prompt tokens in the answers. Load CV: of requests each replica"
            " finished; preempted: requests vLLM preempted for KV room; busy: share of sampled time a"
            " replica ran a request."
        )
    else:
        what, notes = f"emulated replicas, time scale {result['time_scale']:g}", ""
    notes += (
        " Exact predicted: router-serve's answers whose cached tokens it predicted to the token, of those"
        " it priced by the engine's KV events / by its own model (`router_prefix_prediction_error_tokens`)."
    )
    lines = [
        f"{result['replicas']} {what}, "
        f"median of {result['rounds']} round(s) (failed requests: summed); latencies in "
        + ("engine seconds." if engine == "emulator" else "seconds.")
        + notes
        + ("" if result.get("complete", True) else " **Interrupted: only the runs that finished.**"),
        "",
    ]
    columns = VLLM_COLUMNS if engine == "vllm" else COLUMNS
    for workload, table in result["tables"].items():
        lines += [f"**{workload}**", ""]
        shape = result.get("engine_shapes", {}).get(workload)
        if shape:
            lines += [_shape_line(shape, result["replicas"]), ""]
        head = "| contender | " + " | ".join(title for title, _ in columns) + " |"
        rule = "|---|" + "---:|" * len(columns)
        searched = workload == sizes.get("workload")
        if searched:
            head += f" replicas for P99 ≤ {sizes['target_p99_s']:.2f} s |"
            rule += "---:|"
        lines += [head, rule]
        ran = {name: f for name, f in table.items() if "requests" in f}
        for name, f in table.items():
            if name not in ran:
                lines.append(f"| {labels[name]} | did not run: {f['error']} |")
                continue
            row = f"| {labels[name]} | " + " | ".join(cell(f) for _, cell in columns) + " |"
            if searched:
                row += f" {_needed(sizes['contenders'].get(name), result['replicas'])} |"
            lines.append(row)
        lines.append("")
        if not ran:
            continue
        cpu = [
            f"{labels[n]} {f['router_cpu_share']:.0%}" for n, f in ran.items() if not math.isnan(f["router_cpu_share"])
        ]
        fleet = {"llama-server": "llama-servers ", "vllm": "vLLM fleet (every process) "}.get(engine, "emulated fleet ")
        lines.append(
            "CPU, share of one core: client "
            + f"{max(f['client_cpu_share'] for f in ran.values()):.0%} at most, "
            + fleet
            + f"{max(f['emulator_cpu_share'] for f in ran.values()):.0%} at most; routers: "
            + (", ".join(cpu) or "none")
            + "."
        )
        lines.append("")
        lines += _goals(ran, labels, vllm=engine == "vllm")
    return "\n".join(lines)


def _shape_line(shape: dict[str, Any], replicas: int) -> str:
    """Engine: what the replicas of a workload are, and its working set against their KV."""
    argv = " ".join(shape.get("emulator_args") or shape.get("engine_args") or ())
    line = f"Engine: {shape['engine']}" + (f" (`{argv}`)" if argv else "")
    kv = shape.get("kv_tokens_per_replica")
    if kv:
        line += f"; KV for {kv:,} tokens a replica, {kv * replicas:,} in the fleet"
        work = shape.get("working_set_tokens")
        if work is not None:
            held = (
                f"the {shape['documents_asked']} documents asked about hold {work:,} tokens"
                if "documents_asked" in shape
                else f"the {shape['sessions']} conversations of a run end holding about {work:,} tokens "
                "(shared system prompts once)"
            )
            line += f"; {held}, {work / kv:.2f}× one replica's KV and {work / (kv * replicas):.2f}× the fleet's"
    return line + "."


def _needed(found: dict[str, Any] | None, replicas: int) -> str:
    if found is None:
        return ""
    if found.get("error"):
        return "n/a"
    if found["needed"] is None:
        return f"> {replicas}"
    if found["needed"] == found.get("lowest_probed"):
        return f"≤ {found['needed']}"  # the search goes no lower than half the fleet
    return str(found["needed"])


def _goals(table: dict[str, dict[str, Any]], labels: dict[str, str], vllm: bool = False) -> list[str]:
    """`full` (router-serve as shipped) against each other contender: ratios of the medians above
    (on vLLM: of the engines' hit rates, and of later turns' TTFT P50 and P99 too)."""
    full = table.get("full")
    if not full:
        return []
    hit = "engine_kv_hit_rate" if vllm else "kv_hit_rate"

    def ratio(a: float, b: float) -> str:
        return _num(a / b, 2) + "×" if b > 0 else "n/a"

    out = [
        "| as shipped (full) against | KV hit, full ÷ other | multi-turn mean, full vs other "
        "| multi-turn P99, other ÷ full | load CV, full / other |"
        + (" later-turn TTFT P50, other ÷ full | later-turn TTFT P99, other ÷ full |" if vllm else ""),
        "|---|---:|---:|---:|---:|" + ("---:|---:|" if vllm else ""),
    ]
    for name, f in table.items():
        if name == "full":
            continue
        mean = full["multi_turn_mean_s"] / f["multi_turn_mean_s"] - 1 if f["multi_turn_mean_s"] > 0 else math.nan
        row = (
            f"| {labels[name]} | {ratio(full[hit], f[hit])} | {'n/a' if math.isnan(mean) else f'{mean:+.0%}'} "
            f"| {ratio(f['multi_turn_p99_s'], full['multi_turn_p99_s'])} "
            f"| {_num(full['load_cv'])} / {_num(f['load_cv'])} |"
        )
        if vllm:
            row += (
                f" {ratio(f['ttft_later_p50_s'], full['ttft_later_p50_s'])} "
                f"| {ratio(f['ttft_later_p99_s'], full['ttft_later_p99_s'])} |"
            )
        out.append(row)
    return [*out, ""]


def write_plots(result: dict[str, Any], out: Path) -> list[str] | None:
    """The PNG plots written (none when no run finished); None when matplotlib, from the `bench`
    extra, is not installed."""
    try:
        import matplotlib  # noqa: PLC0415 -- optional (the bench extra): None when it is missing

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 -- optional, and only after the Agg backend is chosen
    except ImportError:
        return None
    labels = result["contenders"]
    written: list[str] = []
    tables = {w: {n: f for n, f in t.items() if "requests" in f} for w, t in result["tables"].items()}
    tables = {w: t for w, t in tables.items() if t}
    if not tables:
        return written
    hit = ("engine_kv_hit_rate", "KV hit rate, engines' counters (%)") if result.get("engine") == "vllm" else None
    fig, axes = plt.subplots(len(tables), 2, figsize=(12, 3.2 * len(tables)), squeeze=False)
    for row, (workload, table) in enumerate(tables.items()):
        names = list(table)
        colours = [
            "#c0392b" if n == "full" else "#7f8c8d" if n in ("round-robin", "oracle") else "#2980b9" for n in names
        ]
        for col, (key, title, scale) in enumerate(
            (
                (*(hit or ("kv_hit_rate", "KV hit rate (%)")), 100.0),
                ("multi_turn_p99_s", "multi-turn P99 (engine s)", 1.0),
            )
        ):
            ax = axes[row][col]
            ax.barh([labels[n] for n in names], [table[n][key] * scale for n in names], color=colours)
            ax.invert_yaxis()
            ax.set_title(f"{workload}: {title}", fontsize=10)
            ax.tick_params(labelsize=8)
            if col == 1:
                ax.set_yticklabels([])
    fig.tight_layout()
    path = out / "fleet-hit-p99.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path.name)

    busiest = size_workload(list(result["runs"]))
    runs = result["runs"][busiest] if busiest else next(iter(result["runs"].values()))
    # the first round that ran, of every contender with a load timeline
    timelines = {
        n: next((r["load_timeline"] for r in rs if r.get("load_timeline", {}).get("queued")), None)
        for n, rs in runs.items()
    }
    shown = {n: tl for n, tl in timelines.items() if tl is not None}
    if not shown:
        return written
    fig, axes = plt.subplots(len(shown), 1, figsize=(12, 1.6 * len(shown)), squeeze=False, sharex=True)
    peak = max(max(max(q) for q in tl["queued"]) for tl in shown.values()) or 1
    for ax, (name, tl) in zip((a[0] for a in axes), shown.items(), strict=True):
        grid = list(map(list, zip(*tl["queued"], strict=True)))  # replicas x time
        t = tl["t_s"]
        ax.imshow(
            grid,
            aspect="auto",
            interpolation="nearest",
            cmap="magma",
            vmin=0,
            vmax=peak,
            extent=(t[0], t[-1], len(grid), 0),
        )
        ax.set_ylabel(labels[name], rotation=0, ha="right", va="center", fontsize=8)
        ax.set_yticks([])
    axes[-1][0].set_xlabel("engine seconds (requests running + waiting per replica, one row each)")
    fig.tight_layout()
    path = out / "fleet-load.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path.name)
    return written


# -- command line ---------------------------------------------------------------------------------


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
        help=f"which to run, in order (default: those installed that run with --engine, of {', '.join(CONTENDERS)})",
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
        try:
            find_binary()
        except NotBuilt as exc:
            raise ValueError(str(exc)) from None
    elif args.llama_arg:
        raise ValueError("--llama-arg is for --engine llama-server")
    if args.engine == "vllm":
        if not (1 <= args.max_num_seqs <= 256 and 17 <= args.kv_blocks <= 1_000_000):
            raise ValueError("need 1 <= --max-num-seqs <= 256 and 17 <= --kv-blocks (a 512-token context)")
        try:
            find_vllm()
        except VllmNotBuilt as exc:
            raise ValueError(str(exc)) from None
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
    for name in ("think", "duration", "doc_rate", "trace_window", "trace_speedup", "time_scale", "sample_s"):
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
        else [n for n, c in CONTENDERS.items() if available(n) and args.engine in c.engines]
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
    broken = [f for t in result["tables"].values() for f in t.values() if f.get("error") or f.get("failed", 0) > 0]
    return 1 if broken else 0
