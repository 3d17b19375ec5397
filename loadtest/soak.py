"""Soak: N minutes of the locust sessions against `router-serve --demo`, with the router's memory.

    python loadtest/soak.py --minutes 10 --users 20 --out soak-results

Starts `router-serve --demo R` on a free loopback port (or uses `--host URL` and `--pid PID` of a
router already running), runs `loadtest/locustfile.py` headless for `--minutes`, and samples the
router's resident memory (RSS, from /proc, all its processes) every `--sample-s`. Writes
`soak.json` and prints one summary: requests and failures, P99 per minute (from locust's
history) and its drift from the first full minute to the last, and RSS at start, end and peak.
Exits 1 on any failed request.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    """Resident memory of `pid` and its children (the demo's emulators run in the router process)."""
    pids = [pid]
    with contextlib.suppress(OSError):
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def wait_up(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"soak: {url} did not come up within {timeout:g} s")


def p99_per_minute(history: Path, kind: str = "POST", name: str = "chat stream") -> list[float]:
    """The P99 (ms, whole streams) locust reported at the end of each minute of the run."""
    rows = [r for r in csv.DictReader(history.open()) if r.get("Type") == kind and r.get("Name") == name]
    if not rows:
        return []
    t0 = int(rows[0]["Timestamp"])
    by_minute: dict[int, float] = {}
    for r in rows:
        value = r.get("99%", "N/A")
        if value not in ("N/A", ""):
            by_minute[(int(r["Timestamp"]) - t0) // 60] = float(value)  # the minute's last report
    return [by_minute[m] for m in sorted(by_minute)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long (default 10)")
    p.add_argument("--users", type=int, default=20, help="locust users (default 20)")
    p.add_argument("--replicas", type=int, default=4, help="emulated replicas of the demo (default 4)")
    p.add_argument("--host", default=None, help="a router already running (default: start router-serve --demo)")
    p.add_argument("--pid", type=int, default=None, help="with --host: the router's pid, for its memory")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between memory samples (default 10)")
    p.add_argument("--out", default="soak-results", help="where soak.json and locust's CSV go")
    args = p.parse_args()
    if not (args.minutes > 0 and args.users > 0 and args.sample_s > 0):
        print("soak: --minutes, --users and --sample-s must be positive", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    router: subprocess.Popen[bytes] | None = None
    host, pid = args.host, args.pid
    if host is None:
        port = free_port()
        router = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "router.proxy.cli",
                "--demo",
                str(args.replicas),
                "--port",
                str(port),
                "--state",
                "none",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        host, pid = f"http://127.0.0.1:{port}", router.pid
    try:
        wait_up(host)
        locust = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "locust",
                "-f",
                str(HERE / "locustfile.py"),
                "--host",
                host,
                "--headless",
                "--users",
                str(args.users),
                "--spawn-rate",
                str(args.users),
                "--run-time",
                f"{int(args.minutes * 60)}s",
                "--only-summary",
                "--csv",
                str(out / "soak"),
                "--csv-full-history",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        memory: list[tuple[float, float]] = []
        t0 = time.monotonic()
        while locust.poll() is None:
            if pid is not None:
                memory.append((round(time.monotonic() - t0, 1), round(rss_mib(pid), 1)))
            with contextlib.suppress(subprocess.TimeoutExpired):
                locust.wait(timeout=args.sample_s)
        log = locust.stdout.read() if locust.stdout else ""
    finally:
        if router is not None:
            os.killpg(router.pid, signal.SIGTERM)
            router.wait(timeout=30)
    # real requests only: the "TTFT" rows are the streams' first-token times, not requests
    rows = [r for r in csv.DictReader((out / "soak_stats.csv").open()) if r["Type"] not in ("TTFT", "")]
    requests = sum(int(r["Request Count"]) for r in rows)
    failures = sum(int(r["Failure Count"]) for r in rows)
    p99 = p99_per_minute(out / "soak_stats_history.csv")
    full = p99[1:-1] or p99  # the first and last minutes are partial
    summary: dict[str, Any] = {
        "minutes": args.minutes,
        "users": args.users,
        "requests": requests,
        "failures": failures,
        "p99_ms_per_minute": p99,
        "p99_drift_ms": (full[-1] - full[0]) if full else None,
        "rss_mib": memory,
        "rss_start_mib": memory[0][1] if memory else None,
        "rss_end_mib": memory[-1][1] if memory else None,
        "rss_peak_mib": max((m for _, m in memory), default=None),
        "locust_exit": locust.returncode,
    }
    (out / "soak.json").write_text(json.dumps(summary, indent=1))
    print(
        f"soak: {args.minutes:g} min, {args.users} users: {requests} requests, {failures} failures; "
        f"P99 per minute (ms) {p99}; RSS {summary['rss_start_mib']} -> {summary['rss_end_mib']} MiB "
        f"(peak {summary['rss_peak_mib']})"
    )
    if locust.returncode not in (0, 1):
        print(log[-2000:], file=sys.stderr)
    return 0 if failures == 0 and locust.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
