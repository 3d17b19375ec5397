"""`router-bench replay` against emulated fleets: sessions, spreading, and the trace cross-check."""

from __future__ import annotations

import itertools
import json
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from router.bench.replay import Replayer, ReplayOptions
from router.bench.workloads import SessionsSpec, best_case_prefix_reuse, generate_sessions
from router.emulator.engine import EngineConfig

SPEC = SessionsSpec(
    rate=4,
    turns_min=3,
    turns_max=5,
    think_s=1.0,
    system_tokens=200,
    first_tokens=(100, 300),
    user_tokens=(10, 40),
    reply_tokens=(8, 24),
    users=20,
    seed=5,
)


async def replay(targets: list[str], **kw: Any) -> dict[str, Any]:
    opts = ReplayOptions(
        targets=tuple(targets), workload=kw.pop("workload", "sessions"), time_scale=20.0, spec=SPEC, **kw
    )
    return await Replayer(opts).run()


async def test_sessions_round_robin_versus_pinned(start_fleet) -> None:  # type: ignore[no-untyped-def]
    # a fresh, cold fleet for each spread: neither run inherits the other's cache
    rr_fleet, pinned_fleet = await start_fleet(3), await start_fleet(3)
    rr = await replay([r.url for r in rr_fleet.replicas], duration_s=15, spread="round-robin")
    pinned = await replay([r.url for r in pinned_fleet.replicas], duration_s=15, spread="session")
    for result in (rr, pinned):
        assert result["errors"] == {} and result["ok"] == result["requests"] > 30
        assert sum(result["per_replica"].values()) == result["ok"]
        assert set(result["per_replica"]) == {"emu-0", "emu-1", "emu-2"}
        assert result["later_turns"] > result["sessions"]
        assert result["e2e_s"]["p99"] >= result["e2e_s"]["p50"] > 0
    assert pinned["jump_rate"] == 0
    assert rr["jump_rate"] > 0.5
    assert pinned["kv_hit_rate_later_turns"] > rr["kv_hit_rate_later_turns"] + 0.1
    assert rr["load_cv"] < 0.1
    # the client's view agrees with the replicas' own counters
    for fleet, result in ((rr_fleet, rr), (pinned_fleet, pinned)):
        assert sum(r.engine.cached_tokens_total for r in fleet.replicas) == result["cached_tokens"]
        assert sum(r.engine.prompt_tokens_total for r in fleet.replicas) == result["prompt_tokens"]
        assert result["sessions_cut"] == 0  # every started session played all its turns


async def test_an_agents_tool_loop_calls_a_tool_each_turn_but_its_last_and_sends_the_results_back(
    start_fleet,  # type: ignore[no-untyped-def]
) -> None:
    """`tool_loop`: each turn but a session's last is answered with a tool call (router-emulator
    answers `tool_choice: required` so); the next turn sends the call back with its result as a
    `tool` message, and finds its history cached (one replica)."""
    fleet = await start_fleet(1, tools=True)  # (vLLM's tool parser flags)
    replica = fleet.replicas[0]
    opts = ReplayOptions(
        targets=(replica.url,), workload="sessions", time_scale=20.0, spec=SPEC, duration_s=3, tool_loop=True
    )
    replayer = Replayer(opts)
    sent: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    send = replayer.send

    async def watched(session: str, turn: int, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        rec = await send(session, turn, path, body, headers)
        sent.setdefault(session, []).append((body, rec.call))
        return rec

    replayer.send = watched  # type: ignore[method-assign]
    result = await replayer.run()
    assert result["errors"] == {} and result["ok"] == result["requests"] > 5
    for turns in sent.values():
        for k, (body, call) in enumerate(turns):
            last = k == len(turns) - 1
            assert (body.get("tool_choice") == "required") is (call is not None) is (not last)
            if k:  # the previous turn's call, and its result answering it
                before = turns[k - 1][1]
                assert body["messages"][-2] == {"role": "assistant", "content": None, "tool_calls": [before]}
                assert body["messages"][-1]["role"] == "tool" and body["messages"][-1]["tool_call_id"] == before["id"]
    assert result["kv_hit_rate_later_turns"] > 0.5


async def test_request_budget_and_errors_are_counted(start_fleet) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1)
    fleet.replicas[0].set_faults({"error_rate": 1.0, "error_status": 503})
    result = await replay([fleet.replicas[0].url], duration_s=30, requests=5)
    assert result["requests"] == 5 and result["ok"] == 0 and result["errors"] == {"http 503": 5}
    # with no request budget: each conversation ends at its failed first turn, and its other turns,
    # never sent, are counted as such
    failing = await replay([fleet.replicas[0].url], duration_s=4)
    started = list(itertools.islice(generate_sessions(SPEC), failing["requests"]))
    assert failing["ok"] == 0 and failing["requests"] == len(started) > 3
    assert failing["turns_dropped"] == sum(len(p.turns) - 1 for p in started) > failing["requests"]
    dead = await replay(["http://127.0.0.1:9"], duration_s=2, requests=3)
    assert dead["ok"] == 0 and sum(dead["errors"].values()) == 3
    assert next(iter(dead["errors"])).startswith("connection")


def synthetic_trace(path: Path, conversations: int = 30, seed: int = 3) -> Path:
    """A Mooncake-format trace: growing conversations behind one shared system-prompt block."""
    rng = random.Random(seed)
    next_id = 1
    rows = []
    for c in range(conversations):
        full: list[int] = [0]
        length = 512 + rng.randint(100, 1500)
        t = c * 2.0
        for _ in range(rng.randint(1, 5)):
            n_full, rest = divmod(length, 512)
            while len(full) < n_full:
                full.append(next_id)
                next_id += 1
            ids = full[:n_full]
            if rest:
                ids = [*ids, next_id]
                next_id += 1
            rows.append(
                {
                    "timestamp": int(t * 1000),
                    "input_length": length,
                    "output_length": rng.randint(1, 30),
                    "hash_ids": ids,
                }
            )
            length += rng.randint(200, 1500)
            t += rng.uniform(1, 5)
    rows.sort(key=lambda r: r["timestamp"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


async def test_trace_replay_matches_the_best_case_reuse(start_fleet, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    trace = synthetic_trace(tmp_path / "trace.jsonl")
    expected = best_case_prefix_reuse(trace)["best_case_hit_rate"]
    fleet = await start_fleet(1, EngineConfig(num_blocks=200_000))  # never evicts
    result = await replay(
        [fleet.replicas[0].url],
        workload="mooncake-conversation",
        trace=str(trace),
        speedup=50.0,
        concurrency=1,
        output_tokens=1,
    )
    assert result["errors"] == {} and result["ok"] == result["requests"]
    assert fleet.replicas[0].engine.cache.evictions == 0
    assert expected > 0.3
    assert abs(result["kv_hit_rate"] - expected) < 0.005, (result["kv_hit_rate"], expected)


def test_command_line_errors_are_one_line(tmp_path: Path) -> None:
    for args in (
        ["--target", "localhost:8000"],
        ["--target", "http://x", "--rate", "0"],
        ["--target", "http://x", "--turns", "a-b"],
        ["--target", "http://x", "--workload", "mooncake-synthetic"],
        ["--target", "http://x", "--workload", "mooncake-synthetic", "--trace", str(tmp_path / "no")],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "router.bench.cli", "replay", *args], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2, args
        assert proc.stderr.startswith("router-bench replay: ") and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("spread", ["round-robin", "session"])
def test_cli_json_against_a_fleet_process(spread: str, tmp_path: Path) -> None:
    with socket.socket() as s1, socket.socket() as s2:
        s1.bind(("127.0.0.1", 0))
        s2.bind(("127.0.0.1", 0))
        ports = [s1.getsockname()[1], s2.getsockname()[1]]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "router.emulator.cli", "--port", str(p), "--time-scale", "100"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for p in ports
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and "listening" in proc.stdout.readline()
        cmd = [
            sys.executable,
            "-m",
            "router.bench.cli",
            "replay",
            "--json",
            "--time-scale",
            "100",
            "--duration",
            "10",
            "--drain",  # every session plays its turns: at 100 x, 0.1 s of wall time cut off most of them
            "--rate",
            "2",
            "--turns",
            "2-3",
            "--think",
            "1",
            "--spread",
            spread,
        ]
        for p in ports:
            cmd += ["--target", f"http://127.0.0.1:{p}"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
        result = json.loads(out.stdout)
        assert result["ok"] > 5 and result["spread"] == spread
        assert set(result["per_replica"]) <= {f"emu-{p}" for p in ports}
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


async def test_a_target_that_breaks_the_protocol_fails_requests_not_the_replay(sse_upstream) -> None:  # type: ignore[no-untyped-def]
    events = [b"data: []\n\n", b'data: {"choices": ["x"], "usage": [1]}\n\n', b"data: [DONE]\n\n"]
    url, _ = await sse_upstream(events, headers={"X-Replica-Id": "odd"})
    result = await replay([url], duration_s=5, requests=4)
    assert result["requests"] == 4 and result["errors"] == {"bad event": 4}
    assert result["per_replica"] == {"odd": 0}  # it answered, so it counts, with no successes


async def test_a_failing_replica_counts_in_the_balance(start_fleet) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3)
    fleet.replicas[2].set_faults({"error_rate": 1.0})
    result = await replay([r.url for r in fleet.replicas], duration_s=10, requests=30, spread="round-robin")
    assert result["per_replica"]["emu-2"] == 0 and len(result["per_replica"]) == 3
    assert result["load_cv"] > 0.5
