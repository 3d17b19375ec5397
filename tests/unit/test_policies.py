"""Every policy spreads, skips replicas that cannot serve, and says so when none can."""

from __future__ import annotations

from collections import Counter

import pytest

from router.config import RouterConfig, parse_replica
from router.fleet import Fleet
from router.keys import NO_KEY, RoutingKey
from router.policy import REGISTRY, make_policy


def setup(name: str, n: int = 4, **cfg: object) -> tuple[Fleet, object]:
    specs = tuple(parse_replica(f"http://127.0.0.1:{9000 + i}") for i in range(n))
    config = RouterConfig(replicas=specs, policy=name, **cfg)  # type: ignore[arg-type]
    fleet = Fleet(specs, config.vnodes, config.hash_seed)
    return fleet, make_policy(name, fleet, config)


def k(i: int) -> RoutingKey:
    return RoutingKey(f"session-{i}".encode(), "header", "x-session-id")


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_spreads_over_the_fleet(name: str) -> None:
    _fleet, policy = setup(name)
    counts = Counter(policy.pick(k(i), None, ()).index for i in range(400))  # type: ignore[attr-defined]
    assert set(counts) == {0, 1, 2, 3}
    assert min(counts.values()) > 40


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_skips_drained_and_excluded_and_none_left(name: str) -> None:
    fleet, policy = setup(name)
    fleet.drain(fleet.replicas[1].id)
    for i in range(100):
        d = policy.pick(k(i), None, {2})  # type: ignore[attr-defined]
        assert d is not None and d.index not in (1, 2)
    assert policy.pick(k(1), None, {0, 2, 3}) is None  # type: ignore[attr-defined]
    for r in list(fleet.replicas):
        fleet.drain(r.id)
    assert policy.pick(k(1), None, ()) is None  # type: ignore[attr-defined]
    assert policy.pick(NO_KEY, None, ()) is None  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["affinity", "consistent_hash"])
def test_hashing_policies_keep_a_key_on_its_replica(name: str) -> None:
    fleet, policy = setup(name)
    for i in range(50):
        first = policy.pick(k(i), None, ())  # type: ignore[attr-defined]
        assert first is not None and first.index == fleet.ring.lookup(k(i).key)
        assert policy.pick(k(i), None, ()).index == first.index  # type: ignore[attr-defined]
        retry = policy.pick(k(i), None, {first.index})  # type: ignore[attr-defined]
        assert retry.index == fleet.ring.successors(k(i).key)[1] and retry.reason == "failover"


def test_affinity_sticks_spills_under_load_and_keeps_the_spill_sticky() -> None:
    fleet, policy = setup("affinity", bounded_load_c=1.25)
    key = k(7)
    owner = fleet.ring.lookup(key.key)
    assert policy.pick(key, None, ()).reason == "ring"  # type: ignore[attr-defined]
    # the owner is overloaded: bounded load sends the key to its ring successor, not anywhere
    fleet.loads[owner] = 10
    spill = policy.pick(key, None, ())  # type: ignore[attr-defined]
    assert spill.reason == "spill" and spill.index == fleet.ring.successors(key.key)[1]
    # once served there, the session stays on the spill target while it is not overloaded
    fleet.loads[owner] = 0
    stay = policy.pick(key, fleet.replicas[spill.index].id, ())  # type: ignore[attr-defined]
    assert stay.index == spill.index and stay.reason == "sticky"
    # a draining replica keeps serving its sessions until the drain has warmed and moved them...
    fleet.drain(fleet.replicas[spill.index].id)
    kept = policy.pick(key, fleet.replicas[spill.index].id, ())  # type: ignore[attr-defined]
    assert kept.index == spill.index and kept.reason == "sticky"
    assert policy.pick(k(8), None, ()).index != spill.index  # type: ignore[attr-defined]  # but takes no new ones
    # ...while a removed one keeps nothing
    removed = fleet.replicas[spill.index]
    removed.health.state = "removed"  # as three failed probes would leave it
    back = policy.pick(key, removed.id, ())  # type: ignore[attr-defined]
    assert back.index == owner


def test_requests_without_a_key_never_pile_onto_one_replica() -> None:
    for name in ("affinity", "consistent_hash", "least_load"):
        _fleet, policy = setup(name)
        counts = Counter(policy.pick(NO_KEY, None, ()).index for _ in range(400))  # type: ignore[attr-defined]
        assert len(counts) == 4 and max(counts.values()) <= 101, (name, counts)  # equal loads: ties rotate


def test_least_load_prefers_the_idle_replica() -> None:
    fleet, policy = setup("least_load")
    for i, load in enumerate((5, 3, 0, 9)):
        fleet.loads[i] = load
    assert {policy.pick(NO_KEY, None, ()).index for _ in range(10)} == {2}  # type: ignore[attr-defined]


def test_unknown_policy() -> None:
    fleet, _ = setup("affinity")
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest", fleet, RouterConfig(replicas=(parse_replica("http://a:1"),)))


def test_the_engine_queue_can_count_toward_the_load_cap() -> None:
    fleet, policy = setup("affinity", bounded_load_c=1.25)
    key = k(3)
    owner = fleet.ring.lookup(key.key)
    fleet.set_queue_load(fleet.replicas[owner], 12)  # load_queue_weight 1 x 12 requests waiting there
    assert fleet.loads[owner] == 12
    assert policy.pick(key, None, ()).reason == "spill"  # type: ignore[attr-defined]
    fleet.set_queue_load(fleet.replicas[owner], 0)  # the queue drained
    assert fleet.loads[owner] == 0 and policy.pick(key, None, ()).reason == "ring"  # type: ignore[attr-defined]
