"""The fault suite: under load, each fault loses nothing silently (router-bench faults, small)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from typing import Any

import pytest

from router.bench import faults
from router.bench.cli import main as bench_main
from router.bench.contenders import available

OPTS = faults.Options(replicas=4, users=8, max_tokens=32, warmup_s=1.5, fault_s=5.0)


async def run(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    result = await faults.run_scenario(name, OPTS)
    assert result["cut_silently"] == 0, result["lost"]
    assert result["failed_clean"] == 0
    if name != "router-restart":  # the only one where the router itself is down for a while
        assert result["refused"] == 0
    assert result["succeeded"] == result["sent"] - result["refused"] > 50
    return result, result["figures"]


async def test_a_crash_before_the_first_byte_is_retried_elsewhere() -> None:
    result, f = await run("crash-before-first-byte")
    assert f["held_at_crash"] >= 1 and result["retried"] >= f["held_at_crash"]
    assert result["refused"] == 0 and f["victim_state"] == "removed" and f["other_state_changes"] == 0


async def test_a_crash_mid_stream_is_resumed_and_the_replica_comes_back() -> None:
    result, f = await run("crash-mid-stream")
    assert f["streams_on_victim_at_crash"] >= 1 and result["resumed"] >= 1
    assert f["back_after_restart_s"] is not None and f["other_state_changes"] == 0


async def test_a_stalled_stream_is_resumed_after_the_idle_time_out() -> None:
    result, _ = await run("stall-mid-stream")
    assert result["resumed"] >= 1


async def test_a_hung_replica_times_out_is_retried_and_removed() -> None:
    result, f = await run("hang")
    assert result["retried"] >= 1 and f["removed_after_s"] is not None and f["victim_state"] == "removed"


async def test_a_flapping_replica_is_kept_out() -> None:
    _, f = await run("flapping")
    assert f["flips"] >= 4
    # taken out once, back once at most, then kept out by the back-off: without it, every cycle
    # would take it out and bring it back (four changes a cycle, counting suspect)
    assert f["victim_state_changes_during"] <= 5 and f["relapses"] <= 1
    assert f["other_state_changes"] == 0


async def test_agents_gone_or_stale_are_aged_out_and_routing_goes_on() -> None:
    _, f = await run("agent-gone")
    assert f["agents_before"] == ["fresh"] * 4
    assert f["victim"] == ("healthy", "gone")
    assert f["stale_one"] == ("healthy", "stale")  # its hour-old ECC errors were not trusted
    assert f["state_changes"] == 0


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed (CI installs it)")
async def test_redis_gone_and_back_routing_goes_on_and_state_reconciles() -> None:
    _, f = await run("redis-gone")
    assert f["removed_during_outage"] and not f["other_router_knew_during_outage"]
    assert f["reconciled_after_s"] is not None and faults.VICTIM not in f["members"]


async def test_a_router_restart_refuses_only_while_down_and_keeps_sessions() -> None:
    result, f = await run("router-restart")
    assert result["refused"] >= 1 and f["refused_outside_downtime"] == 0 and f["ring_with_overrides_back"]
    across = f["sessions_across_restart"]
    assert across >= 1 and f["saved_at_last_replica"] == across
    # each session came back where its cache is, or was moved on knowingly (ttft: a burst of
    # returning turns may make another replica's first token come sooner); a forgotten session
    # would land by cost or ring with no jump counted
    assert across - f["same_replica_after_restart"] <= f["session_jumps_after_restart"]


def test_classification() -> None:
    done = (
        b'data: {"choices":[{"delta":{"content":"ab"}}]}\n\n'
        b'data: {"choices":[{"delta":{},"finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
    )
    assert faults.classify(200, done, True, 1) == ("succeeded", "")
    assert faults.classify(200, done, True, 2)[0] == "cut_silently"  # a token short
    assert faults.classify(200, done.replace(b"data: [DONE]\n\n", b""), True, 1)[0] == "cut_silently"
    error = b'data: {"choices":[{"delta":{"content":"ab"}}]}\n\ndata: {"error":{"message":"x"}}\n\ndata: [DONE]\n\n'
    assert faults.classify(200, error, True, 5) == ("failed_clean", "")
    assert faults.classify(502, b'{"error":{"message":"no replica"}}', True, 5) == ("failed_clean", "")
    assert faults.classify(502, b"Bad Gateway", False, 5)[0] == "cut_silently"
    plain = b'{"choices":[{"message":{"content":"abc"},"finish_reason":"length"}],"usage":{"completion_tokens":3}}'
    assert faults.classify(200, plain, False, 3) == ("succeeded", "")
    assert faults.classify(200, plain, False, 4)[0] == "cut_silently"
    assert faults.classify(200, b"{", False, 4)[0] == "cut_silently"
    unfinished = b'{"choices":[{"message":{"content":"abc"},"finish_reason":null}],"usage":{"completion_tokens":3}}'
    assert faults.classify(200, unfinished, False, 3)[0] == "cut_silently"
    after_done = done + b'data: {"choices":[{"delta":{"content":"zz"}}]}\n\n'
    assert faults.classify(200, after_done, True, 1)[0] == "cut_silently"  # nothing may follow [DONE]
    odd_error = b'data: {"choices":[{"delta":{"content":"ab"}}]}\n\ndata: {"error":"boom"}\n\n'
    assert faults.classify(200, odd_error, True, 5)[0] == "cut_silently"  # not OpenAI-shaped


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scenarios", "meteor"], "unknown scenario(s) meteor"),
        (["--replicas", "2"], "--replicas must be at least 3"),
        (["--duration", "0"], "--duration must be a number of seconds > 0"),
        (["--setting", "probe_interval_s=soon"], "probe_interval_s"),
        (["--setting", "state=none"], "--setting state: the scenarios set these themselves"),
    ],
)
def test_bad_arguments_are_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["faults", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.one_pass  # (its subject is the peer router, not our ring)
@pytest.mark.parametrize("peer", ["vllm", "smg"])
async def test_a_peer_router_is_put_through_the_same_fault(peer: str) -> None:
    if not available(faults.PEER_CONTENDERS[peer]):
        pytest.skip(f"{peer} is not installed (test extra)")
    result = await faults.run_scenario("crash-mid-stream", replace(OPTS, router=peer))
    assert result["router"] == peer and result["resumed"] is None  # it does not say
    assert result["sent"] == result["succeeded"] + result["failed_clean"] + result["cut_silently"] > 50
    assert result["figures"]["streams_on_victim_at_crash"] >= 1


def test_peers_take_only_the_replica_faults(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["faults", "--routers", "sglang", "--scenarios", "redis-gone"]) == 2
    assert "the peers take only these scenarios" in capsys.readouterr().err
    assert bench_main(["faults", "--routers", "nginx"]) == 2
    assert "choose from router-serve, sglang, smg, vllm" in capsys.readouterr().err
