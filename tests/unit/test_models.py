"""Several models on one fleet: which replicas may take a request naming a model, under every policy."""

from __future__ import annotations

import pytest

from router.config import ReplicaSpec, RouterConfig, load, pinned_models
from router.fleet import MODEL_MEMO, UNLISTED_LABELS, Fleet
from router.health.signals import lora_state
from router.keys import RoutingKey
from router.metrics import RouterMetrics
from router.monitor import listed_adapters, listed_models
from router.policy import make_policy
from router.prompt import prompt_of
from router.routing import Routing, SessionDirectory
from router.sessions import SessionTable

POLICIES = ("ttft", "affinity", "consistent_hash", "round_robin", "least_load")


def fleet_of(models: list[frozenset[str] | None], pins: dict[str, frozenset[str]] | None = None) -> Fleet:
    fleet = Fleet([ReplicaSpec(f"r{i}", f"http://10.0.0.{i}:8000") for i in range(len(models))], models=pins)
    for replica, listed in zip(fleet.replicas, models, strict=True):
        fleet.set_models(replica, listed)
    return fleet


def key(name: str, model: str | None, policy: str = "affinity") -> RoutingKey:
    body = {"model": model, "messages": [{"role": "user", "content": f"{name} " * 40}]}
    prompt = prompt_of(body, 64) if policy == "ttft" else None
    return RoutingKey(name.encode(), "header", "x-session-id", prompt=prompt, model=model)


A, B = frozenset({"model-a"}), frozenset({"model-b", "model-b-lora"})


def test_who_serves_what() -> None:
    fleet = fleet_of([A, A, B, None])
    assert fleet.not_serving("model-a") == {2}  # r3 lists nothing: it may serve anything
    assert fleet.not_serving("model-b-lora") == {0, 1}
    assert fleet.not_serving(None) == frozenset()
    assert fleet.not_serving("model-b") == {0, 1}
    assert not fleet.unserved("model-c")  # r3 might serve it
    fleet.set_models(fleet.replicas[3], B)
    assert fleet.unserved("model-c") and not fleet.unserved("model-b")
    assert fleet.not_serving("model-a") == {2, 3}  # the memo follows the change


def test_pinned_models_win_over_what_the_engine_lists() -> None:
    cfg = load(None, {}, {"replicas": ["http://a:1"], "replica_models": ["r0=model-a", "r0=model-x", "*=model-b"]})
    pins = pinned_models(cfg.fleet)
    assert pins == {"r0": {"model-a", "model-x"}, "*": {"model-b"}}
    fleet = fleet_of([B, A], pins)
    assert fleet.replicas[0].models == {"model-a", "model-x"}
    assert fleet.replicas[1].models == {"model-b"}  # "*": every replica not named
    assert not fleet.set_models(fleet.replicas[0], frozenset({"other"}))  # a pin stands
    fleet.add(ReplicaSpec("r9", "http://10.0.0.9:8000"))
    assert fleet.find("r9").models == {"model-b"}  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="replica_models"):
        load(None, {}, {"replicas": ["http://a:1"], "replica_models": ["model-a"]})


def test_the_memo_of_model_sets_is_bounded_and_follows_membership() -> None:
    fleet = fleet_of([A, B])
    for i in range(MODEL_MEMO + 10):
        fleet.not_serving(f"nobody-{i}")
    assert len(fleet._unserving) <= MODEL_MEMO
    assert fleet.not_serving("model-a") == {1}
    fleet.add(ReplicaSpec("r2", "http://10.0.0.2:8000"))
    fleet.set_models(fleet.replicas[2], A)
    assert fleet.not_serving("model-a") == {1}
    fleet.remove("r0")
    assert fleet.not_serving("model-a") == {0}  # r1 is at index 0 now


def test_the_model_label_is_a_served_name_or_one_of_a_bounded_few() -> None:
    listed = fleet_of([A, B])
    assert listed.model_label("model-a") == "model-a" and listed.model_label("model-b-lora") == "model-b-lora"
    assert listed.model_label(None) == "none"
    assert {listed.model_label(f"made-up-{i}") for i in range(100)} == {"other"}  # every replica says no
    listed.set_models(listed.replicas[1], frozenset({"model-c"}))
    assert listed.model_label("model-c") == "model-c" and listed.model_label("model-b") == "other"
    # a replica that does not say (an engine that answers any name): the first few names are kept
    open_fleet = fleet_of([A, None])
    labels = [open_fleet.model_label(f"name-{i}") for i in range(3 * UNLISTED_LABELS)]
    assert labels[:UNLISTED_LABELS] == [f"name-{i}" for i in range(UNLISTED_LABELS)]
    assert set(labels[UNLISTED_LABELS:]) == {"other"}
    assert open_fleet.model_label("name-0") == "name-0" and open_fleet.model_label("model-a") == "model-a"


def test_a_listing_reads_ids_and_adapters() -> None:
    data = {
        "object": "list",
        "data": [
            {"id": "base", "object": "model", "parent": None},
            {"id": "base-lora", "object": "model", "parent": "base"},
            {"id": ""},
            {"object": "model"},
            "junk",
        ],
    }
    assert listed_models(data) == {"base", "base-lora"}
    assert listed_adapters(data) == {"base-lora"}  # the event-fed index keys an adapter's blocks apart
    assert listed_adapters({"data": [{"id": "a", "parent": "a"}]}) == frozenset() and listed_adapters([]) == frozenset()
    assert listed_models({"data": []}) is None
    assert listed_models({"data": "x"}) is None
    assert listed_models([]) is None


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_sends_a_model_only_where_it_is_served(policy: str) -> None:
    fleet = fleet_of([A, B, A, B, None, A])
    chosen = make_policy(policy, fleet, RouterConfig(policy=policy))
    for model, allowed in (("model-a", {0, 2, 4, 5}), ("model-b", {1, 3, 4}), (None, set(range(6)))):
        seen = set()
        for i in range(200):
            decision = chosen.pick(key(f"s{i}", model, policy), None, set())
            assert decision is not None
            seen.add(decision.index)
        assert seen <= allowed, (model, seen)
        assert len(seen) > 1  # spread over the model's replicas, not pinned to one
        # a retry goes to another replica of the model, and none is left once all are tried
        tried = set()
        while (decision := chosen.pick(key("retry", model, policy), None, tried)) is not None:
            assert decision.index in allowed and decision.index not in tried
            tried.add(decision.index)
        assert tried == allowed


@pytest.mark.parametrize("policy", ("ttft", "affinity"))
def test_a_session_on_a_replica_of_another_model_does_not_stick_there(policy: str) -> None:
    fleet = fleet_of([A, B, B])
    chosen = make_policy(policy, fleet, RouterConfig(policy=policy))
    decision = chosen.pick(key("s", "model-b", policy), "r0", set())
    assert decision is not None and decision.index in (1, 2) and decision.reason != "sticky"
    decision = chosen.pick(key("s", "model-a", policy), "r0", set())
    assert decision is not None and (decision.index, decision.reason) == (0, "sticky")


@pytest.mark.parametrize("policy", ("affinity", "consistent_hash"))
def test_replicas_of_one_model_joining_never_move_another_models_sessions(policy: str) -> None:
    fleet = fleet_of([B, B, B, A])
    chosen = make_policy(policy, fleet, RouterConfig(policy=policy))
    keys = [key(f"s{i}", "model-b") for i in range(2000)]
    blind = [RoutingKey(k.key, k.kind, k.source) for k in keys]  # the same keys, naming no model
    before = [chosen.pick(k, None, set()).index for k in keys]  # type: ignore[union-attr]
    blind_before = [chosen.pick(k, None, set()).index for k in blind]  # type: ignore[union-attr]
    for n in (4, 5):
        fleet.add(ReplicaSpec(f"r{n}", f"http://10.0.0.{n}:8000"))
        fleet.set_models(fleet.replicas[n], A)
    after = [chosen.pick(k, None, set()).index for k in keys]  # type: ignore[union-attr]
    blind_after = [chosen.pick(k, None, set()).index for k in blind]  # type: ignore[union-attr]
    assert after == before
    assert sum(a != b for a, b in zip(blind_after, blind_before, strict=True)) > 200  # without models, they move


def test_a_models_load_cap_counts_its_own_replicas() -> None:
    fleet = fleet_of([A, A, B, B, B, B])
    cfg = RouterConfig(policy="affinity", bounded_load_floor=1)
    chosen = make_policy("affinity", fleet, cfg)
    for i in (2, 3, 4, 5):
        fleet.loads[i] = 50  # model B is busy; model A idle
    fleet.loads[0] = 3
    # A's cap is ceil(1.25 x 4 / 2) = 3: r0 is at it, so its keys spill to r1 (the fleet-wide cap,
    # ceil(1.25 x 204 / 6) = 43, would have kept them on r0)
    owned = [k for k in (key(f"s{i}", "model-a") for i in range(400)) if fleet.ring.successors(k.key, 1) == [0]]
    assert owned
    decisions = {chosen.pick(k, None, set()) for k in owned[:20]}  # type: ignore[misc]
    assert {(d.index, d.reason) for d in decisions if d is not None} == {(1, "spill")}


def test_a_models_load_cap_leaves_out_its_replicas_out_of_the_ring() -> None:
    """The cap among a model's replicas counts only those the ring routes to (`routing_weights`,
    read once for the fleet, says as `routing_weight` says for each): one drained, one ramping."""
    fleet = fleet_of([A, A, A, B, B])
    for i in range(5):
        fleet.loads[i] = 6
    skip = fleet.not_serving("model-a")
    assert fleet.load_cap_among(skip, 1.25) == 8  # ceil(1.25 x 19 / 3), at least 18 // 3 + 1
    fleet.drain("r2")
    fleet.set_routing(fleet.replicas[1], 0.5)
    assert fleet.routing_weights() == [fleet.routing_weight(i) for i in range(5)] == [1.0, 0.5, 0.0, 1.0, 1.0]
    assert fleet.load_cap_among(skip, 1.25) == 9  # r0 and r1 alone: ceil(1.25 x 13 / 2)
    fleet.drain("r0")
    fleet.drain("r1")
    assert fleet.load_cap_among(skip, 1.25) == 0  # none of model A's routes


LORA = frozenset({"model-b", "sql-lora", "chat-lora"})


def test_the_lora_state_is_the_newest_series_of_vllms_info_gauge() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:lora_requests_info gauge",
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7e+09',
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql-lora,chat-lora",'
            'waiting_lora_adapters="x-lora"} 1.9e+09',
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1.8e+09',
            "vllm:num_requests_running 3",
        ]
    )
    assert lora_state(text) == (frozenset({"sql-lora", "chat-lora", "x-lora"}), 2)
    assert lora_state("vllm:num_requests_running 3") == (None, None)  # adapters off: it says nothing
    assert lora_state('vllm:lora_requests_info{max_lora="2",running_lora_adapters="a} 1') == (None, None)
    idle = 'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 5'
    assert lora_state(idle) == (frozenset(), 4)


def test_adapters_run_lately_stay_loaded_up_to_max_lora() -> None:
    """vLLM keeps every state's series: the adapters run lately are still in its GPU slots, the
    most recent `max_lora` of them (it evicts the least recently used)."""

    def info(running: str, waiting: str, at: float, max_lora: int = 2) -> str:
        return (
            f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{running}",'
            f'waiting_lora_adapters="{waiting}"}} {at}'
        )

    lately = [info("a", "", 10), info("", "", 40), info("b", "", 30), info("c", "", 20)]
    assert lora_state("\n".join(lately)) == (frozenset({"b", "c"}), 2)  # idle now: b and c were run last
    assert lora_state("\n".join([*lately, info("d", "e", 50)])) == (frozenset({"d", "e"}), 2)
    assert lora_state("\n".join([*lately, info("d", "", 50)])) == (frozenset({"d", "b"}), 2)
    # waiting is not running: an adapter that only waited was never loaded by that state
    assert lora_state("\n".join([info("", "", 9), info("", "x", 8)])) == (frozenset(), 2)
    assert lora_state(info("", "", 9, 4) + "\n" + info("a", "", 8, 4)) == (frozenset({"a"}), 4)


def test_where_an_adapter_is_cold() -> None:
    fleet = fleet_of([LORA, LORA, LORA, A])
    assert fleet.adapter_cold("sql-lora") == frozenset()  # nobody says what it has loaded
    for replica, active in zip(fleet.replicas, (frozenset(), frozenset({"sql-lora"}), None, None), strict=True):
        fleet.set_adapters(replica, active, 2)
    assert fleet.adapter_cold("sql-lora") == {0}  # r2 says nothing, r3 serves another model
    assert fleet.adapter_cold("chat-lora") == frozenset()  # loaded nowhere: nowhere is better
    assert fleet.adapter_cold("model-b") == frozenset()  # the base model
    fleet.set_adapters(fleet.replicas[0], frozenset({"sql-lora"}), 2)
    assert fleet.adapter_cold("sql-lora") == frozenset()  # the memo follows the probes


@pytest.mark.parametrize("policy", ("affinity", "ttft"))
def test_new_sessions_of_an_adapter_prefer_a_replica_that_has_it_loaded(policy: str) -> None:
    fleet = fleet_of([LORA, LORA, LORA, LORA])
    cfg = RouterConfig(policy=policy, bounded_load_floor=2)
    chosen = make_policy(policy, fleet, cfg)
    before = {chosen.pick(key(f"s{i}", "sql-lora", policy), None, set()).index for i in range(40)}  # type: ignore[union-attr]
    assert len(before) > 1  # loaded nowhere: spread as any model's sessions
    for replica in fleet.replicas:
        fleet.set_adapters(replica, frozenset({"sql-lora"}) if replica.id == "r2" else frozenset(), 4)
    decisions = [chosen.pick(key(f"s{i}", "sql-lora", policy), None, set()) for i in range(40)]
    assert {d.index for d in decisions if d is not None} == {2}
    if policy == "affinity":
        assert {d.reason for d in decisions if d is not None} <= {"adapter", "ring"}
    # its session on a replica without it loaded sticks (its history is cached there)
    decision = chosen.pick(key("s0", "sql-lora", policy), "r0", set())
    assert decision is not None and (decision.index, decision.reason) == (0, "sticky")
    # a preference, not a pile-up: past its load cap the others take new sessions again
    fleet.loads[2] = 30
    spread = {chosen.pick(key(f"t{i}", "sql-lora", policy), None, set()).index for i in range(40)}  # type: ignore[union-attr]
    assert 2 not in spread and len(spread) > 1


def test_an_adapter_sent_to_a_replica_counts_as_loaded_there_at_once() -> None:
    """Between probes the router knows what it sent: a replica a request for an adapter went to
    loads it (the least recently used goes past max_lora), so the next request for it finds it."""
    fleet = fleet_of([LORA, LORA, LORA])
    r0, r1, r2 = fleet.replicas
    fleet.set_adapters(r0, frozenset({"sql-lora"}), 2)
    fleet.set_adapters(r1, frozenset(), 2)
    assert fleet.adapter_cold("chat-lora") == frozenset()  # loaded nowhere, and not known as an adapter
    fleet.sent_adapter(r1, "chat-lora")
    assert r1.adapters == {"chat-lora"} and fleet.adapter_cold("chat-lora") == {0}  # r2 says nothing
    fleet.sent_adapter(r0, "chat-lora")
    assert r0.adapters == {"sql-lora", "chat-lora"}
    fleet.sent_adapter(r0, "sql-lora")  # used again: now the most recent
    fleet.sent_adapter(r0, "x-lora")  # a third on two slots: chat-lora, the least recently used, goes
    assert r0.adapters == {"sql-lora", "x-lora"}
    fleet.sent_adapter(r2, "sql-lora")
    assert r2.adapters is None  # its engine says nothing of adapters: nothing to track
    fleet.set_adapters(r0, frozenset({"chat-lora"}), 2)  # the next probe says what is so
    assert r0.adapters == {"chat-lora"}


async def test_a_request_for_a_known_adapter_marks_it_loaded_where_it_went() -> None:
    fleet = fleet_of([LORA, LORA])
    r0, r1 = fleet.replicas
    fleet.set_adapters(r0, frozenset({"sql-lora"}), 4)
    fleet.set_adapters(r1, frozenset(), 4)
    policy = make_policy("round_robin", fleet, RouterConfig(policy="round_robin"))
    routing = Routing(fleet, policy, SessionDirectory(SessionTable(100, 60.0), 60.0), RouterMetrics(), 3)
    went: set[str] = set()
    for i in range(2):  # round robin: one each, blind to adapters
        route = await routing.route(RoutingKey(f"s{i}".encode(), "header", "x", model="sql-lora"), 0.0, 1e9)
        replica = route.next(0.0)
        assert replica is not None
        went.add(replica.id)
        route.release(replica)
    assert went == {"r0", "r1"} and r1.adapters == {"sql-lora"}  # it loads it there: known at once
    route = await routing.route(RoutingKey(b"s9", "header", "x", model="chat-lora"), 0.0, 1e9)
    replica = route.next(0.0)
    assert replica is not None and replica.adapters is not None
    assert "chat-lora" not in replica.adapters  # no engine has named chat-lora as an adapter: nothing to track
