"""The router's settings: one frozen dataclass, each field with its default and what it means.

`RouterConfig` is the table of settings, `FIELDS` names them; router.config.loading reads them
from file, environment and CLI and validates them. The readers below turn a setting's text (a
replica's URL, a discovery source, entries such as REPLICA_ID=N or MODEL=DIR) into what the code
uses; each raises ValueError with a one-line reason, which loading reports as a ConfigError.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from urllib.parse import urlsplit

from router.config.groups import (
    AdmissionSettings,
    BalanceSettings,
    DisaggSettings,
    FleetSettings,
    HealthSettings,
    PlacementSettings,
    ProcessSettings,
    ProxySettings,
    ReplicaSpec,
    RingSettings,
    SessionSettings,
    TenancySettings,
    TlsSettings,
)
from router.health.score import ScoreWeights
from router.health.states import Hysteresis

AUTO_QUEUED = -1  # max_queued = "auto"
# the TLS settings (router.tls): each a file, checked at start
TLS_FILES = (
    "tls_cert_file",
    "tls_key_file",
    "tls_client_ca_file",
    "replica_ca_file",
    "replica_cert_file",
    "replica_key_file",
)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    replicas: tuple[ReplicaSpec, ...] = ()
    policy: str = "ttft"
    # prefill/decode disaggregation (router.proxy.disagg): replicas that only prefill, for the
    # decode replicas (and aggregated ones) to read the KV of; decode replicas join `replicas`
    prefill: tuple[ReplicaSpec, ...] = ()
    decode: tuple[ReplicaSpec, ...] = ()
    disagg_min_prompt_tokens: int = 512  # a shorter prompt is served by its decode replica alone
    # with no prefill replicas: every replica may prefill a request for another (vLLM's kv_both),
    # chosen per request where that costs the fleet less waiting (router.proxy.disagg)
    prefill_anywhere: bool = False
    disagg_introduce: bool = True  # pairs meet by the router's requests before a client's is split across them
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
    # REPLICA_ID=KEY (or *=KEY): the key a replica's engine was started with (vLLM's, llama-server's
    # --api-key), sent as `Authorization: Bearer KEY` on whatever the router asks of it
    replica_api_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)  # (keys: never shown)
    # ttft: placement by predicted time to first token (router.placement, router.policy.ttft)
    prefix_block_bytes: int = 64  # the prefix index's block: 64 bytes of prompt, about 16 tokens
    # REPLICA_ID=TOKENS (or *=TOKENS): KV-cache size where the engine does not say (vLLM and SGLang do)
    kv_capacity_tokens: tuple[str, ...] = ()
    # KV-cache events (router.engines.kvfeed): a replica that publishes them (found through its
    # /kv_event_sources, or named here) is priced by what its engine says it holds
    kv_events: bool = True
    # REPLICA_ID=ENDPOINT or REPLICA_ID=ENDPOINT;REPLAY_ENDPOINT: where a replica publishes, where its
    # /kv_event_sources does not say (SGLang, an engine behind a proxy)
    kv_event_endpoints: tuple[str, ...] = ()
    # the event-fed index's memory at most, MiB (each followed engine counted at its KV capacity);
    # 0: a quarter of this host's memory, or of its container's limit
    kv_events_max_mib: int = 0
    # under --workers: the processes that follow the engines' KV events for the host, each a shard
    # of the replicas (1: the control process alone; more: it and N - 1 processes of their own)
    kv_event_followers: int = 1
    # MODEL=DIR (or *=DIR): a model's tokenizer.json and chat template; else found from the engines'
    # /v1/models (router.engines.tokens)
    tokenizer_dirs: tuple[str, ...] = ()
    token_check_share: float = 0.01  # share of requests tokenized here checked again against the engine
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
    agent_session_headers: bool = True  # coding agents' session headers key requests first (router.keys.AGENTS)
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
    # a body must keep up this rate once it has had BODY_GRACE_S (router.proxy.intake); 0: no floor
    min_body_rate_bytes_per_s: float = 1024.0
    max_header_bytes: int = 16 * 1024
    upstream_connections: int = 256  # per replica
    inject_usage: bool = True
    resume_streams: bool = True  # continue a stream a replica broke mid-way on another replica
    resume_buffer_bytes: int = 1024 * 1024  # per stream: what was sent, to continue from (past it: no resume)
    front: bool = True  # the proxied endpoints on the router's own HTTP/1.1 server (httptools), not aiohttp's
    # overload held at the edge (router.tenancy.admission): requests wait here while every replica for their
    # model is full
    # requests waiting at most: AUTO_QUEUED ("auto" in a file or flag) follows the engines' capacity
    # (router.tenancy.admission); 0: off, every request forwarded at once
    max_queued: int = -1
    queue_timeout_s: float = 10.0  # the longest a request waits for room before its 429
    # max_queued auto: a request is held only while it can start within its share of this target
    ttft_target_ms: float = 2000.0
    full_waiting: int = 8  # a replica is full once its engine's queue reaches this many requests,
    full_kv_usage: float = 0.95  # or its KV cache usage this share
    # health
    health_checks: bool = True
    agents: tuple[str, ...] = ()  # REPLICA_ID=URL of a router-agent whose /stats the control loop reads
    probe_interval_s: float = 2.0
    probe_timeout_s: float = 1.0
    remove_below: float = Hysteresis.remove_below  # (router.health.states holds these defaults)
    return_above: float = Hysteresis.return_above
    remove_after: int = Hysteresis.remove_after
    return_after: int = Hysteresis.return_after
    recovery_ramp_s: float = Hysteresis.ramp_s
    flap_backoff: int = Hysteresis.flap_backoff  # removed again while recovering: up to this x return_after to return
    score_weights: tuple[str, ...] = ()  # NAME=VALUE overrides of router.health.score.ScoreWeights
    # balance and elasticity
    load_queue_weight: float = 0.0  # bounded load counts in-flight + this x requests waiting in the engine
    rebalance: bool = True
    rebalance_threshold: float = 0.5  # theta: a replica is hot above (1 + theta) x mean load
    rebalance_window_s: float = 30.0  # W: hot this long before its vnodes move
    rebalance_cooldown_s: float = 60.0  # C: both sides rest this long after a move
    rebalance_max_vnodes: int = 4  # vnodes moved per cycle at most
    scale_target_load: float = 16.0  # autoscaler signal: in-flight + waiting requests per replica to aim for
    # a request for a model no ready replica serves waits this long for one (the fleet scaled to
    # zero, its autoscaler starting one), then gets a 503; the scale signal may then fall to 0
    scale_from_zero_s: float = 0.0
    warmup: bool = True
    warmup_sessions: int = 32  # sessions warmed per move at most (the most recent first)
    warmup_concurrency: int = 4  # prefill-only requests in flight to one replica at once
    warmup_timeout_s: float = 10.0  # a move switches after this long even if warm-up is not done
    prompt_store_bytes: int = 64 * 1024 * 1024  # latest request body per session, for warm-up
    drain_timeout_s: float = 120.0  # a drain that removes waits this long for in-flight requests
    # discovery: "" (off), file:PATH, dns:NAME:PORT or srv:NAME (router.engines.discovery)
    discovery: str = ""
    discovery_interval_s: float = 5.0
    prefill_discovery: str = ""  # the prefill replicas' source, as `discovery` (router.engines.discovery)
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
    admin_token: str = dataclasses.field(default="", repr=False)
    client_keys_file: str = ""  # clients' keys, hashed, by tenant (router.tenancy.clients); empty: no keys asked
    # TLS (router.tls): HTTPS to clients with this certificate chain and key (PEM), read again on change
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""  # clients must present a certificate this CA signed (mTLS)
    replica_ca_file: str = ""  # https:// replicas are verified against this CA (else the system's)
    replica_cert_file: str = ""  # the client certificate (and key) the router presents to https:// replicas
    replica_key_file: str = ""
    # a request naming no max_tokens reserves this for its answer (router.tenancy.budgets)
    budget_reserve_tokens: int = 1024
    # the admin API, console and /metrics on an address of their own; port 0: on the proxy's address
    admin_host: str = "127.0.0.1"
    admin_port: int = 0
    log_requests: bool = False
    demo: int = 0

    # each group of settings, for the room that owns it (router.config.groups); made once per config
    @cached_property
    def fleet(self) -> FleetSettings:
        return FleetSettings.of(self)

    @cached_property
    def disagg(self) -> DisaggSettings:
        return DisaggSettings.of(self)

    @cached_property
    def sessions(self) -> SessionSettings:
        return SessionSettings.of(self)

    @cached_property
    def placement(self) -> PlacementSettings:
        return PlacementSettings.of(self)

    @cached_property
    def ring(self) -> RingSettings:
        return RingSettings.of(self)

    @cached_property
    def tenancy(self) -> TenancySettings:
        return TenancySettings.of(self)

    @cached_property
    def tls(self) -> TlsSettings:
        return TlsSettings.of(self)

    @cached_property
    def admission(self) -> AdmissionSettings:
        return AdmissionSettings.of(self)

    @cached_property
    def health(self) -> HealthSettings:
        return HealthSettings.of(self)

    @cached_property
    def balance(self) -> BalanceSettings:
        return BalanceSettings.of(self)

    @cached_property
    def proxying(self) -> ProxySettings:
        return ProxySettings.of(self)

    @cached_property
    def processes(self) -> ProcessSettings:
        return ProcessSettings.of(self)


FIELDS = {f.name: f for f in dataclasses.fields(RouterConfig)}
POLICIES = ("ttft", "affinity", "consistent_hash", "round_robin", "least_load", "lmetric")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


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
    """(kind, name, port) of a `discovery` setting (router.engines.discovery); ValueError with a one-line reason."""
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


def shared_through_redis(state: str) -> bool:
    """With this `state` setting the routing state lives in Redis (redis://, rediss:// or unix://),
    shared by several routers."""
    return state.startswith(REDIS_SCHEMES)


def replica_capacities(cfg: FleetSettings) -> dict[str, int]:
    """`replica_capacity` as {replica id or "*": requests it runs at once}."""
    return _per_replica(cfg.replica_capacity)


def kv_capacities(cfg: PlacementSettings) -> dict[str, int]:
    """`kv_capacity_tokens` as {replica id or "*": tokens its KV cache holds}."""
    return _per_replica(cfg.kv_capacity_tokens)


def event_endpoints(cfg: PlacementSettings) -> dict[str, tuple[str, str | None]]:
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


def tokenizer_dirs(cfg: PlacementSettings) -> dict[str, str]:
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


def replica_api_keys(cfg: TenancySettings) -> dict[str, str]:
    """`replica_api_keys` as {replica id or "*": its engine's key}."""
    out: dict[str, str] = {}
    for entry in cfg.replica_api_keys:
        rid, sep, key = entry.partition("=")
        rid, key = rid.strip(), key.strip()
        if not sep or not rid or not key:
            raise ValueError("an entry is not REPLICA_ID=KEY (or *=KEY)")  # (never the entry: it holds a key)
        if rid in out:
            raise ValueError(f"replica {rid!r} is given a key twice")
        out[rid] = key
    return out


def pinned_models(cfg: FleetSettings) -> dict[str, frozenset[str]]:
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


def score_weights(cfg: HealthSettings) -> ScoreWeights:
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
