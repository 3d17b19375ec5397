"""The replicas' rows: the arrays by fleet position that the compiled price reads, kept in step with their records."""

from __future__ import annotations

import math
from array import array

from router.fleet import Fleet, LoadCaps
from router.placement.records import Held

WAITING_REFRESH_S = 0.05  # the engines' probed queues are re-read at most this often


class Rows:
    """Per fleet position, what `PrefixIndex.price` (router.prefix) reads of each replica: its
    holder in the index, when its prefill queue drains, its prefill speed, its recent traffic, the
    requests its engine says are waiting, whether it may be routed to, and its in-flight cap. Laid
    out again when the fleet's membership changes (`lay`); a record's change reaches its row
    through `set_busy`, `set_spt` and `set_recent`, which skip a record the rows do not hold (a
    replica that left, or one not laid out yet)."""

    def __init__(self) -> None:
        self.version = -1  # the fleet's version they were laid out for
        self.helds: list[Held] = []
        self.holders = array("i")
        self.busy = self.spt = self.recent = self.waiting = array("d")
        self.zeros = array("d")  # n zeros: the rows a price fills start as copies of it ...
        self.no_flags = array("B")  # ... and its flags
        self._waiting_at = -math.inf
        self._routable = array("B")
        self._routable_for: object = None
        self._caps = array("q")
        self._uniform_cap: tuple[int, int] | None = None

    def current(self, fleet: Fleet) -> bool:
        return self.version == fleet.version and len(self.holders) == len(fleet.replicas)

    def lay(self, helds: list[Held], version: int) -> None:
        """The rows of `helds`, in fleet order, for the fleet's `version`."""
        n = len(helds)
        for pos, held in enumerate(helds):
            held.pos = pos
        self.holders = array("i", [h.holder for h in helds])
        self.busy = array("d", [h.busy_until for h in helds])
        self.spt = array("d", [h.seconds_per_token for h in helds])
        self.recent = array("d", [h.recent for h in helds])
        self.waiting = array("d", [-1.0] * n)
        self._waiting_at = -math.inf
        self.zeros = array("d", [0.0]) * n
        self.no_flags = array("B", bytes(n))
        self._routable_for = None
        self.helds = helds
        self.version = version

    def holds(self, held: Held) -> bool:
        """`held` has a row (it is laid out at its position)."""
        return held.pos < len(self.helds) and self.helds[held.pos] is held

    def set_busy(self, held: Held, value: float) -> None:
        """When what was sent to `held` is prefilled (kept in its row too)."""
        held.busy_until = value
        if self.holds(held):
            self.busy[held.pos] = value

    def set_spt(self, held: Held, value: float) -> None:
        """Its prefill speed, in seconds per token (kept in its row too)."""
        held.seconds_per_token = value
        if self.holds(held):
            self.spt[held.pos] = value

    def set_recent(self, held: Held) -> None:
        """Its recent traffic, as its record says now."""
        if self.holds(held):
            self.recent[held.pos] = held.recent

    def scale_recent(self, factor: float) -> None:
        recent = self.recent
        for i in range(len(recent)):
            recent[i] *= factor

    def refresh_waiting(self, fleet: Fleet, now: float) -> None:
        """The requests each engine says are waiting (-1: it says nothing), read again at most
        every WAITING_REFRESH_S: probes come every few seconds."""
        if now - self._waiting_at > WAITING_REFRESH_S:
            for i, r in enumerate(fleet.replicas):
                w = r.engine.waiting
                self.waiting[i] = -1.0 if w is None else w
            self._waiting_at = now

    def unroutable(self, fleet: Fleet) -> array[int]:
        """Per position, 1 where the replica may not be routed to (the ring's snapshot says);
        the same array while that snapshot stands (never changed in place)."""
        snapshot = fleet.ring.current
        if self._routable_for is not snapshot:
            self._routable = array("B", [0 if fleet.routable(i) else 1 for i in range(len(self.holders))])
            self._routable_for = snapshot
        return self._routable

    def caps(self, limit: int | LoadCaps) -> array[int]:
        """Per position, the most requests in flight under the gate (`limit`: one for all, or by position)."""
        n = len(self.holders)
        if isinstance(limit, int):
            if self._uniform_cap != (limit, n):
                self._caps = array("q", [limit]) * n
                self._uniform_cap = (limit, n)
        else:
            self._caps = array("q", [limit.of(i) for i in range(n)])
            self._uniform_cap = None
        return self._caps


__all__ = ["WAITING_REFRESH_S", "Rows"]
