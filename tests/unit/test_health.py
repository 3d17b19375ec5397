"""Health: the score function and the state machine's hysteresis (engine signals: test_engine_signals.py)."""

from __future__ import annotations

import random

import pytest

from router.health.score import HealthInputs, ScoreWeights, health_score, ramp
from router.health.states import Hysteresis, ReplicaHealth
from router.monitor import peer_median


def test_score_is_one_for_a_busy_but_healthy_replica() -> None:
    assert (
        health_score(HealthInputs(waiting=0, kv_usage=0.97, fragmentation=0.1, error_rate=0.0, latency_ratio=1.2))
        == 1.0
    )
    assert health_score(HealthInputs()) == 1.0  # nothing known: nothing held against it
    assert health_score(HealthInputs(probe_ok=False, waiting=0)) == 0.0


def test_score_penalties_match_the_documented_example() -> None:
    assert health_score(HealthInputs(waiting=36)) == pytest.approx(0.5)
    assert health_score(HealthInputs(waiting=64)) == 0.0
    assert health_score(HealthInputs(waiting=8)) == 1.0
    # memory counts only while requests wait
    assert health_score(HealthInputs(waiting=1, kv_usage=0.95)) == pytest.approx(0.5)
    assert health_score(HealthInputs(error_rate=0.275)) == pytest.approx(0.5)
    assert health_score(HealthInputs(latency_ratio=3.0)) == pytest.approx(0.5)
    both = health_score(HealthInputs(waiting=36, latency_ratio=3.0))
    assert both == pytest.approx(0.25)  # mild signals add up
    light = ScoreWeights(latency=0.5)
    assert health_score(HealthInputs(latency_ratio=4.0), light) == pytest.approx(0.5)


def test_a_queue_like_its_peers_is_load_not_sickness() -> None:
    # a fleet-wide surge: every engine has a queue and a full cache
    assert health_score(HealthInputs(waiting=40, peer_waiting=40, kv_usage=0.99)) == 1.0
    assert health_score(HealthInputs(waiting=40, peer_waiting=44, kv_usage=0.99)) == 1.0
    # the same replica where its peers have none: its queue is its own
    assert health_score(HealthInputs(waiting=40, peer_waiting=0, kv_usage=0.99)) == pytest.approx((1 - 32 / 56) * 0.1)
    # 36 beyond its peers' median: the documented penalty, and the cache pressure with it
    assert health_score(HealthInputs(waiting=76, peer_waiting=40)) == pytest.approx(0.5)
    assert health_score(HealthInputs(waiting=41, peer_waiting=40, kv_usage=0.95)) == pytest.approx(0.5)
    assert health_score(HealthInputs(waiting=36)) == pytest.approx(0.5)  # no peer probed: as it is


def test_the_peers_median_leaves_the_replica_itself_out() -> None:
    assert peer_median([0.0, 2.0, 40.0], 40.0) == 1.0
    assert peer_median([0.0, 2.0, 40.0], 0.0) == 21.0
    assert peer_median([3.0, 3.0], 3.0) == 3.0  # one occurrence only
    assert peer_median([5.0], 5.0) is None  # no peer
    assert peer_median([1.0, 7.0], None) == 4.0  # its own probe failed: every other counts


def test_ramp_and_weight_validation() -> None:
    assert (ramp(None, 0, 1), ramp(-1, 0, 1), ramp(0.25, 0, 1), ramp(9, 0, 1)) == (0, 0, 0.25, 1)
    with pytest.raises(ValueError):
        ScoreWeights(queue=1.5)
    with pytest.raises(ValueError):
        ScoreWeights(queue_from=10, queue_to=5)
    with pytest.raises(ValueError):
        Hysteresis(remove_below=0.8, return_above=0.7)


def test_removal_needs_k_low_scores_in_a_row() -> None:
    h = ReplicaHealth(Hysteresis(remove_after=3))
    assert h.observe(0.3, 0) == "suspect"
    assert h.observe(0.3, 1) is None and h.state == "suspect"
    assert h.observe(0.6, 2) == "healthy"  # the streak is broken
    for t, expect in ((3, "suspect"), (4, None), (5, "removed")):
        assert h.observe(0.2, t) == expect
    assert not h.routable and h.weight(5) == 0.0


def test_return_needs_k_prime_high_scores_then_ramps() -> None:
    rules = Hysteresis(return_after=2, ramp_s=10, ramp_from=0.1)
    h = ReplicaHealth(rules, state="removed")
    assert h.observe(0.65, 0) is None  # above remove_below but not above return_above: stays out
    assert h.observe(0.9, 1) is None
    assert h.observe(0.6, 2) is None  # streak broken
    assert h.observe(0.95, 3) is None
    assert h.observe(0.95, 4) == "recovering"
    assert h.weight(4) == pytest.approx(0.1)
    assert h.weight(9) == pytest.approx(0.55)  # halfway up the ramp
    assert h.observe(0.95, 9) is None
    assert h.observe(0.95, 14) == "healthy" and h.weight(14) == 1.0


def test_a_relapse_during_recovery_goes_back_out() -> None:
    h = ReplicaHealth(Hysteresis(remove_after=2, return_after=1), state="removed")
    assert h.observe(0.9, 0) == "recovering"
    assert h.observe(0.1, 1) is None
    assert h.observe(0.1, 2) == "removed"


def test_noise_around_a_threshold_never_flaps_routing() -> None:
    rng = random.Random(7)
    healthy = ReplicaHealth()
    removed = ReplicaHealth(state="removed")
    for t in range(5000):
        # isolated dips below 0.5 (never 3 in a row) must not remove; scores hovering between the two
        # thresholds must not bring a removed replica back
        dip = t % 3 == 0 and rng.random() < 0.5
        healthy.observe(0.45 if dip else rng.uniform(0.5, 1.0), t)
        removed.observe(rng.uniform(0.5, 0.7), t)
        assert healthy.routable and not removed.routable


def test_degraded_replicas_take_a_smaller_share_and_drain_is_manual() -> None:
    h = ReplicaHealth()
    h.observe(0.45, 0)
    assert h.state == "suspect" and h.weight(0) == pytest.approx(0.5)
    h.observe(0.99, 1)
    assert h.weight(1) == 1.0
    h.drain(2)
    assert h.observe(1.0, 3) is None and h.state == "draining" and h.weight(3) == 0.0
    h.start_warming(5)  # slow start: routable, weight ramping, healthy once the ramp is done
    assert h.routable and h.weight(5) == pytest.approx(0.1) and h.tick(20) is None
    assert h.tick(35) == "healthy" and h.weight(35) == 1.0 and h.transitions == 5


def test_first_token_signal() -> None:
    assert health_score(HealthInputs(ttft_ratio=2.9)) == 1.0  # within 3x of the fleet: normal
    assert health_score(HealthInputs(ttft_ratio=4.5)) == pytest.approx(0.5)
    assert health_score(HealthInputs(ttft_ratio=9.0, latency_ratio=1.0)) == 0.0


def test_gpu_signals_from_the_agent() -> None:
    assert health_score(HealthInputs(waiting=36, gpu_slowed=True)) == pytest.approx(0.25)  # the documented example
    assert health_score(HealthInputs(ecc_errors=1)) == 0.0
    assert health_score(HealthInputs(ecc_errors=0, gpu_slowed=False, gpu_temperature_c=70)) == 1.0
    assert health_score(HealthInputs(gpu_temperature_c=90)) == pytest.approx(0.5)


def test_a_flapping_replica_needs_longer_to_return_each_time() -> None:
    h = ReplicaHealth(Hysteresis(remove_after=2, return_after=2, ramp_s=10.0, flap_backoff=4))
    now = 0.0

    def feed(score: float, n: int) -> None:
        nonlocal now
        for _ in range(n):
            now += 1.0
            h.observe(score, now)

    feed(0.0, 2)
    assert h.state == "removed" and h.return_needed == 2
    feed(1.0, 2)
    assert h.state == "recovering"
    feed(0.0, 2)  # relapse during the ramp
    assert h.state == "removed" and h.relapses == 1 and h.return_needed == 4
    feed(1.0, 3)
    assert h.state == "removed"  # two more good scores than before are needed
    feed(1.0, 1)
    assert h.state == "recovering"
    feed(0.0, 2)
    feed(1.0, 8)
    assert h.state == "recovering" and h.return_needed == 8  # capped at 4 x return_after
    feed(0.0, 2)
    assert h.return_needed == 8
    feed(1.0, 8)
    feed(1.0, 10)  # a whole ramp: healthy, and the back-off is forgiven
    assert h.state == "healthy" and h.return_needed == 2
    feed(0.0, 2)
    feed(1.0, 2)
    assert h.state == "recovering"


def test_flap_backoff_one_turns_the_back_off_off() -> None:
    h = ReplicaHealth(Hysteresis(remove_after=1, return_after=1, flap_backoff=1))
    for i in range(5):
        h.observe(0.0, 2 * i)
        h.observe(1.0, 2 * i + 1)
        assert h.state == "recovering" and h.return_needed == 1


def test_a_queue_that_shrinks_is_not_a_sick_replica() -> None:
    # the tail of a surge: its peers idle, its queue still deep but shorter than a probe ago
    assert health_score(HealthInputs(waiting=63, peer_waiting=0, waiting_before=70)) == 1.0
    assert health_score(HealthInputs(waiting=63, peer_waiting=0, waiting_before=70, kv_usage=0.99)) == 1.0
    # a stuck engine: the same queue, held or growing, scores as before
    stuck = health_score(HealthInputs(waiting=63, peer_waiting=0))
    assert stuck < 0.05
    assert health_score(HealthInputs(waiting=63, peer_waiting=0, waiting_before=63)) == stuck
    assert health_score(HealthInputs(waiting=63, peer_waiting=0, waiting_before=20)) == stuck
    # draining spares the queue only: a failed probe still scores 0
    assert health_score(HealthInputs(probe_ok=False, waiting=5, waiting_before=70)) == 0.0
