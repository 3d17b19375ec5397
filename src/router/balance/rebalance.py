"""Overheat rebalancing: hand a persistently hot replica's hottest vnodes to the coolest replicas.

Every `interval_s` the control loop feeds each replica's load (in-flight requests plus requests
waiting in its engine's queue) into an exponentially weighted moving average (time constant
`window_s / 3`). A replica is *hot* while its average stays above `(1 + threshold) x mean` of
the routable replicas; once it has been hot for `window_s` seconds and neither it nor any
candidate is cooling down, `plan()` picks its hottest vnodes by recent traffic (counted per vnode
from the keys routed there) and, for each, the coolest replica that would stay below the mean
after taking that vnode's share. At most `max_vnodes` move per cycle. Afterwards both sides cool
down for `cooldown_s`, and a moved vnode is left alone for four cooldowns, so a steady skewed load
settles instead of bouncing vnodes back and forth.

Worked example (threshold 0.5): loads 30, 10, 10, 10 (mean 15): replica 0 is above 22.5; its
hottest vnode carries 40% of its traffic (~12 load units); the coolest replica at 10 would reach
22, above the 18 left behind, so that vnode stays; a vnode carrying 10% (3 units) moves (13 < 27).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RebalanceSettings:
    # the settings rebalance_threshold, _window_s, _cooldown_s and _max_vnodes (their defaults: router.config)
    threshold: float  # theta: hot above (1 + theta) x mean
    window_s: float  # W: hot this long before anything moves
    cooldown_s: float  # C: both sides rest this long after a move
    max_vnodes: int  # moved per cycle at most
    min_load: float = 2.0  # a fleet whose mean load is below this is not rebalanced

    def __post_init__(self) -> None:
        if not (math.isfinite(self.threshold) and self.threshold > 0):
            raise ValueError("threshold must be a positive number")
        if not (self.window_s > 0 and self.cooldown_s >= 0 and self.max_vnodes >= 1 and self.min_load >= 0):
            raise ValueError("window_s > 0, cooldown_s >= 0, max_vnodes >= 1 and min_load >= 0 are required")


@dataclass(frozen=True)
class Move:
    origin: str  # the vnode's own replica (its point is at xxh3(origin#number))
    number: int
    source: str  # its current owner (hot)
    target: str  # its new owner (cool)
    share: float  # the vnode's share of the source's recent keyed traffic


@dataclass
class _Replica:
    load: float = 0.0  # EWMA
    hot_since: float | None = None
    resting_until: float = 0.0


@dataclass
class Rebalancer:
    settings: RebalanceSettings
    _replicas: dict[str, _Replica] = field(default_factory=dict)
    _last_sample: float | None = None
    _vnode_rest: dict[tuple[str, int], float] = field(default_factory=dict)
    moves: int = 0

    def observe(self, loads: dict[str, float], now: float) -> None:
        """Feed the current load of every routable replica (others are dropped from the average)."""
        dt = 0.0 if self._last_sample is None else max(now - self._last_sample, 0.0)
        self._last_sample = now
        alpha = 1.0 - math.exp(-dt / (self.settings.window_s / 3)) if dt > 0 else 1.0
        for rid in [r for r in self._replicas if r not in loads]:
            del self._replicas[rid]
        for rid, load in loads.items():
            state = self._replicas.get(rid)
            if state is None:
                self._replicas[rid] = state = _Replica(load=load)
            else:
                state.load += alpha * (load - state.load)
        mean = self.mean()
        for state in self._replicas.values():
            if mean >= self.settings.min_load and state.load > (1 + self.settings.threshold) * mean:
                if state.hot_since is None:
                    state.hot_since = now
            else:
                state.hot_since = None

    def loads(self) -> dict[str, float]:
        return {rid: s.load for rid, s in self._replicas.items()}

    def total(self) -> float:
        return sum(s.load for s in self._replicas.values())

    def mean(self) -> float:
        return sum(s.load for s in self._replicas.values()) / len(self._replicas) if self._replicas else 0.0

    def load(self, replica_id: str) -> float:
        state = self._replicas.get(replica_id)
        return state.load if state is not None else 0.0

    def overheated(self, now: float) -> list[str]:
        """Replicas hot for at least the window (the autoscaler's overheat signal counts these)."""
        w = self.settings.window_s
        return [rid for rid, s in self._replicas.items() if s.hot_since is not None and now - s.hot_since >= w]

    def plan(self, now: float, traffic: Counter[tuple[str, int]], owners: dict[tuple[str, int], str]) -> list[Move]:
        """The vnodes to move this cycle. `traffic` counts recent keyed requests per vnode
        (origin id, number); `owners` maps each of those vnodes to its current owner."""
        s = self.settings
        mean = self.mean()
        moves: list[Move] = []
        resting = {rid for rid, st in self._replicas.items() if st.resting_until > now}
        for source in sorted(self.overheated(now), key=self.load, reverse=True):
            if source in resting:
                continue
            mine = [(vnode, count) for vnode, count in traffic.items() if owners.get(vnode) == source and count > 0]
            total = sum(count for _, count in mine)
            if total == 0:
                continue
            source_load = self._replicas[source].load
            projected = {rid: st.load for rid, st in self._replicas.items()}
            for vnode, count in sorted(mine, key=lambda item: item[1], reverse=True):
                if len(moves) >= s.max_vnodes or projected[source] <= (1 + s.threshold / 2) * mean:
                    break
                if self._vnode_rest.get(vnode, 0.0) > now:
                    continue
                carried = source_load * count / total
                hot_line = (1 + s.threshold) * mean
                candidates = [
                    rid
                    for rid in projected
                    if rid != source
                    and rid not in resting
                    and projected[rid] + carried < min(hot_line, projected[source] - carried)
                ]
                if not candidates:
                    continue
                target = min(candidates, key=lambda rid: projected[rid])
                projected[target] += carried
                projected[source] -= carried
                moves.append(Move(vnode[0], vnode[1], source, target, count / total))
        return moves

    def moved(self, moves: Iterable[Move], now: float) -> None:
        """The moves were made: rest both sides and the vnodes."""
        for move in moves:
            for rid in (move.source, move.target):
                state = self._replicas.get(rid)
                if state is not None:
                    state.resting_until = now + self.settings.cooldown_s
                    state.hot_since = None
            self._vnode_rest[(move.origin, move.number)] = now + 4 * self.settings.cooldown_s
            self.moves += 1
        self._vnode_rest = {v: t for v, t in self._vnode_rest.items() if t > now}


class VnodeTraffic:
    """Keyed requests per vnode, decayed each cycle (a half-life of `half_life` cycles)."""

    def __init__(self, half_life: float = 5.0) -> None:
        self.recent: Counter[tuple[str, int]] = Counter()
        self._factor = 0.5 ** (1.0 / half_life)

    def record(self, origin: str, number: int) -> None:
        self.recent[(origin, number)] += 1

    def decay(self) -> None:
        factor = self._factor
        self.recent = Counter({v: c * factor for v, c in self.recent.items() if c * factor >= 0.5})
