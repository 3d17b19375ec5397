"""The replica table in shared memory: one writer per slot, any number of readers, none blocked.

A writer bumps the slot's sequence number to odd, writes the payload and its checksum, and bumps
it to even. A reader copies the slot and accepts the copy only if the sequence was even and the
same before and after, and the checksum matches; otherwise it retries (a bounded number of times).
Counter cells are plain aligned int64 stores, each with a single writer (its worker), so a reader
sees every cell whole. Only the process that created the segment unlinks it; attaching processes
are kept out of Python's resource tracker, which would otherwise unlink the segment when they
exit (cpython gh-82300).
"""

from __future__ import annotations

import os
import struct
import time
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

from router.errors import RouterError
from router.kvevents.mapped import SHM_DIR, take_pages
from router.ring import xxh3_64
from router.shm.layout import (
    COUNTER_CELL,
    GENERATION_AT,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    PROBED_AT,
    SEQ,
    SLOT_PAYLOAD,
    SLOT_SIZE,
    VERSION,
    ReplicaSlot,
    pack,
    unpack,
)

STICKY_ENTRY = 3  # uint64s per session entry (router.state.session_table.SharedSessions)
MAX_OVERRIDES = 4096
_COUNT = struct.Struct("<I4x")
_OVERRIDE = struct.Struct("<HHI")  # origin slot, owner slot, vnode
OVERRIDES_SIZE = _COUNT.size + MAX_OVERRIDES * _OVERRIDE.size
READ_RETRIES = 1_000_000
READ_PATIENCE_S = 0.05  # a slot still being written after this long has lost its writer
MAX_SLOTS = 16384
MAX_WORKERS = 256
_U64 = struct.Struct("<Q")


def _buffer(shm: shared_memory.SharedMemory) -> memoryview:
    buf = shm.buf
    assert buf is not None, "the shared memory segment is closed"
    return buf


def segment_size(slots: int, workers: int, sticky_entries: int = 0) -> int:
    per_worker = (slots * COUNTER_CELL + STICKY_ENTRY * sticky_entries) * 8
    return HEADER_SIZE + 2 * slots * SLOT_SIZE + workers * per_worker + SEQ.size + OVERRIDES_SIZE


class SegmentError(RouterError, RuntimeError):
    """The replica table's segment could not be laid out: its folder (/dev/shm) has no room for it."""


class TornRead(RouterError, RuntimeError):
    """A slot kept changing under the reader for READ_RETRIES tries (a writer died mid-write?)."""


class SlotTable:
    """Replica slots (control loop), agent slots (router-agents) and per-worker counter rows."""

    def __init__(
        self, shm: shared_memory.SharedMemory, slots: int, workers: int, owner: bool, sticky_entries: int = 0
    ) -> None:
        self._shm = shm
        self.slots = slots
        self.workers = workers
        self.sticky_entries = sticky_entries
        self.owner = owner
        self._buf: memoryview = _buffer(shm)
        start = HEADER_SIZE + 2 * slots * SLOT_SIZE
        self._counters = self._buf[start : start + workers * slots * COUNTER_CELL * 8].cast("q")
        start += workers * slots * COUNTER_CELL * 8
        self._sticky = self._buf[start : start + workers * sticky_entries * STICKY_ENTRY * 8].cast("Q")
        self._overrides_at = start + workers * sticky_entries * STICKY_ENTRY * 8
        self._rows: list[memoryview] = []  # views handed out, released on close

    @property
    def name(self) -> str:
        return self._shm.name

    @classmethod
    def create(cls, name: str | None, slots: int, workers: int = 0, sticky_entries: int = 0) -> SlotTable:
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in 1..{MAX_SLOTS}")
        if not 0 <= workers <= MAX_WORKERS:
            raise ValueError(f"workers must be in 0..{MAX_WORKERS}")
        if sticky_entries & (sticky_entries - 1) or sticky_entries > 1 << 24:
            raise ValueError("sticky_entries must be 0 or a power of two up to 2**24")
        size = segment_size(slots, workers, sticky_entries)
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        # its pages taken before they are written (router.kvevents.mapped: a page of /dev/shm written
        # where the folder is full kills the writer with SIGBUS); where segments are not files
        # under /dev/shm (not Linux), nothing to take
        segment = Path(SHM_DIR) / shm.name
        try:
            if segment.exists():
                take_pages(segment, 0, size)
        except OSError as exc:
            shm.close()
            shm.unlink()
            raise SegmentError(
                f"cannot lay out the replica table in /dev/shm ({size / (1 << 20):.1f} MiB: shm_slots, workers and "
                f"sticky_max_sessions): {exc.strerror or exc}; give it more room (docker run --shm-size, a Kubernetes "
                "emptyDir of medium Memory with a larger sizeLimit)"
            ) from None
        buf = _buffer(shm)
        buf[:size] = bytes(size)
        HEADER.pack_into(buf, 0, MAGIC, VERSION, slots, SLOT_SIZE, os.getpid(), workers, sticky_entries)
        return cls(shm, slots, workers, owner=True, sticky_entries=sticky_entries)

    @classmethod
    def attach(cls, name: str) -> SlotTable:
        # the creator owns the segment's life: keep it out of this process's resource tracker,
        # which would unlink it when we exit (and which a spawned child shares with its parent)
        register = resource_tracker.register
        resource_tracker.register = lambda name, rtype: None if rtype == "shared_memory" else register(name, rtype)
        try:
            shm = shared_memory.SharedMemory(name=name, create=False)
        finally:
            resource_tracker.register = register
        buf = _buffer(shm)
        if len(buf) < HEADER_SIZE:
            shm.close()
            raise ValueError(f"shared memory {name!r} is not a version-{VERSION} replica table")
        magic, version, slots, slot_size, _, workers, sticky = HEADER.unpack_from(buf, 0)
        if (
            magic != MAGIC
            or version != VERSION
            or slot_size != SLOT_SIZE
            or len(buf) < segment_size(slots, workers, sticky)
        ):
            shm.close()
            raise ValueError(f"shared memory {name!r} is not a version-{VERSION} replica table")
        return cls(shm, slots, workers, owner=False, sticky_entries=sticky)

    # -- seqlocked slots ----------------------------------------------------------------------

    def _offset(self, index: int, region: int) -> int:
        if not 0 <= index < self.slots:
            raise IndexError(f"slot {index} out of range 0..{self.slots - 1}")
        return HEADER_SIZE + (region * self.slots + index) * SLOT_SIZE

    def _write(self, at: int, slot: ReplicaSlot) -> None:
        self._write_bytes(at, pack(slot))

    def _write_bytes(self, at: int, payload: bytes) -> None:
        checksum = xxh3_64(payload)  # before the slot goes odd: the write window stays a copy
        buf = self._buf
        seq, _ = SEQ.unpack_from(buf, at)
        SEQ.pack_into(buf, at, seq + 1 | 1, 0)  # odd: writing
        buf[at + SEQ.size : at + SEQ.size + len(payload)] = payload
        SEQ.pack_into(buf, at, (seq | 1) + 1, checksum)  # even: done, with the payload's checksum

    def _read(self, at: int, index: int) -> ReplicaSlot:
        return unpack(self._read_bytes(at, SLOT_PAYLOAD.size, f"slot {index}"))

    def _read_bytes(self, at: int, size: int, what: str) -> bytes:
        buf = self._buf
        end = at + SEQ.size + size
        deadline = None
        for attempt in range(1, READ_RETRIES + 1):
            before, checksum = SEQ.unpack_from(buf, at)
            if not before & 1:
                payload = bytes(buf[at + SEQ.size : end])
                after, _ = SEQ.unpack_from(buf, at)
                if after == before and (before == 0 or xxh3_64(payload) == checksum):
                    return payload
            if attempt % 64 == 0:  # a writer is busy: let it run, and give up only after a while
                deadline = deadline or time.monotonic() + READ_PATIENCE_S
                if time.monotonic() > deadline:
                    break
                time.sleep(0)
        raise TornRead(f"{what} of {self.name} never settled")

    def write(self, index: int, slot: ReplicaSlot) -> None:
        """Write a replica slot. Each slot has one writer: the router's control loop."""
        self._write(self._offset(index, 0), slot)

    def read(self, index: int) -> ReplicaSlot:
        return self._read(self._offset(index, 0), index)

    # -- vnode overrides (the control loop writes, workers follow) ---------------------------------

    def write_overrides(self, overrides: list[tuple[int, int, int]]) -> None:
        """(origin slot, vnode, owner slot) of every override, under one seqlock."""
        if len(overrides) > MAX_OVERRIDES:
            raise ValueError(f"more than {MAX_OVERRIDES} vnode overrides")
        payload = _COUNT.pack(len(overrides)) + b"".join(_OVERRIDE.pack(o, w, v) for o, v, w in overrides)
        self._write_bytes(self._overrides_at, payload)  # the checksum covers the entries in use only

    def read_overrides(self) -> list[tuple[int, int, int]]:
        at = self._overrides_at
        for _ in range(64):  # the count tells the size; a write in between shows as a bad checksum
            (count,) = _COUNT.unpack_from(self._buf, at + SEQ.size)
            try:
                payload = self._read_bytes(at, _COUNT.size + min(count, MAX_OVERRIDES) * _OVERRIDE.size, "overrides")
            except TornRead:
                continue
            if _COUNT.unpack_from(payload, 0)[0] == count:
                break
        else:
            raise TornRead(f"the overrides of {self.name} never settled")
        return [
            (o, v, w)
            for o, w, v in (_OVERRIDE.unpack_from(payload, _COUNT.size + i * _OVERRIDE.size) for i in range(count))
        ]

    def seq(self, index: int) -> int:
        """The replica slot's sequence number: it changes with every write (a cheap change check)."""
        value: int = SEQ.unpack_from(self._buf, self._offset(index, 0))[0]
        return value

    def write_agent(self, index: int, slot: ReplicaSlot) -> None:
        """Write an agent slot. Each has one writer: the router-agent beside that replica."""
        self._write(self._offset(index, 1), slot)

    def read_agent(self, index: int) -> ReplicaSlot:
        return self._read(self._offset(index, 1), index)

    def find(self, replica_id: str) -> int | None:
        """The replica slot holding `replica_id`, if any."""
        for i in range(self.slots):
            if self.read(i).replica_id == replica_id:
                return i
        return None

    # -- generation and counters ----------------------------------------------------------------

    @property
    def generation(self) -> int:
        value: int = _U64.unpack_from(self._buf, GENERATION_AT)[0]
        return value

    def bump_generation(self) -> int:
        """Mark the replica table changed (the control loop only, after writing the slots)."""
        value = self.generation + 1
        _U64.pack_into(self._buf, GENERATION_AT, value)
        return value

    @property
    def probe_round(self) -> int:
        value: int = _U64.unpack_from(self._buf, PROBED_AT)[0]
        return value

    def bump_probe_round(self) -> int:
        """Mark a round of health probes done (the control loop only, after writing the slots)."""
        value = self.probe_round + 1
        _U64.pack_into(self._buf, PROBED_AT, value)
        return value

    def counters(self, worker: int) -> memoryview:
        """Worker `worker`'s row: cell i (replica slot i) is row[i * COUNTER_CELL : ...] as int64s."""
        if not 0 <= worker < self.workers:
            raise IndexError(f"worker {worker} out of range 0..{self.workers - 1}")
        width = self.slots * COUNTER_CELL
        row = self._counters[worker * width : (worker + 1) * width]
        self._rows.append(row)
        return row

    def sessions(self, worker: int) -> memoryview:
        """Worker `worker`'s session table: entry i is (key tag, written ms, replica) at [3i, 3i + 3)."""
        if not 0 <= worker < self.workers:
            raise IndexError(f"worker {worker} out of range 0..{self.workers - 1}")
        width = STICKY_ENTRY * self.sticky_entries
        row = self._sticky[worker * width : (worker + 1) * width]
        self._rows.append(row)
        return row

    def _release(self) -> None:
        for row in self._rows:
            row.release()
        self._counters.release()
        self._sticky.release()
        self._buf = memoryview(b"")  # drop our views of the segment before closing it

    def close(self) -> None:
        self._release()
        self._shm.close()
        if self.owner:
            self._shm.unlink()

    def __del__(self) -> None:
        # dropped without close(): let SharedMemory's own finaliser close the mapping (never unlink)
        if hasattr(self, "_sticky"):
            self._release()
