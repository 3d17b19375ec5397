"""`round_robin`: each request to the next routable replica (the baseline the field started from)."""

from __future__ import annotations

from collections.abc import Collection

from router.keys import RoutingKey
from router.policy.base import Decision, Policy


class RoundRobin(Policy):
    name = "round_robin"

    def pick(
        self,
        key: RoutingKey,
        last: str | None,
        exclude: Collection[int],
        *,
        parent: bool = False,
        target_s: float | None = None,
    ) -> Decision | None:
        n = len(self.fleet)
        exclude = self.avoiding(key, exclude)
        for _ in range(n):
            i = next(self._rotation) % n
            if i not in exclude and self.fleet.routable(i):
                return Decision(i, "round_robin")
        return None
