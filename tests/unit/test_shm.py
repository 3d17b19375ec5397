"""The shared-memory replica table: layout round trips, attach rules, and no torn reads."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid
from multiprocessing import shared_memory

import pytest

from router.config import ReplicaSpec
from router.fleet import Fleet
from router.monitor import HealthMonitor
from router.shm.layout import HEADER_SIZE, SLOT_SIZE, ReplicaSlot, pack, unpack
from router.shm.table import SlotTable

FULL = ReplicaSlot(
    "gpu-7",
    "http://10.0.0.7:8000",
    "recovering",
    4,
    2,
    0.4,
    0.81,
    12,
    waiting=3.0,
    running=40.0,
    kv_usage=0.9,
    fragmentation=0.1,
    gpu_util=0.77,
    temperature_c=71.0,
    mem_used=70 << 30,
    mem_total=80 << 30,
    throttle_reasons=4,
    ecc_errors=0,
    capacity=256,
    deferred=2.0,
    kv_tokens=29845 * 16,
    block_size=16,
    updated_at=1795962901.25,
)


def name() -> str:
    return f"kvar-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def test_layout_round_trips_and_keeps_missing_figures_missing() -> None:
    assert unpack(pack(FULL)) == FULL
    sparse = ReplicaSlot("r", state="healthy", weight=1.0, score=1.0, updated_at=5.0)
    back = unpack(pack(sparse))
    assert back == sparse and back.mem_used is None and back.kv_usage is None  # not read is not zero
    with pytest.raises(ValueError, match="longer than 64"):
        pack(ReplicaSlot("x" * 65))
    with pytest.raises(ValueError, match="longer than 256"):
        pack(ReplicaSlot("x", "http://" + "h" * 250))
    with pytest.raises(ValueError, match="unknown state"):
        pack(ReplicaSlot("x", state="sleepy"))


def test_create_attach_write_read_and_ownership() -> None:
    table = SlotTable.create(name(), 4)
    try:
        other = SlotTable.attach(table.name)
        assert other.slots == 4 and other.read(2) == ReplicaSlot()  # never written: empty
        table.write(2, FULL)
        assert other.read(2) == FULL
        with pytest.raises(IndexError):
            other.read(4)
        other.close()  # an attached process never unlinks
        assert SlotTable.attach(table.name).read(2) == FULL
    finally:
        table.close()
    with pytest.raises(FileNotFoundError):
        SlotTable.attach(table.name)  # the creator did


def test_attach_refuses_something_else() -> None:
    shm = shared_memory.SharedMemory(name=name(), create=True, size=4096)
    try:
        with pytest.raises(ValueError, match="not a version-11 replica table"):
            SlotTable.attach(shm.name)
    finally:
        shm.close()
        shm.unlink()


def _hammer(segment: str, rounds: int) -> None:
    table = SlotTable.attach(segment)
    for k in range(rounds):
        # every figure of the record equals k: a torn copy would mix two of them
        table.write(
            0,
            ReplicaSlot(
                f"r{k % 10}",
                f"http://r{k}",
                "healthy",
                k,
                k,
                float(k),
                float(k),
                k,
                waiting=float(k),
                running=float(k),
                kv_usage=float(k),
                mem_used=k,
                mem_total=k,
                updated_at=float(k),
            ),
        )
    table.close()


def test_a_reader_never_sees_a_torn_slot_under_a_concurrent_writer() -> None:
    table = SlotTable.create(name(), 1)
    ctx = mp.get_context("spawn")
    writer = ctx.Process(target=_hammer, args=(table.name, 60_000))
    try:
        writer.start()
        seen = set()
        reads = 0
        while writer.is_alive() or reads < 1000:
            slot = table.read(0)
            if slot.replica_id:
                k = slot.inflight
                assert slot.weight == slot.score == slot.waiting == slot.running == slot.kv_usage == float(k)
                assert slot.mem_used == slot.mem_total == slot.transitions == k and slot.replica_id == f"r{k % 10}"
                assert slot.url == f"http://r{k}"
                seen.add(k)
            reads += 1
            if reads > 2_000_000:
                break
        writer.join(timeout=60)
        assert writer.exitcode == 0
        assert len(seen) > 10  # the reads really overlapped the writes
    finally:
        if writer.is_alive():
            writer.kill()
        table.close()


def test_agent_slots_counters_and_generation_are_separate_regions() -> None:
    table = SlotTable.create(name(), 3, workers=2)
    try:
        other = SlotTable.attach(table.name)
        assert (other.slots, other.workers, other.generation) == (3, 2, 0)
        table.write(1, FULL)
        other.write_agent(1, ReplicaSlot("gpu-7", temperature_c=80.0, updated_at=2.0))
        assert table.read(1) == FULL and table.read_agent(1).temperature_c == 80.0
        assert table.read_agent(0) == ReplicaSlot() and table.find("gpu-7") == 1 and table.find("nope") is None
        row0, row1 = other.counters(0), other.counters(1)
        row1[1 * 32 + 0] = 7  # worker 1, replica slot 1, in-flight
        row0[2 * 32 + 1] = -3
        assert table.counters(1)[32] == 7 and table.counters(0)[65] == -3 and table.counters(0)[32] == 0
        assert table.read(1) == FULL  # counters never touch the slots
        table.bump_generation()
        assert other.generation == 1
        with pytest.raises(IndexError):
            other.counters(2)
        other.close()  # releases the rows it handed out
    finally:
        table.close()


def test_a_stuck_agent_slot_reads_as_no_agent() -> None:
    table = SlotTable.create(name(), 2)
    try:
        fleet = Fleet([ReplicaSpec("gpu-7", "http://10.0.0.7:8000")])
        replica = fleet.replicas[0]
        replica.slot = 1
        table.write_agent(1, ReplicaSlot("gpu-7", temperature_c=90.0, updated_at=__import__("time").time()))
        monitor = HealthMonitor(fleet, lambda: None, 1.0, 1.0, table=table)  # type: ignore[arg-type, return-value]
        assert monitor._agent_slot(replica)["gpu_temperature_c"] == 90.0
        # an agent killed in the middle of a write leaves the slot's sequence odd for ever
        at = HEADER_SIZE + (table.slots + 1) * SLOT_SIZE
        table._buf[at] |= 1
        assert monitor._agent_slot(replica) == {}  # no reading, and the probe round goes on
    finally:
        table.close()


def test_probe_rounds_are_counted_in_the_header_apart_from_the_generation() -> None:
    table = SlotTable.create(name(), slots=4, workers=2)
    try:
        other = SlotTable.attach(table.name)
        assert (other.probe_round, other.generation) == (0, 0)
        table.bump_probe_round()
        table.bump_probe_round()
        assert (other.probe_round, other.generation) == (2, 0)  # a worker sees the round, routing unchanged
        table.bump_generation()
        assert (other.probe_round, other.generation) == (2, 1)
        other.close()
    finally:
        table.close()
