"""What a `router-bench fleet` run reads beside its client: router-serve's own /metrics before and
after (how well it predicted cached tokens, whose KV events it believed), and the replicas'
counters sampled during the run (`Sampler`), with the load, busy and engine figures made of them."""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.bench.replicas import Fleet, Sample
from router.bench.vllm import VLLM_COUNTERS
from router.measures import coefficient_of_variation

PREDICTION_SOURCES = ("events", "model")  # router_prefix_prediction_error_tokens{source}
EVENTS_READY_S = 30.0  # router-serve believes every replica's KV events within this, or the run goes on without


@dataclass(frozen=True)
class RouterCounts:
    """What one read of router-serve's /metrics says of its predictions: per source, the answers
    checked and the cumulative counts of the error histogram (predicted minus reported cached
    tokens) by upper bound; per replica, whether its KV events are believed; per tokenizing source,
    the requests tokenized and their seconds; the router's own tokens checked against the engine's."""

    errors: dict[str, dict[float, float]]  # source -> {le: answers with an error <= le}
    believed: dict[str, float]  # replica -> router_kv_events_believed
    tokenized: dict[str, tuple[float, float]]  # source -> (count, seconds)
    checks: dict[str, float]  # router_token_checks by result: match, mismatch, error
    disagg: dict[str, float] = field(default_factory=dict)  # router_disagg_requests by mode (split, alone, ...)
    tokenizers: dict[str, float] = field(default_factory=dict)  # router_tokenizer by source, over its models
    jumps: dict[str, float] = field(default_factory=dict)  # router_session_jumps by reason
    followups: float = 0.0  # router_session_followups: the jump rate's denominator
    retries: dict[str, float] = field(default_factory=dict)  # router_retries by cause (timeout, reset, ...)
    gone: float = 0.0  # router_requests with status 499: answers whose client left before their end

    @classmethod
    def parse(cls, text: str) -> RouterCounts:
        errors: dict[str, dict[float, float]] = {}
        believed: dict[str, float] = {}
        tokenized: dict[str, list[float]] = {}
        checks: dict[str, float] = {}
        disagg: dict[str, float] = {}
        tokenizers: dict[str, float] = {}
        jumps: dict[str, float] = {}
        retries: dict[str, float] = {}
        followups = gone = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sample.labels
                if sample.name == "router_prefix_prediction_error_tokens_bucket":
                    errors.setdefault(labels.get("source", ""), {})[float(labels["le"])] = sample.value
                elif sample.name == "router_kv_events_believed":
                    believed[labels.get("replica", "")] = sample.value
                elif sample.name in ("router_tokenize_seconds_count", "router_tokenize_seconds_sum"):
                    pair = tokenized.setdefault(labels.get("source", ""), [0.0, 0.0])
                    pair[sample.name.endswith("_sum")] = sample.value
                elif sample.name == "router_token_checks_total":
                    result = labels.get("result", "")
                    checks[result] = checks.get(result, 0.0) + sample.value
                elif sample.name == "router_disagg_requests_total":
                    disagg[labels.get("mode", "")] = sample.value
                elif sample.name == "router_tokenizer":
                    source = labels.get("source", "")
                    tokenizers[source] = tokenizers.get(source, 0.0) + sample.value
                elif sample.name == "router_session_jumps_total":
                    jumps[labels.get("reason", "")] = sample.value
                elif sample.name == "router_session_followups_total":
                    followups = sample.value
                elif sample.name == "router_retries_total":
                    retries[labels.get("cause", "")] = sample.value
                elif sample.name == "router_requests_total" and labels.get("status") == "499":
                    gone += sample.value
        tokens = {k: (v[0], v[1]) for k, v in tokenized.items()}
        return cls(errors, believed, tokens, checks, disagg, tokenizers, jumps, followups, retries, gone)

    def all_believed(self, replicas: int) -> bool:
        return len(self.believed) >= replicas and all(v == 1 for v in self.believed.values())

    def tokenizer_found(self) -> bool:
        """A model's tokenizer is found (from the replicas' /v1/models), not only learnt."""
        return any(v > 0 for source, v in self.tokenizers.items() if source != "learnt")


def prediction_figures(before: RouterCounts, after: RouterCounts) -> dict[str, Any]:
    """A run's predictions, per source (the histograms' changes between two reads): answers checked,
    those predicted to the token (the bucket (-0.5, 0.5]), under (the engine had more cached) and
    over, and the share exact; `exact_predicted_<source>` is that share (nan without answers)."""
    out: dict[str, Any] = {"predictions": {}}
    for source in PREDICTION_SOURCES:
        end, start = after.errors.get(source, {}), before.errors.get(source, {})
        cum = {le: n - start.get(le, 0.0) for le, n in end.items()}
        answers = cum.get(math.inf, 0.0)
        under, upto = cum.get(-0.5, 0.0), cum.get(0.5, 0.0)
        exact = upto - under
        out["predictions"][source] = {
            "answers": answers,
            "exact": exact,
            "under": under,
            "over": answers - upto,
            "buckets": {("+Inf" if math.isinf(le) else f"{le:g}"): n for le, n in sorted(cum.items())},
        }
        out[f"predicted_answers_{source}"] = answers
        out[f"exact_predicted_{source}"] = exact / answers if answers else math.nan
    out["kv_events_believed"] = dict(after.believed)
    out["tokenize"] = {
        source: {
            "count": count - before.tokenized.get(source, (0.0, 0.0))[0],
            "seconds": seconds - before.tokenized.get(source, (0.0, 0.0))[1],
        }
        for source, (count, seconds) in after.tokenized.items()
    }
    out["token_checks"] = {k: n - before.checks.get(k, 0.0) for k, n in after.checks.items()}
    # its sessions moved, by why (the router's own count): `cost` is the one its price chose
    moved = {k: n - before.jumps.get(k, 0.0) for k, n in after.jumps.items() if n - before.jumps.get(k, 0.0)}
    followups = after.followups - before.followups
    out["jumps_by_reason"] = moved
    out["cost_move_share"] = moved.get("cost", 0.0) / followups if followups else math.nan
    # answers it counted as their client gone (499): none where the client waits for every end
    # (a run not cut off at its duration); one closed at [DONE] was counted so once (forward.py)
    out["client_gone"] = after.gone - before.gone
    # its attempts that failed before their first byte, by cause (each retried where attempts
    # remained): what a failed request met on the way, for its progress line
    out["router_retries"] = {
        k: n - before.retries.get(k, 0.0) for k, n in after.retries.items() if n - before.retries.get(k, 0.0)
    }
    if after.disagg:  # with prefill replicas: how its requests were served, split or whole
        modes = {k: n - before.disagg.get(k, 0.0) for k, n in after.disagg.items()}
        out["disagg_modes"] = modes
        out["split_share"] = modes.get("split", 0.0) / sum(modes.values()) if sum(modes.values()) else math.nan
    return out


async def router_counts(url: str) -> RouterCounts | None:
    """One read of router-serve's /metrics; None when it did not answer."""
    with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError, ValueError):
        async with (
            aiohttp.ClientSession() as http,
            http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r,
        ):
            r.raise_for_status()
            return RouterCounts.parse(await r.text())
    return None


async def events_believed(url: str, replicas: int, timeout: float = EVENTS_READY_S) -> float | None:
    """Seconds until router-serve at `url` believes every replica's KV events (it finds them through
    /kv_event_sources every few seconds, then replays what they hold) and has found their model's
    tokenizer (it asks their /v1/models once they are believed); None if not within `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        counts = await router_counts(url)
        if counts is not None and counts.all_believed(replicas) and counts.tokenizer_found():
            return time.monotonic() - t0
        await asyncio.sleep(0.25)
    return None


# -- the fleet's own counters ---------------------------------------------------------------------


@dataclass
class Sampler:
    fleet: Fleet
    interval_s: float
    samples: list[Sample] = field(default_factory=list)
    first: asyncio.Event = field(default_factory=asyncio.Event)  # the first sample was taken (or failed)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def take(self, http: aiohttp.ClientSession, t0: float) -> None:
        self.samples.append(await self.fleet.read(http, time.perf_counter() - t0))

    async def run(self, t0: float) -> None:
        async with aiohttp.ClientSession() as http:
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError, KeyError, ValueError):
                    try:
                        await self.take(http, t0)
                    finally:
                        self.first.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.interval_s)
            with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError, KeyError, ValueError):
                await self.take(http, t0)  # the final counters

    def stop(self) -> None:
        self._stop.set()


def fleet_figures(samples: list[Sample], window_end_wall_s: float) -> dict[str, Any]:
    """Load and busy figures from the emulators' counters: requests each replica finished (from the
    first sample, taken as the replay starts, to the last); GPU busy share and in-flight spread
    while arrivals lasted (first sample to the last one before `window_end_wall_s`)."""
    if len(samples) < 2:
        return {"gpu_busy": math.nan, "load_cv": math.nan, "inflight_cv": math.nan, "finished": []}
    window = [s for s in samples if s.wall_s <= window_end_wall_s] or samples[:2]
    if len(window) < 2:
        window = samples[:2]
    first, last = window[0], window[-1]
    busy = [
        (b1 - b0) / (e1 - e0) if e1 > e0 else 0.0
        for b0, b1, e0, e1 in zip(first.busy_s, last.busy_s, first.engine_s, last.engine_s, strict=True)
    ]
    # requests each replica finished from the replay's start (not the routers' readiness request)
    finished = [b - a for a, b in zip(samples[0].finished, samples[-1].finished, strict=True)]
    loaded = [s for s in window if sum(s.queued) > 0]
    out = {
        "gpu_busy": sum(busy) / len(busy),
        "gpu_busy_per_replica": busy,
        "finished": finished,
        "load_cv": coefficient_of_variation(finished),
        "inflight_cv": statistics.fmean(coefficient_of_variation(s.queued) for s in loaded) if loaded else math.nan,
    }
    if samples[0].counters is not None and samples[-1].counters is not None:
        out |= engine_figures(samples[0].counters, samples[-1].counters)
    return out


def engine_figures(start: dict[str, float], end: dict[str, float]) -> dict[str, float]:
    """A run's figures from vLLM's own counters (VLLM_COUNTERS, fleet totals at its start and end):
    its hit rate (hit ÷ queried prompt tokens), preemptions, and the mean time to first token, time
    waiting and time in prefill of the requests that finished."""
    d = {name: end[name] - start[name] for name in VLLM_COUNTERS}

    def ratio(a: str, b: str) -> float:
        return d[a] / d[b] if d[b] > 0 else math.nan

    return {
        "engine_cache_queries": d["vllm:prefix_cache_queries_total"],
        "engine_cache_hits": d["vllm:prefix_cache_hits_total"],
        "engine_kv_hit_rate": ratio("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
        "preemptions": d["vllm:num_preemptions_total"],
        "engine_ttft_mean_s": ratio("vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count"),
        "engine_queue_mean_s": ratio("vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count"),
        "engine_prefill_mean_s": ratio(
            "vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count"
        ),
    }
