"""Agreement between routers following the same KV events (router.bench.event_agreement): the
prompts drawn from what one router applied, and the decision each router's index makes."""

from __future__ import annotations

import asyncio
import random
from array import array

import msgpack

from router.bench.event_agreement import Agreement, Recorder, decision, sample
from router.kvevents.tokens import root_of, token_chain
from router.kvevents.truth import Truth
from router.kvevents.wire import Batch, decode

BS = 4
IDS = ["a", "b"]


def stored(hashes: list[int], parent: int | None, first_token: int) -> dict[str, object]:
    n = len(hashes)
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(first_token, first_token + n * BS)),
        "block_size": BS,
        "medium": "GPU",
    }


def batch(seq: int, *events: object) -> Batch:
    return decode(seq, msgpack.packb([1.0, list(events), 0]))


def router() -> Truth:
    truth = Truth()
    for rid in IDS:
        truth.holdings(rid, 0, 100).caught_up()  # subscribed before each engine's first message
    return truth


def apply(truth: Truth, rid: str, b: Batch) -> None:
    (h,) = truth.of(rid)
    h.accept(b)


def chain(first_token: int, blocks: int) -> array[int]:
    return token_chain(list(range(first_token, first_token + blocks * BS)), BS, root_of(None, None))


def test_the_replica_holding_most_of_the_prompt_is_chosen() -> None:
    truth = router()
    apply(truth, "a", batch(0, stored([1], None, 100)))
    apply(truth, "b", batch(0, stored([7, 8], None, 100)))
    assert decision(truth, IDS, chain(100, 2)) == 1  # b holds both blocks, a one
    assert decision(truth, IDS, chain(100, 1)) == 0  # both hold the one block: the first
    assert decision(truth, IDS, chain(500, 2)) == -1  # nobody holds any: load decides
    truth.suspect("b")  # not believed: it counts as holding nothing
    assert decision(truth, IDS, chain(100, 2)) == 0


def test_an_event_in_flight_makes_two_routers_differ_until_it_lands() -> None:
    first, second = router(), router()
    b0 = batch(0, stored([1, 2], None, 100))
    for truth in (first, second):
        apply(truth, "a", b0)
    b1 = batch(0, stored([5, 6, 7], None, 100))
    apply(first, "b", b1)  # applied by one router, in flight to the other
    prompt = chain(100, 3)
    assert (decision(first, IDS, prompt), decision(second, IDS, prompt)) == (1, 0)
    apply(second, "b", b1)
    assert decision(second, IDS, prompt) == 1


def test_prompts_are_drawn_from_the_chains_the_router_applied() -> None:
    rec = Recorder(BS)
    rec.heard("a", batch(0, stored([1, 2], None, 100)))
    rec.heard("a", batch(1, stored([3], 2, 108)))  # the chain goes on
    rec.heard("b", batch(0, stored([9], 4, 300)))  # its chain began before the router joined: not drawn
    assert list(rec.chains["a"]) == [3] and "b" not in rec.chains
    rng = random.Random(1)
    drawn = {tuple(rec.draw(rng) or ()) for _ in range(50)}
    assert drawn == {tuple(chain(100, n)) for n in (1, 2, 3)}  # every leading part, nothing else
    for k in range(10):  # only the latest chains are kept
        rec.heard("a", batch(2 + k, stored([100 + k], None, 1000 * k)))
    assert len(rec.chains["a"]) == 4


def test_the_sampler_counts_identical_decisions_and_the_late_router_apart() -> None:
    first, second, late = router(), router(), router()
    rec = Recorder(BS)
    b = batch(0, stored([1, 2], None, 100))
    for truth in (first, second):
        apply(truth, "a", b)
    rec.heard("a", b)
    agreement = Agreement()
    clock = iter([0.0, 0.0, 1.0])  # two rounds of draws, then the time is up
    asyncio.run(sample(rec, [first, second], lambda: late, IDS, agreement, 1.0, lambda: next(clock)))
    assert agreement.samples == agreement.identical == agreement.held == 32 and agreement.share == 1.0
    # the late router applied nothing yet: every prompt it sends elsewhere (to load) than the first
    assert agreement.late_samples == 32 and agreement.late_identical == 0 and agreement.late_share == 0.0


def test_decisions_of_routers_in_other_processes_are_compared_chain_by_chain() -> None:
    first = router()
    rec = Recorder(BS)
    b = batch(0, stored([1, 2], None, 100))
    apply(first, "a", b)
    rec.heard("a", b)
    asked: list[int] = []

    async def remote(chains: list[array[int]]) -> list[list[int]]:
        # two other processes: one agrees on every chain; the other has not applied the batch yet,
        # so it sends the prompts of two blocks elsewhere (to load) and agrees on the one-block ones
        asked.append(len(chains))
        return [[0] * len(chains), [0 if len(c) == 1 else -1 for c in chains]]

    agreement = Agreement()
    clock = iter([0.0, 1.0])  # one round of draws
    asyncio.run(sample(rec, [first], lambda: None, IDS, agreement, 1.0, lambda: next(clock), remote=remote))
    assert asked == [16] and agreement.samples == 16 and agreement.held == 16
    rng = random.Random(7)  # the sampler's draws, again: the one-block prompts are the identical ones
    one_block = sum(len(rec.draw(rng) or ()) == 1 for _ in range(16))
    assert 0 < one_block < 16 and agreement.identical == one_block
