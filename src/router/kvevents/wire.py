"""vLLM's (and SGLang's) KV-cache event messages, decoded: what an engine says it stored, removed or cleared.

An engine publishes on a ZMQ PUB socket, one message per scheduler step that changed its prefix
cache, three frames each: the topic, the sequence number (8 bytes, big-endian, from 0 when the
engine starts), and a msgpack payload `[ts, [event, ...], data_parallel_rank]`. An event is a
map tagged by "type" (vLLM since mid-2026):

    {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": p | None,
     "token_ids": [...], "block_size": 32, "lora_id": ..., "medium": "GPU", "lora_name": ...,
     "extra_keys": [[...] | None, ...], ...}
    {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": "GPU", ...}
    {"type": "AllBlocksCleared"}

or, before that, a positional array: `["BlockStored", hashes, parent, token_ids, block_size,
lora_id, medium, lora_name?]`, `["BlockRemoved", hashes, medium]`, `["AllBlocksCleared"]`.
Fields an engine adds later are ignored; a message that is not one of these is a `WireError`
(one readable line), never a crash of the subscriber. The engine's block hashes (ints or bytes)
are kept only to apply its removals: the router keys blocks by its own hash of the token ids.
Each is read as a 64-bit name (`engine_name`): vLLM's default hashes are ints under 2**64
(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1: the low 64 bits of its SHA-256), read as they are, in one
array at C speed; a negative 64-bit int (an engine that sends signed hashes) is its two's
complement; bytes and longer ints are hashed to 64 bits (BLAKE2b), where two of the n blocks a
replica holds share a name with odds of about n**2 / 2**65 (one in 37 million at a million).

Most messages are read at C speed (`_kvwire.scan`, its twin router/_kvwire_py.py): the tagged
events vLLM sends, their hashes and token ids straight from the msgpack bytes into arrays. Any
other message (positional events, signed or bytes hashes, a malformed one) is decoded here the
long way, which also says what is wrong with it. Either way a run of BlockRemoved events on one
medium (vLLM sends one per evicted block) is one `Removed`.

A stored block's `extra_keys` entry holds, in order, the LoRA adapter's name (when one is set),
multimodal identifiers, and the request's `cache_salt` (a string, on the first block only):
blocks of two adapters or two salts never share a key, and `cache_salt` is how the router's keys
separate them too (router.kvevents.tokens.root_of).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from router._compat import NO_EXTENSIONS
from router.errors import RouterError

if TYPE_CHECKING or NO_EXTENSIONS:
    from router._kvwire_py import scan
else:
    from _kvwire import scan

MEDIUM_GPU = "GPU"
END_SEQ = -1  # the replay socket's last answer
_SPAN = 1 << 64


class WireError(RouterError, ValueError):
    """A message that is not a KV-event batch."""


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: array[int]  # the engine's names of the stored blocks, in chain order ('Q': `engine_name`)
    parent: int | None  # the engine's name of the block before the first (None: the chain's first)
    token_ids: array[int]  # len(hashes) x block_size tokens ('Q': unsigned 64-bit)
    block_size: int
    medium: str
    lora_name: str | None
    salt: str | None  # the request's cache_salt, where the first block's extra keys carry one


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: array[int]  # 'Q': `engine_name`
    medium: str


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    ts: float
    rank: int
    events: tuple[Event, ...]
    # read by the scanner (False: decoded the long way: a shape the scanner leaves, which an engine
    # sending it on every message would make slow; Holdings counts them). Not part of what it says.
    scanned: bool = field(default=False, compare=False)


def engine_name(h: object, where: str = "event") -> int:
    """An engine's block hash as a 64-bit name: an int in [0, 2**64) itself, a negative one from
    -2**63 its two's complement, bytes or a longer int 64 bits of BLAKE2b of it."""
    if isinstance(h, int) and not isinstance(h, bool):
        if 0 <= h < _SPAN:
            return h
        if -(1 << 63) <= h < 0:
            return h + _SPAN
        data = b"i" + h.to_bytes((h.bit_length() + 8) // 8, "big", signed=True)
    elif isinstance(h, bytes):
        data = b"b" + h
    else:
        raise WireError(f"{where}: a block hash is a {type(h).__name__}, not an int or bytes")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _hashes(value: Any, where: str) -> array[int]:
    if not isinstance(value, list | tuple):
        raise WireError(f"{where}: block_hashes is not a list")
    try:  # vLLM's ints, at C speed (a bool would pass: it is refused below, at C speed too)
        names = array("Q", value)
    except (TypeError, OverflowError):
        return array("Q", [engine_name(h, where) for h in value])
    if bool in map(type, value):
        raise WireError(f"{where}: a block hash is a bool, not an int or bytes")
    return names


def _medium(value: Any) -> str:
    return value if isinstance(value, str) and value else MEDIUM_GPU


def _salt(extra_keys: Any, lora_name: str | None) -> str | None:
    """The cache_salt in the first block's extra keys: the string that is not the adapter's name."""
    if not isinstance(extra_keys, list | tuple) or not extra_keys:
        return None
    first = extra_keys[0]
    if not isinstance(first, list | tuple):
        return None
    items = list(first)
    if lora_name is not None and items and items[0] == lora_name:
        items = items[1:]
    strings = [x for x in items if isinstance(x, str)]
    return strings[-1] if strings else None


def _stored(
    hashes: Any, parent: Any, token_ids: Any, block_size: Any, medium: Any, lora_name: Any, extra: Any, where: str
) -> Stored:
    keys = _hashes(hashes, where)
    if parent is not None:
        if not isinstance(parent, int | bytes) or isinstance(parent, bool):
            raise WireError(f"{where}: parent_block_hash is a {type(parent).__name__}")
        parent = engine_name(parent, where)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise WireError(f"{where}: block_size is {block_size!r}, not a whole number >= 1")
    try:  # (the array checks each id at C speed: an int, not negative, under 2**64)
        ids = array("Q", token_ids) if isinstance(token_ids, list | tuple) else None
    except (TypeError, OverflowError):
        ids = None
    if ids is None:
        raise WireError(f"{where}: token_ids is not a list of token ids")
    if len(ids) != len(keys) * block_size:
        raise WireError(f"{where}: {len(ids)} token ids for {len(keys)} blocks of {block_size}")
    name = lora_name if isinstance(lora_name, str) and lora_name else None
    return Stored(keys, parent, ids, block_size, _medium(medium), name, _salt(extra, name))


def _event_of_map(e: dict[Any, Any], where: str) -> Event:
    kind = e.get("type")
    if kind == "BlockStored":
        return _stored(
            e.get("block_hashes"),
            e.get("parent_block_hash"),
            e.get("token_ids"),
            e.get("block_size"),
            e.get("medium"),
            e.get("lora_name"),
            e.get("extra_keys"),
            where,
        )
    if kind == "BlockRemoved":
        return Removed(_hashes(e.get("block_hashes"), where), _medium(e.get("medium")))
    if kind == "AllBlocksCleared":
        return Cleared()
    raise WireError(f"{where}: unknown event type {kind!r}")


def _event_of_array(e: list[Any] | tuple[Any, ...], where: str) -> Event:
    kind = e[0] if e else None
    fields = list(e[1:])
    if kind == "BlockStored":
        if len(fields) < 4:
            raise WireError(f"{where}: a positional BlockStored has {len(fields)} fields, not 4 or more")
        fields += [None] * (7 - len(fields))
        hashes, parent, token_ids, block_size, _lora_id, medium, lora_name = fields[:7]
        return _stored(hashes, parent, token_ids, block_size, medium, lora_name, None, where)
    if kind == "BlockRemoved":
        if not fields:
            raise WireError(f"{where}: a positional BlockRemoved has no block hashes")
        return Removed(_hashes(fields[0], where), _medium(fields[1] if len(fields) > 1 else None))
    if kind == "AllBlocksCleared":
        return Cleared()
    raise WireError(f"{where}: unknown event type {kind!r}")


def event_of(e: Any, where: str = "event") -> Event:
    """One event, tagged map or positional array."""
    if isinstance(e, dict):
        return _event_of_map(e, where)
    if isinstance(e, list | tuple):
        return _event_of_array(e, where)
    raise WireError(f"{where}: an event is a {type(e).__name__}, not a map or an array")


def seq_of(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"the sequence frame has {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)


def _events(scanned: list[tuple[Any, ...]]) -> tuple[Event, ...]:
    out: list[Event] = []
    for e in scanned:
        kind = e[0]
        out.append(Stored(*e[1:]) if kind == 0 else Removed(e[1], e[2]) if kind == 1 else Cleared())
    return tuple(out)


def _gathered(events: list[Event]) -> tuple[Event, ...]:
    """`events` with each run of removals on one medium made one."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, Removed) and isinstance(last, Removed) and last.medium == e.medium:
            out[-1] = Removed(last.hashes + e.hashes, e.medium)
        else:
            out.append(e)
    return tuple(out)


def decode(seq: int, payload: bytes) -> Batch:
    """The batch a message carries (its sequence number already read)."""
    scanned = scan(payload)
    if scanned is not None:
        return Batch(seq, scanned[0], scanned[1], _events(scanned[2]), scanned=True)
    return decode_long(seq, payload)


def decode_long(seq: int, payload: bytes) -> Batch:
    """`decode` without the scanner: every message, every shape, and a WireError that says what is wrong."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as exc:
        raise WireError(f"message {seq}: not msgpack ({exc})") from None
    if not isinstance(body, list | tuple) or len(body) < 2:
        raise WireError(f"message {seq}: the payload is not [ts, events, rank]")
    ts, events = body[0], body[1]
    rank = body[2] if len(body) > 2 else 0
    if not isinstance(events, list | tuple):
        raise WireError(f"message {seq}: events is not a list")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        rank = 0
    where = f"message {seq}"
    return Batch(
        seq,
        float(ts) if isinstance(ts, int | float) else 0.0,
        rank,
        _gathered([event_of(e, where) for e in events]),
    )


def frames_of(frames: list[bytes]) -> Batch:
    """A PUB message's frames ([topic, seq, payload]; [seq, payload] without a topic)."""
    if len(frames) == 3:
        return decode(seq_of(frames[1]), frames[2])
    if len(frames) == 2:
        return decode(seq_of(frames[0]), frames[1])
    raise WireError(f"a message of {len(frames)} frames, not 3 (topic, sequence, payload)")


__all__ = [
    "END_SEQ",
    "MEDIUM_GPU",
    "Batch",
    "Cleared",
    "Event",
    "Removed",
    "Stored",
    "WireError",
    "decode",
    "decode_long",
    "engine_name",
    "event_of",
    "frames_of",
    "seq_of",
]
