"""router-bench redis --rates: a phase's figures from its processes' counts and Redis' own, and
what makes the run fail."""

from __future__ import annotations

from collections import Counter
from typing import Any

from router.bench.redis_load import _row, faulty, render


def part(started: int, charged: int, failed: int, answered: int, on_path: list[float]) -> dict[str, Any]:
    return {
        "asked": started,
        "started": started,
        "sent_s": 2.0,
        "charged": charged,
        "refused": 0,
        "found": 3,
        "failed_calls": failed,
        "answered": answered,
        "told": started,
        "learnt": 0,
        "on_path_s": on_path,
        "cpu_s": 0.5,
        "served": [],
    }


def test_a_phase_counts_round_trips_by_feature_and_the_scripts_redis_should_have_run() -> None:
    before = Counter({"EVALSHA": 10, "GET": 5, "INFO": 7})
    # 100 requests: 90 charged, 10 let through uncharged; 4 settlements dropped (the 86 others went
    # summed, in 20 scripts): 110 scripts answered
    after = before + Counter({"EVALSHA": 110, "GET": 100, "SET": 60, "PUBLISH": 100, "HSET": 110, "INFO": 2})
    parts = [part(60, 55, 8, 65, [0.001] * 60), part(40, 35, 6, 45, [0.002] * 40)]
    row = _row("x", 50, 2.0, parts, before, after, 0.01)
    assert row["started"] == 100 and row["started_per_s"] == 50
    assert row["uncharged"] == 10 and row["settlements_dropped"] == 4
    assert row["scripts_expected"] == 110 == row["scripts_run"]
    assert row["round_trips_per_request"] == {"budgets": 1.1, "sessions": 1.6, "placements": 1.0}
    assert "INFO" not in row["commands"]  # the bench's own
    assert row["redis_cpu_us_per_request"] == 100.0 and row["procs_cpu_us_per_request"] == 10_000.0
    result: dict[str, Any] = {
        "procs": 2,
        "phase_s": 2.0,
        "sessions": 10,
        "stall": None,
        "phases": [row],
        "sessions_lost": {},
    }
    assert faulty(result) is None
    assert "| x | 50 (50) | 1.00 / 2.00 |" in render(result)
    # a script Redis ran whose answer never came back is what the run fails on, in one line
    row["scripts_run"] += 1
    assert faulty(result) == "phase x: Redis ran 111 budget scripts, the processes counted 110"


def test_a_reloaded_script_is_not_counted_twice_and_a_lost_session_fails_the_run() -> None:
    # a new, empty Redis: each process's first call finds no script, loads it and calls it again
    after = Counter({"EVALSHA": 13, "SCRIPT|LOAD": 2})
    row = _row("back", 10, 1.0, [part(10, 10, 0, 11, [0.001] * 10)], Counter({"PING": 1}), after, 0.001)
    assert row["scripts_run"] == 11 == row["scripts_expected"]
    result: dict[str, Any] = {"procs": 1, "phase_s": 1.0, "sessions": 10, "stall": None, "phases": [row]}
    result["sessions_lost"] = {"served_while_stopped": 5, "missing_after": 2}
    assert faulty(result) == "2 sessions served while Redis was stopped are not in it after"
    assert "missing from the new Redis after it came back: 2" in render(result)
