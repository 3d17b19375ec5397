"""The shared-memory replica table's layout: defined here once, read and written only through it.

Segment = header, then `slots` fixed-size slots, all little-endian:

    header  magic "KVAR" | version u32 | slots u32 | slot_size u32 | creator pid u32 | padding to 64 bytes
    slot    seq u64 | checksum u64 | payload (SLOT_PAYLOAD below) | padding to SLOT_SIZE

`seq` is the slot's seqlock: odd while a writer is inside. `checksum` is XXH3 of the payload, so a
reader also rejects a torn copy on hardware that reorders stores. Bump VERSION whenever the payload
changes: an attaching process refuses a segment of another version rather than misread it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields

MAGIC = b"KVAR"
VERSION = 1
HEADER = struct.Struct("<4sIIII44x")  # 64 bytes
SEQ = struct.Struct("<QQ")  # seq, checksum: 16 bytes
# replica id, state, flags (which optional figures are present), weight, score, in-flight, then
# engine and GPU figures, then when it was written (unix seconds)
SLOT_PAYLOAD = struct.Struct("<64sBxxxIddq" + "d" * 6 + "QQQQd")
SLOT_SIZE = 256
assert HEADER.size == 64 and SEQ.size + SLOT_PAYLOAD.size <= SLOT_SIZE

STATE_CODES = ("empty", "healthy", "suspect", "removed", "recovering", "draining", "warming")
OPTIONAL = (
    "waiting",
    "running",
    "kv_usage",
    "fragmentation",
    "gpu_util",
    "temperature_c",
    "mem_used",
    "mem_total",
    "throttle_reasons",
    "ecc_errors",
)


@dataclass(frozen=True)
class ReplicaSlot:
    """One replica's row. Optional figures are None when their source could not be read."""

    replica_id: str = ""
    state: str = "empty"
    weight: float = 0.0
    score: float = 0.0
    inflight: int = 0
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    fragmentation: float | None = None
    gpu_util: float | None = None
    temperature_c: float | None = None
    mem_used: int | None = None
    mem_total: int | None = None
    throttle_reasons: int | None = None
    ecc_errors: int | None = None
    updated_at: float = 0.0


FIELD_NAMES = tuple(f.name for f in fields(ReplicaSlot))


def pack(slot: ReplicaSlot) -> bytes:
    rid = slot.replica_id.encode("utf-8")
    if len(rid) > 64:
        raise ValueError(f"replica id {slot.replica_id!r} is longer than 64 bytes")
    if slot.state not in STATE_CODES:
        raise ValueError(f"unknown state {slot.state!r}")
    flags = 0
    values = []
    for bit, name in enumerate(OPTIONAL):
        value = getattr(slot, name)
        if value is not None:
            flags |= 1 << bit
        values.append(value if value is not None else 0)
    return SLOT_PAYLOAD.pack(
        rid,
        STATE_CODES.index(slot.state),
        flags,
        slot.weight,
        slot.score,
        slot.inflight,
        *(float(v) for v in values[:6]),
        *(int(v) for v in values[6:]),
        slot.updated_at,
    )


def unpack(payload: bytes | memoryview) -> ReplicaSlot:
    rid, state, flags, weight, score, inflight, *rest = SLOT_PAYLOAD.unpack(payload)
    updated_at = rest.pop()
    optional = {name: (rest[bit] if flags >> bit & 1 else None) for bit, name in enumerate(OPTIONAL)}
    return ReplicaSlot(
        rid.rstrip(b"\0").decode("utf-8"),
        STATE_CODES[state],
        weight,
        score,
        inflight,
        **optional,
        updated_at=updated_at,
    )
