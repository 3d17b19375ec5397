"""router-bench redis, reduced: three routers on a real redis-server, which is slowed, stopped and
restarted empty under load; every request is answered whole, the sessions served while it was away
reach the new Redis, the budgets pass uncharged only while it is away, and the commands a request
costs are counted by name."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from router.bench.cli import build_parser

# its subject is router-bench's harness (and the peers beside our router), not which ring the router
# loads: CI runs it on the compiled pass only (pyproject.toml's one_pass marker)
pytestmark = pytest.mark.one_pass


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_requests_go_on_through_a_slow_and_a_stopped_redis(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["redis", "--routers", "3", "--users", "6", "--phase-s", "1.5", "--out", str(tmp_path)]
    )
    assert args.run(args) == 0
    result = json.loads((tmp_path / "redis.json").read_text())
    phases = {p["phase"]: p for p in result["phases"]}
    assert list(phases) == ["idle", "healthy", "slowed", "stopped", "back"]
    assert phases["idle"]["answered"] == 0 and phases["idle"]["commands_per_s"] > 0  # the routers' own polling
    healthy = phases["healthy"]
    assert healthy["answered"] > 10 and healthy["succeeded"] == healthy["answered"]
    # each request reserves its budget before, and settles it after in a router's round of
    # settlements (summed by tenant every 100 ms): two scripts a request at most, more than one
    assert 1.0 < healthy["commands"]["EVALSHA"] / healthy["answered"] <= 2.2
    assert 1.0 < healthy["round_trips_per_request"]["budgets"] <= 2.2
    assert healthy["round_trips_per_request"]["sessions"] > 0
    assert healthy["commands"].get("SET", 0) > 0  # sessions written (in batches)
    for name in ("slowed", "stopped", "back"):  # routing goes on, whatever Redis does
        assert phases[name]["answered"] > 0 and phases[name]["succeeded"] == phases[name]["answered"], name
    assert phases["stopped"]["commands"] == {}
    # Redis' own CPU: some while it serves (every request's scripts run there), none known while it is away
    assert result["routers"] == 3 and healthy["redis_cpu_ms_per_s"] > 0 and healthy["redis_cpu_us_per_request"] > 0
    assert math.isnan(phases["stopped"]["redis_cpu_s"])
    assert result["cut_silently"] == 0
    assert result["sessions_served_while_stopped"] > 0 and result["sessions_lost"] == 0
    assert result["uncharged_while_away"] > 0  # the budgets fail open while Redis is away
    assert "| stopped | " in (tmp_path / "redis.md").read_text()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_a_requests_shared_state_at_a_rate_through_a_slow_and_a_stopped_redis(tmp_path: Path) -> None:
    """--rates: processes run a request's Redis calls with the router's own objects, open loop."""
    args = build_parser().parse_args(
        ["redis", "--rates", "150,300", "--procs", "2", "--phase-s", "2", "--faults", "--out", str(tmp_path)]
    )
    assert args.run(args) == 0
    result = json.loads((tmp_path / "redis-rates.json").read_text())
    phases = {p["phase"]: p for p in result["phases"]}
    assert list(phases) == ["150/s", "300/s", "slowed", "stopped", "back"]
    for name in ("150/s", "300/s"):
        p = phases[name]
        # open loop: the arrivals come at the rate asked (Poisson), and every one is started
        assert 0.6 * p["rate_asked"] < p["started_per_s"] < 1.4 * p["rate_asked"], p
        assert p["started"] == p["asked"] and p["uncharged"] == 0 and p["settlements_dropped"] == 0
        # a reservation's script a request, and a script a process's round of settlements (every 100
        # ms): each run by Redis answered its process
        assert p["scripts_run"] == p["scripts_expected"]
        rounds = 2 * result["phase_s"] / 0.1  # (two processes; twice that, for the drain at the end of a slow one)
        assert p["started"] < p["scripts_run"] <= p["started"] + 2 * rounds, (p["scripts_run"], p["started"])
        trips = p["round_trips_per_request"]
        assert 1.0 < trips["budgets"] < 1.5 and 1.5 <= trips["sessions"] <= 2.2 and 0.9 <= trips["placements"] <= 1.1
        assert p["redis_cpu_us_per_request"] > 0 and p["procs_cpu_us_per_request"] > 0
        assert 0 < p["on_path_p50_ms"] <= p["on_path_p99_ms"]
    # stopped: the budgets fail open at once, nothing reaches Redis, the requests go on
    stopped = phases["stopped"]
    assert stopped["commands"] == {} and stopped["scripts_run"] is None
    # (none waits on a connection or an answer: 0.5 s each, were it so)
    assert stopped["uncharged"] == stopped["started"] > 0 and stopped["on_path_p99_ms"] < 250
    # slowed and back: Redis ran exactly the scripts the processes were told it ran
    for name in ("slowed", "back"):
        assert phases[name]["scripts_run"] == phases[name]["scripts_expected"] > 0, name
    lost = result["sessions_lost"]
    assert lost["served_while_stopped"] > 0 and lost["missing_after"] == 0
    assert "| stopped | " in (tmp_path / "redis-rates.md").read_text()


def test_rates_must_be_positive_counts() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["redis", "--rates", "100,x"])
