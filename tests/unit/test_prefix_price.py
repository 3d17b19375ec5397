"""PrefixIndex.price, one routing decision: its arithmetic, gating, ties, history, exclusions, the
spread term and refusals on both implementations, and the two giving bit-equal costs on any index
and fleet."""

from __future__ import annotations

import math
import random
from array import array
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twins import implementations

from router import _prefix_py, prefix
from router._compat import NO_EXTENSIONS

IMPLEMENTATIONS = implementations("_prefix", _prefix_py)
COMPILED = IMPLEMENTATIONS.get("compiled")
CANDIDATE, GATED, NEAR = 1, 2, 4
UNTOUCHED = -7.0  # what the output rows hold before the call: excluded positions keep it
UNTOUCHED_FLAGS = 0xEE


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request: pytest.FixtureRequest) -> ModuleType:
    return IMPLEMENTATIONS[request.param]


@pytest.fixture
def compiled() -> ModuleType:
    if COMPILED is None:
        pytest.skip("installed with ROUTER_NO_EXTENSIONS=1: no compiled module to test")
    return COMPILED


@dataclass
class Fleet:
    """The per-position inputs of one decision, as lists; `call` turns them into the buffers."""

    holders: list[int]
    busy_until: list[float] = field(default_factory=list)
    seconds_per_token: list[float] = field(default_factory=list)
    loads: list[int] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)
    caps: list[int] = field(default_factory=list)
    excluded: list[int] = field(default_factory=list)
    recent: list[float] | None = None  # None: price gets no recent buffer
    known: list[float] | None = None  # None: price gets no known buffer (the index answers everywhere)
    evicts: list[float] | None = None  # None: price gets no evicts buffer (no eviction is priced)

    def __post_init__(self) -> None:
        n = len(self.holders)
        self.busy_until = self.busy_until or [0.0] * n
        self.seconds_per_token = self.seconds_per_token or [1e-3] * n
        self.loads = self.loads or [0] * n
        self.waiting = self.waiting or [-1.0] * n
        self.caps = self.caps or [1 << 40] * n
        self.excluded = self.excluded or [0] * n


@dataclass
class Decision:
    best: int
    near: int
    cached: list[float]
    wait: list[float]
    cost: list[float]
    flags: list[int]
    spread: list[float] | None  # None: price got no spread_out
    home: int = -1


SCALARS = {
    "now": 0.0,
    "decode_s": 0.0,
    "mean_uncached": 0.0,
    "block_tokens": 16.0,
    "total_tokens": 1000.0,
    "last": -1,
    "history_blocks": 0,
    "tie_s": 0.0,
    "tie_share": 0.0,
    "recent_scale": 1.0,
    "spread_tokens": 0.0,
    "interference": 0.0,
    "history_from_all": False,
    "home_share": -1.0,
    "spread_whole": False,
}
LATER = ("recent_scale", "spread_tokens", "interference", "history_from_all", "home_share", "spread_whole")


def decide(
    index: Any, chain: array[int], fleet: Fleet, *, spread_out: bool = True, legacy: bool = False, **scalars: Any
) -> Decision:
    """price on `fleet`; legacy: called with the arguments price had before the spread term only
    (the fleet has no recent, the scalars none of LATER), else with all of them."""
    s = SCALARS | scalars
    n = len(fleet.holders)
    cached, wait, cost = (array("d", [UNTOUCHED] * n) for _ in range(3))
    flags = array("B", [UNTOUCHED_FLAGS] * n)
    spread = array("d", [UNTOUCHED] * n) if spread_out and not legacy else None
    extra: dict[str, Any] = {}
    if legacy:
        assert fleet.recent is None and not any(name in scalars for name in LATER)
    else:
        extra = {
            "recent": None if fleet.recent is None else array("d", fleet.recent),
            "spread_out": spread,
            **({} if fleet.known is None else {"known": array("d", fleet.known)}),
            **({} if fleet.evicts is None else {"evicts": array("d", fleet.evicts)}),
            **{name: s[name] for name in LATER},
        }
    best, near, home = index.price(
        chain,
        array("i", fleet.holders),
        array("d", fleet.busy_until),
        array("d", fleet.seconds_per_token),
        array("q", fleet.loads),
        array("d", fleet.waiting),
        array("q", fleet.caps),
        array("B", fleet.excluded),
        s["now"],
        s["decode_s"],
        s["mean_uncached"],
        s["block_tokens"],
        s["total_tokens"],
        s["last"],
        s["history_blocks"],
        s["tie_s"],
        s["tie_share"],
        cached,
        wait,
        cost,
        flags,
        **extra,
    )
    return Decision(
        best, near, list(cached), list(wait), list(cost), list(flags), None if spread is None else list(spread), home
    )


def index_holding(impl: ModuleType, chain: array[int], *blocks: int) -> Any:
    """An index of len(blocks) holders, holder h keeping the first blocks[h] blocks of `chain`."""
    index = impl.PrefixIndex()
    for count in blocks:
        h = index.add_holder(1000)
        index.insert(h, chain, count)
    return index


CHAIN = _prefix_py.block_chain(bytes(range(256)) * 16, 64, 3)  # 64 blocks


def test_flags_are_exported_alike(impl: ModuleType) -> None:
    assert (impl.PRICE_CANDIDATE, impl.PRICE_GATED, impl.PRICE_NEAR) == (CANDIDATE, GATED, NEAR)
    assert type(impl.SPREAD_SMOOTH) is float and impl.SPREAD_SMOOTH == 4.0


def test_the_selector_exports_what_this_run_asked_for() -> None:
    chosen = _prefix_py if NO_EXTENSIONS else COMPILED
    assert chosen is not None
    assert prefix.chain_of_parts is chosen.chain_of_parts and prefix.PrefixIndex is chosen.PrefixIndex
    assert (prefix.PRICE_CANDIDATE, prefix.PRICE_GATED, prefix.PRICE_NEAR) == (CANDIDATE, GATED, NEAR)


HAND: dict[str, Any] = {"now": 2.0, "decode_s": 1 / 128, "mean_uncached": 128.0, "tie_s": 1 / 16, "tie_share": 0.25}


def hand_fleet(recent: list[float] | None = None) -> Fleet:
    """The hand-computed decisions' fleet: 0 and 1 hold 40 and 10 blocks (index_holding), 2 nothing."""
    return Fleet(
        holders=[0, 1, -1],
        busy_until=[2.5, 1.0, 0.0],
        seconds_per_token=[1 / 1024, 1 / 2048, 1 / 1024],
        loads=[2, 0, 1],
        waiting=[5.0, -1.0, 1.0],
        recent=recent,
    )


def test_a_hand_computed_decision(impl: ModuleType) -> None:
    # Powers of two throughout, so every figure below is exact.
    #   0: 40 blocks = 640 cached, 360 to compute at 1/1024 s; queued 0.5 s, 2 in flight
    #      (2/128 s), 5 waiting so 3 queued by others (3 x 128 tokens x 1/1024 s)
    #   1: 10 blocks = 160 cached, 840 at 1/2048 s; its queue drained before now, nothing waits
    #   2: no holder yet: all 1000 tokens at 1/1024 s; 1 in flight, 1 waiting (that one)
    index = index_holding(impl, CHAIN, 40, 10)
    fleet = hand_fleet()
    got = decide(index, CHAIN, fleet, **HAND)
    assert got.cached == [640.0, 160.0, 0.0]
    assert got.wait == [0.5 + 2 / 128 + 3 * 128 / 1024, 0.0, 1 / 128]
    assert got.cost == [0.890625 + 360 / 1024, 840 / 2048, 1 / 128 + 1000 / 1024]
    # best 0.41015625; the margin is max(1/16, 0.41015625 / 4) = 0.1025390625: only itself
    assert (got.best, got.near) == (1, 1)
    assert got.flags == [CANDIDATE, CANDIDATE | NEAR, CANDIDATE]
    assert got.spread == [0.0, 0.0, 0.0]  # no recent: no spread
    assert index.total() == 50  # a decision changes nothing in the index


def test_a_hand_computed_spread(impl: ModuleType) -> None:
    # The fleet above with a 1024-token prompt (uncached 384, 864, 1024) and recent requests
    # 3, 3, 0 at scale 2: r = 6, 6, 0, mean 4, so 0 and 1 are 2 over it, excess 2 / (4 + 4) = 1/4.
    #   0: 8192 x 1/1024 x 1/4 x 384 / 1024 = 0.75 s     1: 8192 x 1/2048 x 1/4 x 864 / 1024 = 0.84375 s
    index = index_holding(impl, CHAIN, 40, 10)
    fleet = hand_fleet(recent=[3.0, 3.0, 0.0])
    scalars = HAND | {"total_tokens": 1024.0, "recent_scale": 2.0}
    plain = decide(index, CHAIN, fleet, **scalars)
    assert plain.cost == [0.890625 + 0.375, 0.421875, 1 / 128 + 1.0] and plain.best == 1
    got = decide(index, CHAIN, fleet, spread_tokens=8192.0, **scalars)
    assert got.spread == [0.75, 0.84375, 0.0]
    assert got.cached == plain.cached and got.wait == plain.wait
    assert got.cost == [1.265625 + 0.75, 0.421875 + 0.84375, 1.0078125]
    # the spread moves the request off the busy holder; margin max(1/16, 1.0078125 / 4) leaves 1 out
    assert (got.best, got.near) == (2, 1)
    assert got.flags == [CANDIDATE, CANDIDATE, CANDIDATE | NEAR]


def test_a_new_conversations_spread_is_charged_whole(impl: ModuleType) -> None:
    # the fleet above, spread_whole: every position over the mean pays as if it computed the whole
    # prompt, the holder of most of it (0, 384 uncached) as much as one holding none
    #   0: 8192 x 1/1024 x 1/4 x 1024 / 1024 = 2.0 s     1: 8192 x 1/2048 x 1/4 x 1024 / 1024 = 1.0 s
    index = index_holding(impl, CHAIN, 40, 10)
    fleet = hand_fleet(recent=[3.0, 3.0, 0.0])
    scalars = HAND | {"total_tokens": 1024.0, "recent_scale": 2.0, "spread_tokens": 8192.0}
    scaled = decide(index, CHAIN, fleet, **scalars)
    whole = decide(index, CHAIN, fleet, spread_whole=True, **scalars)
    assert whole.spread == [2.0, 1.0, 0.0] and scaled.spread == [0.75, 0.84375, 0.0]
    assert whole.cached == scaled.cached and whole.wait == scaled.wait
    assert whole.cost == [1.265625 + 2.0, 0.421875 + 1.0, 1.0078125]
    # and at least what the shared prefix there saves it: its messages before the last (30 blocks,
    # 480 tokens), as far as a replica holds them. With 64 spread tokens, 0 (holding 640) pays for 480
    # and 1 for the 160 it holds:  0: 480 x 1/1024 x 1/4     1: 160 x 1/2048 x 1/4 = 0.01953125 s
    small = scalars | {"spread_tokens": 64.0, "history_blocks": 30}
    held = decide(index, CHAIN, fleet, spread_whole=True, **small)
    assert held.cached[:2] == [640.0, 160.0] and held.spread == [480 / 1024 / 4, 0.01953125, 0.0]
    # a prompt that is all its last message (no history) pays the spread tokens alone
    alone = decide(index, CHAIN, fleet, spread_whole=True, **(small | {"history_blocks": 0}))
    assert alone.spread == [64 / 1024 / 4, 64 / 2048 / 4, 0.0]
    # without a spread term it changes nothing
    assert decide(index, CHAIN, fleet, **(scalars | {"spread_tokens": 0.0, "spread_whole": True})) == decide(
        index, CHAIN, fleet, **(scalars | {"spread_tokens": 0.0})
    )


def test_the_last_server_never_pays_the_spread(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    fleet = Fleet(holders=[-1] * 4, seconds_per_token=[1 / 1024] * 4, recent=[0.0, 16.0, 0.0, 16.0])
    scalars = {"total_tokens": 1024.0, "spread_tokens": 1024.0}
    over = (((1024.0 * (1 / 1024)) * ((16.0 - 8.0) / (8.0 + 4.0))) * 1024.0) / 1024.0  # mean 8
    assert decide(index, CHAIN, fleet, **scalars).spread == [0.0, over, 0.0, over]
    for last in range(4):
        got = decide(index, CHAIN, fleet, last=last, **scalars)
        assert got.spread == [0.0 if i == last or i % 2 == 0 else over for i in range(4)]
        assert got.cost[last] == 1.0  # its cost is the plain one


def test_excluded_positions_do_not_count_in_the_mean_and_gated_ones_do(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    fleet = Fleet(
        holders=[-1] * 4,
        seconds_per_token=[1 / 1024] * 4,
        loads=[0, 5, 0, 0],
        caps=[9, 5, 9, 9],  # 1 is gated
        excluded=[1, 0, 0, 0],
        recent=[1000.0, 0.0, 8.0, 4.0],
    )
    # mean (0 + 8 + 4) / 3 = 4: only 2 is over it, excess 4 / 8; 64 x 1/1024 x 1/2 x 1024 / 1024
    got = decide(index, CHAIN, fleet, total_tokens=1024.0, spread_tokens=64.0)
    assert got.spread == [UNTOUCHED, 0.0, 1 / 32, 0.0]
    assert got.cost == [UNTOUCHED, 1.0, 1.0 + 1 / 32, 1.0]
    assert (got.best, got.near) == (3, 1) and got.flags == [
        UNTOUCHED_FLAGS,
        CANDIDATE | GATED,
        CANDIDATE,
        CANDIDATE | NEAR,
    ]
    fleet.excluded = [0, 0, 0, 0]  # now 0 counts: mean 253, and only 0 is over it
    got = decide(index, CHAIN, fleet, total_tokens=1024.0, spread_tokens=64.0)
    assert (
        got.spread[1:] == [0.0, 0.0, 0.0]
        and got.spread[0] == (64.0 / 1024 * ((1000.0 - 253.0) / 257.0) * 1024.0) / 1024.0
    )


def test_cached_tokens_stop_at_the_prompt(impl: ModuleType) -> None:
    index = index_holding(impl, CHAIN, 64)
    got = decide(index, CHAIN, Fleet(holders=[0]), total_tokens=900.0)  # 64 blocks x 16 = 1024 > 900
    assert got.cached == [900.0] and got.cost == [0.0]


def test_a_gated_candidate_is_priced_but_never_picked(impl: ModuleType) -> None:
    index = index_holding(impl, CHAIN, 64, 0)
    fleet = Fleet(holders=[0, 1], loads=[3, 5], caps=[3, 6])  # 0 is at its cap
    got = decide(index, CHAIN, fleet, decode_s=0.0, tie_s=100.0)
    assert got.cost[0] < got.cost[1]
    assert (got.best, got.near) == (1, 1)  # the near-ties leave the gated one out too
    assert got.flags == [CANDIDATE | GATED, CANDIDATE | NEAR]


def test_every_candidate_gated_leaves_the_fallback_to_the_caller(impl: ModuleType) -> None:
    index = index_holding(impl, CHAIN, 64, 0)
    got = decide(index, CHAIN, Fleet(holders=[0, 1], loads=[1, 9], caps=[1, 0]), tie_s=100.0)
    assert (got.best, got.near) == (-1, 0)
    assert got.flags == [CANDIDATE | GATED] * 2 and got.cost[0] < got.cost[1]


def test_equal_costs_pick_the_lowest_position_and_all_are_near(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    got = decide(index, CHAIN, Fleet(holders=[-1, -1, -1, -1], excluded=[1, 0, 0, 0]))
    assert (got.best, got.near) == (1, 3)
    assert got.flags[1:] == [CANDIDATE | NEAR] * 3


def test_near_ties_take_the_larger_of_the_two_margins(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    # costs 1, 1.05, 1.1, 1.3 s (all tokens at 1 ms, different queues)
    fleet = Fleet(holders=[-1] * 4, busy_until=[0.0, 0.05, 0.1, 0.3])
    assert decide(index, CHAIN, fleet, tie_s=0.0).near == 1
    assert decide(index, CHAIN, fleet, tie_s=0.06).near == 2
    assert decide(index, CHAIN, fleet, tie_s=0.06, tie_share=0.12).near == 3  # 0.12 x 1 s beats 0.06
    got = decide(index, CHAIN, fleet, tie_s=0.5, tie_share=0.12)
    assert (got.best, got.near) == (0, 4) and all(f & NEAR for f in got.flags)


def test_the_last_server_holds_at_least_the_history(impl: ModuleType) -> None:
    index = index_holding(impl, CHAIN, 8, 8, 30)
    fleet = Fleet(holders=[0, 1, 2])
    got = decide(index, CHAIN, fleet, last=1, history_blocks=20)
    assert got.cached == [128.0, 320.0, 480.0]  # the history lifts only `last`, and only above its match
    assert decide(index, CHAIN, fleet, last=2, history_blocks=20).cached == [128.0, 128.0, 480.0]
    assert decide(index, CHAIN, fleet, last=-1, history_blocks=20).cached == [128.0, 128.0, 480.0]
    assert decide(index, CHAIN, Fleet(holders=[-1]), last=0, history_blocks=1 << 70).cached == [1000.0]


def test_with_history_from_all_the_last_server_holds_what_any_holds(impl: ModuleType) -> None:
    index = index_holding(impl, CHAIN, 8, 8, 30)
    fleet = Fleet(holders=[0, 1, 2])
    got = decide(index, CHAIN, fleet, last=1, history_blocks=20, history_from_all=True)
    assert got.cached == [128.0, 480.0, 480.0]  # holder 2's 30 blocks beat the history's 20
    fleet.excluded = [0, 0, 1]  # an excluded position still says what is held
    got = decide(index, CHAIN, fleet, last=1, history_blocks=20, history_from_all=True)
    assert got.cached == [128.0, 480.0, UNTOUCHED]
    got = decide(index, CHAIN, fleet, last=1, history_blocks=40, history_from_all=True)
    assert got.cached[1] == 640.0  # the history, when it is more
    assert decide(index, CHAIN, fleet, last=-1, history_from_all=True).cached == [128.0, 128.0, UNTOUCHED]


def test_known_tokens_replace_the_match_and_the_history(impl: ModuleType) -> None:
    """A position whose engine's events say what it holds is priced by that, not by the model."""
    index = index_holding(impl, CHAIN, 8, 8, 30)
    fleet = Fleet(holders=[0, 1, 2], known=[-1.0, 64.0, 5000.0])
    got = decide(index, CHAIN, fleet, last=1, history_blocks=20, history_from_all=True)
    # 0: its match (8 x 16); 1: what it is known to hold, though it is `last` and any holder keeps 30
    # blocks; 2: known, stopped at the prompt
    assert got.cached == [128.0, 64.0, 1000.0]
    assert got.best == 2 and got.cost[2] == 0.0
    fleet.known = [0.0, -0.5, -1.0]  # 0 is known to hold nothing; any negative asks the index
    assert decide(index, CHAIN, fleet, last=1, history_blocks=20).cached == [0.0, 320.0, 480.0]


def test_what_a_placement_evicts_is_added_to_its_cost_and_nothing_else(impl: ModuleType) -> None:
    """evicts[i]: seconds of prefill what the request would push out there costs the conversations
    likely to come back. It is part of the cost (and so of the best and the ties), not of the wait."""
    index = index_holding(impl, CHAIN, 40, 10)
    fleet = hand_fleet()
    before = decide(index, CHAIN, fleet, **HAND)
    fleet.evicts = [0.0, 0.0, 0.0]
    assert_same(decide(index, CHAIN, fleet, **HAND), before)  # zeros add nothing, bit for bit
    fleet.evicts = [0.0, 2.0, 0.25]
    got = decide(index, CHAIN, fleet, **HAND)
    assert got.wait == before.wait and got.cached == before.cached and got.spread == before.spread
    assert got.cost == [before.cost[0], before.cost[1] + 2.0, before.cost[2] + 0.25]
    assert before.best == 1 and got.best != 1  # the cheapest to compute destroys the most: it loses


def test_interference_scales_each_speed_by_its_load(impl: ModuleType) -> None:
    # the hand-computed fleet at interference 1/2: s/token x 2, x 1 and x 1.5 for 2, 0 and 1 in flight
    index = index_holding(impl, CHAIN, 40, 10)
    fleet = hand_fleet()
    got = decide(index, CHAIN, fleet, interference=0.5, **HAND)
    assert got.wait == [0.5 + 2 / 128 + 3 * 128 * 2 / 1024, 0.0, 1 / 128]  # others' queue at the scaled speed too
    assert got.cost == [1.265625 + 360 * 2 / 1024, 840 / 2048, 1 / 128 + 1000 * 1.5 / 1024]
    # the same doubles as speeds scaled beforehand
    speeds = zip(fleet.seconds_per_token, fleet.loads, strict=True)
    fleet.seconds_per_token = [s * (1.0 + 0.5 * load) for s, load in speeds]
    assert_same(decide(index, CHAIN, fleet, **HAND), got)


def test_the_home_holds_the_most_of_the_prompt_and_at_least_its_share(impl: ModuleType) -> None:
    index = index_holding(impl, CHAIN, 8, 8, 30)  # 128, 128 and 480 of 1000 tokens
    fleet = Fleet(holders=[0, 1, 2])
    assert decide(index, CHAIN, fleet).home == -1  # not asked for
    assert decide(index, CHAIN, fleet, home_share=0.5).home == -1  # 480 < 500
    assert decide(index, CHAIN, fleet, home_share=0.25).home == 2
    fleet.excluded = [0, 0, 1]
    assert decide(index, CHAIN, fleet, home_share=0.0).home == 1  # of equals, the highest position
    fleet.loads, fleet.caps = [0, 9, 0], [9, 9, 9]  # gated: still the home (the stay margin decides)
    assert decide(index, CHAIN, fleet, home_share=0.1).home == 1
    assert decide(index_holding(impl, CHAIN, 0, 0), CHAIN, Fleet(holders=[0, 1]), home_share=0.0).home == -1


def test_excluded_positions_are_left_alone(impl: ModuleType) -> None:
    index = index_holding(impl, CHAIN, 64, 0)
    got = decide(index, CHAIN, Fleet(holders=[0, 1, -1], excluded=[1, 0, 7]), tie_s=100.0)
    assert (got.best, got.near) == (1, 1)
    assert got.cached[0] == got.cost[2] == UNTOUCHED and got.flags == [UNTOUCHED_FLAGS, CANDIDATE | NEAR, 0xEE]
    got = decide(index, CHAIN, Fleet(holders=[0, 1], excluded=[1, 1]))
    assert (got.best, got.near) == (-1, 0) and got.flags == [UNTOUCHED_FLAGS] * 2


def test_unknown_or_own_waiting_adds_nothing(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    fleet = Fleet(holders=[-1] * 4, loads=[2, 2, 2, 2], waiting=[-1.0, 1.0, 2.0, 3.5])
    got = decide(index, CHAIN, fleet, decode_s=0.5, mean_uncached=100.0, total_tokens=0.0)
    assert got.wait == [1.0, 1.0, 1.0, 1.0 + 1.5 * 100.0 * 1e-3]


def test_empty_fleet_and_empty_prompt(impl: ModuleType) -> None:
    index = index_holding(impl, CHAIN, 64)
    got = decide(index, CHAIN, Fleet(holders=[]))
    assert (got.best, got.near, got.cost) == (-1, 0, [])
    got = decide(index, array("Q"), Fleet(holders=[0]), total_tokens=10.0)
    assert got.cached == [0.0] and (got.best, got.near) == (0, 1)


def test_buffers_may_be_longer_or_numpy(impl: ModuleType) -> None:
    np = pytest.importorskip("numpy")
    index = index_holding(impl, CHAIN, 64, 3)
    args = [
        np.frombuffer(CHAIN.tobytes(), dtype=np.uint64),
        np.array([0, 1], dtype=np.int32),
        np.array([0.0, 0.0, 9.0]),  # longer than the fleet: the rest is not read
        np.array([1e-3, 2e-3]),
        np.array([0, 1], dtype=np.int64),
        np.array([-1.0, 4.0]),
        np.array([9, 9], dtype=np.int64),
        np.zeros(2, dtype=np.uint8),
    ]
    outs = [np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(2, dtype=np.uint8)]
    scalars = [1.0, 0.01, 50.0, 16.0, 2000.0, 1, 5, 0.001, 0.1]
    spread = np.zeros(3)
    best, near, _ = index.price(
        *args,
        *scalars,
        *outs,
        recent=np.array([9.0, 0.0, 1e9]),
        recent_scale=0.5,
        spread_tokens=300.0,
        spread_out=spread,
    )
    want = decide(
        index,
        CHAIN,
        Fleet([0, 1], [0.0, 0.0], [1e-3, 2e-3], [0, 1], [-1.0, 4.0], [9, 9], recent=[9.0, 0.0]),
        now=1.0,
        decode_s=0.01,
        mean_uncached=50.0,
        last=1,
        total_tokens=2000.0,
        history_blocks=5,
        tie_s=0.001,
        tie_share=0.1,
        recent_scale=0.5,
        spread_tokens=300.0,
    )
    assert (best, near) == (want.best, want.near)
    assert [o.tolist() for o in outs] == [want.cached, want.wait, want.cost, want.flags]
    assert want.spread is not None and want.spread[0] > 0.0  # 0 is over the mean (last is 1)
    assert spread.tolist() == [*want.spread, 0.0]


# -- bad input: the same refusals both ways --------------------------------------------------------


def good_args(index: Any) -> list[Any]:
    n = 2
    return [
        CHAIN,
        array("i", [0, -1]),
        array("d", [0.0] * n),
        array("d", [1e-3] * n),
        array("q", [0] * n),
        array("d", [-1.0] * n),
        array("q", [4] * n),
        array("B", [0] * n),
        0.0,
        0.01,
        10.0,
        16.0,
        100.0,
        -1,
        0,
        0.0,
        0.0,
        array("d", [0.0] * n),
        array("d", [0.0] * n),
        array("d", [0.0] * n),
        array("B", [0] * n),
        array("d", [0.0] * n),
        1.0,
        0.0,
        array("d", [0.0] * n),
        0.0,
        False,
        -1.0,
        None,
        False,
        None,
    ]


OUTS = (17, 18, 19, 20, 24)  # good_args' positions of the output rows
BAD = [
    ("chain list", 0, [1, 2]),
    ("chain signed", 0, array("q", [1])),
    ("holders int64", 1, array("q", [0, -1])),
    ("holders list", 1, [0, -1]),
    ("busy_until float32", 2, array("f", [0.0, 0.0])),
    ("busy_until short", 2, array("d", [0.0])),
    ("seconds_per_token none", 3, None),
    ("loads int32", 4, array("i", [0, 0])),
    ("loads short", 4, array("q", [0])),
    ("waiting 2-d", 5, memoryview(array("d", [0.0] * 4).tobytes()).cast("d", (2, 2))),
    ("caps strided", 6, memoryview(array("q", [4] * 4))[::2]),
    ("excluded bool list", 7, [False, False]),
    ("excluded short", 7, array("B", [0])),
    ("now str", 8, "0"),
    ("decode_s none", 9, None),
    ("mean_uncached bool", 10, True),
    ("total_tokens huge", 12, 1 << 1100),
    ("last float", 13, 0.0),
    ("last too big", 13, 2),
    ("last below -1", 13, -2),
    ("history_blocks negative", 14, -1),
    ("history_blocks float", 14, 1.0),
    ("tie_share str", 16, "x"),
    ("cached_out read-only", 17, memoryview(array("d", [0.0] * 2).tobytes()).cast("d")),
    ("wait_out short", 18, array("d", [0.0])),
    ("cost_out ints", 19, array("q", [0, 0])),
    ("flags_out bytes", 20, b"\x00\x00"),
    ("flags_out short", 20, memoryview(bytearray(1))),
    ("holder removed", 1, array("i", [1, -1])),
    ("holder past range", 1, array("i", [0, 5])),
    ("holder below -1", 1, array("i", [-2, 0])),
    ("recent list", 21, [0.0, 0.0]),
    ("recent int64", 21, array("q", [0, 0])),
    ("recent short", 21, array("d", [0.0])),
    ("recent 2-d", 21, memoryview(array("d", [0.0] * 4).tobytes()).cast("d", (2, 2))),
    ("recent_scale str", 22, "1"),
    ("recent_scale none", 22, None),
    ("spread_tokens bool", 23, True),
    ("spread_tokens huge", 23, 1 << 1100),
    ("spread_out read-only", 24, memoryview(array("d", [0.0] * 2).tobytes()).cast("d")),
    ("spread_out short", 24, array("d", [0.0])),
    ("spread_out float32", 24, array("f", [0.0, 0.0])),
    ("interference str", 25, "0"),
    ("interference none", 25, None),
    ("history_from_all int", 26, 1),
    ("history_from_all none", 26, None),
    ("home_share str", 27, "0.5"),
    ("home_share huge", 27, 1 << 1100),
    ("spread_whole int", 29, 1),
    ("spread_whole none", 29, None),
    ("evicts list", 30, [0.0, 0.0]),
    ("evicts short", 30, array("d", [0.0])),
    ("evicts int64", 30, array("q", [0, 0])),
]


def refusals(impl: ModuleType) -> dict[str, tuple[type, str]]:
    index = impl.PrefixIndex()
    index.add_holder(10)
    index.add_holder(10)
    index.remove_holder(1)
    found = {}
    for name, position, value in BAD:
        args = good_args(index)
        args[position] = value
        with pytest.raises((TypeError, ValueError, OverflowError)) as err:
            index.price(*args)
        found[name] = (err.type, str(err.value))
        assert not any(any(args[k]) for k in OUTS if isinstance(args[k], array))  # checked before written
    assert index.price(*good_args(index)) == (0, 2, -1)  # both hold nothing: a tie
    assert index.price(*good_args(index)[:21]) == (0, 2, -1)  # the spread's arguments and later are optional
    args = good_args(index)
    args[21] = args[24] = None
    assert index.price(*args) == (0, 2, -1)
    return found


def test_bad_input_is_refused_with_a_clear_error(impl: ModuleType) -> None:
    found = refusals(impl)
    assert found["chain list"] == (TypeError, "chain must be a buffer of uint64 (array('Q')), not list")
    assert found["holders int64"] == (
        TypeError,
        "holders must be a buffer of int32 (array('i')), not one of format 'q'",
    )
    assert found["busy_until short"] == (ValueError, "busy_until has 1 entries, fewer than holders (2)")
    assert found["loads int32"] == (TypeError, "loads must be a buffer of int64 (array('q')), not one of format 'i'")
    assert found["excluded bool list"] == (TypeError, "excluded must be a buffer of uint8 (array('B')), not list")
    assert found["now str"] == (TypeError, "now must be a float, not str")
    assert found["last too big"] == (ValueError, "last must be -1 or in [0, 2), got 2")
    assert found["history_blocks negative"] == (ValueError, "history_blocks must be non-negative, got -1")
    assert found["cached_out read-only"] == (
        TypeError,
        "cached_out must be a writable buffer of float64 (array('d')), not a read-only one",
    )
    assert found["flags_out bytes"][0] is TypeError
    assert found["holder removed"] == (ValueError, "holders[0] is 1, not -1 or a holder in use")
    assert found["holder below -1"] == (ValueError, "holders[0] is -2, not -1 or a holder in use")
    assert found["recent list"] == (TypeError, "recent must be a buffer of float64 (array('d')), not list")
    assert found["recent int64"] == (
        TypeError,
        "recent must be a buffer of float64 (array('d')), not one of format 'q'",
    )
    assert found["recent short"] == (ValueError, "recent has 1 entries, fewer than holders (2)")
    assert found["recent 2-d"] == (TypeError, "recent must be a one-dimensional contiguous buffer")
    assert found["recent_scale none"] == (TypeError, "recent_scale must be a float, not NoneType")
    assert found["spread_tokens bool"] == (TypeError, "spread_tokens must be a float, not bool")
    assert found["spread_out read-only"] == (
        TypeError,
        "spread_out must be a writable buffer of float64 (array('d')), not a read-only one",
    )
    assert found["spread_out short"] == (ValueError, "spread_out has 1 entries, fewer than holders (2)")
    assert found["interference str"] == (TypeError, "interference must be a float, not str")
    assert found["history_from_all int"] == (TypeError, "history_from_all must be a bool, not int")
    assert found["home_share str"] == (TypeError, "home_share must be a float, not str")


def test_an_excluded_position_may_name_any_holder(impl: ModuleType) -> None:
    index = impl.PrefixIndex()
    got = decide(index, CHAIN, Fleet(holders=[99, -1], excluded=[1, 0]))
    assert got.best == 1


def test_both_refuse_alike(compiled: ModuleType) -> None:
    assert refusals(compiled) == refusals(_prefix_py)


# -- the two agree --------------------------------------------------------------------------------

BASE = _prefix_py.block_chain(random.Random(4).randbytes(64 * 48), 64, 8)  # 48 blocks
OTHER = _prefix_py.block_chain(random.Random(5).randbytes(64 * 16), 64, 8)

seconds_st = st.one_of(
    st.floats(0, 5, allow_subnormal=False),
    st.sampled_from([0.0, -0.0, 1e-300, 1.0 / 3, math.inf, -math.inf, math.nan]),
)
position_st = st.fixed_dictionaries(
    {
        "holder": st.integers(-1, 5),
        "busy_until": st.one_of(st.floats(-10, 10), seconds_st),
        "spt": st.one_of(st.floats(1e-6, 1e-2), seconds_st),
        "load": st.integers(-2, 12),
        "waiting": st.one_of(st.just(-1.0), st.floats(-3, 20), seconds_st),
        "cap": st.integers(0, 12),
        "excluded": st.sampled_from([0, 0, 0, 1, 255]),
    }
)
request_st = st.fixed_dictionaries(
    {
        "now": st.one_of(st.floats(-10, 10), seconds_st),
        "decode_s": seconds_st,
        "mean_uncached": st.one_of(st.floats(0, 5000), seconds_st),
        "block_tokens": st.one_of(st.floats(0.5, 64), st.sampled_from([16.0, 0.0, math.inf])),
        "total_tokens": st.one_of(st.floats(0, 4096), st.sampled_from([768.0, 0.0])),
        "history_blocks": st.one_of(st.integers(0, 60), st.just(1 << 64)),
        "tie_s": seconds_st,
        "tie_share": st.one_of(st.floats(0, 1), seconds_st),
        "interference": st.one_of(st.just(0.0), st.floats(0, 4), seconds_st),
        "history_from_all": st.booleans(),
        "home_share": st.one_of(st.just(-1.0), st.floats(0, 1), st.sampled_from([0.0, 0.5, math.nan, math.inf])),
    }
)
# requests recently sent to a position: -8 and 0 make a mean of -SPREAD_SMOOTH, a division by zero
recent_st = st.one_of(
    st.floats(0, 64),
    st.floats(-16, 16),
    st.sampled_from([0.0, -0.0, 1.0, 3.0, -8.0, -4.0, 1e300, math.inf, -math.inf, math.nan]),
)
spread_st = st.fixed_dictionaries(
    {
        "recent_scale": st.one_of(
            st.floats(0, 4), st.sampled_from([1.0, 0.5, 0.0, -1.0, 1e-300, 1e300, math.inf, math.nan])
        ),
        "spread_tokens": st.one_of(
            st.floats(0, 8192), st.sampled_from([0.0, -0.0, -64.0, 256.0, 1e-300, math.inf, math.nan])
        ),
        "spread_whole": st.booleans(),
    }
)
# what each of six holders keeps: a prefix of BASE (after a truncate, maybe one with a gap), of OTHER
holding_st = st.lists(
    st.tuples(st.integers(0, 48), st.integers(0, 48), st.integers(0, 16), st.booleans()), min_size=6, max_size=6
)


def same_float(a: float, b: float) -> bool:
    return (a == b and math.copysign(1, a) == math.copysign(1, b)) or (math.isnan(a) and math.isnan(b))


def assert_same(ours: Decision, theirs: Decision, rows: tuple[str, ...] = ("cached", "wait", "cost", "spread")) -> None:
    """Bit for bit: the same best, near, home and flags, and the same doubles in every row (NaN as NaN)."""
    assert (ours.best, ours.near, ours.home, ours.flags) == (theirs.best, theirs.near, theirs.home, theirs.flags)
    for row in rows:
        a, b = getattr(ours, row), getattr(theirs, row)
        assert (a is None) == (b is None), (row, a, b)
        assert a is None or all(same_float(x, y) for x, y in zip(a, b, strict=True)), (row, a, b)


def holding_index(impl: ModuleType, holding: list[tuple[int, int, int, bool]], removed: set[int]) -> Any:
    index = impl.PrefixIndex()
    for h, (held, keep, other, gap) in enumerate(holding):
        index.add_holder(100)
        index.insert(h, BASE, held)
        index.insert(h, OTHER, other)
        if gap:
            index.truncate(h, BASE[: max(keep, 1)], max(keep, 1) - 1)
    for h in removed:
        index.remove_holder(h)
    return index


def drawn_decision(
    fleet: list[dict[str, Any]], removed: set[int], data: st.DataObject
) -> tuple[array[int], int, Fleet]:
    """The chain, `last` and Fleet of a drawn fleet (no recent yet)."""
    positions = [p | {"holder": -1 if p["holder"] in removed and not p["excluded"] else p["holder"]} for p in fleet]
    chain = data.draw(st.sampled_from([BASE, BASE[:20], OTHER, array("Q")]), label="chain")
    last = data.draw(st.integers(-1, len(fleet) - 1), label="last")
    spec = Fleet(
        holders=[p["holder"] for p in positions],
        busy_until=[p["busy_until"] for p in positions],
        seconds_per_token=[p["spt"] for p in positions],
        loads=[p["load"] for p in positions],
        waiting=[p["waiting"] for p in positions],
        caps=[p["cap"] for p in positions],
        excluded=[p["excluded"] for p in positions],
    )
    return chain, last, spec


def test_a_mean_of_minus_the_smoothing_divides_by_zero_alike(impl: ModuleType) -> None:
    # r = -8, 0: mean -4, so 0 - -4 over -4 + 4: C's +inf, and the twin's too (not ZeroDivisionError)
    fleet = Fleet(holders=[-1, -1], recent=[-8.0, 0.0])
    got = decide(impl.PrefixIndex(), CHAIN, fleet, spread_tokens=1.0)
    assert got.spread == [0.0, math.inf] and got.cost == [1.0, math.inf] and (got.best, got.near) == (0, 1)


@given(
    holding=holding_st,
    removed=st.sets(st.integers(0, 5), max_size=2),
    fleet=st.lists(position_st, max_size=10),
    request=request_st,
    data=st.data(),
)
def test_without_a_spread_the_costs_are_as_before(
    impl: ModuleType,
    holding: list[tuple[int, int, int, bool]],
    removed: set[int],
    fleet: list[dict[str, Any]],
    request: dict[str, Any],
    data: st.DataObject,
) -> None:
    # Every way of asking for no spread gives the doubles price gave before the term, bit for
    # bit: the call with the old arguments only is that decision.
    request = {name: value for name, value in request.items() if name not in LATER}
    index = holding_index(impl, holding, removed)
    chain, last, spec = drawn_decision(fleet, removed, data)
    n = len(fleet)
    before = decide(index, chain, spec, legacy=True, last=last, **request)
    recent = data.draw(st.lists(recent_st, min_size=n, max_size=n), label="recent")
    only_last = [1.0 if i == last else 0.0 for i in range(n)]  # the one over the mean is `last`
    no_spread: list[tuple[list[float] | None, dict[str, Any]]] = [
        (None, {}),
        (None, {"spread_tokens": 256.0}),
        (recent, {}),
        (recent, {"spread_tokens": 0.0}),
        (recent, {"spread_tokens": -0.0}),
        (recent, {"spread_tokens": -64.0}),
        (recent, {"spread_tokens": math.nan}),
        (recent, {"spread_tokens": 256.0, "recent_scale": 0.0}),  # everyone at 0 (or NaN)
        (only_last, {"spread_tokens": 256.0}),
    ]
    for values, spread in no_spread:
        spec.recent = values
        got = decide(index, chain, spec, last=last, **request | spread)
        assert_same(got, before, rows=("cached", "wait", "cost"))
        assert got.spread == [UNTOUCHED if spec.excluded[i] else 0.0 for i in range(n)]
    # an empty prompt computes nothing anywhere
    spec.recent = None
    before = decide(index, chain, spec, legacy=True, last=last, **request | {"total_tokens": 0.0})
    spec.recent = recent
    got = decide(index, chain, spec, last=last, **request | {"total_tokens": 0.0, "spread_tokens": 256.0})
    assert_same(got, before, rows=("cached", "wait", "cost"))
    assert got.spread == [UNTOUCHED if spec.excluded[i] else 0.0 for i in range(n)]


def compare_both(
    compiled: ModuleType,
    holding: list[tuple[int, int, int, bool]],
    removed: set[int],
    fleet: list[dict[str, Any]],
    request: dict[str, Any],
    data: st.DataObject,
    with_recent: bool,
) -> None:
    indexes = [holding_index(impl, holding, removed) for impl in (compiled, _prefix_py)]
    chain, last, spec = drawn_decision(fleet, removed, data)
    if with_recent:
        spec.recent = data.draw(st.lists(recent_st, min_size=len(fleet), max_size=len(fleet)), label="recent")
    spread_out = data.draw(st.booleans(), label="with spread_out")
    if data.draw(st.booleans(), label="with known"):
        spec.known = data.draw(
            st.lists(
                st.one_of(st.just(-1.0), st.floats(0, 5000), st.sampled_from([0.0, math.inf, math.nan])),
                min_size=len(fleet),
                max_size=len(fleet),
            ),
            label="known",
        )
    if data.draw(st.booleans(), label="with evicts"):
        spec.evicts = data.draw(
            st.lists(
                st.one_of(st.just(0.0), st.floats(0, 30), st.sampled_from([-0.0, math.inf, math.nan])),
                min_size=len(fleet),
                max_size=len(fleet),
            ),
            label="evicts",
        )
    ours, theirs = (decide(index, chain, spec, last=last, spread_out=spread_out, **request) for index in indexes)
    assert_same(ours, theirs)


@given(
    holding=holding_st,
    removed=st.sets(st.integers(0, 5), max_size=2),
    fleet=st.lists(position_st, max_size=10),
    request=request_st,
    spread=spread_st,
    data=st.data(),
)
def test_compiled_equals_twin_on_any_decision(
    compiled: ModuleType,
    holding: list[tuple[int, int, int, bool]],
    removed: set[int],
    fleet: list[dict[str, Any]],
    request: dict[str, Any],
    spread: dict[str, Any],
    data: st.DataObject,
) -> None:
    with_recent = data.draw(st.booleans(), label="with recent")
    compare_both(compiled, holding, removed, fleet, request | spread, data, with_recent)


@given(
    holding=holding_st,
    removed=st.sets(st.integers(0, 5), max_size=2),
    fleet=st.lists(position_st, min_size=2, max_size=10),
    request=request_st,
    total_tokens=st.floats(1, 4096),
    spread_tokens=st.one_of(st.floats(1 / 64, 8192), st.sampled_from([256.0, 1e-300, 1e300, math.inf])),
    recent_scale=st.one_of(st.floats(1 / 64, 4), st.sampled_from([1.0, 0.5, -1.0, 1e300, math.inf])),
    data=st.data(),
)
def test_compiled_equals_twin_where_a_spread_applies(
    compiled: ModuleType,
    holding: list[tuple[int, int, int, bool]],
    removed: set[int],
    fleet: list[dict[str, Any]],
    request: dict[str, Any],
    total_tokens: float,
    spread_tokens: float,
    recent_scale: float,
    data: st.DataObject,
) -> None:
    # the same, always with recent requests, a positive spread_tokens and a prompt to compute
    request |= {"total_tokens": total_tokens, "spread_tokens": spread_tokens, "recent_scale": recent_scale}
    compare_both(compiled, holding, removed, fleet, request, data, with_recent=True)
