"""The replica table shared by worker processes: the control loop publishes, workers follow.

`router-serve --workers N` runs one control process (probes, scoring, admin changes) and N worker
processes (proxying). The control process owns the authoritative `Fleet` and publishes it into
the shared-memory segment (router.shm): one slot per replica with its id, URL, state, ring weight,
score and figures, and a generation number that goes up whenever routing changes. Each worker
keeps a `Fleet` of its own that follows the table, so every worker builds the same ring and sends
a key where the others would. Workers publish their own per-replica counters (in flight, requests,
errors, tokens, time per output token) in their row; the control loop adds the rows up for health
scoring and the admin API, and each worker adds the other workers' in-flight counts to its own
for the bounded-load cap. Where each session was served last is shared beside this table
(router.state.session_table).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

from router.config import ReplicaSpec
from router.fleet import Fleet, ReplicaState, recent_samples
from router.health.score import HealthInputs
from router.health.signals import EngineStats
from router.ring import xxh3_64
from router.shm.layout import COUNTER_CELL, COUNTER_FIELDS, LATENCY_SAMPLES, ReplicaSlot
from router.shm.table import SlotTable

INFLIGHT, REQUESTS, ERRORS, PROMPT, CACHED, OWNER = range(6)
# per latency kind: where its count cell is; its LATENCY_SAMPLES sample cells follow it
SAMPLES_AT = {"tpot": COUNTER_FIELDS.index("tpot_count"), "ttft": COUNTER_FIELDS.index("ttft_count")}
COUNTED = (REQUESTS, ERRORS, PROMPT, CACHED)


def owner_tag(replica_id: str, epoch: int) -> int:
    """Which replica a counter cell counts for: its id and the slot assignment's epoch (a worker
    may lag behind a slot's reassignment, or behind a replica removed and added again)."""
    return xxh3_64(f"{epoch}:{replica_id}".encode()) - 2**63 or 1  # an int64 that is never 0 (unwritten)


def _flag(value: bool | None) -> int | None:
    return None if value is None else int(value)


def _int(value: float | None) -> int | None:
    return None if value is None else round(value)


def _row(replica: ReplicaState, weight: float) -> ReplicaSlot:
    """`replica`'s slot, with the weight the ring routes it by (`Fleet.routing_weights`)."""
    assert replica.index is not None
    e = replica.engine
    i = replica.inputs or HealthInputs()
    return ReplicaSlot(
        replica.id,
        replica.url,
        replica.state,
        replica.health.transitions,
        replica.epoch,
        weight,
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
        ttft_ratio=i.ttft_ratio,
        gpu_slowed=_flag(i.gpu_slowed),
        probe_ok=_flag(i.probe_ok) if replica.inputs is not None else None,
        capacity=replica.capacity,
        deferred=e.deferred,
        kv_tokens=_int(e.kv_tokens),
        block_size=_int(e.block_size),
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
        ttft_ratio=row.ttft_ratio,
        gpu_temperature_c=row.temperature_c,
        gpu_slowed=None if row.gpu_slowed is None else bool(row.gpu_slowed),
        ecc_errors=row.ecc_errors,
    )


class Publisher:
    """The control loop's side: give replicas slots, write them, and gather the workers' counters."""

    def __init__(self, fleet: Fleet, table: SlotTable) -> None:
        self.fleet = fleet
        self.table = table
        self._written: dict[int, ReplicaSlot] = {}  # slot -> the row last written there (time left out)
        self._seen: dict[tuple[int, int], list[int]] = {}  # (worker, slot) -> counters last gathered
        self._rows = [table.counters(w) for w in range(table.workers)]
        self._epochs = 0
        self._written_overrides: list[tuple[int, int, int]] = []

    def _assign(self) -> None:
        used = {r.slot for r in self.fleet.replicas if r.slot is not None}
        free = (i for i in range(self.table.slots) if i not in used)
        for replica in self.fleet.replicas:
            if replica.slot is None:
                slot = next(free, None)
                if slot is None:
                    raise ValueError(f"the shared replica table is full ({self.table.slots} slots)")
                self._epochs += 1
                replica.slot, replica.epoch = slot, self._epochs

    def has_room(self) -> bool:
        return len(self.fleet.replicas) < self.table.slots

    def publish(self) -> None:
        """Write the slots that changed; clear the slots of replicas gone; bump the generation if
        anything routing depends on changed."""
        self._assign()
        changed = False
        live: set[int] = set()
        weights = self.fleet.routing_weights()  # (read once: the ring's tables are copies a read)
        for replica, weight in zip(self.fleet.replicas, weights, strict=True):
            assert replica.slot is not None
            row = _row(replica, weight)
            live.add(replica.slot)
            before = self._written.get(replica.slot)
            timeless = dataclasses.replace(row, updated_at=0.0)
            if before == timeless:
                continue  # unchanged: its sequence number stays, so workers skip it
            self.table.write(replica.slot, row)
            self._written[replica.slot] = timeless
            if before is None or _routing(before) != _routing(row):
                changed = True
        for slot in [s for s in self._written if s not in live]:
            self.table.write(slot, ReplicaSlot())
            del self._written[slot]
            for key in [k for k in self._seen if k[1] == slot]:
                del self._seen[key]
            changed = True
        overrides = self._overrides()
        if overrides != self._written_overrides:
            self.table.write_overrides(overrides)
            self._written_overrides = overrides
            changed = True
        if changed:
            self.table.bump_generation()

    def _overrides(self) -> list[tuple[int, int, int]]:
        """The ring's vnode overrides by slot: (origin slot, vnode, owner slot)."""
        slots = {r.id: r.slot for r in self.fleet.replicas if r.slot is not None}
        return sorted(
            (slots[origin], number, slots[owner])
            for (origin, number), owner in self.fleet.ring.overrides.items()
            if origin in slots and owner in slots
        )

    def forget(self, replica: ReplicaState) -> None:
        """A replica left the fleet: free its slot (written empty on the next publish)."""
        replica.slot = None

    def worker_restarted(self, worker: int) -> None:
        """A restarted worker counts from zero: its earlier counts are already gathered."""
        for key in [k for k in self._seen if k[0] == worker]:
            del self._seen[key]

    def collect(self) -> None:
        """Add the workers' counters into the control loop's replicas (for scoring and the admin API)."""
        if not self._rows:
            return  # no workers: the replicas' own counters are the only ones
        for replica in self.fleet.replicas:
            if replica.slot is None:
                continue
            base = replica.slot * COUNTER_CELL
            tag = owner_tag(replica.id, replica.epoch)
            inflight = 0
            samples: dict[str, list[int]] = {kind: [] for kind in SAMPLES_AT}
            for w, row in enumerate(self._rows):
                cell = row[base : base + COUNTER_CELL].tolist()
                if cell[OWNER] != tag:
                    continue  # that worker has not caught up with this slot's replica yet
                inflight += cell[INFLIGHT]
                for kind, at in SAMPLES_AT.items():
                    count = min(max(cell[at], 0), LATENCY_SAMPLES)
                    samples[kind] += cell[at + 1 : at + 1 + count]
                seen = self._seen.get((w, replica.slot))
                if seen is not None and seen[OWNER] != tag:
                    seen = None
                for field in COUNTED:
                    # counters only grow; one that went down was restarted: count it from 0
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
            # every worker's latest samples pooled: their median is a true median
            for kind, pooled in samples.items():
                setattr(replica, f"pooled_{kind}", (statistics.median(pooled) / 1e9 if pooled else 0.0, len(pooled)))


def _routing(row: ReplicaSlot) -> tuple[str, str, str, int, float]:
    return row.replica_id, row.url, row.state, row.epoch, row.weight


class Follower:
    """A worker's side: keep its Fleet equal to the table, and publish its own counters. With no
    `worker` (a process that follows the engines' KV events for the host's workers, a shard of
    them: router.proxy.followers), it only reads the table: it has no counters, and sends nothing."""

    def __init__(
        self,
        fleet: Fleet,
        table: SlotTable,
        worker: int | None,
        latency_window_s: float,
        on_removed: Callable[[str], None] = lambda rid: None,
        queue_weight: float = 0.0,
    ) -> None:
        self.queue_weight = queue_weight
        self.fleet = fleet
        self.table = table
        self.worker = worker
        self.latency_window_s = latency_window_s
        self.on_removed = on_removed
        self.generation = -1
        self._seqs: dict[int, int] = {}  # slot -> sequence number when last read
        self._rows: dict[int, ReplicaSlot] = {}  # the non-empty slots as last read
        self._others = [table.counters(w) for w in range(table.workers) if w != worker]
        self._row: memoryview | None = None
        if worker is not None:
            self._row = table.counters(worker)
            fleet.shared_inflight = self._row  # INFLIGHT is a cell's first field
            fleet.refresh_loads = self.pull_loads

    def sync(self) -> bool:
        """Follow the table if the control loop changed it; True when it did."""
        generation = self.table.generation
        if generation == self.generation:
            return False
        self.reload(generation)
        return True

    def _changed_rows(self) -> dict[int, ReplicaSlot]:
        """The replica slots written since this worker last read them."""
        table = self.table
        rows = {}
        for slot in range(table.slots):
            seq = table.seq(slot)
            if self._seqs.get(slot) != seq:
                rows[slot] = table.read(slot)
                self._seqs[slot] = seq
        return rows

    def reload(self, generation: int | None = None) -> None:
        table = self.table
        # read the generation first: a change made while we read bumps it again and we re-read
        self.generation = table.generation if generation is None else generation
        for slot, row in self._changed_rows().items():
            if row.state == "empty":
                self._rows.pop(slot, None)
            else:
                self._rows[slot] = row
        wanted = {row.replica_id: (slot, row) for slot, row in self._rows.items()}
        fleet = self.fleet
        for gone in list(fleet.replicas):
            found = wanted.get(gone.id)
            if found is None or found[0] != gone.slot or found[1].epoch != gone.epoch or found[1].url != gone.url:
                fleet.remove(gone.id)
                self.on_removed(gone.id)
        listed = sorted(wanted.items(), key=lambda item: item[1][0])
        added = [ReplicaSpec(rid, row.url) for rid, (_, row) in listed if fleet.find(rid) is None]
        fleet.add_all(added)  # (the ring placed once for all of them)
        new = {spec.id for spec in added}
        for rid, (slot, row) in listed:
            replica = fleet.find(rid)
            assert replica is not None
            if rid in new:
                replica.slot, replica.epoch = slot, row.epoch
                replica.owner_tag = owner_tag(rid, row.epoch)
            if rid in new and self._row is not None:
                base = slot * COUNTER_CELL
                for field in range(COUNTER_CELL):  # counts first, then whose they are
                    self._row[base + field] = replica.owner_tag if field == OWNER else 0
            self._apply(replica, row)
            fleet.set_routing(replica, row.weight, exact=True)
        fleet.by_slot = {r.slot: r for r in fleet.replicas if r.slot is not None}
        self._follow_overrides()

    def _follow_overrides(self) -> None:
        """Make this worker's ring carry the control loop's vnode overrides."""
        ring = self.fleet.ring
        ids = {slot: row.replica_id for slot, row in self._rows.items()}
        desired: dict[tuple[str, int], str] = {}
        for origin_slot, number, owner_slot in self.table.read_overrides():
            origin, owner = ids.get(origin_slot), ids.get(owner_slot)
            if origin in ring.replica_ids and owner in ring.replica_ids and number < ring.vnodes:
                assert origin is not None and owner is not None
                desired[(origin, number)] = owner
        current = ring.overrides
        for (origin, number), owner in desired.items():
            if current.get((origin, number)) != owner:
                ring.reassign_vnode(ring.index(origin), number, ring.index(owner))
        for origin, number in current.keys() - desired.keys():
            ring.clear_override(ring.index(origin), number)

    def _apply(self, replica: ReplicaState, row: ReplicaSlot) -> None:
        health = replica.health
        health.state = row.state
        health.score = row.score
        health.transitions = row.transitions
        replica.inputs = inputs_of(row)
        replica.engine = EngineStats(
            waiting=row.waiting,
            deferred=row.deferred,
            running=row.running,
            kv_usage=row.kv_usage,
            fragmentation=row.fragmentation,
            kv_tokens=row.kv_tokens,
            block_size=row.block_size,
        )
        self.fleet.set_capacity(replica, row.capacity)
        replica.queue_load = round(self.queue_weight * (row.waiting or 0.0))

    def refresh(self) -> None:
        """Scores, states and inputs for display (routing itself follows the generation)."""
        changed = self._changed_rows()
        self._rows.update({slot: row for slot, row in changed.items() if row.state != "empty"})
        for replica in self.fleet.replicas:
            row = changed.get(replica.slot) if replica.slot is not None else None
            if row is not None and row.replica_id == replica.id and row.epoch == replica.epoch:
                self._apply(replica, row)

    def publish(self, now: float) -> None:
        """Write this worker's counters for every replica."""
        row = self._row
        if row is None:
            raise TypeError("a follower of the table without a worker has no counters to publish")
        horizon = now - self.latency_window_s
        for replica in self.fleet.replicas:
            if replica.slot is None:
                continue
            base = replica.slot * COUNTER_CELL
            row[base + INFLIGHT] = replica.inflight
            row[base + REQUESTS] = replica.requests
            row[base + ERRORS] = replica.errors
            row[base + PROMPT] = replica.prompt_tokens
            row[base + CACHED] = replica.cached_tokens
            for kind, at in SAMPLES_AT.items():
                recent = recent_samples(replica, kind, horizon)[-LATENCY_SAMPLES:]
                row[base + at] = 0  # readers take no sample while the samples change
                for i, value in enumerate(recent):
                    row[base + at + 1 + i] = round(value * 1e9)
                row[base + at] = len(recent)

    def fleet_inflight(self, replica: ReplicaState) -> int:
        """Every worker's requests in flight at `replica`: this one's now, the others' as last published."""
        if replica.slot is None:
            return replica.inflight
        at = replica.slot * COUNTER_CELL
        tag = replica.owner_tag
        return replica.inflight + sum(max(o[at + INFLIGHT], 0) for o in self._others if o[at + OWNER] == tag)

    def pull_loads(self) -> None:
        """The bounded-load cap counts every worker's in-flight requests, not only this one's."""
        loads = self.fleet.loads
        for replica in self.fleet.replicas:
            if replica.slot is not None and replica.index is not None:
                loads[replica.index] = self.fleet_inflight(replica) + replica.queue_load
