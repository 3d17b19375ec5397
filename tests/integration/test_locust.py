"""A short headless locust run of loadtest/locustfile.py against router-serve --demo: no errors."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from router.bench.common import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_locust_sessions_against_the_demo_have_no_errors(tmp_path: Path) -> None:
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "router.proxy.cli", "--demo", "2", "--port", str(port), "--state", "none"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "router-serve --demo did not come up"
            time.sleep(0.2)
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "locust",
                "-f",
                str(ROOT / "loadtest" / "locustfile.py"),
                "--host",
                f"http://127.0.0.1:{port}",
                "--headless",
                "--users",
                "4",
                "--spawn-rate",
                "4",
                "--run-time",
                "6s",
                "--think-min",
                "0.1",
                "--think-max",
                "0.3",
                "--only-summary",
                "--csv",
                str(tmp_path / "run"),
            ],
            capture_output=True,
            text=True,
            timeout=90,
            cwd=tmp_path,
        )
    finally:
        os.killpg(router.pid, signal.SIGTERM)
        router.wait(timeout=20)
    assert run.returncode == 0, run.stderr[-2000:]  # locust exits 1 on any failed request
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader((tmp_path / "run_stats.csv").open())}
    streamed = rows[("POST", "chat stream")]
    assert int(streamed["Request Count"]) >= 5 and int(streamed["Failure Count"]) == 0
    ttft = rows[("TTFT", "chat stream")]
    assert int(ttft["Request Count"]) == int(streamed["Request Count"])
    # a stream's time covers the whole stream, so it is never shorter than its time to first token
    assert float(streamed["Average Response Time"]) >= float(ttft["Average Response Time"])
    assert "0 failures" in run.stdout + run.stderr
