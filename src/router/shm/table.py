"""The replica table in shared memory: one writer per slot, any number of readers, none blocked.

A writer bumps the slot's sequence number to odd, writes the payload and its checksum, and bumps
it to even. A reader copies the slot and accepts the copy only if the sequence was even and the
same before and after, and the checksum matches; otherwise it retries (a bounded number of times).
Only the process that created the segment unlinks it; attaching processes are kept out of Python's
resource tracker, which would otherwise unlink the segment when they exit (cpython gh-82300).
"""

from __future__ import annotations

import os
from multiprocessing import resource_tracker, shared_memory

from router.ring import xxh3_64
from router.shm.layout import HEADER, MAGIC, SEQ, SLOT_PAYLOAD, SLOT_SIZE, VERSION, ReplicaSlot, pack, unpack

READ_RETRIES = 10_000


def _buffer(shm: shared_memory.SharedMemory) -> memoryview:
    buf = shm.buf
    assert buf is not None, "the shared memory segment is closed"
    return buf


class TornRead(RuntimeError):
    """A slot kept changing under the reader for READ_RETRIES tries (a writer died mid-write?)."""


class SlotTable:
    def __init__(self, shm: shared_memory.SharedMemory, slots: int, owner: bool) -> None:
        self._shm = shm
        self.slots = slots
        self.owner = owner
        self._buf: memoryview = _buffer(shm)

    @property
    def name(self) -> str:
        return self._shm.name

    @classmethod
    def create(cls, name: str | None, slots: int) -> SlotTable:
        if not 1 <= slots <= 65536:
            raise ValueError("slots must be in 1..65536")
        shm = shared_memory.SharedMemory(name=name, create=True, size=HEADER.size + slots * SLOT_SIZE)
        buf = _buffer(shm)
        buf[: HEADER.size + slots * SLOT_SIZE] = bytes(HEADER.size + slots * SLOT_SIZE)
        HEADER.pack_into(buf, 0, MAGIC, VERSION, slots, SLOT_SIZE, os.getpid())
        return cls(shm, slots, owner=True)

    @classmethod
    def attach(cls, name: str) -> SlotTable:
        shm = shared_memory.SharedMemory(name=name, create=False)
        # the creator owns the segment's life: don't let this process's resource tracker unlink it
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        magic, version, slots, slot_size, _ = HEADER.unpack_from(_buffer(shm), 0)
        if magic != MAGIC or version != VERSION or slot_size != SLOT_SIZE:
            shm.close()
            raise ValueError(f"shared memory {name!r} is not a version-{VERSION} replica table")
        return cls(shm, slots, owner=False)

    def _offset(self, index: int) -> int:
        if not 0 <= index < self.slots:
            raise IndexError(f"slot {index} out of range 0..{self.slots - 1}")
        return HEADER.size + index * SLOT_SIZE

    def write(self, index: int, slot: ReplicaSlot) -> None:
        """Write one slot. Each slot must have one writer at a time (the control loop, or its agent)."""
        at = self._offset(index)
        payload = pack(slot)
        buf = self._buf
        seq, _ = SEQ.unpack_from(buf, at)
        SEQ.pack_into(buf, at, seq + 1 | 1, 0)  # odd: writing
        buf[at + SEQ.size : at + SEQ.size + len(payload)] = payload
        SEQ.pack_into(buf, at, (seq | 1) + 1, xxh3_64(payload))  # even: done, with the payload's checksum

    def read(self, index: int) -> ReplicaSlot:
        at = self._offset(index)
        buf = self._buf
        end = at + SEQ.size + SLOT_PAYLOAD.size
        for _ in range(READ_RETRIES):
            before, checksum = SEQ.unpack_from(buf, at)
            if before & 1:
                continue
            payload = bytes(buf[at + SEQ.size : end])
            after, _ = SEQ.unpack_from(buf, at)
            if after == before and (before == 0 or xxh3_64(payload) == checksum):
                return unpack(payload)
        raise TornRead(f"slot {index} of {self.name} never settled")

    def close(self) -> None:
        self._buf = memoryview(b"")  # drop our view of the segment before closing it
        self._shm.close()
        if self.owner:
            self._shm.unlink()
