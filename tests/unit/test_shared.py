"""The shared replica table between the control loop and workers, in one process (no sockets)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import pytest

from router.config import ReplicaSpec, RouterConfig
from router.fleet import Fleet
from router.health.signals import EngineStats
from router.keys import RoutingKey
from router.policy import make_policy
from router.shm.layout import COUNTER_CELL
from router.shm.table import SlotTable
from router.state.replica_table import ERRORS, INFLIGHT, OWNER, REQUESTS, Follower, Publisher, owner_tag
from router.state.session_table import SharedSessions

SPECS = [ReplicaSpec(f"r{i}", f"http://10.0.0.{i}:8000") for i in range(5)]
KEYS = [f"session-{i}".encode() for i in range(2000)]


@pytest.fixture
def table() -> Iterator[SlotTable]:
    t = SlotTable.create(f"kvar-test-{os.getpid()}-{uuid.uuid4().hex[:8]}", 8, workers=2)
    yield t
    t.close()


def published(table: SlotTable, specs: list[ReplicaSpec]) -> tuple[Fleet, Publisher, list[Fleet], list[Follower]]:
    """A control loop's fleet published to the table, and two workers following it."""
    control = Fleet(specs)
    publisher = Publisher(control, table)
    publisher.publish()
    workers = [Fleet([]) for _ in range(table.workers)]
    return control, publisher, workers, [Follower(f, table, w, 20.0) for w, f in enumerate(workers)]


def owners(fleet: Fleet) -> list[str]:
    return [fleet.replicas[fleet.ring.lookup(k)].id for k in KEYS]


def test_workers_follow_membership_health_and_weights(table: SlotTable) -> None:
    control, publisher, workers, followers = published(table, SPECS)
    for f in followers:
        assert f.sync() and not f.sync()  # read once, then only when the generation moves
    assert owners(workers[0]) == owners(workers[1]) == owners(control)

    now = 100.0
    sick = control.find("r2")
    assert sick is not None
    for _ in range(3):
        sick.health.observe(0.1, now)
    control.apply_health(sick, now)
    assert sick.state == "removed"
    degraded = control.find("r3")
    assert degraded is not None
    degraded.health.observe(0.45, now)  # suspect, with a smaller weight
    control.apply_health(degraded, now)
    publisher.publish()
    for f in followers:
        assert f.sync()
    for fleet in workers:
        assert owners(fleet) == owners(control) and "r2" not in owners(fleet)
        assert fleet.find("r2").state == "removed" and fleet.find("r3").state == "suspect"  # type: ignore[union-attr]
        assert fleet.ring.weights[fleet.find("r3").index] == control.ring.weights[degraded.index] < 1  # type: ignore[union-attr]

    removed: list[str] = []
    followers[0].on_removed = removed.append
    control.remove("r0")
    control.add(ReplicaSpec("r9", "http://10.0.0.9:8000"))
    publisher.publish()
    for f in followers:
        f.sync()
    assert removed == ["r0"]
    for fleet in workers:
        assert sorted(r.id for r in fleet.replicas) == sorted(r.id for r in control.replicas)
        assert owners(fleet) == owners(control)
    assert table.read(table.find("r9") or 0).url == "http://10.0.0.9:8000"


def test_in_flight_counts_cross_workers_and_counters_add_up(table: SlotTable) -> None:
    control = Fleet(SPECS[:3])
    publisher = Publisher(control, table)
    publisher.publish()
    a, b = Fleet([]), Fleet([])
    fa, fb = Follower(a, table, 0, 20.0), Follower(b, table, 1, 20.0)
    fa.sync()
    fb.sync()
    ra, rb = a.find("r1"), b.find("r1")
    assert ra is not None and rb is not None and ra.index is not None and rb.index is not None
    for _ in range(3):
        a.acquire(ra)
    b.acquire(rb)
    fb.pull_loads()
    assert b.loads[rb.index] == 4  # its own 1 and worker 0's 3, written as they happened
    a.release(ra)
    ra.errors += 1
    for when in range(6):
        ra.tpot.append((99.0 + when * 0.1, 0.020))
    rb.tpot.append((99.9, 0.400))  # one slow reply through the other worker: the pooled median shrugs
    fa.publish(100.0)
    fb.publish(100.0)
    fb.pull_loads()
    assert b.loads[rb.index] == 3
    publisher.collect()
    r1 = control.find("r1")
    assert r1 is not None
    assert (r1.inflight, r1.requests, r1.errors) == (3, 4, 1)
    assert r1.pooled_tpot == (pytest.approx(0.020), 7)
    publisher.collect()  # counted once, not again
    assert (r1.requests, r1.errors) == (4, 1)

    # a restarted worker counts from zero again: that is new work, not a negative one
    row = table.counters(0)
    base = r1.slot * COUNTER_CELL  # type: ignore[operator]
    row[base + REQUESTS] = 1
    row[base + ERRORS] = 0
    publisher.collect()
    assert (r1.requests, r1.errors) == (5, 1)
    # a cell still counting for another replica (a worker behind a slot's reassignment) is ignored
    row[base + OWNER] = owner_tag("someone-else", 1)
    row[base + INFLIGHT] = 50
    row[base + REQUESTS] = 1000
    publisher.collect()
    assert (r1.requests, r1.inflight) == (5, 1)


def test_a_spill_rechecks_loads_from_the_other_workers(table: SlotTable) -> None:
    control = Fleet(SPECS[:3])
    Publisher(control, table).publish()
    a, b = Fleet([]), Fleet([])
    fa, fb = Follower(a, table, 0, 20.0), Follower(b, table, 1, 20.0)
    fa.sync()
    fb.sync()
    policy = make_policy("affinity", b, RouterConfig(replicas=tuple(SPECS[:3])))
    key = RoutingKey(KEYS[0], "header", "x-session-id")
    owner = b.ring.lookup(key.key)
    other = a.find(b.replicas[owner].id)
    assert other is not None
    a.acquire(other)
    fb.pull_loads()  # worker 1 saw worker 0's request in flight ...
    a.release(other)  # ... which has finished since
    decision = policy.pick(key, None, set())
    assert decision is not None and decision.index == owner and decision.reason == "ring"


def test_a_replica_added_again_under_its_old_id_starts_from_zero(table: SlotTable) -> None:
    control = Fleet(SPECS[:2])
    publisher = Publisher(control, table)
    publisher.publish()
    worker = Fleet([])
    follower = Follower(worker, table, 0, 20.0)
    follower.sync()
    old = worker.find("r1")
    assert old is not None
    for _ in range(40):
        worker.acquire(old)
        old.errors += 1
        worker.release(old)
    # removed and added again (a new epoch) before this worker caught up and wrote its counts
    control.remove("r1")
    control.add(SPECS[1])
    publisher.publish()
    follower.publish(100.0)  # still counting for the old r1
    publisher.collect()
    fresh = control.find("r1")
    assert fresh is not None and (fresh.requests, fresh.errors) == (0, 0)
    follower.sync()
    new = worker.find("r1")
    assert new is not None and new is not old and new.epoch == fresh.epoch > old.epoch
    worker.acquire(new)
    follower.publish(100.0)
    publisher.collect()
    assert (fresh.requests, fresh.errors, fresh.inflight) == (1, 0, 1)
    # a worker restarted: its counts start from zero, and none of them is lost
    publisher.worker_restarted(0)
    restarted = Fleet([])
    again = Follower(restarted, table, 0, 20.0)
    again.sync()
    r = restarted.find("r1")
    assert r is not None
    for _ in range(3):
        restarted.acquire(r)
    again.publish(100.0)
    publisher.collect()
    assert fresh.requests == 4


def test_unchanged_slots_are_not_rewritten(table: SlotTable) -> None:
    control = Fleet(SPECS[:3])
    publisher = Publisher(control, table)
    publisher.publish()
    seqs = [table.seq(i) for i in range(3)]
    generation = table.generation
    publisher.publish()
    assert [table.seq(i) for i in range(3)] == seqs and table.generation == generation
    r = control.find("r2")
    assert r is not None
    r.health.score = 0.95  # shown, but routing does not change: a write without a new generation
    publisher.publish()
    assert table.seq(r.slot or 0) != seqs[r.slot or 0] and table.generation == generation


def test_sessions_are_shared_between_workers() -> None:
    table = SlotTable.create(f"kvar-test-{os.getpid()}-{uuid.uuid4().hex[:8]}", 8, workers=2, sticky_entries=8)
    try:
        control, publisher, fleets, followers = published(table, SPECS[:3])
        for f in followers:
            f.sync()
        a, b = (SharedSessions(table, w, fleets[w], 600.0) for w in range(2))
        now = int(time.time() * 1000)
        assert b.get(b"s1") is None
        a.put(b"s1", fleets[0].find("r1"), now)  # type: ignore[arg-type]
        assert b.get(b"s1") == (fleets[1].find("r1"), now)  # served through worker 0, known to worker 1
        b.put(b"s1", fleets[1].find("r2"), now + 3)  # type: ignore[arg-type]  # 3 ms later worker 1 spilled it
        assert a.get(b"s1") == (fleets[0].find("r2"), now + 3)  # the most recent write wins everywhere
        a.put(b"s1", fleets[0].find("r0"), now + 4)  # type: ignore[arg-type]  # and back again, a ms later
        assert b.get(b"s1") == (fleets[1].find("r0"), now + 4)
        # a replica removed, and its slot given to another: an entry for the old one names nobody
        b.put(b"s2", fleets[1].find("r2"), now)  # type: ignore[arg-type]
        control.remove("r2")
        control.add(ReplicaSpec("r9", "http://10.0.0.9:8000"))
        publisher.publish()
        for f in followers:
            f.sync()
        assert a.get(b"s2") is None
        # memory stays fixed: a full neighbourhood gives up its oldest entry
        r0 = fleets[0].find("r0")
        for i in range(20):
            a.put(f"k{i}".encode(), r0, now + i)  # type: ignore[arg-type]
        assert a.get(b"k19") == (r0, now + 19) and a.get(b"k0") is None
        a.put(b"old", r0, now - 700_000)  # type: ignore[arg-type]  # written longer ago than the TTL
        assert a.get(b"old") is None
    finally:
        table.close()


def test_workers_follow_vnode_overrides(table: SlotTable) -> None:
    control, publisher, workers, followers = published(table, SPECS)
    for f in followers:
        f.sync()
    ring = control.ring
    key = KEYS[0]
    _, origin, number = ring.locate(key)  # type: ignore[misc]
    new_owner = (ring.lookup(key) + 1) % len(SPECS)
    ring.reassign_vnode(origin, number, new_owner)
    generation = table.generation
    publisher.publish()
    assert table.generation > generation  # an override is a routing change
    for f in followers:
        assert f.sync()
    for fleet in workers:
        assert fleet.ring.overrides == ring.overrides and owners(fleet) == owners(control)
        assert fleet.replicas[fleet.ring.lookup(key)].id == SPECS[new_owner].id
    ring.clear_override(origin, number)
    publisher.publish()
    for f in followers:
        f.sync()
    assert all(fleet.ring.overrides == {} and owners(fleet) == owners(control) for fleet in workers)


def test_workers_read_the_engines_kv_size_and_queues(table: SlotTable) -> None:
    """Each worker sizes its own prefix index for a replica from the engine's KV capacity, so the
    control loop's probe of it must reach them, with the waiting requests by kind."""
    control, publisher, workers, followers = published(table, SPECS)
    engine = EngineStats(waiting=1.0, deferred=2.0, running=3.0, kv_usage=0.25, kv_tokens=4128.0, block_size=32.0)
    replica = control.find("r1")
    assert replica is not None
    replica.engine = engine
    publisher.publish()
    for follower, fleet in zip(followers, workers, strict=True):
        follower.sync()
        follower.refresh()
        seen = fleet.find("r1")
        assert seen is not None and seen.engine == engine
        assert fleet.find("r2").engine.kv_tokens is None  # type: ignore[union-attr]  # not read: unknown


def test_a_follower_without_a_worker_reads_the_table_and_writes_nothing(table: SlotTable) -> None:
    """A process that follows the engines' KV events for a shard (router.proxy.followers) keeps
    its fleet equal to the table as a worker does, but has no counters: the workers' rows stay
    theirs, and it has nothing to publish."""
    control, publisher, _, _ = published(table, SPECS)
    rows = [bytes(table.counters(w)) for w in range(table.workers)]
    reader = Fleet([])
    follower = Follower(reader, table, None, 20.0)
    assert follower.sync() and [r.id for r in reader.replicas] == [s.id for s in SPECS]
    assert owners(reader) == owners(control)
    control.remove("r1")
    publisher.publish()
    assert follower.sync() and "r1" not in [r.id for r in reader.replicas]
    assert [bytes(table.counters(w)) for w in range(table.workers)] == rows
    with pytest.raises(TypeError, match="no counters"):
        follower.publish(time.time())
