"""`router-bench replay` ends when it says: `--duration` is the whole run, SIGINT and SIGTERM print
the results so far; and the progress line it shows meanwhile (router.bench.live)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from router.bench.common import free_port
from router.bench.live import PROGRESS_ENV, Progress
from router.bench.replay import Replayer, ReplayOptions, render
from router.bench.workloads import SessionsSpec
from router.emulator.server import Faults

# long replies, sessions that would outlive the run: a drained run would take minutes
LONG = SessionsSpec(rate=4, turns_min=4, turns_max=6, think_s=2.0, reply_tokens=(150, 250), users=20, seed=3)


def test_progress_is_quiet_off_a_terminal_and_plain_lines_when_asked() -> None:
    quiet = io.StringIO()
    Progress(quiet, environ={}).show("nothing")
    assert quiet.getvalue() == ""
    off = io.StringIO()
    Progress(off, environ={PROGRESS_ENV: "0"}).show("nothing")
    assert off.getvalue() == ""
    plain = io.StringIO()
    every = Progress(plain, environ={PROGRESS_ENV: "0.05"})
    every.show("too soon")  # the first line comes one interval in, not at once
    time.sleep(0.06)
    every.show("first")
    every.show("too soon again")
    assert plain.getvalue() == "  first\n"


async def test_a_ticking_progress_line_comes_while_nothing_answers() -> None:
    out = io.StringIO()
    progress = Progress(out, environ={PROGRESS_ENV: "0.1"})
    calls = []

    def describe() -> str:
        calls.append(1)
        return f"tick {len(calls)}"

    async with progress.ticking(describe):
        await asyncio.sleep(1.3)  # nothing happens; the line still comes (TICK_S = 1 s)
    assert out.getvalue().startswith("  tick 1\n")


async def test_duration_is_the_whole_run_against_a_slow_replica(start_fleet) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1, time_scale=1.0, faults=Faults(slow=4.0))
    lines: list[str] = []
    opts = ReplayOptions(targets=(fleet.replicas[0].url,), workload="sessions", duration_s=4, cut_off=True, spec=LONG)
    t0 = time.monotonic()
    result = await Replayer(opts, lines.append).run()
    took = time.monotonic() - t0
    assert took < 4 + 15  # drained, the sessions started in 4 s would run on for minutes
    assert result["cut_off"] > 0 and result["errors"] == {}  # cut off is not an error
    assert result["requests"] == result["ok"] + result["cut_off"]
    assert result["e2e_s"]["n"] == result["ok"] and result["ttft_s"]["n"] == result["ok"]  # cut ones: no latency
    assert result["sessions_cut"] > 0 and result["cut_off_at_duration"] is True
    assert lines and "in flight" in lines[-1] and "s left" in lines[-1]  # ticks, even with nothing answered
    assert "cut off, not errors, and in no latency" in render(result)


def _emulator(port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.emulator.cli", "--port", str(port), "--fault", "slow=3"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and "listening" in proc.stdout.readline()
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_prints_the_partial_results(sig: int, tmp_path: Any) -> None:
    port = free_port()
    emulator = _emulator(port)
    err_path = tmp_path / "stderr"
    try:
        with err_path.open("w") as err:
            bench = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "router.bench.cli",
                    "replay",
                    "--json",
                    "--target",
                    f"http://127.0.0.1:{port}",
                    "--duration",
                    "120",
                    "--rate",
                    "4",
                ],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env={**os.environ, PROGRESS_ENV: "0.5"},
            )
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and "done " not in err_path.read_text():
                time.sleep(0.2)
            time.sleep(2)  # some answers in, some in flight
            bench.send_signal(sig)
            out, _ = bench.communicate(timeout=30)
        stderr = err_path.read_text()
        assert bench.returncode == 128 + sig, stderr
        result = json.loads(out)  # stdout is the JSON alone: progress went to stderr
        assert result["partial"]["stopped_by"] == signal.Signals(sig).name
        assert 0 < result["partial"]["after_s"] < 60 and result["wall_s"] < 60
        assert result["requests"] > 0 and result["requests"] == result["ok"] + result["cut_off"]
        assert result["errors"] == {}
        assert "the run ends after 120 s" in stderr and "stopping; the results so far follow" in stderr
        assert any(line.startswith("  [") and "KV hit" in line for line in stderr.splitlines())
    finally:
        emulator.terminate()
        emulator.wait(timeout=10)


def test_a_target_that_cannot_be_reached_is_named_at_once_not_after_the_run() -> None:
    port = free_port()  # nothing listens there
    started = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "router.bench.cli",
            "replay",
            "--target",
            f"http://127.0.0.1:{port}",
            "--duration",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and out.stdout == "" and time.monotonic() - started < 20
    assert (
        out.stderr
        == f"router-bench replay: cannot reach http://127.0.0.1:{port} (Connection refused): is it running?\n"
    )


async def test_a_run_with_no_answers_reports_no_hit_rate() -> None:
    opts = ReplayOptions(
        targets=("http://127.0.0.1:9",), workload="sessions", time_scale=20.0, duration_s=1, requests=2
    )
    text = render(await Replayer(opts).run())
    assert "KV hit rate        n/a (no answers)" in text and "load CV            n/a (no answers)" in text
