"""The interface every policy implements, and the least-loaded pick they share as a fallback.

A policy answers one question, `pick`: which replica for this request. Its `Decision` carries what
the routing core needs to count the answer (why, and how a session's jump counts), and a policy
that learns from the attempts it caused (`ttft`: its prefix index and prefill queues) hands each
route a `Hearing`, told of every attempt: sent, released, failed, answered. `explain` gives the
same answer as `pick` without moving anything (for /admin/route).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self

from router.config import RouterConfig
from router.config.groups import RingSettings
from router.fleet import Fleet, ReplicaState
from router.keys import RoutingKey
from router.ring import Ring

if TYPE_CHECKING:
    from router.placement import Answer, Candidate, Prediction


FIRST_STEPS = 8  # replicas a clockwise walk asks the ring for at first


def clockwise(ring: Ring, key: bytes) -> Iterator[int]:
    """The distinct replicas clockwise from `key`, in `ring.successors`' order, asked for a few
    at first: a walk that stops early (the common case: a spill finds a replica under its cap
    a step or two on) never builds the whole fleet's order, 40 µs at a thousand replicas."""
    head = ring.successors(key, FIRST_STEPS)
    yield from head
    if len(head) == FIRST_STEPS:
        yield from ring.successors(key)[FIRST_STEPS:]


@dataclass(frozen=True, slots=True)
class Decision:
    index: int
    reason: (
        str  # sticky | ring | spill | failover | round_robin | least_load | prefix | cost | target | adapter | parent
    )
    cost: Candidate | None = field(default=None, compare=False)  # ttft: the chosen replica's row
    # how a session's jump to this replica counts (router_session_jumps' reason): `jump` whatever
    # became of the replica it left; else, where that replica is still there, routable and not
    # tried, `passed_over` (`affinity` passes it over only at its load cap: `spill`)
    jump: str | None = field(default=None, compare=False)
    passed_over: str = field(default="ring", compare=False)
    late: bool = field(default=False, compare=False)  # ttft: no replica is predicted to meet the request's target
    # the replica a session's turn leaves for this one (where it was served last), set by the route
    # when the pick moves it: where its cache is (router.proxy.disagg moves it over with a split)
    left: str | None = field(default=None, compare=False)


class Hearing(Protocol):
    """What a policy learns from the attempts of one route: each replica it was `sent` to (with
    the decision), `released` when that attempt ends however it ended, `failed` before its first
    byte, or `answered` with what the answer showed (the prediction it made there, if any), and
    whether the answer `called_tools` (its conversation comes back within seconds)."""

    def sent(self, replica: ReplicaState, decision: Decision, now: float) -> None: ...

    def released(self, replica: ReplicaState, now: float) -> None: ...

    def failed(self, replica: ReplicaState) -> None: ...

    def answered(self, replica: ReplicaState, answer: Answer) -> Prediction | None: ...

    def called_tools(self, replica: ReplicaState) -> None: ...

    def blocks_held(self, replica: ReplicaState) -> int: ...


@dataclass(frozen=True, slots=True)
class Explained:
    """What `explain` found: the decision (None: no replica can serve), and the policy's own
    account of it (`ttft`: every candidate's price), as JSON-ready fields."""

    decision: Decision | None
    details: dict[str, Any] = field(default_factory=dict)


class Policy:
    name: ClassVar[str] = ""
    keyed: ClassVar[bool] = False  # it routes by the request's key (else the key only counts jumps)
    reads_prompts: ClassVar[bool] = False  # its keys carry the prompt's blocks (router.prompt)

    def __init__(self, fleet: Fleet, ring: RingSettings) -> None:
        """`ring`: the ring's settings; of them a policy keeps the load caps (`bounded_load_c`, `_floor`)."""
        self.fleet = fleet
        self.caps = ring
        self.clock: Callable[[], float] = time.monotonic
        self._rotation = itertools.count()

    @classmethod
    def from_config(cls, fleet: Fleet, config: RouterConfig) -> Self:
        """The policy with the groups of settings it reads (the ring's, by default)."""
        return cls(fleet, config.ring)

    def pick(
        self,
        key: RoutingKey,
        last: str | None,
        exclude: Collection[int],
        *,
        parent: bool = False,
        target_s: float | None = None,
    ) -> Decision | None:
        """Where a request for `key` goes, never to a replica in `exclude`; `last`: where its session
        was served last, or with `parent`, where the session that started it (a sub-agent's) was,
        which it shares a context with but is not its own: nothing is remembered of leaving it;
        `target_s`: the time to first token the request asks for, from now (a policy that predicts
        it, `ttft`, places the request where it is met and says when none meets it: `late`)."""
        raise NotImplementedError

    def explain(self, key: RoutingKey, last: str | None) -> Explained:
        """`pick`'s answer for a first attempt, with nothing moved or remembered; a policy that does
        not route by key (its pick moves a rotation) explains nothing."""
        return Explained(self.pick(key, last, ()) if self.keyed else None)

    def hear(self, key: RoutingKey) -> Hearing | None:
        """What hears of the attempts of a route for `key` (None: the policy learns nothing from them)."""
        return None

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Run on `clock` (monotonic seconds), the routing core's: a simulator's is virtual."""
        self.clock = clock

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
