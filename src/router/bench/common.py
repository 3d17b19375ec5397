"""What the benchmarks that drive an in-process fleet share: settings from the command line, and
running one measurement to a result (or to one readable error line)."""

from __future__ import annotations

import argparse
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from router._runtime import run as run_loop
from router.config import ConfigError


def positive_int(text: str) -> int:
    """An argparse type: a positive integer, `_` and `,` allowed as digit separators."""
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_settings(entries: list[str]) -> dict[str, str]:
    """`--setting NAME=VALUE` entries as router settings; ValueError names a malformed one."""
    settings = {}
    for entry in entries:
        name, sep, value = entry.partition("=")
        if not sep or not name:
            raise ValueError(f"--setting {entry!r} is not NAME=VALUE")
        settings[name] = value
    return settings


def measure(command: str, run: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any] | None:
    """Run a measurement on the router's event loop; on bad settings or a failed run, print one
    line (`router-bench COMMAND: ...`) and return None."""
    out: dict[str, Any] = {}

    async def main() -> None:
        out.update(await run())

    try:
        run_loop(main())
    except (ConfigError, ValueError, RuntimeError, TimeoutError) as exc:
        print(f"router-bench {command}: {exc}", flush=True)
        return None
    return out


def progress_line(every_s: float = 0.2) -> Callable[[str], None]:
    """A progress line on stderr, rewritten in place at most every `every_s` seconds (for a terminal)."""
    last = [0.0]

    def show(msg: str) -> None:
        now = time.monotonic()
        if now - last[0] > every_s:
            last[0] = now
            print(f"\r\x1b[K  {msg}", end="", file=sys.stderr, flush=True)

    return show
