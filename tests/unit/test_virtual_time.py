"""The simulator's light event loop on a virtual clock (router.bench.virtual_time)."""

from __future__ import annotations

import asyncio

import pytest

from router.bench.virtual_time import LightLoop


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
