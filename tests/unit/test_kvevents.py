"""The engines' KV-cache events: the wire, what a replica holds by them, the router's token keys, the fleet's truth."""

from __future__ import annotations

import contextlib
import math
from array import array
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.config import ReplicaSpec
from router.fleet import Fleet
from router.kvevents.holdings import DUPLICATE, GAP, OK, RESTART, Holdings
from router.kvevents.tokens import (
    EngineTokens,
    Tokenizer,
    TokenizerError,
    TokenStore,
    extend_chain,
    request_chain,
    root_of,
    token_chain,
)
from router.kvevents.truth import Truth
from router.kvevents.wire import Batch, Cleared, Removed, Stored, WireError, decode, engine_name, frames_of
from router.placement.events import Layout, events_rows
from router.prefix import PrefixIndex
from router.prompt import Prompt
from router.ring import xxh3_64

BS = 4


def tagged_stored(hashes, parent, tokens, lora=None, extra=None, medium="GPU"):  # type: ignore[no-untyped-def]
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None if lora is None else 1,
        "medium": medium,
        "lora_name": lora,
        "extra_keys": extra if extra is not None else [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


TS = 1796301048.5


def payload(*events: object, rank: int = 0, ts: float = TS) -> bytes:
    return msgpack.packb([ts, list(events), rank])


def batch(seq: int, *events: object, ts: float = TS) -> Batch:
    return decode(seq, payload(*events, ts=ts))


TOKENS = list(range(100, 124))  # six blocks of four


# -- the wire ---------------------------------------------------------------------------------------


def test_a_tagged_batch_as_vllm_032_sends_it() -> None:
    # as recorded from vLLM 0.32: a LoRA request with a cache_salt
    extra = [["lora-0", "abc"], ["lora-0"]]
    frames = [b"kv-events", (7).to_bytes(8, "big"), payload(tagged_stored([11, 12], None, TOKENS[:8], "lora-0", extra))]
    got = frames_of(frames)
    assert (got.seq, got.rank) == (7, 0)
    (e,) = got.events
    assert isinstance(e, Stored)
    assert list(e.hashes) == [11, 12] and e.parent is None and list(e.token_ids) == TOKENS[:8]
    assert (e.block_size, e.medium, e.lora_name, e.salt) == (BS, "GPU", "lora-0", "abc")
    removed = batch(8, {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU", "group_idx": 0})
    assert removed.events == (Removed(array("Q", [11]), "GPU"),)
    assert batch(9, {"type": "AllBlocksCleared"}).events == (Cleared(),)


def test_the_positional_encoding_of_older_vllm() -> None:
    b = batch(
        3,
        ["BlockStored", [b"\x01" * 32], None, TOKENS[:4], BS, None, "CPU"],
        ["BlockStored", [5], b"\x01" * 32, TOKENS[4:8], BS, None],  # before `medium`: the GPU
        ["BlockRemoved", [5], "GPU"],
        ["AllBlocksCleared"],
    )
    first, second, removed, cleared = b.events
    assert isinstance(first, Stored) and first.medium == "CPU" and list(first.hashes) == [engine_name(b"\x01" * 32)]
    assert isinstance(second, Stored) and second.medium == "GPU" and second.parent == engine_name(b"\x01" * 32)
    assert removed == Removed(array("Q", [5]), "GPU") and cleared == Cleared()


def test_an_engines_block_hash_is_read_as_a_64_bit_name() -> None:
    assert [engine_name(h) for h in (0, 7, 2**64 - 1)] == [0, 7, 2**64 - 1]  # vLLM's ints as they are
    assert engine_name(-1) == 2**64 - 1 and engine_name(-(2**63)) == 2**63  # signed 64-bit: two's complement
    names = {engine_name(h) for h in (b"\x01" * 32, b"\x02" * 32, 2**64, -(2**63) - 1, b"")}
    assert len(names) == 5 and all(0 <= x < 2**64 for x in names)
    assert engine_name(b"\x01" * 32) == engine_name(b"\x01" * 32)
    with pytest.raises(WireError, match="a block hash is a bool"):
        batch(0, tagged_stored([1, True], None, TOKENS[:8]))
    with pytest.raises(WireError, match="a block hash is a str"):
        batch(0, {"type": "BlockRemoved", "block_hashes": ["x"]})


def test_bytes_hashes_store_and_remove_alike() -> None:
    # vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 sends its 32-byte hashes
    h = holdings()
    a, b = b"\xaa" * 32, b"\xbb" * 32
    h.accept(batch(0, tagged_stored([a], None, TOKENS[:4])))
    h.accept(batch(1, tagged_stored([b], a, TOKENS[4:8])))
    assert h.match(chain_of(TOKENS[:8])) == 2
    h.accept(batch(2, {"type": "BlockRemoved", "block_hashes": [b], "medium": "GPU"}))
    assert h.match(chain_of(TOKENS[:8])) == 1 and h.figures.removed == 1


def test_a_salt_without_an_adapter() -> None:
    (e,) = batch(0, tagged_stored([1], None, TOKENS[:4], extra=[["salty"]])).events
    assert isinstance(e, Stored) and e.salt == "salty" and e.lora_name is None


@pytest.mark.parametrize(
    ("frames", "says"),
    [
        ([b"t", b"\x00" * 7, payload()], "8"),
        ([b"t"], "frames"),
        ([b"t", b"\x00" * 8, b"\xc1"], "msgpack"),
        ([b"t", b"\x00" * 8, msgpack.packb({"a": 1})], "payload"),
        ([b"t", b"\x00" * 8, payload({"type": "Mystery"})], "Mystery"),
        ([b"t", b"\x00" * 8, payload(tagged_stored([1, 2], None, TOKENS[:5]))], "token ids"),
        ([b"t", b"\x00" * 8, payload(tagged_stored([1.5], None, TOKENS[:4]))], "hash"),
        ([b"t", b"\x00" * 8, payload(["BlockStored", [1]])], "fields"),
        ([b"t", b"\x00" * 8, payload(7)], "event"),
    ],
)
def test_bad_messages_are_named_not_crashed_on(frames: list[bytes], says: str) -> None:
    with pytest.raises(WireError, match=says):
        frames_of(frames)


@given(st.binary(max_size=64))
def test_any_payload_decodes_or_is_a_wire_error(data: bytes) -> None:
    with contextlib.suppress(WireError):  # anything else fails the test
        decode(0, data)


# -- the router's token keys ------------------------------------------------------------------------


def test_token_keys_chain_from_the_adapter_and_salt() -> None:
    root = root_of(None, None)
    chain = token_chain(TOKENS[:10], BS, root)  # two whole blocks; the rest is no block
    assert len(chain) == 2
    k0 = xxh3_64(array("Q", TOKENS[:4]).tobytes(), root)
    assert chain[0] == k0 and chain[1] == xxh3_64(array("Q", TOKENS[4:8]).tobytes(), k0)
    assert token_chain(TOKENS[:8], BS, root_of("lora-0", None))[0] != k0
    assert token_chain(TOKENS[:8], BS, root_of(None, "salt"))[0] != k0
    assert root_of("a", "b") != root_of("ab", None) != root_of(None, "ab")


def test_a_request_never_counts_its_last_token() -> None:
    # 8 tokens in blocks of 4: an engine computes the last token anyway, so one block at most is a hit
    assert len(request_chain(TOKENS[:8], BS, 0)) == 1
    assert len(request_chain(TOKENS[:9], BS, 0)) == 2
    tokens = EngineTokens(9, tuple(TOKENS[:9]), None, None, "render")
    assert tokens.chain(BS) == request_chain(TOKENS[:9], BS, root_of(None, None))


# -- what one replica holds ---------------------------------------------------------------------------


def holdings(capacity: int = 100) -> Holdings:
    return Holdings(PrefixIndex(), capacity)


def chain_of(tokens: list[int], lora: str | None = None, salt: str | None = None) -> array[int]:
    return token_chain(tokens, BS, root_of(lora, salt))


def test_stored_blocks_are_found_by_a_request_in_the_same_tokens() -> None:
    h = holdings()
    assert h.unsure  # nothing is known before the first message
    assert h.accept(batch(0, tagged_stored([1, 2, 3], None, TOKENS[:12]))) == OK
    assert h.sure and h.block_size == BS
    # a later turn: its parent is the engine's hash of block 3
    assert h.accept(batch(1, tagged_stored([4], 3, TOKENS[12:16]))) == OK
    request = EngineTokens(21, tuple(TOKENS[:21]), None, None, "render")
    assert h.match(request.chain(BS)) == 4
    # another adapter's request in the same tokens holds nothing here
    assert h.match(EngineTokens(21, tuple(TOKENS[:21]), "lora-0", None, "render").chain(BS)) == 0
    # vLLM frees a request's blocks tail first, and evicts the least recently freed: leaves go first
    h.accept(batch(2, {"type": "BlockRemoved", "block_hashes": [4], "medium": "GPU"}))
    h.accept(batch(3, {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}))
    assert h.match(request.chain(BS)) == 2
    h.accept(batch(4, {"type": "AllBlocksCleared"}))
    assert h.match(request.chain(BS)) == 0 and h.blocks() == 0


def test_adapters_and_salts_as_the_engine_keeps_them() -> None:
    h = holdings()
    extra = [["lora-0", "s"], ["lora-0"]]
    h.accept(batch(0, tagged_stored([1, 2], None, TOKENS[:8], "lora-0", extra)))
    assert h.match(chain_of(TOKENS[:8], "lora-0", "s")) == 2
    assert h.match(chain_of(TOKENS[:8], "lora-0")) == 0 and h.match(chain_of(TOKENS[:8])) == 0


def test_a_block_whose_parent_was_never_seen_is_counted_not_guessed() -> None:
    h = holdings()
    h.accept(batch(0, tagged_stored([9], 1234, TOKENS[4:8])))
    assert h.figures.orphans == 1 and h.blocks() == 0


def test_sequence_numbers_decide_what_is_believed() -> None:
    h = holdings()
    assert h.accept(batch(0, tagged_stored([1], None, TOKENS[:4]))) == OK
    assert h.accept(batch(0, tagged_stored([1], None, TOKENS[:4]))) == RESTART  # a live publisher never repeats 0
    assert h.figures.restarts == 1 and h.blocks() == 1
    assert h.accept(batch(1, tagged_stored([2], 1, TOKENS[4:8]))) == OK
    missed = batch(2, tagged_stored([3], 2, TOKENS[8:12]))
    later = batch(3, tagged_stored([4], 3, TOKENS[12:16]))
    assert h.accept(later) == GAP and h.seq == 1  # nothing applied past the gap
    assert h.replayed([missed, later], 2) and h.sure and h.seq == 3
    assert h.match(chain_of(TOKENS[:16])) == 4 and h.figures.replayed == 2
    # a number seen before on the live stream, sent later: the engine restarted and its first messages were lost
    assert h.accept(batch(2, tagged_stored([9], None, TOKENS[:4]), ts=TS + 60)) == GAP
    assert h.figures.restarts == 2 and h.blocks() == 0 and h.seq is None


def test_live_copies_of_what_a_replay_applied_are_skipped_not_taken_for_a_restart() -> None:
    # a router joins a busy engine: it subscribes, asks the replay socket for everything, and meanwhile
    # the same messages queue in its subscriber socket; they arrive after the replay, already applied
    h = holdings()
    sent = [
        batch(0, tagged_stored([1], None, TOKENS[:4]), ts=TS),
        batch(1, tagged_stored([2], 1, TOKENS[4:8]), ts=TS + 0.05),
        batch(2, tagged_stored([3], 2, TOKENS[8:12]), ts=TS + 0.10),
    ]
    assert h.accept(sent[1]) == GAP
    assert h.replayed(sent, 0) and h.sure and h.seq == 2
    assert [h.accept(b) for b in sent[1:]] == [DUPLICATE, DUPLICATE]
    assert h.figures.restarts == 0 and h.figures.duplicates == 2 and h.match(chain_of(TOKENS[:12])) == 3
    assert h.accept(batch(3, tagged_stored([4], 3, TOKENS[12:16]), ts=TS + 0.15)) == OK and h.seq == 3
    # past the replay a repeated number is a restart again, whatever its timestamp
    assert h.accept(batch(1, tagged_stored([9], None, TOKENS[:4]), ts=TS + 0.05)) == GAP
    assert h.figures.restarts == 1 and h.blocks() == 0


def test_a_restart_right_after_a_replay_is_still_a_restart() -> None:
    h = holdings()
    sent = [batch(0, tagged_stored([1], None, TOKENS[:4]), ts=TS), batch(1, tagged_stored([2], 1, TOKENS[4:8]))]
    assert h.replayed(sent, 0) and h.seq == 1
    # the engine started again: its message 0 is a new one (a later timestamp), not the replayed 0
    assert h.accept(batch(0, tagged_stored([7], None, TOKENS[8:12]), ts=TS + 30)) == RESTART
    assert h.figures.restarts == 1 and h.figures.duplicates == 0 and h.blocks() == 1


def test_a_gap_replay_cannot_fill_leaves_it_unsure_until_the_cache_turned_over() -> None:
    h = holdings(capacity=5)
    h.accept(batch(0, tagged_stored([1], None, TOKENS[:4])))
    b = batch(9, tagged_stored([11], None, TOKENS[4:8]))
    assert h.accept(b) == GAP
    assert not h.replayed([batch(7, tagged_stored([10], None, TOKENS[8:12])), b], 1)  # replay starts at 7
    assert h.unsure and h.seq == 9 and h.figures.unsure_episodes == 1
    h.force(batch(10, tagged_stored([12, 13], None, TOKENS[:8])))
    assert h.unsure  # 4 blocks stored since, of 5
    h.accept(batch(11, tagged_stored([14], None, TOKENS[12:16])))
    assert h.sure  # the cache has turned over once: what it holds now, it was told


def test_a_first_message_past_zero_is_a_late_join() -> None:
    h = holdings()
    assert h.accept(batch(5, tagged_stored([1], None, TOKENS[:4]))) == GAP
    assert h.replayed([batch(i, tagged_stored([i + 10], None, TOKENS[:4])) for i in range(6)], 0)
    assert h.sure and h.seq == 5


def test_an_empty_replay_means_nothing_was_published_yet() -> None:
    h = holdings()
    h.caught_up()
    assert h.sure and h.seq is None
    assert h.accept(batch(0, tagged_stored([1], None, TOKENS[:4]))) == OK


def test_after_a_health_outage_the_next_message_tells() -> None:
    h = holdings()
    h.accept(batch(0, tagged_stored([1], None, TOKENS[:4])))
    h.suspect()
    assert not h.sure
    assert h.accept(batch(1, tagged_stored([2], 1, TOKENS[4:8]))) == OK and h.sure  # it only paused
    h.suspect()
    assert h.accept(batch(0, tagged_stored([7], None, TOKENS[8:12]))) == RESTART and h.sure  # it restarted
    assert h.match(chain_of(TOKENS[:8])) == 0 and h.blocks() == 1


def test_memory_is_bounded_by_the_engines_capacity() -> None:
    h = holdings(capacity=8)
    for seq in range(100):  # every removal missed
        tokens = [seq * 1000 + t for t in range(BS)]
        h.accept(batch(seq, tagged_stored([seq + 1], None, tokens)))
    assert h.blocks() <= 8
    assert [h.index.key_of(h.tiers["GPU"].holder, seq + 1) is not None for seq in range(100)] == [False] * 92 + [
        True
    ] * 8


def test_a_second_tier_is_held_apart() -> None:
    h = holdings()
    h.accept(batch(0, tagged_stored([1, 2], None, TOKENS[:8])))
    h.accept(batch(1, tagged_stored([3], 2, TOKENS[8:12], medium="CPU")))  # its parent is on the GPU
    assert h.match(chain_of(TOKENS[:12])) == 2
    assert h.match(chain_of(TOKENS[:12]), "CPU") == 0  # the CPU tier holds block 3, not blocks 1 and 2
    h.accept(batch(2, tagged_stored([1, 2], None, TOKENS[:8], medium="CPU")))
    assert h.match(chain_of(TOKENS[:12]), "CPU") == 3
    h.accept(batch(3, {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}))
    assert h.match(chain_of(TOKENS[:12])) == 1 and h.match(chain_of(TOKENS[:12]), "CPU") == 3


# -- the fleet's truth -------------------------------------------------------------------------------


def test_truth_answers_only_for_believed_replicas_and_prices_a_second_tier() -> None:
    truth = Truth(tier_tokens_per_s=40_000)
    tokens = EngineTokens(17, tuple(TOKENS[:17]), None, None, "render")
    assert truth.held("a", tokens, {}) is None  # it publishes nothing
    a = truth.holdings("a", 0, 100)
    assert truth.held("a", tokens, {}) is None  # nothing believed yet
    a.accept(batch(0, tagged_stored([1, 2], None, TOKENS[:8])))
    a.accept(batch(1, tagged_stored([1, 2, 3, 4], None, TOKENS[:16], medium="CPU")))
    found = truth.held("a", tokens, {})
    assert found is not None and (found.gpu_tokens, found.tier_tokens) == (8, 8)
    # at 10,000 tokens/s a token computed costs 1e-4 s, one loaded 2.5e-5 s: each saves three quarters
    assert truth.credit(found, 1e-4) == pytest.approx(8 + 8 * 0.75)
    assert truth.credit(found, 1e-5) == 8  # a tier slower than computing is worth nothing
    b0, b1 = truth.holdings("b", 0, 100), truth.holdings("b", 1, 100)
    b0.accept(batch(0, tagged_stored([1], None, TOKENS[:4])))
    b1.accept(batch(0, tagged_stored([1, 2, 3], None, TOKENS[:12])))
    found = truth.held("b", tokens, {})
    assert found is not None and found.gpu_tokens == 12  # the best rank's
    b1.suspect()
    assert truth.held("b", tokens, {}) is None and not truth.sure("b")
    truth.forget("b")
    assert truth.of("b") == [] and truth.index.n_holders == 4  # a's two tiers, and b's two ranks' freed numbers


def test_placement_reads_each_replica_as_the_truth_holds_it_in_one_pass_or_one_by_one() -> None:
    """`events_rows` reads most replicas in one pass (one believed rank on its GPU, the index's
    match) and the rest one by one: either way each replica's row is what `Truth.held` says, with
    the blocks of requests in flight there, a second tier, a rank not believed, a block size said
    only by its metrics, and a replica excluded or publishing nothing."""
    fleet = Fleet([ReplicaSpec(rid, f"http://10.0.0.{k}:1") for k, rid in enumerate("abcdefg")])
    truth = Truth(tier_tokens_per_s=40_000)
    for rid in "abcdef":
        truth.holdings(rid, 0, 100)
    for rid in "abcd":  # the system prompt's block, and for b and c more of the conversation
        truth.of(rid)[0].accept(batch(0, tagged_stored([1], None, TOKENS[:4])))  # type: ignore[union-attr]
    truth.of("b")[0].accept(batch(1, tagged_stored([2, 3], 1, TOKENS[4:12])))  # type: ignore[union-attr]
    truth.of("c")[0].accept(batch(1, tagged_stored([1, 2], None, TOKENS[:8], medium="CPU")))  # type: ignore[union-attr]
    truth.of("d")[0].suspect()  # type: ignore[union-attr]  # its health went down: not believed
    truth.of("e")[0].accept(batch(0))  # type: ignore[union-attr]  # believed, holding nothing: no block size said
    fleet.replicas[4].engine = replace(fleet.replicas[4].engine, block_size=BS)  # ... but its metrics say one
    first = EngineTokens(13, tuple(TOKENS[:13]), None, None, "tokenizer")
    second = EngineTokens(21, tuple(TOKENS[:21]), None, None, "tokenizer")
    truth.expect("a", first.chain(BS))  # the conversation's last turn, still in flight on a ...
    truth.of("a")[0].accept(batch(1, tagged_stored([2], 1, TOKENS[4:8])))  # type: ignore[union-attr]
    assert truth.ahead("a") == 0  # ... its first blocks shown: it evicts nothing more before the next
    excluded = array("B", [0, 0, 0, 0, 0, 0, 0])
    spt = array("d", [1e-4] * 7)
    prompt = Prompt(second.chain(BS), 84, 3, second)
    got = events_rows(fleet, truth, prompt, excluded, spt, array("d", [0.0] * 7), 0.0, 0.0, Layout())
    assert got is not None
    known, tier, _ = got
    for i, rid in enumerate("abcdefg"):
        held = truth.held(rid, second, {}, BS if rid == "e" else None)
        assert known[i] == (-1.0 if held is None else truth.credit(held, 1e-4)), rid
        assert tier[i] == (0 if held is None else held.tier_tokens), rid
    assert list(known) == [12.0, 12.0, 4.0 + 4 * 0.75, -1.0, 0.0, -1.0, -1.0]  # (f: no message yet)
    excluded[1] = 1
    known, _, _ = events_rows(fleet, truth, prompt, excluded, spt, array("d", [0.0] * 7), 0.0, 0.0)  # type: ignore[misc]
    assert known[1] == -1.0 and known[0] == 12.0


def test_a_layout_kept_across_requests_follows_what_each_replica_becomes() -> None:
    """A Layout judges once which replicas are read in the pass, and again whenever a rank's
    believed, block size or tiers change or a replica's health does: one kept across requests reads
    every row as `Truth.held` says it, however the replicas change between them."""
    rids = "abcd"
    fleet = Fleet([ReplicaSpec(rid, f"http://10.0.0.{k}:1") for k, rid in enumerate(rids)])
    truth = Truth(tier_tokens_per_s=40_000)
    ranks = {rid: truth.holdings(rid, 0, 100) for rid in rids}
    for rid in "abc":
        ranks[rid].accept(batch(0, tagged_stored([1], None, TOKENS[:4])))
    ranks["d"].accept(batch(0))  # believed, holding nothing: no block size said yet
    tokens = EngineTokens(13, tuple(TOKENS[:13]), None, None, "tokenizer")
    prompt = Prompt(tokens.chain(BS), 52, 3, tokens)
    layout = Layout()
    excluded = array("B", [0] * len(rids))

    def rows() -> list[float]:
        got = events_rows(
            fleet, truth, prompt, excluded, array("d", [1e-4] * 4), array("d", [0.0] * 4), 0.0, 0.0, layout
        )
        assert got is not None
        for i, rid in enumerate(rids):
            held = truth.held(rid, tokens, {})
            assert got[0][i] == (-1.0 if held is None else truth.credit(held, 1e-4)), rid
        return list(got[0])

    assert rows() == [4.0, 4.0, 4.0, 0.0] and len(layout.fast[0]) == 3 and len(layout.dynamic) == 1
    ranks["a"].suspect()  # its health went down: not believed until its next message
    assert rows() == [-1.0, 4.0, 4.0, 0.0]
    ranks["a"].accept(batch(1))  # the next number: nothing was missed
    assert rows()[0] == 4.0
    fleet.replicas[1].health.state = "removed"  # (excluded by the ring in routing; here, asked)
    assert rows()[1] == -1.0 and not ranks["b"].sure  # a removed replica is suspected
    fleet.replicas[1].health.state = "healthy"
    ranks["b"].accept(batch(1, tagged_stored([2], 1, TOKENS[4:8])))
    assert rows()[1] == 8.0
    ranks["c"].accept(batch(1, tagged_stored([1, 2, 3], None, TOKENS[:12], medium="CPU")))  # a second tier
    assert rows()[2] == 4.0 + 8 * 0.75 and layout.slow == [2]
    ranks["d"].accept(batch(1, tagged_stored([1], None, TOKENS[:4])))  # its events say a block size
    assert rows()[3] == 4.0 and len(layout.fast[0]) == 3 and not layout.dynamic


def test_the_blocks_of_requests_in_flight_are_held_when_the_next_one_runs() -> None:
    """A turn still prefilling has stored nothing yet; the next turn of its conversation, sent now,
    runs after it there and finds its blocks: the truth expects them there until it ends."""
    truth = Truth()
    a = truth.holdings("a", 0, 100)
    a.accept(batch(0, tagged_stored([1], None, TOKENS[:4])))  # the system prompt's block
    first = EngineTokens(13, tuple(TOKENS[:13]), None, None, "tokenizer")
    second = EngineTokens(21, tuple(TOKENS[:21]), None, None, "tokenizer")
    assert truth.block_size("a") == BS and truth.held("a", second, {}).gpu_tokens == 4  # type: ignore[union-attr]
    truth.expect("a", first.chain(BS))
    truth.expect("a", first.chain(BS))  # a retry of it, or another reader of the same prompt
    assert truth.held("a", second, {}).gpu_tokens == 12  # type: ignore[union-attr]  # held, then coming
    truth.unexpect("a", first.chain(BS))
    assert truth.held("a", second, {}).gpu_tokens == 12  # type: ignore[union-attr]  # the other is still running
    truth.unexpect("a", first.chain(BS))
    assert truth.held("a", second, {}).gpu_tokens == 4 and "a" not in truth.coming  # type: ignore[union-attr]
    truth.expect("b", first.chain(BS))
    assert truth.held("b", second, {}) is None  # a replica that publishes nothing is priced by the model
    truth.forget("a")
    assert "a" not in truth.coming


def test_what_the_requests_sent_ahead_allocate_first_is_not_counted_held() -> None:
    """The misses on real vLLM were blocks evicted between the decision and the scheduling: a
    request priced now finds what the requests sent there before it leave of its prefix, until
    their own new blocks show in the events (their evictions come in the same message)."""
    truth = Truth()
    a = truth.holdings("a", 0, 8)  # a KV cache of eight blocks
    x = list(range(100, 112))  # a conversation's three blocks
    a.accept(batch(0, tagged_stored([1, 2, 3], None, x)))
    a.accept(batch(1, tagged_stored([4, 5, 6, 7], None, list(range(200, 216)))))  # four younger blocks
    turn = EngineTokens(14, (*x, 7, 8), None, None, "tokenizer")  # its next turn

    def held() -> int:
        found = truth.held("a", turn, {})
        assert found is not None
        return found.gpu_tokens

    assert held() == 12
    other = EngineTokens(13, tuple(range(300, 313)), None, None, "tokenizer")
    truth.expect("a", other.chain(BS), 3)  # sent before it: three new blocks when it runs
    # one empty block; two of the three allocated evict the two oldest: the conversation's tail first
    assert truth.ahead("a") == 3 and held() == 4
    assert truth.cut["a"] == 1
    # it evicts now (no empty block): all three evict, the whole conversation
    a.accept(batch(2, {"type": "BlockRemoved", "block_hashes": [6], "medium": "GPU"}))
    assert held() == 0
    # the conversation's last turn ends after the younger blocks were stored: its blocks are freed
    # last, the youngest; what is allocated takes the younger ones' instead
    last = EngineTokens(13, (*x, 7), None, None, "tokenizer")
    truth.expect("a", last.chain(BS))
    truth.unexpect("a", last.chain(BS))
    assert held() == 12
    # the request sent ahead runs: its blocks show (and with them what it evicted): nothing is ahead
    a.accept(batch(3, {"type": "BlockRemoved", "block_hashes": [1, 2, 3], "medium": "GPU"}))
    assert held() == 0 and truth.ahead("a") == 3  # (an eviction says nothing of who caused it)
    a.accept(batch(4, tagged_stored([9, 10, 11], None, list(range(300, 312)))))
    assert truth.ahead("a") == 0 and "a" not in truth.queued
    truth.unexpect("a", other.chain(BS))
    assert truth.figures("a")["evictions_predicted"] == 2  # type: ignore[index]


def test_a_conversation_that_ended_a_turn_is_kept_once_at_its_latest() -> None:
    """`ended` keeps one record a conversation: its next turn replaces its last (whose blocks are a
    prefix of it); an earlier one told late does not; at most RETURNING_MAX a replica, the newest."""
    from router.kvevents.truth import RETURNING_MAX  # noqa: PLC0415

    truth = Truth()
    first = EngineTokens(9, tuple(range(100, 109)), None, None, "tokenizer").chain(BS)  # two blocks
    second = EngineTokens(13, tuple(range(100, 113)), None, None, "tokenizer").chain(BS)  # three
    truth.ended("a", first, 1.0)
    truth.ended("a", second, 2.0)
    assert [(list(r.keys), r.at) for r in truth.returning["a"]] == [(list(second), 2.0)]
    truth.ended("a", first, 3.0)  # (an earlier turn told late: the later one stands)
    assert [r.at for r in truth.returning["a"]] == [2.0]
    for k in range(RETURNING_MAX + 2):
        truth.ended("a", EngineTokens(5, (k, k, k, k, k), None, None, "tokenizer").chain(BS), 4.0 + k)
    kept = truth.returning["a"]
    assert len(kept) == RETURNING_MAX and kept[0].at == 6.0 and kept[-1].at == 5.0 + RETURNING_MAX
    truth.ended("a", array("Q"), 99.0)  # a prompt shorter than a block leaves nothing to come back for
    assert len(truth.returning["a"]) == RETURNING_MAX and truth.evicts("b", first, 5, 99.0) == 0.0
    truth.forget("a")
    assert "a" not in truth.returning


def test_what_a_request_evicts_of_a_conversation_about_to_return_weighs_less_where_the_cache_turns_over() -> None:
    """A cache of nine blocks holding eight, its oldest a conversation that ended a turn (it may come
    back). A request allocating three blocks evicts two of the conversation's three, all of a loss
    while the cache is not seen turning over; once it evicts a block a second, those two blocks would be
    gone 2 s later anyway, and a conversation comes back that soon with 1 - exp(-2 / RETURN_S)."""
    from router.kvevents.truth import RETURN_S, TOOLS_BACK_S  # noqa: PLC0415

    clock = [0.0]
    truth = Truth(clock=lambda: clock[0])
    a = truth.holdings("a", 0, 9)
    x = list(range(100, 112))
    a.accept(batch(0, tagged_stored([1, 2, 3], None, x)))
    a.accept(batch(1, tagged_stored([4, 5, 6, 7, 8], None, list(range(200, 220)))))  # one block left empty
    conversation = EngineTokens(13, (*x, 7), None, None, "tokenizer").chain(BS)
    other = EngineTokens(9, tuple(range(500, 509)), None, None, "tokenizer").chain(BS)
    truth.ended("a", conversation, 0.0)
    assert truth.evicts("a", other, 1, 0.0) == 0.0  # it fits the empty block: nothing is evicted for it ...
    assert truth.evicts("a", other, 3, 0.0) == 2.0  # ... or the conversation's tail goes (no rate yet)
    assert truth.evicts("a", conversation, 3, 0.0) == 0.0  # its own next turn pins what it shares
    clock[0] = 9.5
    a.accept(batch(2, {"type": "BlockRemoved", "block_hashes": [4, 5, 6, 7, 8], "medium": "GPU"}))
    a.accept(batch(3, tagged_stored([9, 10, 11, 12, 13], None, list(range(300, 320)))))
    got = truth.evicts("a", other, 2, 10.0)  # 5 blocks evicted in the 5 s to 10 s; evicting now: no empty block
    assert got == pytest.approx(2 * math.exp(-10 / RETURN_S) * -math.expm1(-2 / RETURN_S))
    assert truth.figures("a")["evictions_priced"] == 2  # type: ignore[index]
    # its answer called tools: it comes back within seconds (TOOLS_BACK_S), so the same push weighs
    # what is left of it 10 s on, and that it is back well before the cache's turnover reaches it
    truth.tools("a", conversation)
    assert truth.figures("a")["returning_from_tools"] == 1  # type: ignore[index]
    got_tools = truth.evicts("a", other, 2, 10.0)
    assert got_tools == pytest.approx(2 * math.exp(-10 / TOOLS_BACK_S) * -math.expm1(-2 / TOOLS_BACK_S))
    truth.tools("a", other)  # (a turn it never kept: nothing changes)
    assert [r.back_s for r in truth.returning["a"]] == [TOOLS_BACK_S]


def test_an_eviction_rate_is_the_same_whoever_reads_it_when() -> None:
    """The rate over whole windows of RATE_S fixed on the clock: read often or rarely, it says the
    same at the same time (a read that moved its window would make /admin/route's explanations,
    which read every replica, change later decisions)."""
    from router.kvevents.holdings import RATE_S, Rate  # noqa: PLC0415

    often, rarely = Rate(), Rate()
    removals = [(0.4, 3), (1.0, 2), (4.9, 5), (5.0, 1), (7.5, 4), (16.0, 2)]
    t = 0.0
    for at, n in removals:
        while t < at:
            often.at(t)
            t += 0.1
        often.add(at, n)
        rarely.add(at, n)
    times = (4.0, 5.0, 9.9, 10.0, 14.0, 16.0, 19.9, 20.0, 25.0)
    assert [often.at(x) for x in times] == [rarely.at(x) for x in times]
    # windows [0, 5), [5, 10), [10, 15), [15, 20): 10, 5, 0 and 2 blocks; each read after its window
    assert [rarely.at(x) for x in (16.0, 19.9, 20.0, 25.0)] == [0.0, 0.0, 2 / RATE_S, 0.0]
    early = Rate()
    for at, n in removals[:4]:
        early.add(at, n)
    assert [early.at(x) for x in (5.0, 9.9, 10.0, 15.0)] == [10 / RATE_S, 10 / RATE_S, 1 / RATE_S, 0.0]


def test_a_tool_loop_that_just_paused_weighs_more_than_a_chat_and_less_once_it_is_late() -> None:
    """Two conversations alike but for how their answers ended: one called tools. Pushed out at
    once, the tool loop's blocks weigh more (it is back within seconds, before the turnover would
    have taken them); a minute on, less (a tool loop that has not come back has most likely ended)."""
    clock = [0.0]
    truth = Truth(clock=lambda: clock[0])
    a = truth.holdings("a", 0, 9)
    x = list(range(100, 112))
    a.accept(batch(0, tagged_stored([1, 2, 3], None, x)))
    a.accept(batch(1, tagged_stored([4, 5, 6, 7, 8], None, list(range(200, 220)))))
    assert a.eviction_rate(0.0) == 0.0  # (nothing evicted yet)
    clock[0] = 9.5
    a.accept(batch(2, {"type": "BlockRemoved", "block_hashes": [4, 5, 6, 7, 8], "medium": "GPU"}))
    a.accept(batch(3, tagged_stored([9, 10, 11, 12, 13], None, list(range(300, 320)))))
    assert a.eviction_rate(10.0) == 1.0  # the cache turns over: two blocks' worth in 2 s
    conversation = EngineTokens(13, (*x, 7), None, None, "tokenizer").chain(BS)
    other = EngineTokens(9, tuple(range(500, 509)), None, None, "tokenizer").chain(BS)

    def price(tools: bool, age: float) -> float:
        truth.returning.clear()
        truth._room.clear()
        truth.ended("a", conversation, 10.0 - age)
        if tools:
            truth.tools("a", conversation)
        return truth.evicts("a", other, 2, 10.0)

    assert price(True, 0.0) > 2 * price(False, 0.0) > 0
    assert 0 < price(True, 25.0) < price(False, 25.0)


# -- the model's own tokenizer ------------------------------------------------------------------------


def test_a_folder_without_a_tokenizer_is_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer(tmp_path)


def small_model(folder: Path) -> Path:
    """A model folder as the engines read it: a byte-level BPE trained here, and a chat template."""
    from tokenizers import Tokenizer as HfTokenizer  # noqa: PLC0415
    from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tok = HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False)
    tok.train_from_iterator(["the fox jumps over the lazy dog and the weather is fine " * 20], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    (folder / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}\n"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    return folder


def test_a_conversations_earlier_turns_are_not_tokenized_again(tmp_path: Path) -> None:
    tokenizer = Tokenizer(small_model(tmp_path))
    messages = [{"role": "system", "content": "the fox " * 50}, {"role": "user", "content": "the dog?"}]
    first = tokenizer.chat(messages)
    whole = tokenizer.encode(tokenizer.render(messages))
    assert list(first) == whole and first[0] == tokenizer.tokenizer.token_to_id("<s>")
    messages += [{"role": "assistant", "content": "the weather is fine"}, {"role": "user", "content": "and the fox?"}]
    before = tokenizer.tokenized
    second = tokenizer.chat(messages)
    tokenized = tokenizer.tokenized - before
    rendered = tokenizer.render(messages)
    assert list(second) == tokenizer.encode(rendered)  # the same ids as tokenizing it whole ...
    assert tokenized < len(rendered) // 4  # ... from the new turns' text alone


def test_a_turn_renders_its_template_once_and_a_changed_history_is_tokenized_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = Tokenizer(small_model(tmp_path))
    renders = []
    render = tokenizer.render
    monkeypatch.setattr(tokenizer, "render", lambda *a, **k: renders.append(1) or render(*a, **k))
    messages = [{"role": "system", "content": "the fox " * 50}, {"role": "user", "content": "the dog?"}]
    tokenizer.chat(messages)
    messages += [{"role": "assistant", "content": "the weather"}, {"role": "user", "content": "and the fox?"}]
    tokenizer.chat(messages)
    assert len(renders) == 2  # once a turn
    # a template that renders the last message otherwise: the kept turn's text is no prefix of the
    # next one's, though its messages are; the text's hash says so, and the turn is tokenized whole
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% if loop.last %}!{% endif %}"
        "{{ '<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    marked = Tokenizer(tmp_path)
    marked.chat(messages[:2])
    before = marked.tokenized
    ids = marked.chat(messages)
    assert marked.tokenized - before == len(marked.render(messages))
    assert list(ids) == marked.encode(marked.render(messages))


@given(
    st.lists(st.integers(0, 2**32), max_size=60),
    st.lists(st.integers(0, 2**32), max_size=60),
    st.integers(1, 8),
    st.sampled_from([None, "lora-0"]),
)
def test_a_longer_prompts_chain_extends_its_beginnings(
    head: list[int], more: list[int], block_size: int, lora: str | None
) -> None:
    seed = root_of(lora, None)
    ids = (*head, *more)
    before = request_chain(head, block_size, seed)
    # the same keys as hashing it whole, whatever the lengths (a head shorter than a block, the
    # new ids ending inside the head's last block, nothing new)
    assert extend_chain(before, ids, block_size, seed) == request_chain(ids, block_size, seed)


def test_a_conversations_next_turn_hashes_only_its_new_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import router.kvevents.tokens as tokens  # noqa: PLC0415

    tokenizer = Tokenizer(small_model(tmp_path))
    messages = [{"role": "system", "content": "the fox " * 80}, {"role": "user", "content": "the dog?"}]
    first = EngineTokens.of_turn(tokenizer.turn(messages), None, None)
    assert first.chain(BS) == request_chain(first.ids, BS, root_of(None, None))
    hashed: list[int] = []
    chain = tokens.token_chain
    monkeypatch.setattr(tokens, "token_chain", lambda ids, *a: hashed.append(len(ids)) or chain(ids, *a))
    messages += [{"role": "assistant", "content": "the weather is fine"}, {"role": "user", "content": "and?"}]
    second = EngineTokens.of_turn(tokenizer.turn(messages), None, None)
    made = second.chain(BS)
    assert 0 < sum(hashed) < len(second.ids) - len(first.ids) + 2 * BS  # the new turn's ids hashed ...
    assert made == request_chain(second.ids, BS, root_of(None, None))  # ... the same keys as hashing it whole
    # another adapter's chain of the same messages is its own, not the kept one's
    other = EngineTokens.of_turn(tokenizer.turn(messages), "lora-0", None)
    assert other.chain(BS) == request_chain(second.ids, BS, root_of("lora-0", None)) != second.chain(BS)


def test_an_answer_kept_after_it_went_leaves_the_next_turn_only_its_new_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import router.kvevents.tokens as tokens  # noqa: PLC0415

    tokenizer = Tokenizer(small_model(tmp_path))
    messages = [{"role": "system", "content": "the fox " * 80}, {"role": "user", "content": "the dog?"}]
    first = EngineTokens.of_turn(tokenizer.turn(messages), None, None)
    first.chain(BS)  # (the placement made it while pricing the turn)
    reply = "the weather is fine and the dog jumps over the fox " * 3
    kept = tokenizer.replied(messages, reply)
    assert kept > len(first.ids)
    hashed: list[int] = []
    chain = tokens.token_chain
    monkeypatch.setattr(tokens, "token_chain", lambda ids, *a: hashed.append(len(ids)) or chain(ids, *a))
    # the client's copy of the answer carries fields the template does not render: found all the same
    said = {"role": "assistant", "content": reply, "refusal": None, "tool_calls": []}
    question = {"role": "user", "content": "and the fox?"}
    nxt = [*messages, said, question]
    before = tokenizer.tokenized
    second = EngineTokens.of_turn(tokenizer.turn(nxt), None, None)
    rendered = tokenizer.render(nxt)
    assert list(second.ids) == tokenizer.encode(rendered)  # the same ids as tokenizing it whole ...
    assert tokenizer.tokenized - before - len(rendered) == len("<|user|>and the fox?<|end|>\n<|assistant|>")
    made = second.chain(BS)
    assert 0 < sum(hashed) <= len(second.ids) - kept + BS  # ... the reply's blocks were hashed after it went
    assert made == request_chain(second.ids, BS, root_of(None, None))
    # a client that sends back an answer other than the one it got: its turn is tokenized from the
    # request's own kept turn on, and its ids are still the whole text's
    edited = [*messages, {"role": "assistant", "content": "the dog"}, question]
    assert list(tokenizer.chat(edited)) == tokenizer.encode(tokenizer.render(edited))
    # a conversation whose own turn was never kept keeps nothing: it would save no work
    assert tokenizer.replied([{"role": "user", "content": "the lazy dog"}], reply) == 0


def test_kept_tokens_are_bounded_by_the_ids_they_hold() -> None:
    store = TokenStore(max_tokens=100)
    store.put(1, range(60), "a")
    store.put(2, range(30))
    assert store.get(1) == ("a", tuple(range(60))) and store.tokens == 90  # 1 is now the most recent
    store.put(3, range(20))  # 110 > 100: the least recently used (2) goes
    assert 2 not in store and 1 in store and 3 in store and store.tokens == 80
    store.put(1, range(5))  # kept again, smaller
    assert store.tokens == 25 and len(store) == 2
    store.put(4, range(101))  # more than the whole store: not kept, nothing dropped for it
    assert 4 not in store and len(store) == 2
    few = TokenStore(max_tokens=100, max_entries=2)
    for key in range(3):
        few.put(key, ())  # empty prompts: bounded by their number
    assert 0 not in few and len(few) == 2


def test_a_template_that_refuses_is_an_error_not_a_crash(tmp_path: Path) -> None:
    small_model(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(TokenizerError, match="no system role"):
        Tokenizer(tmp_path).chat([{"role": "system", "content": "x"}])


def test_a_second_tiers_speed_is_learnt_from_answers() -> None:
    truth = Truth(tier_tokens_per_s=100_000)  # 1e-5 s a token, until answers say otherwise
    for _ in range(200):
        truth.learn_tier(4e-5)  # it loads 25,000 tokens a second
    assert truth.tier_spt == pytest.approx(4e-5, rel=0.01) and truth.tier_samples == 200
    before = truth.tier_spt
    for noise in (float("nan"), -1.0, 0.0, 5.0):
        truth.learn_tier(noise)
    assert truth.tier_spt == before and truth.tier_samples == 200
