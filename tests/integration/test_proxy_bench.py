"""`router-bench proxy` runs end to end, with and without the peer routers (tiny runs: they measure,
they assert no speed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from router.bench.proxy_bench import PEER_POLICIES, PEERS, _failure, peer_command, peer_installed

# its subject is router-bench's harness (and the peers beside our router), not which ring the router
# loads: CI runs it on the compiled pass only (pyproject.toml's one_pass marker)
pytestmark = pytest.mark.one_pass


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
            "1,4",
            "--saturate-s",
            "0.5",
            "--saturate-connections",
            "8",
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
        "floor: uvloop + httptools",
        "router-serve",
        "router-serve, resume off",
        "router-serve, resume and usage injection off",
        "router-serve --no-front",
        "router-serve (same)",
    ]
    for r in result["results"]:
        assert r["small_ok"] == 40 and r["events"] >= 8 * 5 and r["ttft_ms_median"] > 0, r
        if len(os.sched_getaffinity(0)) >= 2:  # saturation needs one CPU for the contender, one for the rest
            sat = r["saturation"]
            assert sat["requests_per_s"] > 0 and sat["errors"] == 0 and sat["latency_ms_p99"] > 0, r["contender"]
    assert result["results"][0]["cpu_us_per_request"] is None
    serve = result["results"][3]
    assert serve["cpu_us_per_request"] == serve["cpu_us_per_request_c4"] >= 0  # clock ticks: a tiny run may read 0
    assert serve["cpu_us_per_request_c1"] >= 0
    bad = subprocess.run(
        [sys.executable, "-m", "router.bench.cli", "proxy", "--against", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--against 'nope' is not NAME=PATH" in bad.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "router.bench.cli", "proxy", "--concurrency", "8,x"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--concurrency '8,x' is not a list of numbers" in bad.stderr


def small_run(mode: str) -> dict[str, Any]:
    """`router-bench proxy MODE --json` at a small size, one round: its result."""
    small = ("--requests", "40", "--streams", "8", "--tokens", "5", "--ttft-samples", "10", "--rounds", "1")
    cmd = [sys.executable, "-m", "router.bench.cli", "proxy", "--json", mode, *small, "--concurrency", "1,4"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_the_shared_fleet_contenders_are_served_with_keys_budgets_and_traces() -> None:
    result = small_run("--shared-fleet")
    assert [r["contender"] for r in result["results"]] == [
        "direct",
        "router-serve",
        "router-serve, client keys",
        "router-serve, keys + budgets",
        "router-serve, keys + budgets + traces (all)",
        "router-serve, keys + budgets + traces (1 %)",
    ]
    for r in result["results"]:  # every request was let through: the key was good, the budget never reached
        assert r["small_ok"] == 40 and r["events"] >= 8 * 5 and r["ttft_ms_median"] > 0, r
    assert result["saturate_s"] == 0


def test_a_failed_small_request_is_counted_by_status_and_error_code() -> None:
    # which refusal a 429 was (the overload queue's, a budget's) is in its body, not its status
    assert _failure(429, b'{"error": {"message": "m", "type": "t", "code": "queue_full"}}') == "429 queue_full"
    assert _failure(502, b"<html>Bad Gateway</html>") == "502" and _failure(500, b'{"error": "x"}') == "500"
    assert _failure(503, b'{"error": {"code": null}}') == "503"


def test_https_against_plain_http_keep_alive_and_a_new_connection_per_request() -> None:
    result = small_run("--tls")
    rows = {r["contender"]: r for r in result["results"]}
    assert list(rows) == ["direct", "router-serve, HTTP", "router-serve, HTTPS"]
    for name in ("router-serve, HTTP", "router-serve, HTTPS"):  # every request answered, over TLS too
        assert rows[name]["small_ok"] == 40 and rows[name]["events"] >= 8 * 5
        assert rows[name]["cpu_us_per_request_new_connection"] is not None  # (40 requests: maybe 0 ticks)
    assert result["saturate_s"] == 0


def test_the_peer_routers_side_by_side() -> None:
    assert all(peer_installed(kind) for kind in PEERS)  # the test extra installs every peer
    out = subprocess.run(
        [
            *(sys.executable, "-m", "router.bench.cli", "proxy", "--json", "--requests", "40", "--streams", "8"),
            *("--tokens", "5", "--ttft-samples", "10", "--rounds", "1", "--concurrency", "4", "--saturate-s", "0"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    results = {r["contender"]: r for r in json.loads(out.stdout)["results"]}
    peers = ["sglang-router (cache_aware)", "smg (cache_aware)", "vllm-router (consistent_hash)"]
    assert [f"{PEERS[kind].package} ({policy})" for kind, policy in PEER_POLICIES] == peers
    assert list(results)[-3:] == peers
    for name in peers:
        r = results[name]
        assert r["small_ok"] == 40 and r["events"] >= 8 * 5 and r["ttft_ms_median"] > 0, name
        assert r["cpu_us_per_request"] is not None and r["cpu_us_per_request"] >= 0, name


def test_smg_runs_from_its_own_module_not_the_script_sglang_router_shares() -> None:
    cmd, env = peer_command("smg", 1234, ["http://127.0.0.1:9001"], ["--policy", "cache_aware"])
    assert cmd[:3] == [sys.executable, "-m", "smg.launch_router"] and env == {"HF_ENDPOINT": "http://127.0.0.1:9"}
    assert cmd[cmd.index("--host") + 1] == cmd[cmd.index("--prometheus-host") + 1] == "127.0.0.1"
    assert cmd[-2:] == ["--policy", "cache_aware"] and "http://127.0.0.1:9001" in cmd
    vllm, env = peer_command("vllm", 1234, ["http://127.0.0.1:9001"], ["--policy", "consistent_hash"])
    assert vllm[0].endswith("vllm-router") and env is None


def test_a_signal_ends_the_proxy_benchmark_with_the_rounds_it_finished() -> None:
    args = ["proxy", "--json", "--no-peers", "--requests", "40", "--streams", "4", "--tokens", "5"]
    args += ["--ttft-samples", "5", "--rounds", "50", "--concurrency", "1", "--saturate-s", "0.5"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.bench.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"ROUTER_BENCH_PROGRESS": "1"},
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # a plain line per step: once round 2 begins, round 1 is whole
            if "(round 2)" in line:
                break
        proc.send_signal(signal.SIGINT)  # our own child, by its PID
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 130
    result = json.loads(stdout)
    assert result["partial"]["stopped_by"] == "SIGINT" and result["saturate_s"] == 0  # no saturation after a stop
    names = [r["contender"] for r in result["results"]]
    assert names[0] == "direct" and "router-serve" in names  # round 1 of every contender is kept
    # measured, not made up: a figure for each (a few requests may take less than one 10 ms CPU tick: 0)
    assert all(
        isinstance(r["cpu_us_per_request"], float | int) for r in result["results"] if r["contender"] != "direct"
    )
