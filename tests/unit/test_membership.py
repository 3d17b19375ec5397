"""The membership service: every change in one order (fleet, publish, share, balance), and reconciling."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import ReplicaSpec
from router.fleet import Fleet, ReplicaState
from router.health.states import Hysteresis
from router.membership import Facts, Membership, NoRoom


class Recorder:
    """Every collaborator of membership, writing what it was told, in order, into one list."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.log: list[tuple[Any, ...]] = []

    def published(self) -> None:
        # what the fleet looks like when it is published: the shared table gets this
        self.log.append(("publish", tuple((r.id, r.state) for r in self.fleet.replicas)))

    def released(self, replica: ReplicaState) -> None:
        self.log.append(("release", replica.id))

    def forget(self, replica_id: str) -> None:
        self.log.append(("forget", replica_id))

    def changed(self, op: str, arg: Any) -> None:
        self.log.append(("share", op, arg))

    async def added(self, replica: ReplicaState) -> int | None:
        self.log.append(("balance added", replica.id, replica.state))
        return 7

    async def drain(self, replica: ReplicaState, remove: bool) -> int | None:
        self.log.append(("balance drain", replica.id, remove))
        return 3


class Clock:
    def __init__(self) -> None:
        self.mono = 50.0
        self.unix = 1_800_000_000.25


def service(replicas: int = 2, room: bool = True) -> tuple[Membership, Recorder, Clock]:
    fleet = Fleet(
        [ReplicaSpec(f"r{i}", f"http://10.0.0.{i}:8000") for i in range(replicas)], 64, 0, Hysteresis(ramp_s=30)
    )
    clock = Clock()
    recorder = Recorder(fleet)
    membership = Membership(
        fleet, forget=recorder.forget, room=lambda: room, clock=lambda: clock.mono, wall=lambda: clock.unix
    )
    membership.published.append(recorder.published)
    membership.released.append(recorder.released)
    membership.peers = recorder
    membership.mover = recorder
    return membership, recorder, clock


async def test_an_add_starts_slow_then_publishes_then_shares_then_warms() -> None:
    membership, recorder, _clock = service()
    membership.discovery = True  # discovery runs here: what it adds is its to remove
    replica, moved, warming = await membership.add(ReplicaSpec("r9", "http://10.0.0.9:8000"), discovered=True)
    assert warming == 7 and moved and replica.state == "warming"
    since = 1_800_000_001.0  # from the next whole second: where balance loops tick
    assert recorder.log == [
        ("publish", (("r0", "healthy"), ("r1", "healthy"), ("r9", "warming"))),  # never published cold at full weight
        ("share", "add", ("r9", "http://10.0.0.9:8000", since, "both")),
        ("share", "discovered", "r9"),
        ("balance added", "r9", "warming"),
    ]
    assert membership.changes == 1 and membership.discovered == {"r9"} and membership.warming_since == {"r9": since}
    assert membership.fleet.ring.weights[replica.index] == pytest.approx(0.1)  # type: ignore[index]


async def test_an_add_without_room_or_with_a_clash_changes_nothing() -> None:
    membership, recorder, _ = service(room=False)
    with pytest.raises(NoRoom):
        await membership.add(ReplicaSpec("r9", "http://10.0.0.9:8000"))
    membership, recorder, _ = service()
    with pytest.raises(ValueError, match="already"):
        await membership.add(ReplicaSpec("r0", "http://10.0.0.99:8000"))
    assert recorder.log == [] and membership.changes == 0


async def test_remove_drain_and_override_keep_the_order() -> None:
    membership, recorder, _ = service(3)
    replica, moving = await membership.drain("r1", remove=True)
    assert moving == 3 and replica.state == "draining" and membership.removing == {"r1"}
    membership.override("r0", 5, "r2")
    membership.override("r0", 5, None)
    membership.remove("r1")
    with pytest.raises(KeyError):
        membership.remove("nope")
    steps = [entry[:2] for entry in recorder.log]
    assert steps == [
        ("publish", (("r0", "healthy"), ("r1", "draining"), ("r2", "healthy"))),
        ("share", "drain"),
        ("balance drain", "r1"),
        ("publish", (("r0", "healthy"), ("r1", "draining"), ("r2", "healthy"))),
        ("share", "override"),
        ("publish", (("r0", "healthy"), ("r1", "draining"), ("r2", "healthy"))),
        ("share", "override"),
        ("forget", "r1"),  # its gauges go, then its shared slot, then the fleet without it is published
        ("release", "r1"),
        ("publish", (("r0", "healthy"), ("r2", "healthy"))),
        ("share", "remove"),
    ]
    assert recorder.log[1][2][:3] == ("r1", "http://10.0.0.1:8000", True)
    assert recorder.log[4][2] == ("r0", 5, "r2") and recorder.log[6][2] == ("r0", 5, None)
    assert membership.removing == set() and membership.fleet.ring.overrides == {}


async def test_a_peer_s_facts_are_applied_at_once_unshared_and_its_slow_start_keeps_its_start() -> None:
    membership, recorder, clock = service(3)
    membership.override("r0", 1, "r1")
    recorder.log.clear()
    facts = Facts(
        replicas={"r0": "http://10.0.0.0:8000", "r2": "http://10.0.0.2:8000", "r7": "http://10.0.0.7:8000"},
        removed={"r1"},
        draining={"r2": True},
        warming={"r7": clock.unix - 16.0},  # a peer began its slow start 16 s ago
        overrides={("r0", 3): "r7"},
    )
    settle = membership.reconcile(facts)
    assert [entry[0] for entry in recorder.log] == ["forget", "release", "publish"]  # published once; not shared
    assert membership.fleet.ring.overrides == {("r0", 3): "r7"}  # the peer's overrides, and only those
    r7 = membership.fleet.find("r7")
    assert r7 is not None and r7.state == "warming"
    # 16 s into a 30 s ramp climbed in tenths: 5 steps of 0.09 above 0.1, as on the peer
    assert membership.fleet.ring.weights[r7.index] == pytest.approx(0.1 + 0.9 * 0.5)  # type: ignore[index]
    assert [r.id for r in settle.added] == ["r7"] and [(r.id, rm) for r, rm in settle.drained] == [("r2", True)]
    recorder.log.clear()
    await membership.settle(settle)
    assert recorder.log == [("balance added", "r7", "warming"), ("balance drain", "r2", True)]
    assert membership.reconcile(facts).added == [] and recorder.log[-1][0] == "balance drain"  # nothing new


def test_a_saved_state_adds_without_slow_start_and_clears_no_override() -> None:
    membership, _recorder, _ = service(3)
    membership.override("r0", 1, "r1")
    facts = Facts(
        replicas={"r5": "http://10.0.0.5:8000"}, removed={"r2"}, overrides={("r0", 4): "r5"}, discovered={"r5"}
    )
    settle = membership.reconcile(facts, everything=False)
    r5 = membership.fleet.find("r5")
    assert r5 is not None and r5.state == "healthy" and settle.added == []
    assert membership.fleet.find("r2") is None and membership.fleet.find("r1") is not None
    assert membership.fleet.ring.overrides == {("r0", 1): "r1", ("r0", 4): "r5"}
    assert membership.discovered == set()  # no discovery runs here: nothing is its to remove
    membership.discovery = True
    membership.reconcile(facts, everything=False)
    assert membership.discovered == {"r5"}


def test_a_replica_s_role_travels_with_the_facts_and_the_saved_state() -> None:
    """A decode replica is one wherever the fleet's facts go (a peer through Redis, a saved state):
    taken for an aggregated one, it would be sent requests whole where they should be split."""
    from router.state.file import RoutingState  # noqa: PLC0415

    membership, _recorder, _ = service(2)
    membership.reconcile(
        Facts(replicas={"d7": "http://10.0.0.7:8000", "r8": "http://10.0.0.8:8000"}, roles={"d7": "decode"})
    )
    d7, r8 = membership.fleet.find("d7"), membership.fleet.find("r8")
    assert d7 is not None and d7.role == "decode" and r8 is not None and r8.role == "both"
    assert membership.facts().roles == {"d7": "decode"}
    saved = RoutingState(added=[("d7", "http://10.0.0.7:8000"), ("r8", "http://10.0.0.8:8000")], roles={"d7": "decode"})
    again = RoutingState.from_json(saved.to_json())
    assert again.roles == {"d7": "decode"} and again.added == saved.added
    old = RoutingState.from_json(RoutingState(added=[("r8", "http://10.0.0.8:8000")]).to_json())
    assert old.roles == {}  # a state saved with no role in it: aggregated, as before
