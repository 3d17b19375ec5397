"""`least_load`: the replica with the fewest requests in flight (a baseline: no affinity at all)."""

from __future__ import annotations

from collections.abc import Collection

from router.keys import RoutingKey
from router.policy.base import Decision, Policy


class LeastLoad(Policy):
    name = "least_load"

    def pick(
        self,
        key: RoutingKey,
        last: str | None,
        exclude: Collection[int],
        *,
        parent: bool = False,
        target_s: float | None = None,
    ) -> Decision | None:
        return self.least_loaded(self.avoiding(key, exclude))
