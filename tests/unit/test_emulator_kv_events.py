"""The emulator's KV-cache events as the engine writes them down, and their two wire encodings."""

from __future__ import annotations

import msgpack  # type: ignore[import-untyped, unused-ignore]
import pytest

from router.emulator.engine import Engine, EngineConfig, Sequence
from router.emulator.kvcache import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, PrefixCache
from router.emulator.kvevents import KvEventsOptions, encode_batch
from router.kvevents.emulator_tokens import block_hashes, cache_seed, generated_text, token_ids

BS = 4  # tokens per block: 16 bytes


def steps(engine: Engine, *seqs: Sequence) -> list[list[CacheEvent]]:
    """Run the sequences to the end on a virtual clock; each step's events (steps without any too)."""
    for seq in seqs:
        engine.add(seq)
    now, out = 0.0, []
    while engine.has_work():
        step = engine.schedule(now)
        assert step is not None
        now += step.duration
        engine.finish(step, now)
        engine.cache.check()
        out.append(engine.take_kv_events())
    return out


def stored(events: list[list[CacheEvent]]) -> list[BlockStored]:
    return [e for step in events for e in step if isinstance(e, BlockStored)]


def test_token_ids_are_four_bytes_little_endian_the_last_padded() -> None:
    assert token_ids(b"Hello, w") == [int.from_bytes(b"Hell", "little"), int.from_bytes(b"o, w", "little")]
    assert token_ids(b"abcde") == [int.from_bytes(b"abcd", "little"), ord("e")]
    assert token_ids(b"") == []


def test_prompt_blocks_when_prefill_computes_them_then_reply_blocks_as_decode_fills_them() -> None:
    e = Engine(EngineConfig(block_size=BS, num_blocks=64), kv_events=True)
    prompt = b"p" * 40  # 10 tokens: 2 full blocks, half of a third
    seq = e.new_sequence(prompt, 8, 0.0)
    events = steps(e, seq)
    blocks = stored(events)
    # one event when prefill ends (its 2 blocks), then one per block decode fills: the third is
    # full once the 3rd reply token's KV is computed, the fourth at the 7th; the 8th never has KV
    assert [len(b.block_hashes) for b in blocks] == [2, 1, 1]
    assert [i for i, step in enumerate(events) if step] == [0, 2, 6]  # step i gives token i + 1
    text = prompt + generated_text(e.reply_seed(seq), 0, 7).encode()
    chain = block_hashes(text, BS)
    assert [h for b in blocks for h in b.block_hashes] == chain[:4]  # what the next turn keys them by
    assert [b.parent_block_hash for b in blocks] == [None, chain[1], chain[2]]
    assert [t for b in blocks for t in b.token_ids] == token_ids(text[: 4 * BS * 4])
    assert all(b.lora_name is None and b.extra_keys == [None] * len(b.block_hashes) for b in blocks)


def test_a_short_last_prompt_token_leaves_its_block_to_the_reply_as_the_next_turn_cuts_it() -> None:
    e = Engine(EngineConfig(block_size=BS, num_blocks=64), kv_events=True)
    prompt = b"p" * 46  # 12 tokens, the last of 2 bytes: the third block's bytes end in the reply
    seq = e.new_sequence(prompt, 4, 0.0)
    blocks = stored(steps(e, seq))
    assert [len(b.block_hashes) for b in blocks] == [2, 1]
    text = prompt + generated_text(e.reply_seed(seq), 0, 4).encode()
    assert [h for b in blocks for h in b.block_hashes] == block_hashes(text, BS)[:3]
    assert blocks[1].token_ids == token_ids(text[32:48])  # what the next turn's prompt has there


def test_chunked_prefill_stores_each_chunks_blocks_chained_and_a_hit_is_the_parent() -> None:
    e = Engine(EngineConfig(block_size=BS, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=8), kv_events=True)
    first = e.new_sequence(b"a" * 96, 1, 0.0)  # 24 tokens: 6 blocks, 8 tokens a step
    blocks = stored(steps(e, first))
    assert [len(b.block_hashes) for b in blocks] == [2, 2, 2]
    assert [b.parent_block_hash for b in blocks] == [None, blocks[0].block_hashes[-1], blocks[1].block_hashes[-1]]
    # a longer prompt with the same start hits 5 blocks (its last token is recomputed): it stores
    # only the blocks it computes, their parent the last block it hit
    second = e.new_sequence(b"a" * 96 + b"b" * 32, 1, 0.0)
    again = stored(steps(e, second))
    assert second.cached_tokens == 6 * BS
    assert again[0].parent_block_hash == blocks[2].block_hashes[-1]
    assert again[0].token_ids == token_ids(b"b" * 32)


def test_eviction_is_one_block_removed_per_block() -> None:
    e = Engine(EngineConfig(block_size=BS, num_blocks=6), kv_events=True)
    old = stored(steps(e, e.new_sequence(b"x" * 64, 1, 0.0)))  # 4 blocks, cached and evictable
    new_events = steps(e, e.new_sequence(b"y" * 64, 1, 0.0))  # needs 5 blocks: 3 evicted
    removed = [ev for step in new_events for ev in step if isinstance(ev, BlockRemoved)]
    # the conversation's tail goes first (released last block first)
    assert [r.block_hash for r in removed] == old[0].block_hashes[::-1][:3]
    first = new_events[0]
    assert all(isinstance(ev, BlockRemoved) for ev in first[:3]) and isinstance(first[3], BlockStored)


def test_reset_prefix_cache_is_refused_while_blocks_are_held_and_clears_all_at_once() -> None:
    e = Engine(EngineConfig(block_size=BS, num_blocks=64), kv_events=True)
    running = e.new_sequence(b"z" * 64, 4, 0.0)
    e.add(running)
    step = e.schedule(0.0)
    assert step is not None
    assert not e.reset_prefix_cache()  # a request holds blocks, as vLLM refuses
    e.finish(step, step.duration)
    steps(e)
    e.take_kv_events()
    assert e.reset_prefix_cache()
    assert e.take_kv_events() == [AllBlocksCleared()]  # one event, no BlockRemoved
    assert e.cache.cached_blocks == 0 and e.cache.evictions == 0
    e.cache.check()
    assert e.new_sequence(b"z" * 64, 1, 0.0).hashes[0] not in e.cache._refs


def test_lora_and_salt_blocks_are_their_own_with_vllm_extra_keys() -> None:
    e = Engine(EngineConfig(block_size=BS, num_blocks=256), kv_events=True)
    prompt = b"q" * 64
    plain = e.new_sequence(prompt, 1, 0.0)
    lora = e.new_sequence(prompt, 1, 0.0, adapter="lora-0")
    salted = e.new_sequence(prompt, 1, 0.0, cache_salt="abc")
    both = e.new_sequence(prompt, 1, 0.0, adapter="lora-0", cache_salt="abc")
    named_like_salt = e.new_sequence(prompt, 1, 0.0, adapter="abc")
    seqs = (plain, lora, salted, both, named_like_salt)
    assert len({s.hashes[0] for s in seqs}) == 5  # no two share a block
    assert plain.hashes == block_hashes(prompt, BS) and cache_seed(None, None) == 0
    events = {}
    for seq in seqs:
        (event,) = stored(steps(e, seq))
        assert seq.cached_tokens == 0
        events[seq.id] = event
    assert events[plain.id].extra_keys == [None] * 4
    assert events[lora.id].extra_keys == [["lora-0"]] * 4 and events[lora.id].lora_name == "lora-0"
    assert events[salted.id].extra_keys == [["abc"], None, None, None]
    assert events[both.id].extra_keys == [["lora-0", "abc"], ["lora-0"], ["lora-0"], ["lora-0"]]
    # the same adapter and salt again hits
    twin = e.new_sequence(prompt + b"more", 1, 0.0, adapter="lora-0", cache_salt="abc")
    steps(e, twin)
    assert twin.cached_tokens == 4 * BS


def test_reset_forgets_events_not_yet_taken() -> None:
    e = Engine(EngineConfig(block_size=BS, num_blocks=64), kv_events=True)
    seq = e.new_sequence(b"r" * 64, 2, 0.0)
    e.add(seq)
    step = e.schedule(0.0)
    assert step is not None
    e.finish(step, step.duration)
    e.reset()
    assert e.take_kv_events() == [] and e.cache.journal is e.kv_events


def test_an_engine_without_kv_events_writes_nothing() -> None:
    e = Engine(EngineConfig(block_size=BS, num_blocks=64))
    steps(e, e.new_sequence(b"s" * 64, 3, 0.0))
    assert e.kv_events is None and e.take_kv_events() == [] and e.cache.journal is None
    assert PrefixCache(4, BS).reset()


EVENTS: list[CacheEvent] = [
    BlockStored([1, 2**64 - 1], None, [7] * 8, "lora-0", [["lora-0", "abc"], ["lora-0"]]),
    BlockRemoved(2**64 - 1),
    AllBlocksCleared(),
]


def test_tagged_encoding_is_vllms_maps() -> None:
    ts, events, rank = msgpack.unpackb(encode_batch(EVENTS, "tagged", BS, {"lora-0": 1}, 12.5))
    assert ts == 12.5 and rank == 0
    assert events == [
        {
            "type": "BlockStored",
            "block_hashes": [1, 2**64 - 1],
            "parent_block_hash": None,
            "token_ids": [7] * 8,
            "block_size": BS,
            "lora_id": 1,
            "medium": "GPU",
            "lora_name": "lora-0",
            "extra_keys": [["lora-0", "abc"], ["lora-0"]],
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        },
        {"type": "BlockRemoved", "block_hashes": [2**64 - 1], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ]
    assert list(events[0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
    ]


def test_positional_encoding_is_vllms_arrays() -> None:
    _, events, _ = msgpack.unpackb(encode_batch(EVENTS, "positional", BS, {"lora-0": 1}, 0.0))
    assert events == [
        ["BlockStored", [1, 2**64 - 1], None, [7] * 8, BS, 1, "GPU", "lora-0"],
        ["BlockRemoved", [2**64 - 1], "GPU"],
        ["AllBlocksCleared"],
    ]


@pytest.mark.parametrize(
    "bad", [{"encoding": "json"}, {"buffer_steps": 0}, {"port": 70000}, {"replay_port": -1}, {"hwm": 0}]
)
def test_kv_events_options_are_validated(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        KvEventsOptions(**bad)  # type: ignore[arg-type]
