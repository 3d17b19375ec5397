"""Agreement between routers that follow the same engines' KV events (`router-bench events --routers`).

Routers agree by construction only while each has applied every event: a decision taken while a
message is in flight to one of them and not yet to another, or by a router that joined late and
has not replayed everything, may differ. This measures how often it does, on keyless traffic, where
the event-fed index is what decides: a request goes to the replica whose events say it holds the
most of its prompt (no replica holding any: every router falls back alike, to load).

`Recorder` keeps, from one router's applied batches, the token ids of each replica's latest
chains (a request's prompt as its engine stored it, block by block). Every `SAMPLE_S` the sampler
draws prompts from them (a random leading part of a random recent chain, the newest included, so
that events still in flight to another router count) and asks every router which replica it would
send each to (`decision`): one compiled match over the router's whole index, then the replica
whose GPU tier holds the most leading blocks, among those the router believes (a replica it does
not believe yet is priced by its model in a real router: here it counts as holding nothing).
"""

from __future__ import annotations

import asyncio
import random
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from router.kvevents.tokens import root_of, token_chain
from router.kvevents.truth import Truth
from router.kvevents.wire import MEDIUM_GPU, Batch, Stored

SAMPLE_S = 0.05  # prompts are drawn this often
SAMPLES = 16  # ... this many each time
CHAINS_KEPT = 4  # a replica's latest chains a prompt is drawn from


class Recorder:
    """The token ids of each replica's latest chains, from the batches one router applied."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # replica id -> its chains' token ids, by the engine's name of each chain's last block
        self.chains: dict[str, OrderedDict[int, array[int]]] = {}

    def heard(self, rid: str, batch: Batch) -> None:
        for e in batch.events:
            if not isinstance(e, Stored) or e.block_size != self.block_size or not len(e.hashes):
                continue
            kept = self.chains.get(rid)
            if e.parent is None:
                tokens = array("Q", e.token_ids)
            else:
                before = kept.pop(e.parent, None) if kept is not None else None
                if before is None:
                    continue  # its chain began before this router joined
                tokens = before
                tokens.extend(e.token_ids)
            if kept is None:
                kept = self.chains[rid] = OrderedDict()  # (a replica is listed once it has a chain)
            kept[e.hashes[-1]] = tokens
            while len(kept) > CHAINS_KEPT:
                kept.popitem(last=False)

    def draw(self, rng: random.Random) -> array[int] | None:
        """A prompt's chain of keys: a random leading part of a random recent chain (None: none yet)."""
        if not self.chains:
            return None
        kept = self.chains[rng.choice(list(self.chains))]
        tokens = rng.choice(list(kept.values()))
        blocks = rng.randint(1, len(tokens) // self.block_size)
        return token_chain(tokens[: blocks * self.block_size], self.block_size, root_of(None, None))


def decision(truth: Truth, ids: Sequence[str], chain: array[int]) -> int:
    """The position of the replica whose events say it holds the most leading blocks of `chain` on
    its GPU (the first among equals), of those believed; -1 when none holds any."""
    index = truth.index
    matched = array("i", bytes(4 * index.n_holders))
    index.match_all(chain, matched)
    best, most = -1, 0
    for pos, rid in enumerate(ids):
        if not truth.sure(rid):
            continue
        for h in truth.of(rid):
            t = h.tiers.get(MEDIUM_GPU)
            if t is not None and matched[t.holder] > most:
                best, most = pos, matched[t.holder]
    return best


@dataclass
class Agreement:
    """Decisions compared: among the routers that joined together, and a late one against the first."""

    samples: int = 0
    identical: int = 0  # every router that joined together decided alike
    held: int = 0  # ... of which some replica held some of the prompt (the index decided, not load)
    late_samples: int = 0  # once the late router believed every replica
    late_identical: int = 0

    @property
    def share(self) -> float:
        return self.identical / self.samples if self.samples else float("nan")

    @property
    def late_share(self) -> float:
        return self.late_identical / self.late_samples if self.late_samples else float("nan")


async def sample(
    recorder: Recorder,
    together: Sequence[Truth],
    late: Callable[[], Truth | None],
    ids: Sequence[str],
    agreement: Agreement,
    until: float,
    clock: Callable[[], float],
    seed: int = 7,
) -> None:
    """Draws prompts every SAMPLE_S until `until` (on `clock`) and counts identical decisions.
    `late()` is the late router once it believes every replica (None before, or without one)."""
    rng = random.Random(seed)
    while clock() < until:
        joined = late()
        for _ in range(SAMPLES):
            chain = recorder.draw(rng)
            if chain is None:
                break
            first = decision(together[0], ids, chain)
            same = all(decision(t, ids, chain) == first for t in together[1:])
            agreement.samples += 1
            agreement.identical += same
            agreement.held += first >= 0
            if joined is not None:
                agreement.late_samples += 1
                agreement.late_identical += decision(joined, ids, chain) == first
        await asyncio.sleep(SAMPLE_S)


__all__ = ["Agreement", "Recorder", "decision", "sample"]
