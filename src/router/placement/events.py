"""What the engines' KV-cache events say of a prompt on each candidate: its tokens held, on a second tier, evicted."""

from __future__ import annotations

import math
from array import array

from router.fleet import Fleet
from router.kvevents.truth import Truth
from router.prompt import Prompt


def events_rows(
    fleet: Fleet,
    truth: Truth,
    prompt: Prompt,
    excluded: array[int],
    spt: array[float],
    zeros: array[float],
    mean_output: float,
    now: float,
) -> tuple[array[float], array[float], array[float] | None] | None:
    """Per position, the cached tokens its engine's events say it holds (a second tier's
    credited at its speed `spt`), -1 where they say nothing or are not believed; and of those, the
    tokens its engine holds on a second tier; and what the blocks it would allocate there (its
    prompt's not held, and a reply of `mean_output` tokens) evict of the conversations likely to
    come back costs them (router.kvevents.truth.Truth.evicts) at its prefill speed (None where it
    evicts nothing anywhere). None when no candidate's events say anything. `prompt` carries its
    engine tokens."""
    tokens = prompt.tokens
    assert tokens is not None
    known = array("d", [-1.0]) * len(excluded)
    tier, evicts = zeros[:], zeros[:]
    matches: dict[int, array[int]] = {}  # by block size: what every holder keeps of its chain
    # by block size: the prompt's chain and the blocks it allocates besides those held (its reply's)
    sized: dict[int, tuple[array[int], int]] = {}
    used = evicting = False
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
            if b and r.id in returning:
                at_size = sized.get(b)
                if at_size is None:
                    chain = tokens.chain(b)
                    at_size = sized[b] = (chain, len(chain) + math.ceil(mean_output / b))
                # it allocates its prompt's blocks not held there, and its reply's
                lost = truth.evicts(r.id, at_size[0], at_size[1] - found.gpu_tokens // b, now)
                if lost > 0:
                    evicts[i] = lost * b * spt[i]
                    evicting = True
    if not used:
        return None
    return known, tier, evicts if evicting else None


__all__ = ["events_rows"]
