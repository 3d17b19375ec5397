"""The continuous-batching engine on a virtual clock: prefill, decode, queueing, KV pressure."""

from __future__ import annotations

import pytest

from router.emulator.engine import Engine, EngineConfig, RequestTooLarge, Sequence
from router.kvevents.emulator_tokens import generated_text


def text(tokens: int, tag: str = "a") -> bytes:
    unit = (tag * 4)[:4].encode()
    return unit * tokens


def run(engine: Engine, arrivals: list[tuple[float, Sequence]], until: float = 1e9) -> float:
    """Drive the engine with a virtual clock; returns the time it went idle."""
    now = 0.0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or engine.has_work():
        while pending and pending[0][0] <= now:
            engine.add(pending.pop(0)[1])
        step = engine.schedule(now)
        if step is None:
            now = pending[0][0]
            continue
        now += step.duration
        engine.finish(step, now)
        engine.cache.check()
        assert now < until
    return now


def ttft(seq: Sequence) -> float:
    assert seq.first_token_at is not None
    return seq.first_token_at - seq.arrival


def test_prefill_time_grows_with_uncached_tokens() -> None:
    cfg = EngineConfig()
    e = Engine(cfg)
    short = e.new_sequence(text(500), 1, 0.0)
    run(e, [(0.0, short)])
    long = e.new_sequence(text(4000, "b"), 1, 0.0)
    run(e, [(0.0, long)])
    assert ttft(short) == pytest.approx(cfg.step_base_s + 500 / cfg.prefill_tokens_per_s)
    assert ttft(long) == pytest.approx(cfg.step_base_s + 4000 / cfg.prefill_tokens_per_s)


def test_a_cached_prefix_skips_its_prefill_and_is_reported() -> None:
    e = Engine(EngineConfig())
    first = e.new_sequence(text(4000) + b"first question", 8, 0.0)
    run(e, [(0.0, first)])
    second = e.new_sequence(text(4000) + b"another question", 8, 0.0)
    run(e, [(0.0, second)])
    assert first.cached_tokens == 0
    assert second.cached_tokens == 4000  # 250 whole blocks of 16
    assert ttft(second) < ttft(first) / 10
    assert e.cached_tokens_total == 4000 and e.prompt_tokens_total == first.prompt_tokens + second.prompt_tokens


def test_the_reply_is_cached_for_the_next_turn() -> None:
    e = Engine(EngineConfig(block_size=16))
    turn1 = e.new_sequence(text(100), 40, 0.0)
    run(e, [(0.0, turn1)])
    reply = generated_text(e.reply_seed(turn1), 0, 40).encode()
    turn2 = e.new_sequence(text(100) + reply + b"<|end|><|user|>and then?<|end|><|assistant|>", 4, 0.0)
    run(e, [(0.0, turn2)])
    assert turn2.cached_tokens == (100 + 40) // 16 * 16


def test_decode_steps_slow_down_with_batch_size_and_context() -> None:
    cfg = EngineConfig()
    alone = Engine(cfg)
    one = alone.new_sequence(text(64, "z"), 100, 0.0)
    run(alone, [(0.0, one)])
    crowded = Engine(cfg)
    many = [crowded.new_sequence(text(64, f"{i:04d}"), 100, 0.0) for i in range(64)]
    run(crowded, [(0.0, s) for s in many])
    assert one.finished_at is not None and many[0].finished_at is not None
    decode_one = one.finished_at - one.first_token_at  # type: ignore[operator]
    decode_many = many[0].finished_at - many[0].first_token_at  # type: ignore[operator]
    assert decode_many > decode_one * 1.4
    per_step = cfg.step_base_s + cfg.decode_per_seq_s * 64
    assert decode_many >= 99 * per_step


def test_at_most_max_num_seqs_run_the_rest_wait_in_order() -> None:
    e = Engine(EngineConfig(max_num_seqs=2, max_num_batched_tokens=64))
    seqs = [e.new_sequence(text(10, str(i)), 5, 0.0) for i in range(5)]
    for s in seqs:
        e.add(s)
    step = e.schedule(0.0)
    assert step is not None and len(e.running) == 2 and len(e.waiting) == 3
    assert [s.id for s in e.running] == [seqs[0].id, seqs[1].id]
    e.finish(step, step.duration)
    run(e, [])
    finished = sorted(seqs, key=lambda s: s.finished_at)  # type: ignore[arg-type, return-value]
    assert [s.id for s in finished[:2]] == [seqs[0].id, seqs[1].id]


def test_a_full_kv_cache_makes_requests_wait() -> None:
    e = Engine(EngineConfig(num_blocks=10, block_size=16))
    big = e.new_sequence(text(120), 20, 0.0)  # 140 tokens: 9 blocks
    small = e.new_sequence(text(20, "q"), 5, 0.0)  # 2 blocks: must wait for big
    e.add(big)
    e.add(small)
    e.schedule(0.0)
    assert e.running == [big] and list(e.waiting) == [small]
    run(e, [])
    assert small.first_token_at is not None and big.finished_at is not None
    assert small.first_token_at > big.finished_at


def test_long_prompts_prefill_in_chunks() -> None:
    cfg = EngineConfig(max_num_batched_tokens=1000)
    e = Engine(cfg)
    s = e.new_sequence(text(3500), 1, 0.0)
    run(e, [(0.0, s)])
    assert e.steps == 4  # 1000 + 1000 + 1000 + 500
    assert ttft(s) == pytest.approx(4 * cfg.step_base_s + 3500 / cfg.prefill_tokens_per_s)


def test_abort_frees_blocks_and_slowdown_stretches_time() -> None:
    e = Engine(EngineConfig(num_blocks=50))
    s = e.new_sequence(text(300), 100, 0.0)
    e.add(s)
    step = e.schedule(0.0)
    assert step is not None
    assert e.cache.used_blocks == 25 and e.fragmentation() == 0  # 400 slots reserved, none written yet
    e.finish(step, 1.0)
    # the 300-token prompt (and its first token) fill 19 blocks of 16 with 3 slots to spare; the
    # reply's reserved blocks are not waste
    assert s.context_tokens == 301 and e.fragmentation() == pytest.approx(3 / (25 * 16))
    e.abort(s)
    assert e.cache.used_blocks == 0 and not e.has_work() and s.aborted
    slow = Engine(EngineConfig())
    slow.slowdown = 3.0
    t = slow.new_sequence(text(300), 1, 0.0)
    run(slow, [(0.0, t)])
    assert ttft(t) == pytest.approx(3 * (0.010 + 300 / 15000))


def test_impossible_requests_are_refused_up_front() -> None:
    e = Engine(EngineConfig(max_model_len=1000, num_blocks=1000))
    with pytest.raises(RequestTooLarge, match="maximum context length is 1000"):
        e.new_sequence(text(990), 20, 0.0)
    small = Engine(EngineConfig(num_blocks=4, block_size=16))
    with pytest.raises(RequestTooLarge, match="KV cache"):
        small.new_sequence(text(60), 10, 0.0)
    with pytest.raises(RequestTooLarge):
        e.new_sequence(b"", 5, 0.0)


@pytest.mark.parametrize("field", ["block_size", "num_blocks", "max_num_seqs", "prefill_tokens_per_s"])
def test_config_is_validated(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: 0})


def test_prefill_chunks_are_cached_as_they_are_computed() -> None:
    cfg = EngineConfig(max_num_batched_tokens=1024)
    e = Engine(cfg)
    doc = text(4096, "d")
    a = e.new_sequence(doc + b"question A", 1, 0.0)
    e.add(a)
    step = e.schedule(0.0)
    assert step is not None
    e.finish(step, step.duration)  # A has computed its first 1024 tokens
    b = e.new_sequence(doc + b"question B", 1, step.duration)
    e.add(b)
    run(e, [])
    assert b.cached_tokens >= 1024  # B hits the chunks A had finished when B arrived


def test_the_last_generated_token_is_not_cached() -> None:
    e = Engine(EngineConfig(block_size=4))
    first = e.new_sequence(b"abcd" * 8, 4, 0.0)  # 8 prompt tokens + 4 generated
    run(e, [(0.0, first)])
    reply = generated_text(e.reply_seed(first), 0, 4).encode()
    nxt = e.new_sequence(b"abcd" * 8 + reply + b"more" * 4, 1, 0.0)
    run(e, [(0.0, nxt)])
    assert nxt.cached_tokens == (8 + 4 - 1) // 4 * 4  # 2 prompt blocks + 0 of the reply's: 8, not 12


def test_a_request_never_joins_a_step_that_began_before_it_arrived() -> None:
    cfg = EngineConfig()
    e = Engine(cfg)
    busy = e.new_sequence(text(100, "b"), 50, 0.0)
    e.add(busy)
    step = e.schedule(0.0)
    assert step is not None
    late = e.new_sequence(text(100, "l"), 1, 0.005)  # arrives during the step
    e.add(late)
    assert e.schedule(0.0) is not None and late not in e.running  # the step that began at 0 keeps it out
    e.finish(step, step.duration)
    run(e, [])
    assert late.first_token_at is not None and late.first_token_at - late.arrival >= cfg.step_base_s


def test_adapters_take_gpu_slots_and_a_load_costs_the_first_step() -> None:
    cfg = EngineConfig(max_loras=1, lora_load_s=0.05)
    e = Engine(cfg)
    sql = [e.new_sequence(text(100, f"s{i}"), 20, 0.0) for i in range(2)]
    chat = e.new_sequence(text(100, "c"), 5, 0.0)
    plain = e.new_sequence(text(100, "p"), 5, 0.0)
    for seq in sql:
        seq.adapter = "sql"
    chat.adapter = "chat"
    run(e, [(0.0, sql[0]), (0.0, chat), (0.0, sql[1]), (0.0, plain)])
    # one adapter a batch: chat waited for both sql requests; the base model's request did not
    assert chat.first_token_at is not None and sql[1].finished_at is not None
    assert chat.first_token_at > sql[1].finished_at
    assert plain.first_token_at == sql[0].first_token_at == sql[1].first_token_at
    # loading sql into its slot cost the first step 50 ms; chat's load evicted it
    assert ttft(sql[0]) == pytest.approx(cfg.step_base_s + 300 / cfg.prefill_tokens_per_s + 0.05)
    assert list(e.adapters) == ["chat"]
    again = e.new_sequence(text(100, "c2"), 1, 0.0)
    again.adapter = "chat"
    run(e, [(0.0, again)])
    assert ttft(again) == pytest.approx(cfg.step_base_s + 100 / cfg.prefill_tokens_per_s)  # loaded already
