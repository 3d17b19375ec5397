"""A short headless locust run of loadtest/locustfile.py against router-serve --demo: no errors."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

from demo import running_demo

ROOT = Path(__file__).resolve().parents[2]


def test_locust_sessions_against_the_demo_have_no_errors(tmp_path: Path) -> None:
    with running_demo(2) as (port, _):
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
    assert run.returncode == 0, run.stderr[-2000:]  # locust exits 1 on any failed request
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader((tmp_path / "run_stats.csv").open())}
    streamed = rows[("POST", "chat stream")]
    assert int(streamed["Request Count"]) >= 5 and int(streamed["Failure Count"]) == 0
    ttft = rows[("TTFT", "chat stream")]
    assert int(ttft["Request Count"]) == int(streamed["Request Count"])
    # a stream's time covers the whole stream, so it is never shorter than its time to first token
    assert float(streamed["Average Response Time"]) >= float(ttft["Average Response Time"])
    assert "0 failures" in run.stdout + run.stderr
