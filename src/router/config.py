"""Router configuration: one frozen dataclass, validated at load, from file, environment and CLI.

Precedence, lowest first: defaults, the TOML file (`--config`), environment variables
`ROUTER_<SETTING>` (upper case; lists comma-separated), command-line flags. A bad value raises
ConfigError naming the setting and where it came from; names that are no setting (a TOML key, a
`ROUTER_*` variable) raise UnknownSettings, one line each with the closest names.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from router.health.score import ScoreWeights


class ConfigError(ValueError):
    """A setting that cannot be used; str() is one line for the operator."""

    def __init__(self, setting: str, source: str, problem: str) -> None:
        super().__init__(f"invalid setting '{setting}' (from {source}): {problem}")
        self.setting = setting


class UnknownSettings(ConfigError):
    """Names that are no setting, each with the closest known names; str() is one line each."""

    def __init__(self, lines: list[str]) -> None:
        ValueError.__init__(self, "\n".join(lines))
        self.setting = "unknown"
        self.lines = lines


@dataclass(frozen=True)
class ReplicaSpec:
    id: str
    url: str


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    replicas: tuple[ReplicaSpec, ...] = ()
    policy: str = "ttft"
    # ring
    vnodes: int = 128
    hash_seed: int = 0
    bounded_load_c: float = 1.25
    bounded_load_floor: int = 8  # fewer requests in flight than this never spill (nor more than its capacity)
    # REPLICA_ID=N (or *=N for every other replica): requests a replica runs at once, where its
    # engine does not say (llama-server's slots and the emulator's max_num_seqs are read from it)
    replica_capacity: tuple[str, ...] = ()
    capacity_caps: bool = True  # bounded-load caps respect capacities; off: capacity-blind, as before
    # REPLICA_ID=MODEL (or *=MODEL), one per entry: the models a replica serves, pinned (beats its /v1/models)
    replica_models: tuple[str, ...] = ()
    # ttft: placement by predicted time to first token (router.placement, router.policy.ttft)
    prefix_block_bytes: int = 64  # the prefix index's block: 64 bytes of prompt, about 16 tokens
    # REPLICA_ID=TOKENS (or *=TOKENS): KV-cache size where the engine does not say (vLLM and SGLang do)
    kv_capacity_tokens: tuple[str, ...] = ()
    # KV-cache events (router.kvfeed): a replica that publishes them (found through its
    # /kv_event_sources, or named here) is priced by what its engine says it holds
    kv_events: bool = True
    # REPLICA_ID=ENDPOINT or REPLICA_ID=ENDPOINT;REPLAY_ENDPOINT: where a replica publishes, where its
    # /kv_event_sources does not say (SGLang, an engine behind a proxy)
    kv_event_endpoints: tuple[str, ...] = ()
    # MODEL=DIR (or *=DIR): a model's tokenizer.json and chat template; else the engine's render endpoint
    tokenizer_dirs: tuple[str, ...] = ()
    token_check_share: float = 0.01  # share of requests tokenized here whose tokens the engine's render checks
    kv_tier_tokens_per_s: float = 200_000.0  # tokens a second a second KV tier (CPU offloading) loads back
    prefill_tokens_per_s: float = 10_000.0  # a replica's prefill speed until its answers show it
    ttft_decode_s: float = 0.002  # time to first token added by each request in flight there
    # the prefill's own time counts once more for each request in flight there (each is delayed by it)
    ttft_interference: float = 1.0
    # a new conversation on a replica with recent traffic past the fleet's mean costs as if this many
    # more tokens were computed there, per (recent - mean) / (mean + 4) (router.placement)
    ttft_spread_tokens: float = 2000.0
    ttft_gate_c: float = 1.5  # never a replica past max(ceil(c x (in flight + 1) / replicas), mean + floor)
    ttft_stay_share: float = 1.0  # the conversation's replica keeps it unless another costs < 1 / (1 + this) of it
    # ... and a keyed session's replica, not past the gate, unless moving also saves this many times
    # what the move costs the fleet: its recompute, for itself and all it delays there, and what it evicts
    ttft_move_weight: float = 1.0
    ttft_move_cooldown_s: float = 60.0  # a session moved by cost does not move by cost again for this long
    ttft_tie_s: float = 0.001  # costs this close are equal (the least full, then the ring, break the tie)
    ttft_tie_share: float = 0.1  # ... or this close as a share of the cheapest
    # ttft: a request for a LoRA adapter loaded on other replicas costs this much more time to first
    # token where it is not (loading it, or waiting for a free adapter slot)
    adapter_load_s: float = 0.25
    # ttft: a replica whose requests in flight fill its KV cache makes a new one wait for room
    # (tokens past its capacity, drained a capacity's worth every reply time: router.placement)
    ttft_kv_wait: bool = True
    # ttft: a first token later (or sooner) than modelled moves its replica's queue by this share of the lag
    ttft_queue_gain: float = 0.5
    # affinity (and ttft: the sessions' table)
    sticky_ttl_s: float = 600.0
    sticky_max_sessions: int = 200_000
    # routing keys
    key_headers: tuple[str, ...] = ("x-session-id", "session-id", "session_id", "conversation-id", "x-conversation-id")
    key_body_fields: tuple[str, ...] = ("session_id", "metadata.session_id", "metadata.user_id", "user")
    prefix_chars: int = 256
    max_key_bytes: int = 256
    # proxying
    replica_header: str = "X-Router-Replica"  # "" turns it off
    max_attempts: int = 3
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 60.0
    idle_timeout_s: float = 60.0
    total_timeout_s: float = 600.0
    client_timeout_s: float = 60.0  # longest pause while a client sends its request body
    keepalive_timeout_s: float = 75.0  # idle connections close; a request's headers must be in within it
    max_body_bytes: int = 32 * 1024 * 1024
    max_header_bytes: int = 16 * 1024
    upstream_connections: int = 256  # per replica
    inject_usage: bool = True
    resume_streams: bool = True  # continue a stream a replica broke mid-way on another replica
    resume_buffer_bytes: int = 1024 * 1024  # per stream: what was sent, to continue from (past it: no resume)
    front: bool = True  # the proxied endpoints on the router's own HTTP/1.1 server (httptools), not aiohttp's
    # overload held at the edge (router.admission): requests wait here while every replica for their model is full
    max_queued: int = 0  # requests waiting at most (0: off, every request forwarded as before)
    queue_timeout_s: float = 10.0  # the longest a request waits for room before its 429
    full_waiting: int = 8  # a replica is full once its engine's queue reaches this many requests,
    full_kv_usage: float = 0.95  # or its KV cache usage this share
    # health
    health_checks: bool = True
    agents: tuple[str, ...] = ()  # REPLICA_ID=URL of a router-agent whose /stats the control loop reads
    probe_interval_s: float = 2.0
    probe_timeout_s: float = 1.0
    remove_below: float = 0.5
    return_above: float = 0.7
    remove_after: int = 3
    return_after: int = 3
    recovery_ramp_s: float = 30.0
    flap_backoff: int = 8  # a replica removed again while recovering needs up to 8x return_after to return
    score_weights: tuple[str, ...] = ()  # NAME=VALUE overrides of router.health.score.ScoreWeights
    # balance and elasticity
    load_queue_weight: float = 0.0  # bounded load counts in-flight + this x requests waiting in the engine
    rebalance: bool = True
    rebalance_threshold: float = 0.5  # theta: a replica is hot above (1 + theta) x mean load
    rebalance_window_s: float = 30.0  # W: hot this long before its vnodes move
    rebalance_cooldown_s: float = 60.0  # C: both sides rest this long after a move
    rebalance_max_vnodes: int = 4  # vnodes moved per cycle at most
    scale_target_load: float = 16.0  # autoscaler signal: in-flight + waiting requests per replica to aim for
    warmup: bool = True
    warmup_sessions: int = 32  # sessions warmed per move at most (the most recent first)
    warmup_concurrency: int = 4  # prefill-only requests in flight to one replica at once
    warmup_timeout_s: float = 10.0  # a move switches after this long even if warm-up is not done
    prompt_store_bytes: int = 64 * 1024 * 1024  # latest request body per session, for warm-up
    drain_timeout_s: float = 120.0  # a drain that removes waits this long for in-flight requests
    # discovery: "" (off), file:PATH, dns:NAME:PORT or srv:NAME (router.discovery)
    discovery: str = ""
    discovery_interval_s: float = 5.0
    # routing state: "file" (default: a file under $XDG_STATE_HOME/kv-affinity-router),
    # "file:DIRECTORY", "redis://HOST:PORT/DB" (shared by several routers), or "none"
    state: str = "file"
    state_namespace: str = "default"  # routers sharing one Redis and one namespace share their state
    # processes
    workers: int = 1  # proxy processes on one port (SO_REUSEPORT); above 1, plus one control process
    shm_name: str = ""  # shared-memory segment; "" = kvar-<pid> when workers > 1, none for one worker
    shm_slots: int = 1024  # replicas the shared table holds at most
    # console (router.console): the page at /console and its bounded history
    console: bool = True
    console_interval_s: float = 2.0  # how often the history samples the metrics
    console_history_s: float = 900.0  # how far back the heatmap and curves go
    # operating
    admin_token: str = ""
    # the admin API, console and /metrics on an address of their own; port 0: on the proxy's address
    admin_host: str = "127.0.0.1"
    admin_port: int = 0
    log_requests: bool = False
    demo: int = 0


FIELDS = {f.name: f for f in dataclasses.fields(RouterConfig)}
ENV_NAMES = {"ROUTER_" + name.upper(): f for name, f in FIELDS.items()}
HEADER_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
POLICIES = ("ttft", "affinity", "consistent_hash", "round_robin", "least_load")
# ROUTER_* variables that are not settings: the pure-Python opt-out (read where modules load) and
# router-bench's progress lines (a benchmark's router-serve children inherit its environment)
NOT_SETTINGS = frozenset({"ROUTER_NO_EXTENSIONS", "ROUTER_BENCH_PROGRESS"})
# what Kubernetes sets in every pod for a Service named "router" (service links): not settings
SERVICE_LINK = re.compile(r"ROUTER_(SERVICE_[A-Z0-9_]+|PORT_\d+_[A-Z]+(_[A-Z]+)?)")


def parse_replica(text: str) -> ReplicaSpec:
    """`http://host:port` (id host:port) or `NAME=http://host:port`."""
    name, sep, url = text.partition("=")
    if not sep or "://" in name:
        name, url = "", text
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{text!r} is not an http(s) URL")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{text!r} has an invalid port") from None
    base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
    spec = ReplicaSpec(
        id=name.strip() or f"{parts.hostname}:{port or (443 if parts.scheme == 'https' else 80)}", url=base
    )
    # the shared-memory replica table's limits (router.shm.layout), for every replica alike
    if len(spec.id.encode()) > 64 or len(spec.url.encode()) > 256:
        raise ValueError(f"{text!r}: a replica id is at most 64 bytes and its URL at most 256")
    return spec


def parse_source(text: str) -> tuple[str, str, int]:
    """(kind, name, port) of a `discovery` setting (router.discovery); ValueError with a one-line reason."""
    kind, sep, rest = text.partition(":")
    if not sep or not rest:
        raise ValueError(f"{text!r}: use file:PATH, dns:NAME:PORT or srv:NAME")
    if kind == "file":
        return kind, rest, 0
    if kind == "srv":
        return kind, rest, 0
    if kind == "dns":
        name, sep, port = rest.rpartition(":")
        if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{text!r}: dns needs NAME:PORT, e.g. dns:vllm-headless:8000")
        return kind, name, int(port)
    raise ValueError(f"{text!r}: unknown discovery kind {kind!r}; use file:, dns: or srv:")


def _coerce(name: str, value: Any, source: str) -> Any:
    f = FIELDS[name]
    kind = f.type
    try:
        if name == "replicas":
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(parse_replica(str(v)) for v in items if str(v).strip())
        if kind == "tuple[str, ...]":
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(str(v).strip() for v in items if str(v).strip())
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(f"expected true or false, got {value!r}")
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(f"expected an integer, got {value!r}")
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"expected an integer, got {value!r}") from None
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError(f"expected a number, got {value!r}")
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"expected a number, got {value!r}") from None
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        if name == "admin_token":
            return value.strip()  # a token read from a file or a Secret often ends in a newline
        return value
    except (TypeError, ValueError) as exc:
        raise ConfigError(name, source, str(exc)) from None


def validate(cfg: RouterConfig, sources: Mapping[str, str]) -> RouterConfig:
    def bad(name: str, problem: str) -> ConfigError:
        return ConfigError(name, sources.get(name, "default"), problem)

    if not 0 < cfg.port <= 65535:
        raise bad("port", "must be in 1..65535")
    if not 0 <= cfg.admin_port <= 65535:
        raise bad("admin_port", "must be in 1..65535, or 0 to serve admin, console and metrics on the proxy's port")
    if cfg.admin_port == cfg.port:
        # refused whatever the hosts: a wildcard or a name for the same address would share the port
        raise bad("admin_port", f"{cfg.admin_port} is the proxy's own port; give the admin API a port of its own, or 0")
    if cfg.admin_port and not cfg.admin_host.strip():
        raise bad("admin_host", "must be an address (an empty one would listen on every interface)")
    if cfg.policy not in POLICIES:
        raise bad("policy", f"unknown policy {cfg.policy!r}; choose one of {', '.join(POLICIES)}")
    if not 1 <= cfg.vnodes <= 65536:
        raise bad("vnodes", "must be in 1..65536")
    if not 0 <= cfg.hash_seed < 2**64:
        raise bad("hash_seed", "must be in [0, 2**64)")
    if not (math.isfinite(cfg.bounded_load_c) and cfg.bounded_load_c >= 1):
        raise bad("bounded_load_c", "must be a finite number >= 1")
    if not (math.isfinite(cfg.ttft_gate_c) and cfg.ttft_gate_c >= 1):
        raise bad("ttft_gate_c", "must be a finite number >= 1")
    if not 16 <= cfg.prefix_block_bytes <= 240:
        # XXH3 hashes inputs up to 240 bytes without a derived secret: the chain stays cheap
        raise bad("prefix_block_bytes", "must be in 16..240 bytes")
    if not (math.isfinite(cfg.prefill_tokens_per_s) and cfg.prefill_tokens_per_s > 0):
        raise bad("prefill_tokens_per_s", "must be a positive number of tokens per second")
    for name in (
        "ttft_decode_s",
        "ttft_tie_s",
        "ttft_spread_tokens",
        "ttft_interference",
        "ttft_stay_share",
        "ttft_move_weight",
        "ttft_move_cooldown_s",
        "ttft_queue_gain",
        "adapter_load_s",
    ):
        value = getattr(cfg, name)
        if not (math.isfinite(value) and value >= 0):
            raise bad(name, "must be a number >= 0")
    if not 0 <= cfg.ttft_tie_share < 1:
        raise bad("ttft_tie_share", "must be a share in [0, 1)")
    if not 0 <= cfg.max_queued <= 1_000_000:
        raise bad("max_queued", "must be in 0..1000000 requests (0 turns the queue off)")
    if not (math.isfinite(cfg.full_kv_usage) and 0 < cfg.full_kv_usage <= 1):
        raise bad("full_kv_usage", "must be a share in (0, 1]")
    for name in (
        "sticky_ttl_s",
        "connect_timeout_s",
        "first_byte_timeout_s",
        "idle_timeout_s",
        "total_timeout_s",
        "client_timeout_s",
        "keepalive_timeout_s",
        "probe_interval_s",
        "probe_timeout_s",
        "rebalance_threshold",
        "rebalance_window_s",
        "warmup_timeout_s",
        "drain_timeout_s",
        "discovery_interval_s",
        "scale_target_load",
        "console_interval_s",
        "console_history_s",
        "queue_timeout_s",
    ):
        value = getattr(cfg, name)
        if not (math.isfinite(value) and value > 0):
            raise bad(name, "must be a positive number of seconds")
    if cfg.console_interval_s < 0.1:
        raise bad("console_interval_s", "must be at least 0.1 s")
    for name in (
        "sticky_max_sessions",
        "prefix_chars",
        "max_key_bytes",
        "max_attempts",
        "max_body_bytes",
        "max_header_bytes",
        "upstream_connections",
        "rebalance_max_vnodes",
        "warmup_concurrency",
        "bounded_load_floor",
        "resume_buffer_bytes",
        "full_waiting",
    ):
        if getattr(cfg, name) < 1:
            raise bad(name, "must be at least 1")
    if cfg.sticky_ttl_s > 30 * 86400:
        raise bad("sticky_ttl_s", "must be at most 30 days (2592000 s)")
    for name in ("load_queue_weight", "rebalance_cooldown_s"):
        value = getattr(cfg, name)
        if not (math.isfinite(value) and value >= 0):
            raise bad(name, "must be a number >= 0")
    for name in ("warmup_sessions", "prompt_store_bytes"):
        if getattr(cfg, name) < 0:
            raise bad(name, "must be >= 0")
    if not 0 <= cfg.remove_below < cfg.return_above <= 1:
        raise bad("return_above", "need 0 <= remove_below < return_above <= 1")
    if cfg.remove_after < 1 or cfg.return_after < 1:
        raise bad("remove_after" if cfg.remove_after < 1 else "return_after", "must be at least 1")
    if not 1 <= cfg.flap_backoff <= 1024:
        raise bad("flap_backoff", "must be in 1..1024 (1 turns the back-off off)")
    if not (math.isfinite(cfg.recovery_ramp_s) and cfg.recovery_ramp_s >= 0):
        raise bad("recovery_ramp_s", "must be a number of seconds >= 0")
    try:
        score_weights(cfg)
    except ValueError as exc:
        raise bad("score_weights", str(exc)) from None
    try:
        replica_capacities(cfg)
    except ValueError as exc:
        raise bad("replica_capacity", str(exc)) from None
    try:
        kv_capacities(cfg)
    except ValueError as exc:
        raise bad("kv_capacity_tokens", str(exc)) from None
    try:
        event_endpoints(cfg)
    except ValueError as exc:
        raise bad("kv_event_endpoints", str(exc)) from None
    try:
        tokenizer_dirs(cfg)
    except ValueError as exc:
        raise bad("tokenizer_dirs", str(exc)) from None
    if not (math.isfinite(cfg.token_check_share) and 0 <= cfg.token_check_share <= 1):
        raise bad("token_check_share", "must be a share in 0..1")
    if not (math.isfinite(cfg.kv_tier_tokens_per_s) and cfg.kv_tier_tokens_per_s > 0):
        raise bad("kv_tier_tokens_per_s", "must be a positive number of tokens a second")
    try:
        pinned_models(cfg)
    except ValueError as exc:
        raise bad("replica_models", str(exc)) from None
    known = {r.id for r in cfg.replicas}
    for entry in cfg.agents:
        rid, sep, url = entry.partition("=")
        if not sep or rid not in known or not url.startswith(("http://", "https://")):
            raise bad("agents", f"{entry!r} is not REPLICA_ID=http://host:port for a configured replica")
    if cfg.state not in ("file", "none") and not (
        (cfg.state.startswith("file:") and len(cfg.state) > 5)
        or (cfg.state.startswith(REDIS_SCHEMES) and urlsplit(cfg.state).netloc + urlsplit(cfg.state).path)
    ):
        raise bad("state", f"{cfg.state!r}: use file, file:DIRECTORY, redis://HOST:PORT/DB or none")
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", cfg.state_namespace):
        raise bad("state_namespace", "must be 1..64 letters, digits, '.', '_' or '-'")
    if not 1 <= cfg.workers <= 64:
        raise bad("workers", "must be in 1..64 processes")
    if not 1 <= cfg.shm_slots <= 16384:
        raise bad("shm_slots", "must be in 1..16384")
    if cfg.shm_name and not re.fullmatch(r"[A-Za-z0-9._-]{1,200}", cfg.shm_name):
        raise bad("shm_name", "must be 1..200 letters, digits, '.', '_' or '-'")
    if len(cfg.replicas) + cfg.demo > cfg.shm_slots:
        raise bad("shm_slots", f"must hold the {len(cfg.replicas) + cfg.demo} configured replicas")
    if cfg.discovery:
        try:
            parse_source(cfg.discovery)
        except ValueError as exc:
            raise bad("discovery", str(exc)) from None
    if not 0 <= cfg.demo <= 64:
        raise bad("demo", "must be in 0..64 replicas")
    if not cfg.replicas and not cfg.demo and not cfg.discovery:
        raise bad("replicas", "no replicas: give --replica URL (repeatable), ROUTER_REPLICAS, --discovery, or --demo N")
    ids = [r.id for r in cfg.replicas]
    dup = next((i for i in ids if ids.count(i) > 1), None)
    if dup is not None:
        raise bad("replicas", f"replica id {dup!r} appears twice (name them: NAME=URL)")
    if cfg.replica_header and not HEADER_TOKEN.fullmatch(cfg.replica_header):
        raise bad("replica_header", "must be an HTTP header name (letters, digits, -), or empty to turn it off")
    urls = [r.url for r in cfg.replicas]
    dup_url = next((u for u in urls if urls.count(u) > 1), None)
    if dup_url is not None:
        raise bad("replicas", f"{dup_url} is listed twice (a retry could go back to the same replica)")
    return cfg


def shared_through_redis(cfg: RouterConfig) -> bool:
    """The routing state lives in Redis (redis://, rediss:// or unix://), shared by several routers."""
    return cfg.state.startswith(REDIS_SCHEMES)


def replica_capacities(cfg: RouterConfig) -> dict[str, int]:
    """`replica_capacity` as {replica id or "*": requests it runs at once}."""
    return _per_replica(cfg.replica_capacity)


def kv_capacities(cfg: RouterConfig) -> dict[str, int]:
    """`kv_capacity_tokens` as {replica id or "*": tokens its KV cache holds}."""
    return _per_replica(cfg.kv_capacity_tokens)


def event_endpoints(cfg: RouterConfig) -> dict[str, tuple[str, str | None]]:
    """`kv_event_endpoints` as {replica id: (its PUB endpoint, its replay endpoint or None)}."""
    out: dict[str, tuple[str, str | None]] = {}
    for entry in cfg.kv_event_endpoints:
        rid, sep, rest = entry.partition("=")
        rid = rid.strip()
        pub, _, replay = rest.partition(";")
        pub, replay = pub.strip(), replay.strip()
        if not sep or not rid or not pub:
            raise ValueError(f"{entry!r} is not REPLICA_ID=ENDPOINT or REPLICA_ID=ENDPOINT;REPLAY_ENDPOINT")
        for endpoint in (pub, replay) if replay else (pub,):
            if not endpoint.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{entry!r}: {endpoint!r} is not a ZMQ endpoint (tcp://HOST:PORT or ipc://PATH)")
        if rid in out:
            raise ValueError(f"{entry!r}: replica {rid!r} is named twice")
        out[rid] = (pub, replay or None)
    return out


def tokenizer_dirs(cfg: RouterConfig) -> dict[str, str]:
    """`tokenizer_dirs` as {model or "*": the folder of its tokenizer.json and chat template}."""
    out: dict[str, str] = {}
    for entry in cfg.tokenizer_dirs:
        model, sep, folder = entry.partition("=")
        model, folder = model.strip(), folder.strip()
        if not sep or not model or not folder:
            raise ValueError(f"{entry!r} is not MODEL=DIR (or *=DIR)")
        if model in out:
            raise ValueError(f"{entry!r}: model {model!r} is named twice")
        out[model] = folder
    return out


def pinned_models(cfg: RouterConfig) -> dict[str, frozenset[str]]:
    """`replica_models` as {replica id or "*": the models it serves}."""
    out: dict[str, set[str]] = {}
    for entry in cfg.replica_models:
        rid, sep, model = entry.partition("=")
        rid, model = rid.strip(), model.strip()
        if not sep or not rid or not model:
            raise ValueError(f"{entry!r} is not REPLICA_ID=MODEL (or *=MODEL)")
        out.setdefault(rid, set()).add(model)
    return {rid: frozenset(models) for rid, models in out.items()}


def _per_replica(entries: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for entry in entries:
        rid, sep, text = entry.rpartition("=")
        rid = rid.strip()
        try:
            value = int(text)
        except ValueError:
            value = 0
        if not sep or not rid or value < 1:
            raise ValueError(f"{entry!r} is not REPLICA_ID=N (or *=N) with N a whole number >= 1")
        if rid in out:
            raise ValueError(f"{rid!r} is given twice")
        out[rid] = value
    return out


def score_weights(cfg: RouterConfig) -> ScoreWeights:
    """The health score's weights and thresholds: the defaults with `score_weights` applied."""
    names = {f.name for f in dataclasses.fields(ScoreWeights)}
    values: dict[str, float] = {}
    for entry in cfg.score_weights:
        name, sep, text = entry.partition("=")
        name = name.strip()
        if not sep or name not in names:
            raise ValueError(f"{entry!r} is not NAME=VALUE with NAME one of {', '.join(sorted(names))}")
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{entry!r}: {text.strip()!r} is not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"{entry!r}: the value must be finite")
        values[name] = value
    return ScoreWeights(**values)  # checks ranges and that each *_from is below its *_to


def load(
    file: str | None = None, env: Mapping[str, str] | None = None, cli: Mapping[str, Any] | None = None
) -> RouterConfig:
    """Defaults < TOML file < ROUTER_* environment < CLI values (None means "not given")."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    data: dict[str, Any] = {}
    if file:
        try:
            with open(file, "rb") as handle:
                data = tomllib.load(handle)
        except OSError as exc:
            raise ConfigError("config", file, exc.strerror or str(exc)) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", file, f"not valid TOML: {exc}") from None
    unknown = [_unknown(name, file or "") for name in data if name not in FIELDS]
    unknown += [_unknown(key, "the environment") for key in sorted(env or ()) if _unknown_variable(key)]
    if unknown:
        raise UnknownSettings(unknown)
    for name, value in data.items():
        values[name] = _coerce(name, value, file or "")
        sources[name] = file or ""
    for name in FIELDS:
        key = "ROUTER_" + name.upper()
        if env is not None and key in env:
            if key == "ROUTER_PORT" and env[key].startswith("tcp://"):
                raise ConfigError(
                    name,
                    key,
                    f"{env[key]!r} is Kubernetes' service link for a Service named "
                    "'router', not a port: set enableServiceLinks: false in the pod, or pass --port",
                )
            values[name] = _coerce(name, env[key], key)
            sources[name] = key
    for name, value in (cli or {}).items():
        if value is not None:
            flag = "--replica" if name == "replicas" else "--" + name.replace("_", "-")
            values[name] = _coerce(name, value, flag)
            sources[name] = flag
    if values.get("demo") and "state" not in sources:
        values["state"] = "none"  # a demo starts clean (its replicas are new each time) unless asked
    return validate(RouterConfig(**values), sources)


def _unknown_variable(key: str) -> bool:
    return (
        key.startswith("ROUTER_")
        and key not in ENV_NAMES
        and key not in NOT_SETTINGS
        and not SERVICE_LINK.fullmatch(key)
    )


def _unknown(name: str, source: str) -> str:
    """One line for a name that is no setting: where it was, and the closest settings' names."""
    variable = name.startswith("ROUTER_")
    bare = name.removeprefix("ROUTER_").lower() if variable else name
    if variable and bare.startswith("router_"):  # the prefix written twice
        bare = bare.removeprefix("router_")
    close = difflib.get_close_matches(bare, list(FIELDS), n=2, cutoff=0.7)
    names = [f"ROUTER_{c.upper()}" if variable else c for c in close]
    hint = f"did you mean {' or '.join(names)}?" if names else "router-serve --help lists the settings"
    return f"unknown setting {name} (from {source}): {hint}"


def from_environment(file: str | None, cli: Mapping[str, Any]) -> RouterConfig:
    return load(file, os.environ, cli)
