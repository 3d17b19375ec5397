"""A replica's health state, moved by its scores with hysteresis, and the ring weight it implies.

    healthy --score < remove_below--> suspect --k low scores in a row--> removed
       ^                                 | a score >= remove_below            |
       |<--------------------------------'                                    | k' scores > return_above
       |                                                                       v   in a row
       '<------------- the weight ramp has run its course ------------- recovering
                                           (k low scores in a row send it back to removed)

`draining` is set and cleared by an operator and ignores scores; `warming` (a replica just added:
its weight ramps up while sessions' caches are warmed on it, see router.balance) leaves like
`recovering`. Removal needs k low
scores in a row and return needs k' scores above a higher threshold in a row, so a noisy signal
near one threshold never flaps a replica in and out of routing. A replica removed again while
still recovering is flapping: each such relapse doubles the good scores its next return needs
(up to `flap_backoff` times `return_after`), until it completes a ramp and is healthy again.

Ring weight: 0 when removed or draining; otherwise score / full_weight_at, clamped to
[min_weight, 1], so a degraded-but-alive replica takes a smaller share; while recovering it is
further capped by a ramp from `ramp_from` to 1 over `ramp_s` seconds, climbed in RAMP_STEPS equal
steps, so a returning replica does not take its whole share (and a cold cache's worth of
sessions) at once. Whole steps let several routers that know when a slow start began agree on
its weight at every moment, not only at its end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STATES = ("healthy", "suspect", "removed", "recovering", "draining", "warming")
ROUTABLE = frozenset({"healthy", "suspect", "recovering", "warming"})
RAMP_STEPS = 10  # 0.09 of weight a step from ramp_from 0.1: each above fleet.WEIGHT_STEP, so each is applied


@dataclass(frozen=True)
class Hysteresis:
    remove_below: float = 0.5
    return_above: float = 0.7
    remove_after: int = 3  # k: low scores in a row before removal
    return_after: int = 3  # k': high scores in a row before return
    ramp_s: float = 30.0
    ramp_from: float = 0.1
    full_weight_at: float = 0.9
    min_weight: float = 0.1
    flap_backoff: int = 8  # a flapping replica's return needs at most this many times return_after

    def __post_init__(self) -> None:
        if not 0 <= self.remove_below < self.return_above <= 1:
            raise ValueError("need 0 <= remove_below < return_above <= 1")
        if self.remove_after < 1 or self.return_after < 1:
            raise ValueError("remove_after and return_after must be at least 1")
        if not (self.ramp_s >= 0 and 0 < self.ramp_from <= 1 and 0 < self.full_weight_at <= 1):
            raise ValueError("ramp_s >= 0, ramp_from in (0, 1] and full_weight_at in (0, 1] are required")
        if not 0 < self.min_weight <= 1:
            raise ValueError("min_weight must be in (0, 1]")
        if self.flap_backoff < 1:
            raise ValueError("flap_backoff must be at least 1")


class ReplicaHealth:
    # bumped by every change of any replica's state in this process: what is laid out by the
    # states (router.placement.events.Layout's verdicts) knows when it is stale
    changes = 0

    def __init__(self, rules: Hysteresis | None = None, state: str = "healthy") -> None:
        if state not in STATES:
            raise ValueError(f"unknown state {state!r}")
        self.rules = rules or Hysteresis()
        self._state = state
        ReplicaHealth.changes += 1
        self.score = 1.0
        self.transitions = 0
        self.relapses = 0  # removals during recovery: the replica is flapping
        self.return_needed = self.rules.return_after  # grows while it flaps
        self._bad = 0
        self._good = 0
        self._ramp_start = 0.0

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, state: str) -> None:
        if state != self._state:
            self._state = state
            ReplicaHealth.changes += 1

    @property
    def routable(self) -> bool:
        return self._state in ROUTABLE

    @property
    def up(self) -> bool:
        """Routable, or drained by an operator: its engine serves what it holds (and may hand a
        session's KV over); not removed by its scores, whose engine may be gone."""
        return self.state in ROUTABLE or self.state == "draining"

    def _move(self, state: str, now: float) -> str:
        if state == "removed" and self.state == "recovering":
            self.relapses += 1
            cap = self.rules.return_after * self.rules.flap_backoff
            self.return_needed = min(self.return_needed * 2, cap)
        elif state == "healthy" and self.state == "recovering":
            self.return_needed = self.rules.return_after  # it stayed up for a whole ramp
        self.state = state
        self.transitions += 1
        self._bad = self._good = 0
        if state in ("recovering", "warming"):
            self._ramp_start = now
        return state

    def observe(self, score: float, now: float) -> str | None:
        """Take one probe's score; returns the new state when it changed."""
        r = self.rules
        self.score = min(max(score, 0.0), 1.0)
        low = self.score < r.remove_below
        state = self.state
        if state == "draining":
            return None
        if state in ("healthy", "suspect", "recovering", "warming"):
            self._bad = self._bad + 1 if low else 0
            if self._bad >= r.remove_after:
                return self._move("removed", now)
            if state == "healthy" and low:
                self.state = "suspect"  # counted as a transition: it is visible in /admin and metrics
                self.transitions += 1
                return "suspect"
            if state == "suspect" and not low:
                self.state = "healthy"
                self.transitions += 1
                return "healthy"
            return self.tick(now)
        # removed
        self._good = self._good + 1 if self.score > r.return_above else 0
        if self._good >= self.return_needed:
            return self._move("recovering", now)
        return None

    def tick(self, now: float) -> str | None:
        """A recovering or warming replica whose ramp has run its course is healthy."""
        if self.state in ("recovering", "warming") and now - self._ramp_start >= self.rules.ramp_s:
            return self._move("healthy", now)
        return None

    def drain(self, now: float) -> None:
        if self.state != "draining":
            self._move("draining", now)

    def start_warming(self, now: float) -> None:
        """A new replica: routable, its weight ramping up (slow start) while caches are warmed."""
        self._move("warming", now)

    def weight(self, now: float) -> float:
        """The ring weight this health implies (0 takes the replica out of the ring)."""
        r = self.rules
        if not self.routable:
            return 0.0
        weight = min(max(self.score / r.full_weight_at, r.min_weight), 1.0)
        if self.state in ("recovering", "warming") and r.ramp_s > 0:
            # in whole steps, each on a whole second from its start: routers that share a slow
            # start's start time step it alike, in the same second (router.membership)
            elapsed = math.floor(now - self._ramp_start) if r.ramp_s >= 1 else now - self._ramp_start
            progress = math.floor(min(max(elapsed / r.ramp_s, 0.0), 1.0) * RAMP_STEPS) / RAMP_STEPS
            weight = min(weight, r.ramp_from + (1.0 - r.ramp_from) * progress)
        return weight
