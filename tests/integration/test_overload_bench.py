"""`router-bench overload` runs end to end on a short schedule (it counts; it asserts no speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

# its subject is router-bench's harness (and the peers beside our router), not which ring the router
# loads: CI runs it on the compiled pass only (pyproject.toml's one_pass marker)
pytestmark = pytest.mark.one_pass

SMALL = ("--no-peers", "--replicas", "2", "--slots", "2", "--loads", "3", "--calibrate-s", "2", "--max-tokens", "16")


def small_run(*extra: str) -> dict[str, Any]:
    """A short run on a small fleet at three times its capacity, without the peers."""
    out = subprocess.run(
        [sys.executable, "-m", "router.bench.cli", "overload", "--json", *SMALL, *extra],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_overload_benchmark_smoke() -> None:
    result = small_run("--duration-s", "4")
    assert result["capacity_rps"] > 0
    runs = {r["contender"]: r for r in result["runs"]}
    assert set(runs) == {"admission", "shipped", "off", "round-robin"}
    for r in runs.values():
        assert r["sent"] > 0 and abs(r["good"] + r["late"] + r["shed"] + r["failed"] - 1) < 0.01
        # the steady window (the middle half of a 4 s run) counts a part of the good answers, at most all
        assert 0 <= r["steady_goodput_rps"] * 2 <= r["good"] * r["sent"]
    # at three times its capacity, the router with admission (tuned, or as shipped) refuses part
    # cleanly; with it off, or without a router, nothing is
    assert runs["admission"]["shed"] > 0 and runs["shipped"]["shed"] > 0
    assert runs["off"]["shed"] == runs["round-robin"]["shed"] == 0
    assert runs["admission"]["failed"] == runs["shipped"]["failed"] == 0


def test_priority_classes_are_counted_and_the_higher_fares_better_with_admission() -> None:
    result = small_run("--priorities", "--duration-s", "4", "--contenders", "admission,off")
    assert [r["contender"] for r in result["runs"]] == ["admission", "off"]
    for run in result["runs"]:
        c = run["classes"]
        assert c["interactive"]["sent"] + c["bulk"]["sent"] == run["sent"]
        assert c["bulk"]["sent"] > c["interactive"]["sent"] > 0  # three to one
    admission = next(r for r in result["runs"] if r["contender"] == "admission")["classes"]
    assert admission["interactive"]["good"] > admission["bulk"]["good"], admission


def test_the_mixed_traffic_is_counted_per_client_and_kind() -> None:
    result = small_run("--mix", "--duration-s", "4", "--contenders", "admission,round-robin")
    for run in result["runs"]:
        c = run["classes"]
        assert c["heavy"]["sent"] + c["light"]["sent"] == run["sent"] == c["turn"]["sent"] + c["new"]["sent"]
        assert c["heavy"]["sent"] > c["light"]["sent"] > 0  # three to one
        assert c["turn"]["sent"] > 0 and c["new"]["sent"] > 0  # conversations go on
        for name in ("heavy", "light", "turn", "new"):
            assert 0 <= c[name]["good"] + c[name]["shed"] + c[name]["late"] <= 1.0001


def test_bad_arguments_are_one_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "router.bench.cli", "overload", "--loads", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.strip() == "router-bench overload: --loads 'x' is not a list of numbers"
    out = subprocess.run(
        [sys.executable, "-m", "router.bench.cli", "overload", "--mix", "--priorities"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "choose one" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    for contenders, said in (
        (
            "admission,bogus",
            "unknown contender 'bogus' (known: admission, shipped, off, round-robin, smg, smg-priority)",
        ),
        ("smg-priority", "smg-priority runs only with --priorities"),
        ("admission,smg", "smg is named, but --no-peers leaves it out"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "router.bench.cli", "overload", "--no-peers", "--contenders", contenders],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and out.stderr.strip() == f"router-bench overload: {said}", out.stderr
