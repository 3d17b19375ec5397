"""`_held` (compiled) and its twin router/_held_py.py answer alike: the loops of a price's read of
the engines' events over every replica (router.placement.events.events_rows), and of what a
request would evict of the conversations likely back (router.kvevents.truth.Truth.evicts),
compared on every price of a simulated run with losses past the replay buffer, a replica
joining, one dying and one removed."""

from __future__ import annotations

import math
from array import array
from types import SimpleNamespace
from typing import Any

import pytest
from twins import implementations

from router import _held_py
from router.bench.cli import build_parser
from router.bench.simulate import Simulation
from router.kvevents import truth as truth_module
from router.placement import events

IMPLEMENTATIONS = implementations("_held", _held_py)
FLEET = ["--replicas", "6", "--sessions", "300", "--policy", "ttft", "--kv-tokens", "12000"]
CHANGES = ["--scale-out-at", "10", "--fail-at", "15", "--scale-in-at", "20"]


def _copy(value: Any) -> Any:
    return (
        array(value.typecode, value) if isinstance(value, array) else list(value) if isinstance(value, list) else value
    )


def test_both_implementations_read_every_price_of_a_run_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    twin = IMPLEMENTATIONS["python"]
    compiled = IMPLEMENTATIONS.get("compiled", twin)  # (installed without it on purpose: the twin alone)
    seen = {"reads": 0, "held": 0, "under": 0, "slow": 0, "lost": 0, "losing": 0}

    def read_plain(*args: Any) -> None:
        # (layout, excluded, known, sizes, slow, truth, tokens, matches)
        theirs = [_copy(a) for a in args]
        compiled.read_plain(*args)
        twin.read_plain(*theirs)
        assert args[2] == theirs[2] and args[3] == theirs[3] and args[4] == theirs[4]
        seen["reads"] += 1
        seen["held"] += sum(1 for k in args[2] if k > 0)
        seen["slow"] += len(args[4]) > 0

    def under(*args: Any) -> Any:
        ours = compiled.under(*args)
        assert ours == twin.under(*args)
        seen["under"] += len(ours)
        return ours

    def lost(kept: Any, counts: list[int], chain: array[int], now: float, spare_s: float) -> float:
        ours = compiled.lost(kept, counts, chain, now, spare_s)
        assert ours == twin.lost(kept, counts, chain, now, spare_s)  # (to the last bit)
        seen["lost"] += 1
        seen["losing"] += ours > 0
        return ours

    monkeypatch.setattr(events, "read_plain", read_plain)
    monkeypatch.setattr(events, "under", under)
    monkeypatch.setattr(truth_module, "lost", lost)
    sim = Simulation(
        build_parser().parse_args(
            ["simulate", *FLEET, "--events", "--event-loss", "0.05", "--replay-keep", "0", *CHANGES]
        )
    )
    out = sim.run()
    assert out["events"]["unsure_episodes"] > 0 and out["failed_attempts"] > 0
    assert seen["reads"] > 1000 and seen["held"] > 500 and seen["under"] > 1000 and seen["slow"] > 100
    assert seen["lost"] > 100 and seen["losing"] > 50


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_each_kind_of_position_is_read_as_its_layout_says(impl: str) -> None:
    """Laid out for the pass: read from the index's match. A worker's rank (`followed`): read
    where its roster row says it is believed with a block size and no second tier begun, asked
    one by one where it is not believed, judged attribute by attribute where its block size is
    not said or another tier began. With requests in flight whose blocks have not shown
    (`queued`): asked one by one; whose blocks follow what it holds (`coming`): credited with
    them. Excluded: not read. The candidates under a limit are the positions flagged candidate,
    not gated, costing at most it."""
    mod = IMPLEMENTATIONS[impl]

    class Tokens:
        def chain(self, size: int) -> array[int]:
            assert size == 4
            return array("Q", [11, 12, 13, 14])

    class Truth:
        def __init__(self) -> None:
            self.queued = {"a": {1: object()}, "b": {}, "zz": {2: object()}}
            self.coming = {"c": {12: 1, 14: 1}, "a": {12: 1}, "zz": {11: 1}}

        def matched(self, tokens: Any, size: int, matches: dict[int, array[int]]) -> array[int]:
            matches[size] = array("i", [1, 1, 1, 0, 2, 2, 2, 2])  # by holder: leading blocks kept
            return matches[size]

    said_nothing = SimpleNamespace(block_size=None, sure=True)  # a rank: no block size said ...
    metrics = SimpleNamespace(engine=SimpleNamespace(block_size=None), health=SimpleNamespace(state="healthy"))
    # roster rows of ten words: believed (word 1), block size (2), a second tier's holder (3)
    rows = array("Q")
    for believed, block, second in ((1, 4, 0), (0, 4, 0), (1, 0, 0), (1, 4, 9)):
        rows += array("Q", [0, believed, block, second, 0, 0, 0, 0, 0, 0])
    layout = SimpleNamespace(
        fast=(array("i", [0, 1, 2, 3]), array("i", [0, 1, 2, 3]), array("i", [4] * 4)),
        slow=[7],
        dynamic=[],
        followed=(array("i", [4, 5, 6, 7]), array("i", [4, 5, 6, 7]), array("i", [0, 10, 20, 30])),
        followed_entries=[None, None, (6, metrics, said_nothing, {"GPU": 0}, 6), (7, metrics, said_nothing, {}, 7)],
        rows=rows,
        row_words=(1, 2, 3),
        at={"a": 0, "b": 1, "c": 2, "d": 3},
    )
    known, sizes, slow = array("d", [-1.0] * 8), array("i", [0] * 8), [9]
    excluded = array("B", [0, 0, 0, 1, 0, 0, 0, 0])
    mod.read_plain(layout, excluded, known, sizes, slow, Truth(), Tokens(), {})
    # a: queued; c: a block coming after its one; d excluded; 4: a worker's, believed; 5: not
    # believed; 6: no block size said (nor by metrics); 7: a second tier begun (judged: no size)
    assert list(known) == [-1.0, 4.0, 8.0, -1.0, 8.0, -1.0, -1.0, -1.0]
    assert list(sizes) == [0, 4, 4, 0, 4, 0, 0, 0] and slow == [9, 7, 5, 6, 7, 0]
    cost = array("d", [1.0, 2.0, 3.0, 0.5, 2.5])
    flags = array("B", [1, 1, 1 | 2, 0, 1])  # (candidate 1, gated 2)
    assert mod.under(cost, flags, 2.5, 1, 2) == [0, 1, 4]
    assert mod.under(cost, flags, 1.0, 1, 2) == [0]


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_what_a_request_would_evict_of_the_conversations_likely_back(impl: str) -> None:
    """Each conversation's blocks past the request's allocation are lost, but those it shares with
    the request (pinned by it) are not, weighed by how recently it ended and how soon it comes back
    (e^((at - now) / back) * (1 - e^(-spare / back))); one that keeps nothing there loses nothing."""
    mod = IMPLEMENTATIONS[impl]
    chain = array("Q", [1, 2, 3, 4, 5, 6])
    kept = [
        SimpleNamespace(keys=array("Q", [1, 2, 3, 9, 9]), at=10.0, back_s=30.0),  # shares 3 blocks
        SimpleNamespace(keys=array("Q", [7, 8]), at=4.0, back_s=5.0),  # shares none
        SimpleNamespace(keys=array("Q", [1, 2]), at=9.0, back_s=30.0),  # keeps nothing there
        SimpleNamespace(keys=array("Q", [1, 2, 3, 4, 5, 6, 7]), at=10.0, back_s=30.0),  # all kept past it
    ]
    counts = [5, 1, 2, 0, 0, 0, 7, 7]  # (kept now, left past the allocation), by conversation
    now, spare = 12.0, 20.0
    first = (5 - 3) * math.exp((10.0 - now) / 30.0) * -math.expm1(-spare / 30.0)
    second = 2 * math.exp((4.0 - now) / 5.0) * -math.expm1(-spare / 5.0)
    assert mod.lost(kept, counts, chain, now, spare) == first + second
    assert mod.lost(kept, counts, chain, now, math.inf) == (5 - 3) * math.exp(-2.0 / 30.0) + 2 * math.exp(-8.0 / 5.0)
    assert mod.lost([], [], chain, now, spare) == 0.0
