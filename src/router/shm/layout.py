"""The shared-memory replica table's layout: defined here once, read and written only through it.

Segment, all little-endian:

    header    magic "KVAR" | version u32 | slots u32 | slot_size u32 | creator pid u32 | workers u32
              | sticky entries u32 | padding | generation u64 at GENERATION_AT | probe round u64 at
              PROBED_AT | padding to 64 bytes
    replicas  `slots` slots written by the control loop: the replica table every worker routes by
    agents    `slots` slots written by colocated router-agents, agent slot i for replica slot i
    counters  `workers` rows of `slots` cells of COUNTER_FIELDS int64s, row w written by worker w only
    sessions  `workers` tables of `sticky entries` entries (a power of two) of three uint64s, table w
              written by worker w only: where each session was served last (router.state.session_table)
    overrides seq u64 | checksum u64 | count u32 | padding | MAX_OVERRIDES entries of (origin slot
              u16, owner slot u16, vnode u32): the ring's vnode overrides, written by the control loop

    slot      seq u64 | checksum u64 | payload (SLOT_PAYLOAD below) | padding to SLOT_SIZE

`generation` goes up each time the control loop changes what routing depends on (membership,
state, ring weight), so a worker re-reads the table only when it changed. `probe round` goes up
after each round of health probes, whether or not any figure changed: a worker then knows the
engines' queues it reads are new, and counts its sends from there (router.tenancy.admission).

`seq` is the slot's seqlock: odd while a writer is inside. `checksum` is XXH3 of the payload, so a
reader also rejects a torn copy on hardware that reorders stores. Bump VERSION whenever the payload
changes: an attaching process refuses a segment of another version rather than misread it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields

MAGIC = b"KVAR"
VERSION = 11
HEADER = struct.Struct("<4sIIIIII4x")  # 32 bytes, then the generation and the probe round, then padding to 64
GENERATION_AT = 32
PROBED_AT = 40
HEADER_SIZE = 64
SEQ = struct.Struct("<QQ")  # seq, checksum: 16 bytes
MAX_ID_BYTES = 64
MAX_URL_BYTES = 256
# replica id, url, state, flags (which optional figures are present), state changes, epoch (which
# assignment of the slot this is: a replica removed and added again gets a new one), weight,
# score, in-flight, then the optional figures (OPTIONAL, in order), then when it was written
# (unix seconds)
OPTIONAL_FLOATS = (
    "waiting",
    "running",
    "kv_usage",
    "fragmentation",
    "gpu_util",
    "temperature_c",
    "error_rate",
    "latency_ratio",
    "ttft_ratio",
    "deferred",
)
OPTIONAL_INTS = (
    "mem_used",
    "mem_total",
    "throttle_reasons",
    "ecc_errors",
    "gpu_slowed",
    "probe_ok",
    "capacity",
    "kv_tokens",
    "block_size",
)
OPTIONAL = OPTIONAL_FLOATS + OPTIONAL_INTS
SLOT_PAYLOAD = struct.Struct(
    f"<{MAX_ID_BYTES}s{MAX_URL_BYTES}sBxxxIIIddq" + "d" * len(OPTIONAL_FLOATS) + "Q" * len(OPTIONAL_INTS) + "d"
)
SLOT_SIZE = 576
# one worker's figures for one replica, each an int64 the worker alone writes
LATENCY_SAMPLES = 9  # a worker's latest samples of each latency kind, in nanoseconds
COUNTER_FIELDS = (
    "inflight",
    "requests",
    "errors",
    "prompt_tokens",
    "cached_tokens",
    "owner",  # a tag of the replica (id and epoch) the worker counted for (router.state.replica_table.owner_tag)
    "tpot_count",  # how many of the tpot sample cells hold a sample
    *(f"tpot_{i}" for i in range(LATENCY_SAMPLES)),
    "ttft_count",
    *(f"ttft_{i}" for i in range(LATENCY_SAMPLES)),
)
COUNTER_CELL = 32  # int64s per cell
assert PROBED_AT + 8 <= HEADER_SIZE and HEADER.size <= GENERATION_AT
assert SEQ.size + SLOT_PAYLOAD.size <= SLOT_SIZE
assert len(COUNTER_FIELDS) <= COUNTER_CELL

STATE_CODES = ("empty", "healthy", "suspect", "removed", "recovering", "draining", "warming")


@dataclass(frozen=True)
class ReplicaSlot:
    """One replica's row. Optional figures are None when their source could not be read."""

    replica_id: str = ""
    url: str = ""
    state: str = "empty"
    transitions: int = 0
    epoch: int = 0
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
    # the rest of the health score's inputs, as the control loop last saw them
    error_rate: float | None = None
    latency_ratio: float | None = None
    ttft_ratio: float | None = None
    gpu_slowed: int | None = None  # 0 or 1
    probe_ok: int | None = None  # 0 or 1
    capacity: int | None = None  # requests the replica runs at once (reported or configured)
    # the engine's KV cache, which sizes each worker's prefix index for it, and its other waiting requests
    deferred: float | None = None
    kv_tokens: int | None = None
    block_size: int | None = None
    updated_at: float = 0.0


FIELD_NAMES = tuple(f.name for f in fields(ReplicaSlot))


def pack(slot: ReplicaSlot) -> bytes:
    rid = slot.replica_id.encode("utf-8")
    if len(rid) > MAX_ID_BYTES:
        raise ValueError(f"replica id {slot.replica_id!r} is longer than {MAX_ID_BYTES} bytes")
    url = slot.url.encode("utf-8")
    if len(url) > MAX_URL_BYTES:
        raise ValueError(f"replica url {slot.url!r} is longer than {MAX_URL_BYTES} bytes")
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
        url,
        STATE_CODES.index(slot.state),
        flags,
        slot.transitions,
        slot.epoch,
        slot.weight,
        slot.score,
        slot.inflight,
        *(float(v) for v in values[: len(OPTIONAL_FLOATS)]),
        *(int(v) for v in values[len(OPTIONAL_FLOATS) :]),
        slot.updated_at,
    )


def unpack(payload: bytes | memoryview) -> ReplicaSlot:
    rid, url, state, flags, transitions, epoch, weight, score, inflight, *rest = SLOT_PAYLOAD.unpack(payload)
    updated_at = rest.pop()
    optional = {name: (rest[bit] if flags >> bit & 1 else None) for bit, name in enumerate(OPTIONAL)}
    return ReplicaSlot(
        rid.rstrip(b"\0").decode("utf-8"),
        url.rstrip(b"\0").decode("utf-8"),
        STATE_CODES[state],
        transitions,
        epoch,
        weight,
        score,
        inflight,
        **optional,
        updated_at=updated_at,
    )
