"""`router-serve --demo` as a child process, for tests that drive it from outside (locust, fuzzing)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from router.bench.common import free_port


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def running_demo(replicas: int, *extra: str, log: Path | None = None) -> Iterator[tuple[int, int]]:
    """(port, pid) of `router-serve --demo REPLICAS --state none EXTRA...` on loopback, once /health
    answers 200; stopped with its process group on the way out. `log`: where its output goes."""
    port = free_port()
    out = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "router.proxy.cli",
            "--demo",
            str(replicas),
            "--port",
            str(port),
            "--state",
            "none",
            *extra,
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    if log is not None:
        out.close()  # type: ignore[union-attr]
    try:
        deadline = time.monotonic() + 30
        while not _healthy(port):
            assert time.monotonic() < deadline and proc.poll() is None, "router-serve --demo did not come up"
            time.sleep(0.2)
        yield port, proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
