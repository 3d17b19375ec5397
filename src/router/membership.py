"""Every change to the fleet — add, remove, drain, override — in one place and in one order.

A change, wherever it comes from (the admin API, discovery, the balance loop, another router
through Redis, the saved routing state), goes through `Membership`:

1. the fleet and its ring change (a new replica starts its slow start at once: no cold moment at
   full weight; a replica that left loses its gauges and its shared slot);
2. the fleet is published (to shared memory, for the worker processes and router-agents) and the
   routing state is marked for saving;
3. the change is shared with the other routers (unless it came from them);
4. the balance loop is told: warm-up and session moves for a new replica, moves for a drain.

Slow starts, drains and overrides are fleet-wide facts, shared whole: an override with its owner,
a drain with whether it removes the replica and when it began, a slow start with the second it
began (unix time), so that a router that starts late computes the same ring weights as its peers
at once. Health states stay each router's own reading.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.config import ReplicaSpec
from router.errors import RouterError
from router.fleet import Fleet, ReplicaState
from router.ring import MovedRange

log = logging.getLogger("router.membership")


class NoRoom(RouterError, RuntimeError):
    """The shared replica table has no free slot for another replica."""


class Clash(RouterError, ValueError):
    """A new replica's id or URL is another replica's; str() says which."""


class Peers(Protocol):
    """The other routers (Redis): told of every change made here."""

    def changed(self, op: str, arg: Any) -> None: ...


class Mover(Protocol):
    """The balance loop: what follows a new replica or a drain."""

    async def added(self, replica: ReplicaState) -> int | None: ...

    async def drain(self, replica: ReplicaState, remove: bool) -> int | None: ...


@dataclass
class Facts:
    """The fleet-wide routing facts, as another router or a saved state has them."""

    replicas: dict[str, str] = field(default_factory=dict)  # id -> url
    roles: dict[str, str] = field(default_factory=dict)  # id -> role, where not "both" (decode replicas)
    removed: set[str] = field(default_factory=set)  # ids removed (and not added back since)
    draining: dict[str, bool] = field(default_factory=dict)  # id -> whether it leaves once drained
    warming: dict[str, float] = field(default_factory=dict)  # id -> unix time its slow start began
    drained: dict[str, float] = field(default_factory=dict)  # id -> unix time its drain began
    overrides: dict[tuple[str, int], str] = field(default_factory=dict)  # (origin, vnode) -> owner
    discovered: set[str] = field(default_factory=set)  # ids that discovery added (and may remove)


@dataclass
class Settle:
    """What a batch of changes leaves for the balance loop."""

    added: list[ReplicaState] = field(default_factory=list)
    drained: list[tuple[ReplicaState, bool]] = field(default_factory=list)


class Membership:
    def __init__(
        self,
        fleet: Fleet,
        forget: Callable[[str], None] = lambda replica_id: None,
        room: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.fleet = fleet
        self.discovery = False  # replica discovery runs here (router.engines.discovery): what it added is kept
        self._forget = forget  # a replica left: drop its gauges
        self._room = room
        self._clock = clock
        self._wall = wall
        self.changes = 0  # goes up with every change (the routing state is saved when it moved)
        self.published: list[Callable[[], None]] = []  # called after every change
        self.released: list[Callable[[ReplicaState], None]] = []  # a replica left: its shared slot goes
        self.peers: Peers | None = None
        self.mover: Mover | None = None
        self.warming_since: dict[str, float] = {}  # replica id -> unix time its slow start began
        self.drained_since: dict[str, float] = {}  # replica id -> unix time its drain began
        self.removing: set[str] = set()  # draining replicas that leave the fleet once drained
        self.discovered: set[str] = set()  # replicas discovery added (and may remove)

    # -- the steps every change takes ------------------------------------------------------------

    def publish(self) -> None:
        self.changes += 1
        for hook in self.published:
            hook()

    def _share(self, op: str, arg: Any) -> None:
        if self.peers is not None:
            self.peers.changed(op, arg)

    def _left(self, replica: ReplicaState) -> None:
        self._forget(replica.id)
        for hook in self.released:
            hook(replica)
        self.warming_since.pop(replica.id, None)
        self.drained_since.pop(replica.id, None)
        self.removing.discard(replica.id)
        self.discovered.discard(replica.id)

    def _start_warming(self, replica: ReplicaState, since: float) -> None:
        """Slow start from `since` (unix seconds): the ramp is as far along as it is for every router."""
        now = self._clock()
        replica.health.start_warming(now - (self._wall() - since))  # a start to come: at weight ramp_from till then
        self.warming_since[replica.id] = since
        self.fleet.apply_health(replica, now)

    # -- changes made here ------------------------------------------------------------------------

    async def add(
        self, spec: ReplicaSpec, discovered: bool = False, seen: Callable[[ReplicaState], Any] | None = None
    ) -> tuple[ReplicaState, list[MovedRange], int | None]:
        """A new replica: slow start, published, shared, then warm-up and moves of the sessions that
        now belong to it (`seen` is shown the replica before those). Returns it, the ring ranges it
        took, and how many sessions are warmed there (None: the sessions cannot be asked for now).
        Clash, NoRoom: nothing changed."""
        if not self._room():
            raise NoRoom("the shared replica table is full")
        try:
            moved = self.fleet.add(spec)
        except ValueError as exc:
            raise Clash(str(exc)) from None
        replica = self.fleet.replicas[-1]
        # from the next whole second: the ramp's steps then fall where balance loops tick (router.balance)
        since = float(math.ceil(self._wall()))
        self._start_warming(replica, since)
        if discovered and self.discovery:
            self.discovered.add(replica.id)
        self.publish()
        self._share("add", (spec.id, spec.url, since, spec.role))
        if discovered:
            self._share("discovered", spec.id)
        if seen is not None:
            seen(replica)
        warming = await self.mover.added(replica) if self.mover is not None else 0
        return replica, moved, warming

    def remove(self, replica_id: str) -> list[MovedRange]:
        """KeyError if there is no such replica."""
        replica = self.fleet.find(replica_id)
        moved = self.fleet.remove(replica_id)
        if replica is not None:
            self._left(replica)
        self.publish()
        self._share("remove", replica_id)
        return moved

    async def drain(
        self, replica_id: str, remove: bool, seen: Callable[[ReplicaState], Any] | None = None
    ) -> tuple[ReplicaState, int | None]:
        """The replica takes no new sessions; its sessions move (warmed) to their ring owners; with
        `remove` it leaves once drained (`seen` is shown it before the balance loop starts on it).
        KeyError if there is no such replica."""
        self.fleet.drain(replica_id)
        replica = self.fleet.find(replica_id)
        assert replica is not None
        since = self._wall()
        self.drained_since[replica.id] = since
        if remove:
            self.removing.add(replica.id)
        self.publish()
        self._share("drain", (replica.id, replica.url, remove, since))
        if seen is not None:
            seen(replica)
        moving = await self.mover.drain(replica, remove) if self.mover is not None else 0
        return replica, moving

    def override(self, origin: str, number: int, owner: str | None) -> list[MovedRange]:
        """Hand vnode `number` of `origin` to `owner` (None: back to `origin`). The ids must be in the ring."""
        ring = self.fleet.ring
        if owner is None:
            moved = ring.clear_override(ring.index(origin), number)
        else:
            moved = ring.reassign_vnode(ring.index(origin), number, ring.index(owner))
        self.publish()
        self._share("override", (origin, number, owner))
        return moved

    # -- changes made elsewhere -------------------------------------------------------------------

    def reconcile(self, facts: Facts, everything: bool = True) -> Settle:
        """Make the fleet what `facts` say, in one batch published once; not shared (it came from
        the peers, or from this router's own saved state). Without `everything`, only what the
        facts name changes (a saved state: replicas it does not mention stay, overrides are only
        added). Returns what the balance loop is to do next (`settle`)."""
        fleet = self.fleet
        changed = False
        settle = Settle()
        for rid in facts.removed - facts.replicas.keys():
            replica = fleet.find(rid)
            if replica is not None:
                fleet.remove(rid)
                self._left(replica)
                changed = True
        for rid, url in facts.replicas.items():
            replica = fleet.find(rid)
            if replica is None:
                try:
                    fleet.add(ReplicaSpec(rid, url, facts.roles.get(rid, "both")))
                except ValueError as exc:  # its URL is now another replica's
                    log.warning("cannot follow the fleet's replica %s: %s", rid, exc)
                    continue
                replica = fleet.replicas[-1]
                # a peer's new replica ramps up from when its slow start began; a saved state's
                # replicas were added long since, unless it says otherwise; one added and already
                # draining stays draining
                if rid not in facts.draining and (everything or rid in facts.warming):
                    self._start_warming(replica, facts.warming.get(rid, self._wall()))
                    settle.added.append(replica)
                changed = True
        for rid, remove in facts.draining.items():
            replica = fleet.find(rid)
            if replica is not None and replica.state != "draining":
                fleet.drain(rid)
                self.drained_since[rid] = facts.drained.get(rid, self._wall())
                if remove:
                    self.removing.add(rid)
                settle.drained.append((replica, remove))
                changed = True
        if self.discovery:  # replicas discovery added are discovery's to remove
            self.discovered |= {rid for rid in facts.discovered if fleet.find(rid) is not None}
        ring = fleet.ring
        desired = {
            vnode: owner
            for vnode, owner in facts.overrides.items()
            if vnode[0] in ring.replica_ids and owner in ring.replica_ids and 0 <= vnode[1] < ring.vnodes
        }
        current = ring.overrides
        for (origin, number), owner in desired.items():
            if current.get((origin, number)) != owner:
                ring.reassign_vnode(ring.index(origin), number, ring.index(owner))
                changed = True
        for origin, number in current.keys() - desired.keys() if everything else ():
            ring.clear_override(ring.index(origin), number)
            changed = True
        if changed:
            self.publish()
        return settle

    async def settle(self, settle: Settle) -> None:
        """The balance loop's part of a reconciled batch: warm-up for new replicas, drains go on."""
        if self.mover is None:
            return
        for replica in settle.added:
            if replica.index is not None and replica.state != "draining":
                await self.mover.added(replica)
        for replica, remove in settle.drained:
            if replica.index is not None and replica.state == "draining":
                await self.mover.drain(replica, remove)

    def facts(self) -> Facts:
        """This router's fleet-wide facts (to seed an empty Redis)."""
        fleet = self.fleet
        return Facts(
            replicas={r.id: r.url for r in fleet.replicas},
            roles={r.id: r.role for r in fleet.replicas if r.role != "both"},
            draining={r.id: r.id in self.removing for r in fleet.replicas if r.state == "draining"},
            warming={
                rid: t for rid, t in self.warming_since.items() if (r := fleet.find(rid)) and r.state == "warming"
            },
            overrides=dict(fleet.ring.overrides),
            discovered=set(self.discovered),
        )
