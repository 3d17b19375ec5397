"""router-emulator --otlp-traces-endpoint in a real process: an `llm_request` SERVER span per finished
request, as vLLM 0.32 exports it, under the client's traceparent or at the root of a trace of its
own, with the response's token counts; the spans still batched go out at exit; a protocol other
than http/protobuf is refused (exit 2)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest
from otlp_receiver import OtlpReceiver, ReceivedSpan

from router.bench.common import free_port

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CHAT = {"model": "emulated-llm", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
WAIT_S = 10.0


async def ended(proc: subprocess.Popen[bytes], timeout: float = WAIT_S) -> int:
    """Its exit status, waited for without blocking the loop (the receiver on it answers the
    exporter's last batch meanwhile)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() >= deadline:
            proc.kill()
            proc.wait(timeout=5)
            raise AssertionError(f"router-emulator (pid {proc.pid}) did not exit within {timeout} s")
        await asyncio.sleep(0.02)
    return proc.returncode


@asynccontextmanager
async def emulator(traces_url: str, replicas: int, **env: str) -> AsyncIterator[int]:
    """router-emulator serving `replicas` replicas, tracing to `traces_url`; yields the first port.
    At the end it is stopped with SIGTERM and must exit 0."""
    port = free_port(replicas)
    args = ["--replicas", str(replicas), "--base-port", str(port), "--time-scale", "10"]
    inherited = {k: v for k, v in os.environ.items() if k != "OTEL_SERVICE_NAME"}
    environment = inherited | {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"} | env
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.emulator.cli", *args, "--otlp-traces-endpoint", traces_url],
        stdout=subprocess.DEVNULL,
        env=environment,
    )
    try:
        deadline = time.monotonic() + WAIT_S
        async with aiohttp.ClientSession() as session:
            for p in range(port, port + replicas):
                while True:
                    try:
                        async with session.get(f"http://127.0.0.1:{p}/health") as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientConnectionError:
                        pass
                    assert proc.poll() is None, f"router-emulator exited with status {proc.returncode}"
                    assert time.monotonic() < deadline, f"router-emulator did not listen on {p} within {WAIT_S} s"
                    await asyncio.sleep(0.05)
        yield port
        proc.terminate()
        assert await ended(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)


async def chat(port: int, headers: dict[str, str] | None = None) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        async with session.post(url, data=orjson.dumps(CHAT), headers=headers or {}) as resp:
            assert resp.status == 200, await resp.text()
            answer: dict[str, Any] = await resp.json()
            return answer


def llm_requests(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    return [span for span in spans if span.name == "llm_request"]


async def test_a_request_is_traced_under_its_traceparent_and_one_without_at_a_root() -> None:
    async with OtlpReceiver() as receiver, emulator(receiver.traces_url, 2, OTEL_BSP_SCHEDULE_DELAY="100") as port:
        traced = await chat(port, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
        untraced = await chat(port + 1)
        spans = await receiver.wait_for(lambda got: len(llm_requests(got)) == 2 and llm_requests(got), WAIT_S)

    by_id = {span.attributes["gen_ai.request.id"]: span for span in spans}
    assert set(by_id) == {traced["id"], untraced["id"]}

    child = by_id[traced["id"]]
    assert (child.kind, child.trace_id, child.parent_span_id) == ("SERVER", CLIENT_TRACE, CLIENT_SPAN)
    assert child.service == "router-emulator"
    attributes = child.attributes
    assert attributes["gen_ai.usage.prompt_tokens"] == traced["usage"]["prompt_tokens"]
    assert attributes["gen_ai.usage.completion_tokens"] == traced["usage"]["completion_tokens"] == 4
    assert attributes["gen_ai.request.max_tokens"] == 4
    assert attributes["router.emulator.replica"] == f"emu-{port}"
    queue, ttft, e2e = (attributes[f"gen_ai.latency.{n}"] for n in ("time_in_queue", "time_to_first_token", "e2e"))
    assert 0 <= queue <= ttft <= e2e
    assert attributes["gen_ai.latency.time_in_model_inference"] == pytest.approx(e2e - queue)
    assert child.start_ns < child.end_ns

    root = by_id[untraced["id"]]
    assert (root.kind, root.parent_span_id) == ("SERVER", "")
    assert root.trace_id not in ("", CLIENT_TRACE)
    assert root.attributes["router.emulator.replica"] == f"emu-{port + 1}"
    assert root.attributes["gen_ai.usage.prompt_tokens"] == untraced["usage"]["prompt_tokens"]
    assert root.attributes["gen_ai.usage.completion_tokens"] == untraced["usage"]["completion_tokens"]


async def test_the_spans_still_batched_go_out_at_exit_under_its_service_name() -> None:
    async with OtlpReceiver() as receiver:
        # a batch that would wait a minute: only the exit's flush sends it
        async with emulator(
            receiver.traces_url, 1, OTEL_BSP_SCHEDULE_DELAY="60000", OTEL_SERVICE_NAME="replica-a"
        ) as port:
            answer = await chat(port)
            await asyncio.sleep(0.3)
            assert not receiver.named("llm_request")
        spans = await receiver.wait_for(llm_requests, WAIT_S)
    assert [(span.attributes["gen_ai.request.id"], span.service) for span in spans] == [(answer["id"], "replica-a")]


def test_a_protocol_other_than_http_protobuf_is_refused() -> None:
    env = os.environ | {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}
    args = ["--port", str(free_port()), "--otlp-traces-endpoint", "http://127.0.0.1:4317"]
    proc = subprocess.run(
        [sys.executable, "-m", "router.emulator.cli", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("router-emulator: ")
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='grpc'" in proc.stderr
