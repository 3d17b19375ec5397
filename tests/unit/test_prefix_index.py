"""The prefix index and its block keys (whole or in parts): every behaviour on both implementations,
their agreement over any history, golden answers."""

from __future__ import annotations

import json
import random
import re
from array import array
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st
from twins import implementations

from router import _prefix_py, prefix
from router._compat import NO_EXTENSIONS

IMPLEMENTATIONS = implementations("_prefix", _prefix_py)
COMPILED = IMPLEMENTATIONS.get("compiled")
GOLDEN = json.loads((Path(__file__).parents[1] / "data" / "prefix_golden.json").read_text())


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request: pytest.FixtureRequest) -> ModuleType:
    """One prefix-index implementation module: `compiled` (_prefix) or `python` (router._prefix_py)."""
    return IMPLEMENTATIONS[request.param]


@pytest.fixture
def compiled() -> ModuleType:
    if COMPILED is None:
        pytest.skip("installed with ROUTER_NO_EXTENSIONS=1: no compiled module to test")
    return COMPILED


def chain_of(impl: ModuleType, text: str) -> array[int]:
    keys: array[int] = impl.block_chain(text, 4)  # one block per 4 characters (ASCII)
    return keys


def test_selector_loaded_what_this_run_asked_for() -> None:
    # Fails when the compiled module silently failed to load in a run that did not opt out.
    if NO_EXTENSIONS:
        assert prefix.IMPLEMENTATION == "python"
        assert prefix.PrefixIndex.__module__ == "router._prefix_py"
    else:
        assert prefix.IMPLEMENTATION == "compiled"
        assert prefix.PrefixIndex.__module__ == "_prefix"
        assert COMPILED is not None and str(COMPILED.__file__).endswith((".so", ".pyd"))


# -- block keys ---------------------------------------------------------------------------------


def chain_oracle(data: bytes, block_len: int, seed: int) -> list[int]:
    """The parent-seeded XXH3 chain, by the xxhash package, one whole block at a time."""
    out, h = [], seed
    for start in range(0, len(data) - block_len + 1, block_len):
        h = xxhash.xxh3_64_intdigest(data[start : start + block_len], h)
        out.append(h)
    return out


@pytest.mark.parametrize("block_len", [1, 3, 16, 64, 240, 241, 300])
@pytest.mark.parametrize("seed", [0, 9, (1 << 64) - 1])
def test_block_chain_is_the_parent_seeded_xxh3_chain(impl: ModuleType, block_len: int, seed: int) -> None:
    data = bytes(range(256)) * 5
    keys = impl.block_chain(data, block_len, seed)
    assert isinstance(keys, array) and keys.typecode == "Q"
    assert list(keys) == chain_oracle(data, block_len, seed)


@given(
    data=st.binary(max_size=3000),
    block_len=st.sampled_from([1, 4, 16, 64, 240, 241, 512]),  # past 240 bytes XXH3 reads a secret
    seed=st.integers(0, (1 << 64) - 1),
)
def test_block_chain_of_any_input(impl: ModuleType, data: bytes, block_len: int, seed: int) -> None:
    assert list(impl.block_chain(data, block_len, seed)) == chain_oracle(data, block_len, seed)


def test_block_chain_inputs(impl: ModuleType) -> None:
    assert impl.block_chain("héllo wörld!", 2) == impl.block_chain("héllo wörld!".encode(), 2)
    assert impl.block_chain(bytearray(b"abcdefgh"), 4) == impl.block_chain(memoryview(b"abcdefgh"), 4)
    assert len(impl.block_chain(b"abcdefghi", 4)) == 2  # the partial block has no key
    assert len(impl.block_chain(b"abc", 4)) == 0 and len(impl.block_chain(b"abcd", 4)) == 1
    assert len(impl.block_chain(b"abc", 1 << 70)) == 0
    assert impl.block_chain(array("Q", [1, 2]), 8) == impl.block_chain(array("Q", [1, 2]).tobytes(), 8)
    prompt_a, prompt_b = "shared system prompt" + "A" * 8, "shared system prompt" + "B" * 8
    a, b = impl.block_chain(prompt_a, 4), impl.block_chain(prompt_b, 4)
    assert a[:5] == b[:5] and a[5] != b[5]  # shared whole blocks, shared keys


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (("x", 4, -1), ValueError, "seed must be in [0, 2**64), got -1"),
        (("x", 4, 1 << 64), ValueError, f"seed must be in [0, 2**64), got {1 << 64}"),
        (("x", 4, "1"), TypeError, "seed must be an int, not str"),
        (("x", 4, True), TypeError, "seed must be an int, not bool"),
        (("x", 0), ValueError, "block_len must be positive, got 0"),
        (("x", -3), ValueError, "block_len must be positive, got -3"),
        (("x", True), TypeError, "block_len must be an int, not bool"),
        (("x", 2.0), TypeError, "block_len must be an int, not float"),
        ((5, 4), TypeError, "data must be str or bytes-like, not int"),
    ],
)
def test_block_chain_refuses_with_a_clear_error(
    impl: ModuleType, args: tuple[Any, ...], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        impl.block_chain(*args)


def test_block_chain_refuses_strided_buffers_alike() -> None:
    strided = memoryview(b"abcdefgh")[::2]
    for impl in IMPLEMENTATIONS.values():
        with pytest.raises(TypeError, match="data must be str or bytes-like, not memoryview"):
            impl.block_chain(strided, 2)


# -- block keys of a prompt in parts ------------------------------------------------------------


def joined(parts: list[Any]) -> bytes:
    """What chain_of_parts keys: the parts' bytes one after another (str as UTF-8, surrogates passed)."""
    return b"".join(p.encode("utf-8", "surrogatepass") if isinstance(p, str) else bytes(p) for p in parts)


def assert_keys_the_join(impl: ModuleType, parts: list[Any], block_len: int, seed: int, mark: int) -> None:
    chain, total, head = impl.chain_of_parts(parts, block_len, seed, mark)
    data = joined(parts)
    assert isinstance(chain, array) and chain.typecode == "Q"
    assert chain == _prefix_py.block_chain(data, block_len, seed)
    assert (total, head) == (len(data), len(joined(parts[:mark])))


# ASCII, Latin, CJK, emoji and lone surrogates; pieces from empty to several blocks long
char_st = st.one_of(
    st.characters(max_codepoint=0x7F),
    st.characters(min_codepoint=0x80),
    st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"]),
)
piece_st = st.tuples(st.one_of(st.text(char_st, max_size=24), st.binary(max_size=24)), st.integers(1, 40)).map(
    lambda t: t[0] * t[1]
)
parts_st = st.lists(piece_st, max_size=24)


@given(parts=parts_st, block_len=st.integers(16, 240), seed=st.integers(0, (1 << 64) - 1), data=st.data())
def test_chain_of_parts_keys_the_join(
    impl: ModuleType, parts: list[Any], block_len: int, seed: int, data: st.DataObject
) -> None:
    mark = data.draw(st.integers(0, len(parts)), label="mark")
    assert_keys_the_join(impl, parts, block_len, seed, mark)


@pytest.mark.parametrize("block_len", [1, 2, 7, 15, 241, 300, 1000, 1 << 70])
def test_chain_of_parts_any_block_length(impl: ModuleType, block_len: int) -> None:
    # below the router's 16 and above 240 (a block XXH3 keys with the derived secret, carried on the heap)
    parts = ["<|system|>", "Ünïcödé 🚀 " * 40, b"", "<|end|>", bytes(range(256)) * 3, "x" * 999]
    for mark in range(len(parts) + 1):
        assert_keys_the_join(impl, parts, block_len, 9, mark)


def test_chain_of_parts_inputs(impl: ModuleType) -> None:
    keys = array("Q", [1, 2, 3])
    parts = [bytearray(b"abc"), memoryview(b"defgh"), keys, "ij", b"k" * 70, memoryview(b"xyz" * 9)[3:]]
    assert_keys_the_join(impl, parts, 16, 1, 3)
    assert impl.chain_of_parts(tuple(parts), 16, 1, 3) == impl.chain_of_parts(parts, 16, 1, 3)
    assert impl.chain_of_parts([], 16, 0, 0) == (array("Q"), 0, 0)
    assert impl.chain_of_parts(["", b""], 4, 0, 2) == (array("Q"), 0, 0)
    # more parts than the compiled core keeps on its stack; a prompt long enough to drop the GIL
    many = [f"<|user|>{i}" for i in range(40)] + ["q" * 20000, b"end"]
    for mark in (0, 17, 41, 42):
        assert_keys_the_join(impl, many, 64, 5, mark)
    # the rendering the router keys: a prefix of parts keys a prefix of the chain
    head, _, _ = impl.chain_of_parts(many[:20], 64, 5, 0)
    whole, _, before = impl.chain_of_parts(many, 64, 5, 20)
    assert whole[: len(head)] == head and before // 64 == len(head)


@pytest.mark.parametrize(
    "args",
    [
        ([], 4, -1, 0),
        ([], 4, 1 << 64, 0),
        ([], 4, "1", 0),
        ([], 0, 0, 0),
        ([], -3, 0, 0),
        ([], True, 0, 0),
        ([], 2.0, 0, 0),
        ("abc", 4, 0, 0),
        (b"abc", 4, 0, 0),
        (None, 4, 0, 0),
        (iter(["a"]), 4, 0, 0),
        (["a"], 4, 0, 2),
        (["a"], 4, 0, -1),
        (["a"], 4, 0, True),
        (["a"], 4, 0, 1.0),
        (["a", 5], 4, 0, 0),
        (["a", None], 4, 0, 0),
        ([memoryview(b"abcdefgh")[::2]], 4, 0, 0),
        ([b"ok", ["a"]], 4, 0, 1),
    ],
)
def test_chain_of_parts_refuses_with_a_clear_error(impl: ModuleType, args: tuple[Any, ...]) -> None:
    with pytest.raises((TypeError, ValueError)) as err:
        impl.chain_of_parts(*args)
    if args[1] != 4 or args[2] != 0:  # block_len and seed: the same refusals as block_chain
        with pytest.raises(err.type, match="^" + re.escape(str(err.value)) + "$"):
            impl.block_chain(b"", *args[1:3])


def test_chain_of_parts_refusals_read_well_and_agree() -> None:
    cases = [
        ("abc", 4, 0, 0),
        (["a"], 4, 0, 2),
        (["a"], 4, 0, True),
        (["a", 5], 4, 0, 0),
        ([memoryview(b"abcdefgh")[::2]], 4, 0, 0),
    ]
    found: dict[str, list[str]] = {}
    for name, impl in IMPLEMENTATIONS.items():
        for args in cases:
            with pytest.raises((TypeError, ValueError)) as err:
                impl.chain_of_parts(*args)
            found.setdefault(name, []).append(f"{err.type.__name__}: {err.value}")
    assert found["python"] == [
        "TypeError: parts must be a list or tuple of str and bytes-like pieces, not str",
        "ValueError: mark must be in [0, 1], got 2",
        "TypeError: mark must be an int, not bool",
        "TypeError: parts[1] must be str or bytes-like, not int",
        "TypeError: parts[0] must be str or bytes-like, not memoryview",
    ]
    assert found.get("compiled", found["python"]) == found["python"]


# -- holders ------------------------------------------------------------------------------------


def test_holders_take_the_lowest_free_number(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    assert index.n_holders == 0 and index.total() == 0
    assert [index.add_holder(c) for c in (5, 6, 7)] == [0, 1, 2]
    assert index.n_holders == 3
    index.remove_holder(1)
    index.remove_holder(2)
    assert index.n_holders == 3  # the allocated range does not shrink
    assert index.add_holder(9) == 1
    assert index.add_holder(9) == 2
    assert index.add_holder(9) == 3
    assert [index.capacity(h) for h in range(4)] == [5, 9, 9, 9]


def test_a_removed_holder_forgets_its_blocks(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    chain = chain_of(impl, "abcdefghijklmnop")
    h = index.add_holder(10)
    other = index.add_holder(10)
    index.insert(h, chain)
    index.insert(other, chain)
    index.remove_holder(h)
    assert index.total() == 4
    with pytest.raises(ValueError, match="holder 0 is not in use"):
        index.match(h, chain)
    assert index.add_holder(10) == h
    assert index.size(h) == 0 and index.match(h, chain) == 0
    assert index.match(other, chain) == 4


# -- insert, eviction, match ----------------------------------------------------------------------


def test_insert_counts_new_blocks_and_match_finds_the_prefix(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    h = index.add_holder(100)
    long, short = chain_of(impl, "0123456789abcdefghij"), chain_of(impl, "0123456789ab")
    assert index.insert(h, short) == 3
    assert index.insert(h, long) == 2  # the first 3 blocks were held
    assert index.insert(h, long) == 0
    assert index.size(h) == 5 and index.total() == 5
    assert index.match(h, long) == 5 and index.match(h, short) == 3
    assert index.match(h, chain_of(impl, "0123456789abXXXX")) == 3
    assert index.match(h, chain_of(impl, "X123456789ab")) == 0
    assert index.match(h, array("Q")) == 0


def test_insert_only_the_first_n_blocks(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    h = index.add_holder(100)
    chain = chain_of(impl, "0123456789abcdefghij")
    assert index.insert(h, chain, 2) == 2
    assert index.match(h, chain) == 2
    assert index.insert(h, chain, 0) == 0
    assert index.insert(h, chain, 5) == 3 and index.match(h, chain) == 5


def test_eviction_keeps_a_prefix_of_every_chain(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    h = index.add_holder(3)
    chain = chain_of(impl, "0123456789abcdefghij")
    assert index.insert(h, chain) == 5  # all five were new, the last two evicted again
    assert index.size(h) == 3
    assert index.match(h, chain) == 3


def test_least_recently_sent_blocks_go_first(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    h = index.add_holder(4)
    a, b, c = (chain_of(impl, s * 8) for s in "abc")
    index.insert(h, a)
    index.insert(h, b)
    index.insert(h, a)  # a is now more recent than b
    index.insert(h, c)  # evicts b's two blocks, tail first
    assert [index.match(h, x) for x in (a, b, c)] == [2, 0, 2]
    index.insert(h, b, 1)  # b's first block; a's last block is now the oldest
    assert [index.match(h, x) for x in (a, b, c)] == [1, 1, 2]


def test_shared_prefixes_outlive_their_branches(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    h = index.add_holder(5)
    system = "You are kind. "[:12]
    x, y, z = (chain_of(impl, system + tail) for tail in ("xxxxxxxx", "yyyyyyyy", "zzzz"))
    index.insert(h, x)  # 3 shared + 2
    index.insert(h, y)  # the shared blocks refresh; x's branch is now the oldest
    assert [index.match(h, c) for c in (x, y)] == [3, 5]
    index.insert(h, z)
    assert [index.match(h, c) for c in (x, y, z)] == [3, 4, 4]


def test_capacity_shrinks_and_grows(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    h = index.add_holder(10)
    a, b = chain_of(impl, "a" * 16), chain_of(impl, "b" * 16)
    index.insert(h, a)
    index.insert(h, b)
    assert index.set_capacity(h, 6) == 2
    assert index.capacity(h) == 6 and index.size(h) == 6
    assert [index.match(h, a), index.match(h, b)] == [2, 4]
    assert index.set_capacity(h, 100) == 0
    assert index.set_capacity(h, 0) == 6
    assert index.size(h) == 0 and index.total() == 0


def test_capacity_zero_holds_nothing(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    h = index.add_holder(0)
    chain = chain_of(impl, "abcdefgh")
    assert index.insert(h, chain) == 2  # counted as new, then evicted at once
    assert index.size(h) == 0 and index.match(h, chain) == 0


def test_clear_drops_everything_and_keeps_the_capacity(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    h, other = index.add_holder(8), index.add_holder(8)
    chain = chain_of(impl, "abcdefghijkl")
    index.insert(h, chain)
    index.insert(other, chain)
    assert index.clear(h) == 3
    assert index.size(h) == 0 and index.capacity(h) == 8 and index.match(h, chain) == 0
    assert index.match(other, chain) == 3 and index.clear(h) == 0


def test_truncate_drops_the_tail_the_engine_lost(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    h = index.add_holder(50)
    chain = chain_of(impl, "abcdefghijklmnopqrstuvwx")
    index.insert(h, chain)
    assert index.truncate(h, chain, 2) == 4
    assert index.match(h, chain) == 2 and index.size(h) == 2
    assert index.truncate(h, chain, 2) == 0
    assert index.truncate(h, chain, 99) == 0
    assert index.truncate(h, chain, 0) == 2 and index.size(h) == 0


def test_match_gallops_over_a_gap_the_same_way(impl: ModuleType) -> None:
    # After a truncate, a sibling chain may keep blocks past a hole; galloping then finds
    # what its fixed probe order finds, in both implementations.
    index = impl.PrefixIndex()
    h = index.add_holder(100)
    trunk = "t" * 4 * 12
    c, d = chain_of(impl, trunk + "c" * 16), chain_of(impl, trunk + "d" * 16)
    index.insert(h, c)
    index.insert(h, d)
    assert index.truncate(h, d, 10) == 6  # trunk blocks 10 and 11, and d's branch
    # c keeps blocks 0-9 and 12-15: probes 1, 2, 4, 8 and 16 all hit
    assert index.match(h, c) == 16
    # d keeps blocks 0-9: probes 1, 2, 4, 8 hit, 16 misses, then 12 (miss), 10 (hit), 11 (miss)
    assert index.match(h, d) == 10
    index.insert(h, d)
    assert index.match(h, c) == index.match(h, d) == 16


def test_evict_drops_the_oldest_blocks(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    h = index.add_holder(20)
    a, b = chain_of(impl, "a" * 12), chain_of(impl, "b" * 12)
    index.insert(h, a)
    index.insert(h, b)
    assert index.evict(h, 2) == 2
    assert [index.match(h, a), index.match(h, b)] == [1, 3]
    assert index.evict(h, 0) == 0
    assert index.evict(h, 1 << 80) == 4 and index.size(h) == 0


def test_match_after_is_the_match_once_the_oldest_blocks_went(impl: ModuleType) -> None:
    # What a request would find once `evicted` blocks were allocated before it: nothing dropped.
    index = impl.PrefixIndex()
    h = index.add_holder(20)
    a, b = chain_of(impl, "a" * 16), chain_of(impl, "b" * 12)
    index.insert(h, a)  # a3 a2 a1 a0 (a0 most recent: its tail goes first, as an engine frees it)
    index.insert(h, b)
    assert [index.match_after(h, a, k) for k in range(6)] == [4, 3, 2, 1, 0, 0]
    assert index.match_after(h, b, 4) == 3 and index.match_after(h, b, 1 << 80) == 0
    assert index.size(h) == 7 and index.match(h, a) == 4  # nothing was dropped
    index.insert(h, a, 2)  # a conversation's start used again: younger than all of b
    assert index.match_after(h, a, 5) == 2
    for k in range(8):  # the same as evicting on a copy
        copy = impl.PrefixIndex()
        c = copy.add_holder(20)
        copy.insert(c, a[2:])
        copy.insert(c, b)
        copy.insert(c, a, 2)
        copy.evict(c, k)
        assert index.match_after(h, a, k) == copy.match(c, a), k
    with pytest.raises(ValueError, match="evicted must be non-negative"):
        index.match_after(h, a, -1)


def test_match_after_many_is_match_after_for_each_chain_and_count_in_one_walk(impl: ModuleType) -> None:
    # A replica's returning conversations: one system prompt, then each its own turns, and one of
    # them used again lately; asked for several counts at once, in any order.
    index = impl.PrefixIndex()
    h = index.add_holder(400)
    system = b"s" * 4 * BLOCK
    chains = [impl.block_chain(system + bytes([i]) * (2 + i) * BLOCK, BLOCK, 5) for i in range(6)]
    for chain in chains:
        index.insert(h, chain)
    index.insert(h, chains[2], 5)
    index.insert(h, impl.block_chain(b"x" * 40 * BLOCK, BLOCK, 5))
    stranger = impl.block_chain(b"y" * 3 * BLOCK, BLOCK, 5)
    asked = [*chains, stranger, chains[0][:2]]
    for counts in ([0], [7, 0, 30], [index.size(h), 1 << 80], [45, 44, 46, 60]):
        expected = [index.match_after(h, c, k) for c in asked for k in counts]
        assert index.match_after_many(h, asked, counts) == expected, counts
    expected = [index.match_after(h, c, 3) for c in asked[:2]]
    assert index.match_after_many(h, (c for c in asked[:2]), iter([3])) == expected  # any iterables
    assert index.match_after_many(h, [], [3]) == [] and index.match_after_many(h, asked, []) == []
    assert index.size(h) == 4 + sum(2 + i for i in range(6)) + 40  # nothing was dropped
    with pytest.raises(ValueError, match="evicted must be non-negative"):
        index.match_after_many(h, asked, [3, -1])
    with pytest.raises(TypeError):
        index.match_after_many(h, [b"not keys"], [3])


def test_match_all_fills_one_count_per_holder_number(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    chain = chain_of(impl, "0123456789abcdef")
    for cap in (10, 10, 10, 2):
        index.add_holder(cap)
    index.insert(0, chain)
    index.insert(2, chain, 1)
    index.insert(3, chain)
    index.remove_holder(1)
    out = array("i", [-7] * 6)
    index.match_all(chain, out)
    assert list(out) == [4, 0, 1, 2, -7, -7]  # past n_holders: untouched
    empty = impl.PrefixIndex()
    empty.match_all(chain, array("i"))


def test_numpy_buffers_are_accepted(impl: ModuleType) -> None:
    np = pytest.importorskip("numpy")
    index = impl.PrefixIndex()
    h = index.add_holder(10)
    chain = np.frombuffer(chain_of(impl, "abcdefghijkl").tobytes(), dtype=np.uint64)  # format 'L'
    assert index.insert(h, chain) == 3
    out = np.zeros(1, dtype=np.int32)
    index.match_all(chain, out)
    assert out.tolist() == [3] and index.match(h, chain[:2]) == 2
    with pytest.raises(TypeError, match="one-dimensional contiguous"):
        index.match(h, chain[::2])


def test_memory_grows_with_the_blocks_held(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    empty = index.memory_bytes()
    h = index.add_holder(5000)
    index.insert(h, impl.block_chain(bytes(range(256)) * 64, 4))
    assert index.total() == 4096
    assert index.memory_bytes() > empty + 4096 * 16


def test_compiled_memory_stays_under_46_bytes_a_block(compiled: ModuleType) -> None:
    # 24 bytes of entry, 8 to 16 of slots (load 1/4 to 1/2), at most a quarter of idle pool
    index = compiled.PrefixIndex()
    data = random.Random(3).randbytes(1 << 17)
    for h in range(4):
        index.add_holder(1 << 15)
        index.insert(h, compiled.block_chain(data, 4, h + 1))
        assert index.memory_bytes() / index.total() <= 46
    assert index.total() == 1 << 17


# -- engines' names for blocks (an event-fed holder) -------------------------------------------------


def test_an_engines_name_finds_and_forgets_its_block(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    h, other = index.add_holder(10), index.add_holder(10)
    chain = chain_of(impl, "abcdefghijkl")
    assert index.insert(h, chain, -1, array("Q", [101, 102, 103])) == 3
    index.insert(other, chain, -1, array("Q", [101, 102, 103]))  # the same names, another holder
    assert [index.key_of(h, x) for x in (101, 102, 103, 104)] == [*chain, None]
    assert index.forget(h, array("Q", [103, 999])) == 1  # an unknown name is passed over
    assert index.match(h, chain) == 2 and index.key_of(h, 103) is None
    assert index.match(other, chain) == 3 and index.key_of(other, 103) == chain[2]  # untouched
    index.insert(h, chain, 1, array("Q", [201, 202, 203]))  # block 0 renamed: its old name is gone
    assert index.key_of(h, 101) is None and index.key_of(h, 201) == chain[0]
    index.insert(h, chain[1:2], -1, array("Q", [201]))  # the name moves to block 1
    assert index.key_of(h, 201) == chain[1] and index.forget(h, array("Q", [102])) == 0
    assert index.forget(h, array("Q", [201])) == 1 and index.match(h, chain) == 1


def test_a_block_that_leaves_takes_its_name_along(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    h = index.add_holder(2)
    chain = chain_of(impl, "abcdefghijkl")
    index.insert(h, chain, -1, array("Q", [1, 2, 3]))  # capacity 2: block 2 evicted at once
    assert index.key_of(h, 3) is None and index.forget(h, array("Q", [3])) == 0
    index.truncate(h, chain, 1)
    assert index.key_of(h, 2) is None and index.key_of(h, 1) == chain[0]
    index.evict(h, 1)
    assert index.key_of(h, 1) is None
    index.insert(h, chain, 2, array("Q", [1, 2, 3]))
    index.clear(h)
    assert index.key_of(h, 1) is None and index.key_of(h, 2) is None
    index.insert(h, chain, 2, array("Q", [1, 2, 3]))
    index.set_capacity(h, 1)
    assert (index.key_of(h, 1), index.key_of(h, 2)) == (chain[0], None)
    index.remove_holder(h)
    h = index.add_holder(2)  # the number again, nothing named
    assert index.key_of(h, 1) is None


def test_compiled_memory_with_names_stays_under_72_bytes_a_block(compiled: ModuleType) -> None:
    # 32 bytes of entry and name, 8 to 16 of slots in each table, at most a quarter of idle pool
    index = compiled.PrefixIndex()
    plain = compiled.PrefixIndex()
    rng = random.Random(4)
    for h in range(4):
        index.add_holder(1 << 15)
        plain.add_holder(1 << 15)
        chain = compiled.block_chain(rng.randbytes(1 << 17), 4, h + 1)
        index.insert(h, chain, -1, array("Q", [rng.getrandbits(64) for _ in chain]))
        plain.insert(h, chain)
        assert index.memory_bytes() / index.total() <= 72
    assert index.memory_bytes() > plain.memory_bytes()  # an index that names nothing pays nothing


# -- bad input: the same refusals both ways --------------------------------------------------------


def bad_calls(index: Any, chain: array[int]) -> list[tuple[str, Any]]:
    # holder 0 in use (capacity 4), 1 removed, 2 in use; n_holders == 3
    return [
        ("holder str", lambda: index.size("0")),
        ("holder bool", lambda: index.match(True, chain)),
        ("holder float", lambda: index.capacity(0.0)),
        ("holder negative", lambda: index.size(-1)),
        ("holder removed", lambda: index.insert(1, chain)),
        ("holder past range", lambda: index.clear(3)),
        ("holder huge", lambda: index.evict(1 << 70, 1)),
        ("capacity negative", lambda: index.add_holder(-1)),
        ("capacity huge", lambda: index.set_capacity(0, 1 << 63)),
        ("capacity float", lambda: index.add_holder(2.5)),
        ("capacity bool", lambda: index.set_capacity(0, False)),
        ("chain list", lambda: index.match(0, list(chain))),
        ("chain signed", lambda: index.insert(0, array("q", [1, 2]))),
        ("chain 32-bit", lambda: index.match(2, array("I", [1, 2]))),
        ("chain bytes", lambda: index.match(0, b"12345678")),
        ("chain strided", lambda: index.match(0, memoryview(chain)[::2])),
        ("chain 2-d", lambda: index.match(0, memoryview(chain.tobytes()).cast("Q", (2, 2)))),
        ("chain none", lambda: index.truncate(0, None, 1)),
        ("n too big", lambda: index.insert(0, chain, 5)),
        ("n negative", lambda: index.insert(0, chain, -2)),
        ("n float", lambda: index.insert(0, chain, 1.0)),
        ("keep negative", lambda: index.truncate(0, chain, -1)),
        ("keep str", lambda: index.truncate(0, chain, "1")),
        ("count negative", lambda: index.evict(0, -1)),
        ("count none", lambda: index.evict(0, None)),
        ("out short", lambda: index.match_all(chain, array("i", [0, 0]))),
        ("out int64", lambda: index.match_all(chain, array("q", [0] * 3))),
        ("out read-only", lambda: index.match_all(chain, memoryview(array("i", [0] * 3).tobytes()).cast("i"))),
        ("out list", lambda: index.match_all(chain, [0, 0, 0])),
        ("out before chain", lambda: index.match_all([1], [0, 0, 0])),
        ("aliases list", lambda: index.insert(0, chain, -1, [1, 2, 3, 4])),
        ("aliases short", lambda: index.insert(0, chain, 2, array("Q", [1, 2]))),
        ("aliases signed", lambda: index.forget(0, array("q", [1]))),
        ("forget removed holder", lambda: index.forget(1, array("Q", [1]))),
        ("alias negative", lambda: index.key_of(0, -1)),
        ("alias huge", lambda: index.key_of(0, 1 << 64)),
        ("alias str", lambda: index.key_of(2, "1")),
    ]


def refusals(impl: ModuleType) -> list[tuple[str, type, str]]:
    index = impl.PrefixIndex()
    for cap in (4, 4, 4):
        index.add_holder(cap)
    index.remove_holder(1)
    chain = impl.block_chain(b"abcdefghijklmnop", 4)
    found = []
    for name, call in bad_calls(index, chain):
        with pytest.raises((TypeError, ValueError)) as err:
            call()
        found.append((name, err.type, str(err.value)))
    assert index.size(0) == 0 and index.capacity(0) == 4  # nothing changed on the way
    return found


def test_bad_input_is_refused_with_a_clear_error(impl: ModuleType) -> None:
    found = {name: (kind, msg) for name, kind, msg in refusals(impl)}
    assert found["holder str"] == (TypeError, "holder must be an int, not str")
    assert found["holder removed"] == (ValueError, "holder 1 is not in use")
    assert found["capacity negative"] == (ValueError, "capacity must be in [0, 2**63), got -1")
    assert found["chain list"] == (TypeError, "chain must be a buffer of uint64 (array('Q')), not list")
    assert found["chain signed"] == (TypeError, "chain must be a buffer of uint64 (array('Q')), not one of format 'q'")
    assert found["n too big"] == (ValueError, "n must be -1 or in [0, 4], got 5")
    assert found["out short"] == (ValueError, "out has 2 entries, fewer than n_holders (3)")
    assert found["aliases short"] == (ValueError, "aliases has 2 entries, not one per block of the chain (4)")
    assert found["alias negative"] == (ValueError, "alias must be in [0, 2**64), got -1")
    assert found["out read-only"] == (
        TypeError,
        "out must be a writable buffer of int32 (array('i')), not a read-only one",
    )


def test_both_refuse_alike(compiled: ModuleType) -> None:
    assert refusals(compiled) == refusals(_prefix_py)


def test_index_takes_no_arguments(impl: ModuleType) -> None:
    with pytest.raises(TypeError):
        impl.PrefixIndex(4)


# -- the two agree --------------------------------------------------------------------------------

BLOCK = 4


def segment(path: tuple[int, ...]) -> bytes:
    """The bytes a tree node adds to its parent's: 1 to 3 whole blocks, fixed by its path."""
    blocks = 1 + sum(path) % 3
    return (repr(path).encode() * BLOCK * 3)[: blocks * BLOCK]


def tree_chain(path: tuple[int, ...]) -> array[int]:
    data = b"".join(segment(path[: i + 1]) for i in range(len(path)))
    return _prefix_py.block_chain(data, BLOCK, 5)


# chains from a small tree of shared segments (most), or arbitrary keys with repeats (a few)
chain_st = st.one_of(
    st.lists(st.integers(0, 2), min_size=1, max_size=5).map(lambda p: tree_chain(tuple(p))),
    st.lists(st.integers(0, 5), max_size=6).map(lambda keys: array("Q", keys)),
)
holder_st = st.integers(-1, 5)
op_st = st.one_of(
    st.tuples(st.just("add_holder"), st.integers(0, 12)),
    st.tuples(st.just("remove_holder"), holder_st),
    st.tuples(st.just("insert"), holder_st, chain_st, st.integers(-1, 16)),
    st.tuples(st.just("insert"), holder_st, chain_st, st.just(-1)),
    st.tuples(st.just("set_capacity"), holder_st, st.integers(0, 12)),
    st.tuples(st.just("truncate"), holder_st, chain_st, st.integers(0, 16)),
    st.tuples(st.just("evict"), holder_st, st.integers(0, 6)),
    st.tuples(st.just("clear"), holder_st),
    st.tuples(st.just("match"), holder_st, chain_st),
    st.tuples(st.just("match_after"), holder_st, chain_st, st.integers(0, 16)),
    st.tuples(
        st.just("match_after_many"), holder_st, st.lists(chain_st, max_size=3), st.lists(st.integers(0, 16), max_size=3)
    ),
    st.tuples(st.just("match_all"), chain_st),
    st.tuples(st.just("size"), holder_st),
    st.tuples(st.just("insert_named"), holder_st, chain_st, st.integers(-1, 16), st.integers(0, 3)),
    st.tuples(st.just("forget"), holder_st, st.lists(st.integers(0, 9), max_size=4).map(lambda a: array("Q", a))),
    st.tuples(st.just("key_of"), holder_st, st.integers(0, 9)),
)


def names_of(chain: array[int], salt: int) -> array[int]:
    """Engine names for a chain's blocks, from few enough values that names often move between blocks."""
    return array("Q", [(key * 7 + salt) % 10 for key in chain])


def apply(index: Any, op: tuple[Any, ...]) -> Any:
    name, *args = op
    try:
        if name == "insert_named":
            holder, chain, n, salt = args
            return index.insert(holder, chain, n, names_of(chain, salt))
        if name == "match_all":
            out = array("i", [-1] * (index.n_holders + 1))
            index.match_all(args[0], out)
            return list(out)
        return getattr(index, name)(*args)
    except (TypeError, ValueError) as exc:  # bad holders, n past the chain: both refuse alike
        return ("error", type(exc), str(exc))


def assert_same(a: Any, b: Any, probes: list[array[int]]) -> None:
    assert a.n_holders == b.n_holders and a.total() == b.total()
    for h in range(a.n_holders):
        assert apply(a, ("size", h)) == apply(b, ("size", h))
        assert apply(a, ("capacity", h)) == apply(b, ("capacity", h))
        assert [apply(a, ("key_of", h, alias)) for alias in range(10)] == [
            apply(b, ("key_of", h, alias)) for alias in range(10)
        ]
    for chain in probes:
        assert apply(a, ("match_all", chain)) == apply(b, ("match_all", chain))


PROBES = [tree_chain(p) for p in [(0,), (0, 1), (0, 1, 2), (1, 1, 1, 1, 1), (2, 0, 2, 0), (0, 0, 0, 0, 0)]]


@given(ops=st.lists(op_st, max_size=40))
def test_compiled_equals_twin_over_any_history(compiled: ModuleType, ops: list[tuple[Any, ...]]) -> None:
    a, b = compiled.PrefixIndex(), _prefix_py.PrefixIndex()
    for op in ops:
        assert apply(a, op) == apply(b, op), op
        assert_same(a, b, PROBES)


def test_compiled_equals_twin_at_scale(compiled: ModuleType) -> None:
    # Enough blocks to grow the table and the pool many times, with deletions all along
    # (backward shifts across the wrap-around, reuse of freed entries).
    rng = random.Random(11)
    a, b = compiled.PrefixIndex(), _prefix_py.PrefixIndex()
    trunks = [rng.randbytes(64 * rng.randrange(1, 40)) for _ in range(30)]
    chains = [_prefix_py.block_chain(t + rng.randbytes(64 * rng.randrange(0, 60)), 64, 1) for t in trunks * 4]
    for cap in (3000, 500, 8000, 0, 1200):
        assert a.add_holder(cap) == b.add_holder(cap)
    for step in range(1500):
        h = rng.randrange(5)
        chain = rng.choice(chains)
        roll = rng.random()
        if roll < 0.3:
            op: tuple[Any, ...] = ("insert", h, chain, -1)
        elif roll < 0.6:
            op = ("insert", h, chain, -1, array("Q", [k >> 50 for k in chain]))  # some names shared
        elif roll < 0.65:
            op = ("forget", h, array("Q", [k >> 50 for k in rng.choice(chains)[rng.randrange(3) :]]))
        elif roll < 0.8:
            op = ("match_all", chain)
        elif roll < 0.9:
            op = ("truncate", h, chain, rng.randrange(len(chain) + 1))
        elif roll < 0.97:
            op = ("evict", h, rng.randrange(200))
        else:
            op = ("set_capacity", h, rng.randrange(100, 9000))
        assert apply(a, op) == apply(b, op), (step, op)
    assert_same(a, b, chains)
    assert a.total() > 5000
    names = sorted({k >> 50 for c in chains for k in c})
    for h in range(5):
        assert [a.key_of(h, x) for x in names] == [b.key_of(h, x) for x in names]


def test_compiled_equals_twin_in_a_crowded_small_table(compiled: ModuleType) -> None:
    # At most 8 blocks, so the table keeps its first 16 slots and its probe runs often wrap
    # past the end: deletions must shift entries back across the wrap-around too.
    rng = random.Random(5)
    keys = [array("Q", [rng.getrandbits(64)]) for _ in range(40)]
    a, b = compiled.PrefixIndex(), _prefix_py.PrefixIndex()
    for index in (a, b):
        index.add_holder(6)
    for step in range(3000):
        chain = array("Q", [*rng.choice(keys), *rng.choice(keys)][: rng.randrange(1, 3)])
        roll = rng.random()
        op: tuple[Any, ...] = (
            ("insert", 0, chain, -1) if roll < 0.8 else ("truncate", 0, chain, 0) if roll < 0.95 else ("evict", 0, 2)
        )
        assert apply(a, op) == apply(b, op), (step, op)
        assert [a.match(0, k) for k in keys] == [b.match(0, k) for k in keys], step
    assert a.memory_bytes() < 2000  # the table never grew


# -- golden answers --------------------------------------------------------------------------------


def vector_id(v: dict[str, Any]) -> str:
    return f"{'text' if 'text' in v else 'hex'}-{v['block_len']}-{v['seed']}"


@pytest.mark.parametrize("vector", GOLDEN["chains"], ids=vector_id)
def test_golden_block_keys(impl: ModuleType, vector: dict[str, Any]) -> None:
    data = vector["text"] if "text" in vector else bytes.fromhex(vector["hex"])
    assert list(impl.block_chain(data, vector["block_len"], vector["seed"])) == vector["keys"]


def parts_id(v: dict[str, Any]) -> str:
    return f"{len(v['parts'])}parts-{v['block_len']}-{v['seed']}"


@pytest.mark.parametrize("vector", GOLDEN["parts"], ids=parts_id)
def test_golden_parts(impl: ModuleType, vector: dict[str, Any]) -> None:
    parts = [p["text"] if "text" in p else bytes.fromhex(p["hex"]) for p in vector["parts"]]
    chain, total, head = impl.chain_of_parts(parts, vector["block_len"], vector["seed"], vector["mark"])
    assert (list(chain), total, head) == (vector["keys"], vector["total"], vector["head"])


def test_golden_history(impl: ModuleType) -> None:
    history = GOLDEN["history"]
    chains = [impl.block_chain(p, history["block_len"], history["seed"]) for p in history["prompts"]]
    assert [list(c) for c in chains] == history["chains"]
    index = impl.PrefixIndex()
    for *op, expected in history["steps"]:
        name, *args = op
        if name == "match_all":
            out = array("i", [0] * index.n_holders)
            index.match_all(chains[args[0]], out)
            got: Any = list(out)
        elif name in ("insert", "match", "truncate"):
            got = getattr(index, name)(args[0], chains[args[1]], *args[2:])
        else:
            got = getattr(index, name)(*args)
        assert got == expected, op
