"""An asyncio event loop on a virtual clock, for `router-bench simulate`.

The loop's `time()` is a number that moves only when the loop would otherwise wait: where a real
loop blocks in its selector until the next timer is due, this one jumps the clock to that timer.
Coroutines written for real time (`asyncio.sleep`, `loop.call_at`, `loop.time()` for deadlines)
run unchanged and as fast as the CPU allows, in the order of their virtual times; nothing reads
the wall clock. It has no I/O: a socket registered with it would never be ready (the loop's own
wake-up pipe is the only one, and it is never written in one thread).

Its turn of the loop is lighter than asyncio's, which a simulation of a million sessions runs
some ten million times: timers wait in a heap of (time, order, handle) tuples that compare in C
(asyncio's heap compares its handles with a method written in Python), equal times run in the
order they were set, and a turn neither asks the selector nor makes the checks of debug mode.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import selectors
from asyncio import events
from collections.abc import Callable
from contextvars import Context
from typing import Any, TypeVarTuple

_Ts = TypeVarTuple("_Ts")


class _Idle(selectors.BaseSelector):
    """A selector with nothing to wait for, where the loop registers its wake-up pipe; the loop's
    turn (`VirtualLoop._run_once`) never asks it."""

    def __init__(self) -> None:
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        return []

    def close(self) -> None:
        self._keys.clear()

    def get_map(self) -> dict[Any, selectors.SelectorKey]:
        return self._keys


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock starts at 0 and jumps to each timer as it falls due."""

    def __init__(self) -> None:
        self._now = 0.0
        self._timers: list[tuple[float, int, events.TimerHandle]] = []
        self._order = itertools.count()
        super().__init__(selector=_Idle())
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(seconds, 0.0)

    def call_at(
        self,
        when: float,
        callback: Callable[[*_Ts], object],
        *args: *_Ts,
        context: Context | None = None,
    ) -> events.TimerHandle:
        timer = events.TimerHandle(when, callback, args, self, context)
        heapq.heappush(self._timers, (when, next(self._order), timer))
        # (asyncio's own fields, as its loop keeps them: a cancelled timer tells its loop while scheduled)
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    def _run_once(self) -> None:
        """One turn: with nothing ready, the clock jumps to the next timer; every timer due joins
        the ready handles, and those ready at the turn's start run."""
        ready: Any = self._ready  # type: ignore[attr-defined]  # (asyncio's deque of handles ready to run)
        timers = self._timers
        if not ready:
            while timers and timers[0][2]._cancelled:
                heapq.heappop(timers)
            if not timers:
                # nothing scheduled and nothing ready: in real time the loop would wait forever
                raise RuntimeError("the virtual clock has nothing left to run (a coroutine waits for what never comes)")
            if timers[0][0] > self._now:
                self._now = timers[0][0]
        now = self._now
        while timers and timers[0][0] <= now:
            timer = heapq.heappop(timers)[2]
            timer._scheduled = False  # type: ignore[attr-defined]
            if not timer._cancelled:
                ready.append(timer)
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                handle._run()

    def close(self) -> None:
        self._timers.clear()
        super().close()
