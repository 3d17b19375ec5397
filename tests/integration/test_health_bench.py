"""`router-bench health` runs end to end on fast probe settings (it times, it asserts no speed)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_health_benchmark_smoke() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "router.bench.cli",
            "health",
            "--json",
            "--replicas",
            "3",
            "--sessions",
            "6",
            "--busy",
            "12",
            "--busy-tokens",
            "100",
            "--warmup",
            "1",
            "--timeout",
            "60",
            "--setting",
            "probe_interval_s=0.1",
            "--setting",
            "recovery_ramp_s=0.5",
        ],
        capture_output=True,
        text=True,
        timeout=150,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["settings"]["probe_interval_s"] == 0.1
    assert result["seconds_to_remove"] > 0 and 0 < result["seconds_to_return"] <= result["seconds_to_full_weight"]
    states = [state for _, rid, state, _ in result["timeline"] if rid == "emu-1"]
    assert states[:1] == ["healthy"] and "removed" in states and states[-1] == "healthy"
    assert result["busy_replica_state_changes"] == 0  # busy is not sick
    assert result["requests_failed"] == 0 and result["requests_sent"] > 50


def test_bad_settings_are_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "router.bench.cli", "health", "--setting", "probe_interval_s=-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stdout.strip() == (
        "router-bench health: invalid setting 'probe_interval_s' (from --probe-interval-s): "
        "must be a positive number of seconds"
    )
