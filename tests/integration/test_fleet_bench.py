"""router-bench fleet end to end: every contender (the peer routers included) in front of a small
emulated fleet, a synthetic session workload and a short trace, the fleet-size search, and the
files it writes."""

from __future__ import annotations

import json
from pathlib import Path

from router.bench import fleet
from router.bench.cli import build_parser

# a tiny Mooncake-format trace: three conversations of two turns sharing a system block
TRACE = [
    {"timestamp": t, "input_length": n, "output_length": 8, "hash_ids": ids}
    for t, n, ids in (
        (0, 600, [0, 1]),
        (100, 600, [0, 2]),
        (200, 600, [0, 3]),
        (900, 1100, [0, 1, 4]),
        (1000, 1100, [0, 2, 5]),
        (1100, 1100, [0, 3, 6]),
    )
]


def test_every_contender_on_a_small_fleet(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    for name in fleet.TRACES.values():
        (traces / name).write_text("".join(json.dumps(row) + "\n" for row in TRACE))
    out = tmp_path / "out"
    contenders = list(fleet.CONTENDERS)  # the test extra installs both peer routers: none is left out
    args = build_parser().parse_args(
        [
            "fleet",
            "--replicas",
            "3",
            "--rate",
            "3",
            "--duration",
            "10",
            "--think",
            "0.5",
            "--time-scale",
            "10",
            "--sample-s",
            "0.2",
            "--contenders",
            ",".join(contenders),
            "--workloads",
            "sessions,mooncake-synthetic",
            "--trace-dir",
            str(traces),
            "--trace-speedup",
            "1",
            "--out",
            str(out),
        ]
    )
    assert args.run(args) == 0  # 0: no request failed anywhere
    result = json.loads((out / "fleet.json").read_text())
    assert (out / "fleet.md").read_text().startswith("3 emulated replicas")
    assert (out / "fleet-hit-p99.png").stat().st_size > 1000 and (out / "fleet-load.png").stat().st_size > 1000

    sessions = result["tables"]["sessions@3"]
    assert list(sessions) == contenders
    requests = {f["requests"] for f in sessions.values()}
    assert len(requests) == 1 and requests.pop() > 20  # every contender served the same turns
    for name, f in sessions.items():
        assert f["failed"] == 0, name
        assert 0 < f["gpu_busy"] <= 1, name
        run = result["runs"]["sessions@3"][name][0]
        # the fleet finished at least what the client got (plus readiness probes and warm-ups)
        assert sum(run["finished"]) >= run["ok"], name
        assert len(run["load_timeline"]["queued"][0]) == 3
    rr = sessions["round-robin"]
    assert rr["jump_rate"] > 0.3
    for sticky in ("consistent_hash", "oracle", "sglang-header", "vllm-consistent-hash"):
        assert sessions[sticky]["jump_rate"] == 0, sticky
        assert sessions[sticky]["kv_hit_rate"] > rr["kv_hit_rate"] + 0.1, sticky
    assert sessions["full"]["kv_hit_rate"] > rr["kv_hit_rate"] + 0.1
    assert result["runs"]["sessions@3"]["full"][0]["router_cpu_share"] > 0
    assert result["runs"]["sessions@3"]["round-robin"][0]["router_cpu_share"] is None

    trace = result["tables"]["mooncake-synthetic"]
    assert all(f["requests"] == len(TRACE) and f["failed"] == 0 for f in trace.values())
    # later turns extend their first turn's blocks: sticky contenders hit them
    assert trace["oracle"]["kv_hit_rate"] > trace["round-robin"]["kv_hit_rate"]

    sizes = result["replicas_needed"]
    assert sizes["workload"] == "sessions@3"
    for name in ("round-robin", "full"):
        found = sizes["contenders"][name]
        assert found["needed"] in (2, 3, None)
        assert "3" in found["probes"]  # the full-size run counts as a probe
