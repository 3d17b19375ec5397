"""router-bench fleet: the figures it derives, the fleet-size search, its arguments, its tables."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from router.bench import contenders, fleet, fleet_counters, fleet_report, fleet_runs, fleet_workloads
from router.bench.cli import build_parser
from router.bench.fleet_counters import fleet_figures
from router.bench.fleet_report import render_markdown, summarize_runs
from router.bench.fleet_runs import bisect_size
from router.bench.proxy_bench import peer_command
from router.bench.replay import Record, meets, tpot
from router.bench.replicas import Child, Sample
from router.metrics import RouterMetrics


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
    assert fleet_workloads.size_workload(args.workloads) == "sessions@16"
    assert (
        fleet_workloads.session_rate("sessions@16") == 16.0
        and fleet_workloads.session_rate("mooncake-synthetic") is None
    )
    assert args.size_search == ["round-robin", "full"]
    assert args_of("--contenders", "full,oracle").size_search == ["full"]  # by default: those that run
    assert args_of("--contenders", "full", "--size-search", "").size_search == []
    assert args_of("--contenders", "full", "--setting", "bounded_load_c=1.5").settings == {"bounded_load_c": "1.5"}
    for flags, message in (
        (["--contenders", "full,nginx"], "unknown contender 'nginx'"),
        (["--workloads", "sessions,chat"], "unknown workload 'chat'"),
        (["--workloads", "longdoc@2"], "unknown workload 'longdoc@2'"),
        (["--workloads", "sessions@x"], "the rate after @ must be a positive number"),
        (["--workloads", "sessions-keyless@0"], "the rate after @ must be a positive number"),
        (["--workloads", "sessions,sessions@4", "--rate", "4"], "--workloads names 'sessions@4' twice"),
        (["--doc-tokens", "900-100"], "--doc-tokens must be MIN-MAX"),
        (["--doc-turns", "x"], "--doc-turns must look like"),
        (["--docs", "0"], "--docs"),
        (["--doc-rate", "0"], "--doc-rate must be a positive number"),
        (["--workloads", "mooncake-synthetic"], "needs --trace-dir"),
        (["--workloads", "mooncake-synthetic", "--trace-dir", "/nonexistent"], "no trace file"),
        (["--rate", "4,x"], "--rate must be numbers"),
        (["--rate", "0"], "--rate must be positive"),
        (["--rate", "inf"], "--rate must be positive"),
        (["--rate", "4,4"], "--rate names '4' twice"),
        (["--contenders", "full,full"], "--contenders names 'full' twice"),
        (["--replicas", "1"], r"2 <= --replicas <= 1000"),
        (["--replicas", "50000"], r"2 <= --replicas <= 1000"),
        (["--time-scale", "0"], "--time-scale must be a positive number"),
        (["--duration", "inf"], "--duration must be a positive number"),
        (["--turns", "5-2"], "--turns"),
        (["--contenders", "full", "--size-search", "round-robin"], "not among the contenders"),
        (["--setting", "novalue"], "NAME=VALUE"),
        (["--setting", "policy=round_robin"], "set by each contender"),
        (["--setting", "bounded_load_c=0.5"], "bounded_load_c"),
        (["--setting", "no_such_thing=1"], "unknown"),
    ):
        with pytest.raises(ValueError, match=message):
            args_of(*flags)


def test_agents_and_session_replay_are_sessions_of_their_own_shape() -> None:
    args = args_of("--contenders", "full,smg-header", "--workloads", "agents@0.5,session-replay@4,agents-keyless@1")
    assert args.workloads == ["agents@0.5", "session-replay@4", "agents-keyless@1"]
    targets = ["http://127.0.0.1:1"]
    agents = fleet_workloads.workload_options("agents@0.5", args, targets, contenders.CONTENDERS["smg-header"])
    assert agents.spec is not None and agents.spec.rate == 0.5 and agents.spec.system_prompts == 2
    assert agents.spec.system_tokens == 12_000 and agents.spec.turns_max == 30 and agents.spec.think_s == 1.5
    # Claude Code's own session header, beside the one the contender reads
    assert agents.key_headers == ("X-Session-ID", "x-claude-code-session-id")
    keyless = fleet_workloads.workload_options("agents-keyless@1", args, targets, contenders.CONTENDERS["full"])
    assert not keyless.session_keys and "x-claude-code-session-id" not in keyless.key_headers
    replay = fleet_workloads.workload_options("session-replay@4", args, targets, contenders.CONTENDERS["full"])
    assert replay.spec is not None and replay.spec.turns_min == replay.spec.turns_max == 20
    assert fleet_workloads.size_workload(args.workloads) == "session-replay@4"  # the busiest keyed one
    with pytest.raises(ValueError, match="rate after @"):
        fleet_workloads.Workload.parse("agents@0")


def test_workloads_by_name() -> None:
    args = args_of("--contenders", "full", "--rate", "2,8", "--workloads", "sessions-keyless,longdoc,sessions@3")
    assert args.workloads == ["sessions-keyless@2", "sessions-keyless@8", "longdoc", "sessions@3"]
    assert fleet_workloads.session_rate("sessions-keyless@8") == 8.0 and fleet_workloads.session_rate("longdoc") is None
    # the size search runs on the busiest sessions that carry keys
    assert fleet_workloads.size_workload(args.workloads) == "sessions@3"
    assert fleet_workloads.size_workload(["sessions-keyless@8", "longdoc-keyless"]) is None
    parsed = [
        fleet_workloads.Workload.parse(w)
        for w in ("sessions-keyless@2", "longdoc", "longdoc-keyless", "mooncake-synthetic")
    ]
    assert [(w.kind, w.keyed) for w in parsed] == [
        ("sessions", False),
        ("longdoc", True),
        ("longdoc", False),
        ("trace", True),
    ]
    targets = ["http://127.0.0.1:1"]
    for name, keys in (
        ("sessions-keyless@2", False),
        ("sessions@3", True),
        ("longdoc", True),
        ("longdoc-keyless", False),
    ):
        opts = fleet_workloads.workload_options(name, args, targets, contenders.CONTENDERS["full"])
        assert opts.session_keys is keys and opts.workload == name.split("@")[0].removesuffix("-keyless")
    doc = fleet_workloads.workload_options("longdoc", args, targets, contenders.CONTENDERS["full"]).longdoc
    assert doc is not None and (doc.documents, doc.doc_tokens, doc.turns_min, doc.turns_max) == (
        24,
        (6000, 12000),
        3,
        6,
    )
    assert fleet_workloads.arrivals_s("longdoc", args) == args.duration


def test_longdoc_runs_on_its_own_engine_shape() -> None:
    args = args_of("--contenders", "full", "--replicas", "8", "--workloads", "longdoc,sessions")
    assert fleet_workloads.emulator_args("longdoc", args) == list(fleet_workloads.LONGDOC_ENGINE)
    assert fleet_workloads.emulator_args("sessions@4", args) == []
    shape = fleet_workloads.engine_shape("longdoc", args)
    assert shape["kv_tokens_per_replica"] == 6144 * 16 and shape["kv_tokens_fleet"] == 8 * 6144 * 16
    # by default the documents asked about outgrow one replica's KV and fit the fleet's
    assert shape["kv_tokens_per_replica"] < shape["working_set_tokens"] < shape["kv_tokens_fleet"]
    assert 1 < shape["documents_asked"] < 24
    assert fleet_workloads.engine_shape("sessions@4", args)["kv_tokens_per_replica"] == 30000 * 16
    assert "working_set_tokens" not in fleet_workloads.engine_shape("sessions@4", args)
    # --emulator-arg comes after the shape: it changes it, in either spelling
    more = args_of("--contenders", "full", "--workloads", "longdoc", "--emulator-arg=--num-blocks=1000")
    assert fleet_workloads.emulator_args("longdoc", more)[-1] == "--num-blocks=1000"
    assert fleet_workloads.engine_shape("longdoc", more)["kv_tokens_per_replica"] == 16000
    assert fleet_workloads._last_int(["--block-size", "32", "--num-blocks", "x"], "--block-size", 16) == 32
    assert fleet_workloads._last_int(["--num-blocks", "x"], "--num-blocks", 16) is None
    line = fleet_report._shape_line(shape, 8)
    assert line.startswith("Engine: 70B-class, long context (`--num-blocks=6144 ")
    assert "KV for 98,304 tokens a replica, 786,432 in the fleet" in line and "× one replica's KV" in line


def test_contenders_of_the_router_and_the_peers() -> None:
    args = {name: c.args for name, c in contenders.CONTENDERS.items()}
    assert "--policy" not in args["full"] and {"--rebalance", "--warmup"} <= set(args["full"])  # as shipped
    assert args["affinity"] == ("--policy", "affinity", "--rebalance", "--warmup")
    assert args["full-capacity-blind"] == ("--policy", "affinity", "--rebalance", "--warmup", "--no-capacity-caps")
    assert args["full-no-kv-wait"] == ("--rebalance", "--warmup", "--no-ttft-kv-wait")
    assert args["full-no-queue-lag"] == ("--rebalance", "--warmup", "--ttft-queue-gain", "0")
    assert args["least_load"][-2:] == contenders.PLAIN and args["consistent_hash"][-2:] == contenders.PLAIN
    assert args["smg-cache-aware"] == ("--policy", "cache_aware")
    assert args["smg-header"] == ("--policy", "consistent_hashing", "--routing-key-headers", "x-session-id")
    assert contenders.CONTENDERS["smg-header"].key_headers == ("X-Session-ID",)
    assert args["full-model"] == ("--rebalance", "--warmup", "--no-kv-events")  # today's model, events off
    assert args["full-tokenizer"] == args["full"] and contenders.CONTENDERS["full-tokenizer"].tokenizer
    assert contenders.CONTENDERS["full-tokenizer"].engines == ("vllm",)  # the model's files are vLLM's tiny model's


def test_prefill_decode_contenders_split_the_fleet_and_run_only_when_named() -> None:
    c = contenders.CONTENDERS
    assert [n for n, x in c.items() if x.roles] == ["disagg", "disagg-always", "disagg-p25", "disagg-p75", "vllm-pd"]
    assert [n for n, x in c.items() if x.splits and not x.roles] == ["anywhere"]
    assert c["anywhere"].args[-1] == "--prefill-anywhere" and c["anywhere"].engines == ("emulator", "vllm")
    assert c["disagg"].args == c["full"].args and c["disagg-always"].args[-2:] == ("--disagg-min-prompt-tokens", "0")
    assert all(c[n].engines == ("emulator", "vllm") for n in ("disagg", "disagg-always", "vllm-pd"))
    urls = [f"http://127.0.0.1:{9001 + i}" for i in range(5)]
    assert contenders.split_roles(urls) == (urls[:2], urls[2:])
    assert contenders.split_roles(urls[:2]) == ([urls[0]], [urls[1]])
    eight = [f"http://127.0.0.1:{9001 + i}" for i in range(8)]
    assert [len(contenders.split_roles(eight, share)[0]) for share in (0.25, 0.5, 0.75, 0.01, 0.99)] == [2, 4, 6, 1, 7]
    # roles that follow the load: every replica given as a replica, none as prefill or decode
    cmd = contenders.router_command(c["anywhere"], 8000, eight)
    assert "--prefill" not in cmd and cmd.count("--replica") == 8 and "--prefill-anywhere" in cmd
    cmd = contenders.router_command(c["disagg-always"], 8000, urls)
    assert "--replica" not in cmd and cmd[-10:] == [
        *("--prefill", urls[0], "--prefill", urls[1]),
        *("--decode", urls[2], "--decode", urls[3], "--decode", urls[4]),
    ]
    assert contenders.router_command(c["full"], 8000, urls[:1])[-2:] == ["--replica", urls[0]]
    peer, _ = peer_command("vllm", 8000, urls, c["vllm-pd"].args, contenders.split_roles(urls))
    assert "--worker-urls" not in peer and "--vllm-pd-disaggregation" in peer
    assert peer[peer.index("--prefill") : peer.index("--prefill") + 4] == ["--prefill", urls[0], "--prefill", urls[1]]
    # the default contenders leave them out: they run when named
    assert not {"disagg", "disagg-always", "disagg-p25", "anywhere", "vllm-pd"} & set(args_of().contenders)
    assert args_of("--contenders", "full,disagg").contenders == ["full", "disagg"]
    with pytest.raises(ValueError, match="runs with --engine emulator or vllm only"):
        args_of("--engine", "llama-server", "--contenders", "disagg")


def test_time_per_output_token_and_goodput() -> None:
    def record(ttft: float, e2e: float, tokens: int) -> Record:
        return Record("s", 1, "t", ok=True, ttft_s=ttft, e2e_s=e2e, completion_tokens=tokens)

    assert tpot(record(1.0, 2.0, 11)) == pytest.approx(0.1)
    assert tpot(record(1.0, 1.0, 1)) is None and tpot(Record("s", 1, "t")) is None
    slo = (2.0, 0.05)
    assert meets(record(1.0, 1.4, 11), slo) and meets(record(1.9, 1.9, 1), slo)  # one token: TTFT only
    assert not meets(record(2.5, 2.6, 11), slo) and not meets(record(1.0, 2.0, 11), slo)
    runs = [
        run_result(0.3, 2.0, 4.0, 0.01)
        | {"slo_met": 50, "wall_s": 50.0, "time_scale": 2.0, "tpot_s": {"p50": 0.02, "p99": 0.2}, "split_share": 0.5}
    ]
    f = summarize_runs(runs)
    assert f["goodput_rps"] == 0.5 and f["slo_share"] == 50 / runs[0]["ok"] and f["tpot_p99_s"] == 0.2
    result = {
        "replicas": 4,
        "time_scale": 2.0,
        "rounds": 1,
        "disagg": True,
        "slo": {"ttft_s": 5.0, "tpot_s": 0.1},
        "contenders": {"disagg": "router-serve prefill/decode"},
        "tables": {"longdoc": {"disagg": f}},
        "replicas_needed": {},
    }
    md = render_markdown(result)
    assert "| TPOT P50 (ms) | TPOT P99 (ms) | goodput (/s) | within target | split |" in md
    assert "TTFT ≤ 5 s and TPOT ≤ 100 ms" in md
    row = next(line for line in md.splitlines() if line.startswith("| router-serve prefill/decode"))
    assert "| 20.0 | 200.0 | 0.50 |" in row and "| 50.0% |" in row


def test_the_routers_predictions_are_read_from_its_metrics() -> None:
    metrics = RouterMetrics()

    def page() -> fleet_counters.RouterCounts:
        return fleet_counters.RouterCounts.parse(generate_latest(metrics.registry).decode())

    before_run = metrics.child(metrics.prefix_prediction_error, "events")
    before_run.observe(40)  # the readiness request, before the run: not counted
    metrics.child(metrics.requests, "r0", "ttft", "header", "499", "m").inc()  # a client gone before the run
    metrics.child(metrics.tokenize_seconds, "render").observe(0.5)
    before = page()
    for error in (0, 0, 0, -32, 64):  # three exact, one under (the engine had more), one over
        metrics.child(metrics.prefix_prediction_error, "events").observe(error)
    metrics.child(metrics.prefix_prediction_error, "model").observe(0.25)
    metrics.child(metrics.kv_events_believed, "r0").set(1)
    metrics.child(metrics.kv_events_believed, "r1").set(0)
    metrics.child(metrics.tokenize_seconds, "render").observe(0.002)
    metrics.child(metrics.token_checks, "m", "match").inc(2)
    metrics.followups.inc(40)
    metrics.child(metrics.jumps, "cost").inc(2)
    metrics.child(metrics.jumps, "health").inc(1)
    metrics.child(metrics.retries, "reset").inc(2)
    metrics.child(metrics.requests, "r0", "ttft", "header", "200", "m").inc(30)
    metrics.child(metrics.requests, "r1", "ttft", "header", "499", "m").inc(2)  # two clients gone during it
    after = page()
    assert not after.all_believed(2) and not fleet_counters.RouterCounts({}, {"r0": 1}, {}, {}).all_believed(2)
    got = fleet_counters.prediction_figures(before, after)
    events = got["predictions"]["events"]
    assert (events["answers"], events["exact"], events["under"], events["over"]) == (5, 3, 1, 1)
    assert events["buckets"]["-16"] == 1 and events["buckets"]["+Inf"] == 5
    assert got["exact_predicted_events"] == 0.6 and got["predicted_answers_events"] == 5
    assert got["exact_predicted_model"] == 1.0 and got["predicted_answers_model"] == 1
    assert got["kv_events_believed"] == {"r0": 1, "r1": 0}
    assert got["tokenize"]["render"]["count"] == 1 and got["tokenize"]["render"]["seconds"] == pytest.approx(0.002)
    assert got["token_checks"] == {"match": 2}
    assert got["jumps_by_reason"] == {"cost": 2, "health": 1} and got["cost_move_share"] == 0.05
    assert got["router_retries"] == {"reset": 2} and got["client_gone"] == 2
    # a failed run's progress line says what router-serve retried on the way; one without failures, nothing
    assert fleet_runs.failed_why(got | {"errors": {"http 502": 1}}) == " (http 502 x1; router-serve retried: reset 2)"
    assert fleet_runs.failed_why(got | {"errors": {}}) == ""
    kept = got | {"errors": {"http 502": 1}, "router_log": "out/logs/sessions-router-4.log"}
    assert fleet_runs.failed_why(kept).endswith("reset 2; its log: out/logs/sessions-router-4.log)")
    # the table's cell: per source, the share exact of how many; none without answers; n/a for a peer
    assert fleet_report.exact_cell(got) == "60.0% of 5 / 100.0% of 1"
    assert fleet_report.exact_cell(fleet_counters.prediction_figures(before, before)) == "none / none"
    assert fleet_report.exact_cell({"kv_hit_rate": 0.5}) == "n/a"
    med = summarize_runs([{**run_result(0.5, 1.0, 2.0, 0.1), **got}])
    assert med["exact_predicted_events"] == 0.6 and fleet_report.exact_cell(med) == "60.0% of 5 / 100.0% of 1"


def test_a_childs_log_is_kept_from_its_tail(tmp_path: Path) -> None:
    child = Child.spawn(
        [sys.executable, "-c", "import sys; sys.stderr.write('x' * 5000 + '\\nthe replica refused\\n')"], "a child"
    )
    try:
        assert child.proc.wait(30) == 0
        whole = child.keep_log(tmp_path / "logs" / "run.log").read_text()
        assert whole.startswith("xxx") and whole.endswith("the replica refused\n") and len(whole) == 5021
        tail = child.keep_log(tmp_path / "tail.log", limit=20).read_text()
        assert tail == "the replica refused\n"
    finally:
        child.stop()


def test_cli_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["fleet", "--contenders", "bogus"])
    assert args.run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("router-bench fleet: unknown contender")


def run_result(
    hit: float, mean: float, p99: float, cv: float, router_cpu: float | None = 0.1, ok: int = 100
) -> dict[str, Any]:
    return {
        "kv_hit_rate": hit,
        "e2e_later_turns_s": {"n": 10, "mean": mean, "p99": p99},
        "ttft_s": {"n": 10, "p99": p99 / 10},
        "ttft_later_turns_s": {"n": 8, "p99": p99 / 20},
        "load_cv": cv,
        "inflight_cv": cv * 2,
        "jump_rate": 0.5,
        "gpu_busy": 0.8,
        "requests": 100,
        "ok": ok,
        "client_cpu_share": 0.1,
        "emulator_cpu_share": 0.2,
        "router_cpu_share": router_cpu,
    }


def test_medians_tables_and_ratios() -> None:
    runs = [run_result(0.3, 2.0, 4.0, 0.01), run_result(0.4, 2.2, 5.0, 0.02), run_result(0.35, 9.0, 4.5, 0.03, ok=97)]
    med = summarize_runs(runs)
    assert med["kv_hit_rate"] == 0.35 and med["multi_turn_mean_s"] == 2.2 and med["multi_turn_p99_s"] == 4.5
    assert med["rounds"] == 3 and med["failed"] == 3  # failures are summed over rounds, not a median
    assert summarize_runs([{"error": "sglang-router exited"}]) == {"error": "sglang-router exited", "rounds": 0}
    full = summarize_runs([run_result(0.7, 1.1, 1.5, 0.04)])
    rr = summarize_runs([run_result(0.35, 2.2, 4.5, 0.01, router_cpu=None)])
    result = {
        "replicas": 20,
        "time_scale": 2.0,
        "rounds": 1,
        "contenders": {
            "round-robin": "round-robin (client)",
            "full": "router-serve full policy",
            "oracle": "oracle",
            "vllm": "vllm-router",
        },
        "tables": {"sessions@16": {"round-robin": rr, "full": full, "vllm": {"error": "exited", "rounds": 0}}},
        "replicas_needed": {
            "workload": "sessions@16",
            "target_p99_s": 4.5,
            "contenders": {
                "round-robin": {"needed": 20, "lowest_probed": 10},
                "full": {"needed": 14, "lowest_probed": 10},
            },
        },
    }
    md = render_markdown(result)
    rows = [line for line in md.splitlines() if line.startswith("| round-robin (client)")]
    assert "| 35.0% |" in rows[0] and rows[0].endswith("| 20 |")
    assert "| 0.450 | 0.225 |" in rows[0]  # TTFT P99, then the later turns' TTFT P99
    assert "| later-turn TTFT P99 (s) |" in md
    assert "replicas for P99 ≤ 4.50 s" in md
    assert next(line for line in md.splitlines() if line.startswith("| router-serve full policy")).endswith("| 14 |")
    # the full policy against round robin: hit 2.00x, mean -50%, P99 3.00x lower
    assert "| round-robin (client) | 2.00× | -50% | 3.00× | 0.040 / 0.010 |" in md
    assert "routers: router-serve full policy 10%." in md
    assert "| vllm-router | did not run: exited |" in md
    result["replicas_needed"]["contenders"]["full"]["needed"] = 10  # the search's floor: "at most"
    assert next(ln for ln in render_markdown(result).splitlines() if ln.startswith("| router-serve")).endswith("≤ 10 |")
    assert "Sessions cut" not in md
    full["sessions_cut"] = 2  # a slow run reached the drain cap: its row is short of turns, and says so
    assert (
        "Sessions cut at the drain cap (3 × `--duration`), their later turns never sent: router-serve full policy 2."
        in render_markdown(result)
    )
    assert "an earlier turn of their conversation failed" not in md
    full["turns_dropped"] = 3  # refused turns ended their conversations: the row is short, and says so
    assert (
        "Turns never sent because an earlier turn of their conversation failed (a refusal among them): "
        "router-serve full policy 3." in render_markdown(result)
    )


async def test_a_fleet_that_fails_requests_does_not_meet_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    async def fake_run_one(args: Any, c: Any, workload: str, n: int, progress: Any) -> dict[str, Any]:
        # every size keeps its P99, but below 15 replicas only by failing or cutting requests
        return {
            "e2e_later_turns_s": {"p99": 1.0},
            "requests": 10,
            "ok": 10 if n >= 14 else 9,
            "sessions_cut": 0 if n >= 15 else 1,
        }

    monkeypatch.setattr(fleet_runs, "run_one", fake_run_one)
    args = args_of("--contenders", "round-robin,full")
    full = {"multi_turn_p99_s": 1.0, "failed": 0, "sessions_cut": 0}
    found = await fleet_runs.size_search(args, "full", "sessions@16", full, 2.0, None, lambda msg: None)
    assert found["needed"] == 15 and found["lowest_probed"] == 10
    assert found["probes"][20] == full  # the full-size run is the first probe
