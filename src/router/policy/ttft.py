"""`ttft` (default): the replica whose first token would come soonest, from what it holds and what it has queued.

For each routable replica not yet tried, router.placement prices the request in seconds of time
to first token: the wait for the prefill already sent there (and queued by others, and its decode
load) plus this prompt's tokens it does not hold, at its learnt prefill speed — counted once more
for each request running there, which that prefill delays — plus, for a conversation new to it,
the traffic it recently got above the fleet's mean (router.placement has the formula). What it holds comes
from the prefix index (blocks the router sent there, corrected by the `cached_tokens` it reports);
the replica a session was served on last holds that session's whole history, its replies too.

1. Gate: a replica with more in flight than max(ceil(ttft_gate_c x (in flight + 1) / replicas),
   ceil((in flight + 1) / replicas) + bounded_load_floor) — capped by its capacity while another
   has a free slot, as for `affinity` — is not a candidate while another is (the slack over the
   mean is absolute, so a surge that loads every replica spills no session over a few requests).
   Cache alone never draws traffic onto a replica already far past the fleet (the "death
   spiral" of routers that send every miss to the emptiest cache).
2. The cheapest candidate wins. Costs within max(`ttft_tie_s`, `ttft_tie_share` x the cheapest)
   of it are equal — a shared system prompt held on one replica is not a reason to send every new
   conversation there: the session's last replica among them keeps it, else the least full of
   them, else the first of those clockwise on the ring from the key: an idle fleet places new
   sessions as consistent hashing would (routers with no shared state agree), never by list order.
3. The replica holding the conversation (a keyed session's own; for a keyless request, the one
   holding at least half its prompt) keeps it unless another costs less than 1 / (1 +
   `ttft_stay_share`) of its cost: a move leaves a cache behind, and near-equal guesses are noise.
4. A hot shared prefix gains a second holder by itself: once its holder's queue costs more than
   recomputing the prefix elsewhere, the next request goes elsewhere, and that replica holds it too.

A session jumps only when moving is cheaper, its recompute counted (reason `cost`), when its
replica is past the gate (`spill`), or on a retry (`failover`). Requests whose prompt the index
cannot use (no whole block: an embedding of a word, an empty prompt) are placed as by `affinity`.
"""

from __future__ import annotations

from collections.abc import Collection

from router.config import RouterConfig
from router.fleet import Fleet
from router.keys import RoutingKey
from router.placement import Candidate, Placement
from router.policy.affinity import Affinity
from router.policy.base import Decision, Policy
from router.prompt import Prompt

HOME_SHARE = 0.5  # a keyless conversation's home holds at least this share of its prompt (not only an opening)


class Ttft(Policy):
    name = "ttft"
    keyed = True

    def __init__(self, fleet: Fleet, config: RouterConfig) -> None:
        super().__init__(fleet, config)
        self.placement: Placement = Placement(fleet, config)
        self.fallback = Affinity(fleet, config)
        self.stay_share = config.ttft_stay_share

    def pick(self, key: RoutingKey, last: str | None, exclude: Collection[int]) -> Decision | None:
        prompt = key.prompt
        if prompt is None:
            return self.fallback.pick(key, last, exclude)
        return self.decide(key, prompt, last, exclude)[0]

    @staticmethod
    def evidence(key: RoutingKey, last: str | None) -> str | None:
        """Where a session's history lives, if the key says so: a fingerprint (the first message)
        is shared by every conversation that opens alike, so it proves nothing; the index knows."""
        return last if key.kind in ("header", "body") else None

    def decide(
        self, key: RoutingKey, prompt: Prompt, last: str | None, exclude: Collection[int]
    ) -> tuple[Decision | None, Placement]:
        """The decision (its `cost` the chosen replica's row; every candidate's in the placement's
        `rows()`, for /admin/route)."""
        fleet = self.fleet
        placement = self.placement
        tried = exclude
        exclude = self.avoiding(key, exclude)  # and the replicas not serving its model
        last_index = self.session_replica(self.evidence(key, last), exclude)
        # a conversation's home: a keyed session's replica, else the one holding most of the prompt
        staying = self.stay_share and last_index is None
        best, near, holding = placement.price(
            prompt,
            exclude,
            last_index,
            placement.clock(),
            HOME_SHARE if staying else -1.0,
            cold=fleet.adapter_cold(key.model),
        )
        if best == -2:
            return None, placement
        tie = near > 1
        if best == -1:  # every one past the gate: the least full of them (a queue still beats an error)
            rows = placement.rows()
            best = min(rows, key=lambda c: (fleet.fullness(c.index), c.cost_s)).index
        elif tie:
            # within the tie margin: the session's replica, else the least full, else the ring
            close = placement.near()
            if last_index in close:
                best = last_index
            else:
                fewest = min(fleet.fullness(i) for i in close)
                least = {i for i in close if fleet.fullness(i) == fewest}
                ring_key = key.key if key.kind != "none" else prompt.chain.tobytes()[:8]
                best = next((i for i in fleet.ring.successors(ring_key) if i in least), min(least))
        if self.stay_share:
            # the replica that holds the conversation keeps it unless moving saves a real share of
            # its cost: a move costs the cache it leaves behind, and near-equal guesses are noise
            home = last_index if last_index is not None else holding
            if home is not None and home >= 0 and home != best and placement.stays(home, best, self.stay_share):
                best = home
        chosen = placement.row(best)
        return Decision(best, self._reason(chosen, last_index, tried, placement, tie), chosen), placement

    @staticmethod
    def _reason(
        chosen: Candidate, last_index: int | None, exclude: Collection[int], placement: Placement, tie: bool
    ) -> str:
        if exclude:
            return "failover"
        if last_index is not None:
            if chosen.index == last_index:
                return "sticky"
            return "spill" if placement.row(last_index).gated else "cost"
        if chosen.cached_tokens > 0:
            return "prefix"
        return "ring" if tie else "cost"
