"""`consistent_hash`: the owner of the key on the ring, nothing else (no load bound, no stickiness).

Requests without a key spread least-loaded. A retry walks clockwise past the replicas tried.
"""

from __future__ import annotations

from collections.abc import Collection

from router.keys import RoutingKey
from router.policy.base import Decision, Policy


class ConsistentHash(Policy):
    name = "consistent_hash"
    keyed = True

    def pick(
        self,
        key: RoutingKey,
        last: str | None,
        exclude: Collection[int],
        *,
        parent: bool = False,
        target_s: float | None = None,
    ) -> Decision | None:
        avoid = self.avoiding(key, exclude)
        if key.kind == "none":
            return self.least_loaded(avoid)
        ring = self.fleet.ring
        i = ring.lookup_excluding(key.key, avoid) if avoid else ring.lookup(key.key)
        if i < 0:
            return None
        return Decision(i, "failover" if exclude else "ring")
