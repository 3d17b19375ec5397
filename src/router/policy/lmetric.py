"""`lmetric`: LMetric's score, a baseline written here from the paper's formula (not the authors' code).

Zhang et al., "Simple is Better: ... LLM request scheduling" (OSDI '26) score a replica by the
product of two indicators: the new prefill tokens the request would compute there (its prompt
less what that replica holds) and the replica's current batch size; the lowest product wins. The
product needs no weights: scaling either indicator scales every score alike, so the order, and
the pick, do not change. Here the tokens a replica holds come from the same place `ttft` reads
them (router.placement: its engine's KV-cache events, else the router's model of what it sent),
and the batch size is the requests the router has in flight there.

The paper names the formula's one failure: both indicators zero. Two things the paper leaves open
are decided here, and said so: where several replicas score alike (an idle replica scores 0
whatever it holds), the one with fewer new prefill tokens wins, then the ring order from the key
(never list order); a request without a prompt the index can use is placed as by `affinity`.
Of `ttft`'s decision nothing else applies: no gate, no stay margin, no move price, no sessions
kept on their replica but by their score. What `ttft.pick` does around any decision still does:
a request with a first-token target goes where the prediction meets it, and a keyed session the
score moves off its replica is counted as moved for cost (its metrics and jump reasons).

Worked example: a 10,000-token prompt; replica A holds 9,000 of it and runs 4 requests (score
1,000 x 4 = 4,000), B holds nothing and runs 1 (10,000 x 1 = 10,000), C is idle (0 x ... = 0):
C wins, though it recomputes the whole prompt; with C busy too (1 request: 10,000), A wins.
"""

from __future__ import annotations

from collections.abc import Collection

from router.keys import RoutingKey
from router.placement import Priced
from router.policy.base import Decision
from router.policy.ttft import Ttft
from router.prompt import Prompt


class Lmetric(Ttft):
    name = "lmetric"

    def decide(
        self, key: RoutingKey, prompt: Prompt, last: str | None, exclude: Collection[int], every_row: bool = False
    ) -> tuple[Decision | None, Priced]:
        fleet, placement = self.fleet, self.placement
        tried = exclude
        exclude = self.avoiding(key, exclude)
        cold = fleet.adapter_cold(key.model)
        priced = placement.price(prompt, exclude, None, placement.clock(), -1.0, cold=cold, every_row=every_row)
        if priced.best == -2:
            return None, priced
        rows = priced.rows()
        ring_key = key.key if key.kind != "none" else prompt.chain.tobytes()[:8]
        order = {index: n for n, index in enumerate(fleet.ring.successors(ring_key))}
        loads = fleet.loads
        chosen = min(
            rows, key=lambda c: (c.uncached_tokens * loads[c.index], c.uncached_tokens, order.get(c.index, len(order)))
        )
        last_index = self.session_replica(self.evidence(key, last), exclude)
        if tried:
            reason = "failover"
        elif last_index is not None:
            reason = "sticky" if chosen.index == last_index else "cost"
        else:
            reason = "prefix" if chosen.cached_tokens > 0 else "cost"
        return Decision(chosen.index, reason, chosen), priced


__all__ = ["Lmetric"]
