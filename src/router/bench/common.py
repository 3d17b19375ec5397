"""What the benchmarks that drive an in-process fleet share: settings from the command line, and
running one measurement to a result (or to one readable error line, or, stopped by a signal, to
what it measured until then)."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from router._runtime import run as run_loop
from router.bench.live import Stop, Stopped, run_until
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


def measure(
    command: str, run: Callable[[dict[str, Any]], Awaitable[object]]
) -> tuple[dict[str, Any] | None, Stopped | None]:
    """Run a measurement on the router's event loop; `run` fills the dict it is given as it goes.
    SIGINT or SIGTERM cancel it (its cleanup runs) and the dict comes back as it stands, with the
    signal (print it marked partial, exit with `Stopped.exit_status`). On bad settings or a failed
    run, print one line (`router-bench COMMAND: ...`) and return None for the dict."""
    out: dict[str, Any] = {}
    stopped: list[Stopped | None] = [None]

    async def main() -> None:
        stop = Stop().install()
        try:
            await run_until(run(out), stop.event)
        finally:
            stop.uninstall()
            stopped[0] = stop.stopped

    try:
        run_loop(main())
    except (ConfigError, ValueError, RuntimeError, TimeoutError) as exc:
        print(f"router-bench {command}: {exc}", flush=True)
        return None, stopped[0]
    return out, stopped[0]
