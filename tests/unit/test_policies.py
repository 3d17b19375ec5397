"""Every policy spreads, skips replicas that cannot serve, and says so when none can."""

from __future__ import annotations

from collections import Counter

import pytest

from router.config import RouterConfig, parse_replica
from router.fleet import Fleet
from router.keys import NO_KEY, RoutingKey
from router.policy import REGISTRY, make_policy
from router.policy.base import clockwise


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


@pytest.mark.parametrize("n", [1, 7, 8, 9, 30])
def test_a_clockwise_walk_asked_in_two_parts_is_the_rings_whole_order(n: int) -> None:
    fleet, _ = setup("affinity", n=n)
    for i in range(50):
        assert list(clockwise(fleet.ring, k(i).key)) == fleet.ring.successors(k(i).key)


def test_a_spill_goes_clockwise_past_capped_replicas_far_round_the_ring() -> None:
    fleet, policy = setup("affinity", n=30, bounded_load_c=1.25, bounded_load_floor=1)
    key = k(5)
    order = fleet.ring.successors(key.key)
    for i in order[:12]:  # the owner and the next eleven at their caps (past the walk's first part)
        fleet.loads[i] = 10
    spill = policy.pick(key, None, ())  # type: ignore[attr-defined]
    assert (spill.reason, spill.index) == ("spill", order[12])
    # a retry that excludes the owner and the next replica goes on from there, capped ones passed over
    retry = policy.pick(key, None, set(order[:2]))  # type: ignore[attr-defined]
    assert (retry.reason, retry.index) == ("failover", order[12])


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


def test_a_full_replica_spills_even_under_the_floor_when_its_capacity_is_known() -> None:
    # issue 16: a 4-slot llama-server kept getting a session's requests up to the floor of 8, so
    # the queued ones waited ~23 s; with its slots known, its floor is its capacity
    fleet, policy = setup("affinity", n=2)
    key = k(3)
    owner = fleet.ring.lookup(key.key)
    other = 1 - owner
    fleet.loads[owner] = 4
    assert policy.pick(key, fleet.replicas[owner].id, ()).index == owner  # type: ignore[attr-defined]  # unknown: floor 8
    for r in fleet.replicas:
        fleet.set_capacity(r, 4)
    moved = policy.pick(key, fleet.replicas[owner].id, ())  # type: ignore[attr-defined]
    assert (moved.index, moved.reason) == (other, "spill")
    fleet.loads[owner] = 3
    assert policy.pick(key, fleet.replicas[owner].id, ()).reason == "sticky"  # type: ignore[attr-defined]


def test_caps_scale_with_capacity_and_stay_uniform_when_all_alike() -> None:
    fleet, _policy = setup("affinity", n=3)

    def caps(uniform: int, floor: int = 8) -> list[int]:
        got = fleet.load_caps(uniform, floor)
        return [got.of(i) for i in range(3)]

    assert caps(40) == [40, 40, 40] and caps(4) == [8, 8, 8]  # nothing known: as before
    for r in fleet.replicas:
        fleet.set_capacity(r, 64)
    assert fleet.capacity_ratios() is None and caps(40) == [40, 40, 40]  # all alike: the uniform caps
    for r, size in zip(fleet.replicas, (32, 64, 96), strict=True):
        fleet.set_capacity(r, size)
    assert caps(40) == [20, 40, 60]
    assert caps(4) == [8, 8, 8]  # the floor still holds below them
    # a replica of unknown capacity counts as the mean of the known ones
    fleet.set_capacity(fleet.replicas[1], None)
    assert fleet.replicas[1].capacity is None and caps(40)[1] == 40
    # least-loaded goes by load for its capacity: 30 of 96 is emptier than 12 of 32
    fleet.loads[0], fleet.loads[1], fleet.loads[2] = 12, 50, 30
    assert fleet.fullness(2) < fleet.fullness(0)


def test_no_cap_above_capacity_while_a_slot_is_free_somewhere() -> None:
    fleet, policy = setup("affinity", n=2)
    for r in fleet.replicas:
        fleet.set_capacity(r, 2)
    # three in flight, four slots: the uniform cap (3) would queue one on a full replica
    fleet.loads[0], fleet.loads[1] = 2, 1
    assert fleet.load_caps(3, 8).of(0) == 2
    key = next(k(i) for i in range(100) if fleet.ring.lookup(k(i).key) == 0)
    spilled = policy.pick(key, None, ())  # type: ignore[attr-defined]
    assert (spilled.index, spilled.reason) == (1, "spill")
    # every slot busy: nothing to gain by moving, the queue is shared out by the caps
    fleet.loads[0], fleet.loads[1] = 2, 2
    assert fleet.load_caps(3, 8).of(0) == 3
    assert policy.pick(key, None, ()).index == 0  # type: ignore[attr-defined]


def test_least_load_goes_by_capacity() -> None:
    fleet, policy = setup("least_load", n=2)
    fleet.loads[0], fleet.loads[1] = 3, 5
    assert policy.pick(NO_KEY, None, ()).index == 0  # type: ignore[attr-defined]
    fleet.set_capacity(fleet.replicas[0], 4)
    fleet.set_capacity(fleet.replicas[1], 16)
    assert policy.pick(NO_KEY, None, ()).index == 1  # type: ignore[attr-defined]  # 5 of 16 beats 3 of 4


def test_configured_capacity_stands_until_the_engine_reports_one() -> None:
    specs = tuple(parse_replica(f"a{i}=http://127.0.0.1:{9000 + i}") for i in range(3))
    fleet = Fleet(specs, 16, 0, capacities={"a0": 2, "*": 8})
    assert [r.capacity for r in fleet.replicas] == [2, 8, 8]
    fleet.set_capacity(fleet.replicas[1], 4.0)  # llama-server's /slots
    assert fleet.replicas[1].capacity == 4
    fleet.set_capacity(fleet.replicas[1], None)  # an engine that reports none: the setting again
    assert fleet.replicas[1].capacity == 8
    fleet.add(parse_replica("a9=http://127.0.0.1:9009"))
    assert fleet.replicas[-1].capacity == 8


def test_requests_on_a_draining_replica_take_no_routable_slot() -> None:
    fleet, _policy = setup("affinity", n=3)
    for r in fleet.replicas:
        fleet.set_capacity(r, 2)
    fleet.loads[0], fleet.loads[1], fleet.loads[2] = 2, 2, 1
    fleet.drain(fleet.replicas[0].id)  # its two requests finish there; replica 2 still has a free slot
    assert fleet.load_caps(3, 8).of(1) == 2


def test_capacity_caps_off_routes_as_if_no_capacity_were_known() -> None:
    specs = tuple(parse_replica(f"http://127.0.0.1:{9000 + i}") for i in range(2))
    config = RouterConfig(replicas=specs, capacity_caps=False)
    fleet = Fleet(specs, config.vnodes, config.hash_seed, capacity_caps=False)
    policy = make_policy("affinity", fleet, config)
    for r in fleet.replicas:
        fleet.set_capacity(r, 2)
    assert [r.capacity for r in fleet.replicas] == [2, 2]  # still known, and shown
    fleet.loads[0] = 4
    assert fleet.load_limit(1, 8) == 8 and fleet.capacity_ratios() is None
    key = next(k(i) for i in range(100) if fleet.ring.lookup(k(i).key) == 0)
    assert policy.pick(key, fleet.replicas[0].id, ()).reason == "sticky"  # type: ignore[attr-defined]
