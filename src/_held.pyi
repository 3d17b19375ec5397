"""Type stubs for the compiled `_held` (see _held.pyx; its twin is router/_held_py.py)."""

from array import array
from typing import Any

def read_plain(
    positions: array[int],
    holders: array[int],
    block_sizes: array[int],
    dynamic: list[tuple[int, Any, Any, dict[str, Any], int]],
    judged_slow: list[int],
    excluded: array[int],
    known: array[float],
    sizes: array[int],
    slow: list[int],
    truth: Any,
    tokens: Any,
    matches: dict[int, array[int]],
    at: dict[str, int],
) -> None: ...
def under(cost: array[float], flags: array[int], limit: float, candidate: int, gated: int) -> list[int]: ...
