"""A proxied request's journey without sockets (router.proxy.journey): failover, resuming a broken
stream, shedding, and the ledger's finish, with a scripted `Attempts` and an in-memory exchange."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from router.config import load, parse_replica
from router.fleet import Fleet, ReplicaState
from router.metrics import RouterMetrics
from router.policy import make_policy
from router.proxy.forward import Outcome, Retry, Trip
from router.proxy.framer import SseFramer
from router.proxy.intake import Intake, take_in_body
from router.proxy.journey import Journey
from router.proxy.ledger import Ledger
from router.proxy.resume import StreamRecord
from router.proxy.sse import StreamFramer
from router.routing import AGAIN_PAUSE_S, Routing, Served, SessionDirectory
from router.routing.request import Keys
from router.sessions import SessionTable
from router.tenancy.admission import Admission
from router.tenancy.budgets import Budgets, LocalStore, estimate, prompt_estimate
from router.tenancy.clients import RANK, Client
from router.web import JSON


class Exchange:
    """The client's side, in memory."""

    def __init__(self, path: str = "/v1/chat/completions", headers: Mapping[str, str] | None = None) -> None:
        self.method = "POST"
        self.path = path
        self.headers = CIMultiDictProxy(CIMultiDict(headers or {}))
        self.remote: str | None = "10.0.0.9"
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.prepared = False
        self.body = b""
        self.sent_headers: dict[str, str] = {}
        self.ended = False

    def answer(self, status: int, body: bytes, headers: Mapping[str, str], close: bool = False) -> None:
        self.status, self.body, self.sent_headers = status, body, dict(headers)

    async def prepare(self, status: int, headers: Mapping[str, str]) -> None:
        self.status, self.prepared, self.sent_headers = status, True, dict(headers)

    async def write(self, data: bytes) -> None:
        self.body += data

    async def write_eof(self) -> None:
        self.ended = True


Step = Callable[[ReplicaState, Trip], "Retry | Outcome"]


class Script:
    """Attempts that do what the test says, replica by replica, and remember where they went."""

    def __init__(self, *steps: Step, resumes: tuple[Callable[[Outcome], Retry | None], ...] = ()) -> None:
        self.steps = list(steps)
        self.resumes = list(resumes)
        self.sent: list[str] = []
        self.resumed: list[tuple[str, dict[str, Any]]] = []

    async def send(self, replica: ReplicaState, trip: Trip, deadline: float, decision: Any = None) -> Retry | Outcome:
        self.sent.append(replica.id)
        return self.steps.pop(0)(replica, trip)

    async def resume(
        self, replica: ReplicaState, trip: Trip, body: bytes, deadline: float, outcome: Outcome, splicer: StreamFramer
    ) -> Retry | None:
        self.resumed.append((replica.id, orjson.loads(body)))
        return self.resumes.pop(0)(outcome)


def answered(replica: ReplicaState, trip: Trip) -> Outcome:
    """A whole JSON answer, with usage."""
    trip.exchange.answer(200, b'{"choices": []}', JSON)
    return Outcome(trip.exchange, Served(200, ttft_s=0.01, prompt_tokens=40, cached_tokens=30, completion_tokens=5))


def chunk(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def broken(replica: ReplicaState, trip: Trip) -> Outcome:
    """A chat stream cut after two tokens, left open for the journey to resume."""
    opening = {"id": "c-1", "created": 1, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    tokens = [{"id": "c-1", "created": 1, "choices": [{"index": 0, "delta": {"content": t}}]} for t in ("Hel", "lo")]
    record = StreamRecord(trip.intake.keep)
    for event in (opening, *tokens):
        record.add(chunk(event))
    exchange = trip.exchange
    exchange.status, exchange.prepared, exchange.body = 200, True, bytes(record.buf)
    outcome = Outcome(exchange, Served(200, ttft_s=0.01, streamed=True))
    outcome.record, outcome.framer = record, SseFramer(False)
    outcome.stream_error, outcome.broken = "upstream connection lost mid-stream", True
    return outcome


def build(
    replicas: int = 3, policy: str = "affinity", **settings: Any
) -> tuple[Routing, Admission, RouterMetrics, Any, Fleet]:
    urls = [f"r{i}=http://127.0.0.1:{9000 + i}" for i in range(replicas)]
    config = load(None, {}, {"replicas": urls, "policy": policy, "state": "none", **settings})
    fleet = Fleet(config.replicas, config.vnodes, config.hash_seed)
    metrics = RouterMetrics()
    sessions = SessionTable(1000, config.sticky_ttl_s)
    routing = Routing(
        fleet, make_policy(policy, fleet, config), SessionDirectory(sessions, config.sticky_ttl_s), metrics, 3
    )
    admission = Admission(fleet, config.max_queued, config.queue_timeout_s, config.full_waiting, config.full_kv_usage)
    return routing, admission, metrics, config, fleet


def journey_of(
    routing: Routing,
    admission: Admission,
    metrics: RouterMetrics,
    script: Script,
    pause: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> Journey:
    ledger = Ledger(metrics, routing.policy.name, routing.fleet.model_label, log_requests=False)
    return Journey(routing, admission, script, ledger, metrics, total_timeout_s=30.0, max_key_bytes=256, pause=pause)


def request(config: Any, body: dict[str, Any], session: str = "s-1", path: str = "/v1/chat/completions") -> Intake:
    headers = CIMultiDictProxy(CIMultiDict({"X-Session-ID": session}))
    intake = take_in_body(path, headers, orjson.dumps(body), config.proxying, Keys.of(config))
    assert isinstance(intake, Intake)
    return intake


def count(metric: Any, **labels: str) -> float:
    return sum(
        s.value
        for family in metric.collect()
        for s in family.samples
        if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items())
    )


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


async def test_a_failure_before_the_first_byte_goes_to_the_next_replica_and_ends_in_the_ledger() -> None:
    routing, admission, metrics, config, fleet = build()
    script = Script(lambda r, t: Retry("connect", 502), answered)
    journey = journey_of(routing, admission, metrics, script)
    exchange = Exchange()
    await journey.serve(exchange, request(config, CHAT), time.monotonic())
    assert exchange.status == 200 and len(script.sent) == 2 and script.sent[0] != script.sent[1]
    assert all(r.inflight == 0 for r in fleet.replicas)  # each attempt released, the failed one too
    assert count(metrics.retries, cause="connect") == 1 and metrics.failovers._value.get() == 1
    assert count(metrics.requests, replica=script.sent[1], status="200", key_kind="header") == 1
    first = fleet.find(script.sent[0])
    assert first is not None and first.errors == 1
    # the session lives where it was served: its next turn goes there first
    script.steps.append(answered)
    await journey.serve(Exchange(), request(config, CHAT), time.monotonic())
    assert script.sent[2] == script.sent[1]


async def test_no_replica_left_is_an_openai_shaped_answer_and_a_finish() -> None:
    routing, admission, metrics, config, fleet = build(replicas=2)
    script = Script(lambda r, t: Retry("timeout", 504), lambda r, t: Retry("timeout", 504))
    exchange = Exchange()
    await journey_of(routing, admission, metrics, script).serve(exchange, request(config, CHAT), time.monotonic())
    error = orjson.loads(exchange.body)["error"]
    assert exchange.status == 504 and error["code"] == "upstream_error" and "timed out" in error["message"]
    assert count(metrics.requests, replica="none", status="504") == 1
    # a model no replica serves is answered at once, never sent
    fleet.replicas[0].models = fleet.replicas[1].models = frozenset({"m"})
    missing = Exchange()
    await journey_of(routing, admission, metrics, Script()).serve(
        missing, request(config, CHAT | {"model": "x"}), time.monotonic()
    )
    assert missing.status == 404 and orjson.loads(missing.body)["error"]["code"] == "model_not_found"


def refused(cause: str, status: int = 502) -> Step:
    return lambda r, t: Retry(cause, status)


class Pauses:
    """The journey's waits, recorded (and not waited)."""

    def __init__(self) -> None:
        self.waited: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waited.append(seconds)


@pytest.mark.parametrize("cause", ["connect", "reset"])
async def test_the_only_replica_failing_as_a_passing_fault_does_is_tried_once_more_after_a_pause(cause: str) -> None:
    """A fleet of one: a connection it refused or closed unanswered is tried again after
    AGAIN_PAUSE_S (it was a 502 at once), and served; failing again, the 502 comes after two
    attempts, never a third however many `max_attempts` allows."""
    routing, admission, metrics, config, fleet = build(replicas=1)
    pauses = Pauses()
    script = Script(refused(cause), answered)
    exchange = Exchange()
    journey = journey_of(routing, admission, metrics, script, pauses)
    await journey.serve(exchange, request(config, CHAT), time.monotonic())
    assert exchange.status == 200 and script.sent == ["r0", "r0"] and pauses.waited == [AGAIN_PAUSE_S]
    assert count(metrics.retries, cause=cause) == 1 and fleet.replicas[0].inflight == 0
    assert count(metrics.requests, replica="r0", status="200") == 1
    script = Script(refused(cause), refused(cause), answered)
    failed = Exchange()
    await journey_of(routing, admission, metrics, script, pauses).serve(failed, request(config, CHAT), time.monotonic())
    assert failed.status == 502 and script.sent == ["r0", "r0"] and fleet.replicas[0].inflight == 0
    assert count(metrics.requests, replica="none", status="502") == 1


@pytest.mark.parametrize(("cause", "status"), [("timeout", 504), ("http_5xx", 503)])
async def test_a_replica_that_timed_out_or_answered_a_5xx_is_not_tried_again(cause: str, status: int) -> None:
    routing, admission, metrics, config, _ = build(replicas=1)
    pauses = Pauses()
    script = Script(refused(cause, status), answered)
    exchange = Exchange()
    journey = journey_of(routing, admission, metrics, script, pauses)
    await journey.serve(exchange, request(config, CHAT), time.monotonic())
    assert exchange.status == status and script.sent == ["r0"] and pauses.waited == []


async def test_only_the_last_replica_is_tried_again_and_only_where_none_is_left() -> None:
    """Three replicas: the first two failing to connect go to the next, never back; with two, the
    last one tried is tried once more, within `max_attempts` (3); one drained meanwhile is not."""
    routing, admission, metrics, config, fleet = build(replicas=3)
    pauses = Pauses()
    script = Script(refused("connect"), refused("connect"), answered)
    exchange = Exchange()
    journey = journey_of(routing, admission, metrics, script, pauses)
    await journey.serve(exchange, request(config, CHAT), time.monotonic())
    assert exchange.status == 200 and len(set(script.sent)) == 3 and pauses.waited == []
    routing, admission, metrics, config, fleet = build(replicas=2)
    script = Script(refused("reset"), refused("connect"), answered)
    exchange = Exchange()
    await journey_of(routing, admission, metrics, script, pauses).serve(
        exchange, request(config, CHAT, session="s-2"), time.monotonic()
    )
    assert exchange.status == 200 and len(script.sent) == 3 and script.sent[2] == script.sent[1] != script.sent[0]
    assert pauses.waited == [AGAIN_PAUSE_S]

    async def drained_meanwhile(seconds: float) -> None:
        fleet.drain(script.sent[-1])

    script = Script(refused("connect"), refused("connect"), answered)
    exchange = Exchange()
    await journey_of(routing, admission, metrics, script, drained_meanwhile).serve(
        exchange, request(config, CHAT, session="s-3"), time.monotonic()
    )
    assert exchange.status == 502 and len(script.sent) == 2 and all(r.inflight == 0 for r in fleet.replicas)


async def test_a_client_gone_while_the_journey_waits_to_try_again_is_a_499() -> None:
    routing, admission, metrics, config, fleet = build(replicas=1)

    async def gone(seconds: float) -> None:
        raise asyncio.CancelledError

    exchange = Exchange()
    with pytest.raises(asyncio.CancelledError):
        await journey_of(routing, admission, metrics, Script(refused("connect")), gone).serve(
            exchange, request(config, CHAT), time.monotonic()
        )
    assert count(metrics.requests, replica="none", status="499") == 1 and fleet.replicas[0].inflight == 0


async def test_a_spare_routing_core_serves_whole_when_the_route_offers_no_replica() -> None:
    """Every replica of the route's out of routing (drained): the spare's replicas (a disaggregated
    fleet's prefill pool) serve the request, counted as any; without a spare, the 503 it was."""
    routing, admission, metrics, config, fleet = build(replicas=2)
    for r in fleet.replicas:
        fleet.drain(r.id)
    spare_fleet = Fleet((parse_replica("p0=http://127.0.0.1:9300"),))
    sessions = SessionTable(16, config.sticky_ttl_s)
    spare = Routing(
        spare_fleet,
        make_policy("affinity", spare_fleet, config),
        SessionDirectory(sessions, config.sticky_ttl_s),
        metrics,
        3,
    )
    script = Script(answered)
    ledger = Ledger(metrics, routing.policy.name, fleet.model_label, log_requests=False)
    journey = Journey(routing, admission, script, ledger, metrics, 30.0, 256, spare=spare)
    exchange = Exchange()
    await journey.serve(exchange, request(config, CHAT), time.monotonic())
    assert exchange.status == 200 and script.sent == ["p0"] and spare_fleet.replicas[0].inflight == 0
    assert count(metrics.requests, replica="p0", status="200") == 1
    alone = Exchange()
    await journey_of(routing, admission, metrics, Script()).serve(alone, request(config, CHAT), time.monotonic())
    assert alone.status == 503 and orjson.loads(alone.body)["error"]["code"] == "no_replica_available"


async def test_a_stream_broken_mid_way_is_resumed_on_another_replica_from_what_the_client_has() -> None:
    routing, admission, metrics, config, fleet = build()

    def continued(outcome: Outcome) -> None:
        outcome.stream_error, outcome.broken = None, False  # the continuation ran to its end
        return None

    script = Script(broken, resumes=(continued,))
    exchange = Exchange()
    intake = request(config, CHAT | {"stream": True})
    assert intake.keep > 0  # resumable
    await journey_of(routing, admission, metrics, script).serve(exchange, intake, time.monotonic())
    (broke_on,) = script.sent
    resumed_on, follow = script.resumed[0]
    assert resumed_on != broke_on  # by the route: never back to the replica it broke on
    assert follow["messages"][-1] == {"role": "assistant", "content": "Hello"}  # the reply so far, to go on from
    assert count(metrics.stream_resumes, outcome="resumed") == 1
    # the journey ends where the stream ended, and the session lives there now
    assert count(metrics.requests, replica=resumed_on, status="200") == 1
    assert all(r.inflight == 0 for r in fleet.replicas)
    script.steps.append(answered)
    await journey_of(routing, admission, metrics, script).serve(Exchange(), request(config, CHAT), time.monotonic())
    assert script.sent[-1] == resumed_on


async def test_a_stream_no_replica_can_continue_ends_with_an_error_event() -> None:
    routing, admission, metrics, config, _ = build(replicas=2)
    script = Script(broken, resumes=(lambda outcome: Retry("connect", 502),))
    exchange = Exchange()
    await journey_of(routing, admission, metrics, script).serve(
        exchange, request(config, CHAT | {"stream": True}), time.monotonic()
    )
    assert (
        exchange.ended and b'"code":"upstream_error"' in exchange.body and exchange.body.endswith(b"data: [DONE]\n\n")
    )
    assert count(metrics.stream_resumes, outcome="failed") == 1


async def test_every_replica_full_sheds_with_a_429_in_the_apis_shape() -> None:
    routing, admission, metrics, config, fleet = build(replicas=1, max_queued=1, queue_timeout_s=0.05, full_waiting=1)
    replica = fleet.replicas[0]  # its engine's queue past full_waiting: no room until it drains
    replica.engine = dataclasses.replace(replica.engine, waiting=5)
    script = Script()
    exchange = Exchange()
    await journey_of(routing, admission, metrics, script).serve(exchange, request(config, CHAT), time.monotonic())
    error = orjson.loads(exchange.body)["error"]
    assert exchange.status == 429 and exchange.sent_headers["Retry-After"] and script.sent == []
    assert (error["type"], error["code"]) == ("rate_limit_error", "queue_timeout")  # held, then shed
    assert count(metrics.shed, reason="timeout") == 1 and count(metrics.requests, status="429") == 1
    assert admission.queued == 0
    messages = Exchange("/v1/messages")  # Anthropic's clients get Anthropic's shape
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    await journey_of(routing, admission, metrics, script).serve(
        messages, request(config, body, path="/v1/messages"), 0.0
    )
    assert orjson.loads(messages.body)["error"]["type"] == "rate_limit_error" and messages.status == 429


async def test_the_access_log_and_a_counter_say_the_class_a_request_got_after_its_tenants_cap(caplog: Any) -> None:
    routing, admission, metrics, config, _ = build()
    ledger = Ledger(metrics, routing.policy.name, routing.fleet.model_label, log_requests=True, tenants=True)
    journey = Journey(routing, admission, Script(answered, answered), ledger, metrics, 30.0, 256)
    caplog.set_level("INFO", logger="router.access")
    bulk = Client("team", "k", RANK["bulk"])  # a bulk tenant: asking for `system` does not lift it
    asked = CIMultiDictProxy(CIMultiDict({"X-Session-ID": "s", "X-Priority": "system"}))
    capped = take_in_body(
        "/v1/chat/completions", asked, orjson.dumps(CHAT), config.proxying, Keys.of(config), client=bulk
    )
    assert isinstance(capped, Intake)
    await journey.serve(Exchange(), capped, time.monotonic())
    await journey.serve(Exchange(), request(config, CHAT), time.monotonic())  # no keys, no header: default
    first, second = (orjson.loads(r.getMessage()) for r in caplog.records if r.name == "router.access")
    assert first["priority"] == "bulk" and first["tenant"] == "team" and second["priority"] == "default"
    assert count(metrics.class_requests, priority="bulk", status="200") == 1
    assert count(metrics.class_requests, priority="default", status="200") == 1
    assert count(metrics.class_requests, priority="system", status="200") == 0


async def test_the_access_log_names_a_sessions_jump_as_the_jumps_metric_counts_it(caplog: Any) -> None:
    routing, admission, metrics, config, _ = build()
    script = Script(answered)
    ledger = Ledger(metrics, routing.policy.name, routing.fleet.model_label, log_requests=True)
    journey = Journey(routing, admission, script, ledger, metrics, total_timeout_s=30.0, max_key_bytes=256)
    caplog.set_level("INFO", logger="router.access")
    await journey.serve(Exchange(), request(config, CHAT), time.monotonic())
    # the next turn's replica refuses it: served elsewhere, the session has jumped
    script.steps += [lambda r, t: Retry("connect", 502), answered]
    await journey.serve(Exchange(), request(config, CHAT), time.monotonic())
    first, second = (orjson.loads(r.getMessage()) for r in caplog.records if r.name == "router.access")
    assert first["jump"] is None and first["replica"] == script.sent[0] == script.sent[1]
    assert second["replica"] == script.sent[2] != script.sent[1] and second["attempts"] == 2
    assert second["jump"] == "failover" and count(metrics.jumps, reason="failover") == 1


def budgeted(limit: int, clock: list[float]) -> Budgets:
    return Budgets({"team": limit}, LocalStore(clock=lambda: clock[0]), reserve_tokens=1024)


def budget_world(limit: int) -> tuple[Budgets, Any, RouterMetrics, Callable[[Script], Journey]]:
    """A fleet whose one tenant, "team", has `limit` tokens a minute (the clock standing still):
    its budgets, config, metrics, and a journey for a script."""
    routing, admission, metrics, config, fleet = build()
    budgets = budgeted(limit, [0.0])
    ledger = Ledger(metrics, routing.policy.name, fleet.model_label, log_requests=False, tenants=True)

    def journey(script: Script) -> Journey:
        return Journey(routing, admission, script, ledger, metrics, 30.0, 256, clients=None, budgets=budgets)

    return budgets, config, metrics, journey


def level(budgets: Budgets) -> float:
    store = budgets.store
    assert isinstance(store, LocalStore)
    return store.buckets["team"][0]  # (the clock stands still: nothing refills)


async def test_a_tenants_budget_is_reserved_then_settled_on_what_the_request_used() -> None:
    budgets, config, metrics, journey = budget_world(6000)

    def keyed(body: dict[str, Any]) -> Intake:
        return dataclasses.replace(request(config, body), client=Client("team", "k"))

    body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    served = journey(Script(answered))
    await served.serve(Exchange(), keyed(body), time.monotonic())
    assert level(budgets) == 6000 - 45  # its usage: 40 prompt and 5 completion tokens
    # a request no replica answered gives all it reserved back
    failing = journey(Script(*(lambda r, t: Retry("connect", 502) for _ in range(3))))
    await failing.serve(Exchange(), keyed(body), time.monotonic())
    assert level(budgets) == 6000 - 45
    # one that asks more than is left gets a 429 with the wait for it, and reaches no replica
    greedy = journey(script := Script())
    exchange = Exchange()
    greedy_body = body | {"max_tokens": 5960}  # with its prompt, within the budget but not what is left
    assert 6000 - 45 < estimate(greedy_body, len(orjson.dumps(greedy_body)), 256) <= 6000
    await greedy.serve(exchange, keyed(greedy_body), time.monotonic())
    error = orjson.loads(exchange.body)["error"]
    assert exchange.status == 429 and error["code"] == "tokens_per_minute_exceeded" and script.sent == []
    assert int(exchange.sent_headers["Retry-After"]) >= 1 and "team" in error["message"]
    assert count(metrics.shed, reason="budget", priority="default") == 1


async def test_a_request_larger_than_its_tenants_whole_budget_is_refused_and_a_cut_stream_pays_what_passed() -> None:
    budgets, config, metrics, journey = budget_world(2000)

    body = {"model": "m", "max_tokens": 120_000, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    intake = dataclasses.replace(request(config, body), client=Client("team", "k"))
    # on a full bucket: it could never fit, so it is refused at once, with no wait that would help
    exchange = Exchange()
    await journey(script := Script()).serve(exchange, intake, time.monotonic())
    error = orjson.loads(exchange.body)["error"]
    assert exchange.status == 429 and error["code"] == "request_exceeds_budget" and script.sent == []
    assert "Retry-After" not in exchange.sent_headers and "2000" in error["message"]
    assert count(metrics.shed, reason="exceeds_budget", priority="default") == 1
    assert isinstance(budgets.store, LocalStore) and "team" not in budgets.store.buckets  # nothing taken

    # a stream that fits, cut after three events and before its usage: charged its prompt's
    # estimate and those three, not the 1,000 tokens it reserved for its answer
    def cut(replica: ReplicaState, trip: Trip) -> Outcome:
        trip.exchange.status, trip.exchange.prepared = 200, True
        outcome = Outcome(trip.exchange, Served(200, ttft_s=0.01, streamed=True, cut=True, events=3))
        outcome.stream_error = "upstream connection lost mid-stream"
        return outcome

    fits = dataclasses.replace(request(config, body | {"max_tokens": 1000}), client=Client("team", "k"))
    served = journey(Script(cut))
    await served.serve(Exchange(), fits, time.monotonic())
    assert level(budgets) == 2000 - (prompt_estimate(len(fits.raw)) + 3)

    # a client that leaves mid-stream (its task cancelled): charged what its framer had passed, five
    def gone(replica: ReplicaState, trip: Trip) -> Outcome:
        outcome = Outcome(trip.exchange, Served(200, ttft_s=0.01, streamed=True))
        outcome.framer = SseFramer(False)
        outcome.framer.feed(b'data: {"choices": []}\n\n' * 5)
        trip.streaming = outcome
        raise asyncio.CancelledError

    before = level(budgets)
    left = journey(Script(gone))
    with pytest.raises(asyncio.CancelledError):
        await left.serve(Exchange(), fits, time.monotonic())
    assert level(budgets) == before - (prompt_estimate(len(fits.raw)) + 5)


async def test_a_sheddable_request_no_replica_can_serve_in_time_is_refused_before_any_attempt() -> None:
    routing, admission, metrics, config, fleet = build(policy="ttft", prefill_tokens_per_s=1000)
    headers = CIMultiDictProxy(CIMultiDict({"X-Session-ID": "s", "X-Priority": "sheddable", "x-slo-ttft-ms": "50"}))
    body = {"model": "m", "messages": [{"role": "user", "content": "lorem ipsum " * 400}], "max_tokens": 4}
    intake = take_in_body("/v1/chat/completions", headers, orjson.dumps(body), config.proxying, Keys.of(config, True))
    assert isinstance(intake, Intake) and intake.target_s == 0.05 and intake.rank == RANK["sheddable"]
    script = Script()
    exchange = Exchange()
    await journey_of(routing, admission, metrics, script).serve(exchange, intake, time.monotonic())
    assert exchange.status == 429 and orjson.loads(exchange.body)["error"]["code"] == "ttft_target_unmet"
    assert script.sent == [] and all(r.inflight == 0 for r in fleet.replicas)
    # the same request of the default class is served, late
    headers = CIMultiDictProxy(CIMultiDict({"X-Session-ID": "s", "x-slo-ttft-ms": "50"}))
    intake = take_in_body("/v1/chat/completions", headers, orjson.dumps(body), config.proxying, Keys.of(config, True))
    assert isinstance(intake, Intake)
    script = Script(answered)
    await journey_of(routing, admission, metrics, script).serve(Exchange(), intake, time.monotonic())
    assert len(script.sent) == 1


class KeptReplies:
    """The engines' tokens, recording what the journey hands them."""

    def __init__(self) -> None:
        self.replies: list[str] = []

    def tokenized(self, key: Any, api: Any, body: dict[str, Any]) -> Any:
        return key

    def replied(self, key: Any, api: Any, body: dict[str, Any], reply: Callable[[], str | None]) -> None:
        assert key.prompt is not None and body["messages"]
        text = reply()
        assert text is not None
        self.replies.append(text)


def whole_stream(replica: ReplicaState, trip: Trip) -> Outcome:
    """A chat stream that ran to its end, as the client got it."""
    events = [{"id": "c-1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    events += [{"id": "c-1", "choices": [{"index": 0, "delta": {"content": t}}]} for t in ("Hel", "lo")]
    events.append({"id": "c-1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    record = StreamRecord(trip.intake.keep)
    for event in events:
        record.add(chunk(event))
    record.add(b"data: [DONE]\n\n")
    exchange = trip.exchange
    exchange.status, exchange.prepared, exchange.body = 200, True, bytes(record.buf)
    outcome = Outcome(exchange, Served(200, ttft_s=0.01, streamed=True))
    outcome.record, outcome.framer = record, SseFramer(False)
    return outcome


async def test_a_chat_answer_that_ended_well_in_text_is_kept_for_its_next_turn_and_no_other() -> None:
    routing, admission, metrics, config, _fleet = build(policy="ttft")
    kept = KeptReplies()
    ledger = Ledger(metrics, routing.policy.name, routing.fleet.model_label, log_requests=False)

    def whole(replica: ReplicaState, trip: Trip) -> Outcome:
        outcome = answered(replica, trip)
        outcome.reply = "Hi there"  # (the relay reads it from the answer's JSON)
        return outcome

    def called_tools(replica: ReplicaState, trip: Trip) -> Outcome:
        outcome = whole_stream(replica, trip)
        outcome.facts.tools = True
        return outcome

    def resumed(outcome: Outcome) -> None:
        outcome.stream_error, outcome.broken = None, False
        return None

    script = Script(whole_stream, whole, called_tools, broken, resumes=(resumed,))
    journey = Journey(routing, admission, script, ledger, metrics, 30.0, 256, kept)
    headers = CIMultiDictProxy(CIMultiDict({"X-Session-ID": "s-1"}))
    chat = CHAT | {"messages": [{"role": "user", "content": "tell me about the fox " * 20}]}
    for body in (chat | {"stream": True}, chat, chat | {"stream": True}, chat | {"stream": True}):
        intake = take_in_body(
            "/v1/chat/completions", headers, orjson.dumps(body), config.proxying, Keys.of(config, True)
        )  # its prompt read
        assert isinstance(intake, Intake) and intake.key.prompt is not None
        await journey.serve(Exchange(), intake, time.monotonic())
    # the stream's text read from its record, the whole answer's; not an answer that called tools,
    # nor a stream that broke (what its client got was spliced from two replicas)
    assert kept.replies == ["Hello", "Hi there"]
    assert len(script.sent) == 4 and not script.steps
