"""The `ttft` policy and its placement model: cost arithmetic, the gate, ties, feedback from usage."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import pytest

from router.config import RouterConfig, parse_replica
from router.fleet import Fleet, ReplicaState
from router.health.signals import EngineStats
from router.keys import RoutingKey
from router.placement import Answer, Placed, Placement
from router.policy import make_policy
from router.policy.ttft import Ttft
from router.prompt import Prompt, prompt_of, render

BLOCK = 64


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(n: int = 4, **cfg: object) -> tuple[Fleet, Ttft, Clock]:
    specs = tuple(parse_replica(f"http://127.0.0.1:{9000 + i}") for i in range(n))
    config = RouterConfig(replicas=specs, **cfg)  # type: ignore[arg-type]
    fleet = Fleet(specs, config.vnodes, config.hash_seed)
    policy = make_policy("ttft", fleet, config)
    assert isinstance(policy, Ttft)
    clock = Clock()
    policy.placement.clock = clock
    return fleet, policy, clock


def chat(document: str, *turns: str, model: str = "m") -> dict[str, object]:
    messages: list[dict[str, str]] = [{"role": "system", "content": "You answer questions about documents."}]
    messages.append({"role": "user", "content": document + "\n" + turns[0]})
    for i, turn in enumerate(turns[1:]):
        messages.append({"role": "assistant", "content": f"answer {i} " * 20})
        messages.append({"role": "user", "content": turn})
    return {"model": model, "messages": messages}


def doc(i: int, tokens: int = 4000) -> str:
    words = f"doc{i} " * (tokens * 4 // 5)
    return words[: tokens * 4]


def keyless(body: dict[str, object]) -> RoutingKey:
    prompt = prompt_of(body, BLOCK)
    assert prompt is not None
    return RoutingKey(b"fp:" + str(body["messages"][1]["content"])[:32].encode(), "prefix", "messages", prompt)  # type: ignore[index]


def keyed(session: str, body: dict[str, object]) -> RoutingKey:
    return RoutingKey(session.encode(), "header", "x-session-id", prompt_of(body, BLOCK))


def serve(fleet: Fleet, policy: Ttft, key: RoutingKey, cached: int | None = None, ttft: float | None = None) -> int:
    """Pick, send, and answer at once (cached tokens as predicted unless given)."""
    d = policy.pick(key, None, ())
    assert d is not None and d.cost is not None and key.prompt is not None
    replica = fleet.replicas[d.index]
    placed = policy.placement.sent(replica, key.prompt, d.cost, policy.placement.clock())
    tokens = round(key.prompt.nbytes / policy.placement.bytes_per_token)
    got = round(d.cost.cached_tokens) if cached is None else cached
    policy.placement.answered(replica, key.prompt, placed, Answer(tokens, got, ttft))
    policy.placement.released(replica, policy.placement.clock())
    return d.index


def send_all(fleet: Fleet, policy: Ttft, index: int, keys: list[RoutingKey], now: float) -> list[Placed]:
    """Send every one of `keys` to the replica at `index` (priced there, counted in flight), unanswered."""
    replica, placed = fleet.replicas[index], []
    for key in keys:
        assert key.prompt is not None
        fleet.acquire(replica)
        row = policy.placement.candidates(key.prompt, [index], None, now)[0]
        placed.append(policy.placement.sent(replica, key.prompt, row, now))
    return placed


# -- the prompt -----------------------------------------------------------------------------------


def test_a_conversation_renders_to_a_growing_prefix_and_models_keep_apart() -> None:
    one = render(chat(doc(1), "first?"))[0]
    two = render(chat(doc(1), "first?", "second?"))[0]
    assert two.startswith(one)
    a, b = prompt_of(chat(doc(1), "first?"), BLOCK), prompt_of(chat(doc(1), "first?", "second?"), BLOCK)
    assert a is not None and b is not None
    assert list(b.chain[: len(a.chain)]) == list(a.chain)
    assert b.history_blocks >= len(a.chain)  # the earlier turn, its reply too, is history
    other = prompt_of(chat(doc(1), "first?", model="other"), BLOCK)
    assert other is not None and not set(other.chain) & set(a.chain)
    assert prompt_of({"messages": [{"role": "user", "content": "hi"}]}, BLOCK) is None  # no whole block
    assert prompt_of({"prompt": ["x" * 200]}, BLOCK) is not None
    assert render({"messages": "nonsense"}) == (b"", 0)


# -- cost arithmetic ------------------------------------------------------------------------------


def test_cost_is_the_queue_plus_the_uncached_prefill() -> None:
    fleet, policy, clock = setup(2, prefill_tokens_per_s=10_000, ttft_decode_s=0.002, ttft_interference=0)
    placement = policy.placement
    body = chat(doc(1, 2000), "q?")
    key = keyless(body)
    assert key.prompt is not None
    p = key.prompt
    total = p.nbytes / 4
    held = placement.of(fleet.replicas[0])
    placement.index.insert(held.holder, p.chain, 10)  # ten blocks of 16 tokens
    placement.set_busy(held, clock.now + 0.5)
    fleet.acquire(fleet.replicas[0])  # one request decoding there
    rows = {c.index: c for c in placement.candidates(p, [0, 1], None, clock.now)}
    assert rows[0].cached_tokens == pytest.approx(160)
    assert rows[0].wait_s == pytest.approx(0.5 + 0.002)
    assert rows[0].cost_s == pytest.approx(0.502 + (total - 160) / 10_000)
    assert rows[1].cached_tokens == 0 and rows[1].wait_s == 0
    assert rows[1].cost_s == pytest.approx(total / 10_000)
    # the engine's waiting queue beyond what the router sent counts as that many average requests
    placement.learnt.mean_uncached = 1000
    fleet.replicas[1].engine = EngineStats(waiting=3)
    clock.now += 0.1  # probed queues are re-read at most every 50 ms
    again = {c.index: c for c in placement.candidates(p, [0, 1], None, clock.now)}
    assert again[1].wait_s == pytest.approx(3 * 1000 / 10_000)
    # with interference, the prefill counts once more for each request running there
    placement.interference = 0.5
    loaded = {c.index: c for c in placement.candidates(p, [0, 1], None, clock.now)}
    assert loaded[0].cost_s == pytest.approx(loaded[0].wait_s + (total - 160) / 10_000 * (1 + 0.5 * 1))
    assert loaded[1].cost_s == pytest.approx(again[1].cost_s)  # nothing in flight there


def test_a_replica_whose_kv_cache_is_full_makes_a_request_wait_for_room() -> None:
    config = {"prefill_tokens_per_s": 10_000, "ttft_interference": 0, "ttft_spread_tokens": 0}
    fleet, policy, clock = setup(2, kv_capacity_tokens=("*=20000",), **config)
    placement = policy.placement
    long = [keyless(chat(doc(i, 5000), "q?")) for i in range(4)]
    one = keyless(chat(doc(9, 5000), "q?"))
    assert one.prompt is not None
    tokens = one.prompt.nbytes / placement.bytes_per_token
    placement.learnt.mean_output = 100
    full = fleet.replicas[0]
    placed = send_all(fleet, policy, 0, long, clock.now)
    held = placement.of(full)
    assert held.kv_tokens == pytest.approx(sum(p.tokens for p in placed))
    assert held.kv_tokens == pytest.approx(4 * (tokens + 100), rel=0.01)
    placement.set_busy(held, clock.now)  # prefilled: only the KV cache is in the way
    rows = {c.index: c for c in placement.candidates(one.prompt, [0, 1], None, clock.now)}
    assert rows[0].wait_s == pytest.approx(4 * 0.002)  # no reply timed yet: no wait for room, however full
    # replies take 2 s from first token to last: tokens past the capacity drain 20,000 per 2 s
    placement.answered(fleet.replicas[1], one.prompt, None, Answer(round(tokens), 0, None, 100, 2.0))
    assert placement.learnt.reply_s == 2.0
    over = held.kv_tokens + tokens + placement.learnt.mean_output - placement.kv.capacity(held)
    assert over > 0
    rows = {c.index: c for c in placement.candidates(one.prompt, [0, 1], None, clock.now)}
    assert rows[0].wait_s == pytest.approx(over / placement.kv.capacity(held) * 2.0 + 4 * 0.002)
    assert rows[1].wait_s == 0
    d = policy.pick(one, None, ())
    assert d is not None and d.index == 1  # there is room there
    # the setting off: no such wait
    placement.kv.wait = False
    assert placement.candidates(one.prompt, [0], None, clock.now)[0].wait_s == pytest.approx(4 * 0.002)
    placement.kv.wait = True
    # finished and failed attempts take their tokens away; nothing in flight, nothing held
    fleet.release(full)
    placement.released(full, clock.now, placed[0])
    assert placed[0].tokens == 0 and held.kv_tokens == pytest.approx(3 * (tokens + 100), rel=0.01)
    assert long[1].prompt is not None
    placement.failed(full, long[1].prompt, placed[1])
    assert held.kv_tokens == pytest.approx(2 * (tokens + 100), rel=0.01)
    assert placement.candidates(one.prompt, [0], None, clock.now)[0].wait_s == pytest.approx(3 * 0.002)
    for _ in range(3):
        fleet.release(full)
    placement.released(full, clock.now)  # the rest ended without their records: all gone with them
    assert held.kv_tokens == 0


def test_first_tokens_later_than_modelled_lengthen_the_queue_and_sooner_ones_shorten_it() -> None:
    fleet, policy, clock = setup(2, prefill_tokens_per_s=10_000, ttft_interference=0, ttft_spread_tokens=0)
    placement = policy.placement
    replica = fleet.replicas[0]
    keys = [keyless(chat(doc(i, 2000), "q?")) for i in range(4)]
    placed = send_all(fleet, policy, 0, keys, clock.now)
    held = placement.of(replica)
    assert placed[0].due == pytest.approx(clock.now + 2000 / 10_000 + placed[0].decode_s, rel=0.02)
    assert placed[-1].due == pytest.approx(held.busy_until + placed[-1].decode_s)

    def answer(i: int, first_at: float) -> None:
        fleet.release(replica)
        placement.released(replica, clock.now, placed[i])
        prompt = keys[i].prompt
        assert prompt is not None
        placement.answered(replica, prompt, placed[i], Answer(2000, 0, None, 50, 1.0, first_at))

    clock.now += 0.3
    busy = held.busy_until
    answer(0, placed[0].due + 1.0)  # a second later than modelled: the three behind it wait longer too
    assert held.busy_until == pytest.approx(busy + 0.5) and held.shift == pytest.approx(0.5)
    # as late again, against the queue as it was when it was sent: half of that lag is news already
    answer(1, placed[1].due + 1.0)
    assert held.busy_until == pytest.approx(busy + 0.75) and held.shift == pytest.approx(0.75)
    d = policy.pick(keys[0], None, ())
    assert d is not None and d.index == 1  # the longer queue costs more
    # sooner than modelled: the queue is shorter, never drained before now
    answer(2, placed[2].due - 10.0)
    assert held.busy_until == pytest.approx(clock.now)
    # with nothing left behind it, a late first token delays nobody
    clock.now += 5
    answer(3, placed[3].due + 3.0)
    assert held.busy_until <= clock.now and replica.inflight == 0
    # ttft_queue_gain = 0: the model's queue alone
    placement.learnt.queue_gain = 0
    prompt = keys[0].prompt
    assert prompt is not None
    fleet.acquire(replica)
    fleet.acquire(replica)
    one = placement.sent(replica, prompt, placement.candidates(prompt, [0], None, clock.now)[0], clock.now)
    busy = held.busy_until
    fleet.release(replica)
    placement.answered(replica, prompt, one, Answer(2000, 0, None, 50, 1.0, one.due + 5.0))
    assert held.busy_until == busy


def test_a_sent_request_queues_its_prefill_and_the_queue_drains_with_time() -> None:
    fleet, policy, clock = setup(1, prefill_tokens_per_s=1_000)
    key = keyless(chat(doc(1, 1000), "q?"))
    assert key.prompt is not None
    d = policy.pick(key, None, ())
    assert d is not None and d.cost is not None
    replica = fleet.replicas[0]
    placed = policy.placement.sent(replica, key.prompt, d.cost, clock.now)
    held = policy.placement.of(replica)
    assert held.busy_until == pytest.approx(clock.now + d.cost.uncached_tokens / 1000)
    assert placed.wait_tokens == 0
    second = policy.placement.sent(replica, key.prompt, d.cost, clock.now)
    assert second.wait_tokens == pytest.approx(d.cost.uncached_tokens)  # it waits for the first
    clock.now += 100
    assert policy.placement.candidates(key.prompt, [0], None, clock.now)[0].wait_s == 0


def test_prefill_speed_is_learnt_from_measured_ttft() -> None:
    fleet, policy, clock = setup(1, prefill_tokens_per_s=1_000, ttft_decode_s=0)
    placement = policy.placement
    key = keyless(chat(doc(1, 3000), "q?"))
    for _ in range(30):  # the replica is 4x faster than the prior: 4,000 tokens/s
        assert key.prompt is not None
        d = policy.pick(key, None, ())
        assert d is not None and d.cost is not None
        replica = fleet.replicas[0]
        placed = placement.sent(replica, key.prompt, d.cost, clock.now)
        tokens = round(key.prompt.nbytes / 4)
        placement.answered(replica, key.prompt, placed, Answer(tokens, 0, tokens / 4000))
        placement.index.clear(placement.of(replica).holder)
        clock.now += 100
    assert 1 / placement.of(fleet.replicas[0]).seconds_per_token == pytest.approx(4000, rel=0.05)


def speed_sampler(models: list[frozenset[str]] | None = None) -> tuple[Fleet, Placement, Callable[..., None]]:
    """Four replicas (serving `models`, if given) and a function that has replica i answer the same
    document alone, `computed` tokens (default: all of it) at `tokens_per_s`."""
    fleet, policy, clock = setup(4, prefill_tokens_per_s=1_000, ttft_decode_s=0)
    placement = policy.placement
    for replica, served in zip(fleet.replicas, models or (), strict=False):
        fleet.set_models(replica, served)
    prompt = keyless(chat(doc(1, 3000), "q?")).prompt
    assert prompt is not None
    tokens = round(prompt.nbytes / 4)

    def sample(index: int, tokens_per_s: float, computed: int = tokens) -> None:
        assert prompt is not None
        replica = fleet.replicas[index]
        placed = placement.sent(replica, prompt, placement.candidates(prompt, [index], None, clock.now)[0], clock.now)
        placement.answered(replica, prompt, placed, Answer(computed, 0, computed / tokens_per_s))
        placement.index.clear(placement.of(replica).holder)
        clock.now += 100

    return fleet, placement, sample


def test_a_few_odd_samples_do_not_make_one_of_a_uniform_fleet_look_slow() -> None:
    fleet, placement, sample = speed_sampler()

    for _ in range(16):
        for i in range(4):
            sample(i, 4000)
    speeds = [1 / placement.of(r).seconds_per_token for r in fleet.replicas]
    assert speeds == pytest.approx([4000] * 4, rel=0.01)
    sample(0, 1000)
    sample(0, 1000)  # two slow samples (a loaded host, a neighbour's chunk): the median shrugs them off
    sample(1, 40, computed=200)  # a short prompt's first token is a step's fixed cost: not a speed
    assert 1 / placement.of(fleet.replicas[0]).seconds_per_token == pytest.approx(4000, rel=0.01)
    assert 1 / placement.of(fleet.replicas[1]).seconds_per_token == pytest.approx(4000, rel=0.01)
    # a replica that is slower says so in every sample: it is learnt as such
    for _ in range(16):
        sample(3, 2000)
    assert 1 / placement.of(fleet.replicas[3]).seconds_per_token < 2700


# -- placement ------------------------------------------------------------------------------------


def test_new_conversations_on_a_held_document_go_where_it_is_held() -> None:
    fleet, policy, clock = setup(4)
    first = serve(fleet, policy, keyless(chat(doc(7), "who?")))
    clock.now += 10
    for q in ("what?", "when?", "where?"):
        assert serve(fleet, policy, keyless(chat(doc(7), q))) == first
        clock.now += 10


def test_a_keyed_session_sticks_and_moves_only_when_moving_is_cheaper() -> None:
    fleet, policy, clock = setup(2, prefill_tokens_per_s=10_000, bounded_load_floor=100)
    body = chat(doc(1, 2000), "a?", "b?")
    key = keyed("s1", body)
    d = policy.pick(key, fleet.replicas[1].id, ())
    assert d is not None and d.index == 1 and d.reason == "sticky"  # its history lives there
    held = policy.placement.of(fleet.replicas[1])
    policy.placement.set_busy(held, clock.now + 5.0)  # five seconds of prefill queued on it
    moved = policy.pick(key, fleet.replicas[1].id, ())
    assert moved is not None and moved.index == 0 and moved.reason == "cost"


def test_no_death_spiral_a_slow_replica_holding_every_prefix_still_spreads() -> None:
    fleet, policy, clock = setup(4, prefill_tokens_per_s=10_000)
    placement = policy.placement
    slow = placement.of(fleet.replicas[0])
    placement.rows.set_spt(slow, 1 / 500)  # twenty times slower than the others
    bodies = [chat(doc(i, 2000), "q?") for i in range(40)]
    for body in bodies:  # it holds every document
        prompt = prompt_of(body, BLOCK)
        assert prompt is not None
        placement.index.insert(slow.holder, prompt.chain)
    picks = Counter()
    held = []
    for body in bodies:  # forty new questions arrive together: none is answered yet
        key = keyless(body)
        d = policy.pick(key, None, ())
        assert d is not None and d.cost is not None and key.prompt is not None
        replica = fleet.replicas[d.index]
        fleet.acquire(replica)
        placement.sent(replica, key.prompt, d.cost, clock.now)
        held.append(replica)
        picks[d.index] += 1
    assert len(picks) == 4 and min(picks.values()) >= 5
    assert picks[0] <= len(bodies) // 2  # cache alone never drew them all onto it
    assert max(fleet.loads) <= placement.gate() + 1


@pytest.mark.parametrize("served", [40, 20])
def test_a_new_conversation_does_not_pile_onto_the_holder_of_its_shared_prompt(served: int) -> None:
    # a coding agent's shared tool prompt (its system message), held by replica 0, which has just
    # served 40 (or 20) requests (answered: nothing queued, nothing in flight) while the others
    # served none. With 20 the holder costs 1.7 times another replica: within the stay margin of a
    # home (2x), which had kept every new session there; it is not the new conversation's home
    fleet, policy, clock = setup(4, prefill_tokens_per_s=10_000, bounded_load_floor=1000)
    placement = policy.placement
    tools = {"role": "system", "content": doc(9, 8000)}

    def agent(*turns: str) -> dict[str, object]:
        messages = [tools, {"role": "user", "content": turns[0]}]
        for turn in turns[1:]:
            messages += [{"role": "assistant", "content": "calling a tool"}, {"role": "user", "content": turn}]
        return {"model": "m", "messages": messages}

    for placed in send_all(fleet, policy, 0, [keyless(agent(f"task {i}")) for i in range(served)], clock.now):
        fleet.release(fleet.replicas[0])
        placement.released(fleet.replicas[0], clock.now, placed)
    placement.set_busy(placement.of(fleet.replicas[0]), clock.now)
    # a new session (no assistant turn yet) goes where its turns to come will not crowd the holder
    opening = keyless(agent("a new task"))
    assert opening.prompt is not None and opening.prompt.opening
    d, priced = policy.decide(opening, opening.prompt, None, ())
    # (its spread there: the tool prompt it holds, about 8,000 tokens, x 1/10,000 s x excess
    # (40 - 10) / (10 + 4); scaled by the few tokens it computes there, as a continuation's is, it
    # was nothing and it stayed. The holder is no home for it: it holds none of its last message)
    assert d is not None and d.index != 0 and d.cost is not None
    mean = served / 4
    assert priced.row(0).spread_s == pytest.approx(8000 / 10_000 * (served - mean) / (mean + 4), rel=0.02)
    if served == 20:  # within the stay margin (a home keeps what costs less than twice another)
        assert priced.row(0).cost_s < 2 * d.cost.cost_s
    assert priced.row(0).ttft_s < d.cost.ttft_s  # its first token would come sooner there
    # the same prompt a turn further on is a conversation continuing there: it stays
    going_on = keyless(agent("a new task", "and then?"))
    assert going_on.prompt is not None and not going_on.prompt.opening
    d = policy.pick(going_on, None, ())
    assert d is not None and d.index == 0


def test_the_gate_keeps_traffic_off_a_replica_far_past_the_fleet() -> None:
    fleet, policy, _clock = setup(4, bounded_load_floor=2, ttft_gate_c=1.5)
    body = chat(doc(3, 3000), "q?")
    owner = serve(fleet, policy, keyless(body))
    for _ in range(6):
        fleet.acquire(fleet.replicas[owner])
    d = policy.pick(keyless(chat(doc(3, 3000), "again?")), None, ())
    assert d is not None and d.index != owner


def test_a_hot_prefix_gains_a_second_holder_when_its_first_is_the_bottleneck() -> None:
    fleet, policy, clock = setup(4, prefill_tokens_per_s=10_000, bounded_load_floor=1000)
    placement = policy.placement
    owner = serve(fleet, policy, keyless(chat(doc(5, 8000), "first?")))
    chosen = []
    for i in range(100):  # a burst of questions on the one document: the owner's queue grows
        key = keyless(chat(doc(5, 8000), f"question {i}? " * 40))
        d = policy.pick(key, None, ())
        assert d is not None and d.cost is not None and key.prompt is not None
        fleet.acquire(fleet.replicas[d.index])
        placement.sent(fleet.replicas[d.index], key.prompt, d.cost, clock.now)
        chosen.append(d.index)
    assert chosen[0] == owner
    others = [i for i in chosen if i != owner]
    assert others, "the hot document never gained a second holder"
    second = others[0]
    key = keyless(chat(doc(5, 8000), "later?"))
    assert key.prompt is not None
    placement.answered(fleet.replicas[second], key.prompt, None, Answer(0, 0, None))  # it answered: it holds it
    rows = {c.index: c for c in placement.candidates(key.prompt, [owner, second], None, clock.now)}
    assert rows[second].cached_tokens > 7000 and rows[owner].cached_tokens > 7000


def test_ties_break_by_the_ring_never_by_list_order() -> None:
    fleet, policy, _clock = setup(4)
    picks = Counter()
    for i in range(200):
        key = RoutingKey(f"s{i}".encode(), "header", "x", prompt_of(chat(doc(i, 200), "q"), BLOCK))
        d = policy.pick(key, None, ())
        assert d is not None
        assert d.index == fleet.ring.lookup(key.key)  # an idle fleet with nothing cached: the ring
        assert d.reason == "ring"
        picks[d.index] += 1
    assert len(picks) == 4


# -- feedback from usage --------------------------------------------------------------------------


def test_usage_that_shows_an_over_prediction_shrinks_the_lru_and_drops_the_blocks() -> None:
    fleet, policy, clock = setup(1)
    placement = policy.placement
    replica = fleet.replicas[0]
    key = keyless(chat(doc(2, 4000), "q?"))
    assert key.prompt is not None
    serve(fleet, policy, key)  # now it holds the prompt (all ~250 blocks)
    held = placement.of(replica)
    before = held.blocks
    d = policy.pick(key, None, ())
    assert d is not None and d.cost is not None and d.cost.cached_tokens > 3900
    placed = placement.sent(replica, key.prompt, d.cost, clock.now)
    # the engine held only the first 1,000 tokens: someone else's requests evicted the rest
    tokens = round(key.prompt.nbytes / 4)
    predicted = placement.answered(replica, key.prompt, placed, Answer(tokens, 1000, None))
    assert predicted is not None and predicted.tokens > 3900 and predicted.source == "model"
    assert held.blocks < before
    assert placement.index.size(held.holder) <= held.blocks
    again = placement.candidates(key.prompt, [0], None, clock.now)[0]
    assert again.cached_tokens == pytest.approx(1000, abs=16)
    assert placement.learnt.accuracy.over_tokens == pytest.approx(predicted.tokens - 1000)


def test_a_replica_that_lost_its_cache_is_emptied_and_exact_answers_grow_it_back() -> None:
    fleet, policy, _clock = setup(1)
    placement = policy.placement
    replica = fleet.replicas[0]
    # three models: chains that share no block (a miss on one truncates only its own)
    keys = [keyless(chat(doc(i, 2000), "q?", model=f"m{i}")) for i in range(3)]
    for key in keys:
        serve(fleet, policy, key)
    held = placement.of(replica)
    assert placement.index.size(held.holder) > 300
    for key in keys[:2]:  # it restarted: two answers in a row found nothing of a long prefix
        serve(fleet, policy, key, cached=0)
    assert held.resets == 1
    assert placement.index.size(held.holder) <= len(keys[1].prompt.chain)  # type: ignore[union-attr]
    held.blocks = held.engine_blocks // 2
    for _ in range(5):
        serve(fleet, policy, keys[1])  # exact: grows back
    assert held.blocks > held.engine_blocks // 2


def test_capacity_follows_what_the_engine_reports() -> None:
    fleet, policy, _clock = setup(1, kv_capacity_tokens=("*=1000",))
    placement = policy.placement
    replica = fleet.replicas[0]
    assert placement.of(replica).engine_blocks == 1000 * 4 // BLOCK
    replica.engine = EngineStats(kv_tokens=2048 * 16)
    assert placement.of(replica).engine_blocks == 2048 * 16 * 4 // BLOCK
    key = keyless(chat(doc(1, 40_000), "q?"))  # longer than the cache: the start of it is kept
    serve(fleet, policy, key)
    assert placement.index.size(placement.of(replica).holder) == 2048


def test_without_a_usable_prompt_the_policy_places_as_affinity_does() -> None:
    fleet, policy, _clock = setup(4)
    for i in range(50):
        key = RoutingKey(f"s{i}".encode(), "header", "x")
        d = policy.pick(key, None, ())
        assert d is not None and d.index == fleet.ring.lookup(key.key) and d.cost is None


def test_placed_carries_the_prediction() -> None:
    fleet, policy, clock = setup(2)
    key = keyless(chat(doc(1), "q?"))
    serve(fleet, policy, key)
    d = policy.pick(key, None, ())
    assert d is not None and d.cost is not None and key.prompt is not None
    placed = policy.placement.sent(fleet.replicas[d.index], key.prompt, d.cost, clock.now)
    assert isinstance(placed, Placed) and placed.blocks == len(key.prompt.chain)
    assert isinstance(key.prompt, Prompt)


def test_placement_forgets_replicas_that_left() -> None:
    fleet, policy, _clock = setup(3)
    placement: Placement = policy.placement
    for r in fleet.replicas:
        placement.of(r)
    gone = fleet.replicas[1].id
    fleet.remove(gone)
    fleet.add(parse_replica("http://127.0.0.1:9100"))
    placement.of(fleet.replicas[-1])
    assert gone not in placement.held and len(placement.held) == 3


def test_a_session_stays_unless_moving_saves_a_real_share_of_its_cost() -> None:
    fleet, policy, clock = setup(2, prefill_tokens_per_s=10_000, bounded_load_floor=100, ttft_interference=0)
    body = chat(doc(1, 2000), "a?", "b?")
    key = keyed("s1", body)
    held = policy.placement.of(fleet.replicas[1])
    policy.placement.set_busy(held, clock.now + 0.3)  # staying costs 0.3 s; moving, ~0.21 s of recompute
    stay = policy.pick(key, fleet.replicas[1].id, ())
    assert stay is not None and stay.index == 1 and stay.reason == "sticky"
    policy.stay_share = policy.move_weight = 0.0  # without the margin (or the move's price) the cheaper guess wins
    moved = policy.pick(key, fleet.replicas[1].id, ())
    assert moved is not None and moved.index == 0 and moved.reason == "cost"


def test_the_gate_leaves_a_session_within_the_floor_of_the_fleets_mean() -> None:
    # every replica busy, the session's a little more (12 against 6): past 1.5 x the mean, yet
    # within bounded_load_floor (8) of it, so the session keeps its cache rather than spill
    fleet, policy, _clock = setup(4, bounded_load_floor=8, ttft_gate_c=1.5)
    key = keyed("s1", chat(doc(1, 2000), "a?", "b?"))
    for i, load in enumerate((12, 6, 6, 6)):
        for _ in range(load):
            fleet.acquire(fleet.replicas[i])
    assert fleet.ring.load_cap(fleet.loads, 1.5) == 12 and policy.placement.gate() == 16
    stay = policy.pick(key, fleet.replicas[0].id, ())
    assert stay is not None and stay.index == 0 and stay.reason == "sticky"
    for _ in range(5):  # 17: more than the floor past the mean: it spills
        fleet.acquire(fleet.replicas[0])
    spill = policy.pick(key, fleet.replicas[0].id, ())
    assert spill is not None and spill.index != 0 and spill.reason == "spill"


def fill(policy: Ttft, replica: ReplicaState, *documents: int) -> None:
    """`replica`'s LRU full of other conversations' documents: whatever is sent there evicts some."""
    placement = policy.placement
    held = placement.of(replica)
    for i in documents:
        prompt = prompt_of(chat(doc(i, 2000), "q?"), BLOCK)
        assert prompt is not None
        placement.index.insert(held.holder, prompt.chain)
    held.blocks = placement.index.size(held.holder)
    placement.index.set_capacity(held.holder, held.blocks)


def test_a_keyed_session_stays_unless_the_move_pays_for_what_it_costs_the_fleet() -> None:
    """Staying costs 0.5 s (its replica's queue), moving 0.21 s (the history recomputed on an idle
    replica): under half, so the session moved. Priced for the fleet it does not: that replica's
    cache is full (the recompute evicts as much of others' context) or others queued three
    requests there (each waits for it). A long queue at home still moves it."""
    for crowded in ("full cache", "queued there"):
        fleet, policy, clock = setup(2, prefill_tokens_per_s=10_000, bounded_load_floor=100)
        placement = policy.placement
        key = keyed("s1", chat(doc(1, 2000), "a?", "b?"))
        home, other = fleet.replicas[1], fleet.replicas[0]
        placement.set_busy(placement.of(home), clock.now + 0.5)
        if crowded == "full cache":
            fill(policy, other, 2, 3)
        else:
            other.engine = EngineStats(waiting=3)
        stay, priced = policy.decide(key, key.prompt, home.id, ())  # type: ignore[arg-type]
        assert stay is not None and stay.index == 1 and stay.reason == "sticky", crowded
        rows = {c.index: c for c in priced.rows()}
        assert rows[0].cost_s < rows[1].cost_s / 2  # the cheaper guess by far, for this request alone
        recompute = (rows[0].uncached_tokens - rows[1].uncached_tokens) / 10_000
        assert recompute == pytest.approx(0.2, rel=0.05)
        price = policy.move_price(rows[1], rows[0])
        assert price == pytest.approx(2 * recompute if crowded == "full cache" else 4 * recompute)
        placement.set_busy(placement.of(home), clock.now + 5.0)  # a long queue: the move pays
        moved = policy.pick(key, home.id, ())
        assert moved is not None and moved.index == 0 and moved.reason == "cost", crowded


def test_a_session_moved_by_cost_rests_and_never_flips_back() -> None:
    fleet, policy, clock = setup(3, prefill_tokens_per_s=10_000, bounded_load_floor=0)
    placement = policy.placement
    first = prompt_of(chat(doc(1, 2000), "a?"), BLOCK)
    key = keyed("s1", chat(doc(1, 2000), "a?", "b?"))
    assert first is not None and key.prompt is not None
    a = fleet.replicas[0]
    placement.index.insert(placement.of(a).holder, first.chain)  # its first turn was answered on A
    placement.set_busy(placement.of(a), clock.now + 5.0)
    explained, _ = policy.decide(key, key.prompt, a.id, ())  # /admin/route: nothing is remembered
    assert explained is not None and explained.reason == "cost" and not policy.moves
    d = policy.pick(key, a.id, ())
    assert d is not None and d.index != 0 and d.reason == "cost" and d.cost is not None
    b = fleet.replicas[d.index]
    c = next(r for r in fleet.replicas if r not in (a, b))
    placement.sent(b, key.prompt, d.cost, clock.now)  # served there: B holds it all now
    # 10 s later B has 5 s queued, A is idle and holds most of it: within the cool-down it stays
    clock.now += 10
    placement.set_busy(placement.of(b), clock.now + 5.0)
    stay = policy.pick(key, b.id, ())
    assert stay is not None and stay.index == b.index and stay.reason == "sticky"
    for _ in range(2):  # ... unless B is past the gate: a spill is no cost move
        fleet.acquire(b)
    spill = policy.pick(key, b.id, ())
    assert spill is not None and spill.index != b.index and spill.reason == "spill"
    for _ in range(2):
        fleet.release(b)
    # past the cool-down it may move again, never back to A (the cheapest: it holds the history)
    clock.now += 60
    placement.set_busy(placement.of(b), clock.now + 5.0)
    back = policy.pick(key, b.id, ())
    assert back is not None and back.index == b.index and back.reason == "sticky"
    for _ in range(2):  # with A past the gate, C is the cheapest: that move is made
        fleet.acquire(a)
    onward = policy.pick(key, b.id, ())
    assert onward is not None and onward.index == c.index and onward.reason == "cost"


def test_a_move_that_did_not_take_leaves_no_cool_down() -> None:
    """The session was sent away by cost, but its next turn says it was served at home still (the
    attempt failed over back there): no cool-down holds it."""
    fleet, policy, clock = setup(2, prefill_tokens_per_s=10_000, bounded_load_floor=100)
    placement = policy.placement
    key = keyed("s1", chat(doc(1, 2000), "a?", "b?"))
    home = fleet.replicas[1]
    placement.set_busy(placement.of(home), clock.now + 5.0)
    d = policy.pick(key, home.id, ())
    assert d is not None and d.reason == "cost" and b"s1" in policy.moves
    clock.now += 1
    placement.set_busy(placement.of(home), clock.now + 5.0)
    again = policy.pick(key, home.id, ())
    assert again is not None and again.index == 0 and again.reason == "cost"


def test_a_replicas_speed_is_weighed_against_the_replicas_of_its_own_models() -> None:
    """A 70B's replicas prefill slower than an 8B's: the prior a replica's few samples are weighed
    against, and the speed of one not measured yet, are those of its own model's replicas."""
    big, small = frozenset({"big-70b"}), frozenset({"small-8b"})
    fleet, placement, sample = speed_sampler([big, big, small, small])
    for _ in range(16):
        sample(0, 1000)  # the big model's
        sample(2, 8000)  # the small model's
    assert placement.learnt.model_spt[big] == pytest.approx(1 / 1000) and placement.learnt.model_spt[
        small
    ] == pytest.approx(1 / 8000)
    # not measured yet: as fast as its own model's replicas, not the fleet's median of both
    assert 1 / placement.of(fleet.replicas[1]).seconds_per_token == pytest.approx(1000, rel=0.01)
    assert 1 / placement.of(fleet.replicas[3]).seconds_per_token == pytest.approx(8000, rel=0.01)
    sample(3, 8000)  # one sample, weighed against its peers' 8,000: it stays there
    assert 1 / placement.of(fleet.replicas[3]).seconds_per_token == pytest.approx(8000, rel=0.01)


def test_a_replica_fed_by_events_is_priced_by_what_its_engine_holds() -> None:
    """The model sent a document to replica 0; its engine's events say it evicted it, and replica 2
    holds it (another router sent it there): the decision reads the events, not the model."""
    from dataclasses import replace  # noqa: PLC0415

    import msgpack  # noqa: PLC0415

    from router.kvevents.tokens import EngineTokens  # noqa: PLC0415
    from router.kvevents.wire import decode  # noqa: PLC0415

    fleet, policy, clock = setup(3)
    placement = policy.placement
    key = keyless(chat(doc(7), "q?"))
    assert key.prompt is not None
    serve(fleet, policy, key)  # the model now says: its first replica holds it
    ids = tuple(range(1, 4002))
    tokens = EngineTokens(len(ids), ids, None, None, "render")
    stored = {
        "type": "BlockStored",
        "block_hashes": list(range(1, 251)),
        "parent_block_hash": None,
        "token_ids": list(ids[:4000]),
        "block_size": 16,
        "medium": "GPU",
    }
    for i in range(3):
        h = placement.truth.holdings(fleet.replicas[i].id, 0, 10_000)
        h.accept(decode(0, msgpack.packb([0.0, [stored] if i == 2 else [], 0])))
    eventful = replace(key, prompt=replace(key.prompt, tokens=tokens))
    d, priced = policy.decide(eventful, eventful.prompt, None, ())  # type: ignore[arg-type]
    assert d is not None and d.cost is not None and d.index == 2
    assert d.cost.cached_tokens == 4000 and priced.source(2) == d.cost.source == "events"
    assert [c.cached_tokens for c in priced.rows()] == [0.0, 0.0, 4000.0]
    placed = placement.sent(fleet.replicas[2], eventful.prompt, d.cost, clock.now)  # type: ignore[arg-type]
    got = placement.answered(fleet.replicas[2], eventful.prompt, placed, Answer(4001, 4000, None))  # type: ignore[arg-type]
    assert got is not None and (got.tokens, got.source) == (4000, "events")
    assert (
        placement.learnt.events_accuracy.exact == 1 and placement.figures()["by_source"]["events"]["exact_share"] == 1.0
    )  # type: ignore[index]
    # its events stop being believed: the model prices it again
    placement.truth.suspect(fleet.replicas[2].id)
    d, priced = policy.decide(eventful, eventful.prompt, None, ())  # type: ignore[arg-type]
    assert d is not None and priced.source(2) == "model"


def test_a_long_new_context_goes_where_it_pushes_out_no_conversation_about_to_come_back() -> None:
    """Two replicas of 300 blocks, each holding 250 blocks of one conversation: replica 0's ended a
    turn just now (it may come back), replica 1's was never sent by this router (nothing says it
    will). A new 4,000-token document fits in neither's 50 empty blocks: on 0 it would evict most
    of the conversation about to return, so it goes to 1, and /admin/route's rows say why."""
    from dataclasses import replace  # noqa: PLC0415

    import msgpack  # noqa: PLC0415

    from router.kvevents.tokens import EngineTokens  # noqa: PLC0415
    from router.kvevents.wire import decode  # noqa: PLC0415

    fleet, policy, clock = setup(2)
    placement = policy.placement

    def tokens(first: int) -> EngineTokens:
        ids = tuple(range(first, first + 4001))
        return EngineTokens(len(ids), ids, None, None, "tokenizer")

    def stored(first: int) -> dict[str, object]:
        ids = list(range(first, first + 4000))
        hashes = list(range(first, first + 250))
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                "token_ids": ids, "block_size": 16, "medium": "GPU"}  # fmt: skip

    for i, first in enumerate((1, 100_001)):
        h = placement.truth.holdings(fleet.replicas[i].id, 0, 300)
        h.accept(decode(0, msgpack.packb([0.0, [stored(first)], 0])))
    key = keyless(chat(doc(7), "q?"))
    assert key.prompt is not None

    def prompt(first: int):  # type: ignore[no-untyped-def]
        return replace(key.prompt, tokens=tokens(first))

    # before any conversation ended a turn here, the two are alike: a tie (the ring breaks it)
    new = replace(key, prompt=prompt(200_001))
    d, priced = policy.decide(new, new.prompt, None, ())  # type: ignore[arg-type]
    assert d is not None and d.cost is not None and d.cost.evicts_s == 0.0 and len(priced.near()) == 2
    there, other = d.index, 1 - d.index
    # the conversation the ring's pick holds ends a turn there
    mine = prompt((1, 100_001)[there])
    row = placement.price(mine, (), None, clock.now).row(there)
    placed = placement.sent(fleet.replicas[there], mine, row, clock.now)
    placement.released(fleet.replicas[there], clock.now, placed)
    assert placement.truth.figures(fleet.replicas[there].id)["returning"] == 1  # type: ignore[index]
    d, priced = policy.decide(new, new.prompt, None, ())  # type: ignore[arg-type]
    assert d is not None and d.index == other and priced.near() == [other]
    rows = {c.index: c for c in priced.rows()}
    spt = placement.of(fleet.replicas[there]).seconds_per_token
    # 250 + its reply's blocks, 50 empty: at least 200 of the conversation's 250 evicted, at its speed
    assert rows[there].evicts_s >= 200 * 16 * spt and rows[other].evicts_s == 0.0
    assert rows[there].ttft_s == pytest.approx(rows[other].ttft_s)  # its first token is no later there
    # the conversation's own next turn shares what it holds: it pushes nothing of it out
    ids = (*mine.tokens.ids[:4000], 9)
    next_turn = replace(mine, tokens=EngineTokens(4001, ids, None, None, "tokenizer"))
    assert placement.price(next_turn, (), None, clock.now).row(there).evicts_s == 0.0
    # 15 s later it weighs exp(-1/2) of that; past RETURN_S it is forgotten
    clock.now += 15.0
    d, priced = policy.decide(new, new.prompt, None, ())  # type: ignore[arg-type]
    assert d is not None and d.index == other
    assert {c.index: c for c in priced.rows()}[there].evicts_s == pytest.approx(rows[there].evicts_s * math.exp(-0.5))
    clock.now += 16.0
    d, priced = policy.decide(new, new.prompt, None, ())  # type: ignore[arg-type]
    assert d is not None and d.cost is not None and d.cost.evicts_s == 0.0 and len(priced.near()) == 2
    assert placement.truth.figures(fleet.replicas[there].id)["evictions_priced"] == 2  # type: ignore[index]


def test_a_target_places_a_request_where_it_is_predicted_met_and_marks_it_late_where_none_is() -> None:
    """The session of the test above stays home with 0.5 s queued there (the move does not pay for
    the fleet); asked for its first token within 0.4 s, it goes where that is predicted (about
    0.21 s), reason `target`; asked for 0.1 s, no replica meets it: it stays, marked late."""
    fleet, policy, clock = setup(2, prefill_tokens_per_s=10_000, bounded_load_floor=100)
    placement = policy.placement
    key = keyed("s1", chat(doc(1, 2000), "a?", "b?"))
    home, other = fleet.replicas[1], fleet.replicas[0]
    placement.set_busy(placement.of(home), clock.now + 0.5)
    fill(policy, other, 2, 3)
    stay = policy.pick(key, home.id, ())
    assert stay is not None and stay.index == 1 and not stay.late
    met = policy.pick(key, home.id, (), target_s=0.4)
    assert met is not None and (met.index, met.reason, met.late) == (0, "target", False)
    assert met.cost is not None and met.cost.ttft_s <= 0.4
    late = policy.pick(key, home.id, (), target_s=0.1)
    assert late is not None and (late.index, late.reason, late.late) == (1, "sticky", True)
    roomy = policy.pick(key, home.id, (), target_s=5.0)  # a target its own choice meets changes nothing
    assert roomy is not None and (roomy.index, roomy.reason, roomy.late) == (1, "sticky", False)


# -- lmetric: LMetric's score, a baseline beside ttft -------------------------------------------------


def test_lmetric_picks_the_lowest_product_of_new_tokens_and_batch() -> None:
    """The module's worked example: A holds most of the prompt but runs 4, B holds nothing and runs
    1, C holds nothing and is idle: C scores 0 and wins; busy too, A wins."""
    specs = tuple(parse_replica(f"http://127.0.0.1:{9000 + i}") for i in range(3))
    config = RouterConfig(replicas=specs)
    fleet = Fleet(specs, config.vnodes, config.hash_seed)
    policy = make_policy("lmetric", fleet, config)
    assert isinstance(policy, Ttft) and policy.name == "lmetric"
    opening = keyed("warm", chat(doc(1), "What is it about?"))
    assert opening.prompt is not None
    send_all(fleet, policy, 0, [opening], policy.placement.clock())  # A holds the document (and the opening)
    fleet.release(fleet.replicas[0])
    follow = keyed("other", chat(doc(1), "What is it about?", "And then?"))
    fleet.loads[0], fleet.loads[1], fleet.loads[2] = 4, 1, 0
    d = policy.pick(follow, None, ())
    assert d is not None and d.index == 2 and d.cost is not None and d.cost.cached_tokens == 0
    fleet.loads[2] = 1
    d = policy.pick(follow, None, ())
    assert d is not None and d.index == 0 and d.reason == "prefix"
    # a keyed session stays only by its score: 62 new tokens x 50 beat 4,078 x 1; x 100 do not
    fleet.loads[0] = 50
    d = policy.pick(follow, fleet.replicas[0].id, ())
    assert d is not None and d.index == 0 and d.reason == "sticky"
    fleet.loads[0] = 100
    d = policy.pick(follow, fleet.replicas[0].id, ())
    assert d is not None and d.index in (1, 2) and d.reason == "cost"


def test_a_price_is_a_value_that_a_later_price_leaves_as_it_was() -> None:
    """A decision reads its own rows: pricing another prompt (or the same one after the fleet
    moved) makes another `Priced` and changes none of the first one's rows, its cheapest or its
    ties. (The rows used to be scratch arrays that the next price overwrote.)"""
    fleet, policy, clock = setup(3, prefill_tokens_per_s=10_000)
    placement = policy.placement
    fill(policy, fleet.replicas[1], 1)
    first = keyless(chat(doc(1), "q?"))
    assert first.prompt is not None
    priced = placement.price(first.prompt, (), None, clock.now)
    before = [(c.index, c.cached_tokens, c.cost_s, c.wait_s, c.gated) for c in priced.rows()]
    assert priced.best == 1 and priced.row(1).cached_tokens > 0 and priced.source(1) == "model"
    # another prompt held nowhere, and the holder loaded since: both change what a price says now
    other = keyless(chat(doc(2), "q?"))
    assert other.prompt is not None
    placement.set_busy(placement.of(fleet.replicas[1]), clock.now + 9.0)
    later = placement.price(other.prompt, (1,), None, clock.now)
    assert later.best != 1 and [c.index for c in later.rows()] == [0, 2]
    again = placement.price(first.prompt, (), None, clock.now)
    assert again.row(1).cost_s > priced.row(1).cost_s + 8.0
    assert [(c.index, c.cached_tokens, c.cost_s, c.wait_s, c.gated) for c in priced.rows()] == before
    assert priced.best == 1 and priced.near() == [1]
