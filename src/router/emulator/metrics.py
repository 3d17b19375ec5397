"""Prometheus metrics of one emulated replica, under vLLM's names, plus a few of the emulator's own.

Anything built to scrape vLLM (the router's health checks, dashboards) works against the
emulator unchanged. Times are engine seconds: what the emulated GPU would show, whatever the
emulator's time scale. Gauges are read from the engine at scrape time.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.emulator.engine import Engine, Sequence

LORA_SERIES = 64  # LoRA states whose series are kept (vLLM keeps every one)
# vLLM's bucket edges for these histograms
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
BUSY_WINDOW_S = 10.0


class ReplicaMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        label = ["model_name"]
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", label, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", label, registry=r)
        self.waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Requests waiting, by reason: capacity (for room in the batch), deferred (for a LoRA slot).",
            [*label, "reason"],
            registry=r,
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", label, registry=r
        )
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", label, registry=r
        )
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", label, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", label, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.", label, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests.", [*label, "finished_reason"], registry=r)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", label, buckets=TTFT_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", label, buckets=E2E_BUCKETS, registry=r
        )
        self.fragmentation = Gauge(
            "emulator:kv_fragmentation",
            "Unused token slots in KV blocks held by running requests / slots held (0..1).",
            label,
            registry=r,
        )
        self.busy = Gauge(
            "emulator:gpu_busy_fraction",
            f"Share of the last {BUSY_WINDOW_S:g} engine seconds spent running steps (0..1).",
            label,
            registry=r,
        )
        self.max_num_seqs = Gauge(
            "emulator:max_num_seqs", "Requests the engine runs at once at most (its batch).", label, registry=r
        )
        self.busy_seconds = Counter("emulator:busy_seconds", "Engine seconds spent running steps.", label, registry=r)
        # vLLM's NixlConnector's, on a decode replica that read a remote prefill's KV
        self.transfer_time = Histogram(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            label,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0),
            registry=r,
        )
        self.failed_transfers = Counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers, including handshake and notification failures.",
            label,
            registry=r,
        )
        # vLLM's own: its KV-cache shape as labels of a gauge at 1 (routers size their prefix index by it)
        self.cache_config = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig.",
            ["block_size", "num_gpu_blocks", "enable_prefix_caching"],
            registry=r,
        )
        self._cache_shape: tuple[str, str, str] | None = None  # the labels it carries now
        # vLLM's LoRA state (only with adapters): a series per state seen, its value the time it was
        # last current, so the newest series is the state now and the older ones say which adapters
        # ran lately; vLLM keeps every one, the emulator the latest LORA_SERIES
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=r,
        )
        self._lora_series: OrderedDict[tuple[str, str, str], None] = OrderedDict()  # least recently current first
        self.model = model
        self._steps: deque[tuple[float, float]] = deque()  # (end, duration) of recent steps
        # (running, waiting, deferred) as the last step left them: vLLM sets its queue gauges as it
        # records a step, so a request that arrived since is in neither count until the step after
        # it (measured on vLLM 0.32: eight requests sent at once read 0 and 0, then 4 and 4)
        self._queues = (0, 0, 0)

    def on_step(self, end: float, duration: float, tokens: int) -> None:
        self._steps.append((end, duration))
        while self._steps[0][0] <= end - BUSY_WINDOW_S:  # bounded even if nobody scrapes
            self._steps.popleft()
        self.busy_seconds.labels(self.model).inc(duration)
        self.generation_tokens.labels(self.model).inc(tokens)

    def on_recorded(self, engine: Engine) -> None:
        """A step's end: its queues as the gauges will show them until the next one."""
        self._queues = (len(engine.running), len(engine.waiting), engine.deferred())

    def on_admitted(self, seq: Sequence) -> None:
        self.prefix_queries.labels(self.model).inc(seq.prompt_tokens)
        self.prefix_hits.labels(self.model).inc(seq.cached_tokens)
        self.prompt_tokens.labels(self.model).inc(seq.prompt_tokens)

    def on_finished(self, seq: Sequence) -> None:
        assert seq.finished_at is not None and seq.first_token_at is not None
        self.success.labels(self.model, "length").inc()
        self.ttft.labels(self.model).observe(seq.first_token_at - seq.arrival)
        self.e2e.labels(self.model).observe(seq.finished_at - seq.arrival)

    def on_lora(self, engine: Engine) -> None:
        """The engine's adapters after a step (vLLM records them every step): a state that differs
        from the last one becomes current, and the last one's series keeps the time it ended."""
        labels = (
            str(engine.config.max_loras),
            ",".join(engine.running_adapters()),
            ",".join(engine.waiting_adapters()),
        )
        series = self._lora_series
        current = next(reversed(series), None)
        if labels == current:
            return
        now = time.time()
        if current is not None:
            self.lora_info.labels(*current).set(now)
        series.pop(labels, None)
        series[labels] = None
        if len(series) > LORA_SERIES:
            self.lora_info.remove(*series.popitem(last=False)[0])
        self.lora_info.labels(*labels).set(now)

    def busy_fraction(self, now: float) -> float:
        start = now - BUSY_WINDOW_S
        while self._steps and self._steps[0][0] <= start:
            self._steps.popleft()
        busy = sum(min(d, end - start) for end, d in self._steps)
        return min(busy / BUSY_WINDOW_S, 1.0)

    def render(self, engine: Engine, now: float, adapters: bool = False) -> bytes:
        m = self.model
        if adapters:
            self.on_lora(engine)
            self.lora_info.labels(*next(reversed(self._lora_series))).set(time.time())  # current until now
        # an engine with nothing left (the last request cancelled while it waited) shows none
        running, waiting, deferred = self._queues if engine.has_work() else (0, 0, 0)
        self.running.labels(m).set(running)
        self.waiting.labels(m).set(waiting)
        self.waiting_by_reason.labels(m, "capacity").set(waiting - deferred)
        self.waiting_by_reason.labels(m, "deferred").set(deferred)
        self.kv_usage.labels(m).set(engine.cache.usage)
        self.fragmentation.labels(m).set(engine.fragmentation())
        self.busy.labels(m).set(self.busy_fraction(now))
        self.max_num_seqs.labels(m).set(engine.config.max_num_seqs)
        cfg = engine.config
        shape = (str(cfg.block_size), str(cfg.num_blocks), "True")
        if shape != self._cache_shape:  # a restart may come back with another shape
            if self._cache_shape is not None:
                self.cache_config.remove(*self._cache_shape)
            self._cache_shape = shape
        self.cache_config.labels(*shape).set(1)
        return generate_latest(self.registry)
