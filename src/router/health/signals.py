"""What an inference engine's Prometheus `/metrics` says about its load, read by name.

Understands vLLM (`vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc` and the older `vllm:gpu_cache_usage_perc`, prefix-cache counters),
SGLang (`sglang:num_queue_reqs`, `sglang:num_running_reqs`, `sglang:token_usage`) and the
emulator's `emulator:kv_fragmentation`. A figure the engine does not export stays None: missing,
never invented. Several series of one gauge (one per engine or model label) add up, except
usage and fragmentation ratios, which take the worst.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# engine metric name -> (EngineStats field, how series combine)
NAMES: dict[str, tuple[str, str]] = {
    "vllm:num_requests_waiting": ("waiting", "sum"),
    "vllm:num_requests_running": ("running", "sum"),
    "vllm:kv_cache_usage_perc": ("kv_usage", "max"),
    "vllm:gpu_cache_usage_perc": ("kv_usage", "max"),
    "vllm:prefix_cache_queries_total": ("prefix_queries", "sum"),
    "vllm:prefix_cache_hits_total": ("prefix_hits", "sum"),
    "sglang:num_queue_reqs": ("waiting", "sum"),
    "sglang:num_running_reqs": ("running", "sum"),
    "sglang:token_usage": ("kv_usage", "max"),
    "emulator:kv_fragmentation": ("fragmentation", "max"),
}


@dataclass(frozen=True)
class EngineStats:
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None  # 0..1
    fragmentation: float | None = None  # 0..1
    prefix_queries: float | None = None
    prefix_hits: float | None = None


def parse_engine_metrics(text: str) -> EngineStats:
    """Read the known figures out of Prometheus text exposition; unknown lines are skipped and a
    malformed line never raises."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end <= 0:
            continue
        target = NAMES.get(line[:name_end])
        if target is None:
            continue
        fields = line[line.rfind("}") + 1 if "}" in line else name_end :].split()
        try:
            value = float(fields[0])
        except (IndexError, ValueError):
            continue
        if not math.isfinite(value):
            continue
        field, how = target
        if field in found:
            found[field] = found[field] + value if how == "sum" else max(found[field], value)
        else:
            found[field] = value
    return EngineStats(**found)
