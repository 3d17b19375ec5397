"""How every long-running command runs: on uvloop, until SIGINT or SIGTERM asks it to stop."""

from __future__ import annotations

import asyncio
import gc
import os
import resource
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import Any


class Stop(asyncio.Event):
    """Set by SIGINT or SIGTERM; `signal` says which came first."""

    signal: str = ""


def stop_event() -> Stop:
    """An event set by SIGINT or SIGTERM, from now on (instead of the default: dying at once)."""
    stop = Stop()
    loop = asyncio.get_running_loop()

    def received(sig: signal.Signals) -> None:
        stop.signal = stop.signal or sig.name
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, received, sig)
    return stop


async def until_stopped(stop: Stop | None = None) -> str:
    """Wait for SIGINT or SIGTERM (the caller then shuts down cleanly); the signal's name."""
    stop = stop or stop_event()
    await stop.wait()
    return stop.signal


OPEN_FILES = 1 << 20  # the soft limit raised no higher than this (an unlimited hard limit)


def raise_open_files() -> int:
    """Raise this process's soft limit on open files to its hard limit (at most OPEN_FILES) and return
    it: a router following a thousand replicas' KV events holds a few descriptors for each (its
    subscriber's connection, ZMQ's signalling), besides its clients' and replicas' connections, and
    a container's soft limit is often 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            return soft
        return want
    return soft


CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2: a number, or "max"
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1: a number (huge: none)
)


def memory_limit_bytes() -> int:
    """The memory this process may use: the host's, or its container's limit where one is less
    (a router pod is usually given one)."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < limit:
            limit = int(text)
    return limit


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` on uvloop (the design's event loop), or asyncio's where uvloop is missing."""
    try:
        import uvloop  # noqa: PLC0415 -- may be missing: then asyncio's loop runs it
    except ImportError:  # pragma: no cover - uvloop is a dependency
        asyncio.run(main)
        return
    uvloop.run(main)


# Collections of the youngest generation come after this many new objects rather than 700: a
# request makes a few hundred, and every collection stops the loop (measured at saturation on
# one CPU: P99 latency about 80 ms with the default, about 30 ms with this, P50 about 20 ms both).
GC_YOUNG = 50_000


def settle() -> None:
    """Once a serving process has started: what it built to start (the app, the ring, the index
    as loaded) is moved out of the collector's sight, and young collections come less often."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG, older, oldest)
