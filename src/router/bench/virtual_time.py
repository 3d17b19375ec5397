"""An asyncio event loop on a virtual clock, for `router-bench simulate`.

The loop's `time()` is a number that moves only when the loop would otherwise wait: where a real
loop blocks in its selector until the next timer is due, this one jumps the clock to that timer.
Coroutines written for real time (`asyncio.sleep`, `loop.call_at`, `loop.time()` for deadlines)
run unchanged and as fast as the CPU allows, in the order of their virtual times; nothing reads
the wall clock. It has no I/O: a socket registered with it would never be ready (the loop's own
wake-up pipe is the only one, and it is never written in one thread).
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any


class _Idle(selectors.BaseSelector):
    """A selector with nothing to wait for: `select(timeout)` moves the clock by `timeout`."""

    def __init__(self, loop: VirtualLoop) -> None:
        self._loop = loop
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            # nothing scheduled and nothing ready: in real time the loop would wait forever
            raise RuntimeError("the virtual clock has nothing left to run (a coroutine waits for what never comes)")
        self._loop.advance(timeout)
        return []

    def close(self) -> None:
        self._keys.clear()

    def get_map(self) -> dict[Any, selectors.SelectorKey]:
        return self._keys


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock starts at 0 and jumps to each timer as it falls due."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(selector=_Idle(self))
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(seconds, 0.0)
