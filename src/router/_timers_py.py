"""The pure-Python twin of `_timers` (src/_timers.pyx): the simulator's timers in order of when
they fall due, a heap of `(when, order, timer)` tuples (they compare in C, and `order`, unique,
breaks ties before a timer is ever compared). The compiled one keeps the same order in a flat
array; both answer alike (tests/unit/test_virtual_time.py runs both)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Any


class TimerHeap:
    """Timers by `(when, the order pushed)`; each timer has a `cancelled` attribute."""

    __slots__ = ("_heap", "_order")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, when: float, item: Any) -> None:
        """Keep `item` until `when` (after those pushed before it for the same time)."""
        heapq.heappush(self._heap, (when, next(self._order), item))

    def first_when(self) -> float:
        """When the first timer falls due (IndexError where none waits)."""
        if not self._heap:
            raise IndexError("no timer waits")
        return self._heap[0][0]

    def drop_cancelled(self) -> None:
        """Drop the cancelled timers at the front."""
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)

    def take_due(self, now: float, into: deque[Any]) -> None:
        """Take out every timer due at or before `now`, in order; append those not cancelled to `into`."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            item = heapq.heappop(heap)[2]
            if not item.cancelled:
                into.append(item)

    def clear(self) -> None:
        self._heap.clear()
