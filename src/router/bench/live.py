"""A benchmark while it runs: a progress line on stderr, and SIGINT/SIGTERM that stop it early.

Progress: on a terminal, one line rewritten in place every second or so; on anything else,
nothing, so that test output and CI logs stay quiet. `ROUTER_BENCH_PROGRESS=N` prints a plain
line every N seconds on any stream (N = 0: never, even on a terminal). Progress goes to stderr
only: `--json` on stdout stays one clean object.

Stopping: the first SIGINT or SIGTERM sets an event the run watches; the run cuts off what is
in flight, and the command prints what it measured so far, marked partial with how long it ran,
and exits 128 + the signal (130, 143). A second signal ends the process at once, as the signal
would have without this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TextIO

PROGRESS_ENV = "ROUTER_BENCH_PROGRESS"
TICK_S = 1.0  # how often a running benchmark describes itself
IN_PLACE_EVERY_S = 0.2  # a terminal's line is rewritten at most this often
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Progress:
    """Where a benchmark's progress goes: rewritten in place on a terminal, plain lines every
    `ROUTER_BENCH_PROGRESS` seconds when that is set, or nowhere."""

    def __init__(self, stream: TextIO | None = None, environ: dict[str, str] | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        setting = (environ if environ is not None else os.environ).get(PROGRESS_ENV, "").strip()
        self.in_place = False
        self.every_s = 0.0
        if setting:
            try:
                self.every_s = max(float(setting), 0.0)
            except ValueError:
                self.every_s = 0.0
        elif _isatty(self.stream):
            self.in_place, self.every_s = True, IN_PLACE_EVERY_S
        self._last = time.monotonic() if not self.in_place else 0.0
        self._shown = False

    @property
    def enabled(self) -> bool:
        return self.every_s > 0

    def show(self, msg: str) -> None:
        """The line of progress, if it is time for one."""
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        if self.in_place:
            print(f"\r\x1b[K  {msg}", end="", file=self.stream, flush=True)
            self._shown = True
        else:
            print(f"  {msg}", file=self.stream, flush=True)

    def clear(self) -> None:
        """Erase the in-place line (before a line that stays, or the results)."""
        if self._shown:
            print("\r\x1b[K", end="", file=self.stream, flush=True)
            self._shown = False

    def note(self, msg: str) -> None:
        """A line that stays, whatever the mode (a run's figures as it ends, a plan up front)."""
        self.clear()
        print(msg, file=self.stream, flush=True)

    @contextlib.asynccontextmanager
    async def ticking(self, describe: Callable[[], str]) -> AsyncIterator[None]:
        """While the block runs, `describe()` is shown every TICK_S (so a run that answers
        nothing for a while still says where it stands); the line is erased after."""
        if not self.enabled:
            yield
            return

        async def tick() -> None:
            while True:
                await asyncio.sleep(min(TICK_S, self.every_s))
                self.show(describe())

        task = asyncio.ensure_future(tick())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.wait([task])
            self.clear()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or not a real stream
        return False


@dataclass(frozen=True)
class Stopped:
    """A run that a signal ended early."""

    signum: int
    after_s: float

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # 130 for SIGINT, 143 for SIGTERM: what a shell reports

    def mark(self, result: dict[str, Any]) -> dict[str, Any]:
        """`result`, marked partial (the JSON's `partial` key)."""
        result["partial"] = {"stopped_by": self.name, "after_s": round(self.after_s, 1)}
        return result


def partial_headline(result: dict[str, Any]) -> str:
    """The line a partial result's table opens with."""
    p = result["partial"]
    return f"PARTIAL: stopped by {p['stopped_by']} after {p['after_s']:g} s; what was measured until then"


class Stop:
    """The first SIGINT or SIGTERM once installed: remembered, and an event a run can wait on.
    Install it inside the running loop; uninstall before the loop ends."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.event = asyncio.Event()
        self.signum: int | None = None
        self.started = time.monotonic()
        self._stream = stream if stream is not None else sys.stderr
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> Stop:
        self._loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            self._loop.add_signal_handler(sig, self._signalled, sig)
        return self

    def uninstall(self) -> None:
        if self._loop is not None:
            for sig in SIGNALS:
                self._loop.remove_signal_handler(sig)
            self._loop = None

    def _signalled(self, sig: int) -> None:
        if self.signum is not None:  # a second one: end now, as the signal would have
            self.uninstall()
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
            return
        self.signum = sig
        self.event.set()
        print(
            f"\r\x1b[K{signal.Signals(sig).name}: stopping; the results so far follow (again to quit at once)"
            if _isatty(self._stream)
            else f"{signal.Signals(sig).name}: stopping; the results so far follow",
            file=self._stream,
            flush=True,
        )

    @property
    def stopped(self) -> Stopped | None:
        if self.signum is None:
            return None
        return Stopped(self.signum, time.monotonic() - self.started)


async def run_until(work: Awaitable[Any], stop: asyncio.Event, deadline: float | None = None) -> bool:
    """Run `work` until it ends, `stop` is set or the monotonic `deadline` passes; in the last two
    cases it is cancelled (its cleanup runs) and awaited. True when it ran to its end. Its own
    exceptions propagate."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    try:
        await asyncio.wait([task, stopping], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not task.done():
            task.cancel()
        await asyncio.wait([task, stopping])
    if task.cancelled():
        return False
    task.result()  # its exception, if any
    return True
