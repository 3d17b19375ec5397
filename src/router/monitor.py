"""The health control loop: probe every replica, score it, move its state, make the ring follow.

Every `probe_interval_s`, for each replica at once: `GET /health` (a refused connection, a time-out
or a 5xx fails the probe; an engine without the route, 404, is not held against it) and
`GET /metrics` (engine figures; missing ones stay missing), and for an engine that refuses models
it does not list (vLLM, the emulator) `GET /v1/models`: the models and adapters it serves, which
requests naming a model are routed by (router.fleet.Fleet.not_serving; pinned models win).
Passive figures come from the proxy:
the error share of the requests sent since the last probe (from 5 requests on), and the replica's
median time per output token, and median time to first token per prompt token computed, each
against the fleet's median (from 5 replies on each side; the latest 9 within the last 5 probe
intervals or 10 s, whichever is longer).
The score (router.health.score) moves the state machine (router.health.states), and the fleet
turns state and weight into ring availability and vnode weight: a removed replica's keys walk to
their ring successors and come back, with a weight ramp, when it recovers.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from router.fleet import Fleet, ReplicaState, recent_samples
from router.health.score import HealthInputs, ScoreWeights, health_score
from router.health.signals import (
    BY_KIND,
    LLAMA_CPP,
    EngineStats,
    lora_state,
    parse_engine_metrics,
    read_slots,
    with_slots,
)
from router.shm.table import SlotTable, TornRead

log = logging.getLogger("router.health")

MIN_SAMPLES = 5
SLOTS_EVERY = 15  # probe rounds between reads of a llama-server's /slots (30 s at the default interval)
# NVML clock event reasons that mean the GPU runs slower than it should: HW slowdown, SW thermal,
# HW thermal, HW power brake (a power cap alone is normal under load)
SLOWED_CLOCKS = 0x8 | 0x20 | 0x40 | 0x80
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineStats) if f.name != "kind")
LATENCY_WINDOW_PROBES = 5  # latency samples older than this many probe intervals are ignored,
LATENCY_WINDOW_MIN_S = 10.0  # or than this many seconds, whichever is longer


def listed_models(data: Any) -> frozenset[str] | None:
    """The model ids (adapters included: vLLM lists them with their `parent`) of a /v1/models
    answer; None when it lists none."""
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return None
    names = frozenset(e["id"] for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str) and e["id"])
    return names or None


def listed_adapters(data: Any) -> frozenset[str]:
    """The LoRA adapters of a /v1/models answer: vLLM lists each with its base model as `parent`."""
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return frozenset()
    return frozenset(
        e["id"]
        for e in entries
        if isinstance(e, dict)
        and isinstance(e.get("id"), str)
        and isinstance(e.get("parent"), str)
        and e["parent"]
        and e["parent"] != e["id"]
    )


def latency_window_s(probe_interval_s: float) -> float:
    return max(LATENCY_WINDOW_PROBES * probe_interval_s, LATENCY_WINDOW_MIN_S)


@dataclass
class _Window:
    requests: int = 0
    errors: int = 0


def peer_median(values: list[float], own: float | None) -> float | None:
    """The median of sorted `values` less one occurrence of `own` (None: `own` is not among
    them); None when no value is left."""
    if own is not None:
        at = bisect.bisect_left(values, own)
        values = values[:at] + values[at + 1 :]
    return statistics.median(values) if values else None


def _number(value: Any) -> float:
    """A reading's timestamp; anything that is not a number makes the reading stale."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


class HealthMonitor:
    def __init__(
        self,
        fleet: Fleet,
        client: Callable[[], aiohttp.ClientSession],
        interval_s: float,
        timeout_s: float,
        weights: ScoreWeights | None = None,
        agents: dict[str, str] | None = None,
        table: SlotTable | None = None,
        queue_weight: float = 0.0,
        before_round: Callable[[], None] | None = None,
        after_round: Callable[[], None] | None = None,
        inflight: Callable[[ReplicaState], int] | None = None,
    ) -> None:
        self.agents = {rid: url.rstrip("/") for rid, url in (agents or {}).items()}
        self.fleet = fleet
        self._client = client
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.weights = weights or ScoreWeights()
        self.table = table  # with worker processes: colocated agents' slots are read from here
        self.queue_weight = queue_weight
        self.before_round = before_round
        self.after_round = after_round
        # what the router has in flight at a replica (every worker's, with worker processes): read
        # the moment its engine's figures arrive, so that admission counts sends from then on
        self.inflight: Callable[[ReplicaState], int] = inflight or (lambda r: r.inflight)
        self._last: dict[str, _Window] = {}
        self.rounds = 0

    async def run(self) -> None:
        while True:
            try:
                await self.probe_once()
            except Exception:  # a bug in one round must not end health checking for good
                log.exception("health probe round failed")
            await asyncio.sleep(self.interval_s)

    async def probe_once(self) -> None:
        if self.before_round is not None:
            self.before_round()
        replicas = list(self.fleet.replicas)
        results, gpus = await asyncio.gather(
            asyncio.gather(*(self._probe(r) for r in replicas)), asyncio.gather(*(self._agent(r) for r in replicas))
        )
        now = time.monotonic()
        medians = self._fleet_medians(replicas, "tpot", now)
        first_token = self._fleet_medians(replicas, "ttft", now)
        queues = sorted(stats.waiting for ok, stats, *_ in results if ok and stats.waiting is not None)
        for replica, (ok, stats, read, listed, lora, sent), gpu in zip(replicas, results, gpus, strict=True):
            if replica.index is None:
                continue  # removed while we probed
            if read:  # else what was known stands
                self.fleet.set_models(replica, listed)
            if ok:
                self.fleet.set_adapters(replica, *lora)
            if ok and gpu:  # the engine's own figures win; the agent's fill what its /metrics lacks
                stats = EngineStats(
                    **{k: v if v is not None else gpu.get(k) for k, v in dataclasses.asdict(stats).items()}
                )
            replica.engine = stats
            replica.inflight_at_read = sent
            if stats.kind is not None:  # its engine answered (else the capacity last read stands)
                self.fleet.set_capacity(replica, stats.capacity)
            if self.queue_weight:
                self.fleet.set_queue_load(replica, round(self.queue_weight * (stats.waiting or 0.0)))
            inputs = HealthInputs(
                probe_ok=ok,
                waiting=stats.waiting,
                peer_waiting=peer_median(queues, stats.waiting if ok else None),
                waiting_before=None if replica.inputs is None else replica.inputs.waiting,
                kv_usage=stats.kv_usage,
                fragmentation=stats.fragmentation,
                error_rate=self._error_rate(replica),
                latency_ratio=self._ratio(replica, medians),
                ttft_ratio=self._ratio(replica, first_token),
                gpu_temperature_c=gpu.get("gpu_temperature_c"),
                gpu_slowed=gpu.get("gpu_slowed"),
                ecc_errors=gpu.get("ecc_errors"),
            )
            replica.inputs = inputs
            before = replica.state
            score = health_score(inputs, self.weights)
            replica.health.observe(score, now)
            if replica.state != before:  # what an operator asks first: why
                fields = dataclasses.asdict(inputs).items()
                said = {
                    k: v if isinstance(v, bool) else round(v, 3)
                    for k, v in fields
                    if v is not None and not (k == "probe_ok" and v)
                }
                log.info("replica %s: %s -> %s (score %.2f; %s)", replica.id, before, replica.state, score, said)
            self.fleet.apply_health(replica, now)
        self.rounds += 1
        if self.after_round is not None:
            self.after_round()

    async def _probe(
        self, replica: ReplicaState
    ) -> tuple[bool, EngineStats, bool, frozenset[str] | None, tuple[frozenset[str] | None, int | None], int | None]:
        """(whether it is up, its engine's figures, whether its models were read this time, the
        models it lists: None where it lists none or its engine does not check them, the LoRA
        adapters it has loaded and its max_lora: None where it does not say, what was in
        flight there when its figures arrived: None where none came)."""
        client = self._client()
        try:
            async with client.get(replica.url + "/health", timeout=self.timeout, headers=replica.auth) as resp:
                await resp.read()
                ok = resp.status < 500
                server = resp.headers.get("Server", "")
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False, EngineStats(), False, None, (None, None), None
        stats = EngineStats()
        sent: int | None = None
        lora: tuple[frozenset[str] | None, int | None] = (None, None)
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, UnicodeDecodeError):
            async with client.get(replica.url + "/metrics", timeout=self.timeout, headers=replica.auth) as resp:
                if resp.status == 200:
                    text = await resp.text()
                    sent = self.inflight(replica)  # the queue it reports holds what was sent until now
                    stats = parse_engine_metrics(text)
                    lora = lora_state(text)
        engine = BY_KIND.get(stats.kind or "")
        if engine is None and server.startswith("llama.cpp"):
            engine = LLAMA_CPP  # llama-server started without --metrics still lists its slots
        if engine is not None and engine.slots:
            last = replica.engine.capacity
            # its slots rarely change: read again every SLOTS_EVERY rounds, or when the metrics lack
            # what only they give (running, without --metrics)
            if last is None or stats.running is None or self.rounds % SLOTS_EVERY == 0:
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                    async with client.get(replica.url + "/slots", timeout=self.timeout, headers=replica.auth) as resp:
                        if resp.status == 200:
                            stats = with_slots(stats, read_slots(await resp.json(content_type=None)), engine)
            if stats.capacity is None and last is not None:
                stats = dataclasses.replace(stats, capacity=last, kind=stats.kind or engine.kind)
        read, listed = True, None
        if engine is not None and engine.checks_model:
            read = False
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                async with client.get(replica.url + "/v1/models", timeout=self.timeout, headers=replica.auth) as resp:
                    if resp.status == 200:
                        data = await resp.json(content_type=None)
                        read, listed = True, listed_models(data)
                        self.fleet.note_adapters(listed_adapters(data))
        return ok, stats, read, listed, lora, sent

    def _fresh(self, taken_at: float) -> bool:
        """Taken within the last three probe intervals (at least 3 s); a reading from more than
        5 s in the future (a clock gone wrong, or Infinity) is not fresh either."""
        age = time.time() - taken_at
        return -5.0 <= age <= 3 * max(self.interval_s, 1.0)

    def _agent_slot(self, replica: ReplicaState) -> dict[str, Any]:
        """The colocated agent's figures from shared memory, when it wrote them for this replica lately."""
        if self.table is None or replica.slot is None:
            replica.agent = "none"
            return {}
        try:
            row = self.table.read_agent(replica.slot)
        except TornRead:  # an agent died mid-write (or two write one slot): no usable reading
            replica.agent = "stale"
            return {}
        if row.replica_id != replica.id:
            replica.agent = "none"
            return {}
        if not self._fresh(row.updated_at):
            replica.agent = "stale"
            return {}  # it stopped writing: aged out
        replica.agent = "fresh"
        return {
            "gpu_temperature_c": row.temperature_c,
            "gpu_slowed": bool(row.throttle_reasons & SLOWED_CLOCKS) if row.throttle_reasons is not None else None,
            "ecc_errors": row.ecc_errors,
            "waiting": row.waiting,
            "running": row.running,
            "kv_usage": row.kv_usage,
            "fragmentation": row.fragmentation,
        }

    async def _agent(self, replica: ReplicaState) -> dict[str, Any]:
        """Inputs from the replica's router-agent (over HTTP, or its shared-memory slot), if it
        has one and its reading is fresh: GPU figures, and engine figures to fill gaps."""
        url = self.agents.get(replica.id)
        if url is None:
            return self._agent_slot(replica)
        try:
            async with self._client().get(url + "/stats", timeout=self.timeout) as resp:
                stats = await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            replica.agent = "gone"
            return {}  # routing goes on from probes and passive figures
        if not isinstance(stats, dict) or not self._fresh(_number(stats.get("taken_at"))):
            replica.agent = "stale"
            return {}  # aged out
        replica.agent = "fresh"
        gpus = [g for g in stats.get("gpus") or () if isinstance(g, dict)]
        temps = [g["temperature_c"] for g in gpus if isinstance(g.get("temperature_c"), (int, float))]
        reasons = [g["throttle_reasons"] for g in gpus if isinstance(g.get("throttle_reasons"), int)]
        ecc = [g["ecc_uncorrected"] for g in gpus if isinstance(g.get("ecc_uncorrected"), int)]
        engine = stats.get("engine")
        engine = engine if isinstance(engine, dict) else {}
        return {
            "gpu_temperature_c": max(temps) if temps else None,
            "gpu_slowed": any(r & SLOWED_CLOCKS for r in reasons) if reasons else None,
            "ecc_errors": sum(ecc) if ecc else None,
            **{k: v for k in ENGINE_FIELDS if isinstance(v := engine.get(k), (int, float))},
        }

    def _error_rate(self, replica: ReplicaState) -> float | None:
        last = self._last.setdefault(replica.id, _Window(replica.requests, replica.errors))
        requests, errors = replica.requests - last.requests, replica.errors - last.errors
        if requests < MIN_SAMPLES:
            return None  # too few to judge; keep counting into the next window
        self._last[replica.id] = _Window(replica.requests, replica.errors)
        return min(errors / requests, 1.0)

    def _fleet_medians(self, replicas: list[ReplicaState], kind: str, now: float) -> dict[str, float]:
        """Each replica's median of its recent `kind` samples ("tpot" or "ttft"), where it has enough."""
        medians = {}
        horizon = now - latency_window_s(self.interval_s)
        for r in replicas:
            pooled: tuple[float, int] | None = getattr(r, f"pooled_{kind}")
            if pooled is not None:  # gathered from worker processes
                median, samples = pooled
            else:
                recent = recent_samples(r, kind, horizon)
                samples = len(recent)
                median = statistics.median(recent) if recent else 0.0
            if samples >= MIN_SAMPLES:
                medians[r.id] = median
        return medians

    @staticmethod
    def _ratio(replica: ReplicaState, medians: dict[str, float]) -> float | None:
        if replica.id not in medians or len(medians) < 2:
            return None
        fleet = statistics.median(medians.values())
        return medians[replica.id] / fleet if fleet > 0 else None
