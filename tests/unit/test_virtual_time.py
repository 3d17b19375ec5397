"""The simulator's light event loop on a virtual clock (router.bench.virtual_time), and its timers
in order (`_timers`, compiled, and its twin router/_timers_py.py)."""

from __future__ import annotations

import asyncio
import random
import weakref
from collections import deque
from types import ModuleType
from typing import Any

import pytest
from twins import implementations

from router import _timers_py
from router.bench.virtual_time import LightLoop

TIMERS = implementations("_timers", _timers_py)


def test_time_jumps_to_each_timer_in_order_and_passes_no_wall_time() -> None:
    loop = LightLoop()
    seen: list[tuple[float, str]] = []

    async def after(delay: float, name: str) -> str:
        await loop.sleep(delay)
        seen.append((loop.time(), name))
        return name

    loop.call_at(7.5, lambda _: seen.append((loop.time(), "timer")))
    strands = [loop.spawn(after(3600.0, "hour")), loop.spawn(after(2.0, "two")), loop.spawn(after(0.0, "now"))]
    loop.run(until=lambda: all(s.done for s in strands))  # an hour of virtual time, in no real time
    assert seen == [(0.0, "now"), (2.0, "two"), (7.5, "timer"), (3600.0, "hour")]
    assert [s.result() for s in strands] == ["hour", "two", "now"]
    loop.close()


def test_a_strand_awaits_a_wait_and_other_coroutines_and_reads_the_clock_as_the_running_loop() -> None:
    loop = LightLoop()
    answer = loop.wait()

    async def inner() -> float:
        value = await answer  # set by a timer at 5 s
        return value + asyncio.get_running_loop().time()  # (the journey reads its deadlines so)

    async def outer() -> float:
        return await inner() * 2

    loop.call_at(5.0, answer.set, 1.0)
    strand = loop.spawn(outer())
    assert loop.run_until_done(strand) == 12.0
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()  # the loop is the running one only while it runs
    with pytest.raises(RuntimeError, match="set once"):
        answer.set(2.0)
    loop.close()


def test_a_wait_that_nothing_will_set_is_an_error_not_a_hang() -> None:
    loop = LightLoop()

    async def forever() -> None:
        await loop.wait()

    strand = loop.spawn(forever())
    with pytest.raises(RuntimeError, match="nothing left to run"):
        loop.run_until_done(strand)
    loop.close()


def test_awaiting_what_the_loop_cannot_run_stops_the_run_with_a_clear_error() -> None:
    loop = LightLoop()

    async def wrong() -> None:
        await asyncio.sleep(1.0)  # an asyncio sleep: it asks for a loop this one is not

    strand = loop.spawn(wrong())
    with pytest.raises(AttributeError, match="light loop has no create_future"):
        loop.run_until_done(strand)
    assert strand.done and strand.error is not None

    loop = LightLoop()
    future: asyncio.Future[None] = asyncio.new_event_loop().create_future()

    async def alien() -> None:
        await future

    strand = loop.spawn(alien())
    with pytest.raises(RuntimeError, match="only its own Waits"):
        loop.run_until_done(strand)


def test_a_callback_or_strand_that_raises_stops_the_run_with_its_error() -> None:
    loop = LightLoop()
    loop.call_at(1.0, lambda _: 1 / 0)
    loop.call_at(2.0, lambda _: pytest.fail("the run went on past the error"))
    with pytest.raises(ZeroDivisionError):
        loop.run(until=lambda: False)
    assert loop.time() == 1.0

    loop = LightLoop()

    async def broken() -> None:
        await loop.sleep(3.0)
        raise KeyError("a bug")

    strand = loop.spawn(broken())
    with pytest.raises(KeyError, match="a bug"):
        loop.run(until=lambda: False)
    with pytest.raises(KeyError):
        strand.result()


def test_timers_due_at_one_time_run_in_the_order_set_and_cancelled_ones_never() -> None:
    loop = LightLoop()
    seen: list[str] = []
    for name in "abcdefgh":
        loop.call_at(5.0, seen.append, name)
    loop.call_at(5.0, seen.append, "cancelled").cancel()
    loop.call_at(1.0, seen.append, "early")
    later = []
    loop.call_at(9.0, lambda _: later[0].cancel())  # set first, so it runs first: in the turn both fall due
    later.append(loop.call_at(9.0, seen.append, "late, cancelled"))
    loop.run_until(9.0)
    assert seen == ["early", *"abcdefgh"]
    assert loop.time() == 9.0
    loop.close()


def test_turns_run_in_asyncios_order() -> None:
    """A strand woken by a Wait goes on in the next turn, and a sleep's strand a turn after its
    timer: the order asyncio's tasks and futures run in, which the simulator's figures replay."""

    def order(light: bool) -> list[str]:
        seen: list[str] = []
        if light:
            loop = LightLoop()
            sleep, wait, spawn = loop.sleep, loop.wait, loop.spawn
        else:
            aloop = asyncio.new_event_loop()
            sleep, wait, spawn = asyncio.sleep, aloop.create_future, aloop.create_task  # type: ignore[assignment]
        gate = wait()

        async def sleeper(name: str, delay: float) -> None:
            seen.append(f"{name} starts")
            await sleep(delay)
            seen.append(f"{name} woke")

        async def waiter() -> None:
            seen.append("waiter starts")
            await gate
            seen.append("waiter woke")

        async def opener() -> None:
            seen.append("opener starts")
            await sleep(0)
            (gate.set if light else gate.set_result)(None)  # type: ignore[attr-defined]
            seen.append("opener set")

        strands = [spawn(sleeper("a", 0)), spawn(waiter()), spawn(opener()), spawn(sleeper("b", 0))]
        if light:
            loop.run(until=lambda: all(s.done for s in strands))  # type: ignore[attr-defined]
        else:
            aloop.run_until_complete(asyncio.gather(*strands))  # type: ignore[arg-type]
            aloop.close()
        return seen

    assert order(light=True) == order(light=False)


class Due:
    """A timer as the heap sees one: a name and whether it was cancelled."""

    def __init__(self, name: Any) -> None:
        self.name = name
        self.cancelled = False

    def __repr__(self) -> str:
        return f"Due({self.name!r})"


@pytest.mark.parametrize("impl", TIMERS.values(), ids=list(TIMERS))
def test_timers_come_out_by_time_then_in_the_order_pushed_whatever_the_order_in(impl: ModuleType) -> None:
    """Pushes and takes interleaved, with times tied often, some in the past, and some cancelled:
    each take gives what a sort by (when, order pushed) gives, the cancelled left out."""
    rng = random.Random(7)
    heap = impl.TimerHeap()
    waiting: list[tuple[float, int, Due]] = []  # what a sorted list says is there
    pushed = 0
    now = 0.0
    for step in range(3000):
        if rng.random() < 0.6:
            # times on a coarse grid tie often; a few lie before now (due at once)
            when = now + rng.choice((-1.0, 0.0, 0.5, 1.0, 1.5, 7.25)) * rng.randint(0, 3)
            timer = Due(step)
            heap.push(when, timer)
            waiting.append((when, pushed, timer))
            pushed += 1
            if rng.random() < 0.1:
                rng.choice(waiting)[2].cancelled = True
        else:
            now += rng.choice((0.0, 0.5, 1.0, 3.0))
            got: deque[Due] = deque()
            heap.take_due(now, got)
            waiting.sort(key=lambda w: (w[0], w[1]))
            due = [w for w in waiting if w[0] <= now]
            waiting = waiting[len(due) :]
            assert list(got) == [t for _, _, t in due if not t.cancelled]
        assert len(heap) == len(waiting)
        if waiting:
            heap.drop_cancelled()
            waiting.sort(key=lambda w: (w[0], w[1]))
            while waiting and waiting[0][2].cancelled:
                waiting.pop(0)
            assert len(heap) == len(waiting)
            if waiting:
                assert heap.first_when() == waiting[0][0]
    heap.clear()
    assert len(heap) == 0
    with pytest.raises(IndexError):
        heap.first_when()
    heap.push(1.0, Due("after a clear"))
    into: deque[Due] = deque()
    heap.take_due(1.0, into)
    assert [t.name for t in into] == ["after a clear"]


@pytest.mark.parametrize("impl", TIMERS.values(), ids=list(TIMERS))
def test_the_heap_lets_go_of_each_timer_it_gives_out(impl: ModuleType) -> None:
    """A timer taken out, cancelled and dropped, or cleared is no longer held (a million sessions'
    timers would otherwise stay alive)."""
    heap = impl.TimerHeap()
    timers = [Due(i) for i in range(5)]
    refs = [weakref.ref(t) for t in timers]
    for i, timer in enumerate(timers):
        heap.push(float(i), timer)
    timers[0].cancelled = True
    into: deque[Due] = deque()
    heap.drop_cancelled()
    heap.take_due(2.0, into)
    del timers, timer
    assert [r() is None for r in refs] == [True, False, False, False, False]  # 1 and 2 are in `into`
    into.clear()
    assert [r() is None for r in refs] == [True, True, True, False, False]
    heap.clear()
    assert all(r() is None for r in refs)
