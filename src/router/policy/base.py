"""The interface every policy implements, and the least-loaded pick they share as a fallback."""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from router.config import RouterConfig
from router.fleet import Fleet
from router.keys import RoutingKey

if TYPE_CHECKING:
    from router.placement import Candidate, Placement


@dataclass(frozen=True, slots=True)
class Decision:
    index: int
    reason: str  # sticky | ring | spill | failover | round_robin | least_load | prefix | cost | adapter
    cost: Candidate | None = field(default=None, compare=False)  # ttft: the chosen replica's row


class Policy:
    name: ClassVar[str] = ""
    keyed: ClassVar[bool] = False  # it routes by the request's key (else the key only counts jumps)
    placement: Placement | None = None  # ttft: the prefix index and prefill queues its answers feed

    def __init__(self, fleet: Fleet, config: RouterConfig) -> None:
        self.fleet = fleet
        self.config = config
        self._rotation = itertools.count()

    def pick(self, key: RoutingKey, last: str | None, exclude: Collection[int]) -> Decision | None:
        raise NotImplementedError

    def skipping(self, key: RoutingKey) -> frozenset[int]:
        """The replicas that are no candidates for this key: those known not to serve its model,
        and, with admission on, those full while another that serves it has room."""
        fleet = self.fleet
        skip = fleet.not_serving(key.model)
        if fleet.full_of is not None:
            full = fleet.full_of(skip)
            if full:
                return skip | full
        return skip

    def avoiding(self, key: RoutingKey, exclude: Collection[int]) -> Collection[int]:
        """`exclude` (the replicas tried) and the `skipping` ones."""
        skip = self.skipping(key)
        if not skip:
            return exclude
        return skip.union(exclude) if exclude else skip

    def session_replica(self, last: str | None, exclude: Collection[int]) -> int | None:
        """The index of `last`, the replica the session was served on last, while it can take the
        session's next turn: in the fleet, not tried for this request, routable or draining (a
        draining replica keeps its sessions until the drain has warmed and moved them)."""
        if last is None:
            return None
        previous = self.fleet.find(last)
        if (
            previous is None
            or previous.index is None
            or previous.index in exclude
            or not (self.fleet.routable(previous.index) or previous.state == "draining")
        ):
            return None
        return previous.index

    def least_loaded(self, exclude: Collection[int], reason: str = "least_load") -> Decision | None:
        """The routable replica with the fewest in-flight requests for its capacity. Ties rotate, so
        equal loads never pin traffic to the first replica in the list."""
        n = len(self.fleet)
        if n == 0:
            return None
        start = next(self._rotation) % n
        best: int | None = None
        loads = self.fleet.loads
        ratios = self.fleet.capacity_ratios()
        fullest = float("inf")
        for step in range(n):
            i = (start + step) % n
            if i in exclude or not self.fleet.routable(i):
                continue
            full = loads[i] if ratios is None else loads[i] / ratios[i]
            if full < fullest:
                best, fullest = i, full
        return None if best is None else Decision(best, reason)
