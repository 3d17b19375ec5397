"""Router configuration: the settings (settings.py), what each means (meanings.py), read and validated
at load (loading.py)."""

from router.config.groups import ReplicaSpec
from router.config.loading import ENV_NAMES, NOT_SETTINGS, ConfigError, from_environment, load
from router.config.settings import (
    AUTO_QUEUED,
    FIELDS,
    POLICIES,
    RouterConfig,
    event_endpoints,
    kv_capacities,
    parse_replica,
    parse_source,
    pinned_models,
    replica_api_keys,
    replica_capacities,
    score_weights,
    shared_through_redis,
    tokenizer_dirs,
)

__all__ = [
    "AUTO_QUEUED",
    "ENV_NAMES",
    "FIELDS",
    "NOT_SETTINGS",
    "POLICIES",
    "ConfigError",
    "ReplicaSpec",
    "RouterConfig",
    "event_endpoints",
    "from_environment",
    "kv_capacities",
    "load",
    "parse_replica",
    "parse_source",
    "pinned_models",
    "replica_api_keys",
    "replica_capacities",
    "score_weights",
    "shared_through_redis",
    "tokenizer_dirs",
]
