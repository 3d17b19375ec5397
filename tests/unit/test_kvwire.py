"""The KV-event scanner (`_kvwire`, twin router/_kvwire_py.py) against the long way (wire.decode_long).

Whatever a scanner answers must be what the long way decodes; what it does not answer the long
way decodes or refuses. Both are checked on vLLM's messages as it sends them and on messages
made odd on purpose: every field's other types, strings that are not UTF-8, extension types,
deep nesting, messages cut short or followed by more.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from types import ModuleType
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from twins import implementations

from router import _kvwire_py
from router._compat import NO_EXTENSIONS
from router.kvevents import wire
from router.kvevents.holdings import Holdings
from router.kvevents.wire import Batch, Cleared, Removed, Stored, WireError, decode, decode_long
from router.prefix import PrefixIndex

IMPLEMENTATIONS = implementations("_kvwire", _kvwire_py)
TS = 1796301048.25


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return IMPLEMENTATIONS[request.param]


def stored(hashes: list[int], parent: int | None, size: int = 4, **more: Any) -> dict[str, Any]:
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(len(hashes) * size)),
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    return event | more


def removed(*hashes: int, medium: Any = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium, "group_idx": 0}


def packed(*events: Any, ts: Any = TS, rank: Any = 0) -> bytes:
    out: bytes = msgpack.packb([ts, list(events), rank])
    return out


def as_batch(seq: int, scanned: tuple[float, int, list[tuple[Any, ...]]]) -> Batch:
    return Batch(seq, scanned[0], scanned[1], wire._events(scanned[2]))


def same(b: Batch | WireError) -> Batch | WireError:
    """`b`, a NaN timestamp made 0 (NaN is not equal to itself; the router reads it as none)."""
    return dataclasses.replace(b, ts=0.0) if isinstance(b, Batch) and math.isnan(b.ts) else b


def agrees(impl: ModuleType, payload: bytes) -> bool:
    """True where `impl` answered (and its answer is the long way's); False where it left it."""
    scanned = impl.scan(payload)
    if scanned is None:
        return False
    assert as_batch(7, scanned) == decode_long(7, payload)
    return True


def test_the_selector_loaded_what_this_run_asked_for() -> None:
    assert wire.scan.__module__ == ("router._kvwire_py" if NO_EXTENSIONS else "_kvwire")


def test_vllms_own_messages_are_read_by_the_scanner_and_removals_on_one_medium_gathered(impl: ModuleType) -> None:
    payload = packed(
        removed(9),
        removed(10),
        removed(11, medium="CPU"),
        stored([1, 2], None, lora_name="ad", extra_keys=[["ad", "salty"], None]),
        stored([3], 2, medium="CPU"),
        removed(12),
        {"type": "AllBlocksCleared"},
        rank=2,
    )
    assert agrees(impl, payload)
    b = as_batch(1, impl.scan(payload))
    assert b.rank == 2 and b.ts == TS
    assert b.events == (
        Removed(array("Q", [9, 10]), "GPU"),
        Removed(array("Q", [11]), "CPU"),
        Stored(array("Q", [1, 2]), None, array("Q", range(8)), 4, "GPU", "ad", "salty"),
        Stored(array("Q", [3]), 2, array("Q", range(4)), 4, "CPU", None, None),
        Removed(array("Q", [12]), "GPU"),
        Cleared(),
    )


@pytest.mark.parametrize(
    "payload",
    [
        packed(["BlockRemoved", [1], "GPU"]),  # positional (older vLLM)
        packed(removed(-5)),  # signed hashes
        packed(stored([1], -3)),
        packed(removed(1), {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32]}),  # bytes hashes
        msgpack.packb([TS, [{1: "x", "type": "AllBlocksCleared"}], 0]),  # a key that is not a string
    ],
)
def test_shapes_the_scanner_leaves_are_decoded_the_long_way_all_the_same(payload: bytes) -> None:
    compiled = IMPLEMENTATIONS.get("compiled")
    if compiled is not None and not isinstance(msgpack.unpackb(payload, strict_map_key=False)[1][0], dict):
        assert compiled.scan(payload) is None
    assert decode(3, payload) == decode_long(3, payload)


@pytest.mark.parametrize(
    "payload",
    [
        packed(removed(1), ts="x") + b"\xc0",  # more after the message
        packed(removed(1))[:-3],  # cut short
        packed({"type": "BlockRemoved", "block_hashes": [1], "other": "caf\xe9".encode("latin-1")}).replace(
            b"\xc4\x04caf\xe9", b"\xa4caf\xe9"
        ),  # a string that is not UTF-8, where nothing reads it
        packed(stored([1, 2], None, token_ids=[1, 2, 3])),  # too few token ids
        packed(stored([1], None, block_size=0)),
        packed(stored([1], None, block_size=True)),
        packed(removed(True)),
        packed({"type": "BlockMoved"}),
        packed({"type": b"BlockStored"}),
        msgpack.packb({"ts": TS}),
        msgpack.packb([TS, {"type": "AllBlocksCleared"}]),
        b"\xc1",
        b"",
    ],
)
def test_what_is_no_message_is_refused_in_one_line_by_the_long_way(impl: ModuleType, payload: bytes) -> None:
    assert impl.scan(payload) is None
    with pytest.raises(WireError) as refused:
        decode(4, payload)
    assert "\n" not in str(refused.value) and str(refused.value).startswith("message 4")


def test_extension_types_and_deep_nesting_are_left_to_the_long_way(impl: ModuleType) -> None:
    ext = packed(removed(1, medium=msgpack.ExtType(5, b"ab")))
    deep: Any = "x"
    for _ in range(_kvwire_py.MAX_DEPTH + 4):
        deep = [deep]
    nested = packed(stored([1], None, lora_id=deep))
    timestamp = packed(removed(1), ts=msgpack.Timestamp(5, 0))
    for payload in (ext, nested, timestamp):
        if impl is not _kvwire_py:
            assert impl.scan(payload) is None
        else:
            agrees(impl, payload)
        assert decode(1, payload) == decode_long(1, payload)


def test_values_past_the_common_ones_are_read_as_the_long_way_reads_them(impl: ModuleType) -> None:
    cases = [
        packed(removed(2**64 - 1, 0), ts=True, rank=2**63),
        packed(stored([1], 2**63, size=1, medium="", lora_name="", extra_keys=[["", [], {}, "s", 4]])),
        packed(stored([1], None, extra_keys=[["ad", "s"]], lora_name="ad")),
        packed(stored([1], None, extra_keys=[["ad"]], lora_name="ad")),
        packed(stored([1], None, extra_keys=[["ad", "ad"]], lora_name="ad")),
        packed(stored([1], None, extra_keys="s")),
        packed(stored([1], None, extra_keys=[]), rank=-1),
        packed(stored([], None, token_ids=[])),
        packed(stored([1], None, medium=4, lora_name=["x"]), ts=None),
        packed({"type": "AllBlocksCleared", "type2": {"a": [1, {"b": None}]}}, ts=-7),
        packed(removed(1), removed(2, medium="\u00e9t\u00e9"), removed(3, medium="\u00e9t\u00e9")),
        msgpack.packb([TS, [removed(1)]]),
        msgpack.packb([TS, [removed(1)], 0, "more", {"x": 1}]),
        # one key twice: the last is the one (as a dict built from it keeps)
        b"\x93" + msgpack.packb(TS) + b"\x91\x82\xa4type\xacBlockRemoved\xa4type\xb0AllBlocksCleared\x00",
        msgpack.packb([TS, [], 0], use_single_float=True),
    ]
    for payload in cases:
        assert agrees(impl, payload), payload


# -- generated --------------------------------------------------------------------------------

scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=6)
anything = st.recursive(
    scalars | st.binary(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
hash_values = st.integers(0, 2**64 - 1) | st.sampled_from([-1, True, b"\x00" * 8, 2.5, None])
media = st.sampled_from(["GPU", "CPU", "", None, 3, "disk"])


@st.composite
def events(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["stored", "stored", "removed", "removed", "removed", "cleared", "odd"]))
    if kind == "odd":
        return draw(anything)
    if kind == "cleared":
        return {"type": "AllBlocksCleared"}
    n = draw(st.integers(0, 3))
    if draw(st.integers(0, 9)) == 0:
        hashes: Any = draw(st.lists(hash_values, max_size=3))
    else:
        hashes = draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n))
    if kind == "removed":
        event: dict[Any, Any] = {"type": "BlockRemoved", "block_hashes": hashes}
        if draw(st.booleans()):
            event["medium"] = draw(media)
    else:
        size = draw(st.sampled_from([1, 2, 4, 0, -1, True, None]))
        count = len(hashes) * size if isinstance(size, int) and size > 0 else 2
        count += draw(st.sampled_from([0, 0, 0, 1, -1]))
        lora = draw(st.sampled_from([None, "", "ad", 7]))
        salt = draw(st.sampled_from([None, "s", "ad"]))
        first = [x for x in (lora, salt) if x is not None] + draw(st.lists(anything, max_size=2))
        event = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": draw(st.none() | hash_values),
            "token_ids": draw(st.lists(st.integers(0, 2**64 - 1), min_size=max(count, 0), max_size=max(count, 0))),
            "block_size": size,
            "medium": draw(media),
            "lora_name": lora,
            "extra_keys": draw(st.sampled_from([None, [], [first], [first, None], "x"])),
        }
        for name in draw(st.lists(st.sampled_from(sorted(event)), max_size=2)):
            event.pop(name, None)
    for _ in range(draw(st.integers(0, 1))):
        event[draw(st.text(max_size=5))] = draw(anything)
    return event


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    body: list[Any] = [
        draw(st.floats(allow_nan=False) | st.integers(-5, 2**64 - 1) | st.none() | st.booleans()),
        draw(st.lists(events(), max_size=6)),
    ]
    if draw(st.booleans()):
        body.append(draw(st.integers(-3, 2**64 - 1) | st.none() | st.booleans()))
    body += draw(st.lists(anything, max_size=1))
    try:
        payload: bytes = msgpack.packb(body, use_single_float=draw(st.booleans()))
    except OverflowError:  # (a float past float32's range)
        payload = msgpack.packb(body)
    cut = draw(st.sampled_from(["whole", "whole", "whole", "cut", "more", "flip"]))
    if cut == "cut" and payload:
        payload = payload[: draw(st.integers(0, len(payload) - 1))]
    elif cut == "more":
        payload += draw(st.binary(min_size=1, max_size=3))
    elif cut == "flip" and payload:
        at = draw(st.integers(0, len(payload) - 1))
        payload = payload[:at] + bytes([draw(st.integers(0, 255))]) + payload[at + 1 :]
    return payload


@given(payloads())
def test_a_scanner_answers_only_what_the_long_way_decodes_and_as_it_does(payload: bytes) -> None:
    try:
        expected: Batch | WireError = decode_long(5, payload)
    except WireError as exc:
        expected = exc
    answers = {}
    for name, impl in IMPLEMENTATIONS.items():
        scanned = impl.scan(payload)
        if scanned is not None:
            assert same(as_batch(5, scanned)) == same(expected), name
            answers[name] = scanned
    if isinstance(expected, Batch):
        assert same(decode(5, payload)) == same(expected)
    else:
        with pytest.raises(WireError):
            decode(5, payload)


@given(st.lists(events(), max_size=8), st.integers(0, 3))
def test_vllm_shaped_messages_are_all_scanned(raw: list[Any], rank: int) -> None:
    """What vLLM sends (tagged events, hashes and ids as unsigned ints, string keys) never takes the long way."""
    payload = packed(*raw, rank=rank)
    try:
        decode_long(0, payload)
    except WireError:
        return

    def unsigned(h: object) -> bool:
        return type(h) is int and h >= 0

    plain = all(
        isinstance(e, dict)
        and all(isinstance(k, str) for k in e)
        and all(map(unsigned, e.get("block_hashes", [])))
        and (e.get("parent_block_hash") is None or unsigned(e["parent_block_hash"]))
        for e in raw
    )
    for name, impl in IMPLEMENTATIONS.items():
        assert (impl.scan(payload) is not None) == plain, name


def test_a_replica_counts_the_batches_the_scanner_left_to_the_long_way() -> None:
    """`long_way` in a replica's figures: an engine whose every message takes the long way (a
    wire format the scanner does not read) shows there, not only in the CPU it costs."""
    h = Holdings(PrefixIndex(), 100)
    fast = decode(0, packed(removed(1)))
    slow = decode(1, packed(["BlockRemoved", [2], "GPU"]))  # positional: the long way
    assert fast.scanned and not slow.scanned
    assert fast == decode_long(0, packed(removed(1)))  # (whether it was scanned is not what it says)
    h.accept(fast)
    h.accept(slow)
    assert h.figures.batches == 2 and h.figures.long_way == 1
