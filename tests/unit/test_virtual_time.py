"""The simulator's asyncio loop on a virtual clock (router.bench.virtual_time)."""

from __future__ import annotations

import asyncio

import pytest

from router.bench.virtual_time import VirtualLoop


def test_time_jumps_to_each_timer_in_order_and_passes_no_wall_time() -> None:
    loop = VirtualLoop()
    seen: list[tuple[float, str]] = []

    async def after(delay: float, name: str) -> None:
        await asyncio.sleep(delay)
        seen.append((loop.time(), name))

    async def main() -> None:
        loop.call_at(7.5, lambda: seen.append((loop.time(), "timer")))
        await asyncio.gather(after(3600.0, "hour"), after(2.0, "two"), after(0.0, "now"))

    loop.run_until_complete(main())  # an hour of virtual time (in real time this test would take it)
    assert seen == [(0.0, "now"), (2.0, "two"), (7.5, "timer"), (3600.0, "hour")]
    loop.close()


def test_a_wait_that_nothing_will_end_is_an_error_not_a_hang() -> None:
    loop = VirtualLoop()
    never = loop.create_future()
    with pytest.raises(RuntimeError, match="nothing left to run"):
        loop.run_until_complete(never)
    loop.close()


def test_timeouts_fire_on_the_virtual_clock() -> None:
    loop = VirtualLoop()

    async def main() -> float:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(100.0), timeout=30.0)
        return loop.time()

    assert loop.run_until_complete(main()) == pytest.approx(30.0)
    loop.close()


def test_timers_due_at_one_time_run_in_the_order_set_and_cancelled_ones_never() -> None:
    loop = VirtualLoop()
    seen: list[str] = []
    for name in "abcdefgh":
        loop.call_at(5.0, seen.append, name)
    loop.call_at(5.0, seen.append, "cancelled").cancel()
    loop.call_later(1.0, seen.append, "early")
    later: list[asyncio.TimerHandle] = []
    loop.call_at(9.0, lambda: later[0].cancel())  # set first, so it runs first: in the turn both fall due
    later.append(loop.call_at(9.0, seen.append, "late, cancelled"))
    loop.call_at(9.0, loop.stop)
    loop.run_forever()
    assert seen == ["early", *"abcdefgh"]
    assert loop.time() == 9.0
    loop.close()


def test_a_cancelled_timer_alone_does_not_keep_the_clock_going() -> None:
    loop = VirtualLoop()

    async def main() -> None:
        loop.call_at(50.0, lambda: None).cancel()
        await asyncio.sleep(0)

    loop.run_until_complete(main())
    never = loop.create_future()
    with pytest.raises(RuntimeError, match="nothing left to run"):
        loop.run_until_complete(never)
    assert loop.time() == 0.0  # the cancelled timer's time never came
    loop.close()
