"""OpenTelemetry traces of proxied requests (router.tracing), received by an OTLP/HTTP receiver: a
span per request with its intake, routing decision and each attempt (a failover included), the
replica handed the attempt's own trace context, a client's trace continued, and the access log
naming the trace."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from otlp_receiver import OtlpReceiver, ReceivedSpan

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once it is closed: a replica that is down


@pytest.fixture
async def replica() -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    """A stand-in replica that answers every chat request and keeps each request's headers."""
    seen: list[dict[str, str]] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        await request.read()
        answer = {
            "id": "x",
            "object": "chat.completion",
            "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8},
        }
        return web.json_response(answer)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


async def test_a_request_is_traced_from_intake_through_a_failover_into_the_replica(
    replica: tuple[str, list[dict[str, str]]],
    start_router: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, seen = replica
    async with OtlpReceiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        down = f"http://127.0.0.1:{closed_port()}"
        node, router = await start_router(
            [f"down={down}", f"up={url}"], health_checks="false", log_requests="true", policy="consistent_hash"
        )
        assert node.tracing is not None
        # a session the ring gives to the replica that is down: it fails over to the one that is up
        session = next(f"s{i}" for i in range(500) if node.fleet.ring.lookup(f"s{i}".encode()) == 0)
        body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
        caplog.set_level(logging.INFO, "router.access")
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                router + "/v1/chat/completions",
                data=orjson.dumps(body),
                headers={"X-Session-ID": session, "traceparent": parent},
            ) as r,
        ):
            assert r.status == 200 and r.headers["X-Router-Replica"] == "up"

        def whole(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]] | None:
            ours = [s for s in spans if s.trace_id == CLIENT_TRACE]
            by_name: dict[str, list[ReceivedSpan]] = {}
            for s in ours:
                by_name.setdefault(s.name, []).append(s)
            done = "chat m" in by_name and len(by_name.get("attempt", [])) == 2
            return by_name if done and "route" in by_name and "intake" in by_name else None

        spans = await receiver.wait_for(whole, timeout=10)
    request = spans["chat m"][0]
    # the client's trace goes on: the request's span is the child of the client's
    assert request.kind == "SERVER" and request.parent_span_id == CLIENT_SPAN
    attributes = request.attributes
    assert attributes["gen_ai.request.model"] == "m" and attributes["gen_ai.usage.input_tokens"] == 7
    assert attributes["gen_ai.usage.output_tokens"] == 1 and attributes["gen_ai.request.max_tokens"] == 4
    assert attributes["http.response.status_code"] == 200 and attributes["router.replica"] == "up"
    for name in ("intake", "route"):
        assert spans[name][0].parent_span_id == request.span_id
    route = spans["route"][0].attributes
    assert route["router.policy"] == "consistent_hash" and route["router.replica"] == "down"
    failed, served = sorted(spans["attempt"], key=lambda s: s.attributes["router.attempt"])
    assert failed.attributes["router.replica"] == "down" and failed.status == "ERROR"
    assert failed.attributes["router.outcome"] == "connect"
    assert served.attributes["router.replica"] == "up" and served.attributes["router.outcome"] == "ok"
    assert served.kind == "CLIENT" and served.parent_span_id == request.span_id
    # the replica was handed the served attempt's own trace context, not the client's
    _, trace_id, span_id, _ = seen[-1]["traceparent"].split("-")
    assert (trace_id, span_id) == (CLIENT_TRACE, served.span_id)
    # and the access log names the trace
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "router.access"]
    assert lines and lines[-1]["trace_id"] == CLIENT_TRACE


async def test_with_traces_off_a_clients_trace_context_passes_through_untouched(
    replica: tuple[str, list[dict[str, str]]], start_router: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, seen = replica
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    node, router = await start_router([f"up={url}"], health_checks="false")
    assert node.tracing is None
    parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    async with (
        aiohttp.ClientSession() as http,
        http.post(router + "/v1/chat/completions", data=orjson.dumps(body), headers={"traceparent": parent}) as r,
    ):
        assert r.status == 200
    assert seen[-1]["traceparent"] == parent  # the engine joins the client's trace itself
