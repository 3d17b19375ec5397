"""Token budgets on the in-process store, on a clock the tests move, and the admission estimate."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.tenancy.budgets import Budgets, LocalStore, Refusal, Reservation, estimate

PER_MINUTE = 6000  # 100 tokens a second
T = TypeVar("T")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def at_once(coro: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never suspends, as the local store's never do."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    raise AssertionError("the local store waited on something")


def make(limits: dict[str, int] | None = None) -> tuple[Budgets, LocalStore, Clock]:
    clock = Clock()
    store = LocalStore(clock)
    return Budgets({"acme": PER_MINUTE} if limits is None else limits, store, reserve_tokens=100), store, clock


async def test_takes_while_there_is_enough_then_says_how_long_to_wait() -> None:
    budgets, store, _ = make()
    assert await budgets.reserve("acme", 2500) == Reservation("acme", 2500)
    assert await budgets.reserve("acme", 3500) == Reservation("acme", 3500)
    assert await budgets.reserve("acme", 250) == 3  # 250 tokens at 100 a second
    assert await budgets.reserve("acme", 1) == 1  # never less than a second
    assert store.buckets["acme"][0] == 0  # a refusal takes nothing


async def test_refills_over_time_up_to_capacity() -> None:
    budgets, store, clock = make()
    await budgets.reserve("acme", 6000)
    clock.now += 2.5
    assert await budgets.reserve("acme", 300) == 1
    assert await budgets.reserve("acme", 250) == Reservation("acme", 250)
    clock.now += 3600
    assert await budgets.reserve("acme", 1) == Reservation("acme", 1)
    assert store.buckets["acme"][0] == PER_MINUTE - 1


async def test_settle_refunds_what_was_not_used() -> None:
    budgets, store, _ = make()
    reservation = await budgets.reserve("acme", 2500)
    assert isinstance(reservation, Reservation)
    assert await budgets.reserve("acme", 4000) == 5
    budgets.settle_now(reservation, 1500)
    assert store.buckets["acme"][0] == 4500
    assert await budgets.reserve("acme", 4000) == Reservation("acme", 4000)


async def test_settle_charges_what_was_used_beyond_the_reservation() -> None:
    budgets, store, _ = make()
    reservation = await budgets.reserve("acme", 1000)
    assert isinstance(reservation, Reservation)
    budgets.settle_now(reservation, 8000)
    assert store.buckets["acme"][0] == -2000
    assert await budgets.reserve("acme", 100) == 21


async def test_unknown_usage_keeps_the_reservation_charged() -> None:
    budgets, store, _ = make()
    reservation = await budgets.reserve("acme", 1000)
    assert isinstance(reservation, Reservation)
    budgets.settle_now(reservation, None)
    assert store.buckets["acme"][0] == 5000


async def test_a_refund_never_fills_beyond_capacity() -> None:
    budgets, store, clock = make()
    reservation = await budgets.reserve("acme", 3000)
    assert isinstance(reservation, Reservation)
    clock.now += 60
    budgets.settle_now(reservation, 0)
    assert store.buckets["acme"][0] == PER_MINUTE


async def test_a_request_larger_than_the_budget_passes_only_from_a_full_bucket() -> None:
    budgets, store, clock = make()
    await budgets.reserve("acme", 1)
    assert await budgets.reserve("acme", 10_000) == 1  # it needs the bucket full: one token short
    clock.now += 1
    assert await budgets.reserve("acme", 10_000) == Reservation("acme", 10_000)
    assert store.buckets["acme"][0] == -4000
    assert await budgets.reserve("acme", 10_000) == 100  # 10 000 refilled the bucket to full


async def test_a_tenant_without_a_budget_passes_and_settles_to_nothing() -> None:
    budgets, store, _ = make()
    reservation = await budgets.reserve("other", 10**9)
    assert reservation == Reservation("other", 10**9, charged=False)
    assert not budgets.limited("other") and budgets.limited("acme")
    budgets.settle_now(reservation, 10**9)
    assert store.buckets == {}


async def test_update_keeps_the_levels_of_tenants_that_remain() -> None:
    budgets, store, _ = make({"acme": PER_MINUTE, "gone": 600})
    held = await budgets.reserve("gone", 100)
    await budgets.reserve("acme", 5000)
    budgets.update({"acme": 2 * PER_MINUTE, "new": 60})
    assert await budgets.reserve("acme", 1000) == Reservation("acme", 1000)
    assert await budgets.reserve("acme", 100) == 1  # empty: the level was kept, not refilled to the new limit
    assert not budgets.limited("gone")
    assert isinstance(held, Reservation)
    budgets.settle_now(held, 0)  # its tenant lost its budget: nothing to give back to
    assert store.buckets["gone"][0] == 500


async def test_a_lowered_limit_clamps_the_level() -> None:
    budgets, store, _ = make()
    budgets.update({"acme": 600})
    assert await budgets.reserve("acme", 600) == Reservation("acme", 600)
    assert store.buckets["acme"][0] == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "100"])
def test_limits_are_positive_integers(bad: object) -> None:
    with pytest.raises(ValueError, match="acme"):
        Budgets({"acme": bad}, reserve_tokens=100)  # type: ignore[dict-item]


@settings(max_examples=200, deadline=None)
@given(
    per_minute=st.integers(1, 100_000),
    steps=st.lists(
        st.tuples(st.floats(0, 5), st.floats(0, 2), st.one_of(st.none(), st.floats(0, 1))), min_size=1, max_size=40
    ),
)
def test_never_above_capacity_nor_more_granted_than_capacity_and_refill(
    per_minute: int, steps: list[tuple[float, float, float | None]]
) -> None:
    """Each step: wait, ask for up to twice the capacity, settle at most at what was reserved."""
    budgets, store, clock = make({"t": per_minute})
    start = clock.now
    granted = 0
    biggest = 0
    for wait_s, share, used_share in steps:
        clock.now += wait_s
        tokens = int(share * per_minute)
        biggest = max(biggest, tokens)
        reservation = at_once(budgets.reserve("t", tokens))
        if isinstance(reservation, Reservation):
            used = tokens if used_share is None else int(used_share * tokens)
            budgets.settle_now(reservation, used)
            granted += used
        else:
            assert reservation >= 1
        assert store.buckets["t"][0] <= per_minute
    # a grant leaves the level at least 0, or capacity - tokens from a full bucket
    refill = (clock.now - start) * per_minute / 60
    assert granted <= per_minute + refill + max(0, biggest - per_minute) + 1e-6 * per_minute


@pytest.mark.parametrize(
    ("body", "raw_size", "expected"),
    [
        ({"messages": []}, 400, 100 + 256),  # no cap: the default
        ({"max_completion_tokens": 50, "max_tokens": 70}, 401, 101 + 50),  # a byte more is a token more
        ({"max_completion_tokens": None, "max_tokens": 70}, 400, 100 + 70),
        ({"max_tokens": True, "max_output_tokens": 30}, 400, 100 + 30),  # a bool is no count
        ({"max_tokens": 0, "max_output_tokens": "9"}, 400, 100 + 256),
        ({"max_tokens": 12.0}, 400, 100 + 256),
        ({"max_tokens": 100, "n": 3}, 400, 100 + 300),  # each choice completes, the prompt is read once
        ({"max_tokens": 100, "n": 1}, 0, 100),
        ({"n": True}, 0, 256),
    ],
)
def test_estimate(body: dict[str, object], raw_size: int, expected: int) -> None:
    assert estimate(body, raw_size, 256) == expected


@pytest.mark.parametrize("awaited", [False, True])
async def test_admission_reserves_the_estimate_or_says_why_not_alike_awaited_or_not(awaited: bool) -> None:
    budgets, _, clock = make()

    def admit(body: dict[str, Any], raw_size: int) -> Reservation | Refusal:
        if awaited:
            return at_once(budgets.admit("acme", body, raw_size))
        return budgets.admit_now("acme", body, raw_size)

    # its own cap is more than the whole budget: it could never fit, waiting would not help
    never = admit({"max_tokens": PER_MINUTE + 1}, 40)
    assert isinstance(never, Refusal) and (never.reason, never.retry_after_s) == ("exceeds_budget", 0)
    assert f"{PER_MINUTE + 1} completion tokens" in never.message
    # it fits: its prompt's estimate (from its size) and its cap are reserved
    fits = admit({"max_tokens": 4000}, 400)
    assert isinstance(fits, Reservation) and (fits.tokens, fits.prompt) == (4100, 100)
    # the budget is spent for now: the seconds until what it asks for has refilled ((4100 - 1900) / 100)
    spent = admit({"max_tokens": 4000}, 400)
    assert isinstance(spent, Refusal) and spent.reason == "budget" and spent.retry_after_s == 22
    clock.now += 21
    assert isinstance(admit({"max_tokens": 4000}, 400), Refusal)
    clock.now += 1
    assert isinstance(admit({"max_tokens": 4000}, 400), Reservation)
