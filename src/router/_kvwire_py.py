"""The pure-Python twin of `_kvwire` (src/_kvwire.pyx): a KV-event payload read in the shapes engines send.

`scan(payload)` answers `(ts, rank, events)`, each event a tuple:

    (0, hashes, parent, token_ids, block_size, medium, lora_name, salt)   a BlockStored
    (1, hashes, medium)                                                   a run of BlockRemoved
    (2,)                                                                  AllBlocksCleared

(a run of removals on one medium gathered into one), or None for a message it does not read:
anything but tagged-map events with non-negative int hashes, and every malformed message.
router.kvevents.wire decodes those the long way, and says what is wrong. Where either
implementation answers, it answers as that long way decodes (tests/unit/test_kvwire.py compares
them); the compiled one also leaves to it what this twin reads after msgpack has built it
(extension types, map keys that are not strings, deep nesting), and nothing else.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgpack

GPU = "GPU"
MAX_DEPTH = 64  # (the compiled scanner's limit; msgpack's own applies here)

Scanned = tuple[float, int, list[tuple[Any, ...]]]


def _uints(value: Any) -> array[int] | None:
    if type(value) is not list:
        return None
    try:
        names = array("Q", value)
    except (TypeError, OverflowError):
        return None
    return None if bool in map(type, value) else names


def _medium(value: Any) -> str:
    return value if type(value) is str and value else GPU


def _salt(extra: Any, lora_name: str | None) -> str | None:
    if type(extra) is not list or not extra or type(extra[0]) is not list:
        return None
    items = extra[0]
    if lora_name is not None and items and items[0] == lora_name:
        items = items[1:]
    strings = [x for x in items if type(x) is str]
    return strings[-1] if strings else None


def _stored(e: dict[Any, Any]) -> tuple[Any, ...] | None:
    hashes = _uints(e.get("block_hashes"))
    parent = e.get("parent_block_hash")
    size = e.get("block_size")
    ids = _uints(e.get("token_ids"))
    if hashes is None or ids is None or (parent is not None and type(parent) is not int) or type(size) is not int:
        return None
    if (parent is not None and parent < 0) or size < 1 or len(ids) != len(hashes) * size:
        return None
    lora = e.get("lora_name")
    name = lora if type(lora) is str and lora else None
    return (0, hashes, parent, ids, size, _medium(e.get("medium")), name, _salt(e.get("extra_keys"), name))


def scan(payload: object) -> Scanned | None:
    """A KV-event message's payload as (ts, rank, events), or None: not a shape this reads."""
    if type(payload) is not bytes:
        return None
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError):
        return None
    if type(body) is not list or len(body) < 2 or type(body[1]) is not list:
        return None
    ts = body[0]
    rank = body[2] if len(body) > 2 else 0
    out: list[tuple[Any, ...]] = []
    gone: array[int] | None = None
    gone_medium = GPU
    for e in body[1]:
        kind = e.get("type") if type(e) is dict else None
        if kind == "BlockRemoved":
            hashes = _uints(e.get("block_hashes"))
            if hashes is None:
                return None
            medium = _medium(e.get("medium"))
            if gone is not None and medium != gone_medium:
                out.append((1, gone, gone_medium))
                gone = None
            if gone is None:
                gone, gone_medium = array("Q"), medium
            gone.extend(hashes)
            continue
        if gone is not None:
            out.append((1, gone, gone_medium))
            gone = None
        if kind == "BlockStored":
            stored = _stored(e)
            if stored is None:
                return None
            out.append(stored)
        elif kind == "AllBlocksCleared":
            out.append((2,))
        else:
            return None
    if gone is not None:
        out.append((1, gone, gone_medium))
    return (
        float(ts) if isinstance(ts, int | float) else 0.0,
        rank if type(rank) is int and rank >= 0 else 0,
        out,
    )


__all__ = ["MAX_DEPTH", "scan"]
