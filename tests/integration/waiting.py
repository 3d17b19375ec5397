"""Waiting for a condition in the integration tests, instead of sleeping for a guessed while
(imported as `waiting`, as `chat` is)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def until(check: Callable[[], Any | Awaitable[Any]], what: str, timeout: float = 5.0, every: float = 0.02) -> Any:
    """Ask `check` (a function, or one returning an awaitable) every `every` seconds until it
    returns something true, and return that. Past `timeout` seconds: AssertionError naming
    `what` was awaited, and the last answer."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout} s: {what} (last: {value!r})")
        await asyncio.sleep(every)


async def took(check: Callable[[], Any | Awaitable[Any]], what: str, timeout: float = 5.0) -> float:
    """How long `until(check, what, timeout)` waited, in seconds."""
    start = time.monotonic()
    await until(check, what, timeout)
    return time.monotonic() - start


async def probe_rounds(node: Any, n: int = 2, timeout: float = 5.0) -> None:
    """Wait for `n` more of a router's health probe rounds (router.monitor): what the engines said
    after now (their queues, their models) is known to it."""
    start = node.monitor.rounds
    await until(lambda: node.monitor.rounds >= start + n, f"{n} probe rounds", timeout)
