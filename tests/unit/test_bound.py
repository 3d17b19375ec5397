"""The run's limit (router.bench.bound): Belady's eviction over one fleet-wide cache, and the TTFT floor."""

from __future__ import annotations

import random
from array import array
from collections import OrderedDict

import pytest

from router.bench.bound import BoundTrace, Sent, belady_hits, bound_figures, ttft_floor
from router.emulator.engine import EngineConfig

BS = 16


def sent(*blocks: int, extra: int = 1) -> Sent:
    """A prompt of these block keys and `extra` tokens past them."""
    return Sent(array("Q", blocks), len(blocks) * BS + extra)


def lru_hits(requests: list[Sent], capacity: int) -> list[int]:
    """The same cache with least-recently-used eviction: what an engine's own cache does."""
    held: OrderedDict[int, None] = OrderedDict()
    out = []
    for r in requests:
        limit = (r.tokens - 1) // BS
        hit = 0
        while hit < len(r.chain) and hit < limit and r.chain[hit] in held:
            hit += 1
        out.append(hit * BS)
        for key in r.chain:
            held[key] = None
            held.move_to_end(key)
        while len(held) > capacity:
            held.popitem(last=False)
    return out


def test_the_worked_example_keeps_what_comes_back() -> None:
    a, b, again = sent(1, 2, 3), sent(9), sent(1, 2, 3, 4)
    assert belady_hits([a, b, again], 3, BS) == [0, 0, 48]
    assert lru_hits([a, b, again], 3) == [0, 0, 0]  # LRU drops block 1, and the prefix with it


def test_the_last_token_is_never_a_hit() -> None:
    whole = sent(1, 2, extra=0)  # 32 tokens: the engine computes the last, so one block at most
    assert belady_hits([sent(1, 2), whole], 10, BS) == [0, 16]


def test_an_answers_blocks_are_held_for_the_next_turn() -> None:
    """The engine caches a reply's blocks as it decodes: the next turn (history + reply + more) hits them."""
    answered = Sent(array("Q", [1, 2, 3]), 3 * BS + 5, answered=True)
    assert belady_hits([sent(1, 2), answered, sent(1, 2, 3, 4)], 10, BS) == [0, 48]
    trace = BoundTrace(BS)
    number = trace.add("/v1/completions", {"prompt": "abcd" * 40})  # 40 tokens: 2 blocks
    trace.ended(number, "efgh" * 40)
    failed = trace.add("/v1/completions", {"prompt": "wxyz" * 40})
    trace.ended(failed, None)  # nothing more cached
    again = trace.add("/v1/completions", {"prompt": "abcd" * 40 + "efgh" * 40 + "more"})
    assert [e.answered for e in trace.events] == [False, True, False, False] and again == 2
    assert belady_hits(trace.events, 100, BS) == [0, 0, 80]


def test_a_parent_outlives_its_child_when_both_come_back_together() -> None:
    # capacity 2 after [1 2 3]: the next request needs 1 and 2 (and 3); dropping 1 would waste 2 and 3
    hits = belady_hits([sent(1, 2, 3), sent(1, 2, 3, 4)], 2, BS)
    assert hits == [0, 32]


@pytest.mark.parametrize("seed", range(20))
def test_belady_never_loses_to_lru_and_never_beats_an_endless_cache(seed: int) -> None:
    rng = random.Random(seed)
    stems = [[rng.randrange(1, 1 << 40) for _ in range(rng.randint(1, 6))] for _ in range(8)]
    requests = []
    for _ in range(60):
        stem = rng.choice(stems)
        tail = [rng.randrange(1 << 41, 1 << 42) for _ in range(rng.randint(0, 3))]
        requests.append(sent(*stem[: rng.randint(1, len(stem))], *tail))
    capacity = rng.randint(3, 20)
    bound = sum(belady_hits(requests, capacity, BS))
    assert bound >= sum(lru_hits(requests, capacity))
    assert bound <= sum(belady_hits(requests, 10**9, BS)) == sum(lru_hits(requests, 10**9))


def test_the_trace_cuts_chats_and_prompts_into_the_emulators_blocks() -> None:
    trace = BoundTrace(BS)
    messages = [{"role": "user", "content": "How deep is the river? " * 10}]
    trace.add("/v1/chat/completions", {"messages": messages})
    trace.add("/v1/chat/completions", {"messages": [*messages, {"role": "assistant", "content": "deep"}]})
    trace.add("/v1/completions", {"prompt": "x" * 200})
    trace.add("/v1/completions", {"prompt": None})
    first, second, prompt, empty = trace.sent
    assert first.tokens == -(-len("<|user|>" + "How deep is the river? " * 10 + "<|end|><|assistant|>") // 4)
    assert list(second.chain[: len(first.chain) - 1]) == list(first.chain[:-1])  # a history is a prefix
    assert prompt.tokens == 50 and len(prompt.chain) == 3 and empty.tokens == 0


def test_the_ttft_floor_is_the_prefill_alone() -> None:
    engine = EngineConfig(prefill_tokens_per_s=10_000, step_base_s=0.01, attention_per_token_s=0.0)
    assert ttft_floor(10_000, 0, engine) == pytest.approx(2 * 0.01 + 1.0)  # two chunks of 8,192 at most
    assert ttft_floor(0, 5_000, engine) == pytest.approx(0.01 + 1 / 10_000)  # the last token, always
    trace = BoundTrace(BS)
    for _ in range(2):
        trace.add("/v1/completions", {"prompt": "abcd" * 1000})  # 1,000 tokens, then all but the last block
    figures = bound_figures(trace, [True, True], [False, True], 1, EngineConfig(num_blocks=100))
    assert figures["bound_hit_rate"] == pytest.approx(992 / 2000)
    assert figures["ttft_floor_later_s"]["p50"] < figures["ttft_floor_s"]["p99"]
