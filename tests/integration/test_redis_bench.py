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
    # each request reserves its budget before and settles it after: two scripts a request, no more
    assert 1.8 <= healthy["commands"]["EVALSHA"] / healthy["answered"] <= 2.2
    assert 1.8 <= healthy["round_trips_per_request"]["budgets"] <= 2.2
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
