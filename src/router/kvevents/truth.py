"""The fleet's event-fed index: for each replica that publishes KV-cache events, what its engine holds.

One `PrefixIndex` (router.prefix) for the whole fleet, with a holder per replica, data-parallel
rank and medium (router.kvevents.holdings). `held` answers the one question placement asks of
it: how many of this request's tokens does that replica hold, on its GPU and on a second tier —
or None while the replica publishes nothing, or is unsure (a gap replay could not fill, a health
outage not yet explained): placement then reads today's model for that replica alone.

Blocks on a second tier (vLLM's CPU offloading, SGLang's HiCache host memory) are neither hits nor
misses: the engine loads them back instead of computing them, at that tier's speed. `credit`
turns them into the hit they are worth for a replica computing at `seconds_per_token`:
tier tokens x max(0, 1 - tier seconds per token / seconds per token). The tier's speed starts at
`kv_tier_tokens_per_s` and is learnt from the answers that loaded blocks back (`learn_tier`).

What will be held when a request runs, not only what is held now: an engine runs what it was sent
in order, so the prompt blocks of the requests the router sent a replica and that have not ended
(`expect`, until `unexpect`) will be there before a request sent now is scheduled — held, or being
computed and pinned — though no event says so yet. A conversation's next turn sent while its last
turn is still prefilling finds that turn's blocks coming on its replica, and nowhere else: without
them the replica that will hold the whole history looked no better than an idle one.

A replica of several data-parallel ranks has one Holdings per rank (each rank publishes on its
own port and numbers its own messages); a request goes to whichever rank the engine picks, so the
replica holds what its best rank holds.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from router.kvevents.holdings import Holdings
from router.kvevents.tokens import EngineTokens
from router.kvevents.wire import MEDIUM_GPU
from router.prefix import PrefixIndex

TIER_PRIOR = 4  # the configured tier speed counts as this many samples
TIER_ALPHA = 0.05  # ... and each new sample moves the learnt one this much, once many are in


@dataclass(frozen=True, slots=True)
class Found:
    gpu_tokens: int  # tokens of the prompt its GPU holds
    tier_tokens: int  # ... a second tier holds beyond them
    block_size: int


class Truth:
    def __init__(self, tier_tokens_per_s: float = 0.0) -> None:
        self.index = PrefixIndex()
        self.replicas: dict[str, dict[int, Holdings]] = {}
        self.tier_spt = 1.0 / tier_tokens_per_s if tier_tokens_per_s > 0 else 0.0
        self.tier_samples = 0  # answers that loaded blocks back from a second tier, timed
        self.coming: dict[str, Counter[int]] = {}  # replica -> blocks of the requests in flight there

    def __bool__(self) -> bool:
        return bool(self.replicas)

    def holdings(self, replica_id: str, rank: int, capacity_blocks: int) -> Holdings:
        """The Holdings of one replica's rank, made on first use."""
        ranks = self.replicas.setdefault(replica_id, {})
        h = ranks.get(rank)
        if h is None:
            h = ranks[rank] = Holdings(self.index, capacity_blocks)
        return h

    def of(self, replica_id: str) -> list[Holdings]:
        return list(self.replicas.get(replica_id, {}).values())

    def forget(self, replica_id: str) -> None:
        for h in self.replicas.pop(replica_id, {}).values():
            h.close()
        self.coming.pop(replica_id, None)

    def block_size(self, replica_id: str) -> int | None:
        """The block size its events say it keys blocks in (None: not said yet)."""
        return next((h.block_size for h in self.replicas.get(replica_id, {}).values() if h.block_size), None)

    def expect(self, replica_id: str, keys: Sequence[int]) -> None:
        """A request was sent there: its prompt's blocks will be there when what is sent next runs."""
        coming = self.coming.setdefault(replica_id, Counter())
        coming.update(keys)

    def unexpect(self, replica_id: str, keys: Sequence[int]) -> None:
        """... it ended (or failed): its blocks are what the events say from now on."""
        coming = self.coming.get(replica_id)
        if coming is None:
            return
        for key in keys:  # one pass (a 33k-token prompt has a thousand)
            left = coming.get(key, 0) - 1
            if left > 0:
                coming[key] = left
            else:
                coming.pop(key, None)

    def sure(self, replica_id: str) -> bool:
        ranks = self.replicas.get(replica_id)
        return ranks is not None and bool(ranks) and all(h.sure for h in ranks.values())

    def suspect(self, replica_id: str) -> None:
        for h in self.replicas.get(replica_id, {}).values():
            h.suspect()

    def held(
        self,
        replica_id: str,
        tokens: EngineTokens,
        matches: dict[int, array[int]],
        block_size: int | None = None,
    ) -> Found | None:
        """What of `tokens` the replica holds, if its events say so (None: they do not, or are not
        believed). `matches`: by block size, how many leading blocks of the request's chain each
        holder of the index keeps, matched for every holder at once on first use (one call into
        the index for the whole fleet, not one per replica)."""
        ranks = self.replicas.get(replica_id)
        if not ranks:
            return None
        best: Found | None = None
        coming = self.coming.get(replica_id)
        for h in ranks.values():
            if not h.sure:
                return None
            size = h.block_size or block_size
            if not size:
                if any(h.blocks(medium) for medium in h.tiers):
                    return None  # neither its events nor its metrics said its block size yet
                found = Found(0, 0, 0)  # it holds nothing at all (whatever its blocks' size)
                best = best or found
                continue
            matched = matches.get(size)
            if matched is None:
                matched = matches[size] = self._match_all(tokens.chain(size))
            gpu = tier = 0
            for medium, t in h.tiers.items():
                if medium == MEDIUM_GPU:
                    gpu = matched[t.holder]
                else:
                    tier = max(tier, matched[t.holder])
            if coming:  # what the requests in flight there compute before this one runs
                chain = tokens.chain(size)
                while gpu < len(chain) and chain[gpu] in coming:
                    gpu += 1
            found = Found(gpu * size, max(0, tier - gpu) * size, size)
            if best is None or (found.gpu_tokens, found.tier_tokens) > (best.gpu_tokens, best.tier_tokens):
                best = found
        return best

    def _match_all(self, chain: array[int]) -> array[int]:
        matched = array("i", bytes(4 * self.index.n_holders))
        if len(chain):
            self.index.match_all(chain, matched)
        return matched

    def credit(self, held: Found, seconds_per_token: float) -> float:
        """The cached tokens `held` is worth at a replica computing a token in `seconds_per_token`."""
        if not held.tier_tokens or seconds_per_token <= 0:
            return float(held.gpu_tokens)
        saved = 1.0 - self.tier_spt / seconds_per_token
        return held.gpu_tokens + held.tier_tokens * max(0.0, saved)

    def learn_tier(self, seconds_per_token: float) -> None:
        """One answer's time per token loaded back from a second tier (its first token's time, less
        its wait and its prefill of what it computed): the tier's speed is their running mean,
        TIER_ALPHA for each new one once TIER_PRIOR have been seen (the configured speed until then
        counts as that many)."""
        if not (seconds_per_token > 0 and seconds_per_token < 1.0):  # NaN, negative, absurd: noise
            return
        self.tier_samples += 1
        weight = max(TIER_ALPHA, 1.0 / (TIER_PRIOR + self.tier_samples))
        self.tier_spt += weight * (seconds_per_token - self.tier_spt)

    def figures(self, replica_id: str) -> dict[str, object] | None:
        ranks = self.replicas.get(replica_id)
        if not ranks:
            return None
        out: dict[str, object] = {"sure": self.sure(replica_id)}
        for rank, h in sorted(ranks.items()):
            f = h.figures
            out[f"rank_{rank}" if len(ranks) > 1 else "events"] = {
                "sure": h.sure,
                "seq": h.seq,
                "block_size": h.block_size,
                "blocks": {medium: h.blocks(medium) for medium in h.tiers},
                "capacity_blocks": h.capacity,
                "batches": f.batches,
                "stored": f.stored,
                "removed": f.removed,
                "cleared": f.cleared,
                "orphans": f.orphans,
                "gaps": f.gaps,
                "replayed": f.replayed,
                "restarts": f.restarts,
                "unsure_episodes": f.unsure_episodes,
            }
        return out


__all__ = ["Found", "Truth"]
