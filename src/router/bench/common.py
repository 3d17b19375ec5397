"""What the benchmarks that drive an in-process fleet share: settings from the command line, and
running one measurement to a result (or to one readable error line, or, stopped by a signal, to
what it measured until then)."""

from __future__ import annotations

import argparse
import math
import random
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
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


def positive_float(text: str) -> float:
    """An argparse type: a positive, finite number."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed: set[int] = set()  # ports this process has handed out: never twice


def free_port(n: int = 1) -> int:
    """The first of `n` consecutive loopback ports that nobody holds now, below the kernel's
    ephemeral range where there is room: a port from that range, free when asked, may be taken
    by any process's next outgoing connection or port-0 bind before its server binds it (five
    vLLM engines starting at once here had one API server's port taken by another's engine core)."""
    rng = random.Random()
    try:
        ephemeral = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768  # Linux's default
    low, high = 10000, ephemeral - n
    for _ in range(500 if high > low else 0):
        base = rng.randrange(low, high)
        ports = range(base, base + n)
        if any(port in _handed for port in ports):
            continue
        if all(_bindable(port) for port in ports):
            _handed.update(ports)
            return base
    for _ in range(50):  # no room below the range: the kernel's choice, and the ports after it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n <= 65536 and all(_bindable(port) for port in range(base + 1, base + n)):
            return base
    raise RuntimeError(f"no {n} consecutive free loopback ports found")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


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
