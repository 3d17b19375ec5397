"""The pure-Python twin of `_held` (src/_held.pyx): the part of a price's read of the engines'
events that visits every replica, on every request (router.placement.events.events_rows).

`read_plain` reads the replicas whose events come from one believed rank with its GPU its only
medium, in one pass: each one's tokens held are the index's match for its holder (`truth.matched`,
one call for every holder of a block size). Most were judged so when the fleet was laid out
(router.placement.events.Layout), and are read from flat arrays. A replica not read so (no block
size said yet, not believed, a second tier since its layout, removed) goes to `slow`, to be asked
one by one; so does one with requests in flight whose new blocks no event has shown yet (what
they evict first is asked there: `truth.queued`). Where requests are in flight whose blocks are
there (`truth.coming`), what they compute first is added: the blocks of the prompt's chain that
follow what is held and are among theirs.

`under` says which positions a price's candidates under the gate cost at most a limit: those that
router.placement.events.Evicting asks what a request would evict, where it can change the decision.
`lost` is that ask's loop over the conversations likely back on a replica (router.kvevents.truth.
Truth.evicts): under steady load the near-ties are many, and each is asked.

Both answer as the other does (tests/unit/test_held.py compares them, and the placement tests
compare their answers with `Truth.row` asked one by one, on both implementations).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from typing import Any

REMOVED = "removed"


def _hold(
    positions: array[int],
    holders: array[int],
    block_sizes: array[int],
    excluded: array[int],
    known: array[float],
    sizes: array[int],
    matches: dict[int, array[int]],
    truth: Any,
    tokens: Any,
) -> None:
    """Positions' tokens held: each one's holder's match at its block size."""
    for k in range(len(positions)):
        i = positions[k]
        if excluded[i]:
            continue
        size = block_sizes[k]
        matched = truth.matched(tokens, size, matches)
        known[i] = matched[holders[k]] * size
        sizes[i] = size


def read_plain(
    layout: Any,
    excluded: array[int],
    known: array[float],
    sizes: array[int],
    slow: list[int],
    truth: Any,
    tokens: Any,
    matches: dict[int, array[int]],
) -> None:
    """Fills `known` (tokens held) and `sizes` (block size; 0: not read here) for the positions
    read in the pass, as `layout` (router.placement.events.Layout) judged them:
    - `fast` (positions, their holders and block sizes): read as they are;
    - `followed` (positions, holders, their roster rows' first words: a worker's ranks): read where
      three words of the row say so (`layout.row_words`: believed, a block size said, no second
      tier begun), else judged as `dynamic` ones are;
    - `dynamic` (position, replica, its rank, its tiers, its GPU holder): judged attribute by
      attribute.
    Appends to `slow` those to ask one by one, `layout.slow` among them."""
    positions, holders, block_sizes = layout.fast
    _hold(positions, holders, block_sizes, excluded, known, sizes, matches, truth, tokens)
    slow.extend(layout.slow)
    judge = list(layout.dynamic)
    read: tuple[array[int], array[int], array[int]] = (array("i"), array("i"), array("i"))
    positions, holders, words = layout.followed
    if len(positions):
        rows, (sure_at, block_at, second_at) = layout.rows, layout.row_words
        for k in range(len(positions)):
            i = positions[k]
            if excluded[i]:
                continue
            at = words[k]
            size = rows[at + block_at]
            if not size or rows[at + second_at]:
                judge.append(layout.followed_entries[k])  # (its metrics' block size; another tier begun)
            elif not rows[at + sure_at]:
                slow.append(i)
            else:
                for column, value in zip(read, (i, holders[k], size), strict=True):
                    column.append(value)
    for i, r, h, tiers, holder in judge:
        if excluded[i]:
            continue
        size = h.block_size
        if not size:  # (its events have not said one yet: its metrics' may have)
            said = r.engine.block_size
            size = int(said) if said else 0
        if not size or not h.sure or len(tiers) != 1 or r.health.state == REMOVED:
            slow.append(i)
            continue
        for column, value in zip(read, (i, holder, size), strict=True):
            column.append(value)
    _hold(read[0], read[1], read[2], excluded, known, sizes, matches, truth, tokens)
    at = layout.at
    for rid, queued in truth.queued.items():
        i = at.get(rid, -1) if queued else -1
        if i >= 0 and sizes[i]:
            sizes[i] = 0
            known[i] = -1.0
            slow.append(i)
    chains: dict[int, array[int]] = {}
    for rid, coming in truth.coming.items():
        i = at.get(rid, -1) if coming else -1
        if i >= 0 and sizes[i]:
            size = sizes[i]
            chain = chains.get(size)
            if chain is None:
                chain = chains[size] = tokens.chain(size)
            gpu = int(known[i]) // size
            if gpu < len(chain) and chain[gpu] in coming:
                while gpu < len(chain) and chain[gpu] in coming:
                    gpu += 1
                known[i] = gpu * size


def under(cost: array[float], flags: array[int], limit: float, candidate: int, gated: int) -> list[int]:
    """The positions that are candidates not past the gate (`flags`) and cost at most `limit`."""
    return [i for i in range(len(cost)) if cost[i] <= limit and flags[i] & candidate and not flags[i] & gated]


def _common(a: array[int], b: array[int]) -> int:
    """How many leading blocks two chains share (chained keys: equal at k, equal before k)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def lost(kept: Iterable[Any], counts: list[int], chain: array[int], now: float, spare_s: float) -> float:
    """Blocks of the returning conversations `kept` (router.kvevents.truth.Ended: keys, at, back_s)
    that a request of prompt `chain` would evict, weighed by how likely each comes back for them
    within `spare_s`: for the i-th, `counts[2i]` blocks it keeps there now and `counts[2i + 1]`
    left past the request's allocation (router.kvevents.truth.Truth.evicts says why). Its blocks
    the request shares are pinned by it: not lost."""
    total = 0.0
    for i, rec in enumerate(kept):
        had, left = counts[2 * i], counts[2 * i + 1]
        if not had:
            continue
        if left < had:
            left = max(left, min(had, _common(rec.keys, chain)))
        if left < had:
            back = rec.back_s  # alive, and back within spare_s
            total += (had - left) * math.exp((rec.at - now) / back) * -math.expm1(-spare_s / back)
    return total
