"""The router's Prometheus metrics: every name and its definition, in one table.

Code, tests, benchmarks and the console read these names from here. Derived figures use the
definitions in router.measures: per-replica KV hit rate = cached / prompt tokens; jump rate =
session_jumps / session_followups.

Long because TABLE spells out every metric's help text (some 200 lines of definitions); the rest is
made from it (the registry the code increments, the per-replica gauges a scrape shows) and stays
beside it.

It is past 450 lines because every metric's name and definition is in one table by design (one place
for each fact), with the methods that record them beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess, values
from prometheus_client.core import GaugeMetricFamily

from router.fleet import Fleet
from router.health.score import HealthInputs
from router.health.states import STATES

INPUTS = tuple(f.name for f in dataclasses.fields(HealthInputs))

# predicted minus reported cached tokens: exact in (-0.5, 0.5], then by powers of 4, either way
ERROR_BUCKETS = (
    *(-float(4**k) for k in range(8, 0, -1)),
    -1.5,
    -0.5,
    0.5,
    1.5,
    *(float(4**k) for k in range(1, 9)),
)
TOKENIZE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5)
BUCKETS = {
    "router_prefix_prediction_error_tokens": ERROR_BUCKETS,
    "router_tokenize_seconds": TOKENIZE_BUCKETS,
    "router_kv_event_lag_seconds": TOKENIZE_BUCKETS,
}

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# name: (kind, help, labels)
TABLE: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "router_requests": (
        "counter",
        "Requests answered, by replica (none: not routed), policy, key kind, status and model (a name "
        "some replica serves; other: any other name; none: the request named no model).",
        ("replica", "policy", "key_kind", "status", "model"),
    ),
    "router_tenant_requests": (
        "counter",
        "Requests answered with client keys on (client_keys_file), by tenant and key id (none: no valid key) "
        "and status.",
        ("tenant", "key_id", "status"),
    ),
    "router_class_requests": (
        "counter",
        "Requests answered, by the priority class each got (X-Priority capped by its tenant's class) and status.",
        ("priority", "status"),
    ),
    "router_tenant_tokens": (
        "counter",
        "Tokens of the answers served to each tenant (client_keys_file), by kind: prompt or completion.",
        ("tenant", "kind"),
    ),
    "router_inflight": ("gauge", "Requests in flight to each replica.", ("replica",)),
    "router_ttft_seconds": (
        "histogram",
        "Time from request to the first response byte sent to the client.",
        ("replica",),
    ),
    "router_e2e_seconds": ("histogram", "Time from request to the last response byte.", ("replica",)),
    "router_prompt_tokens": ("counter", "Prompt tokens reported by replicas (usage.prompt_tokens).", ("replica",)),
    "router_cached_tokens": (
        "counter",
        "Cached prompt tokens reported by replicas (usage.prompt_tokens_details.cached_tokens).",
        ("replica",),
    ),
    "router_prefix_prompt_tokens": (
        "counter",
        "Prompt tokens of the requests the ttft policy predicted a cached prefix for and whose answer reported "
        "usage (the denominator of the predicted and the reported hit rate).",
        ("replica",),
    ),
    "router_prefix_prediction_error_tokens": (
        "histogram",
        "Per answer that reported usage, the cached prompt tokens the ttft decision counted on at the replica "
        "that answered minus those it reported, by where the prediction came from: events (its engine's "
        "KV-cache events) or model (the router's record of what it sent). Exact predictions fall in the "
        "bucket (-0.5, 0.5].",
        ("source",),
    ),
    "router_tokenize_seconds": (
        "histogram",
        "Time to cut a request into its engine's tokens for the event-fed index, by source: tokenizer (the "
        "model's own, in the router, on the request's path), learnt (its history's tokens found, on the path) "
        "or engine (a conversation tokenized by an engine in the background, off the path); reply: a chat's answer "
        "kept for its next turn, after it has gone.",
        ("source",),
    ),
    "router_token_checks": (
        "counter",
        "The router's tokens checked against its engine's (render where served, else /tokenize), off the "
        "request's path, by model and result: match, mismatch (the tokenizer is not the engine's: not used), "
        "unchecked (the engine refuses both endpoints) or error (no answer).",
        ("model", "result"),
    ),
    "router_tokenizer": (
        "gauge",
        "1 (with worker processes: the number of workers) for what each model's requests are tokenized with: "
        "its tokenizer found from a configured folder "
        "(configured), the engine's model folder (path), the Hugging Face hub (hub), router-emulator's built-in "
        "(builtin), or none yet (learnt: histories tokenized by the engines in the background).",
        ("model", "source"),
    ),
    "router_kv_event_blocks": (
        "gauge",
        "Blocks each replica's engine holds, as its KV-cache events say, by medium (GPU, CPU, ...).",
        ("replica", "medium"),
    ),
    "router_kv_events_believed": (
        "gauge",
        "1 while a replica's KV-cache events are followed without a gap (it is priced by them), 0 while they "
        "are not believed (a gap replay could not fill, a health outage: it is priced by the router's model).",
        ("replica",),
    ),
    "router_kv_events_unfollowed": (
        "gauge",
        "Replicas that publish KV-cache events the router does not follow: each would take its event-fed "
        "index past kv_events_max_mib, or found no room in shared memory (/dev/shm) for its blocks (they are "
        "priced by the router's model).",
        (),
    ),
    "router_kv_event_lag_seconds": (
        "histogram",
        "From a KV-cache event batch's timestamp (its engine's clock) to the router applying it to its index, "
        "live batches only (not replayed ones); across hosts it includes the clocks' offset.",
        (),
    ),
    "router_prefix_predicted_tokens": (
        "counter",
        "Cached prompt tokens the prefix index predicted for those requests (predicted hit rate = this / "
        "router_prefix_prompt_tokens).",
        ("replica",),
    ),
    "router_prefix_reported_tokens": (
        "counter",
        "Cached prompt tokens the replicas reported for those requests (reported hit rate = this / "
        "router_prefix_prompt_tokens).",
        ("replica",),
    ),
    "router_prefix_error_tokens": (
        "counter",
        "|predicted - reported| cached tokens of those requests (prediction error = this / "
        "router_prefix_prompt_tokens).",
        ("replica",),
    ),
    "router_prefix_index_blocks": (
        "gauge",
        "Blocks the prefix index says each replica holds (each block is prefix_block_bytes of prompt).",
        ("replica",),
    ),
    "router_session_followups": ("counter", "Requests of a session seen before (the jump rate's denominator).", ()),
    "router_session_jumps": (
        "counter",
        "Requests served by a different replica than their session's previous one, by reason: spill "
        "(load cap), failover (retry), health (previous replica removed), drain, membership (previous "
        "replica left), migration (overheat rebalancing), scale_out, ring (owner changed, "
        "consistent_hash), round_robin, least_load, cost (ttft: moving saved more time than it cost the fleet: "
        "its recompute, the requests that waited for it, the context it evicted), prefix (ttft: a request "
        "without a session id, keyed by its opening message, placed by its prompt away from where that "
        "opening went last: another conversation may open alike, so not necessarily a session moving), target "
        "(ttft: the request's x-slo-ttft-ms target was predicted met only on another replica).",
        ("reason",),
    ),
    "router_retries": (
        "counter",
        "Upstream attempts that failed before the first byte, by cause; each is retried "
        "on another replica while attempts remain.",
        ("cause",),
    ),
    "router_upstream_reconnects": (
        "counter",
        "Requests sent again, at once, on a new connection to the same replica because the connection they "
        "went out on closed before any answer: a pooled keep-alive connection the replica had closed (as "
        "llama-server does after every stream). Not a replica error; a replica that then refuses the new "
        "connection is retried elsewhere as usual.",
        ("replica",),
    ),
    "router_queued": (
        "gauge",
        "Requests waiting in the router because every replica for their model is full (max_queued).",
        (),
    ),
    "router_shed": (
        "counter",
        "Requests answered 429 because every replica for their model was full: queue_full (max_queued "
        "were waiting already, or a request of a higher class took the place), timeout (they waited "
        "queue_timeout_s), sheddable (a sheddable request does not wait) or target (a sheddable request "
        "no replica was predicted to serve within its x-slo-ttft-ms), budget (its tenant's tokens_per_minute "
        "were spent) or cold (a 503: no replica of its model became ready within scale_from_zero_s); model as "
        "for router_requests; priority: the request's class.",
        ("reason", "model", "priority"),
    ),
    "router_queue_wait_seconds": (
        "histogram",
        "How long requests held in the router waited before going on to a replica.",
        (),
    ),
    "router_disagg_requests": (
        "counter",
        "Requests of a fleet with prefill replicas (or prefill_anywhere), by how each attempt at a decode "
        "replica was served (a retried request counts each): split (prefilled on a prefill replica, "
        "decoded on another), moved (a session moved from a replica still up, which prefilled its turn "
        "from its cache: its KV travelled), alone (not worth splitting: served by the decode replica), "
        "fallback (no prefill replica answered: the decode replica recomputed the prompt), recomputed "
        "(the decode replica failed the transfer and served it alone) or cold (its decode replica had met "
        "no prefill replica yet: served there alone while the router introduces them).",
        ("mode",),
    ),
    "router_disagg_abandoned_prefills": (
        "counter",
        "Prefills whose KV no decode replica read, by why: transfer_failed (the decode replica failed "
        "the transfer and recomputed the prompt), lease_over (the next decode replica came after the "
        "lease: prefilled again), strangers (the next decode replica had not met that prefill replica: "
        "prefilled again), no_decode (the request ended without another decode replica). The "
        "prefill replica holds their blocks until its lease runs out (vLLM: 30 s).",
        ("why",),
    ),
    "router_disagg_pair_meetings": (
        "counter",
        "The router's introductions of a prefill replica to a decode replica (a split request of its own, "
        "so that no client's request pays the engines' first handshake), by outcome: met or failed.",
        ("outcome",),
    ),
    "router_disagg_pair_meeting_seconds": (
        "histogram",
        "How long each introduction of a prefill replica to a decode replica took (the engines' "
        "handshake included), met or failed.",
        (),
    ),
    "router_disagg_leg_seconds": (
        "histogram",
        "The legs of split requests: prefill (from the request to the prefill replica to its answer, the "
        "KV's params), transfer (from the request to the decode replica to its first byte: it reads the "
        "prefilled KV, then computes the first token) and decode (from that first byte to the last).",
        ("leg",),
    ),
    "router_failovers": ("counter", "Requests that succeeded on a replica other than their first choice.", ()),
    "router_replica_score": ("gauge", "Each replica's latest health score (0..1).", ("replica",)),
    "router_replica_routable": (
        "gauge",
        "1 while a replica takes new requests (healthy, suspect, recovering, warming), 0 while removed or draining.",
        ("replica",),
    ),
    "router_replica_state": (
        "gauge",
        "1 for each replica's current health state (healthy, suspect, removed, recovering, draining, warming), "
        "0 for the others.",
        ("replica", "state"),
    ),
    "router_replica_role": (
        "gauge",
        "1 for each replica's role: both (aggregated), decode, or prefill (prefill/decode disaggregation; "
        "prefill replicas are in the other per-replica gauges too).",
        ("replica", "role"),
    ),
    "router_replica_health_input": (
        "gauge",
        "The inputs of each replica's latest health score: waiting, kv_usage, fragmentation, error_rate, "
        "latency_ratio, gpu_temperature_c, gpu_slowed, ecc_errors, probe_ok; absent while unknown.",
        ("replica", "input"),
    ),
    "router_replica_state_changes": (
        "gauge",
        "Health state changes of each replica since the router started.",
        ("replica",),
    ),
    "router_warmup_requests": (
        "counter",
        "Prefill-only warm-up requests the router sent before moving sessions, by result (ok: computed "
        "there, moved: its KV read from the replica the session left, with prefill_anywhere, failed, "
        "skipped: not sent before the warm-up time-out).",
        ("result",),
    ),
    "router_sessions_moved": (
        "counter",
        "Sessions the router moved to another replica, by reason (migration, scale_out, drain).",
        ("reason",),
    ),
    "router_vnode_migrations": ("counter", "Vnodes handed from an overheated replica to a cool one.", ()),
    "router_overheated_replicas": (
        "gauge",
        "Replicas whose load has stayed above (1 + rebalance_threshold) x the mean for rebalance_window_s "
        "(an autoscaler's scale-out signal).",
        (),
    ),
    "router_scale_recommended_replicas": (
        "gauge",
        "Replicas the current load needs: ceil(moving average of all in-flight plus waiting requests / "
        "scale_target_load), at least 1 (for KEDA or an HPA on an external metric).",
        (),
    ),
    "router_scale_idle": (
        "gauge",
        "1 while the fleet's moving-average load has stayed below a quarter of scale_target_load per replica "
        "for rebalance_window_s (a scale-in signal), else 0.",
        (),
    ),
    "router_replica_load": (
        "gauge",
        "Each routable replica's load as the rebalancer sees it: moving average of in-flight plus waiting requests.",
        ("replica",),
    ),
    "router_discovery_changes": (
        "counter",
        "Replicas added or removed (drained, then removed) because discovery found them or no longer did.",
        ("change",),
    ),
    "router_discovery_errors": (
        "counter",
        "Discovery lookups that failed or found nothing (the fleet is left as it was).",
        (),
    ),
    "router_stream_errors": (
        "counter",
        "Streams a replica broke after the first byte (then resumed elsewhere, or ended with an SSE error event).",
        ("replica",),
    ),
    "router_stream_resumes": (
        "counter",
        "Broken streams by what came of them: resumed (the continuation on another replica ran to its end), "
        "failed (it broke too, or no replica could take it), refused (a replica answered the continuation "
        "with a 4xx), impossible (not continuable), finished (cut after its last token), timeout (no time left).",
        ("outcome",),
    ),
}


@contextlib.contextmanager
def _values(value_class: Any) -> Iterator[None]:
    """prometheus_client picks a metric's value class (in memory, or a multiprocess file) when the
    metric or a child of it is made, from a module global: swap it for this router's metrics only."""
    if value_class is None:
        yield
        return
    saved = values.ValueClass
    values.ValueClass = value_class
    try:
        yield
    finally:
        values.ValueClass = saved


class RouterMetrics:
    def __init__(self, value_class: Any = None) -> None:
        """`value_class`: prometheus_client's multiprocess value class, for the control process of
        worker processes (its figures then reach every worker's /metrics); None: in memory, or
        whatever PROMETHEUS_MULTIPROC_DIR selected at import (a worker)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.value_class = value_class
        with _values(value_class):
            made = self._make()
        self._init(made)

    def _make(self) -> dict[str, Any]:
        made: dict[str, Any] = {}
        for name, (kind, doc, labels) in TABLE.items():
            if kind == "counter":
                made[name] = Counter(name, doc, labels, registry=self.registry)
            elif kind == "gauge":
                # with worker processes, the worker being scraped sets every gauge from the shared table
                # ... except what each worker holds for itself: its queue, its tokenizers; theirs add up
                if name in ("router_queued", "router_tokenizer"):
                    made[name] = Gauge(name, doc, labels, registry=self.registry, multiprocess_mode="livesum")
                else:
                    made[name] = Gauge(name, doc, labels, registry=self.registry, multiprocess_mode="livemostrecent")
            else:
                buckets = BUCKETS.get(name, LATENCY_BUCKETS)
                made[name] = Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
        return made

    def _init(self, made: dict[str, Any]) -> None:
        self.requests = made["router_requests"]
        self.tenant_requests = made["router_tenant_requests"]
        self.tenant_tokens = made["router_tenant_tokens"]
        self.class_requests = made["router_class_requests"]
        self.inflight = made["router_inflight"]
        self.ttft = made["router_ttft_seconds"]
        self.e2e = made["router_e2e_seconds"]
        self.prompt_tokens = made["router_prompt_tokens"]
        self.cached_tokens = made["router_cached_tokens"]
        self.followups = made["router_session_followups"]
        self.prefix_prompt_tokens = made["router_prefix_prompt_tokens"]
        self.prefix_predicted_tokens = made["router_prefix_predicted_tokens"]
        self.prefix_prediction_error = made["router_prefix_prediction_error_tokens"]
        self.tokenize_seconds = made["router_tokenize_seconds"]
        self.token_checks = made["router_token_checks"]
        self.tokenizer = made["router_tokenizer"]
        self.kv_event_blocks = made["router_kv_event_blocks"]
        self.kv_events_believed = made["router_kv_events_believed"]
        self.kv_events_unfollowed = made["router_kv_events_unfollowed"]
        self.kv_event_lag = made["router_kv_event_lag_seconds"]
        self.prefix_reported_tokens = made["router_prefix_reported_tokens"]
        self.prefix_error_tokens = made["router_prefix_error_tokens"]
        self.prefix_index_blocks = made["router_prefix_index_blocks"]
        self.jumps = made["router_session_jumps"]
        self.retries = made["router_retries"]
        self.failovers = made["router_failovers"]
        self.disagg = made["router_disagg_requests"]
        self.legs = made["router_disagg_leg_seconds"]
        self.abandoned_prefills = made["router_disagg_abandoned_prefills"]
        self.pair_meetings = made["router_disagg_pair_meetings"]
        self.pair_meeting_seconds = made["router_disagg_pair_meeting_seconds"]
        self.queued = made["router_queued"]
        self.shed = made["router_shed"]
        self.queue_wait = made["router_queue_wait_seconds"]
        self.reconnects = made["router_upstream_reconnects"]
        self.stream_errors = made["router_stream_errors"]
        self.stream_resumes = made["router_stream_resumes"]
        self.score = made["router_replica_score"]
        self.routable = made["router_replica_routable"]
        self.state_changes = made["router_replica_state_changes"]
        self.state = made["router_replica_state"]
        self.role = made["router_replica_role"]
        self.warmups = made["router_warmup_requests"]
        self.sessions_moved = made["router_sessions_moved"]
        self.migrations = made["router_vnode_migrations"]
        self.overheated = made["router_overheated_replicas"]
        self.replica_load = made["router_replica_load"]
        self.scale_recommended = made["router_scale_recommended_replicas"]
        self.scale_idle = made["router_scale_idle"]
        self.discovery_changes = made["router_discovery_changes"]
        self.discovery_errors = made["router_discovery_errors"]
        self.health_input = made["router_replica_health_input"]
        self._children: dict[tuple[Any, ...], Any] = {}
        # in prometheus_client's multiprocess files (the control process of worker processes):
        # labels cannot be removed there; the workers' /metrics leave out replicas that are gone
        self.in_files = self.value_class is not None

    def forget_replica(self, replica: str) -> None:
        """A replica left: its gauges go (counters keep their history)."""
        gauges = (  # labelled by replica alone
            self.inflight,
            self.score,
            self.routable,
            self.state_changes,
            self.replica_load,
            self.prefix_index_blocks,
            self.kv_events_believed,
        )
        gauges_ids = {id(g) for g in (*gauges, self.state, self.role, self.health_input, self.kv_event_blocks)}
        media = [k[2] for k in self._children if k[0] == id(self.kv_event_blocks) and k[1] == replica]
        for key in [k for k in self._children if k[0] in gauges_ids and len(k) > 1 and k[1] == replica]:
            del self._children[key]  # a replica re-added under this id gets live children again
        if self.in_files:
            return
        for gauge in gauges:
            with contextlib.suppress(KeyError):
                gauge.remove(replica)
        for state in STATES:
            with contextlib.suppress(KeyError):
                self.state.remove(replica, state)
        for role in ROLES:
            with contextlib.suppress(KeyError):
                self.role.remove(replica, role)
        for name in INPUTS:
            with contextlib.suppress(KeyError):
                self.health_input.remove(replica, name)
        for medium in media:
            with contextlib.suppress(KeyError):
                self.kv_event_blocks.remove(replica, medium)

    def kv_events_not_followed(self, replica: str) -> None:
        """A replica's KV events are not followed (any more): not believed, no blocks known."""
        self.child(self.kv_events_believed, replica).set(0)
        for key in [k for k in self._children if k[0] == id(self.kv_event_blocks) and k[1] == replica]:
            self._children[key].set(0)

    def show_health(self, replica: str, state: str, inputs: HealthInputs | None) -> None:
        """Set a replica's state and score-input gauges (at scrape time)."""
        for s in STATES:
            self.child(self.state, replica, s).set(1 if s == state else 0)
        for name in INPUTS:
            value = getattr(inputs, name) if inputs is not None else None
            if value is None and self.in_files:
                pass  # not removable there; the workers show the table's inputs instead
            elif value is None:
                with contextlib.suppress(KeyError):
                    self.health_input.remove(replica, name)
                self._children.pop((id(self.health_input), replica, name), None)
            else:
                self.child(self.health_input, replica, name).set(float(value))

    def child(self, metric: Any, *labels: str) -> Any:
        """metric.labels(*labels), memoised: the label lookup costs more than the increment."""
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            with _values(self.value_class):
                found = self._children[key] = metric.labels(*labels)
        return found


PER_REPLICA_GAUGES = (
    "router_inflight",
    "router_replica_score",
    "router_replica_routable",
    "router_replica_state_changes",
    "router_replica_state",
    "router_replica_role",
    "router_replica_health_input",
)
ROLES = ("both", "decode", "prefill")
Row = tuple[str, int, float, bool, int, str, HealthInputs | None, str]


def replica_gauge_families(rows: list[Row]) -> list[Any]:
    """The per-replica gauges, built from (id, in flight, score, routable, state changes, state,
    inputs, role) rows at scrape time: a worker process's view of the shared table, so a replica that
    left is simply absent (multiprocess gauge files would keep it)."""
    families = {
        name: GaugeMetricFamily(name, TABLE[name][1], labels=list(TABLE[name][2])) for name in PER_REPLICA_GAUGES
    }
    for rid, inflight, score, routable, changes, state, inputs, role in rows:
        families["router_inflight"].add_metric([rid], inflight)
        families["router_replica_role"].add_metric([rid, role], 1.0)
        families["router_replica_score"].add_metric([rid], score)
        families["router_replica_routable"].add_metric([rid], 1.0 if routable else 0.0)
        families["router_replica_state_changes"].add_metric([rid], changes)
        for s in STATES:
            families["router_replica_state"].add_metric([rid, s], 1.0 if s == state else 0.0)
        for name in INPUTS:
            value = getattr(inputs, name) if inputs is not None else None
            if value is not None:
                families["router_replica_health_input"].add_metric([rid, name], float(value))
    return list(families.values())


def _replica_rows(*fleets: Fleet) -> list[Row]:
    return [
        (
            r.id,
            fleet.loads[r.index] - r.queue_load,
            r.health.score,
            r.health.routable,
            r.health.transitions,
            r.state,
            r.inputs,
            r.role,
        )
        for fleet in fleets
        for r in fleet.replicas
        if r.index is not None
    ]


def show_replica_gauges(metrics: RouterMetrics, *fleets: Fleet) -> None:
    """Bring the per-replica gauges of a process's own registry up to date with its fleets (the
    routed one, and the prefill replicas')."""
    for rid, inflight, score, routable, transitions, state, inputs, role in _replica_rows(*fleets):
        metrics.child(metrics.role, rid, role).set(1)
        metrics.inflight.labels(rid).set(inflight)
        metrics.score.labels(rid).set(score)
        metrics.routable.labels(rid).set(1 if routable else 0)
        metrics.state_changes.labels(rid).set(transitions)
        metrics.show_health(rid, state, inputs)


def multiprocess_registry(*fleets: Fleet) -> CollectorRegistry | None:
    """A worker's /metrics: every worker's counters and histograms (prometheus_client's
    multiprocess files), and per-replica gauges from this worker's copy of the table. None
    outside multiprocess mode (no PROMETHEUS_MULTIPROC_DIR)."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        return None
    registry = CollectorRegistry()
    files = multiprocess.MultiProcessCollector(None, path)  # type: ignore[no-untyped-call]

    class FromFiles:
        """Every process's counters, histograms and the control process's gauges; the
        per-replica gauges come from the table instead, and only for replicas still there."""

        def collect(self) -> list[Any]:
            present = {r.id for fleet in fleets for r in fleet.replicas if r.index is not None}
            families = []
            for family in files.collect():  # type: ignore[no-untyped-call]
                if family.name in PER_REPLICA_GAUGES:
                    continue
                if family.name == "router_replica_load":
                    family.samples = [s for s in family.samples if s.labels.get("replica") in present]
                families.append(family)
            return families

    class ReplicaGauges:
        def collect(self) -> list[Any]:
            return replica_gauge_families(_replica_rows(*fleets))

    registry.register(FromFiles())
    registry.register(ReplicaGauges())
    return registry
