"""`_held` (compiled) and its twin router/_held_py.py answer alike: the loops of a price's read of
the engines' events over every replica (router.placement.events.events_rows), compared on every
price of a simulated run with losses past the replay buffer, a replica joining, one dying and
one removed."""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from tests.twins import implementations

from router import _held_py
from router.bench.cli import build_parser
from router.bench.simulate import Simulation
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
    seen = {"reads": 0, "held": 0, "under": 0, "slow": 0}

    def read_plain(*args: Any) -> None:
        # (positions, holders, block sizes, dynamic, judged slow, excluded, known, sizes, slow, ...)
        theirs = [_copy(a) for a in args]
        compiled.read_plain(*args)
        twin.read_plain(*theirs)
        assert args[6] == theirs[6] and args[7] == theirs[7] and args[8] == theirs[8]
        seen["reads"] += 1
        seen["held"] += sum(1 for k in args[6] if k > 0)
        seen["slow"] += len(args[8]) > 0

    def under(*args: Any) -> Any:
        ours = compiled.under(*args)
        assert ours == twin.under(*args)
        seen["under"] += len(ours)
        return ours

    monkeypatch.setattr(events, "read_plain", read_plain)
    monkeypatch.setattr(events, "under", under)
    sim = Simulation(
        build_parser().parse_args(
            ["simulate", *FLEET, "--events", "--event-loss", "0.05", "--replay-keep", "0", *CHANGES]
        )
    )
    out = sim.run()
    assert out["events"]["unsure_episodes"] > 0 and out["failed_attempts"] > 0
    assert seen["reads"] > 1000 and seen["held"] > 500 and seen["under"] > 1000 and seen["slow"] > 100


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_what_is_in_flight_is_read_as_the_one_by_one_read_says(impl: str) -> None:
    """A position read in the pass with requests in flight there whose blocks have not shown
    (`queued`) goes to the slow path; one whose in-flight blocks follow what it holds (`coming`)
    is credited with them; a replica not laid out is skipped. The candidates under a limit are the
    positions flagged candidate, not gated, costing at most it."""
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
            matches[size] = array("i", [1, 1, 1, 0])  # by holder: one leading block each, the last none
            return matches[size]

    at = {"a": 0, "b": 1, "c": 2, "d": 3}
    known, sizes, slow = array("d", [-1.0] * 4), array("i", [0] * 4), [9]
    mod.read_plain(
        array("i", [0, 1, 2, 3]), array("i", [0, 1, 2, 3]), array("i", [4] * 4), [], [7],
        array("B", [0, 0, 0, 1]), known, sizes, slow, Truth(), Tokens(), {}, at,
    )  # fmt: skip
    assert list(known) == [-1.0, 4.0, 8.0, -1.0]  # a: queued; c: a block coming after its one; d excluded
    assert list(sizes) == [0, 4, 4, 0] and slow == [9, 7, 0]
    cost = array("d", [1.0, 2.0, 3.0, 0.5, 2.5])
    flags = array("B", [1, 1, 1 | 2, 0, 1])  # (candidate 1, gated 2)
    assert mod.under(cost, flags, 2.5, 1, 2) == [0, 1, 4]
    assert mod.under(cost, flags, 1.0, 1, 2) == [0]
