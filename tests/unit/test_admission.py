"""Overload held at the edge (router.tenancy.admission): who waits, who goes next, and who gets a 429."""

from __future__ import annotations

import asyncio

import pytest

from router.config import AUTO_QUEUED, ReplicaSpec, RouterConfig
from router.fleet import Fleet
from router.health.signals import EngineStats
from router.keys import RoutingKey
from router.policy import make_policy
from router.tenancy.admission import Admission, Shed, client_of
from router.tenancy.clients import RANK


def fleet_of(n: int = 2) -> Fleet:
    return Fleet([ReplicaSpec(f"r{i}", f"http://10.0.0.{i}:1") for i in range(n)])


def admission(fleet: Fleet, max_queued: int = 100, timeout_s: float = 5.0) -> Admission:
    return Admission(fleet, max_queued, timeout_s, full_waiting=8, full_kv_usage=0.95)


def fill(fleet: Fleet, *, waiting: float = 8, kv: float = 0.5) -> None:
    for r in fleet.replicas:
        r.engine = EngineStats(waiting=waiting, kv_usage=kv)


def test_fullness_from_the_engines_queue_its_kv_and_what_was_sent_since_the_probe() -> None:
    fleet = fleet_of(1)
    a = admission(fleet)
    r = fleet.replicas[0]
    assert not a.full(r)  # nothing known: never full
    r.engine = EngineStats(waiting=6, kv_usage=0.5)
    a.probed()
    assert not a.full(r)
    fleet.acquire(r)
    fleet.acquire(r)  # two more sent since the probe: they wait there too
    assert a.queue_of(r) == 8 and a.full(r)
    fleet.release(r)
    assert not a.full(r)
    r.engine = EngineStats(waiting=0, kv_usage=0.96)
    assert a.full(r)
    r.engine = EngineStats()
    fleet.release(r)
    r.capacity = 4  # no queue reported, its slots known (llama-server)
    for _ in range(11):
        fleet.acquire(r)
    assert not a.full(r)
    fleet.acquire(r)
    assert a.full(r)  # 4 running + 8 queued


async def test_off_or_with_room_a_request_goes_on_at_once() -> None:
    fleet = fleet_of()
    assert await Admission(fleet, 0, 1.0, 8, 0.95).enter(None, "c", False, 1e9) == 0.0
    fill(fleet)
    assert await Admission(fleet, 0, 1.0, 8, 0.95).enter(None, "c", False, 1e9) == 0.0  # off
    fleet.replicas[1].engine = EngineStats(waiting=0)
    assert await admission(fleet).enter(None, "c", False, 1e9) == 0.0  # r1 has room


async def test_a_full_fleet_holds_requests_and_lets_one_through_per_request_that_ends() -> None:
    fleet = fleet_of()
    fill(fleet)
    a = admission(fleet)
    tasks = [asyncio.create_task(a.enter(None, f"c{i}", False, 1e9)) for i in range(3)]
    await asyncio.sleep(0)
    assert a.queued == 3 and not any(t.done() for t in tasks)
    fleet.replicas[0].engine = EngineStats(waiting=7)  # room for one
    a.released()
    await asyncio.sleep(0)
    assert sum(t.done() for t in tasks) == 1 and a.queued == 2
    a.probed()  # a probe round: up to one per replica with room
    await asyncio.sleep(0)
    assert sum(t.done() for t in tasks) == 3 and a.queued == 0


async def test_past_the_queue_size_or_the_time_limit_a_429_with_retry_after() -> None:
    fleet = fleet_of()
    fill(fleet)
    a = admission(fleet, max_queued=2, timeout_s=0.05)
    waiting = [asyncio.create_task(a.enter(None, "c", False, 1e9)) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Shed) as full:
        await a.enter(None, "c", False, 1e9)
    assert (full.value.status, full.value.reason) == (429, "queue_full") and full.value.retry_after_s >= 1
    for task in waiting:
        with pytest.raises(Shed) as late:
            await task
        assert late.value.reason == "timeout"
    assert a.queued == 0 and a.shed == {"queue_full": 1, "timeout": 2}
    # the request's own deadline bounds the wait too
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(Shed):
        await admission(fleet, timeout_s=10).enter(None, "c", False, a.clock() + 0.05)
    assert loop.time() - start < 5


async def test_a_client_that_leaves_while_it_waits_leaves_the_queue() -> None:
    fleet = fleet_of()
    fill(fleet)
    a = admission(fleet)
    task = asyncio.create_task(a.enter(None, "c", False, 1e9))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert a.queued == 0 and not any(line.clients for line in a.classes)


async def let_through(
    a: Admission, fleet: Fleet, entries: list[tuple[str, bool]], ranks: list[int] | None = None
) -> list[int]:
    """Queue `entries` (client, running session; of priority classes `ranks`) on a full fleet,
    then free one slot at a time: the order they go on in, as indices of `entries`."""
    order: list[int] = []

    async def one(i: int, client: str, running: bool) -> None:
        await a.enter(None, client, running, 1e9, ranks[i] if ranks else RANK["default"])
        order.append(i)

    tasks = [asyncio.create_task(one(i, c, r)) for i, (c, r) in enumerate(entries)]
    await asyncio.sleep(0)
    fleet.replicas[0].engine = EngineStats(waiting=0)
    for _ in entries:
        a.released()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return order


async def test_running_sessions_go_first_then_clients_take_turns() -> None:
    fleet = fleet_of(1)
    fill(fleet)
    a = admission(fleet)
    # a burst from "greedy" queued first, then one request from "modest"; a running session's turn last
    entries = [("greedy", False)] * 4 + [("modest", False), ("greedy", True)]
    order = await let_through(a, fleet, entries)
    assert order[0] == 5  # the running session's turn, though it came last
    assert order.index(4) == 2  # "modest" waits behind one of greedy's requests, not four
    assert sorted(order) == list(range(6))


async def test_a_higher_class_goes_first_and_takes_the_place_of_a_lower_one() -> None:
    fleet = fleet_of(1)
    fill(fleet)
    a = admission(fleet)
    entries = [("batch", False)] * 3 + [("batch", True), ("chat", False), ("ops", False)]
    ranks = [RANK["bulk"]] * 4 + [RANK["interactive"], RANK["system"]]
    order = await let_through(a, fleet, entries, ranks)
    assert order[:2] == [5, 4] and order[2] == 3  # system, interactive, then bulk's running turn first
    # a full queue: an interactive request takes the place of bulk's newest, even from a client with none waiting
    fill(fleet)
    a = admission(fleet, max_queued=3)
    bulk = [asyncio.create_task(a.enter(None, "batch", False, 1e9, RANK["bulk"])) for _ in range(3)]
    await asyncio.sleep(0)
    chat = asyncio.create_task(a.enter(None, "chat", False, 1e9, RANK["interactive"]))
    await asyncio.sleep(0)
    assert a.queued == 3 and not chat.done()
    with pytest.raises(Shed):
        await bulk[-1]
    # but another bulk request of the same client finds no room among its betters: its own 429
    with pytest.raises(Shed) as shed:
        await a.enter(None, "batch", False, 1e9, RANK["bulk"])
    assert shed.value.reason == "queue_full"
    chat.cancel()
    for task in bulk[:2]:
        task.cancel()
    await asyncio.gather(chat, *bulk[:2], return_exceptions=True)
    assert a.queued == 0


async def test_a_sheddable_request_never_waits() -> None:
    fleet = fleet_of(1)
    a = admission(fleet)
    assert await a.enter(None, "c", False, 1e9, RANK["sheddable"]) == 0.0  # room: it goes on
    fill(fleet)
    with pytest.raises(Shed) as shed:
        await a.enter(None, "c", False, 1e9, RANK["sheddable"])
    assert shed.value.reason == "sheddable" and shed.value.retry_after_s >= 1 and a.queued == 0


async def test_one_full_model_does_not_hold_another_back() -> None:
    fleet = fleet_of(2)
    fleet.set_models(fleet.replicas[0], frozenset({"a"}))
    fleet.set_models(fleet.replicas[1], frozenset({"b"}))
    fill(fleet)
    a = admission(fleet)
    for_a = asyncio.create_task(a.enter("a", "c", False, 1e9))
    for_b = asyncio.create_task(a.enter("b", "c", False, 1e9))
    await asyncio.sleep(0)
    fleet.replicas[1].engine = EngineStats(waiting=0)  # room on b's replica only
    a.released()
    await asyncio.sleep(0)
    assert for_b.done() and not for_a.done()
    # and a new request for b goes on at once; one for a queues behind the one waiting
    assert await a.enter("b", "d", False, 1e9) == 0.0
    fleet.replicas[0].engine = EngineStats(waiting=0)
    late = asyncio.create_task(a.enter("a", "d", False, 1e9))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not late.done()  # nobody jumps the queue of its model ...
    assert for_a.done()  # ... and with room there, the first in it goes as the next one queues
    a.released()
    a.released()
    await asyncio.wait_for(asyncio.gather(for_a, late), 1)


async def test_nothing_routable_is_not_queued() -> None:
    fleet = fleet_of(1)
    fill(fleet)
    fleet.drain("r0")
    assert await admission(fleet).enter(None, "c", False, 1e9) == 0.0  # the router's 503 answers it


def test_clients_by_key_then_user_then_address() -> None:
    assert client_of({"authorization": "Bearer a"}, {"user": "u"}, "1.2.3.4").startswith("key:")
    assert client_of({"authorization": "Bearer a"}, None, None) != client_of({"authorization": "Bearer b"}, None, None)
    assert client_of({}, {"user": "u"}, "1.2.3.4") == "user:u"
    assert client_of({}, {"user": 5}, "1.2.3.4") == "addr:1.2.3.4"


async def test_a_full_queue_makes_room_for_a_client_with_fewer_waiting() -> None:
    fleet = fleet_of(1)
    fill(fleet)
    a = admission(fleet, max_queued=4)
    greedy = [asyncio.create_task(a.enter(None, "greedy", False, 1e9)) for _ in range(4)]
    await asyncio.sleep(0)
    modest = asyncio.create_task(a.enter(None, "modest", False, 1e9))
    await asyncio.sleep(0)
    assert a.queued == 4 and not modest.done()  # it took the place of greedy's newest
    with pytest.raises(Shed):
        await greedy[-1]
    second = asyncio.create_task(a.enter(None, "modest", False, 1e9))
    await asyncio.sleep(0)
    with pytest.raises(Shed):
        await greedy[-2]
    # now 2 and 2: a third from "modest" would leave it with more than greedy: it is shed itself
    with pytest.raises(Shed):
        await a.enter(None, "modest", False, 1e9)
    # a running session's turn goes before new work, whoever waits
    turn = asyncio.create_task(a.enter(None, "modest", True, 1e9))
    await asyncio.sleep(0)
    assert a.queued == 4 and not turn.done()
    fleet.replicas[0].engine = EngineStats(waiting=0)
    a.released()
    await asyncio.sleep(0)
    assert turn.done()
    for task in (*greedy[:2], modest, second):
        task.cancel()
    await asyncio.gather(*greedy, modest, second, return_exceptions=True)
    assert a.queued == 0


@pytest.mark.parametrize("policy", ["ttft", "affinity", "consistent_hash", "least_load"])
def test_with_admission_on_a_full_replica_is_no_candidate_while_another_has_room(policy: str) -> None:
    fleet = fleet_of(3)
    a = admission(fleet)
    fleet.full_of = a.full_of
    chosen = make_policy(policy, fleet, RouterConfig(policy=policy))
    fill(fleet)
    fleet.replicas[2].engine = EngineStats(waiting=0)
    keys = [RoutingKey(f"s{i}".encode(), "header", "x-session-id") for i in range(50)]
    assert {chosen.pick(k, "r0", set()).index for k in keys} == {2}  # type: ignore[union-attr]
    fill(fleet)  # every one full: the policy chooses as it would without admission
    assert len({chosen.pick(k, None, set()).index for k in keys}) > 1  # type: ignore[union-attr]


def test_what_is_sent_after_a_probe_first_takes_the_slots_the_engine_had_free() -> None:
    fleet = fleet_of(1)
    a = Admission(fleet, 10, 1.0, full_waiting=2, full_kv_usage=0.95)
    r = fleet.replicas[0]
    r.capacity = 4
    r.engine = EngineStats(waiting=0, running=1, kv_usage=0.1)
    fleet.acquire(r)
    r.inflight_at_read = 1  # read with one running: three slots free
    a.probed()
    for _ in range(4):
        fleet.acquire(r)
    assert a.queue_of(r) == 1 and not a.full(r)  # three took the free slots, one waits
    fleet.acquire(r)
    assert a.queue_of(r) == 2 and a.full(r)
    for _ in range(3):
        fleet.release(r)
    assert a.queue_of(r) == 0

    # no capacity known: what it ran the last time it queued stands for it, once it has queued
    # (each read counts what the router has in flight there: 3, then 9, then 3)
    r.capacity = None
    r.engine = EngineStats(waiting=0, running=3, kv_usage=0.1)
    r.inflight_at_read = r.inflight
    a.probed()
    for _ in range(20):
        fleet.acquire(r)
    assert a.queue_of(r) is None and not a.full(r)  # never seen queueing: its limit is unknown
    for _ in range(14):
        fleet.release(r)
    r.engine = EngineStats(waiting=3, running=6, kv_usage=0.2)
    r.inflight_at_read = r.inflight
    a.probed()
    assert a.queue_of(r) == 3 and a.full(r)
    for _ in range(6):
        fleet.release(r)
    r.engine = EngineStats(waiting=0, running=3, kv_usage=0.2)
    r.inflight_at_read = r.inflight
    a.probed()
    fleet.acquire(r)
    fleet.acquire(r)
    fleet.acquire(r)
    assert a.queue_of(r) == 0  # three slots of the six it ran when it queued were free
    fleet.acquire(r)
    fleet.acquire(r)
    assert a.full(r)


def test_what_was_in_flight_at_the_read_beyond_the_engines_figures_takes_slots_too() -> None:
    """vLLM's gauges are its scheduler's at its last step: eight requests the router had just sent
    were in neither its running nor its waiting count (measured: 0 and 0 with eight sent, 30 ms
    later 4 and 4). Read so, its four slots are taken by four of them, and the other four wait."""
    fleet = fleet_of(1)
    a = Admission(fleet, 10, 1.0, full_waiting=1, full_kv_usage=0.95)
    r = fleet.replicas[0]
    r.capacity = 4
    for _ in range(8):
        fleet.acquire(r)
    r.engine = EngineStats(waiting=0, running=0, kv_usage=0.0)
    r.inflight_at_read = 8
    a.probed()
    assert a.queue_of(r) == 4 and a.full(r)  # (counted as the figures say, it had four slots free)
    r.engine = EngineStats(waiting=4, running=4, kv_usage=0.1)  # the next read: they are in its figures
    a.probed()
    assert a.queue_of(r) == 4
    for _ in range(4):  # four answered, and four more sent before the next read: its figures lag again
        fleet.release(r)
        fleet.acquire(r)
    r.engine = EngineStats(waiting=0, running=4, kv_usage=0.1)
    a.probed()
    assert a.queue_of(r) == 4 and a.full(r)
    # a read counting more than the router sent (another router's, or replies it has not relayed
    # yet) takes what it counts
    r.engine = EngineStats(waiting=0, running=2, kv_usage=0.1)
    for _ in range(7):
        fleet.release(r)
    r.inflight_at_read = r.inflight
    a.probed()
    assert r.inflight == 1 and a.queue_of(r) == 0
    fleet.acquire(r)
    fleet.acquire(r)
    assert a.queue_of(r) == 0 and not a.full(r)
    fleet.acquire(r)
    assert a.queue_of(r) == 1 and a.full(r)


def test_a_worker_process_fills_its_share_of_the_free_slots_before_counting_sends_as_queued() -> None:
    fleet = fleet_of(1)
    a = Admission(fleet, 10, 1.0, full_waiting=2, full_kv_usage=0.95, free_share=0.5)  # one of two workers
    r = fleet.replicas[0]
    r.capacity = 8
    r.engine = EngineStats(waiting=0, running=4, kv_usage=0.1)
    a.probed()
    for _ in range(3):
        fleet.acquire(r)
    assert a.queue_of(r) == 1  # two of the four free slots are this worker's; the other two the other's


async def test_auto_holds_by_time_from_the_service_rate_it_measures() -> None:
    fleet = fleet_of(2)
    now = [0.0]
    a = Admission(fleet, AUTO_QUEUED, 10.0, full_waiting=8, full_kv_usage=0.95, clock=lambda: now[0], ttft_target_s=2.0)
    r0, r1 = fleet.replicas
    fill(fleet, waiting=4)
    assert not a.full(r0) and a.rate(r0) is None  # no rate, no capacity known: full at full_waiting (8)
    r0.capacity = 3
    assert a.full_at(r0) == 3  # its capacity known: one round of its work queued
    for i in range(16):  # each replica answers 5 a second, for 3 s (RATE_SPAN_S: then its rate is known)
        now[0] = i * 0.2
        a.answered(r0)
        a.answered(r1)
    assert a.rate(r0) == pytest.approx(5.0, rel=0.1) and a.fleet_rate() == pytest.approx(10.0, rel=0.1)
    # full once its queue holds what it starts in a quarter of the 2 s target: 5 x 0.5 -> 2
    assert a.full_at(r0) == 2 and a.full(r0) and a.full(r1)
    # the fleet starts 10 a second and a request may wait half its target (1 s) here: ten wait,
    # the eleventh is refused at once with the wait it would have had
    waiting = [asyncio.create_task(a.enter(None, f"c{i}", False, 1e9)) for i in range(10)]
    await asyncio.sleep(0)
    assert a.queued == 10
    with pytest.raises(Shed) as refused:
        await a.enter(None, "late", False, 1e9)
    assert refused.value.reason == "late" and refused.value.retry_after_s == 2 and a.shed["late"] == 1
    # a request with a target of its own (x-slo-ttft-ms) or a higher class has fewer ahead of it
    with pytest.raises(Shed):
        await a.enter(None, "hurried", False, 1e9, target_s=1.0)
    urgent = asyncio.create_task(a.enter(None, "vip", False, 1e9, rank=RANK["interactive"]))
    await asyncio.sleep(0)
    assert a.queued == 11 and not urgent.done()
    for task in [*waiting, urgent]:
        task.cancel()
    await asyncio.gather(*waiting, urgent, return_exceptions=True)


async def test_auto_refuses_a_waiter_once_half_its_target_has_passed() -> None:
    fleet = fleet_of(1)
    a = Admission(fleet, AUTO_QUEUED, 10.0, full_waiting=8, full_kv_usage=0.95, ttft_target_s=0.2)
    fill(fleet)
    with pytest.raises(Shed) as refused:  # no rate known: it waits, but no longer than 0.1 s
        await asyncio.wait_for(a.enter(None, "c", False, 1e9), 2.0)
    assert refused.value.reason == "timeout"
