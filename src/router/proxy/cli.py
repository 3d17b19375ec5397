"""Command line of `router-serve`: load and validate config, start the router (and a demo fleet)."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.metadata
import logging
import socket
import sys
from typing import Any, NoReturn

from aiohttp import web

from router._runtime import run, settle, until_stopped
from router.config import FIELDS, ConfigError, ReplicaSpec, RouterConfig, from_environment
from router.emulator.server import Fleet as EmulatorFleet
from router.emulator.server import Replica, ReplicaOptions
from router.node import Node
from router.proxy.app import admin_app, build_app
from router.proxy.workers import (
    HANDOVER_S,
    CannotListen,
    Shutdown,
    WorkerFailed,
    listen,
    runner_for,
    serve_workers,
    stop_serving,
)
from router.ring import IMPLEMENTATION as RING_IMPLEMENTATION
from router.shm.table import SlotTable
from router.state import StateError, state_file

HELP = {
    "host": "address to bind (default 127.0.0.1)",
    "port": "port to listen on (default 8080)",
    "policy": "ttft (default: placement by predicted time to first token, from a prefix index of what each "
    "replica holds and its prefill queue), affinity (sticky sessions on the ring), consistent_hash, round_robin "
    "or least_load",
    "vnodes": "virtual nodes per replica (default 128)",
    "hash_seed": "ring hash seed (default 0); changing it remaps every session",
    "bounded_load_c": "bounded-load factor c >= 1 (default 1.25)",
    "bounded_load_floor": "a replica with fewer requests in flight than this (and than its capacity, where known) "
    "is never passed over for load (default 8)",
    "replica_capacity": "comma-separated REPLICA_ID=N (or *=N for the rest): requests a replica runs at once, "
    "where its engine does not report it; load caps and the floor scale with it (default: as reported, else unknown)",
    "max_queued": "requests held at most while every replica for their model is full (its engine's queue at "
    "full_waiting, or its KV cache at full_kv_usage); past it, or past queue_timeout_s, a 429 with Retry-After "
    "(default 0: off, everything is forwarded)",
    "queue_timeout_s": "the longest a held request waits for room before its 429 (default 10)",
    "full_waiting": "a replica is full once its engine's queue (probed, plus what was sent since) reaches this "
    "(default 8)",
    "full_kv_usage": "or once its KV cache usage reaches this share (default 0.95)",
    "replica_models": "comma-separated REPLICA_ID=MODEL (or *=MODEL for the rest), one model each: the models "
    "(and adapters) a replica serves, where its engine's /v1/models does not say (default: as listed there)",
    "capacity_caps": "bounded-load caps and the floor respect replicas' capacities: a full replica spills while "
    "another has a free slot (default on; off: capacity-blind, as before)",
    "prefix_block_bytes": "ttft: bytes of prompt per block of the prefix index, 16..240 (default 64, about 16 tokens)",
    "kv_capacity_tokens": "ttft: comma-separated REPLICA_ID=TOKENS (or *=TOKENS for the rest): the KV cache's size "
    "where the engine does not report it (vLLM and SGLang do; default 262144)",
    "kv_events": "read the KV-cache events of every replica that publishes them (vLLM with --kv-events-config, "
    "found through its /kv_event_sources, or named in kv_event_endpoints) and price it by what its engine "
    "holds; off: the router's own model of what it sent everywhere (default on)",
    "kv_event_endpoints": "comma-separated REPLICA_ID=ENDPOINT or REPLICA_ID=ENDPOINT;REPLAY_ENDPOINT (ZMQ, "
    "tcp://HOST:PORT): where a replica publishes its KV-cache events, where its /kv_event_sources does not say",
    "tokenizer_dirs": "comma-separated MODEL=DIR (or *=DIR): a model's folder with tokenizer.json and its chat "
    "template, to cut requests into the engine's tokens here (needs the tokenizers package); without it, "
    "the engine's /v1/*/render endpoint tokenizes them",
    "token_check_share": "share of the requests tokenized here whose tokens are checked against the engine's "
    "render endpoint (default 0.01; every model's first request is checked)",
    "kv_tier_tokens_per_s": "tokens a second a second KV tier (vLLM --kv-offloading-size, SGLang HiCache) "
    "loads back: blocks held there are priced as that transfer (default 200000)",
    "prefill_tokens_per_s": "ttft: a replica's prefill speed until its answers show it (default 10000)",
    "ttft_decode_s": "ttft: seconds of time to first token each request in flight on a replica adds (default 0.002)",
    "ttft_interference": "ttft: a prefill's time counts once more, times this, for each request in flight on the "
    "replica (each of them is delayed by it; default 1, 0 turns it off)",
    "ttft_spread_tokens": "ttft: a new conversation costs this many more tokens of prefill on a replica whose "
    "recent traffic is past the fleet's mean, times (recent - mean) / (mean + 4) and the share of the prompt it "
    "would compute (its later turns will load it; default 2000)",
    "ttft_gate_c": "ttft: never a replica with more in flight than max(ceil(c x (in flight + 1) / replicas), "
    "ceil((in flight + 1) / replicas) + bounded_load_floor), c >= 1 (default 1.5)",
    "ttft_stay_share": "ttft: the replica holding a conversation (a keyed session's, or one holding half a keyless "
    "prompt) keeps it unless another costs less than 1 / (1 + this) of its cost (default 1: half; 0 turns it off)",
    "ttft_move_weight": "ttft: a keyed session's replica, not past the gate, keeps it unless moving saves more than "
    "ttft_stay_share x the other's cost plus this times the move's price to the fleet: the history recomputed "
    "there, once for itself and once for each request in flight or queued there, and the context of others it "
    "evicts there (default 1; 0: the stay share alone)",
    "ttft_move_cooldown_s": "ttft: a session moved by cost makes no other such move for this many seconds, and none "
    "back to the replica it left while its move is remembered (sticky_ttl_s) (default 60)",
    "ttft_tie_s": "ttft: costs within this many seconds of the cheapest count as equal: the least full of them, "
    "then the ring, breaks the tie (default 0.001)",
    "ttft_tie_share": "ttft: ... or within this share of the cheapest cost (default 0.1)",
    "adapter_load_s": "ttft: seconds added to the cost of a replica without a requested LoRA adapter that other "
    "replicas have loaded (default 0.25; affinity prefers those replicas under their load cap)",
    "ttft_kv_wait": "ttft: a replica whose requests in flight (prompts and expected replies) fill its KV cache "
    "costs the wait for room: the tokens past its capacity, drained a capacity's worth every reply time "
    "(default on)",
    "ttft_queue_gain": "ttft: a streamed answer's first token later (or sooner) than the model predicted moves "
    "the predicted drain of its replica's queue by this share of the lag (default 0.5; 0 turns it off)",
    "sticky_ttl_s": "seconds a session sticks to the replica that served it (default 600)",
    "sticky_max_sessions": "sessions remembered at most (default 200000)",
    "key_headers": "comma-separated headers carrying a session key, tried in order",
    "key_body_fields": "comma-separated body fields (dotted paths) carrying a session key",
    "prefix_chars": "characters of the first message in the prefix fingerprint (default 256)",
    "max_key_bytes": "longer keys are hashed (default 256)",
    "replica_header": "response header naming the replica (default X-Router-Replica; '' turns it off)",
    "max_attempts": "replicas tried per request before giving up (default 3)",
    "connect_timeout_s": "upstream connect time-out (default 2)",
    "first_byte_timeout_s": "time-out until the replica's first body bytes (default 60)",
    "idle_timeout_s": "longest silence inside a stream (default 60)",
    "total_timeout_s": "time-out of a whole request (default 600)",
    "client_timeout_s": "longest pause while a client sends its request body, else 408 (default 60)",
    "keepalive_timeout_s": "idle client connections close after this, as do those that have not sent a "
    "whole request's headers within it (default 75)",
    "max_body_bytes": "largest request body (default 32 MiB)",
    "max_header_bytes": "largest request header block (default 16 KiB)",
    "upstream_connections": "keep-alive connections per replica (default 256)",
    "inject_usage": "ask streams for usage on the client's behalf, then hide it (default on)",
    "resume_streams": "continue a stream a replica broke mid-way on another replica, in the same client stream "
    "(default on)",
    "resume_buffer_bytes": "per stream, the most of it kept to continue from; a longer stream is not resumed "
    "(default 1 MiB)",
    "front": "serve the proxied endpoints on the router's own HTTP/1.1 front (httptools) rather than aiohttp's "
    "server, which keeps every other path (default on)",
    "health_checks": "probe replicas and route around sick ones (default on)",
    "agents": "comma-separated REPLICA_ID=URL of router-agents whose GPU figures join the health score",
    "probe_interval_s": "seconds between health probes (default 2)",
    "probe_timeout_s": "time-out of one probe (default 1)",
    "remove_below": "a replica leaves routing after remove_after scores below this (default 0.5)",
    "return_above": "a removed replica returns after return_after scores above this (default 0.7)",
    "remove_after": "low scores in a row before removal (default 3)",
    "return_after": "high scores in a row before return (default 3)",
    "recovery_ramp_s": "seconds a returning or new replica's weight takes to ramp to full, in ten steps (default 30)",
    "flap_backoff": "a replica removed again while recovering needs twice the good scores to return, up to "
    "this many times return_after (default 8; 1 turns it off)",
    "score_weights": "comma-separated NAME=VALUE overrides of the health score's weights and thresholds "
    "(e.g. latency=0.5,queue_from=16; see docs/router.md)",
    "load_queue_weight": "bounded load counts in-flight requests plus this times the engine's waiting queue "
    "(default 0: in-flight only)",
    "rebalance": "move a persistently hot replica's hottest vnodes to cool replicas (default on)",
    "rebalance_threshold": "a replica is hot above (1 + this) x the mean load (default 0.5)",
    "rebalance_window_s": "seconds a replica stays hot before its vnodes move (default 30)",
    "rebalance_cooldown_s": "seconds both sides of a move rest before the next (default 60)",
    "rebalance_max_vnodes": "vnodes moved per rebalancing cycle at most (default 4)",
    "scale_target_load": "requests in flight plus waiting per replica that the recommended replica count "
    "aims for (default 16)",
    "warmup": "replay sessions' latest prompts (prefill only) on a replica before moving them there (default on)",
    "warmup_sessions": "sessions warmed per move at most, most recent first (default 32)",
    "warmup_concurrency": "warm-up requests in flight to one replica at once (default 4)",
    "warmup_timeout_s": "seconds a move waits for its warm-up before switching anyway (default 10)",
    "prompt_store_bytes": "memory for the latest prompt of each session, kept for warm-up (default 64 MiB)",
    "drain_timeout_s": "seconds a drain that removes the replica waits for its in-flight requests (default 120)",
    "discovery": "find replicas: file:PATH (one [NAME=]URL per line, watched), dns:NAME:PORT (A/AAAA "
    "records, e.g. a headless Kubernetes service) or srv:NAME (SRV records)",
    "discovery_interval_s": "seconds between discovery lookups (default 5)",
    "state": "where routing state (membership changes, drains, vnode overrides, sessions) lives: file (default, "
    "under $XDG_STATE_HOME/kv-affinity-router; --check-config prints the path), file:DIRECTORY, "
    "redis://HOST:PORT/DB (shared by several routers), or none (the default with --demo)",
    "state_namespace": "routers sharing one Redis and one namespace share their state (default: default)",
    "workers": "proxy processes sharing the port (default 1); above 1 a control process probes and "
    "publishes the replica table to them through shared memory",
    "shm_name": "shared-memory segment name for workers and colocated router-agents (default: kvar-<pid> "
    "with --workers above 1; with one worker, set it to let router-agent --shm write GPU figures)",
    "shm_slots": "replicas the shared-memory table holds at most (default 1024)",
    "console": "serve the operator console at /console (default on; its data needs the admin token when one is set)",
    "console_interval_s": "seconds between the console's samples of the metrics (default 2)",
    "console_history_s": "seconds of history the console keeps and shows (default 900)",
    "admin_token": "bearer token of the /admin API and the console's data (default: API off, console open)",
    "admin_host": "address the admin API, console and /metrics bind when admin_port is set (default 127.0.0.1)",
    "admin_port": "serve the admin API, console and /metrics on this port instead of the proxy's "
    "(default 0: on the proxy's port)",
    "log_requests": "one JSON log line per request (default off)",
    "demo": "start N emulated replicas in-process and route to them too; a demo saves no routing state unless "
    "--state is given",
}


# --help in the order a newcomer needs it: starting, then one group per part of the router
GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "start here",
        "where to listen, what to route to, and how",
        ("host", "port", "policy", "workers", "state", "admin_token", "admin_port", "console", "log_requests"),
    ),
    (
        "replicas",
        "how they are found and what each serves",
        ("discovery", "discovery_interval_s", "replica_models", "replica_capacity", "agents", "replica_header"),
    ),
    (
        "sessions and routing keys",
        "what keeps a conversation on the replica holding its context",
        ("key_headers", "key_body_fields", "sticky_ttl_s", "sticky_max_sessions", "prefix_chars", "max_key_bytes"),
    ),
    (
        "placement (ttft)",
        "the default policy: each request where its time to first token is predicted least",
        (
            "kv_events", "kv_event_endpoints", "tokenizer_dirs", "token_check_share", "prefix_block_bytes",
            "kv_capacity_tokens", "kv_tier_tokens_per_s", "prefill_tokens_per_s", "ttft_decode_s",
            "ttft_interference", "ttft_spread_tokens", "ttft_gate_c", "ttft_stay_share", "ttft_move_weight",
            "ttft_move_cooldown_s", "ttft_tie_s", "ttft_tie_share", "adapter_load_s", "ttft_kv_wait",
            "ttft_queue_gain",
        ),
    ),
    (
        "the ring and load",
        "affinity and consistent_hash, and the load caps every policy keeps",
        ("vnodes", "hash_seed", "bounded_load_c", "bounded_load_floor", "capacity_caps", "load_queue_weight"),
    ),
    (
        "admission",
        "holding requests while every replica is full",
        ("max_queued", "queue_timeout_s", "full_waiting", "full_kv_usage"),
    ),
    (
        "health",
        "probing replicas and routing around sick ones",
        (
            "health_checks", "probe_interval_s", "probe_timeout_s", "remove_below", "return_above",
            "remove_after", "return_after", "recovery_ramp_s", "flap_backoff", "score_weights",
        ),
    ),
    (
        "balance, warm-up and drains",
        "moving load off hot replicas without a session storm",
        (
            "rebalance", "rebalance_threshold", "rebalance_window_s", "rebalance_cooldown_s",
            "rebalance_max_vnodes", "scale_target_load", "warmup", "warmup_sessions", "warmup_concurrency",
            "warmup_timeout_s", "prompt_store_bytes", "drain_timeout_s",
        ),
    ),
    (
        "proxying: time-outs, limits, streams",
        "",
        (
            "max_attempts", "connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s", "total_timeout_s",
            "client_timeout_s", "keepalive_timeout_s", "max_body_bytes", "max_header_bytes",
            "upstream_connections", "inject_usage", "resume_streams", "resume_buffer_bytes", "front",
        ),
    ),
    (
        "state, processes, console",
        "",
        (
            "state_namespace", "shm_name", "shm_slots", "console_interval_s", "console_history_s", "admin_host",
        ),
    ),
)  # fmt: skip


class Parser(argparse.ArgumentParser):
    """Names the closest flags when one is misspelled."""

    def error(self, message: str) -> NoReturn:
        unknown = [word for word in message.split() if word.startswith("--")]
        if message.startswith("unrecognized arguments") and unknown:
            flags = [flag for action in self._actions for flag in action.option_strings if flag.startswith("--")]
            hints = []
            for word in unknown:
                close = difflib.get_close_matches(word.partition("=")[0], flags, n=2, cutoff=0.7)
                if close:
                    hints.append(f"{word}: did you mean {' or '.join(close)}?")
            if hints:
                message += " (" + "; ".join(hints) + ")"
        super().error(message)


def _version() -> str:
    try:
        return importlib.metadata.version("kv-affinity-router")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="router-serve",
        usage="router-serve [--demo N | --replica [NAME=]URL ... | --discovery SOURCE] [--config FILE] "
        "[--check-config] [OPTIONS]",
        description=(
            "KV-cache-affinity router for OpenAI-compatible inference replicas. Every setting comes from "
            "defaults < --config TOML < ROUTER_<SETTING> environment variables < these flags. "
            "Try it without GPUs: router-serve --demo 4"
        ),
        epilog="Guide and reference: docs/router.md. The settings' names in TOML are the flags' with underscores.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    first = p.add_argument_group("start here", "where to listen, what to route to, and how")
    first.add_argument("--demo", metavar="N", help=HELP["demo"])
    first.add_argument(
        "--replica",
        dest="replicas",
        action="append",
        metavar="[NAME=]URL",
        help="a replica's base URL, e.g. http://10.0.0.5:8000; repeatable",
    )
    first.add_argument("--config", metavar="FILE", help="TOML file of settings (the names below, with underscores)")
    first.add_argument(
        "--check-config",
        action="store_true",
        help="validate the settings (file, environment and flags together), print what they amount to and where "
        "state is kept, and exit: 0 when valid, 2 with the problem otherwise",
    )
    for title, about, names in GROUPS:
        group = first if title == "start here" else p.add_argument_group(title, about or None)
        for name in names:
            flag = "--" + name.replace("_", "-")
            if FIELDS[name].type == "bool":
                group.add_argument(
                    flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=HELP[name]
                )
            else:  # a string: the config loader converts and validates it, naming the setting on error
                group.add_argument(flag, dest=name, metavar=name.upper(), help=HELP[name])
    return p


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in FIELDS}


def summary(config: RouterConfig) -> str:
    """One line of what a configuration amounts to (for --check-config)."""
    replicas = [f"{len(config.replicas)} replica{'' if len(config.replicas) == 1 else 's'}"]
    if config.discovery:
        replicas.append(f"discovered through {config.discovery}")
    if config.demo:
        replicas.append(f"{config.demo} emulated")
    parts = [
        f"listens on {config.host}:{config.port}",
        "compiled core" if RING_IMPLEMENTATION == "compiled" else "pure-Python core (ROUTER_NO_EXTENSIONS=1)",
        f"policy {config.policy}",
        " + ".join(replicas),
        f"{config.workers} worker process{'es' if config.workers > 1 else ''}",
        f"admin on {config.admin_host}:{config.admin_port}" if config.admin_port else "admin on the proxy's port",
        "admin API " + ("on (token set)" if config.admin_token else "off (no token)"),
    ]
    file = state_file(config)
    if file is not None:
        parts.append(f"routing state saved to {file.path}")
    elif config.state == "none":
        parts.append("routing state not saved" + (" (a demo's default; --state file saves it)" if config.demo else ""))
    else:
        parts.append(f"routing state shared through {config.state} (namespace {config.state_namespace})")
    return ", ".join(parts)


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


async def serve(config: RouterConfig) -> None:
    demo_fleet = None
    if config.demo:
        ports = _free_ports(config.demo)
        demo_fleet = EmulatorFleet([Replica(ReplicaOptions(replica_id=f"emu-{p}", port=p)) for p in ports])
        await demo_fleet.start()
        specs = tuple(ReplicaSpec(f"emu-{p}", f"http://127.0.0.1:{p}") for p in ports)
        config = RouterConfig(**{**config.__dict__, "replicas": config.replicas + specs})
    base = f"http://{config.host}:{config.port}"
    admin = f"http://{config.admin_host}:{config.admin_port}" if config.admin_port else base
    banner = f"router-serve listening on {base} ({config.policy}, {len(config.replicas)} replicas)"
    if config.admin_port:
        banner += f"\nadmin API, console and metrics on {admin}"
    console = f"{admin}/console" + (" (asks for the admin token)" if config.admin_token else "")
    if demo_fleet is not None:
        banner += f"""
demo: {config.demo} emulated replicas at {", ".join(r.url for r in demo_fleet.replicas)}
  send a request:  curl -s {base}/v1/chat/completions -H 'X-Session-ID: demo-1' \\
                     -d '{{"model": "emulated-llm", "max_tokens": 32,
                          "messages": [{{"role": "user", "content": "Hello!"}}]}}'
  metrics:         {admin}/metrics        health: {base}/health
  console:         {console if config.console else "off (--console turns it on)"}
  measure it:      router-bench replay --target {base} --duration 60   (a minute; Ctrl-C keeps what it measured)
  stop:            Ctrl-C"""
    elif config.console:
        banner += f"\nconsole: {console}"
    try:
        if config.workers > 1:
            await serve_workers(config, banner)
        else:
            await _serve_alone(config, banner)
    finally:
        if demo_fleet is not None:
            await demo_fleet.stop()


async def _serve_alone(config: RouterConfig, banner: str) -> None:
    table = SlotTable.create(config.shm_name, config.shm_slots) if config.shm_name else None
    shutdown: Shutdown | None = None
    try:
        node = Node(config, table=table)
        node.publish()
        runner = runner_for(build_app(node), config)
        await runner.setup()
        admin: web.AppRunner | None = None
        try:
            await listen(runner, config.host, config.port)
            if config.admin_port:
                admin = runner_for(admin_app(node), config)
                await admin.setup()
                await listen(admin, config.admin_host, config.admin_port)
            settle()
            print(banner, flush=True)
            print(node.state_line(), flush=True)
            if table is not None:
                print(f"shared memory: {table.name} (router-agent --shm {table.name})", flush=True)
            shutdown = Shutdown(await until_stopped(), node)
        finally:
            try:
                if admin is not None:
                    await admin.cleanup()
            finally:
                drain = await stop_serving(runner, min(HANDOVER_S, config.drain_timeout_s))
                if shutdown is not None:
                    await shutdown.ended(drain)
    finally:
        if table is not None:
            table.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = from_environment(args.config, cli_values(args))
    except ConfigError as exc:
        for line in str(exc).splitlines():  # each mistake on a line of its own
            print(f"router-serve: {line}", file=sys.stderr)
        return 2
    if args.check_config:
        print(f"router-serve: the configuration is valid: {summary(config)}")
        return 0
    if config.log_requests:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        run(serve(config))
    except WorkerFailed as exc:
        print(f"router-serve: {exc}", file=sys.stderr)
        return 1
    except StateError as exc:
        print(
            f"router-serve: cannot use the saved routing state: {exc} (--state none starts without it)", file=sys.stderr
        )
        return 2
    except FileExistsError:
        print(f"router-serve: shared memory {config.shm_name!r} already exists (another router?)", file=sys.stderr)
        return 1
    except CannotListen as exc:
        print(f"router-serve: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"router-serve: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
