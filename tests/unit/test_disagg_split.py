"""The split attempt without sockets (router.proxy.disagg): its prefill leg routed through the prefill pool
(router.pools), with a scripted upstream for the prefill replicas and a scripted decode side."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from router.config import load, parse_replica
from router.engines.handoff import VLLM
from router.fleet import Fleet, ReplicaState
from router.health.states import Hysteresis
from router.metrics import RouterMetrics
from router.policy import Decision
from router.policy.ttft import Ttft
from router.pools import Pairs, Pool, lending_pool, prefill_pool, replica_fleet
from router.proxy import disagg
from router.proxy.disagg import DisaggAttempts
from router.proxy.forward import Outcome, Retry, Timeouts, Trip
from router.proxy.intake import Intake, take_in_body
from router.routing import Routing, Served, SessionDirectory
from router.routing.request import Keys
from router.sessions import SessionTable

PARAMS = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e"}
LONG = "a document to read. " * 400  # some 2,000 tokens: worth splitting at min_tokens 512


class Answer:
    """A prefill replica's whole answer, as router.engines.upstream hands it."""

    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.body = orjson.dumps(body)

    async def read(self) -> bytes:
        return self.body

    def at_eof(self) -> bool:
        return True

    def release(self) -> None: ...

    def close(self) -> None: ...


class Upstream:
    """The prefill replicas: what the next one asked answers, in turn; every request sent, by URL."""

    def __init__(self, answers: list[Answer | Exception]) -> None:
        self.answers = answers
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def post(self, url: str, raw: bytes, headers: dict[str, str], connect_s: float) -> Answer:
        self.sent.append((url, orjson.loads(raw)))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


class Decode:
    """The decode side (router.proxy.attempts.HttpAttempts' part the split attempt uses)."""

    def __init__(self, upstream: Upstream, settled: list[Retry | None] | None = None) -> None:
        self.upstream = upstream
        self.settled = settled or []
        self.bodies: list[tuple[str, str, dict[str, Any]]] = []  # (how, replica, body)

    def client(self) -> Upstream:
        return self.upstream

    @staticmethod
    def keyed(replica: ReplicaState, trip: Trip) -> Trip:
        return trip

    def _answer(self, how: str, replica: ReplicaState, trip: Trip) -> Outcome:
        self.bodies.append((how, replica.id, orjson.loads(trip.intake.raw)))
        return Outcome(trip.exchange, Served(200, ttft_s=0.05, prompt_tokens=2000, completion_tokens=4))

    async def send(self, replica: ReplicaState, trip: Trip, deadline: float) -> Retry | Outcome:
        return self._answer("send", replica, trip)

    async def send_settled(self, replica: ReplicaState, trip: Trip, deadline: float) -> Retry | Outcome:
        failed = self.settled.pop(0) if self.settled else None
        if failed is not None:
            self.bodies.append(("settled", replica.id, orjson.loads(trip.intake.raw)))
            return failed
        return self._answer("settled", replica, trip)


class Exchange:
    method, path, remote, transport = "POST", "/v1/chat/completions", "10.0.0.1", None
    headers = CIMultiDictProxy(CIMultiDict({}))


def world(
    answers: list[Answer | Exception], settled: list[Retry | None] | None = None, met: tuple[str, ...] | None = None
) -> tuple[DisaggAttempts, Pool, Upstream, Decode, Any, list[str]]:
    """Two prefill replicas (p0, p1) in their pool, answering in turn as `answers` says; one
    decode replica, whose split attempts fail as `settled` says; `met`: the prefill replicas it
    has met (router.pools.Pairs; None: no introductions, every pair is split across)."""
    config = load(
        None,
        {},
        {
            "decode": ["d0=http://127.0.0.1:9100"],
            "prefill": ["p0=http://127.0.0.1:9200", "p1=http://127.0.0.1:9201"],
            "state": "none",
            "kv_events": False,
        },
    )
    pool = prefill_pool(config, Hysteresis(), RouterMetrics(), lambda: None, True)  # type: ignore[arg-type, return-value]
    assert pool is not None
    upstream = Upstream(answers)
    decode = Decode(upstream, settled)
    modes: list[str] = []  # how each request was served, then why each abandoned prefill was
    attempts = DisaggAttempts(
        decode,  # type: ignore[arg-type]
        pool,
        VLLM,
        512,
        Timeouts(1.0, 5.0, 5.0),
        modes.append,
        lambda why: modes.append(f"abandoned: {why}"),
        None if met is None else Pairs(pool.fleet, Fleet((DECODE_SPEC,)), VLLM, lambda: None),  # type: ignore[arg-type, return-value]
    )
    for p in met or ():
        assert attempts.pairs is not None
        attempts.pairs.record(p, "d0", 1.0)
    return attempts, pool, upstream, decode, config, modes


def trip(config: Any, text: str = LONG) -> Trip:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    raw = orjson.dumps(body)
    intake = take_in_body(
        "/v1/chat/completions", CIMultiDictProxy(CIMultiDict({})), raw, config.proxying, Keys.of(config, True)
    )
    assert isinstance(intake, Intake)
    return Trip(Exchange(), intake, {}, time.monotonic())  # type: ignore[arg-type]


DECODE_SPEC = parse_replica("d0=http://127.0.0.1:9100")
DECODE = Fleet((DECODE_SPEC,)).replicas[0]


def prefilled(cached: int = 0) -> Answer:
    usage = {"prompt_tokens": 2000, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": cached}}
    return Answer(200, {"choices": [], "usage": usage, "kv_transfer_params": PARAMS})


def asked(pool: Pool, upstream: Upstream) -> list[ReplicaState]:
    """The prefill replicas asked, in order."""
    return [next(r for r in pool.fleet.replicas if url.startswith(r.url + "/")) for url, _ in upstream.sent]


async def test_a_long_prompt_s_prefill_leg_is_routed_through_the_prefill_pool_and_its_decode_reads_the_params() -> None:
    attempts, pool, upstream, decode, config, modes = world([prefilled(), prefilled()])
    result = await attempts.send(DECODE, trip(config), time.monotonic() + 30)
    assert isinstance(result, Outcome) and modes == ["split"]
    ((_, sent),) = upstream.sent
    assert sent["max_tokens"] == 1 and sent["stream"] is False and sent["kv_transfer_params"]["do_remote_decode"]
    how, replica, body = decode.bodies[0]
    assert (how, replica) == ("settled", "d0") and body["kv_transfer_params"] == PARAMS
    # the leg went through the pool's routing core: counted and released there, and heard by its policy
    (prefiller,) = asked(pool, upstream)
    assert result.split is not None and result.split.replica == prefiller.id and result.split.prefill_s >= 0
    assert prefiller.requests == 1 and all(r.inflight == 0 for r in pool.fleet.replicas)
    assert prefiller.prompt_tokens == 2000 and prefiller.errors == 0
    assert pool.placement is not None and pool.placement.blocks_held(prefiller.id) > 0
    # the same document's next request is prefilled where its blocks are
    again = await attempts.send(DECODE, trip(config, LONG + " and a second question?"), time.monotonic() + 30)
    assert isinstance(again, Outcome) and again.split is not None and again.split.replica == prefiller.id


async def test_a_failed_prefill_replica_is_passed_over_and_with_none_left_the_decode_replica_computes() -> None:
    attempts, pool, upstream, decode, config, modes = world(
        [Answer(500, {"error": "x"}), prefilled(), ConnectionResetError(), Answer(200, {"choices": []})]
    )
    result = await attempts.send(DECODE, trip(config), time.monotonic() + 30)
    assert isinstance(result, Outcome) and result.split is not None and modes == ["split"]
    first, second = asked(pool, upstream)
    assert first is not second and first.errors == 1 and result.split.replica == second.id
    # neither answers with params (one resets, one kept nothing): the decode replica is sent the
    # client's body as it came, and recomputes the prompt
    result = await attempts.send(DECODE, trip(config), time.monotonic() + 30)
    assert isinstance(result, Outcome) and result.split is None and modes == ["split", "fallback"]
    how, _, body = decode.bodies[-1]
    assert how == "send" and "kv_transfer_params" not in body
    assert len(upstream.sent) == 4 and {r.id for r in asked(pool, upstream)[2:]} == {"p0", "p1"}
    assert all(r.inflight == 0 for r in pool.fleet.replicas) and sum(r.errors for r in pool.fleet.replicas) == 3


async def test_a_short_prompt_is_served_whole_and_a_transfer_that_fails_is_recomputed() -> None:
    attempts, _, upstream, decode, config, modes = world([prefilled()], [Retry("http_5xx", 500)])
    result = await attempts.send(DECODE, trip(config, "hi"), time.monotonic() + 30)
    assert isinstance(result, Outcome) and modes == ["alone"] and not upstream.sent
    # the decode replica fails the transfer (5xx before its first byte): sent again without params
    result = await attempts.send(DECODE, trip(config), time.monotonic() + 30)
    assert isinstance(result, Outcome) and modes == ["alone", "split", "recomputed", "abandoned: transfer_failed"]
    assert [how for how, _, _ in decode.bodies] == ["send", "settled", "send"]
    assert "kv_transfer_params" in decode.bodies[1][2] and "kv_transfer_params" not in decode.bodies[2][2]


async def test_a_prefill_no_decode_replica_read_is_counted_abandoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode replica that fails before its first byte (unreachable) leaves the params for the
    request's next decode replica; past the lease they are prefilled again, and a request that
    never came back for them leaves them abandoned once the lease is over."""
    attempts, _, upstream, decode, config, modes = world(
        [prefilled()] * 5, [Retry("connect"), None, Retry("connect"), None, Retry("connect"), Retry("connect")]
    )
    one = trip(config)
    failed = await attempts.send(DECODE, one, time.monotonic() + 30)
    assert isinstance(failed, Retry) and modes == ["split"] and len(upstream.sent) == 1
    # its next decode replica, within the lease: the same params, no second prefill
    again = await attempts.send(DECODE, one, time.monotonic() + 30)
    assert isinstance(again, Outcome) and len(upstream.sent) == 1 and decode.bodies[-1][2]["kv_transfer_params"]
    monkeypatch.setattr(disagg, "LEASE_S", -1.0)  # every lease over as soon as it is granted
    other = trip(config)
    assert isinstance(await attempts.send(DECODE, other, time.monotonic() + 30), Retry)
    assert isinstance(await attempts.send(DECODE, other, time.monotonic() + 30), Outcome)
    assert modes[-3:] == ["split", "abandoned: lease_over", "split"] and len(upstream.sent) == 3
    # a request whose journey ended after its decode failed (no replica left) never comes back:
    # the next request to keep params finds its lease over
    assert isinstance(await attempts.send(DECODE, trip(config), time.monotonic() + 30), Retry)
    assert isinstance(await attempts.send(DECODE, trip(config), time.monotonic() + 30), Retry)
    assert modes[-3:] == ["split", "split", "abandoned: no_decode"]


async def test_a_decode_replica_that_has_met_no_prefill_replica_serves_alone_and_strangers_are_passed_over() -> None:
    attempts, pool, upstream, decode, config, modes = world([prefilled(), prefilled()], met=())
    result = await attempts.send(DECODE, trip(config), time.monotonic() + 30)
    assert isinstance(result, Outcome) and modes == ["cold"] and not upstream.sent
    assert decode.bodies[0][0] == "send" and "kv_transfer_params" not in decode.bodies[0][2]
    # it has met p1 alone: every prefill leg goes there, however the prefix index would choose
    assert attempts.pairs is not None
    attempts.pairs.record("p1", "d0", 1.0)
    for i in range(2):
        result = await attempts.send(DECODE, trip(config, f"{i} {LONG}"), time.monotonic() + 30)
        assert isinstance(result, Outcome) and result.split is not None and result.split.replica == "p1"
    assert [r.id for r in asked(pool, upstream)] == ["p1", "p1"]


async def test_a_pair_whose_transfer_fails_is_forgotten_and_kept_params_do_not_cross_to_a_stranger() -> None:
    attempts, pool, upstream, _, config, modes = world([prefilled()] * 3, [Retry("http_5xx", 500)], met=("p0",))
    result = await attempts.send(DECODE, trip(config), time.monotonic() + 30)
    assert isinstance(result, Outcome) and modes == ["split", "recomputed", "abandoned: transfer_failed"]
    assert attempts.pairs is not None and attempts.pairs.met == {}  # introduced again before the next split
    result = await attempts.send(DECODE, trip(config), time.monotonic() + 30)
    assert isinstance(result, Outcome) and modes[-1] == "cold"
    # d0 fails before its first byte: its params are kept for the request's next decode replica,
    # but d1 has met p1 alone, so the prompt is prefilled again there, not read from p0
    pairs = attempts.pairs
    pairs.record("p0", "d0", 1.0)
    pairs.record("p1", "d1", 1.0)
    attempts.inner.settled = [Retry("connect")]  # type: ignore[attr-defined]
    d1 = Fleet((parse_replica("d1=http://127.0.0.1:9101"),)).replicas[0]
    one = trip(config)
    assert isinstance(await attempts.send(DECODE, one, time.monotonic() + 30), Retry)
    result = await attempts.send(d1, one, time.monotonic() + 30)
    assert isinstance(result, Outcome) and result.split is not None and result.split.replica == "p1"
    assert modes[-3:] == ["split", "abandoned: strangers", "split"]
    assert [r.id for r in asked(pool, upstream)] == ["p0", "p0", "p1"]


def pairs_of(prefills: int, decodes: int) -> tuple[Pairs, list[tuple[str, str]]]:
    """Pairs over fleets of `prefills` and `decodes` replicas whose introductions are scripted: a
    pair meets when it is not in `failing`; every introduction is recorded in order."""
    prefill = Fleet(tuple(parse_replica(f"p{i}=http://127.0.0.1:{9200 + i}") for i in range(prefills)))
    decode = Fleet(tuple(parse_replica(f"d{i}=http://127.0.0.1:{9100 + i}") for i in range(decodes)))
    heard: list[str] = []
    pairs = Pairs(prefill, decode, VLLM, lambda: None, lambda outcome, s: heard.append(outcome))  # type: ignore[arg-type, return-value]
    tried: list[tuple[str, str]] = []
    failing: set[tuple[str, str]] = set()

    async def meet(p: ReplicaState, d: ReplicaState) -> bool:
        tried.append((p.id, d.id))
        return (p.id, d.id) not in failing

    pairs.meet = meet  # type: ignore[method-assign]
    pairs.failing = failing  # type: ignore[attr-defined]
    return pairs, tried


async def test_pairs_are_introduced_each_prefill_replica_to_each_decode_replica_once_and_again_after_a_failure() -> (
    None
):
    pairs, tried = pairs_of(2, 3)
    pairs.failing.add(("p1", "d2"))  # type: ignore[attr-defined]
    await pairs.introduce()
    assert sorted(tried) == [(f"p{i}", f"d{j}") for i in range(2) for j in range(3)]
    # one prefill replica's introductions in turn (its engine holds one's blocks until they are read)
    assert [d for p, d in tried if p == "p0"] == ["d0", "d1", "d2"]
    assert len(pairs.met) == 5 and pairs.tries == {("p1", "d2"): 1}
    d2 = pairs.decode.find("d2")
    assert d2 is not None and pairs.has_met(d2) and pairs.strangers(d2) == {1}
    pairs.failing.clear()  # type: ignore[attr-defined]
    tried.clear()
    await pairs.introduce()
    assert tried == [("p1", "d2")] and len(pairs.met) == 6 and not pairs.tries and not pairs.strangers(d2)
    # a drained replica keeps its pairs (its engine is the same one: it hands its sessions' KV over)
    p0 = pairs.prefill.find("p0")
    assert p0 is not None
    p0.health.state = "draining"
    tried.clear()
    await pairs.introduce()
    assert not tried and len(pairs.met) == 6
    p0.health.state = "healthy"
    # a replica its health removed has its pairs forgotten: an engine that comes back may be a new
    # one, which the others have not met
    d0 = pairs.decode.find("d0")
    assert d0 is not None and d0.index is not None
    d0.health.state = "removed"
    tried.clear()
    await pairs.introduce()
    assert not tried and not pairs.has_met(d0) and len(pairs.met) == 4
    d0.health.state = "healthy"
    await pairs.introduce()
    assert sorted(tried) == [("p0", "d0"), ("p1", "d0")] and len(pairs.met) == 6


def lending_world(
    answers: list[Answer | Exception], apart: tuple[tuple[str, str], ...] = ()
) -> tuple[DisaggAttempts, Fleet, Upstream, Decode, Any, list[str]]:
    """Three replicas (r0, r1, r2) that prefill for one another (prefill_anywhere), every pair met
    but those `apart` (prefill, decode); the prefill legs answered as `answers` says."""
    config = load(
        None,
        {},
        {
            "replicas": [f"r{i}=http://127.0.0.1:{9300 + i}" for i in range(3)],
            "policy": "ttft",
            "prefill_anywhere": True,
            "state": "none",
            "kv_events": False,
        },
    )
    fleet = replica_fleet(config, config.replicas, Hysteresis())
    policy = Ttft.from_config(fleet, config)
    metrics = RouterMetrics()
    directory = SessionDirectory(SessionTable(64, config.sticky_ttl_s), config.sticky_ttl_s)
    serve = Pool("serve", fleet, policy, Routing(fleet, policy, directory, metrics, 3))
    upstream = Upstream(answers)
    decode = Decode(upstream)
    modes: list[str] = []
    pairs = Pairs(fleet, fleet, VLLM, lambda: None)  # type: ignore[arg-type, return-value]
    for p in fleet.replicas:
        for d in fleet.replicas:
            if p is not d and (p.id, d.id) not in apart:
                pairs.record(p.id, d.id, 1.0)
    attempts = DisaggAttempts(
        decode,  # type: ignore[arg-type]
        lending_pool(serve, config, metrics),
        VLLM,
        512,
        Timeouts(1.0, 5.0, 5.0),
        modes.append,
        lambda why: modes.append(f"abandoned: {why}"),
        pairs,
        lends=True,
    )
    return attempts, fleet, upstream, decode, config, modes


@pytest.mark.parametrize("why", ["draining", "passed over"])
async def test_a_moved_session_s_turn_is_prefilled_by_the_replica_it_left_and_its_kv_travels(why: str) -> None:
    attempts, fleet, upstream, decode, config, modes = lending_world([prefilled(cached=1900)])
    r0, r1, _ = fleet.replicas
    if why == "draining":
        fleet.drain("r0")  # an operator drains it: it serves what it holds, its engine is the same
    moved = Decision(1, "ring", left="r0")  # the route's pick left r0 for r1
    result = await attempts.send(r1, trip(config), time.monotonic() + 30, moved)
    assert isinstance(result, Outcome) and modes == ["moved"]
    assert result.split is not None and result.split.replica == "r0"
    ((url, sent),) = upstream.sent
    assert url.startswith(r0.url + "/") and sent["kv_transfer_params"]["do_remote_decode"]
    ((how, replica, body),) = decode.bodies
    assert (how, replica) == ("settled", "r1") and body["kv_transfer_params"] == PARAMS
    # the leg went through the routing core: counted there, and released
    assert r0.requests == 1 and r0.inflight == 0 and r0.prompt_tokens == 2000


async def test_a_move_from_a_replica_down_or_unmet_or_whose_prefill_fails_is_computed_where_it_goes() -> None:
    moved = Decision(1, "ring", left="r0")  # the route's pick left r0 for r1
    # its health removed it: its engine may be gone, nothing is asked of it
    attempts, fleet, upstream, decode, config, modes = lending_world([])
    r0, r1, _ = fleet.replicas
    r0.health.state = "removed"
    fleet.apply_health(r0, time.monotonic())
    result = await attempts.send(r1, trip(config), time.monotonic() + 30, moved)
    assert (
        isinstance(result, Outcome)
        and "moved" not in modes
        and all(url.startswith(fleet.replicas[2].url) for url, _ in upstream.sent)
    )
    # the pair never met: no client request pays its handshake (r1 has met r2: it is not cold)
    attempts, fleet, upstream, decode, config, modes = lending_world([], apart=(("r0", "r1"),))
    result = await attempts.send(fleet.replicas[1], trip(config), time.monotonic() + 30, moved)
    assert isinstance(result, Outcome) and modes == ["alone"] and not upstream.sent
    # its prefill fails: the new replica computes the prompt, and no other replica is asked
    attempts, fleet, upstream, decode, config, modes = lending_world([Answer(503, {"error": "busy"})])
    result = await attempts.send(fleet.replicas[1], trip(config), time.monotonic() + 30, moved)
    assert isinstance(result, Outcome) and modes == ["fallback"] and len(upstream.sent) == 1
    assert [how for how, _, _ in decode.bodies] == ["send"] and result.split is None
