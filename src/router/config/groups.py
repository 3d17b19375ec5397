"""The settings by group: what each room of the router receives, not the whole `RouterConfig`.

Each class is one group of `--help` and one table of the TOML file (router.config.meanings.GROUPS),
read off a loaded config as `config.<section>` (`config.balance`, `config.proxying`, ...). The
fields have no defaults here: a setting's default is written once, in `RouterConfig`, and a group
is only ever made from a config (tests make one as `RouterConfig(setting=value).<section>`); a unit
test holds each group's fields to its table's names and types. `ReplicaSpec`, a replica as
configured, lives here too: the disaggregation group holds replicas (and settings.py imports this
module, never the other way).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Self


@dataclass(frozen=True)
class ReplicaSpec:
    id: str
    url: str
    role: str = "both"  # prefill and decode (aggregated), "decode" (--decode) or "prefill" (--prefill)


@dataclass(frozen=True)
class Group:
    section: ClassVar[str] = ""

    @classmethod
    def of(cls, config: object) -> Self:
        """The group's settings as `config` (a RouterConfig: router.config.settings, above this module) has them."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class FleetSettings(Group):
    """[fleet] replicas: how they are found and what each serves."""

    section: ClassVar[str] = "fleet"
    discovery: str
    discovery_interval_s: float
    replica_models: tuple[str, ...]
    replica_capacity: tuple[str, ...]
    agents: tuple[str, ...]
    replica_header: str


@dataclass(frozen=True)
class DisaggSettings(Group):
    """[disagg] prefill/decode disaggregation: replicas that prefill, replicas that decode, and what is split."""

    section: ClassVar[str] = "disagg"
    prefill: tuple[ReplicaSpec, ...]
    decode: tuple[ReplicaSpec, ...]
    prefill_discovery: str
    disagg_min_prompt_tokens: int
    prefill_anywhere: bool
    disagg_introduce: bool


@dataclass(frozen=True)
class SessionSettings(Group):
    """[sessions] sessions and routing keys: what keeps a conversation on the replica holding its context."""

    section: ClassVar[str] = "sessions"
    agent_session_headers: bool
    key_headers: tuple[str, ...]
    key_body_fields: tuple[str, ...]
    sticky_ttl_s: float
    sticky_max_sessions: int
    prefix_chars: int
    max_key_bytes: int


@dataclass(frozen=True)
class PlacementSettings(Group):
    """[placement] placement (ttft): the default policy, each request where its first token is predicted soonest."""

    section: ClassVar[str] = "placement"
    kv_events: bool
    kv_event_endpoints: tuple[str, ...]
    kv_events_max_mib: int
    kv_event_followers: int
    tokenizer_dirs: tuple[str, ...]
    token_check_share: float
    prefix_block_bytes: int
    kv_capacity_tokens: tuple[str, ...]
    kv_tier_tokens_per_s: float
    prefill_tokens_per_s: float
    ttft_decode_s: float
    ttft_interference: float
    ttft_spread_tokens: float
    ttft_gate_c: float
    ttft_stay_share: float
    ttft_move_weight: float
    ttft_move_cooldown_s: float
    ttft_tie_s: float
    ttft_tie_share: float
    adapter_load_s: float
    ttft_kv_wait: bool
    ttft_queue_gain: float


@dataclass(frozen=True)
class RingSettings(Group):
    """[ring] the ring and load: affinity and consistent_hash, and the load caps every policy keeps."""

    section: ClassVar[str] = "ring"
    vnodes: int
    hash_seed: int
    bounded_load_c: float
    bounded_load_floor: int
    capacity_caps: bool
    load_queue_weight: float


@dataclass(frozen=True)
class TenancySettings(Group):
    """[tenancy] a shared fleet: who may use it, its tenants' budgets, and the replicas' own keys."""

    section: ClassVar[str] = "tenancy"
    client_keys_file: str
    budget_reserve_tokens: int
    replica_api_keys: tuple[str, ...] = dataclasses.field(repr=False)  # (keys: never shown)


@dataclass(frozen=True)
class TlsSettings(Group):
    """[tls] TLS: HTTPS to clients (and their certificates) and to replicas."""

    section: ClassVar[str] = "tls"
    tls_cert_file: str
    tls_key_file: str
    tls_client_ca_file: str
    replica_ca_file: str
    replica_cert_file: str
    replica_key_file: str


@dataclass(frozen=True)
class AdmissionSettings(Group):
    """[admission] admission: holding requests while every replica is full."""

    section: ClassVar[str] = "admission"
    max_queued: int
    queue_timeout_s: float
    ttft_target_ms: float
    full_waiting: int
    full_kv_usage: float


@dataclass(frozen=True)
class HealthSettings(Group):
    """[health] health: probing replicas and routing around sick ones."""

    section: ClassVar[str] = "health"
    health_checks: bool
    probe_interval_s: float
    probe_timeout_s: float
    remove_below: float
    return_above: float
    remove_after: int
    return_after: int
    recovery_ramp_s: float
    flap_backoff: int
    score_weights: tuple[str, ...]


@dataclass(frozen=True)
class BalanceSettings(Group):
    """[balance] balance, warm-up and drains: moving load off hot replicas without a session storm."""

    section: ClassVar[str] = "balance"
    rebalance: bool
    rebalance_threshold: float
    rebalance_window_s: float
    rebalance_cooldown_s: float
    rebalance_max_vnodes: int
    scale_target_load: float
    scale_from_zero_s: float
    warmup: bool
    warmup_sessions: int
    warmup_concurrency: int
    warmup_timeout_s: float
    prompt_store_bytes: int
    drain_timeout_s: float


@dataclass(frozen=True)
class ProxySettings(Group):
    """[proxying] proxying: time-outs, limits, streams."""

    section: ClassVar[str] = "proxying"
    max_attempts: int
    connect_timeout_s: float
    first_byte_timeout_s: float
    idle_timeout_s: float
    total_timeout_s: float
    client_timeout_s: float
    keepalive_timeout_s: float
    max_body_bytes: int
    min_body_rate_bytes_per_s: float
    max_header_bytes: int
    upstream_connections: int
    inject_usage: bool
    resume_streams: bool
    resume_buffer_bytes: int
    front: bool


@dataclass(frozen=True)
class ProcessSettings(Group):
    """[processes] state, processes, console."""

    section: ClassVar[str] = "processes"
    state_namespace: str
    shm_name: str
    shm_slots: int
    console_interval_s: float
    console_history_s: float
    admin_host: str


GROUP_CLASSES: tuple[type[Group], ...] = (
    FleetSettings,
    DisaggSettings,
    SessionSettings,
    PlacementSettings,
    RingSettings,
    TenancySettings,
    TlsSettings,
    AdmissionSettings,
    HealthSettings,
    BalanceSettings,
    ProxySettings,
    ProcessSettings,
)
