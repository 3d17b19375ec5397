"""The figures every part of the project reports, defined once (code, tests, benchmarks, console).

- KV hit rate: Σ cached prompt tokens / Σ prompt tokens.
- Jump rate: share of a session's later requests served by a different replica than its previous one.
- Load imbalance: coefficient of variation (population std / mean) of per-replica request counts.
- Percentiles: linear interpolation between closest ranks (numpy's default); every P50, P90 and
  P99 the benchmarks report comes from `percentile`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence


def kv_hit_rate(cached_tokens: float, prompt_tokens: float) -> float:
    return cached_tokens / prompt_tokens if prompt_tokens > 0 else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, interpolated between the two closest ranks; NaN
    when there are none. It stays within the values (statistics.quantiles' default, 'exclusive',
    reaches past the largest of a few), and P50 is the median."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def latency_summary(values: Sequence[float]) -> dict[str, float]:
    """n, mean, P50, P90 and P99 of some latencies ({"n": 0} for none): how every benchmark reports them."""
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def coefficient_of_variation(counts: Iterable[float]) -> float:
    xs = list(counts)
    if not xs:
        return math.nan
    mean = sum(xs) / len(xs)
    if mean == 0:
        return 0.0
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)) / mean


def jump_rate(turns_by_session: Mapping[str, Sequence[str]]) -> float:
    """Sessions' replicas in request order -> share of later requests that changed replica."""
    later = jumps = 0
    for replicas in turns_by_session.values():
        for prev, cur in itertools.pairwise(replicas):
            later += 1
            jumps += prev != cur
    return jumps / later if later else 0.0
