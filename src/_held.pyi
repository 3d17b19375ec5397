"""Type stubs for the compiled `_held` (see _held.pyx; its twin is router/_held_py.py)."""

from array import array
from collections.abc import Iterable
from typing import Any

def read_plain(
    layout: Any,
    excluded: array[int],
    known: array[float],
    sizes: array[int],
    slow: list[int],
    truth: Any,
    tokens: Any,
    matches: dict[int, array[int]],
) -> None: ...
def under(cost: array[float], flags: array[int], limit: float, candidate: int, gated: int) -> list[int]: ...
def lost(kept: Iterable[Any], counts: list[int], chain: array[int], now: float, spare_s: float) -> float: ...
