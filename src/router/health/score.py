"""The health score: one pure function from a replica's signals to a number in [0, 1].

Each signal becomes a penalty in [0, 1] that is 0 while the signal is normal and grows linearly to
1 between two thresholds; the score is the product of (1 - weight x penalty) over the signals, so
one alarming signal is enough to sink it and several mild ones add up. A failed probe scores 0. A
missing signal (None) carries no penalty: not knowing is not being sick.

| signal | penalty 0 at | penalty 1 at | why |
|---|---|---|---|
| queue: waiting beyond its peers' median, unless shrinking | 8 | 64 | a queue means the engine cannot admit work |
| memory: KV usage while more wait than at its peers | 0.90 | 1.00 | full KV with a queue is pressure; else busy |
| fragmentation of held KV | 0.30 | 0.80 | blocks held but unused shrink the real capacity |
| error rate (router-observed) | 0.05 | 0.50 | failing requests |
| latency: time per output token vs the fleet's median (see below) | 2x | 4x | much slower than its peers on like work |
| first token: TTFT per prompt token computed, sent while idle, vs the fleet's | 3x | 6x | slow prefill |
| GPU temperature, hottest GPU (agent) | 85 C | 95 C | heat throttling is near |
| GPU clocks slowed (agent: thermal, power brake, HW slowdown) | — | yes | every step runs slower |
| uncorrected ECC errors (agent) | 0 | 1 or more | the GPU's memory is failing |

Time per output token is sampled only from replies whose replica was sent little of others'
prefill while they ran (router.fleet.TPOT_PREFILL_TOKENS prompt tokens sent there per token
decoded; what was queued before a reply began is not counted):
chunked prefill stretches every decode step beside a long prompt, and a replica given a long
document is busy, not sick (on the Mooncake traces such replicas measured 4 to 33 times their
peers' time per token and were taken out of routing, their sessions moved off their caches).

Queue and memory are counted against the replica's peers (`peer_waiting`: the median of the
others' waiting, this round): when the whole fleet is overloaded every engine has a queue and a
full KV cache, and removing the ones that happen to have a little more would only hand their
traffic to the rest (the cascade that takes a fleet down under a surge). A replica with no peers
probed is counted as it is. A queue shorter than at the last probe (`waiting_before`) is work
being done and carries no penalty: at the end of a surge the replica given the most drains last,
its peers idle beside it, and is no more sick than they are; a stuck engine's queue does not
shrink.

Worked example: waiting = 36, its peers' median 0 (queue penalty 0.5), everything else normal, default weights:
score = 1 - 0.5 = 0.5; the same replica with a GPU held down by heat (slowdown weight 0.5):
0.5 x 0.5 = 0.25. A busy replica (running 200, KV 97% full, nothing waiting) scores 1.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HealthInputs:
    probe_ok: bool = True
    waiting: float | None = None
    peer_waiting: float | None = None  # the median of the other replicas' waiting, this round (None: no peer)
    waiting_before: float | None = None  # its waiting at the last probe (None: not known)
    kv_usage: float | None = None
    fragmentation: float | None = None
    error_rate: float | None = None
    latency_ratio: float | None = None  # replica's time per output token / the fleet's median
    ttft_ratio: float | None = None  # replica's time to first token per prompt token / the fleet's median
    gpu_temperature_c: float | None = None  # the hottest GPU's, from router-agent
    gpu_slowed: bool | None = None  # any GPU's clocks held down by heat or power, from router-agent
    ecc_errors: int | None = None  # uncorrected ECC errors, from router-agent


@dataclass(frozen=True)
class ScoreWeights:
    queue: float = 1.0
    memory: float = 1.0
    fragmentation: float = 0.5
    errors: float = 1.0
    latency: float = 1.0
    ttft: float = 1.0
    temperature: float = 1.0
    slowdown: float = 0.5
    ecc: float = 1.0
    queue_from: float = 8.0
    queue_to: float = 64.0
    memory_from: float = 0.90
    memory_to: float = 1.00
    fragmentation_from: float = 0.30
    fragmentation_to: float = 0.80
    errors_from: float = 0.05
    errors_to: float = 0.50
    latency_from: float = 2.0
    latency_to: float = 4.0
    ttft_from: float = 3.0
    ttft_to: float = 6.0
    temperature_from: float = 85.0
    temperature_to: float = 95.0

    def __post_init__(self) -> None:
        for name in (
            "queue",
            "memory",
            "fragmentation",
            "errors",
            "latency",
            "ttft",
            "temperature",
            "slowdown",
            "ecc",
        ):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"weight {name} must be in [0, 1]")
        for name in ("queue", "memory", "fragmentation", "errors", "latency", "ttft", "temperature"):
            if not getattr(self, f"{name}_from") < getattr(self, f"{name}_to"):
                raise ValueError(f"{name}_from must be below {name}_to")


def ramp(value: float | None, start: float, end: float) -> float:
    """0 at or below `start`, 1 at or above `end`, linear between; 0 for a missing value."""
    if value is None or value <= start:
        return 0.0
    if value >= end:
        return 1.0
    return (value - start) / (end - start)


def health_score(inputs: HealthInputs, weights: ScoreWeights | None = None) -> float:
    if not inputs.probe_ok:
        return 0.0
    w = weights or ScoreWeights()
    # a queue like its peers' is the fleet's load, not this replica's trouble
    waiting, before = inputs.waiting, inputs.waiting_before
    excess = None if waiting is None else waiting - (inputs.peer_waiting or 0.0)
    if waiting is not None and before is not None and waiting < before:
        excess = 0.0  # draining: the engine is getting through its queue
    penalties = (
        (w.queue, ramp(excess, w.queue_from, w.queue_to)),
        (w.memory, ramp(inputs.kv_usage, w.memory_from, w.memory_to) if (excess or 0.0) > 0 else 0.0),
        (w.fragmentation, ramp(inputs.fragmentation, w.fragmentation_from, w.fragmentation_to)),
        (w.errors, ramp(inputs.error_rate, w.errors_from, w.errors_to)),
        (w.latency, ramp(inputs.latency_ratio, w.latency_from, w.latency_to)),
        (w.ttft, ramp(inputs.ttft_ratio, w.ttft_from, w.ttft_to)),
        (w.temperature, ramp(inputs.gpu_temperature_c, w.temperature_from, w.temperature_to)),
        (w.slowdown, 1.0 if inputs.gpu_slowed else 0.0),
        (w.ecc, 1.0 if inputs.ecc_errors else 0.0),
    )
    score = 1.0
    for weight, penalty in penalties:
        score *= 1.0 - weight * penalty
    return min(max(score, 0.0), 1.0)
