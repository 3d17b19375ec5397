"""Traces (router.tracing): off without OTEL_* configuration, and on, a request's spans reach an
OTLP/HTTP receiver with their parents, kinds, attributes and statuses."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import orjson
import pytest
from aiohttp import ClientSession
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes
from otlp_receiver import OtlpReceiver, ReceivedSpan

from router import tracing
from router.tracing import RequestTrace, Tracing, TracingConfigError, setup

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture(autouse=True)
def no_otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    """A receiver on its own thread, and the environment pointing the router's traces at it."""
    with OtlpReceiver().threaded() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        yield receiver


@pytest.fixture
def traced(receiver: OtlpReceiver) -> Iterator[Tracing]:
    traced = setup()
    assert traced is not None
    yield traced
    traced.shutdown()


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [span for span in spans if span.name == name]
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def export(traced: Tracing, receiver: OtlpReceiver, count: int) -> list[ReceivedSpan]:
    assert traced.flush()
    spans: list[ReceivedSpan] = receiver.wait_for_blocking(lambda spans: spans if len(spans) >= count else None)
    return spans


def test_off_without_configuration() -> None:
    assert tracing.exporters_from_environment() == []
    assert setup() is None


@pytest.mark.parametrize(
    "environment",
    [
        {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
        {"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "console"},
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces"},
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},  # a protocol is no endpoint
    ],
)
def test_off_when_the_environment_says_so(monkeypatch: pytest.MonkeyPatch, environment: dict[str, str]) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert setup() is None


@pytest.mark.parametrize(
    ("environment", "exporters"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),  # asked for: the SDK's default endpoint
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "otlp, console"}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, ["otlp"]),
        # the traces' own protocol rules over the general one
        (
            {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            },
            ["otlp"],
        ),
    ],
)
def test_on_when_an_exporter_is_configured(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], exporters: list[str]
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert tracing.exporters_from_environment() == exporters


@pytest.mark.parametrize(
    "environment",
    [
        {"OTEL_TRACES_EXPORTER": "zipkin"},
        {"OTEL_TRACES_EXPORTER": "otlp,jaeger"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
    ],
)
def test_an_exporter_the_router_lacks_is_refused(monkeypatch: pytest.MonkeyPatch, environment: dict[str, str]) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(TracingConfigError, match="OTEL_"):
        setup()


def test_the_console_exporter_prints_spans() -> None:
    """In a process of its own: the exporter holds the stdout of when the SDK was imported."""
    script = (
        "import time; from router.tracing import setup; traced = setup(); "
        "traced.request('POST', '/v1/chat/completions', {}, time.monotonic()).finish(200, model='m')"
    )
    environment = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    environment["OTEL_TRACES_EXPORTER"] = "console"
    done = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=60, check=True
    )
    assert '"name": "chat m"' in done.stdout  # printed at exit, by the provider's own shutdown


def test_the_gen_ai_names_are_the_conventions() -> None:
    assert tracing.GEN_AI_OPERATION_NAME == gen_ai_attributes.GEN_AI_OPERATION_NAME
    assert tracing.GEN_AI_REQUEST_MODEL == gen_ai_attributes.GEN_AI_REQUEST_MODEL
    assert tracing.GEN_AI_REQUEST_MAX_TOKENS == gen_ai_attributes.GEN_AI_REQUEST_MAX_TOKENS
    assert tracing.GEN_AI_USAGE_INPUT_TOKENS == gen_ai_attributes.GEN_AI_USAGE_INPUT_TOKENS
    assert tracing.GEN_AI_USAGE_OUTPUT_TOKENS == gen_ai_attributes.GEN_AI_USAGE_OUTPUT_TOKENS
    known = {value.value for value in gen_ai_attributes.GenAiOperationNameValues}
    assert {"chat", "text_completion", "embeddings"} <= known
    assert set(tracing.OPERATIONS.values()) - known == {"count_tokens"}


def journey(traced: Tracing, headers: dict[str, str] | None = None) -> tuple[RequestTrace, list[dict[str, str]]]:
    """A chat request's whole journey: taken in, routed, queued, a replica that cannot be reached,
    one whose stream breaks, and its continuation on a third. Returns the trace and the headers
    each attempt sent."""
    t0 = time.monotonic() - 0.010
    trace = traced.request("POST", "/v1/chat/completions", headers or {}, t0)
    trace.intake(t0, t0 + 0.001, body_bytes=321)
    trace.routed(
        t0 + 0.001, t0 + 0.002, "ttft", "r1", "cached", key_kind="prefix", predicted_ttft_ms=41.5, cached_tokens=96
    )
    trace.queued(t0 + 0.002, t0 + 0.008)
    sent = []
    first = trace.attempt("r1", "http://10.0.0.1:8000/v1/chat/completions", 1)
    sent.append(first.headers())
    first.end("connect")
    second = trace.attempt("r2", "http://10.0.0.2:8000/v1/chat/completions", 2, resend=True)
    sent.append(second.headers())
    second.end("ok", 200)
    resumed = trace.resume("r3", "http://10.0.0.3:8000/v1/chat/completions", 3, broke_on="r2")
    sent.append(resumed.headers())
    resumed.end("ok", 200)
    trace.finish(
        200,
        model="llama-3",
        input_tokens=120,
        output_tokens=30,
        max_tokens=64,
        tenant="acme",
        key_id="k-7",
        replica="r3",
    )
    return trace, sent


def test_a_request_trace_reaches_the_receiver(traced: Tracing, receiver: OtlpReceiver) -> None:
    trace, sent = journey(traced)
    assert trace.sampled
    spans = export(traced, receiver, 7)
    assert sorted(span.name for span in spans) == sorted(
        ["chat llama-3", "intake", "route", "queue", "attempt", "attempt", "resume"]
    )
    server = one(spans, "chat llama-3")
    assert server.trace_id == trace.trace_id
    assert len(trace.trace_id) == 32 and int(trace.trace_id, 16)
    assert server.parent_span_id == "" and server.kind == "SERVER" and server.status == "UNSET"
    assert server.service == "router-serve"
    assert server.attributes == {
        "http.request.method": "POST",
        "url.path": "/v1/chat/completions",
        "http.response.status_code": 200,
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "llama-3",
        "gen_ai.request.max_tokens": 64,
        "gen_ai.usage.input_tokens": 120,
        "gen_ai.usage.output_tokens": 30,
        "router.tenant": "acme",
        "router.key_id": "k-7",
        "router.policy": "ttft",
        "router.replica": "r3",  # the one that served it; the route span names the one chosen
        "router.reason": "cached",
        "router.key_kind": "prefix",
        "router.predicted_ttft_ms": 41.5,
        "router.cached_tokens": 96,
    }
    for span in spans:
        assert span.trace_id == server.trace_id
        if span is not server:
            assert span.parent_span_id == server.span_id, span.name
            assert server.start_ns <= span.start_ns <= span.end_ns <= server.end_ns, span.name
    assert one(spans, "intake").attributes == {"router.body_bytes": 321}
    assert one(spans, "intake").end_ns - one(spans, "intake").start_ns == pytest.approx(1_000_000, abs=1000)
    assert one(spans, "queue").end_ns - one(spans, "queue").start_ns == pytest.approx(6_000_000, abs=1000)
    assert one(spans, "route").kind == "INTERNAL"
    assert one(spans, "route").attributes == {
        "router.policy": "ttft",
        "router.replica": "r1",
        "router.reason": "cached",
        "router.key_kind": "prefix",
        "router.predicted_ttft_ms": 41.5,
        "router.cached_tokens": 96,
    }
    attempts = sorted(receiver.named("attempt"), key=lambda span: span.attributes["router.attempt"])
    failed, served = attempts
    assert failed.kind == "CLIENT" and failed.status == "ERROR"
    assert failed.attributes == {
        "router.replica": "r1",
        "url.full": "http://10.0.0.1:8000/v1/chat/completions",
        "router.attempt": 1,
        "router.outcome": "connect",
        "error.type": "connect",
    }
    assert served.kind == "CLIENT" and served.status == "UNSET"
    assert served.attributes == {
        "router.replica": "r2",
        "url.full": "http://10.0.0.2:8000/v1/chat/completions",
        "router.attempt": 2,
        "router.resend": True,
        "router.outcome": "ok",
        "http.response.status_code": 200,
    }
    resumed = one(spans, "resume")
    assert resumed.kind == "CLIENT"
    assert resumed.attributes["router.broke_on"] == "r2" and resumed.attributes["router.replica"] == "r3"
    # each attempt names itself the parent of what the replica does: traceparent version-trace-span-flags,
    # sampled (01), and here also the trace id's "random" flag (02) of trace context level 2
    for headers, span in zip(sent, [failed, served, resumed], strict=True):
        assert headers == {"traceparent": f"00-{server.trace_id}-{span.span_id}-03"}


def test_a_client_traceparent_parents_the_request(traced: Tracing, receiver: OtlpReceiver) -> None:
    client = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "vendor=opaque"}
    trace, sent = journey(traced, client)
    assert trace.trace_id == CLIENT_TRACE
    spans = export(traced, receiver, 7)
    server = one(spans, "chat llama-3")
    assert (server.trace_id, server.parent_span_id) == (CLIENT_TRACE, CLIENT_SPAN)
    assert {span.trace_id for span in spans} == {CLIENT_TRACE}
    attempt = sorted(receiver.named("attempt"), key=lambda span: span.attributes["router.attempt"])[0]
    assert sent[0]["traceparent"] == f"00-{CLIENT_TRACE}-{attempt.span_id}-01"  # the client's flags
    assert sent[0]["tracestate"] == "vendor=opaque"  # the client's vendors' state travels on


def test_an_unsampled_client_trace_is_not_exported_but_travels_on(traced: Tracing, receiver: OtlpReceiver) -> None:
    client = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"}  # the client's sampler said no
    trace, sent = journey(traced, client)
    assert trace.trace_id == CLIENT_TRACE and not trace.sampled
    (traceparent,) = {headers["traceparent"] for headers in sent}  # no attempt span: the request's own
    assert traceparent.startswith(f"00-{CLIENT_TRACE}-") and traceparent.endswith("-00")
    assert traced.flush()
    assert receiver.spans == []


def test_the_sampler_is_the_environment_s(monkeypatch: pytest.MonkeyPatch, receiver: OtlpReceiver) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    traced = setup()
    assert traced is not None
    try:
        trace, sent = journey(traced)
        assert not trace.sampled and len(trace.trace_id) == 32
        assert int(sent[0]["traceparent"][-2:], 16) & 1 == 0  # not sampled (02: the trace id is random)
        assert traced.flush()
        assert receiver.spans == []
    finally:
        traced.shutdown()


def test_a_5xx_is_an_error(traced: Tracing, receiver: OtlpReceiver) -> None:
    t0 = time.monotonic()
    trace = traced.request("POST", "/v1/completions", {}, t0)
    attempt = trace.attempt("r1", "http://10.0.0.1:8000/v1/completions", 1)
    attempt.end("http_5xx", 503)
    trace.finish(502, model="m")
    spans = export(traced, receiver, 2)
    server = one(spans, "text_completion m")
    assert server.status == "ERROR"
    assert server.attributes["error.type"] == "502"
    assert server.attributes["http.response.status_code"] == 502
    assert server.attributes["gen_ai.operation.name"] == "text_completion"
    assert one(spans, "attempt").attributes["http.response.status_code"] == 503


@pytest.mark.parametrize(
    ("status", "error", "expected"),
    [
        (200, None, ("UNSET", None)),
        (200, "stream_broken", ("ERROR", "stream_broken")),  # a stream cut after its 200
        (429, "queue_full", ("UNSET", "queue_full")),  # the client's, not the server's
        (404, None, ("UNSET", None)),
        (504, "timeout", ("ERROR", "timeout")),
    ],
)
def test_which_answers_are_errors(
    traced: Tracing, receiver: OtlpReceiver, status: int, error: str | None, expected: tuple[str, str | None]
) -> None:
    traced.request("POST", "/v1/embeddings", {}, time.monotonic()).finish(status, error=error)
    (span,) = export(traced, receiver, 1)
    assert span.name == "embeddings"  # no model named
    assert (span.status, span.attributes.get("error.type")) == expected


def test_a_path_no_api_serves_is_named_by_its_method(traced: Tracing, receiver: OtlpReceiver) -> None:
    traced.request("GET", "/v1/models", {}, time.monotonic()).finish(200, model="m")
    (span,) = export(traced, receiver, 1)
    assert span.name == "GET"
    assert "gen_ai.operation.name" not in span.attributes


async def test_the_batch_processor_exports_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a receiver on the test's own loop: no flush, the processor's schedule sends the spans;
    OTEL_SERVICE_NAME names the service, over setup's default."""
    async with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.traces_url)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "router-worker-3")
        traced = setup()
        assert traced is not None
        try:
            traced.request("POST", "/v1/messages", {}, time.monotonic()).finish(200, model="claude")
            (span,) = await receiver.wait_for(lambda spans: spans)
        finally:
            traced.shutdown()  # (nothing left to send: it does not wait on this loop)
    assert span.name == "chat claude"
    assert span.service == "router-worker-3"


async def test_the_receiver_reads_otlp_json() -> None:
    request = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "engine"}}]},
                "scopeSpans": [
                    {
                        "spans": [
                            {
                                "traceId": CLIENT_TRACE.upper(),
                                "spanId": CLIENT_SPAN,
                                "parentSpanId": "",
                                "name": "llm_request",
                                "kind": 2,
                                "startTimeUnixNano": "1",
                                "endTimeUnixNano": "2",
                                "attributes": [
                                    {"key": "gen_ai.usage.prompt_tokens", "value": {"intValue": "12"}},
                                    {"key": "gen_ai.latency.e2e", "value": {"doubleValue": 0.5}},
                                ],
                                "status": {"code": 2, "message": "boom"},
                            }
                        ]
                    }
                ],
            }
        ]
    }
    async with OtlpReceiver() as receiver, ClientSession() as session:
        async with session.post(
            receiver.traces_url, data=orjson.dumps(request), headers={"Content-Type": "application/json"}
        ) as answer:
            assert answer.status == 200
            assert await answer.json() == {}
        (span,) = await receiver.wait_for(lambda spans: spans, timeout=2.0)
    assert (span.trace_id, span.span_id, span.parent_span_id) == (CLIENT_TRACE, CLIENT_SPAN, "")
    assert (span.kind, span.status, span.status_message, span.service) == ("SERVER", "ERROR", "boom", "engine")
    assert span.attributes == {"gen_ai.usage.prompt_tokens": 12, "gen_ai.latency.e2e": 0.5}


async def test_a_wait_is_bounded() -> None:
    async with OtlpReceiver() as receiver:
        with pytest.raises(AssertionError, match=r"not within 0\.1 s.*received: \[\]"):
            await receiver.wait_for(lambda spans: spans, timeout=0.1)
    with OtlpReceiver().threaded() as receiver, pytest.raises(AssertionError, match=r"not within 0\.1 s"):
        receiver.wait_for_blocking(lambda spans: spans, timeout=0.1)
