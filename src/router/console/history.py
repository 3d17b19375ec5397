"""The console's time series and events: a bounded history sampled from the router's own metrics.

Every `interval_s` the sampler reads the same registry `/metrics` serves (with worker processes,
every worker's counters merged and the replica table's gauges), so the console never shows a
figure `/metrics` does not. From two samples it derives, per replica and for the fleet:

- `inflight`: requests in flight at the sample;
- `qps`: requests answered per second since the previous sample;
- `hit`: KV hit rate, cached / prompt tokens reported by replicas, over the last `window_s`;
- `predicted` / `reported`: for the fleet, under the `ttft` policy, the hit rate the prefix index
  predicted and the one replicas reported, over the same requests (those it predicted for) and the
  last `window_s`: how far the index is from the caches it models;
- `exact`: for the fleet, by where a prediction came from (`events`: the engine's KV-cache events,
  `model`: the router's own model), the share of answers whose cached tokens were predicted to
  the token over the last `window_s` (router_prefix_prediction_error_tokens);
- `jump`: for the fleet, jumps / follow-up requests of sessions over the last `window_s`; `jumps`
  the same split by who moved the session (JUMP_GROUPS: the router's own choice, a request without
  a session id placed by its prompt, a failover, a drain or removal) and `jump_reasons` by each
  reason of router_session_jumps_total (JUMP_REASONS says each in words);
- `ttft_p99`: the 99th percentile of time to first byte over the last `window_s`, read off the
  `router_ttft_seconds` histogram's buckets (so it is a bucket's upper bound);
- `state`: the replica's health state, or `left` once it is no longer in the fleet;
- `legs`: for the fleet, with prefill replicas, each leg of the requests split between a prefill
  and a decode replica (`prefill`, `transfer`, `decode`: router_disagg_leg_seconds) as its mean
  over the last `window_s`, and `split` the share of the requests those replicas served that were
  split (router_disagg_requests_total; the others were served whole by their decode replica).

Every ratio is None ("no data", a gap in the console's curves) over a window with nothing to divide
by: an idle window has no hit rate, not 0 %.

Events are what changed between two samples: a replica's state (removed, returned, draining,
warming, ...), a replica added or gone, vnode migrations, spills, sessions moved and warm-up
requests. Points are kept for `history_s`, events up to MAX_EVENTS; memory is bounded by both.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

MAX_EVENTS = 500
MAX_POINTS = 10_000  # whatever history_s / interval_s asks for
STATE_EVENTS = {
    "removed": "removed",
    "draining": "drain",
    "warming": "warming",
    "recovering": "recovering",
    "suspect": "suspect",
}

# router_session_jumps_total's reasons (router.routing.route, router.policy, router.balance), in the
# words the console shows: who moved the session, then why. A reason missing here shows as `other`.
JUMP_GROUPS = {
    "router": "moved by the router",
    "unkeyed": "no session id: placed by its prompt",
    "failover": "failed over",
    "drain": "drained or removed",
    "other": "jumped for another reason",
}
JUMP_REASONS: dict[str, tuple[str, str]] = {  # reason -> (group, why)
    "cost": ("router", "to a faster replica (ttft: the move saved more time than it cost)"),
    "target": ("router", "to a replica predicted to meet the request's time-to-first-token target"),
    "spill": ("router", "past a replica at its load cap"),
    "migration": ("router", "rebalancing: off a replica that ran hot"),
    "scale_out": ("router", "onto a replica added to the fleet"),
    "ring": ("router", "the ring gave its key to another replica"),
    "round_robin": ("router", "round_robin does not keep sessions"),
    "least_load": ("router", "least_load does not keep sessions"),
    "prefix": ("unkeyed", "where the prefix index placed it; another conversation may open alike"),
    "failover": ("failover", "its replica failed to answer; retried on another"),
    "health": ("failover", "its replica was taken out of routing as unhealthy"),
    "drain": ("drain", "its replica was draining"),
    "membership": ("drain", "its replica left the fleet"),
}


def jump_group(reason: str) -> str:
    return JUMP_REASONS.get(reason, ("other", ""))[0]


@dataclass
class Totals:
    """One reading of the metrics (counters are totals since the router started)."""

    at: float
    requests: dict[str, float] = field(default_factory=dict)
    prompt: dict[str, float] = field(default_factory=dict)
    cached: dict[str, float] = field(default_factory=dict)
    prefix_prompt: dict[str, float] = field(default_factory=dict)
    prefix_predicted: dict[str, float] = field(default_factory=dict)
    prefix_reported: dict[str, float] = field(default_factory=dict)
    inflight: dict[str, float] = field(default_factory=dict)
    state: dict[str, str] = field(default_factory=dict)
    followups: float = 0.0
    jumps: dict[str, float] = field(default_factory=dict)
    moved: dict[str, float] = field(default_factory=dict)
    warmups: dict[str, float] = field(default_factory=dict)
    migrations: float = 0.0
    queued: float = 0.0  # requests held in the router (every replica for their model full)
    shed: dict[str, float] = field(default_factory=dict)  # 429s for overload, by reason
    ttft: dict[str, dict[float, float]] = field(default_factory=dict)  # replica -> bucket bound -> count
    leg_s: dict[str, float] = field(default_factory=dict)  # split requests' legs: seconds in all, by leg
    legs: dict[str, float] = field(default_factory=dict)  # ... and how many, by leg
    disagg: dict[str, float] = field(default_factory=dict)  # requests of a disaggregated fleet, by mode
    predictions: dict[str, float] = field(default_factory=dict)  # answers checked, by prediction source
    exact: dict[str, float] = field(default_factory=dict)  # ... of them predicted to the token


# sample name -> (Totals field, the label that keys it): plain per-label readings
BY_LABEL = {
    "router_prompt_tokens_total": ("prompt", "replica"),
    "router_cached_tokens_total": ("cached", "replica"),
    "router_prefix_prompt_tokens_total": ("prefix_prompt", "replica"),
    "router_prefix_predicted_tokens_total": ("prefix_predicted", "replica"),
    "router_prefix_reported_tokens_total": ("prefix_reported", "replica"),
    "router_inflight": ("inflight", "replica"),
    "router_session_jumps_total": ("jumps", "reason"),
    "router_sessions_moved_total": ("moved", "reason"),
    "router_warmup_requests_total": ("warmups", "result"),
    "router_shed_total": ("shed", "reason"),
    "router_disagg_leg_seconds_sum": ("leg_s", "leg"),
    "router_disagg_leg_seconds_count": ("legs", "leg"),
    "router_disagg_requests_total": ("disagg", "mode"),
}


def read_totals(families: Iterable[Any], at: float) -> Totals:
    """Totals from prometheus_client metric families (registry.collect())."""
    t = Totals(at)
    for family in families:
        for s in family.samples:
            name, labels, value = s.name, s.labels, s.value
            if name in BY_LABEL:
                field_name, label = BY_LABEL[name]
                by = getattr(t, field_name)
                by[labels[label]] = by.get(labels[label], 0.0) + value  # summed over any other label
            elif name == "router_requests_total":
                replica = labels.get("replica", "none")
                if replica != "none":
                    t.requests[replica] = t.requests.get(replica, 0.0) + value
            elif name == "router_replica_state" and value == 1:
                t.state[labels["replica"]] = labels["state"]
            elif name == "router_session_followups_total":
                t.followups = value
            elif name == "router_vnode_migrations_total":
                t.migrations = value
            elif name == "router_queued":
                t.queued += value
            elif name == "router_ttft_seconds_bucket":
                t.ttft.setdefault(labels["replica"], {})[float(labels["le"])] = value
            elif name == "router_prefix_prediction_error_tokens_bucket" and labels["le"] in ("0.5", "-0.5"):
                sign = 1.0 if labels["le"] == "0.5" else -1.0  # exact: in (-0.5, 0.5]
                t.exact[labels["source"]] = t.exact.get(labels["source"], 0.0) + sign * value
            elif name == "router_prefix_prediction_error_tokens_count":
                t.predictions[labels["source"]] = t.predictions.get(labels["source"], 0.0) + value
    return t


def _last_bound(buckets: dict[float, float]) -> float:
    finite = [b for b in buckets if b != float("inf")]
    return max(finite) if finite else 0.0


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den > 0 else None


def _delta(new: dict[Any, float], old: dict[Any, float], key: Any) -> float:
    return max(new.get(key, 0.0) - old.get(key, 0.0), 0.0)  # a restarted worker's counts start over


def quantile_bound(new: dict[float, float], old: dict[float, float], q: float) -> float | None:
    """The upper bound of the histogram bucket holding quantile `q` of what was observed between
    two readings (cumulative buckets), or None if nothing was; inf: beyond the last bound."""
    total = _delta(new, old, float("inf"))
    if total <= 0:
        return None
    for bound in sorted(new):
        if _delta(new, old, bound) >= q * total:
            return bound
    return float("inf")


class History:
    def __init__(
        self,
        collect: Callable[[], Iterable[Any]],
        interval_s: float,
        history_s: float,
        window_s: float = 20.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.collect = collect
        self.interval_s = interval_s
        self.history_s = history_s
        self.points: deque[dict[str, Any]] = deque(maxlen=min(max(int(history_s / interval_s), 2), MAX_POINTS))
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self._readings: deque[Totals] = deque(maxlen=max(int(window_s / interval_s), 1) + 1)
        self._clock = clock
        self._seen: dict[str, float] = {}  # replica -> when it was last in the fleet (unix s)

    def sample(self) -> None:
        now = self._clock()
        totals = read_totals(self.collect(), now)
        readings = self._readings
        if readings:
            for rid in readings[-1].state:  # a replica that left before the second reading too
                self._seen.setdefault(rid, readings[-1].at)
            self._point(totals, readings[-1], readings[0])
            self._events(totals, readings[-1])
        readings.append(totals)

    def _point(self, new: Totals, last: Totals, oldest: Totals) -> None:
        dt = max(new.at - last.at, 1e-6)
        replicas: dict[str, Any] = {}
        oldest_kept = new.at - self.interval_s * (self.points.maxlen or 1)
        for rid, at in list(self._seen.items()):
            if rid not in new.state and at < oldest_kept:
                del self._seen[rid]  # gone for longer than the history reaches: its row goes too
        for rid in sorted(set(new.state) | set(self._seen)):
            present = rid in new.state
            if present:
                self._seen[rid] = new.at
            ttft = quantile_bound(new.ttft.get(rid, {}), oldest.ttft.get(rid, {}), 0.99)
            replicas[rid] = {
                "inflight": new.inflight.get(rid, 0.0) if present else 0.0,
                "qps": round(_delta(new.requests, last.requests, rid) / dt, 3),
                "hit": _ratio(_delta(new.cached, oldest.cached, rid), _delta(new.prompt, oldest.prompt, rid)),
                # JSON has no infinity: beyond the last bucket reads as that bucket's bound, marked
                "ttft_p99": ttft if ttft != float("inf") else f"> {_last_bound(new.ttft.get(rid, {}))} s",
                "state": new.state.get(rid, "left"),
            }
        followups = new.followups - oldest.followups
        jumped = {reason: _delta(new.jumps, oldest.jumps, reason) for reason in new.jumps}
        groups = dict.fromkeys(JUMP_GROUPS, 0.0)
        for reason, count in jumped.items():
            groups[jump_group(reason)] += count

        def fleet_delta(name: str) -> float:
            later, earlier = getattr(new, name), getattr(oldest, name)
            return sum(_delta(later, earlier, r) for r in later)

        predicted_over = fleet_delta("prefix_prompt")
        self.points.append(
            {
                "t": round(new.at, 3),
                "qps": round(sum(_delta(new.requests, last.requests, r) for r in new.requests) / dt, 3),
                "inflight": sum(new.inflight.values()),
                "hit": _ratio(
                    sum(_delta(new.cached, oldest.cached, r) for r in new.cached),
                    sum(_delta(new.prompt, oldest.prompt, r) for r in new.prompt),
                ),
                "predicted": _ratio(fleet_delta("prefix_predicted"), predicted_over),
                "reported": _ratio(fleet_delta("prefix_reported"), predicted_over),
                "exact": {
                    source: _ratio(
                        _delta(new.exact, oldest.exact, source), _delta(new.predictions, oldest.predictions, source)
                    )
                    for source in new.predictions
                },
                "jump": _ratio(sum(jumped.values()), followups),
                "jumps": {group: _ratio(count, followups) for group, count in groups.items()},
                "jump_reasons": {reason: _ratio(count, followups) for reason, count in jumped.items() if count},
                "queued": new.queued,
                "shed": round(fleet_delta("shed") / dt, 3),  # 429s a second, for overload
                "legs": {
                    leg: _ratio(_delta(new.leg_s, oldest.leg_s, leg), _delta(new.legs, oldest.legs, leg))
                    for leg in new.legs
                },
                "split": _ratio(_delta(new.disagg, oldest.disagg, "split"), fleet_delta("disagg")),
                "replicas": replicas,
            }
        )

    def _event(self, at: float, kind: str, text: str, replica: str | None = None) -> None:
        self.events.append({"t": round(at, 3), "kind": kind, "replica": replica, "text": text})

    def _events(self, new: Totals, old: Totals) -> None:
        at = new.at
        for rid in sorted(set(new.state) | set(old.state)):
            before, after = old.state.get(rid), new.state.get(rid)
            if before == after:
                continue
            if before is None:
                self._event(at, "added", f"{rid} joined the fleet ({after})", rid)
            elif after is None:
                self._event(at, "left", f"{rid} left the fleet", rid)
            elif after == "healthy" and before in ("removed", "recovering", "warming"):
                self._event(at, "returned", f"{rid} is back at full weight ({before} → healthy)", rid)
            elif after == "recovering":
                self._event(at, "returned", f"{rid} returns, its weight ramping up ({before} → recovering)", rid)
            else:
                kind = STATE_EVENTS.get(after, "state")
                self._event(at, kind, f"{rid}: {before} → {after}", rid)
        migrations = new.migrations - old.migrations
        if migrations > 0:
            self._event(at, "migration", f"{migrations:.0f} vnode(s) handed from a hot replica to a cool one")
        spills = _delta(new.jumps, old.jumps, "spill")
        if spills > 0:
            self._event(at, "spill", f"{spills:.0f} request(s) spilled past a replica at its load cap")
        for reason in sorted(new.moved):
            moved = _delta(new.moved, old.moved, reason)
            if moved > 0:
                why = JUMP_REASONS.get(reason, ("", "by the router"))[1]
                self._event(at, "moved", f"{moved:.0f} session(s) moved ({reason.replace('_', '-')}): {why}")
        shed = sum(_delta(new.shed, old.shed, r) for r in new.shed)
        if shed > 0:
            self._event(at, "shed", f"{shed:.0f} request(s) answered 429: every replica for their model was full")
        ok, failed = _delta(new.warmups, old.warmups, "ok"), _delta(new.warmups, old.warmups, "failed")
        if ok or failed:
            self._event(at, "warmup", f"{ok:.0f} warm-up request(s) ok, {failed:.0f} failed")

    def since(self, t: float) -> dict[str, Any]:
        """The points and events after unix time `t` (0: all of them)."""
        return {
            "interval_s": self.interval_s,
            "history_s": self.history_s,
            "points": [p for p in self.points if p["t"] > t],
            "events": [e for e in self.events if e["t"] > t],
            "jump_words": {
                "groups": JUMP_GROUPS,
                "reasons": {reason: {"group": group, "text": text} for reason, (group, text) in JUMP_REASONS.items()},
            },
        }
