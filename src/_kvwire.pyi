"""Type stubs for the compiled KV-event scanner `_kvwire` (see _kvwire.pyx; its twin is router/_kvwire_py.py)."""

from array import array

MAX_DEPTH: int

# (kind, ...): (0, hashes, parent, token_ids, block_size, medium, lora_name, salt) a block stored;
# (1, hashes, medium) a run of removals; (2,) all cleared
ScannedEvent = (
    tuple[int, array[int], int | None, array[int], int, str, str | None, str | None]
    | tuple[int, array[int], str]
    | tuple[int]
)

def scan(payload: object) -> tuple[float, int, list[ScannedEvent]] | None: ...
