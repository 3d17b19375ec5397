"""The console's history: points and events derived from the router's own metric registry."""

from __future__ import annotations

from router.console.history import JUMP_GROUPS, JUMP_REASONS, History, quantile_bound
from router.metrics import RouterMetrics
from router.policy.ttft import PLACED
from router.routing.route import POLICY_REASONS


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def serve(m: RouterMetrics, replica: str, requests: int, prompt: int, cached: int) -> None:
    m.requests.labels(replica, "affinity", "header", "200", "m").inc(requests)
    m.prompt_tokens.labels(replica).inc(prompt)
    m.cached_tokens.labels(replica).inc(cached)


def test_points_are_rates_and_windowed_hit_rates_from_the_metrics() -> None:
    m, clock = RouterMetrics(), Clock()
    history = History(m.registry.collect, interval_s=2, history_s=10, window_s=4, clock=clock)
    for r in ("a", "b"):
        m.show_health(r, "healthy", None)
        m.inflight.labels(r).set(0)
    history.sample()
    assert not history.points  # the first reading only sets the base
    serve(m, "a", 10, 1000, 500)
    serve(m, "b", 4, 1000, 0)
    m.inflight.labels("a").set(3)
    m.followups.inc(10)
    m.jumps.labels("spill").inc(1)
    clock.now += 2
    history.sample()
    p = history.points[-1]
    assert p["qps"] == 7.0 and p["inflight"] == 3.0
    assert p["replicas"]["a"] == {"inflight": 3.0, "qps": 5.0, "hit": 0.5, "ttft_p99": None, "state": "healthy"}
    assert p["replicas"]["b"]["hit"] == 0.0 and p["hit"] == 0.25 and p["jump"] == 0.1
    for _ in range(3):  # nothing more: the window slides past the traffic, rates fall to zero
        clock.now += 2
        history.sample()
    p = history.points[-1]
    assert p["qps"] == 0.0 and p["hit"] is None and p["jump"] is None
    assert len(history.points) == 4 and history.since(clock.now - 1)["points"] == [p]
    for _ in range(10):
        clock.now += 2
        history.sample()
    assert len(history.points) == 5  # bounded by history_s / interval_s


def test_events_say_what_changed_between_samples() -> None:
    m, clock = RouterMetrics(), Clock()
    history = History(m.registry.collect, interval_s=1, history_s=900, clock=clock)
    for r in ("a", "b"):
        m.show_health(r, "healthy", None)
    history.sample()
    m.show_health("a", "removed", None)
    m.migrations.inc(2)
    m.jumps.labels("spill").inc(3)
    m.sessions_moved.labels("scale_out").inc(4)
    m.warmups.labels("ok").inc(4)
    m.shed.labels("timeout", "model-a", "default").inc(3)
    m.shed.labels("timeout", "other", "bulk").inc(2)  # summed over models
    m.queued.set(7)
    m.show_health("c", "warming", None)
    clock.now += 1
    history.sample()
    kinds = [e["kind"] for e in history.events]
    assert kinds == ["removed", "added", "migration", "spill", "moved", "shed", "warmup"]
    assert history.points[-1]["queued"] == 7.0 and history.points[-1]["shed"] == 5.0
    assert history.events[0]["text"] == "a: healthy → removed" and history.events[0]["replica"] == "a"
    m.show_health("a", "recovering", None)
    m.forget_replica("b")  # it left the fleet: its row stays in the heatmap as "left"
    clock.now += 1
    history.sample()
    assert [e["kind"] for e in history.since(clock.now - 0.5)["events"]] == ["returned", "left"]
    assert history.points[-1]["replicas"]["b"]["state"] == "left"


def test_quantile_bound_of_histogram_deltas() -> None:
    old = {0.1: 5.0, 0.5: 5.0, 1.0: 5.0, float("inf"): 5.0}
    new = {0.1: 55.0, 0.5: 103.0, 1.0: 104.0, float("inf"): 105.0}  # 100 new: 50, 48, 1, 1
    assert quantile_bound(new, old, 0.5) == 0.1
    assert quantile_bound(new, old, 0.98) == 0.5
    assert quantile_bound(new, old, 0.99) == 1.0
    assert quantile_bound(new, old, 1.0) == float("inf")
    assert quantile_bound(old, old, 0.99) is None


def test_a_replica_gone_before_the_second_reading_is_still_shown_as_left() -> None:
    m, clock = RouterMetrics(), Clock()
    history = History(m.registry.collect, interval_s=1, history_s=900, clock=clock)
    m.show_health("x", "healthy", None)
    serve(m, "x", 1, 10, 0)
    history.sample()
    m.forget_replica("x")
    clock.now += 1
    history.sample()
    assert history.points[-1]["replicas"]["x"]["state"] == "left"
    assert [e["kind"] for e in history.events] == ["left"]


def test_a_replica_removed_and_added_again_comes_back_to_life() -> None:
    m, clock = RouterMetrics(), Clock()
    history = History(m.registry.collect, interval_s=1, history_s=900, clock=clock)
    m.show_health("a", "healthy", None)
    m.child(m.inflight, "a").set(2)
    history.sample()
    m.forget_replica("a")
    clock.now += 1
    history.sample()
    m.show_health("a", "warming", None)  # the same id, added again
    m.child(m.inflight, "a").set(1)
    clock.now += 1
    history.sample()
    assert history.points[-1]["replicas"]["a"] == {
        "inflight": 1.0,
        "qps": 0.0,
        "hit": None,
        "ttft_p99": None,
        "state": "warming",
    }
    assert [e["kind"] for e in history.events] == ["left", "added"]


def test_the_fleet_point_has_the_predicted_and_the_reported_hit_rate_of_the_same_requests() -> None:
    m, clock = RouterMetrics(), Clock()
    history = History(m.registry.collect, interval_s=2, history_s=10, window_s=4, clock=clock)
    m.show_health("a", "healthy", None)
    history.sample()
    serve(m, "a", 4, 4000, 3000)  # four answers, one without a prediction (1000 tokens, none cached)
    m.prefix_prompt_tokens.labels("a").inc(3000)
    m.prefix_predicted_tokens.labels("a").inc(2700)
    m.prefix_reported_tokens.labels("a").inc(3000)
    clock.now += 2
    history.sample()
    p = history.points[-1]
    assert p["hit"] == 0.75 and p["predicted"] == 0.9 and p["reported"] == 1.0
    for _ in range(3):
        clock.now += 2
        history.sample()
    assert history.points[-1]["predicted"] is None  # nothing predicted in the window


def test_the_fleet_point_has_the_share_predicted_exactly_by_source() -> None:
    m, clock = RouterMetrics(), Clock()
    history = History(m.registry.collect, interval_s=2, history_s=10, window_s=4, clock=clock)
    history.sample()
    for error in (0, 0, 0, -32):  # three exact from the events, one off by a block
        m.prefix_prediction_error.labels("events").observe(error)
    for error in (0, 96):
        m.prefix_prediction_error.labels("model").observe(error)
    clock.now += 2
    history.sample()
    assert history.points[-1]["exact"] == {"events": 0.75, "model": 0.5}


def test_an_idle_window_is_no_data_not_zero() -> None:
    """Nothing to divide by is None (a gap on the console), while a quiet window that had requests
    is a real 0: the two must never read alike."""
    m, clock = RouterMetrics(), Clock()
    history = History(m.registry.collect, interval_s=2, history_s=60, window_s=4, clock=clock)
    m.show_health("a", "healthy", None)
    history.sample()
    serve(m, "a", 10, 1000, 0)  # served, nothing cached; follow-ups that all stayed
    m.followups.inc(10)
    m.prefix_prompt_tokens.labels("a").inc(1000)
    m.prefix_predicted_tokens.labels("a").inc(0)
    m.prefix_reported_tokens.labels("a").inc(0)
    m.prefix_prediction_error.labels("model").observe(0)
    clock.now += 2
    history.sample()
    busy = history.points[-1]
    assert busy["hit"] == 0.0 and busy["replicas"]["a"]["hit"] == 0.0
    assert busy["jump"] == 0.0 and set(busy["jumps"].values()) == {0.0} and busy["jump_reasons"] == {}
    assert busy["predicted"] == 0.0 and busy["reported"] == 0.0 and busy["exact"] == {"model": 1.0}
    for _ in range(3):  # idle past the window
        clock.now += 2
        history.sample()
    idle = history.points[-1]
    assert idle["hit"] is None and idle["replicas"]["a"]["hit"] is None
    assert idle["jump"] is None and set(idle["jumps"].values()) == {None} and idle["jump_reasons"] == {}
    assert idle["predicted"] is None and idle["reported"] is None and idle["exact"] == {"model": None}
    assert idle["qps"] == 0.0  # a rate, not a ratio: idle is 0 requests a second


def test_jumps_are_split_by_who_moved_the_session() -> None:
    m, clock = RouterMetrics(), Clock()
    history = History(m.registry.collect, interval_s=2, history_s=60, window_s=4, clock=clock)
    m.show_health("a", "healthy", None)
    history.sample()
    m.followups.inc(20)
    for reason, count in {"cost": 2, "spill": 1, "prefix": 2, "failover": 1, "health": 1, "drain": 1}.items():
        m.jumps.labels(reason).inc(count)
    m.jumps.labels("membership").inc(1)
    m.jumps.labels("a-reason-added-later").inc(1)
    clock.now += 2
    history.sample()
    p = history.points[-1]
    assert p["jump"] == 0.5
    assert p["jumps"] == {"router": 0.15, "unkeyed": 0.1, "failover": 0.1, "drain": 0.1, "other": 0.05}
    assert p["jump_reasons"]["cost"] == 0.1 and p["jump_reasons"]["membership"] == 0.05
    words = history.since(0)["jump_words"]
    assert words["groups"]["router"] == "moved by the router" and words["groups"]["failover"] == "failed over"
    assert words["reasons"]["cost"] == {"group": "router", "text": JUMP_REASONS["cost"][1]}
    assert "faster replica" in words["reasons"]["cost"]["text"]


def test_every_jump_reason_the_router_records_has_words() -> None:
    recorded = POLICY_REASONS | PLACED | {"membership", "drain", "health", "spill", "ring"}
    moved = {"migration", "scale_out", "drain"}  # router.balance.controller's reasons
    assert recorded | moved <= set(JUMP_REASONS)
    assert {group for group, _ in JUMP_REASONS.values()} <= set(JUMP_GROUPS) - {"other"}
