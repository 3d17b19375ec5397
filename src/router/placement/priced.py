"""A price: one prompt priced on the fleet, every candidate's row (router.placement.pricing makes it)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from router.prefix import PRICE_GATED, PRICE_NEAR


@dataclass(slots=True)
class Candidate:
    """One replica's side of a decision, for the pick and for /admin/route."""

    index: int
    cached_tokens: float
    uncached_tokens: float
    wait_s: float
    cost_s: float
    spread_s: float = 0.0  # the part of the cost that is its recent traffic past the fleet's mean
    gated: bool = False
    evicts_s: float = 0.0  # ... and what it would evict there of conversations likely back soon
    source: str = "model"  # where its cached tokens come from: "events" (its engine's) or "model" (the router's)
    tier_tokens: float = 0.0  # ... of which its engine holds on a second tier (events only)

    @property
    def ttft_s(self) -> float:
        """Its predicted time to first token: the cost less what it charges for the turns after."""
        return self.cost_s - self.spread_s - self.evicts_s


class Priced:
    """One prompt priced on the fleet (`Placement.price`): every candidate's row, the cheapest under
    the gate, its near-ties and the conversation's home. A value: a later price makes another and
    leaves this one as it was, so a decision reads its own rows however many prices came since."""

    __slots__ = (
        "best", "cached", "candidates", "cost", "evicts", "flags", "holding", "known", "spread", "tier", "ties",
        "total", "wait",
    )  # fmt: skip

    def __init__(
        self,
        best: int,
        ties: int,
        holding: int,
        total: float,
        candidates: array[int],
        rows: tuple[array[float], array[float], array[float], array[float], array[int]],
        known: tuple[array[float], array[float]] | None = None,
        evicts: array[float] | None = None,
    ) -> None:
        self.best = best  # the cheapest position under the gate; -1: every candidate is past it; -2: none
        self.ties = ties  # how many candidates are within the tie margin of it
        self.holding = holding  # the candidate holding at least the home share of the prompt, else -1
        self.total = total  # the prompt's tokens, as priced
        self.candidates = candidates  # per position, 0 where it was priced
        self.cached, self.wait, self.cost, self.spread, self.flags = rows
        # by the engines' events: per position, the cached tokens they say (-1: nothing), and of those on a second tier
        self.known: array[float] | None = None if known is None else known[0]
        self.tier: array[float] | None = None if known is None else known[1]
        self.evicts = evicts  # per position, what it would evict there (None: nothing anywhere)

    def row(self, pos: int) -> Candidate:
        """The row of position `pos` (a candidate)."""
        cached = self.cached[pos]
        events = self.known is not None and self.known[pos] >= 0
        return Candidate(
            pos,
            cached,
            self.total - cached,
            self.wait[pos],
            self.cost[pos],
            self.spread[pos],
            bool(self.flags[pos] & PRICE_GATED),
            self.evicts[pos] if self.evicts is not None else 0.0,
            "events" if events else "model",
            self.tier[pos] if events and self.tier is not None else 0.0,
        )

    def rows(self) -> list[Candidate]:
        """Every candidate's row."""
        return [self.row(i) for i, x in enumerate(self.candidates) if not x]

    def near(self) -> list[int]:
        """The candidates within the tie margin of the cheapest."""
        flags = self.flags
        return [i for i, x in enumerate(self.candidates) if not x and flags[i] & PRICE_NEAR]

    def stays(self, home: int, best: int, share: float) -> bool:
        """`home` keeps the request from `best`: it is not past the gate, and `best` costs at least
        1 / (1 + share) of what it does."""
        return not self.flags[home] & PRICE_GATED and self.cost[home] <= self.cost[best] * (1 + share)

    def source(self, pos: int) -> str:
        """Where the cached tokens at `pos` came from: "events" or "model"."""
        return "events" if self.known is not None and pos < len(self.known) and self.known[pos] >= 0 else "model"


NO_ROWS = (array("d"), array("d"), array("d"), array("d"), array("B"))  # a price with no candidate


__all__ = ["NO_ROWS", "Candidate", "Priced"]
