"""Command line of `router-emulator`: serve one emulated replica, or a fleet of them, until interrupted."""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from typing import TYPE_CHECKING, Any

from router._runtime import run, until_stopped
from router.emulator.engine import EngineConfig
from router.emulator.kvevents import ENCODINGS, KvEventsOptions
from router.emulator.server import Faults, Fleet, Replica, ReplicaOptions

if TYPE_CHECKING:
    from router.emulator.tracing import RequestTracer

FAULT_NAMES = {
    "hang": ("hang", bool),
    "slow": ("slow", float),
    "error-rate": ("error_rate", float),
    "error-status": ("error_status", int),
    "stall-after": ("stall_after", int),
    "drop-after": ("drop_after", int),
    "end-late": ("end_late", float),
    "crash-after": ("crash_after", float),
    "kv-events-drop": ("kv_events_drop", float),
    "kv-events-drop-next": ("kv_events_drop_next", int),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="router-emulator",
        description=(
            "Serve OpenAI-compatible emulated inference replicas: a paged prefix KV cache and a "
            "continuous-batching scheduler modelled on vLLM, vLLM-named /metrics, fault injection. "
            "No GPU needed. Each replica answers with an X-Replica-Id header."
        ),
        epilog=(
            "faults: --fault [INDEX:]NAME[=VALUE], repeatable; without INDEX it applies to every replica. "
            "NAME is hang, slow=FACTOR, error-rate=SHARE, error-status=500|503, stall-after=CHUNKS, "
            "drop-after=CHUNKS, end-late=SECONDS (wall: a stream's HTTP end that long after its [DONE], as "
            "llama-server writes them apart), crash-after=SECONDS (wall), kv-events-drop=SHARE or "
            "kv-events-drop-next=N "
            "(KV-event messages numbered and buffered but not sent). At run time: POST /emulator/faults "
            "with a JSON object, or POST /emulator/restart-engine, on a replica's port, or "
            "/replicas/INDEX/{faults,crash,restart,restart-engine} on --control-port."
        ),
    )
    g = p.add_argument_group("listening")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=None, help="serve one replica on this port (default 9001)")
    g.add_argument("--replicas", type=int, default=None, metavar="N", help="serve N replicas on consecutive ports")
    g.add_argument("--base-port", type=int, default=9001, help="first port of the fleet (default 9001)")
    g.add_argument("--replica-id", default=None, help="X-Replica-Id of a single replica (default emu-PORT)")
    g.add_argument("--control-port", type=int, default=None, help="fleet control API port (crash/restart/faults)")
    g.add_argument(
        "--api-key",
        default="",
        metavar="KEY",
        help="as vLLM's --api-key: its /v1 paths ask for Authorization: Bearer KEY (default: none asked)",
    )
    p.add_argument(
        "--kv-load-failure-policy",
        choices=("fail", "recompute"),
        default="fail",
        help="a decode that cannot read a remote prefill's KV fails (vLLM's default: a 500, or an error "
        "event in a stream) or recomputes the prompt, as vLLM's kv_load_failure_policy",
    )
    g = p.add_argument_group("model")
    d = EngineConfig()
    g.add_argument(
        "--model",
        nargs="+",
        default=["emulated-llm"],
        metavar="NAME",
        help="served model names: it answers to each, and lists them in /v1/models (default emulated-llm)",
    )
    g.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME",
        help="a LoRA adapter it serves on its model, listed with the model as `parent` (repeatable)",
    )
    g.add_argument(
        "--max-loras",
        type=int,
        default=d.max_loras,
        help=f"distinct adapters in one batch, and GPU slots for them, as vLLM's (default {d.max_loras})",
    )
    g.add_argument(
        "--lora-load-ms",
        type=float,
        default=d.lora_load_s * 1000,
        help="engine milliseconds to load an adapter into a free GPU slot (default 0)",
    )
    g.add_argument(
        "--kv-handshake-ms",
        type=float,
        default=d.kv_handshake_s * 1000,
        help="engine milliseconds a decode replica's first read of a prefill engine's KV waits for their "
        "handshake (NIXL's; default 0)",
    )
    g.add_argument(
        "--kv-read-delay-ms",
        type=float,
        default=d.kv_read_delay_s * 1000,
        help="engine milliseconds before a decode replica begins each read of a prefill's KV (vLLM's CPU "
        "build began some after the prefill's lease ran out; default 0)",
    )
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="engine seconds per wall second; 10 runs ten times faster than real time (default 1)",
    )
    g.add_argument("--block-size", type=int, default=d.block_size, help=f"tokens per KV block (default {d.block_size})")
    g.add_argument(
        "--num-blocks", type=int, default=d.num_blocks, help=f"KV cache capacity in blocks (default {d.num_blocks})"
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=d.max_num_seqs, help=f"most requests in a batch (default {d.max_num_seqs})"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help=f"token budget of one step (default {d.max_num_batched_tokens})",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help=f"longest prompt + reply in tokens (default {d.max_model_len})",
    )
    g.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=d.prefill_tokens_per_s,
        help=f"prefill speed (default {d.prefill_tokens_per_s:g})",
    )
    g.add_argument(
        "--step-ms",
        type=float,
        default=d.step_base_s * 1000,
        help=f"fixed time of one step in ms (default {d.step_base_s * 1000:g})",
    )
    g.add_argument(
        "--decode-per-seq-ms",
        type=float,
        default=d.decode_per_seq_s * 1000,
        help=f"extra step time per decoding request in ms (default {d.decode_per_seq_s * 1000:g})",
    )
    g.add_argument(
        "--attention-ns-per-token",
        type=float,
        default=d.attention_per_token_s * 1e9,
        help=f"extra step time per context token of decoding requests (default {d.attention_per_token_s * 1e9:g})",
    )
    g.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per streamed chunk after the first token, which goes alone (default 1)",
    )
    g.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        help="reply length when a request sets no max_tokens (default 256)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of injected error decisions (default 0)")
    g.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="serve the /v1/*/render endpoints, as vLLM does only with this flag (without it they answer 403; "
        "/tokenize answers either way)",
    )
    g.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help="as vLLM's: with --enable-auto-tool-choice, a chat that requires a tool (tool_choice `required` or a "
        "named function) is answered with a call of it; without both, such a chat gets vLLM 0.32's 400",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="as vLLM's (needs --tool-call-parser): tool_choice `auto` is taken (the emulated model answers in text)",
    )
    g.add_argument("--fault", action="append", default=[], metavar="[INDEX:]NAME[=VALUE]", help="inject a fault")
    g = p.add_argument_group("KV-cache events, as vLLM's --kv-events-config publishes them (off by default)")
    k = KvEventsOptions()
    g.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        metavar="P",
        help="publish each step's KV-cache events on a ZMQ PUB socket on this port (replica i of a fleet: "
        "P+i; 0: any free port, shown in GET /kv_event_sources)",
    )
    g.add_argument(
        "--kv-events-replay-port",
        type=int,
        default=None,
        metavar="Q",
        help="answer replays of buffered messages on a ZMQ ROUTER socket on this port (replica i: Q+i; 0: any "
        "free port; default none)",
    )
    g.add_argument(
        "--kv-events-encoding",
        choices=ENCODINGS,
        default=None,
        help=f"events as maps tagged by type (vLLM since mid-2026) or positional arrays (before) "
        f"(default {k.encoding})",
    )
    g.add_argument(
        "--kv-events-buffer",
        type=int,
        default=None,
        metavar="N",
        help=f"messages kept for replay (default {k.buffer_steps:,})",
    )
    g = p.add_argument_group("traces, as vLLM's (off by default)")
    g.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export an `llm_request` span per finished request, as vLLM does, over OTLP/HTTP to URL, used as "
        "it is (e.g. http://127.0.0.1:4318/v1/traces); OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be unset or "
        "http/protobuf; service name OTEL_SERVICE_NAME, else router-emulator; one provider for the whole fleet, "
        "each span naming its replica",
    )
    return p


class UsageError(Exception):
    pass


def parse_fault(spec: str, n: int) -> tuple[list[int], str, Any]:
    index_part, _, rest = spec.rpartition(":") if ":" in spec else ("", "", spec)
    name, _, value = rest.partition("=")
    if name not in FAULT_NAMES:
        raise UsageError(f"unknown fault {name!r} in --fault {spec!r}; known: {', '.join(FAULT_NAMES)}")
    field, kind = FAULT_NAMES[name]
    if index_part:
        try:
            index = int(index_part)
        except ValueError:
            raise UsageError(f"--fault {spec!r}: replica index must be an integer") from None
        if not 0 <= index < n:
            raise UsageError(f"--fault {spec!r}: replica index {index} out of range 0..{n - 1}")
        targets = [index]
    else:
        targets = list(range(n))
    if kind is bool:
        if value not in ("", "true", "1", "yes"):
            raise UsageError(f"--fault {spec!r}: {name} takes no value")
        return targets, field, True
    if not value:
        raise UsageError(f"--fault {spec!r}: {name} needs a value, e.g. {name}=2")
    try:
        parsed = kind(value)
    except ValueError:
        raise UsageError(f"--fault {spec!r}: {value!r} is not a valid {kind.__name__}") from None
    if field == "crash_after" and not (math.isfinite(parsed) and parsed >= 0):
        raise UsageError(f"--fault {spec!r}: crash-after must be a non-negative number of seconds")
    return targets, field, parsed


def build_tracer(args: argparse.Namespace) -> RequestTracer | None:
    """The process's request tracer, where --otlp-traces-endpoint asks for one."""
    if args.otlp_traces_endpoint is None:
        return None
    from router.emulator.tracing import RequestTracer, TracingConfigError  # noqa: PLC0415 -- OpenTelemetry: only when on

    try:
        return RequestTracer(args.otlp_traces_endpoint)
    except TracingConfigError as exc:
        raise UsageError(str(exc)) from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine every replica runs, from the engine flags (UsageError names a bad one)."""
    try:
        return EngineConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            step_base_s=args.step_ms / 1000,
            decode_per_seq_s=args.decode_per_seq_ms / 1000,
            attention_per_token_s=args.attention_ns_per_token / 1e9,
            max_loras=args.max_loras,
            lora_load_s=args.lora_load_ms / 1000,
            kv_handshake_s=args.kv_handshake_ms / 1000,
            kv_read_delay_s=args.kv_read_delay_ms / 1000,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def build_fleet(args: argparse.Namespace, tracer: RequestTracer | None = None) -> tuple[Fleet, dict[int, float]]:
    if args.port is not None and args.replicas is not None:
        raise UsageError("give either --port (one replica) or --replicas N with --base-port, not both")
    n = args.replicas if args.replicas is not None else 1
    if n < 1 or n > 1000:
        raise UsageError(f"--replicas must be in 1..1000, got {n}")
    first_port = args.port if args.port is not None else args.base_port
    if not (first_port > 0 and first_port + n - 1 <= 65535):
        raise UsageError(f"ports {first_port}..{first_port + n - 1} are out of range")
    if args.replica_id is not None and n > 1:
        raise UsageError("--replica-id names a single replica; a fleet's replicas are named emu-PORT")
    if not (math.isfinite(args.time_scale) and args.time_scale > 0):
        raise UsageError("--time-scale must be a positive number")
    if args.stream_interval < 1 or args.default_max_tokens < 1:
        raise UsageError("--stream-interval and --default-max-tokens must be at least 1")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise UsageError("--enable-auto-tool-choice requires --tool-call-parser")  # (vLLM's words)
    config = engine_config(args)
    kv_events = kv_events_options(args, n, first_port)
    faults = [Faults() for _ in range(n)]
    crash_after: dict[int, float] = {}
    for spec in args.fault:
        targets, field, value = parse_fault(spec, n)
        for i in targets:
            if field == "crash_after":
                crash_after[i] = value
            else:
                try:
                    faults[i].update({field: value})
                except ValueError as exc:
                    raise UsageError(f"--fault {spec!r}: {exc}") from None
    replicas = []
    for i in range(n):
        port = first_port + i
        options = ReplicaOptions(
            replica_id=args.replica_id or f"emu-{port}",
            host=args.host,
            port=port,
            model=args.model[0],
            aliases=tuple(args.model[1:]),
            adapters=tuple(args.lora),
            time_scale=args.time_scale,
            stream_interval=args.stream_interval,
            default_max_tokens=args.default_max_tokens,
            seed=args.seed + i,
            kv_events=kv_events[i] if kv_events else None,
            api_key=args.api_key,
            kv_load_failure_policy=args.kv_load_failure_policy,
            enable_scale_out=args.enable_scale_out,
            # vLLM 0.32 loads its tool parser only with both flags (`--tool-call-parser` alone still refuses)
            tools=bool(args.tool_call_parser and args.enable_auto_tool_choice),
        )
        replicas.append(Replica(options, config, faults[i], tracer))
    return Fleet(replicas, args.host, args.control_port), crash_after


def kv_events_options(args: argparse.Namespace, n: int, first_port: int) -> list[KvEventsOptions]:
    """Each replica's KV-event settings (none when --kv-events-port is not given): ports P+i and
    Q+i, or each its own free port for 0."""
    port, replay = args.kv_events_port, args.kv_events_replay_port
    if port is None:
        given = [f for f in ("replay_port", "encoding", "buffer") if getattr(args, "kv_events_" + f) is not None]
        if given:
            raise UsageError(f"--kv-events-{given[0].replace('_', '-')} needs --kv-events-port")
        return []
    http = range(first_port, first_port + n)
    ranges = {"--kv-events-port": port} | ({"--kv-events-replay-port": replay} if replay is not None else {})
    taken: list[tuple[str, range]] = [("the HTTP ports", http)]
    for flag, first in ranges.items():
        if first == 0:
            continue
        ports = range(first, first + n)
        if not (first > 0 and ports[-1] <= 65535):
            raise UsageError(f"{flag}: ports {first}..{ports[-1]} are out of range")
        for what, other in taken:
            if ports[0] <= other[-1] and other[0] <= ports[-1]:
                raise UsageError(f"{flag}: ports {first}..{ports[-1]} overlap {what}")
        taken.append((flag, ports))
    default = KvEventsOptions()
    try:
        return [
            KvEventsOptions(
                port=port + i if port else 0,
                replay_port=(replay + i if replay else 0) if replay is not None else None,
                encoding=args.kv_events_encoding or default.encoding,
                buffer_steps=args.kv_events_buffer if args.kv_events_buffer is not None else default.buffer_steps,
            )
            for i in range(n)
        ]
    except ValueError as exc:
        raise UsageError(f"--kv-events-*: {exc}") from None


async def serve(fleet: Fleet, crash_after: dict[int, float]) -> None:
    await fleet.start()
    for i, delay in crash_after.items():
        fleet.crash_later(fleet.replicas[i], delay)
    for r in fleet.replicas:
        print(f"{r.options.replica_id} listening on {r.url}", flush=True)
        if r.publisher is not None:
            replay = f", replays on port {r.publisher.replay_port}" if r.publisher.replay_port is not None else ""
            print(f"{r.options.replica_id} publishing KV events on port {r.publisher.port}{replay}", flush=True)
    if fleet.control_port is not None:
        print(f"control API on http://{fleet.control_host}:{fleet.control_port}/replicas", flush=True)
    try:
        await until_stopped()
    finally:
        await fleet.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tracer = None
    try:
        tracer = build_tracer(args)
        fleet, crash_after = build_fleet(args, tracer)
        run(serve(fleet, crash_after))
    except UsageError as exc:
        print(f"router-emulator: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"router-emulator: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        if tracer is not None:
            tracer.shutdown()  # the spans still in the batch go out before the process ends
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
