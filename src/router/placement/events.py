"""What the engines' KV-cache events say of a prompt on each candidate: its tokens held, on a second tier, evicted."""

from __future__ import annotations

import math
from array import array

from router.fleet import Fleet
from router.kvevents.truth import Truth
from router.prefix import PRICE_CANDIDATE, PRICE_GATED
from router.prompt import Prompt


class Evicting:
    """What a request would evict on each position that holds conversations likely back
    (router.kvevents.truth.Truth.evicts), in seconds of its prefill there: asked only where it
    can change the decision (`bound`), since on a fleet of full caches each one walks the tail of
    that replica's LRU (at 100 replicas, pricing them all was most of a decision's time)."""

    __slots__ = ("asks", "now", "seconds", "truth")

    def __init__(self, truth: Truth, now: float, n: int) -> None:
        self.truth = truth
        self.now = now
        # by position: its replica, the prompt's chain at its block size, the blocks it would
        # allocate there, and a block's seconds of prefill there
        self.asks: dict[int, tuple[str, array[int], int, float]] = {}
        self.seconds = array("d", bytes(8 * n))

    def at(self, i: int) -> float:
        """Position i's (0.0 where it holds none likely back), asked once."""
        ask = self.asks.pop(i, None)
        if ask is not None:
            replica_id, chain, allocates, block_s = ask
            lost = self.truth.evicts(replica_id, chain, allocates, self.now)
            self.seconds[i] = lost * block_s
        return self.seconds[i]

    def bound(
        self, cost: array[float], flags: array[int], best: int, also: tuple[int, ...], tie_s: float, tie_share: float
    ) -> array[float] | None:
        """The seconds per position, asked wherever the decision could read them, from a price
        without them (`cost`, `flags`, its `best`): the candidates under the gate, cheapest first,
        until one costs more, without, than the cheapest total found so far plus the tie margin
        (what is added is never negative, so it can be neither the best nor a near-tie); every
        candidate when all are past the gate (the least full of them is chosen by cost); and the
        positions in `also` (a session's replica, the conversation's home: their rows are compared
        with the best). The rest read 0.0. None where nothing asked evicts anything."""
        if best == -1:
            for i in list(self.asks):
                self.at(i)
        elif best >= 0:
            least = cost[best] + self.at(best)  # the cheapest total found so far
            limit = least + max(tie_s, least * tie_share)  # (it only falls: none past it is asked)
            order = sorted(
                (cost[i], i)
                for i in self.asks
                if cost[i] <= limit and flags[i] & PRICE_CANDIDATE and not flags[i] & PRICE_GATED
            )
            for base, i in order:
                if base > least + max(tie_s, least * tie_share):
                    break
                least = min(least, base + self.at(i))
        for i in also:
            if i >= 0:
                self.at(i)
        return self.seconds if any(self.seconds) else None

    def every(self) -> array[float] | None:
        """The seconds on every position (for a price every row of which is read: /admin/route)."""
        for i in list(self.asks):
            self.at(i)
        return self.seconds if any(self.seconds) else None


def events_rows(
    fleet: Fleet,
    truth: Truth,
    prompt: Prompt,
    excluded: array[int],
    spt: array[float],
    zeros: array[float],
    mean_output: float,
    now: float,
) -> tuple[array[float], array[float], Evicting | None] | None:
    """Per position, the cached tokens its engine's events say it holds (a second tier's
    credited at its speed `spt`), -1 where they say nothing or are not believed; and of those, the
    tokens its engine holds on a second tier; and what the blocks it would allocate there (its
    prompt's not held, and a reply of `mean_output` tokens) would evict of the conversations likely
    to come back, to be asked where it matters (`Evicting`; None where no position holds any). None
    when no candidate's events say anything. `prompt` carries its engine tokens."""
    tokens = prompt.tokens
    assert tokens is not None
    known = array("d", [-1.0]) * len(excluded)
    tier = zeros[:]
    matches: dict[int, array[int]] = {}  # by block size: what every holder keeps of its chain
    # by block size: the prompt's chain and the blocks it allocates besides those held (its reply's)
    sized: dict[int, tuple[array[int], int]] = {}
    used = False
    evicting: Evicting | None = None
    returning = truth.returning
    for i, r in enumerate(fleet.replicas):
        if excluded[i] or r.id not in truth.replicas:
            continue
        if r.state == "removed":
            truth.suspect(r.id)  # its health went down: the next message says whether it restarted
            continue
        size = r.engine.block_size
        found = truth.held(r.id, tokens, matches, int(size) if size else None)
        if found is not None:
            known[i] = truth.credit(found, spt[i])
            tier[i] = found.tier_tokens
            used = True
            b = found.block_size
            if b and returning.get(r.id):
                at_size = sized.get(b)
                if at_size is None:
                    chain = tokens.chain(b)
                    at_size = sized[b] = (chain, len(chain) + math.ceil(mean_output / b))
                if evicting is None:
                    evicting = Evicting(truth, now, len(excluded))
                # it allocates its prompt's blocks not held there, and its reply's
                evicting.asks[i] = (r.id, at_size[0], at_size[1] - found.gpu_tokens // b, b * spt[i])
    if not used:
        return None
    return known, tier, evicting


__all__ = ["Evicting", "events_rows"]
