"""`router-bench adapters` runs end to end on a short schedule (it counts; it asserts no speed)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_adapters_benchmark_smoke() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "router.bench.cli",
            "adapters",
            "--json",
            "--replicas",
            "2",
            "--adapters",
            "6",
            "--max-loras",
            "1",
            "--rate",
            "6",
            "--duration-s",
            "3",
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    result = json.loads(out.stdout)
    runs = {r["contender"]: r for r in result["runs"]}
    assert set(runs) == {"ttft", "ttft-blind", "affinity", "round-robin"}
    for r in runs.values():
        assert r["sent"] > 0 and r["failed"] == 0 and r["ttft_p50_s"] is not None
        # six adapters over two slots: every contender pages some in; none can avoid them all
        assert 0 < r["loads_per_100"] <= 100


def test_bad_arguments_are_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "router.bench.cli", "adapters", "--max-loras", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.strip() == "router-bench adapters: --max-loras must be at least 1"
