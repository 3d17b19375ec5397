"""`affinity` (default): sticky session → ring owner under bounded load → next replica clockwise.

1. Sticky: if the session's last replica still routes (or is draining: it keeps its sessions
   until the drain has warmed and moved them), was not tried, and is under the bounded-load
   cap, go back to it: its KV cache holds the conversation, even if the session was spilled or
   migrated there.
2. Ring: otherwise the first replica clockwise from the key whose in-flight load is under
   ceil(c · (total in flight + 1) / routable replicas) — the owner when it is not overloaded,
   else its successor ("spill"), never a random replica.
The cap never goes below `bounded_load_floor`: at a few requests in flight the cap's rounding
would otherwise spill sessions away from their cache for a queue of one or two, which costs a
replica far less than recomputing a conversation. Where replicas' capacities are known (engine
slots, `max_num_seqs`, or `replica_capacity`), caps and floor respect them (router.fleet.LoadCaps):
a request queued behind full slots waits a whole reply, while a free slot elsewhere only costs a
recompute of the context, so a full replica spills while another has room.
Requests without a key spread least-loaded (ties rotate).
A request naming a model goes only to replicas that may serve it (router.fleet.Fleet.not_serving):
its ring owner is the first of them clockwise, so replicas of other models joining or leaving
never move its sessions, and its load cap counts only them. A request for a LoRA adapter that some
replicas have loaded (router.fleet.Fleet.adapter_cold) and its owner has not goes, unless it has a
session replica, to the first of those clockwise that is under its cap (reason `adapter`); all at
their caps, to its owner, which loads it. With admission on (router.tenancy.admission),
a full replica is no candidate either while another has room.
With worker processes, other workers' in-flight counts arrive every few tens of milliseconds;
before a load cap changes a decision they are re-read, so a spill is never caused by a count
that has already gone down.
"""

from __future__ import annotations

from collections.abc import Collection

from router.fleet import NONE
from router.keys import RoutingKey
from router.policy.base import Decision, Policy, clockwise


class Affinity(Policy):
    name = "affinity"
    keyed = True
    # a session's replica that is there, routable and not tried is passed over only at its load
    # cap: its jump counts as a spill (where `ttft` falls back on this policy, by its state)
    passes_over = "spill"

    def pick(
        self,
        key: RoutingKey,
        last: str | None,
        exclude: Collection[int],
        *,
        parent: bool = False,
        target_s: float | None = None,
    ) -> Decision | None:
        if key.kind == "none":
            return self.least_loaded(self.avoiding(key, exclude))
        skip = self.skipping(key)
        decision, capped = self._pick(key, last, exclude, skip)
        if capped and self.fleet.refresh_loads is not None:
            self.fleet.refresh_loads()
            decision, _ = self._pick(key, last, exclude, skip)
        return decision

    def _pick(
        self, key: RoutingKey, last: str | None, exclude: Collection[int], skip: frozenset[int] = NONE
    ) -> tuple[Decision | None, bool]:
        """The decision, and whether a load cap changed it (`skip`: replicas not serving its model)."""
        fleet, ring = self.fleet, self.fleet.ring
        floor = self.caps.bounded_load_floor
        over = self.passes_over  # how a session's jump away counts (router.policy.base.Decision)
        capped = False
        loads = fleet.loads
        c = self.caps.bounded_load_c
        limit = fleet.load_limit(fleet.load_cap_among(skip, c) if skip else ring.load_cap(loads, c), floor)
        if isinstance(limit, int):  # no capacity known: one cap for every replica, as before

            def under(i: int) -> bool:
                return loads[i] < limit

        else:
            cap_of = limit.of

            def under(i: int) -> bool:
                return loads[i] < cap_of(i)

        previous = self.session_replica(last, skip.union(exclude) if skip else exclude)
        if previous is not None:
            if under(previous):
                return Decision(previous, "sticky", passed_over=over), False
            capped = True
        if not exclude:
            owner = ring.lookup(key.key)
            if skip and owner in skip:  # the model's owner: the first clockwise that serves it
                owner = next((i for i in clockwise(ring, key.key) if i not in skip), -1)
            if owner < 0:
                return None, capped
            cold = fleet.adapter_cold(key.model)
            if cold and owner in cold:
                # a LoRA adapter loaded elsewhere: the first replica clockwise that has it, under its cap
                warm = next((i for i in clockwise(ring, key.key) if i not in skip and i not in cold and under(i)), -1)
                if warm >= 0:  # (a session off its capped replica spills there)
                    return Decision(warm, "spill" if capped else "adapter", passed_over=over), capped
            if under(owner):
                return Decision(owner, "ring", passed_over=over), capped
            # the next replica clockwise under its cap (the floor included, which the ring's own
            # lookup_bounded does not know); every one at its cap: the least full of them
            spill = next((i for i in clockwise(ring, key.key) if i not in skip and under(i)), -1)
            if spill < 0:
                spill = min((i for i in ring.successors(key.key) if i not in skip), key=fleet.fullness)
            return Decision(spill, "spill", passed_over=over), True
        fallback: int | None = None
        for i in clockwise(ring, key.key):
            if i in exclude or i in skip:
                continue
            if under(i):
                return Decision(i, "failover", passed_over=over), capped
            capped = True
            if fallback is None:
                fallback = i
        # every untried replica is at its cap: a retry still beats an error
        return (None if fallback is None else Decision(fallback, "failover", passed_over=over)), capped
