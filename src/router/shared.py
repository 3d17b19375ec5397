"""The replica table shared by worker processes: the control loop publishes, workers follow.

`router-serve --workers N` runs one control process (probes, scoring, admin changes) and N worker
processes (proxying). The control process owns the authoritative `Fleet` and publishes it into
the shared-memory segment (router.shm): one slot per replica with its id, URL, state, ring weight,
score and figures, and a generation number that goes up whenever routing changes. Each worker
keeps a `Fleet` of its own that follows the table, so every worker builds the same ring and sends
a key where the others would. Workers publish their own per-replica counters (in flight, requests,
errors, tokens, time per output token) in their row; the control loop adds the rows up for health
scoring and the admin API, and each worker adds the other workers' in-flight counts to its own
for the bounded-load cap.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from router.config import ReplicaSpec
from router.fleet import Fleet, ReplicaState
from router.health.monitor import recent_tpot
from router.health.score import HealthInputs
from router.health.signals import EngineStats
from router.ring import xxh3_64
from router.shm.layout import COUNTER_CELL, ReplicaSlot
from router.shm.table import SlotTable

INFLIGHT, REQUESTS, ERRORS, PROMPT, CACHED, TPOT_SAMPLES, TPOT_NS, OWNER = range(8)
COUNTED = (REQUESTS, ERRORS, PROMPT, CACHED)


def owner_tag(replica_id: str) -> int:
    """Which replica a counter cell counts for (a worker may lag behind a slot's reassignment)."""
    return xxh3_64(replica_id.encode("utf-8")) - 2**63 or 1  # an int64 that is never 0 (unwritten)


def _flag(value: bool | None) -> int | None:
    return None if value is None else int(value)


def _row(replica: ReplicaState, fleet: Fleet) -> ReplicaSlot:
    assert replica.index is not None
    e = replica.engine
    i = replica.inputs or HealthInputs()
    return ReplicaSlot(
        replica.id,
        replica.url,
        replica.state,
        replica.health.transitions,
        fleet.routing_weight(replica.index),
        replica.health.score,
        replica.inflight,
        waiting=e.waiting,
        running=e.running,
        kv_usage=e.kv_usage,
        fragmentation=e.fragmentation,
        temperature_c=i.gpu_temperature_c,
        ecc_errors=i.ecc_errors,
        error_rate=i.error_rate,
        latency_ratio=i.latency_ratio,
        gpu_slowed=_flag(i.gpu_slowed),
        probe_ok=_flag(i.probe_ok) if replica.inputs is not None else None,
        updated_at=time.time(),
    )


def inputs_of(row: ReplicaSlot) -> HealthInputs | None:
    """The health inputs a slot carries (None before the control loop's first probe)."""
    if row.probe_ok is None:
        return None
    return HealthInputs(
        probe_ok=bool(row.probe_ok),
        waiting=row.waiting,
        kv_usage=row.kv_usage,
        fragmentation=row.fragmentation,
        error_rate=row.error_rate,
        latency_ratio=row.latency_ratio,
        gpu_temperature_c=row.temperature_c,
        gpu_slowed=None if row.gpu_slowed is None else bool(row.gpu_slowed),
        ecc_errors=row.ecc_errors,
    )


class Publisher:
    """The control loop's side: give replicas slots, write them, and gather the workers' counters."""

    def __init__(self, fleet: Fleet, table: SlotTable) -> None:
        self.fleet = fleet
        self.table = table
        self._routing: dict[int, tuple[str, str, str, float]] = {}  # slot -> what workers route by
        self._seen: dict[tuple[int, int], list[int]] = {}  # (worker, slot) -> counters last gathered
        self._rows = [table.counters(w) for w in range(table.workers)]

    def _assign(self) -> None:
        used = {r.slot for r in self.fleet.replicas if r.slot is not None}
        free = (i for i in range(self.table.slots) if i not in used)
        for replica in self.fleet.replicas:
            if replica.slot is None:
                slot = next(free, None)
                if slot is None:
                    raise ValueError(f"the shared replica table is full ({self.table.slots} slots)")
                replica.slot = slot

    def has_room(self) -> bool:
        return len(self.fleet.replicas) < self.table.slots

    def publish(self) -> None:
        """Write every replica's slot; clear the slots of replicas gone; bump the generation if
        anything routing depends on changed."""
        self._assign()
        changed = False
        live: set[int] = set()
        for replica in self.fleet.replicas:
            assert replica.slot is not None
            row = _row(replica, self.fleet)
            self.table.write(replica.slot, row)
            live.add(replica.slot)
            routing = (row.replica_id, row.url, row.state, row.weight)
            if self._routing.get(replica.slot) != routing:
                self._routing[replica.slot] = routing
                changed = True
        for slot in [s for s in self._routing if s not in live]:
            self.table.write(slot, ReplicaSlot())
            del self._routing[slot]
            for key in [k for k in self._seen if k[1] == slot]:
                del self._seen[key]
            changed = True
        if changed:
            self.table.bump_generation()

    def forget(self, replica: ReplicaState) -> None:
        """A replica left the fleet: free its slot (written empty on the next publish)."""
        replica.slot = None

    def collect(self) -> None:
        """Add the workers' counters into the control loop's replicas (for scoring and the admin API)."""
        rows = self._rows
        for replica in self.fleet.replicas:
            if replica.slot is None:
                continue
            base = replica.slot * COUNTER_CELL
            tag = owner_tag(replica.id)
            inflight = 0
            tpot_weighted = 0.0
            samples = 0
            for w, row in enumerate(rows):
                cell = row[base : base + COUNTER_CELL].tolist()
                if cell[OWNER] != tag:
                    continue  # that worker has not caught up with this slot's replica yet
                inflight += cell[INFLIGHT]
                n = cell[TPOT_SAMPLES]
                if n > 0:
                    samples += n
                    tpot_weighted += n * cell[TPOT_NS] / 1e9
                seen = self._seen.get((w, replica.slot))
                for field in COUNTED:
                    # counters only grow; one that went down was restarted (worker or slot): count it from 0
                    before = seen[field] if seen is not None else 0
                    delta = cell[field] - before if cell[field] >= before else cell[field]
                    if field == REQUESTS:
                        replica.requests += delta
                    elif field == ERRORS:
                        replica.errors += delta
                    elif field == PROMPT:
                        replica.prompt_tokens += delta
                    else:
                        replica.cached_tokens += delta
                self._seen[(w, replica.slot)] = cell
            replica.inflight = max(inflight, 0)
            replica.pooled_tpot = (tpot_weighted / samples if samples else 0.0, samples)


class Follower:
    """A worker's side: keep its Fleet equal to the table, and publish its own counters."""

    def __init__(
        self,
        fleet: Fleet,
        table: SlotTable,
        worker: int,
        latency_window_s: float,
        on_removed: Callable[[str], None] = lambda rid: None,
    ) -> None:
        self.fleet = fleet
        self.table = table
        self.worker = worker
        self.latency_window_s = latency_window_s
        self.on_removed = on_removed
        self.generation = -1
        self._row = table.counters(worker)
        self._others = [table.counters(w) for w in range(table.workers) if w != worker]
        fleet.shared_inflight = self._row  # INFLIGHT is a cell's first field
        fleet.refresh_loads = self.pull_loads

    def sync(self) -> bool:
        """Follow the table if the control loop changed it; True when it did."""
        generation = self.table.generation
        if generation == self.generation:
            return False
        self.reload(generation)
        return True

    def reload(self, generation: int | None = None) -> None:
        table = self.table
        # read the generation first: a change made while we read bumps it again and we re-read
        self.generation = table.generation if generation is None else generation
        rows = {}
        for slot in range(table.slots):
            row = table.read(slot)
            if row.state != "empty":
                rows[row.replica_id] = (slot, row)
        fleet = self.fleet
        for gone in list(fleet.replicas):
            found = rows.get(gone.id)
            if found is None or found[0] != gone.slot or found[1].url != gone.url:
                fleet.remove(gone.id)
                self.on_removed(gone.id)
        for rid, (slot, row) in sorted(rows.items(), key=lambda item: item[1][0]):
            replica = fleet.find(rid)
            if replica is None:
                fleet.add(ReplicaSpec(rid, row.url))
                replica = fleet.replicas[-1]
                replica.slot = slot
                replica.owner_tag = owner_tag(rid)
                base = slot * COUNTER_CELL
                for field in range(COUNTER_CELL):  # counts first, then whose they are
                    self._row[base + field] = replica.owner_tag if field == OWNER else 0
            self._apply(replica, row)
            fleet.set_routing(replica, row.weight, exact=True)

    @staticmethod
    def _apply(replica: ReplicaState, row: ReplicaSlot) -> None:
        health = replica.health
        health.state = row.state
        health.score = row.score
        health.transitions = row.transitions
        replica.inputs = inputs_of(row)
        replica.engine = EngineStats(row.waiting, row.running, row.kv_usage, row.fragmentation)

    def refresh(self) -> None:
        """Scores and states for display (routing itself follows the generation)."""
        for replica in self.fleet.replicas:
            if replica.slot is not None:
                row = self.table.read(replica.slot)
                if row.replica_id == replica.id:
                    self._apply(replica, row)

    def publish(self, now: float) -> None:
        """Write this worker's counters for every replica."""
        row = self._row
        horizon = now - self.latency_window_s
        for replica in self.fleet.replicas:
            if replica.slot is None:
                continue
            base = replica.slot * COUNTER_CELL
            recent = recent_tpot(replica, horizon)
            row[base + OWNER] = replica.owner_tag
            row[base + INFLIGHT] = replica.inflight
            row[base + REQUESTS] = replica.requests
            row[base + ERRORS] = replica.errors
            row[base + PROMPT] = replica.prompt_tokens
            row[base + CACHED] = replica.cached_tokens
            row[base + TPOT_SAMPLES] = len(recent)
            row[base + TPOT_NS] = round(statistics.median(recent) * 1e9) if recent else 0

    def pull_loads(self) -> None:
        """The bounded-load cap counts every worker's in-flight requests, not only this one's."""
        loads = self.fleet.loads
        for replica in self.fleet.replicas:
            if replica.slot is None or replica.index is None:
                continue
            at = replica.slot * COUNTER_CELL
            tag = replica.owner_tag
            loads[replica.index] = replica.inflight + sum(
                max(other[at + INFLIGHT], 0) for other in self._others if other[at + OWNER] == tag
            )
