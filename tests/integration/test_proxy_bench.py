"""`router-bench proxy` runs end to end (a tiny run: it measures, it asserts no speed)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_proxy_benchmark_smoke() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "router.bench.cli",
            "proxy",
            "--json",
            "--no-peers",
            "--requests",
            "40",
            "--streams",
            "8",
            "--tokens",
            "5",
            "--ttft-samples",
            "10",
            "--rounds",
            "1",
            "--concurrency",
            "4",
            "--against",
            f"same={sys.executable}",  # another installation; this one again, for the test
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    result = json.loads(out.stdout)
    names = [r["contender"] for r in result["results"]]
    assert names == [
        "direct",
        "bare aiohttp",
        "router-serve (affinity)",
        "router-serve (affinity, resume off)",
        "router-serve (affinity, same)",
    ]
    for r in result["results"]:
        assert r["small_ok"] == 40 and r["events"] >= 8 * 5 and r["ttft_ms_median"] > 0
    assert result["results"][0]["cpu_us_per_request"] is None
    assert result["results"][2]["cpu_us_per_request"] >= 0  # clock ticks: a tiny run may read 0
    bad = subprocess.run(
        [sys.executable, "-m", "router.bench.cli", "proxy", "--against", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--against 'nope' is not NAME=PATH" in bad.stderr
