"""router-bench fleet: the figures it derives, the fleet-size search, its arguments, its tables."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest

from router.bench import fleet
from router.bench.cli import build_parser
from router.bench.fleet import Sample, bisect_size, fleet_figures, render_markdown, summarize_runs


def args_of(*flags: str) -> argparse.Namespace:
    args = build_parser().parse_args(["fleet", *flags])
    fleet.check_args(args)
    return args


def test_busy_share_and_balance_come_from_the_fleets_counters() -> None:
    samples = [
        Sample(0.0, engine_s=[0.0, 0.0], busy_s=[0.0, 0.0], queued=[0, 0], finished=[0, 0]),
        Sample(1.0, engine_s=[10.0, 10.0], busy_s=[8.0, 4.0], queued=[4, 2], finished=[30, 10]),
        Sample(2.0, engine_s=[20.0, 20.0], busy_s=[16.0, 8.0], queued=[3, 3], finished=[60, 20]),
        # after the arrivals window: counted for the finished requests, not for busy or spread
        Sample(3.0, engine_s=[30.0, 30.0], busy_s=[30.0, 8.0], queued=[9, 0], finished=[70, 30]),
    ]
    f = fleet_figures(samples, window_end_wall_s=2.5)
    assert f["gpu_busy_per_replica"] == [0.8, 0.4] and f["gpu_busy"] == pytest.approx(0.6)
    assert f["finished"] == [70, 30] and f["load_cv"] == pytest.approx(0.4)  # |70-50| / 50
    # in-flight spread: mean CV over the samples with any load (4,2 -> 1/3; 3,3 -> 0)
    assert f["inflight_cv"] == pytest.approx((1 / 3) / 2)
    assert math.isnan(fleet_figures(samples[:1], 1.0)["gpu_busy"])  # one sample: no figures, no crash


async def test_the_size_search_finds_the_smallest_fleet_that_meets_the_target() -> None:
    probed: list[int] = []

    async def meets(n: int) -> bool:
        probed.append(n)
        return n >= 13

    assert await bisect_size(10, 20, meets) == 13
    assert len(probed) == len(set(probed)) <= 5  # each size at most once, log2 of the range

    async def never(n: int) -> bool:
        return False

    async def always(n: int) -> bool:
        return True

    assert await bisect_size(10, 20, never) is None
    assert await bisect_size(10, 20, always) == 10


def test_arguments() -> None:
    args = args_of("--contenders", "round-robin,full,oracle", "--rate", "4,16")
    assert args.workloads == ["sessions@4", "sessions@16"] and args.rate == [4.0, 16.0]
    assert fleet.size_workload(args.workloads) == "sessions@16"
    assert fleet.session_rate("sessions@16") == 16.0 and fleet.session_rate("mooncake-synthetic") is None
    assert args.size_search == ["round-robin", "full"]
    for flags, message in (
        (["--contenders", "full,nginx"], "unknown contender 'nginx'"),
        (["--workloads", "sessions,chat"], "unknown workload 'chat'"),
        (["--workloads", "mooncake-synthetic"], "needs --trace-dir"),
        (["--workloads", "mooncake-synthetic", "--trace-dir", "/nonexistent"], "no trace file"),
        (["--rate", "4,x"], "--rate must be numbers"),
        (["--rate", "0"], "--rate must be positive"),
        (["--replicas", "1"], "--replicas >= 2"),
        (["--time-scale", "0"], "--time-scale must be positive"),
        (["--contenders", "full", "--size-search", "round-robin"], "not among the contenders"),
        (["--setting", "novalue"], "NAME=VALUE"),
    ):
        with pytest.raises(ValueError, match=message):
            args_of(*flags)


def test_cli_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["fleet", "--contenders", "bogus"])
    assert args.run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("router-bench fleet: unknown contender")


def run_result(hit: float, mean: float, p99: float, cv: float, router_cpu: float | None = 0.1) -> dict[str, Any]:
    return {
        "kv_hit_rate": hit,
        "e2e_later_turns_s": {"n": 10, "mean": mean, "p99": p99},
        "ttft_s": {"n": 10, "p99": p99 / 10},
        "load_cv": cv,
        "inflight_cv": cv * 2,
        "jump_rate": 0.5,
        "gpu_busy": 0.8,
        "requests": 100,
        "ok": 100,
        "client_cpu_share": 0.1,
        "emulator_cpu_share": 0.2,
        "router_cpu_share": router_cpu,
    }


def test_medians_tables_and_ratios() -> None:
    runs = [run_result(0.3, 2.0, 4.0, 0.01), run_result(0.4, 2.2, 5.0, 0.02), run_result(0.35, 9.0, 4.5, 0.03)]
    med = summarize_runs(runs)
    assert med["kv_hit_rate"] == 0.35 and med["multi_turn_mean_s"] == 2.2 and med["multi_turn_p99_s"] == 4.5
    assert med["rounds"] == 3 and med["failed"] == 0
    full = summarize_runs([run_result(0.7, 1.1, 1.5, 0.04)])
    rr = summarize_runs([run_result(0.35, 2.2, 4.5, 0.01, router_cpu=None)])
    result = {
        "replicas": 20,
        "time_scale": 2.0,
        "rounds": 1,
        "contenders": {"round-robin": "round-robin (client)", "full": "router-serve full policy"},
        "tables": {"sessions@16": {"round-robin": rr, "full": full}},
        "replicas_needed": {
            "workload": "sessions@16",
            "target_p99_s": 4.5,
            "contenders": {"round-robin": {"needed": 20}, "full": {"needed": 14}},
        },
    }
    md = render_markdown(result)
    rows = [line for line in md.splitlines() if line.startswith("| round-robin (client)")]
    assert "| 35.0% |" in rows[0] and rows[0].endswith("| 20 |")
    assert "replicas for P99 ≤ 4.50 s" in md
    assert next(line for line in md.splitlines() if line.startswith("| router-serve full policy")).endswith("| 14 |")
    # the full policy against round robin: hit 2.00x, mean -50%, P99 3.00x lower
    assert "| round-robin (client) | 2.00× | -50% | 3.00× | 0.040 / 0.010 |" in md
    assert "routers: router-serve full policy 10%." in md
