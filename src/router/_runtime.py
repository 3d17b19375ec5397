"""How every long-running command runs: on uvloop, until SIGINT or SIGTERM asks it to stop."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM, from now on (instead of the default: dying at once)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def until_stopped(stop: asyncio.Event | None = None) -> None:
    """Wait for SIGINT or SIGTERM (the caller then shuts down cleanly)."""
    await (stop or stop_event()).wait()


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` on uvloop (the design's event loop), or asyncio's where uvloop is missing."""
    try:
        import uvloop  # noqa: PLC0415 -- may be missing: then asyncio's loop runs it
    except ImportError:  # pragma: no cover - uvloop is a dependency
        asyncio.run(main)
        return
    uvloop.run(main)
