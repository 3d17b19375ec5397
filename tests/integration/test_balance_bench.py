"""`router-bench balance` runs end to end on tiny settings (it measures; it asserts behaviour, not speed)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_balance_benchmark_smoke() -> None:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "router.bench.cli", "balance", "--json"),
            *("--replicas", "3", "--sessions", "8", "--hot", "1", "--hot-streams", "4", "--duration", "5"),
            *("--setting", "rebalance_window_s=1", "--setting", "rebalance_cooldown_s=2"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert [row["rebalance"] for row in result["skew"]] == [False, True]
    assert result["skew"][0]["vnodes_moved"] == 0  # rebalancing off moves nothing
    assert [row["warmup"] for row in result["scale_out"]] == [False, True]
    for row in result["skew"] + result["scale_out"]:
        assert row["failed"] == 0
    drain = result["drain"]
    assert drain["failed"] == drain["cut_streams"] == 0 and drain["removed_after_s"] is not None
