"""Reading the settings: defaults, the TOML file, the environment and the CLI, then validation.

Precedence, lowest first: defaults, the TOML file (`--config`), environment variables
`ROUTER_<SETTING>` (upper case; lists comma-separated), command-line flags. In the TOML file a
setting stands at the top or in its group's table (`[health]`, `[admission]`: meanings.SECTIONS),
never in both. A bad value raises
ConfigError naming the setting and where it came from; names that are no setting (a TOML key, a
`ROUTER_*` variable) raise UnknownSettings, one line each with the closest names.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from router.config.meanings import SECTIONS
from router.config.settings import (
    AUTO_QUEUED,
    FIELDS,
    POLICIES,
    REDIS_SCHEMES,
    TLS_FILES,
    RouterConfig,
    event_endpoints,
    kv_capacities,
    parse_replica,
    parse_source,
    pinned_models,
    replica_api_keys,
    replica_capacities,
    score_weights,
    tokenizer_dirs,
)
from router.errors import RouterError
from router.kvevents.mapped import MAX_SHARDS


class ConfigError(RouterError, ValueError):
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


ENV_NAMES = {"ROUTER_" + name.upper(): f for name, f in FIELDS.items()}
HEADER_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# ROUTER_* variables that are not settings: the pure-Python opt-out (read where modules load) and
# router-bench's progress lines (a benchmark's router-serve children inherit its environment)
NOT_SETTINGS = frozenset({"ROUTER_NO_EXTENSIONS", "ROUTER_BENCH_PROGRESS"})
# what Kubernetes sets in every pod for each Service of its namespace (service links), here for a
# Service named "router" or "router-<something>": not settings. Its <NAME>_PORT holds a URL.
SERVICE_LINK = re.compile(
    r"ROUTER_(?:[A-Z0-9_]+_)?(?:SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9_]+)?|PORT_\d+_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?)"
)
LINK_URL = re.compile(r"(?:tcp|udp|sctp)://")


def _coerce(name: str, value: Any, source: str) -> Any:
    f = FIELDS[name]
    kind = f.type
    try:
        if name in ("replicas", "prefill", "decode"):
            items = value.split(",") if isinstance(value, str) else list(value)
            specs = tuple(parse_replica(str(v)) for v in items if str(v).strip())
            return specs if name == "replicas" else tuple(replace(spec, role=name) for spec in specs)
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
        if name == "max_queued" and isinstance(value, str) and value.strip().lower() == "auto":
            return AUTO_QUEUED
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
        if name in ("admin_token", "client_keys_file") or name.endswith("_file"):
            return value.strip()  # a token or path read from a file or a Secret often ends in a newline
        return value
    except (TypeError, ValueError) as exc:
        raise ConfigError(name, source, str(exc)) from None


MIN_ADMIN_TOKEN_BYTES = 16  # an admin token shorter than this is refused at start


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
    for cert, key in (("tls_cert_file", "tls_key_file"), ("replica_cert_file", "replica_key_file")):
        if bool(getattr(cfg, cert)) != bool(getattr(cfg, key)):
            raise bad(cert if not getattr(cfg, cert) else key, f"{cert} and {key} go together: set both or neither")
    if cfg.tls_client_ca_file and not cfg.tls_cert_file:
        raise bad("tls_client_ca_file", "client certificates need the router's own HTTPS: set tls_cert_file too")
    for name in TLS_FILES:
        path = getattr(cfg, name)
        if path and not os.path.isfile(path):
            raise bad(name, f"{path} is not a file")
    if cfg.admin_token and len(cfg.admin_token.encode()) < MIN_ADMIN_TOKEN_BYTES:
        raise bad(
            "admin_token",
            f"must be at least {MIN_ADMIN_TOKEN_BYTES} bytes (a short token is guessed): make one with "
            "`openssl rand -hex 32`",
        )
    if cfg.client_keys_file and not cfg.admin_port and not cfg.admin_token:
        raise bad(
            "client_keys_file",
            "with client keys, nothing on the API's address answers a client but the API: set admin_token (the"
            " console and /metrics then ask for it) or admin_port (they get an address of their own)",
        )
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
        "scale_from_zero_s",
    ):
        value = getattr(cfg, name)
        if not (math.isfinite(value) and value >= 0):
            raise bad(name, "must be a number >= 0")
    if not 1 <= cfg.budget_reserve_tokens <= 10_000_000:
        raise bad("budget_reserve_tokens", "must be in 1..10000000 tokens")
    if not 0 <= cfg.ttft_tie_share < 1:
        raise bad("ttft_tie_share", "must be a share in [0, 1)")
    if not (0 <= cfg.max_queued <= 1_000_000 or cfg.max_queued == AUTO_QUEUED):
        raise bad("max_queued", "must be auto or 0..1000000 requests (0 turns the queue off)")
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
    if not (math.isfinite(cfg.ttft_target_ms) and 0 < cfg.ttft_target_ms <= 3_600_000):
        raise bad("ttft_target_ms", "must be a positive number of milliseconds, at most an hour")
    if not (math.isfinite(cfg.min_body_rate_bytes_per_s) and cfg.min_body_rate_bytes_per_s >= 0):
        raise bad("min_body_rate_bytes_per_s", "must be a rate of at least 0 bytes a second (0: no floor)")
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
    # the settings whose text is read into entries: each reader says what is wrong with an entry
    readers: tuple[tuple[str, Callable[[], object]], ...] = (
        ("score_weights", lambda: score_weights(cfg.health)),
        ("replica_capacity", lambda: replica_capacities(cfg.fleet)),
        ("kv_capacity_tokens", lambda: kv_capacities(cfg.placement)),
        ("kv_event_endpoints", lambda: event_endpoints(cfg.placement)),
        ("tokenizer_dirs", lambda: tokenizer_dirs(cfg.placement)),
        ("replica_api_keys", lambda: replica_api_keys(cfg.tenancy)),
        ("replica_models", lambda: pinned_models(cfg.fleet)),
    )
    for name, read in readers:
        try:
            read()
        except ValueError as exc:
            raise bad(name, str(exc)) from None
    if not 1 <= cfg.kv_event_followers <= MAX_SHARDS:
        raise bad("kv_event_followers", f"must be in 1..{MAX_SHARDS} processes")
    if cfg.kv_events_max_mib < 0:
        raise bad("kv_events_max_mib", "must be a number of MiB >= 0 (0: a quarter of this host's memory)")
    if not (math.isfinite(cfg.token_check_share) and 0 <= cfg.token_check_share <= 1):
        raise bad("token_check_share", "must be a share in 0..1")
    if not (math.isfinite(cfg.kv_tier_tokens_per_s) and cfg.kv_tier_tokens_per_s > 0):
        raise bad("kv_tier_tokens_per_s", "must be a positive number of tokens a second")
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
    for name in ("discovery", "prefill_discovery"):
        if getattr(cfg, name):
            try:
                parse_source(getattr(cfg, name))
            except ValueError as exc:
                raise bad(name, str(exc)) from None
    if not 0 <= cfg.demo <= 64:
        raise bad("demo", "must be in 0..64 replicas")
    if not cfg.replicas and not cfg.demo and not cfg.discovery:
        if cfg.prefill or cfg.prefill_discovery:
            raise bad("decode", "prefill replicas need replicas to decode: give --decode URL (repeatable)")
        raise bad("replicas", "no replicas: give --replica URL (repeatable), ROUTER_REPLICAS, --discovery, or --demo N")
    if cfg.prefill_anywhere and (cfg.prefill or cfg.prefill_discovery):
        raise bad("prefill_anywhere", "is for a fleet without prefill replicas: drop --prefill or this")
    if cfg.prefill_anywhere and cfg.policy != "ttft":
        raise bad("prefill_anywhere", "needs policy ttft (its prefix index and prefill queues price each prefill)")
    if cfg.disagg_min_prompt_tokens < 0:
        raise bad("disagg_min_prompt_tokens", "must be 0 or more tokens")
    every = (*cfg.replicas, *cfg.prefill)
    ids = [r.id for r in every]
    dup = next((i for i in ids if ids.count(i) > 1), None)
    if dup is not None:
        raise bad("replicas", f"replica id {dup!r} appears twice (name them: NAME=URL)")
    if cfg.replica_header and not HEADER_TOKEN.fullmatch(cfg.replica_header):
        raise bad("replica_header", "must be an HTTP header name (letters, digits, -), or empty to turn it off")
    urls = [r.url for r in every]
    dup_url = next((u for u in urls if urls.count(u) > 1), None)
    if dup_url is not None:
        raise bad("replicas", f"{dup_url} is listed twice (a retry could go back to the same replica)")
    return cfg


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
    settings, where, unknown = _sections(data, file or "")
    unknown += [_unknown(key, "the environment") for key in sorted(env or ()) if _unknown_variable(key, env or {})]
    if unknown:
        raise UnknownSettings(unknown)
    for name, value in settings.items():
        values[name] = _coerce(name, value, where[name])
        sources[name] = where[name]
    for name in FIELDS:
        key = "ROUTER_" + name.upper()
        if env is not None and key in env:
            if name.endswith("port") and LINK_URL.match(env[key]):
                service = key.removesuffix("_PORT").lower().replace("_", "-")
                raise ConfigError(
                    name,
                    key,
                    f"{env[key]!r} is Kubernetes' service link for a Service named {service!r}, not a "
                    f"port: set enableServiceLinks: false in the pod, or pass --{name.replace('_', '-')}",
                )
            values[name] = _coerce(name, env[key], key)
            sources[name] = key
    for name, value in (cli or {}).items():
        if value is not None:
            flag = "--replica" if name == "replicas" else "--" + name.replace("_", "-")  # --prefill, --decode
            values[name] = _coerce(name, value, flag)
            sources[name] = flag
    if values.get("demo") and "state" not in sources:
        values["state"] = "none"  # a demo starts clean (its replicas are new each time) unless asked
    if values.get("decode"):  # decode replicas are replicas: they serve alone what is not split
        values["replicas"] = (*values.get("replicas", ()), *values["decode"])
    return validate(RouterConfig(**values), sources)


def _sections(data: Mapping[str, Any], file: str) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """A TOML file's settings, from the top and from their groups' tables: (settings, where each
    was: `FILE` or `FILE [section]`, a line for each name that is no setting there)."""
    settings: dict[str, Any] = {}
    where: dict[str, str] = {}
    unknown: list[str] = []
    for key, value in data.items():
        names = SECTIONS.get(key)
        if names is None or not isinstance(value, dict):  # at the top (TOML puts it before every table)
            if key in FIELDS:
                settings[key], where[key] = value, file
            else:
                unknown.append(_unknown(key, file))
            continue
        for name, item in value.items():
            if name not in names:
                unknown.append(_misplaced(name, key, file))
            elif name in settings:
                raise ConfigError(name, file, f"is set twice: at the top and in [{key}]")
            else:
                settings[name], where[name] = item, f"{file} [{key}]"
    return settings, where, unknown


def _misplaced(name: str, section: str, file: str) -> str:
    """One line for a name in a group's table that is no setting of that group."""
    home = next((s for s, names in SECTIONS.items() if name in names), None)
    if home is not None:
        return f"setting {name} is not one of [{section}] (from {file}): it belongs in [{home}], or at the top"
    if name in FIELDS:
        return f"setting {name} is not one of [{section}] (from {file}): it stands at the top"
    close = difflib.get_close_matches(name, list(SECTIONS[section]), n=2, cutoff=0.7)
    hint = f"did you mean {' or '.join(close)}?" if close else f"router-serve --help lists [{section}]'s settings"
    return f"unknown setting {name} in [{section}] (from {file}): {hint}"


def _unknown_variable(key: str, env: Mapping[str, str]) -> bool:
    return (
        key.startswith("ROUTER_")
        and key not in ENV_NAMES
        and key not in NOT_SETTINGS
        and not SERVICE_LINK.fullmatch(key)
        and not (key.endswith("_PORT") and LINK_URL.match(env[key]))  # a Service's own URL
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
