"""The routing core without sockets: a `Route`'s picks, what it learns from attempts, the session directory."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest

from router.config import load
from router.fleet import Fleet, ReplicaState
from router.keys import RoutingKey
from router.metrics import RouterMetrics
from router.policy import make_policy
from router.prompt import prompt_of
from router.routing import Route, Routing, Served, SessionDirectory
from router.sessions import SessionTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0  # monotonic seconds

    def wall(self) -> float:  # unix seconds: a fixed offset from the monotonic clock
        return 1_800_000_000.0 + self.now

    def wall_ms(self) -> int:
        return int(self.wall() * 1000)


class Siblings:
    """A stand-in for the workers' shared session table."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.entries: dict[bytes, tuple[str, int]] = {}

    def get(self, key: bytes) -> tuple[ReplicaState, int] | None:
        found = self.entries.get(key)
        replica = self.fleet.find(found[0]) if found is not None else None
        return (replica, found[1]) if replica is not None and found is not None else None

    def put(self, key: bytes, replica: ReplicaState, written_ms: int) -> None:
        self.entries[key] = (replica.id, written_ms)


class Peers:
    """A stand-in for Redis: the other routers' sessions."""

    def __init__(self) -> None:
        self.entries: dict[bytes, tuple[str, int]] = {}
        self.written: list[tuple[bytes, str, int]] = []

    async def lookup(self, key: bytes) -> tuple[str, int] | None:
        return self.entries.get(key)

    def served(self, key: bytes, replica: str, written_ms: int) -> None:
        self.written.append((key, replica, written_ms))


class Observer:
    def __init__(self) -> None:
        self.seen: list[tuple[bytes, str, bytes]] = []

    def served(self, key: bytes, path: str, body: bytes) -> None:
        self.seen.append((key, path, body))


def core(policy: str = "affinity", replicas: int = 3, **settings: Any) -> tuple[Routing, Clock, Observer]:
    urls = [f"r{i}=http://127.0.0.1:{9000 + i}" for i in range(replicas)]
    config = load(None, {}, {"replicas": urls, "policy": policy, "state": "none", **settings})
    fleet = Fleet(config.replicas, config.vnodes, config.hash_seed)
    clock = Clock()
    table = SessionTable(1000, config.sticky_ttl_s, clock=lambda: clock.now, wall=clock.wall_ms)
    directory = SessionDirectory(table, config.sticky_ttl_s, wall=clock.wall_ms)
    observer = Observer()
    routing = Routing(
        fleet,
        make_policy(policy, fleet, config),
        directory,
        RouterMetrics(),
        config.max_attempts,
        observer,
        clock=lambda: clock.now,
        wall=clock.wall,
    )
    return routing, clock, observer


def key(text: str) -> RoutingKey:
    return RoutingKey(text.encode(), "header", "x-session-id")


def jumps(routing: Routing) -> dict[str, float]:
    return {
        s.labels["reason"]: s.value
        for metric in routing.metrics.jumps.collect()
        for s in metric.samples
        if s.name.endswith("_total") and s.value
    }


async def serve(routing: Routing, clock: Clock, k: RoutingKey, status: int = 200) -> tuple[Route, ReplicaState]:
    route = await routing.route(k, clock.now, clock.now + 60)
    replica = route.next(clock.now)
    assert replica is not None
    route.release(replica)
    route.served(replica, Served(status, 0.05, 100, 0, 10, streamed=True), "/v1/chat/completions", b"{}")
    return route, replica


async def test_a_session_sticks_and_its_next_turn_is_a_followup_without_a_jump() -> None:
    routing, clock, observer = core()
    _, first = await serve(routing, clock, key("s1"))
    assert routing.directory.table.get(b"s1") == first.id
    assert observer.seen == [(b"s1", "/v1/chat/completions", b"{}")]
    clock.now += 5
    route, again = await serve(routing, clock, key("s1"))
    assert route.last == first.id and again is first and route.decision is not None
    assert route.decision.reason == "sticky" and route.decision.left is None  # it stays: nothing moves
    assert routing.metrics.followups._value.get() == 1 and jumps(routing) == {}


async def test_failover_never_offers_a_replica_twice_and_stops_at_max_attempts() -> None:
    routing, clock, _ = core(replicas=5, max_attempts="3")
    route = await routing.route(key("s1"), clock.now, clock.now + 60)
    offered = []
    while (replica := route.next(clock.now)) is not None:
        assert routing.fleet.loads[replica.index] == 1  # type: ignore[index]  # counted in flight ...
        route.release(replica)
        assert routing.fleet.loads[replica.index] == 0  # type: ignore[index]  # ... until released
        route.failed(replica, "connect")
        offered.append(replica.id)
    assert len(offered) == 3 == len(set(offered)) and not route.timed_out
    assert all(routing.fleet.find(r).errors == 1 for r in offered)  # type: ignore[union-attr]
    assert routing.metrics.retries.labels("connect")._value.get() == 3


async def test_a_served_failover_counts_as_one_and_classifies_the_jump() -> None:
    routing, clock, _ = core()
    _, home = await serve(routing, clock, key("s1"))
    route = await routing.route(key("s1"), clock.now, clock.now + 60)
    first = route.next(clock.now)
    assert first is home
    route.release(first)
    route.failed(first, "http_5xx")
    second = route.next(clock.now)
    assert second is not None and second is not home
    # a failover's pick moves no KV from the home it left: that replica just failed
    assert route.decision is not None and route.decision.left is None
    route.release(second)
    verdict = route.served(second, Served(200))
    assert verdict.followup and verdict.jump == "failover" and not verdict.moved
    assert routing.metrics.failovers._value.get() == 1 and jumps(routing) == {"failover": 1.0}
    assert routing.directory.table.get(b"s1") == second.id  # the session lives where it was served now


async def test_no_attempt_past_the_deadline() -> None:
    routing, clock, _ = core()
    route = await routing.route(key("s1"), clock.now, clock.now + 1)
    clock.now += 1
    assert route.next(clock.now) is None and route.timed_out and route.attempts == 0
    assert list(routing.fleet.loads) == [0, 0, 0]  # nobody was charged for an attempt never made


@pytest.mark.parametrize(
    ("cause", "policy"),
    [("membership", "affinity"), ("health", "affinity"), ("drain", "consistent_hash"), ("ring", "consistent_hash")],
)
async def test_jump_reasons_by_cause(cause: str, policy: str) -> None:
    routing, clock, _ = core(policy)
    fleet = routing.fleet
    _, home = await serve(routing, clock, key("s1"))
    if cause == "membership":
        fleet.remove(home.id)
    elif cause == "health":
        home.health.state = "removed"
        fleet.apply_health(home, clock.now)
    elif cause == "drain":
        fleet.drain(home.id)  # out of the ring: consistent_hash sends its keys to their next owner
    else:  # an override hands the key's vnode to another replica
        _, origin, number = fleet.ring.locate(b"s1")  # type: ignore[misc]
        other = next(r for r in fleet.replicas if r is not home)
        fleet.ring.reassign_vnode(origin, number, other.index)  # type: ignore[arg-type]
    route = await routing.route(key("s1"), clock.now, clock.now + 60)
    replica = route.next(clock.now)
    assert replica is not None and replica.id != home.id
    # the pick says where the session left (router.proxy.disagg moves its KV from there when it is up)
    assert route.decision is not None and route.decision.left == home.id
    route.release(replica)
    verdict = route.served(replica, Served(200))
    assert verdict.followup and verdict.jump == cause and jumps(routing) == {cause: 1.0}


async def test_ttft_counts_a_fingerprint_placed_elsewhere_as_prefix_not_as_a_session_moved() -> None:
    """Two conversations that open alike share a fingerprint key: `ttft` places each by its prompt,
    so the second going elsewhere is no session the router moved (the console shows it apart)."""
    routing, clock, _ = core("ttft")

    def opening_alike(text: str) -> RoutingKey:
        messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
        body = {"model": "m", "messages": [*messages, {"role": "user", "content": text}]}
        return RoutingKey(b"m hello", "prefix", "prefix", prompt_of(body, 64))

    _, first = await serve(routing, clock, opening_alike("the first conversation " * 100))
    for _ in range(4):
        routing.fleet.acquire(first)  # busy: the other conversation is placed elsewhere
    route, other = await serve(routing, clock, opening_alike("another conversation entirely " * 100))
    assert other is not first and route.decision is not None and route.decision.reason in ("cost", "ring")
    assert jumps(routing) == {"prefix": 1.0}


async def test_a_spill_at_the_load_cap_is_a_spill() -> None:
    routing, clock, _ = core(bounded_load_floor="1", bounded_load_c="1.0")
    _, home = await serve(routing, clock, key("s1"))
    for _ in range(3):
        routing.fleet.acquire(home)  # its home is over the bounded-load cap now
    route = await routing.route(key("s1"), clock.now, clock.now + 60)
    replica = route.next(clock.now)
    assert replica is not None and replica is not home
    route.release(replica)
    assert route.served(replica, Served(200)).jump == "spill"


async def test_a_move_the_router_made_counts_under_its_reason_and_outlasts_a_request_under_way() -> None:
    routing, clock, _ = core()
    table = routing.directory.table
    _, home = await serve(routing, clock, key("s1"))
    other = next(r for r in routing.fleet.replicas if r is not home)
    # a turn starts on its home; while it runs the router moves the session (a drain, a migration)
    clock.now += 1
    route = await routing.route(key("s1"), clock.now, clock.now + 60)
    replica = route.next(clock.now)
    assert replica is home
    clock.now += 1
    assert table.move(b"s1", other.id, "migration")
    route.release(replica)
    route.served(replica, Served(200))
    assert table.get(b"s1") == other.id  # the move stands: its next turn goes where it was warmed
    clock.now += 1
    route = await routing.route(key("s1"), clock.now, clock.now + 60)
    replica = route.next(clock.now)
    assert replica is other
    route.release(replica)
    verdict = route.served(replica, Served(200))
    assert verdict.moved and verdict.jump == "migration" and jumps(routing) == {"migration": 1.0}


async def test_a_keyless_or_failed_request_remembers_nothing() -> None:
    routing, clock, observer = core()
    route = await routing.route(RoutingKey(b"", "none", ""), clock.now, clock.now + 60)
    replica = route.next(clock.now)
    assert replica is not None
    route.release(replica)
    assert route.served(replica, Served(200)).followup is False
    await serve(routing, clock, key("s1"), status=500)
    assert len(routing.directory.table) == 0 and observer.seen == []


async def test_a_reply_beside_anothers_long_prefill_is_no_latency_sample() -> None:
    """A long prompt sent to the same replica while a reply decodes stretches its steps: that reply's
    time per token measures the other's prompt, not the replica. A few short ones beside it do not."""
    routing, clock, _ = core()
    for others, counted in ((8000.0, False), (10.0, True)):  # prompt tokens others sent there meanwhile
        route = await routing.route(key("s1"), clock.now, clock.now + 60)
        replica = route.next(clock.now)
        assert replica is not None
        before = len(replica.tpot)
        replica.prompt_sent += others
        clock.now += 1.0
        route.release(replica)
        route.served(replica, Served(200, ttft_s=0.2, prompt_tokens=100, completion_tokens=9, streamed=True))
        assert len(replica.tpot) == before + counted, others


async def test_samples_and_tokens_feed_the_replica() -> None:
    routing, clock, _ = core()
    route = await routing.route(key("s1"), clock.now, clock.now + 60)
    replica = route.next(clock.now)
    assert replica is not None and route.alone
    clock.now += 1.0
    route.release(replica)
    route.served(
        replica, Served(200, ttft_s=0.2, prompt_tokens=1000, cached_tokens=600, completion_tokens=9, streamed=True)
    )
    assert (replica.prompt_tokens, replica.cached_tokens) == (1000, 600)
    assert replica.tpot[-1] == (clock.now, pytest.approx(0.1))  # (1.0 - 0.2) / 8 tokens after the first
    assert replica.ttft[-1] == (clock.now, pytest.approx(0.2 / 400))  # per prompt token computed
    route = await routing.route(key("s2"), clock.now, clock.now + 60)
    cut = route.next(clock.now)
    assert cut is not None
    route.release(cut)
    route.served(cut, Served(200, ttft_s=0.1, completion_tokens=5, streamed=True, cut=True))
    assert cut.errors == 1 and routing.metrics.stream_errors.labels(cut.id)._value.get() == 1


async def test_the_newest_entry_wins_across_local_shared_and_peer_stores() -> None:
    routing, clock, _ = core()
    fleet, table = routing.fleet, routing.directory.table
    siblings, peers = Siblings(fleet), Peers()
    directory = SessionDirectory(table, 600, siblings=siblings, peers=peers, wall=clock.wall_ms)
    table.put(b"k", "r0")
    written = table.written_ms(b"k")
    assert await directory.last_served(b"k") == ("r0", True)
    siblings.entries[b"k"] = ("r1", written + 10)  # another worker served it since
    assert await directory.last_served(b"k") == ("r1", False)
    peers.entries[b"k"] = ("r2", written + 5)  # older than the sibling's: loses
    assert await directory.last_served(b"k") == ("r1", False)
    peers.entries[b"k"] = ("r2", written + 20)  # another router served it last
    assert await directory.last_served(b"k", remember=False) == ("r2", False)
    assert table.get(b"k") == "r0"  # a lookup that routes nothing enters nothing
    assert await directory.last_served(b"k") == ("r2", False)
    assert table.get(b"k") == "r2" and table.written_ms(b"k") == written + 20  # entered here, as old as it is
    peers.entries[b"new"] = ("r1", clock.wall_ms())
    assert await directory.last_served(b"new") == ("r1", False)
    # served here: written to all three
    directory.remember(b"k", fleet.replicas[0], clock.wall_ms() - 1000)
    assert table.get(b"k") == "r0" and siblings.entries[b"k"][0] == "r0" and peers.written[-1][:2] == (b"k", "r0")


def test_routing_core_imports_no_http() -> None:
    """The routing core stands below HTTP (the import contracts in pyproject.toml say so too)."""

    code = (
        "import sys, router.routing; print(sorted(m for m in sys.modules if m.startswith(('aiohttp', 'router.proxy'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_asyncio_is_not_needed_to_open_a_local_route() -> None:
    routing, clock, _ = core()
    route = routing.local_route(key("s1"), clock.now, clock.now + 60)
    assert route.last is None and route.next(clock.now) is not None
    assert asyncio.iscoroutinefunction(routing.route)


# -- ttft: what the prefix index and the prefill model learn from the routes ----------------------


def prompt_key(text: str, session: str = "s") -> RoutingKey:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    return RoutingKey(session.encode(), "header", "x-session-id", prompt_of(body, 64))


async def test_ttft_indexes_a_prompt_where_it_is_sent_before_its_answer() -> None:
    routing, clock, _ = core("ttft")
    placement = routing.policy.placement  # type: ignore[attr-defined]
    assert placement is not None
    first = prompt_key("a long document " * 200, "reader-1")
    route = await routing.route(first, clock.now, clock.now + 60)
    replica = route.next(clock.now)
    assert replica is not None and first.prompt is not None
    chain = first.prompt.chain
    assert placement.index.match(placement.of(replica).holder, chain) == len(chain)  # not yet answered
    # another reader of the document, sent before the first one's answer, goes where it is
    second = prompt_key("a long document " * 200 + "what does it say?", "reader-2")
    route2 = await routing.route(second, clock.now, clock.now + 60)
    assert route2.next(clock.now) is replica and route2.decision is not None
    assert route2.decision.reason == "prefix"


async def test_ttft_forgets_a_prompt_whose_attempt_failed_before_its_first_byte() -> None:
    routing, clock, _ = core("ttft")
    placement = routing.policy.placement  # type: ignore[attr-defined]
    assert placement is not None
    k = prompt_key("a long document " * 200)
    route = await routing.route(k, clock.now, clock.now + 60)
    replica = route.next(clock.now)
    assert replica is not None and k.prompt is not None
    route.failed(replica, "connect")
    route.release(replica)
    assert placement.index.match(placement.of(replica).holder, k.prompt.chain) == 0
    retry = route.next(clock.now)  # the retry elsewhere holds it now
    assert retry is not None and retry is not replica
    assert placement.index.match(placement.of(retry).holder, k.prompt.chain) == len(k.prompt.chain)


async def test_ttft_learns_a_prefill_speed_only_from_a_request_that_had_the_replica_to_itself() -> None:
    routing, clock, _ = core("ttft", replicas=1)
    placement = routing.policy.placement  # type: ignore[attr-defined]
    assert placement is not None
    # prompts long enough to be a speed sample (router.placement.SPEED_MIN_TOKENS)
    alone = await routing.route(prompt_key("first " * 1500, "a"), clock.now, clock.now + 60)
    replica = alone.next(clock.now)
    assert replica is not None
    shared = await routing.route(prompt_key("second " * 1500, "b"), clock.now, clock.now + 60)
    assert shared.next(clock.now) is replica  # two in flight there now
    held = placement.of(replica)
    prior = held.seconds_per_token
    slow = Served(200, 9.0, 2400, 0, 10, streamed=True, token_s=9.0)  # it waited behind the other
    shared.release(replica)
    shared.served(replica, slow, "/v1/chat/completions", b"{}")
    assert held.seconds_per_token == prior and held.samples == 0
    alone.release(replica)
    alone.served(replica, Served(200, 0.2, 2300, 0, 10, streamed=True, token_s=0.2), "/v1/chat/completions", b"{}")
    assert held.samples == 1 and held.seconds_per_token != prior


@pytest.mark.parametrize("cause", ["health", "membership"])
async def test_ttft_counts_a_session_whose_replica_left_by_that_cause_not_by_cost(cause: str) -> None:
    """Its replica left routing, and another holds the conversation's prompt: the session goes
    there, and its jump counts as the replica's leaving, not as a move the policy chose."""
    routing, clock, _ = core("ttft")
    placement, fleet = routing.policy.placement, routing.fleet  # type: ignore[attr-defined]
    assert placement is not None
    k = prompt_key("a long document " * 200)
    _, home = await serve(routing, clock, k)
    other = next(r for r in fleet.replicas if r is not home)
    assert k.prompt is not None
    placement.index.insert(placement.of(other).holder, k.prompt.chain)  # another reader sent it there
    if cause == "health":
        home.health.state = "removed"
        fleet.apply_health(home, clock.now)
    else:
        fleet.remove(home.id)
    route, replica = await serve(routing, clock, k)
    assert replica is other and route.decision is not None and route.decision.reason == "ring"
    assert jumps(routing) == {cause: 1.0}


async def test_ttft_a_session_moved_by_cost_stays_on_its_new_replica_for_the_cool_down() -> None:
    routing, clock, _ = core("ttft", replicas=2, prefill_tokens_per_s="10000", bounded_load_floor="100")
    placement, fleet = routing.policy.placement, routing.fleet  # type: ignore[attr-defined]
    assert placement is not None
    k = prompt_key("a long document " * 200)
    _, home = await serve(routing, clock, k)
    placement.set_busy(placement.of(home), clock.now + 5.0)  # five seconds queued there
    route, moved = await serve(routing, clock, k)
    assert moved is not home and route.decision is not None and route.decision.reason == "cost"
    assert jumps(routing) == {"cost": 1.0}
    clock.now += 10  # its new replica has a queue now; the old one is idle and holds it all
    placement.set_busy(placement.of(moved), clock.now + 5.0)
    route, again = await serve(routing, clock, k)
    assert again is moved and route.decision is not None and route.decision.reason == "sticky"
    assert fleet.find(home.id) is home and jumps(routing) == {"cost": 1.0}


async def test_a_sub_agent_starts_on_its_parents_replica_while_it_has_room_then_keeps_its_own() -> None:
    routing, clock, _ = core(bounded_load_floor="1", bounded_load_c="1.0")
    parent = next(k for k in (key(f"root-{n}") for n in range(50)) if routing.fleet.ring.lookup(k.key) == 0)
    _, home = await serve(routing, clock, parent)
    # a sub-agent whose own key the ring places elsewhere
    sub = next(
        RoutingKey(f"agent-{n}".encode(), "header", "x-claude-code-agent-id", parent=parent.key)
        for n in range(200)
        if routing.fleet.ring.lookup(f"agent-{n}".encode()) != 0
    )
    explained, last = await routing.explain(sub)  # /admin/route says what its route will do
    assert last is None and explained.decision is not None and explained.decision.reason == "parent"
    route, replica = await serve(routing, clock, sub)
    assert replica is home and route.decision is not None and route.decision.reason == "parent"
    assert routing.metrics.followups._value.get() == 0 and jumps(routing) == {}  # a first turn: no jump
    explained, last = await routing.explain(sub)
    assert last == home.id and explained.decision is not None and explained.decision.reason == "sticky"
    # from then on it is a session of its own: its next turn is a follow-up where it was served
    clock.now += 1
    route, again = await serve(routing, clock, sub)
    assert again is home and route.decision is not None and route.decision.reason == "sticky"
    # another sub-agent, while the parent's replica is at its load cap: placed by its own key
    for _ in range(3):
        routing.fleet.acquire(home)
    other = next(
        RoutingKey(f"agent-{n}".encode(), "header", "x-claude-code-agent-id", parent=parent.key)
        for n in range(200, 400)
        if routing.fleet.ring.lookup(f"agent-{n}".encode()) != 0
    )
    explained, _ = await routing.explain(other)
    assert explained.decision is not None and explained.decision.index != home.index
    route = await routing.route(other, clock.now, clock.now + 60)
    replica = route.next(clock.now)
    assert replica is not None and replica is not home and route.decision is not None
    assert route.decision.reason != "parent"
    route.release(replica)


async def test_ttft_a_sub_agent_leaving_its_parents_busy_replica_is_no_session_moved() -> None:
    routing, clock, _ = core("ttft", replicas=2, prefill_tokens_per_s="10000", bounded_load_floor="100")
    policy, placement = routing.policy, routing.policy.placement  # type: ignore[attr-defined]
    text = "a long shared system prompt and tools " * 100
    root = prompt_key(text + "the root's task", session="root")
    _, home = await serve(routing, clock, root)
    placement.set_busy(placement.of(home), clock.now + 5.0)  # five seconds queued where its parent is
    sub = replace(prompt_key(text + "a sub-agent's task", session="root/agent-1"), parent=b"root")
    route, placed = await serve(routing, clock, sub)
    assert placed is not home and route.decision is not None and route.decision.reason == "cost"
    assert jumps(routing) == {} and routing.metrics.followups._value.get() == 0  # its first turn
    assert sub.key not in policy.moves  # no move to keep it from: it may come back beside its parent
