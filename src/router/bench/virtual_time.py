"""A light event loop on a virtual clock, for `router-bench simulate`.

The loop's `time()` is a number that moves only when the loop would otherwise wait: where a real
loop blocks in its selector until the next timer is due, this one jumps the clock to that timer.
Nothing reads the wall clock, so an hour of a fleet runs as fast as the CPU allows.

It is not an asyncio loop: it runs only what the proxy's journey needs of one, and a simulation of
a million sessions runs its turn some ten million times. A coroutine runs as a `Strand` (asyncio's
Task, without its future, its context or its cancellation); it may await the loop's own `Wait`s
(set once, by a timer or by the simulation: `sleep`, and a modelled replica's answer) and other
coroutines, nothing else: awaiting an asyncio future or an `asyncio.sleep` is an error the run
stops on, never a hang. While the loop runs it is the thread's running loop, so the journey's
`asyncio.get_running_loop().time()` reads the virtual clock.

Its turns run in asyncio's order, so a run replays the asyncio loop's to the last digit: timers
wait in order of time (`_timers`, compiled: a heap of flat (time, order) keys; its twin, a heap
of tuples), and equal times run in the order they were set; each turn runs what was ready when
it began, after the timers due join it; a strand started, or woken by a `Wait` set, goes on in
the next turn, and a timer's callback that sets a `Wait` wakes its strand one turn later, as
asyncio's `sleep` does.
"""

from __future__ import annotations

from asyncio import events
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from router._compat import NO_EXTENSIONS

if TYPE_CHECKING or NO_EXTENSIONS:
    from router._timers_py import TimerHeap
else:
    from _timers import TimerHeap

T = TypeVar("T")


class Timer:
    """A callback due at a virtual time; `cancel` before then and it never runs."""

    __slots__ = ("arg", "callback", "cancelled")

    def __init__(self, callback: Callable[[Any], object], arg: Any) -> None:
        self.callback = callback
        self.arg = arg
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        self.arg = None  # (what it held is free at once, as asyncio's cancelled handles are)

    def __call__(self) -> None:
        if not self.cancelled:  # (cancelled after it fell due, in the turn it runs: as in asyncio)
            self.callback(self.arg)


class Wait(Generic[T]):
    """What a strand awaits: `set` once, and the strand awaiting it goes on in the next turn."""

    __slots__ = ("done", "loop", "strand", "value")

    def __init__(self, loop: LightLoop) -> None:
        self.loop = loop
        self.strand: Strand[Any] | None = None
        self.done = False
        self.value: Any = None

    def set(self, value: T) -> None:
        if self.done:
            raise RuntimeError("a Wait is set once")
        self.done = True
        self.value = value
        strand = self.strand
        if strand is not None:
            self.strand = None
            self.loop._ready.append(strand._step)

    def __await__(self) -> Generator[Wait[T], None, T]:
        if not self.done:
            yield self
        return self.value  # type: ignore[no-any-return]


class Strand(Generic[T]):
    """A coroutine the loop runs, a step per turn it is woken in."""

    __slots__ = ("coro", "done", "error", "loop", "value")

    def __init__(self, loop: LightLoop, coro: Coroutine[Any, Any, T]) -> None:
        self.loop = loop
        self.coro = coro
        self.done = False
        self.value: T | None = None
        self.error: BaseException | None = None

    def result(self) -> T:
        if not self.done:
            raise RuntimeError("the strand has not ended")
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]

    def _step(self) -> None:
        try:
            waited = self.coro.send(None)
        except StopIteration as end:
            self.done, self.value = True, end.value
            return
        except BaseException as exc:  # (a bug in the coroutine: the run stops on it)
            self.done, self.error = True, exc
            self.loop.crashed(exc)
            return
        if type(waited) is not Wait:
            # an asyncio future or sleep: nothing here would ever end it
            self.coro.close()
            self.done = True
            self.error = RuntimeError(f"a strand awaited {waited!r}; the light loop runs only its own Waits")
            self.loop.crashed(self.error)
            return
        waited.strand = self


class LightLoop:
    """Timers and strands on a clock that starts at 0 and jumps to each timer as it falls due."""

    def __init__(self) -> None:
        self._now = 0.0
        self._timers = TimerHeap()  # (the compiled `_timers`, or its twin)
        self._ready: deque[Callable[[], object]] = deque()
        self.error: BaseException | None = None  # what a strand or a timer's callback raised

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(seconds, 0.0)

    def call_at(self, when: float, callback: Callable[[Any], object], arg: Any = None) -> Timer:
        """`callback(arg)` at virtual time `when` (at once, in the next turn, if that has passed)."""
        timer = Timer(callback, arg)
        self._timers.push(when, timer)
        return timer

    def spawn(self, coro: Coroutine[Any, Any, T]) -> Strand[T]:
        """Run `coro` from the next turn on."""
        strand = Strand(self, coro)
        self._ready.append(strand._step)
        return strand

    def wait(self) -> Wait[Any]:
        return Wait(self)

    def sleep(self, seconds: float) -> Wait[None]:
        """A Wait set `seconds` from now (asyncio.sleep's, on this loop)."""
        done: Wait[None] = Wait(self)
        self.call_at(self._now + seconds, done.set)
        return done

    def crashed(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc

    def run(self, until: Callable[[], bool]) -> None:
        """Run turns until `until()` says so after one, or a strand or callback raises (raised
        here); RuntimeError where nothing is left to run and `until()` still says no."""
        previous = events._get_running_loop()
        events._set_running_loop(self)  # type: ignore[arg-type]  # (the journey reads loop.time())
        try:
            while not until():
                self._turn()
                if self.error is not None:
                    raise self.error
        finally:
            events._set_running_loop(previous)

    def run_until_done(self, strand: Strand[T]) -> T:
        self.run(lambda: strand.done)
        return strand.result()

    def run_until(self, when: float) -> None:
        """Run every turn due by virtual time `when`, and move the clock on to it."""
        self.call_at(when, _nothing)
        self.run(lambda: self._now >= when and not self._ready and not self._due(when))
        self._now = max(self._now, when)

    def _due(self, when: float) -> bool:
        timers = self._timers
        timers.drop_cancelled()
        return bool(timers) and timers.first_when() <= when

    def _turn(self) -> None:
        """One turn: with nothing ready, the clock jumps to the next timer; every timer due joins
        the ready callbacks, and those ready at the turn's start run."""
        ready = self._ready
        timers = self._timers
        if not ready:
            timers.drop_cancelled()
            if not timers:
                # nothing scheduled and nothing ready: in real time the loop would wait forever
                raise RuntimeError("the virtual clock has nothing left to run (a strand waits for what never comes)")
            first = timers.first_when()
            if first > self._now:
                self._now = first
        timers.take_due(self._now, ready)
        for _ in range(len(ready)):
            try:
                ready.popleft()()
            except BaseException as exc:  # (a bug in a handler: the run stops on it)
                self.crashed(exc)
                return

    def close(self) -> None:
        self._timers.clear()
        self._ready.clear()

    def __getattr__(self, name: str) -> Any:
        # asyncio's loop methods (create_future, call_soon, ...) a coroutine reached for: said plainly
        raise AttributeError(f"the simulator's light loop has no {name}: it runs its own Waits and sleeps only")


def _nothing(_: Any) -> None:
    pass
