"""router-serve in front of emulated replicas: affinity, keys, streaming, failover, limits, admin."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from waiting import until

from router.config import load
from router.node import Node
from router.proxy.app import build_app

SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 20}


def named(replicas: Any) -> list[str]:
    """Replica specs whose router ids match the emulators' own names (emu-0, emu-1, ...)."""
    return [f"{r.options.replica_id}={r.url}" for r in replicas]


def samples(text: str, name: str) -> list[Any]:
    """The samples of `name` in a /metrics page."""
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "emulated-llm", "messages": [SYSTEM, {"role": "user", "content": text}], "max_tokens": 4} | extra


async def call(
    url: str,
    body: Any,
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
    raw: bytes | None = None,
) -> tuple[int, Any, bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            url + path,
            data=raw if raw is not None else orjson.dumps(body),
            allow_redirects=False,
            headers={"Content-Type": "application/json"} | (headers or {}),
        ) as r,
    ):
        return r.status, r.headers, await r.read()


async def test_turns_of_a_session_stay_on_one_replica(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(4)
    router, url = await start_router(named(fleet.replicas))
    homes = set()
    for session in range(12):
        history = [SYSTEM, {"role": "user", "content": f"question {session} " * 30}]
        seen = set()
        for turn in range(3):
            status, headers, body = await call(
                url, {"messages": history, "max_tokens": 8}, {"X-Session-ID": f"s-{session}"}
            )
            assert status == 200
            assert headers["X-Router-Replica"] == headers["X-Replica-Id"]
            seen.add(headers["X-Router-Replica"])
            reply = orjson.loads(body)
            if turn:
                assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            history = [*history, reply["choices"][0]["message"], {"role": "user", "content": "more"}]
        assert len(seen) == 1
        homes |= seen
    assert len(homes) >= 3  # sessions spread over the fleet
    assert all(r.inflight == 0 for r in router.fleet.replicas)


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ({"X-Session-ID": "k-1"}, {}),
        ({"conversation-id": "k-1"}, {}),
        ({}, {"session_id": "k-1"}),
        ({}, {"metadata": {"session_id": "k-1"}}),
        ({}, {"user": "k-1"}),
    ],
)
async def test_each_key_source_pins_requests(start_fleet, start_router, headers: dict, body: dict) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(4)
    router, url = await start_router(named(fleet.replicas), policy="consistent_hash")
    replicas = set()
    for text in ("first", "second question", "third, unrelated"):
        status, h, _ = await call(url, chat(text) | body, headers)
        assert status == 200
        replicas.add(h["X-Router-Replica"])
    assert len(replicas) == 1
    assert replicas == {router.fleet.replicas[router.fleet.ring.lookup(b"k-1")].id}


async def test_prefix_key_keeps_a_conversation_without_ids_together(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(4)
    _, url = await start_router(named(fleet.replicas))
    first = await call(url, chat("Tell me about the history of Rome."))
    later = await call(
        url,
        {
            "model": "emulated-llm",
            "max_tokens": 4,
            "messages": [
                SYSTEM,
                {"role": "user", "content": "Tell me about the history of Rome."},
                {"role": "assistant", "content": "It is long."},
                {"role": "user", "content": "Go on."},
            ],
        },
    )
    assert first[1]["X-Router-Replica"] == later[1]["X-Router-Replica"]


async def test_streams_arrive_byte_identical(start_router, sse_upstream) -> None:  # type: ignore[no-untyped-def]
    events = [
        b'data: {"choices":[{"delta":{"content":"h\\u00e9llo "}}]}\n\n',
        b'data: {"choices":[{"delta":',
        b'{"content":"wor"}}]}\n\ndata: {"choices":[{"delta":{"content":"ld"}}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":0}}}\n\n',
        b"data: [DONE]\n\n",
    ]
    upstream, _ = await sse_upstream(events, delay=0.01)
    _, url = await start_router([upstream])
    body = chat("x", stream=True, stream_options={"include_usage": True})
    direct = await call(upstream, body)
    routed = await call(url, body)
    assert routed[0] == 200 and routed[2] == direct[2] == b"".join(events)


async def test_hop_by_hop_headers_stay_and_forwarded_for_is_added(start_router, sse_upstream) -> None:  # type: ignore[no-untyped-def]
    upstream, seen = await sse_upstream([b"data: [DONE]\n\n"])
    _, url = await start_router([upstream])
    await call(
        url,
        chat("x", stream=True),
        {
            "Connection": "keep-alive, X-Secret-Hop",
            "X-Secret-Hop": "1",
            "Proxy-Authorization": "Basic eA==",
            "X-Forwarded-For": "10.1.1.1",
            "X-Custom": "kept",
        },
    )
    got = {k.lower(): v for k, v in seen[0].items()}
    assert got["x-forwarded-for"] == "10.1.1.1, 127.0.0.1"
    assert got["x-custom"] == "kept"
    assert "proxy-authorization" not in got and "x-secret-hop" not in got


async def test_usage_is_read_and_hidden_unless_asked(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1)
    router, url = await start_router(named(fleet.replicas[:1]))
    _, _, plain = await call(url, chat("hello " * 50, stream=True))
    _, _, asked = await call(url, chat("hello " * 50, stream=True, stream_options={"include_usage": True}))
    assert b'"usage"' not in plain and plain.endswith(b"data: [DONE]\n\n")
    assert asked.count(b'"usage"') == 1
    replica = router.fleet.replicas[0]
    assert replica.prompt_tokens == 2 * orjson.loads(asked.split(b"\n\n")[-3][6:])["usage"]["prompt_tokens"]
    assert replica.cached_tokens > 0 and replica.hit_rate is not None


async def test_openai_client_streams_through_the_router(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    _, url = await start_router(named(fleet.replicas))
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused")
    stream = await client.chat.completions.create(
        model="emulated-llm",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        stream=True,
        extra_headers={"X-Session-ID": "o-1"},
    )
    chunks = [c async for c in stream]
    models = await client.models.list()
    await client.close()
    assert len("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)) == 20
    assert all(c.usage is None for c in chunks)  # the injected usage event was removed
    assert [m.id for m in models.data] == ["emulated-llm"]


async def test_a_replica_down_before_the_first_byte_is_retried_elsewhere(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3)
    router, url = await start_router(named(fleet.replicas))
    key = {"X-Session-ID": "doomed"}
    _, headers, _ = await call(url, chat("a"), key)
    home = next(r for r in fleet.replicas if r.options.replica_id == headers["X-Router-Replica"])
    await home.crash()
    status, headers, body = await call(url, chat("b", stream=True), key)
    assert status == 200 and headers["X-Router-Replica"] != home.options.replica_id
    assert body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body
    assert router.metrics.failovers._value.get() == 1  # type: ignore[attr-defined]
    # an erroring replica (HTTP 5xx) is not tried twice either
    other = next(r for r in fleet.replicas if r is not home and not r.crashed)
    other.set_faults({"error_rate": 1.0})
    for i in range(10):
        status, headers, _ = await call(url, chat(f"c{i}"), {"X-Session-ID": f"t-{i}"})
        assert status == 200
    assert all(r.inflight == 0 for r in router.fleet.replicas)


async def test_all_replicas_failing_gives_a_clear_error(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    for r in fleet.replicas:
        r.set_faults({"error_rate": 1.0, "error_status": 503})
    _, url = await start_router(named(fleet.replicas))
    status, _, body = await call(url, chat("x"))
    assert status == 503 and orjson.loads(body)["error"]["message"]
    _, url2 = await start_router(["http://127.0.0.1:9"], max_attempts=2)
    status, _, body = await call(url2, chat("x"))
    assert status == 502 and "could not be reached" in orjson.loads(body)["error"]["message"]


async def test_the_only_replica_closing_a_connection_unanswered_is_tried_once_more(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    # a fleet of one that closes a fresh connection before any answer (not a pooled one gone stale,
    # which is sent again at once): it was the client's 502; the route tries it once more after a
    # pause, and it answers
    fleet = await start_fleet(1)
    replica = fleet.replicas[0]
    cut = replica._cut

    def cut_once(request: Any) -> None:
        replica.faults.drop_after = None
        cut(request)

    replica._cut = cut_once  # type: ignore[method-assign]
    replica.faults.drop_after = 0
    router, url = await start_router(named(fleet.replicas), health_checks=False)
    status, headers, body = await call(url, chat("a"))
    assert status == 200 and headers["X-Router-Replica"] == "emu-0", body[:300]
    assert orjson.loads(body)["choices"][0]["message"]["content"]
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    assert 'router_retries_total{cause="reset"} 1.0' in text and "router_failovers_total 0.0" in text
    assert router.fleet.replicas[0].inflight == 0


async def test_a_client_that_closes_at_done_before_the_streams_http_end_was_served(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    # llama-server writes [DONE] and the stream's HTTP end apart; a client that closes at [DONE]
    # used to cancel the request while the router waited for that end: its whole answer counted as
    # a 499, its session forgotten (the next turn priced as a new conversation), its usage unread
    fleet = await start_fleet(2)
    for replica in fleet.replicas:
        replica.faults.end_late = 0.5
    router, url = await start_router(named(fleet.replicas), health_checks=False)
    served = []
    async with aiohttp.ClientSession() as http:
        for turn in range(3):
            body = chat(f"turn {turn}", stream=True, stream_options={"include_usage": True})
            async with http.post(url + "/v1/chat/completions", json=body, headers={"X-Session-ID": "d-1"}) as r:
                assert r.status == 200
                served.append(r.headers["X-Router-Replica"])
                async for line in r.content:
                    if line.startswith(b"data: [DONE]"):
                        break
                r.close()  # at [DONE], before its end: the connection closes under the router
            await asyncio.sleep(0.1)  # (the router hears the close)
        async with http.get(url + "/metrics") as m:
            text = await m.text()
    assert len(set(served)) == 1  # the session stays where it was served
    answered: dict[str, float] = {}
    for sample in samples(text, "router_requests_total"):
        answered[sample.labels["status"]] = answered.get(sample.labels["status"], 0.0) + sample.value
    assert answered == {"200": 3.0}, answered  # none counted as a client gone (499)
    assert "router_session_followups_total 2.0" in text and "router_session_jumps_total{" not in text
    assert sum(s.value for s in samples(text, "router_prompt_tokens_total")) > 0  # its usage was read
    await until(lambda: all(r.inflight == 0 for r in router.fleet.replicas), "nothing left in flight")
    # each connection, once its end came half a second later, went back to the pool, none closed
    # (the next turn, 0.1 s after the last, took another meanwhile)
    assert router.upstream is not None
    (pool,) = router.upstream.pools.values()
    await until(lambda: pool.open > 0 and len(pool.idle) == pool.open, "the connections back in their pool")


async def test_a_replicas_error_the_sdk_cannot_read_is_wrapped_in_openais_shape(  # type: ignore[no-untyped-def]
    start_fleet, start_router, sse_upstream
) -> None:
    # the emulator has no /v1/embeddings: aiohttp's own text/plain "404: Not Found" comes back
    fleet = await start_fleet(1)
    _, url = await start_router(named(fleet.replicas))
    status, headers, body = await call(url, {"model": "emulated-llm", "input": "hi"}, path="/v1/embeddings")
    error = orjson.loads(body)["error"]
    assert status == 404 and headers["Content-Type"] == "application/json"
    assert error == {
        "message": "the replica answered 404: 404: Not Found",
        "type": "invalid_request_error",
        "param": None,
        "code": "upstream_error",
    }
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="the replica answered 404: 404: Not Found"):
        await client.embeddings.create(model="emulated-llm", input="hi")
    await client.close()
    # an HTML page with a 5xx, on every replica tried: wrapped, its status kept, its text one line
    page, _ = await sse_upstream([b"<html>\n<h1>502 Bad Gateway</h1>\n</html>"], status=502, content_type="text/html")
    _, url = await start_router([page], max_attempts=1)
    status, headers, body = await call(url, chat("x"))
    error = orjson.loads(body)["error"]
    assert status == 502 and headers["Content-Type"] == "application/json"
    assert error["message"] == "the replica answered 502: <html> <h1>502 Bad Gateway</h1> </html>"
    assert (error["type"], error["code"]) == ("server_error", "upstream_error")
    # an error already in the API's shape (vLLM's: a number in `code`) passes as the engine wrote it
    engine = orjson.dumps(
        {"error": {"message": "bad temperature", "type": "BadRequestError", "param": None, "code": 400}}
    )
    shaped, _ = await sse_upstream([engine], status=400, content_type="application/json")
    _, url = await start_router([shaped])
    status, _, body = await call(url, chat("x"))
    assert status == 400 and body == engine


async def test_a_stream_cut_mid_way_ends_with_an_error_event(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1)
    fleet.replicas[0].set_faults({"drop_after": 3})
    router, url = await start_router(named(fleet.replicas[:1]))
    status, _, body = await call(url, chat("x", stream=True, max_tokens=20))
    events = [e for e in body.split(b"\n\n") if e]
    assert status == 200 and events[-1] == b"data: [DONE]"
    error = orjson.loads(events[-2][6:])["error"]
    assert error["code"] == "upstream_error" and error["type"] == "server_error" and "mid-stream" in error["message"]
    assert router.metrics.stream_errors.labels(fleet.replicas[0].options.replica_id)._value.get() == 1


async def test_stalled_stream_hits_the_idle_timeout(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1)
    fleet.replicas[0].set_faults({"stall_after": 2})
    _, url = await start_router(named(fleet.replicas[:1]), idle_timeout_s=0.3)
    status, _, body = await asyncio.wait_for(call(url, chat("x", stream=True, max_tokens=20)), 5)
    assert status == 200 and b"idle time-out" in body and body.endswith(b"data: [DONE]\n\n")


async def test_a_hung_replica_times_out_and_the_next_one_answers(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    router, url = await start_router(named(fleet.replicas), first_byte_timeout_s=0.3)
    key = {"X-Session-ID": "h-1"}
    home = router.fleet.ring.lookup(b"h-1")
    fleet.replicas[home].set_faults({"hang": True})
    status, headers, _ = await asyncio.wait_for(call(url, chat("x"), key), 5)
    assert status == 200 and headers["X-Router-Replica"] == fleet.replicas[1 - home].options.replica_id
    fleet.replicas[home].set_faults({"hang": False})


async def test_client_disconnect_cancels_the_upstream_request(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1, time_scale=1.0)  # real time: the reply takes seconds
    router, url = await start_router(named(fleet.replicas[:1]))
    engine = fleet.replicas[0].engine
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url + "/v1/chat/completions", json=chat("x", stream=True, max_tokens=500))
        await resp.content.readline()
        resp.close()
    for _ in range(50):
        if engine.aborted_total == 1:
            break
        await asyncio.sleep(0.02)
    assert engine.aborted_total == 1 and not engine.has_work()
    assert router.fleet.replicas[0].inflight == 0
    assert router.metrics.requests.labels("emu-0", "ttft", "prefix", "499", "emulated-llm")._value.get() == 1


async def test_limits_and_bad_bodies_get_openai_errors(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1)
    _, url = await start_router(named(fleet.replicas[:1]), max_body_bytes=1000, max_header_bytes=2000)
    for raw, headers, status in (
        (b"x" * 2000, {}, 413),
        (b"{nope", {}, 400),
        (b"[1]", {}, 400),
        (orjson.dumps(chat("x")), {"X-Big": "y" * 3000}, 431),
    ):
        got, _, body = await call(url, None, headers, raw=raw)
        assert got == status
        assert set(orjson.loads(body)["error"]) == {"message", "type", "param", "code"}


async def test_admin_api(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3)
    _router, url = await start_router([r.url for r in fleet.replicas[:2]], admin_token="s3cret-admin-token")
    auth = {"Authorization": "Bearer s3cret-admin-token"}
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-admin-token"}):
            async with s.get(url + "/admin/replicas", headers=headers) as r:
                assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
        await call(url, chat("warm"), {"X-Session-ID": "a-1"})
        async with s.get(url + "/admin/replicas", headers=auth) as r:
            listed = await r.json()
        assert [x["id"] for x in listed] == [f"127.0.0.1:{r.port}" for r in fleet.replicas[:2]]
        assert {"id", "url", "state", "weight", "inflight", "hit_rate"} <= set(listed[0])
        async with s.get(url + "/admin/route", params={"key": "a-1"}, headers=auth) as r:
            route = await r.json()
        assert route["replica"] == route["sticky"] and route["reason"] == "sticky" and route["walk"]
        async with s.post(
            url + "/admin/replicas", json={"url": fleet.replicas[2].url, "id": "third"}, headers=auth
        ) as r:
            assert r.status == 201 and 0 < (await r.json())["moved_share"] < 0.7
        async with s.post(url + "/admin/replicas", json={"url": fleet.replicas[2].url}, headers=auth) as r:
            assert r.status == 409
        async with s.post(url + "/admin/replicas", json={"url": "http://h:1", "id": "x" * 65}, headers=auth) as r:
            assert r.status == 400 and "at most 64 bytes" in (await r.json())["error"]["message"]
        async with s.post(url + "/admin/replicas/third/drain", headers=auth) as r:
            assert (await r.json())["state"] == "draining"
        for i in range(20):
            _, h, _ = await call(url, chat(f"q{i}"), {"X-Session-ID": f"d-{i}"})
            assert h["X-Router-Replica"] != "third"
        async with s.get(url + "/admin/ring", headers=auth) as r:
            ring = await r.json()
        assert [x["share"] for x in ring["replicas"] if x["id"] == "third"] == [0.0]
        async with s.delete(url + "/admin/replicas/third", headers=auth) as r:
            assert r.status == 200
        async with s.delete(url + "/admin/replicas/third", headers=auth) as r:
            assert r.status == 404
    _, open_url = await start_router(named(fleet.replicas[:1]))
    async with aiohttp.ClientSession() as s, s.get(open_url + "/admin/replicas") as r:
        assert r.status == 404  # no token configured: the admin API is off


async def test_health_models_and_metrics(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    router, url = await start_router(named(fleet.replicas))
    for _i in range(4):
        await call(url, chat("same conversation " * 20), {"X-Session-ID": "m-1"})
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/health") as r:
            assert r.status == 200 and (await r.json())["routable"] == 2
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    for name in (
        "router_requests_total",
        "router_inflight",
        "router_ttft_seconds_bucket",
        "router_e2e_seconds_bucket",
        "router_prompt_tokens_total",
        "router_cached_tokens_total",
        "router_session_followups_total",
    ):
        assert name in text
    assert 'key_kind="header"' in text and 'policy="ttft"' in text
    assert "router_session_followups_total 3.0" in text
    for r in list(router.fleet.replicas):
        router.fleet.drain(r.id)
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/health") as r:
            assert r.status == 503  # not ready: nothing to route to
        async with s.get(url + "/health/live") as r:
            assert r.status == 200  # but alive: a liveness probe must not restart it for that
    status, _, body = await call(url, chat("x"))
    assert status == 503 and "no replica is available" in orjson.loads(body)["error"]["message"]


async def test_one_json_log_line_per_request(start_fleet, start_router, caplog) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1)
    _, url = await start_router(named(fleet.replicas), log_requests=True)
    with caplog.at_level(logging.INFO, logger="router.access"):
        await call(url, chat("x"), {"X-Session-ID": "log-1"})
        await call(url, None, raw=b"{bad")
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "router.access"]
    assert [(x["status"], x["replica"], x["key_kind"]) for x in lines] == [
        (200, "emu-0", "header"),
        (400, None, "none"),
    ]
    # one replica, nothing cached yet: placed by its cost (under ttft, the default)
    assert lines[0]["reason"] == "cost" and lines[0]["attempts"] == 1 and lines[0]["e2e_ms"] > 0


def demo_process(*flags: str) -> tuple[subprocess.Popen[str], int, queue.Queue[str]]:
    """`router-serve --demo ...` as a child, its stdout's lines in a queue."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.proxy.cli", "--port", str(port), *flags],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1", "XDG_STATE_HOME": "/nonexistent/state"},  # saves would fail
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    return proc, port, lines


def test_demo_mode_starts_a_fleet_clean_and_says_how_to_use_it() -> None:
    proc, port, lines = demo_process("--demo", "2")
    try:
        # bounded: a wedged start fails the test instead of hanging the suite
        head = [lines.get(timeout=30) for _ in range(4)]
        assert head[0].startswith(f"router-serve listening on http://127.0.0.1:{port} (ttft, 2 replicas)")
        assert head[1].startswith("demo: 2 emulated replicas") and "curl" in head[2] and '"max_tokens": 32' in head[3]
        more = [lines.get(timeout=5) for _ in range(6)]
        assert f"console:         http://127.0.0.1:{port}/console" in "".join(head + more)
        assert "routing state: not saved" in more[-1]  # a demo starts clean: its replicas are new each time
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=orjson.dumps(chat("hi")),
            headers={"Content-Type": "application/json"},
        )
        deadline = time.monotonic() + 10
        with urllib.request.urlopen(request, timeout=deadline - time.monotonic()) as resp:
            assert resp.status == 200 and resp.headers["X-Router-Replica"].startswith("emu-")
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0


@pytest.mark.parametrize(
    ("drain_s", "ends"),
    [(30, "every request in flight finished"), (1, "the drain limit was reached: 1 request still in flight, cut off")],
)
def test_sigterm_says_that_draining_began_what_is_in_flight_and_how_it_ended(drain_s: int, ends: str) -> None:
    proc, port, lines = demo_process("--demo", "1", "--drain-timeout-s", str(drain_s))
    try:
        while "routing state" not in lines.get(timeout=30):
            pass
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:  # a stream of ~2 s (or more)
            body = orjson.dumps(chat("hi", stream=True, max_tokens=250 if drain_s > 1 else 3000))
            head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            conn.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            received = conn.recv(65536)
            assert received.startswith(b"HTTP/1.1 200")
            proc.send_signal(signal.SIGTERM)  # our own child, by its PID
            began = lines.get(timeout=10)
            assert began.startswith("router-serve: SIGTERM received: draining the router: no new connections; ")
            assert f"1 request in flight to replicas; they have up to {drain_s} s (drain_timeout_s)" in began
            while chunk := conn.recv(65536):
                received += chunk
        ended = lines.get(timeout=30)
        assert re.fullmatch(rf"router-serve: stopped after \d+\.\d s: {ends}\n", ended), ended
        assert received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") is (drain_s > 1)  # whole, or cut off
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


async def test_tcp_nodelay_on_both_legs(start_fleet) -> None:  # type: ignore[no-untyped-def]
    # Nagle + delayed ACK would hold a stream's first small chunk for ~40 ms on a keep-alive connection.
    fleet = await start_fleet(1)
    router = Node(load(None, {}, {"replicas": named(fleet.replicas), "state": "none"}))
    runner = web.AppRunner(build_app(router), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.post(url + "/v1/chat/completions", json=chat("x", stream=True, max_tokens=50)) as resp,
        ):
            await resp.content.readline()
            client_leg = [h.transport.get_extra_info("socket") for h in runner.server.connections]  # type: ignore[union-attr]
            upstream_leg = [
                proto.transport.get_extra_info("socket")
                for conns in router.http.connector._conns.values()
                for proto, _ in conns
            ]  # type: ignore[union-attr]
            upstream_leg += [p.transport.get_extra_info("socket") for p in router.http.connector._acquired]  # type: ignore[union-attr]
            assert client_leg and upstream_leg
            for sock in client_leg + upstream_leg:  # checked while the stream is open
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            await resp.read()
    finally:
        await runner.cleanup()


def sse_events(body: bytes) -> list[bytes]:
    return [e for e in body.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]


async def test_crlf_streams_are_framed_forwarded_and_finished(start_router, sse_upstream) -> None:  # type: ignore[no-untyped-def]
    events = [
        b'data: {"choices":[{"delta":{"content":"a"}}]}\r\n\r\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":3}}}\r\n\r\n',
        b"data:[DONE]\r\n\r\n",
    ]
    upstream, seen = await sse_upstream(events, delay=0.01)
    router, url = await start_router([f"up={upstream}"])
    status, _, body = await call(url, chat("x", stream=True))  # the client did not ask for usage
    assert status == 200 and body == events[0] + events[2]  # byte for byte, the injected usage event gone
    assert router.fleet.replicas[0].prompt_tokens == 7 and router.fleet.replicas[0].cached_tokens == 3
    assert router.metrics.stream_errors.labels("up")._value.get() == 0
    assert seen[0]["Accept-Encoding"] == "identity"  # replicas are never asked to compress


@pytest.mark.parametrize("done", [b"data: [DONE]", b"data:[DONE]\n"])
async def test_done_without_its_blank_line_is_still_done(start_router, sse_upstream, done: bytes) -> None:  # type: ignore[no-untyped-def]
    upstream, _ = await sse_upstream([b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', done])
    _, url = await start_router([upstream])
    _, _, body = await call(url, chat("x", stream=True))
    assert b'"error"' not in body and body.endswith(done)


async def test_nothing_after_done_is_waited_for(start_router, sse_upstream) -> None:  # type: ignore[no-untyped-def]
    upstream, _ = await sse_upstream([b'data: {"choices":[]}\n\n', b"data: [DONE]\n\n"], hold_open=5.0)
    router, url = await start_router([f"up={upstream}"], idle_timeout_s=30)
    _, _, body = await asyncio.wait_for(call(url, chat("x", stream=True)), 4)  # not the 5 s the upstream holds on
    assert b'"error"' not in body and router.fleet.replicas[0].inflight == 0


async def test_a_cut_off_event_is_dropped_before_the_error_event(start_router, sse_upstream) -> None:  # type: ignore[no-untyped-def]
    upstream, _ = await sse_upstream([b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', b'data: {"choices":[{"del'])
    _, url = await start_router([upstream])
    _, _, body = await call(url, chat("x", stream=True))
    events = sse_events(body)
    assert events[-1] == b"data: [DONE]"
    assert orjson.loads(events[-2][6:])["error"]["message"] == "upstream closed the stream early"
    assert all(orjson.loads(e[6:]) for e in events[:-1])  # every event is whole JSON


async def test_total_timeout_ends_a_long_stream_with_an_error_event(start_router, sse_upstream) -> None:  # type: ignore[no-untyped-def]
    chunks = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'] * 40
    upstream, _ = await sse_upstream(chunks, delay=0.05)
    _, url = await start_router([upstream], total_timeout_s=0.5, idle_timeout_s=5)
    _, _, body = await asyncio.wait_for(call(url, chat("x", stream=True)), 5)
    events = sse_events(body)
    assert events[-1] == b"data: [DONE]" and b"total time-out" in events[-2]


@pytest.mark.parametrize(
    ("status", "content_type"),
    [(404, "application/json"), (429, "application/json"), (204, "application/json"), (302, "text/plain")],
)
async def test_answers_without_a_body_and_redirects_pass_through(
    start_router, sse_upstream, status: int, content_type: str
) -> None:
    upstream, seen = await sse_upstream(
        [],
        status=status,
        content_type=content_type,
        headers={"Location": "http://127.0.0.1:9/elsewhere"} if status == 302 else None,
    )
    other, other_seen = await sse_upstream([b"data: [DONE]\n\n"])
    router, url = await start_router([f"a={upstream}", f"b={other}"], policy="consistent_hash")
    key = next(f"k{i}" for i in range(100) if router.fleet.ring.lookup(f"k{i}".encode()) == 0)
    got, _, _ = await call(url, chat("x"), {"X-Session-ID": key})
    assert got == status and len(seen) == 1 and other_seen == []  # not retried, redirect not followed


async def test_odd_usage_figures_never_break_the_answer(start_router, sse_upstream) -> None:  # type: ignore[no-untyped-def]
    bad = b'{"choices":[],"usage":{"prompt_tokens":-5,"prompt_tokens_details":{"cached_tokens":99}}}'
    upstream, _ = await sse_upstream([bad], content_type="application/json")
    router, url = await start_router([f"up={upstream}"])
    status, _, body = await call(url, chat("x"))
    assert status == 200 and body == bad
    assert router.fleet.replicas[0].prompt_tokens == 0 and router.fleet.replicas[0].cached_tokens == 0


async def test_admin_odd_bytes_and_raw_keys(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(2)
    router, url = await start_router(named(fleet.replicas), admin_token="t0k-admin-token-0", policy="round_robin")
    async with aiohttp.ClientSession() as s:
        async with s.get(
            url + "/admin/replicas",
            headers={"Authorization": "Bearer t\udcff0k".encode("utf-8", "surrogateescape").decode("latin-1")},
        ) as r:
            assert r.status == 401
        async with s.get(url + "/admin/route?key=%FFsess", headers={"Authorization": "Bearer t0k-admin-token-0"}) as r:
            route = await r.json()
        assert route["hash"] == router.fleet.ring.key_hash(b"\xffsess")
        assert route["replica"] is None and "does not route by key" in route["reason"]


async def test_a_replica_removed_during_a_retry_walk_does_not_confuse_it(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(3)
    router, url = await start_router(
        named(fleet.replicas), policy="consistent_hash", first_byte_timeout_s=0.5, admin_token="tttttttttttttttt"
    )
    ids = [r.options.replica_id for r in fleet.replicas]
    # a key owned by replica 1 whose ring successor is replica 2
    key = next(f"k{i}" for i in range(2000) if router.fleet.ring.successors(f"k{i}".encode(), 3)[:2] == [1, 2])
    fleet.replicas[1].set_faults({"hang": True})
    request = asyncio.ensure_future(call(url, chat("x"), {"X-Session-ID": key}))
    await asyncio.sleep(0.2)  # the first attempt is waiting on the hung replica
    async with (
        aiohttp.ClientSession() as s,
        s.delete(url + f"/admin/replicas/{ids[0]}", headers={"Authorization": "Bearer tttttttttttttttt"}) as r,
    ):
        assert r.status == 200  # indices shift: replica 1 becomes 0, replica 2 becomes 1
    status, headers, _ = await asyncio.wait_for(request, 5)
    assert status == 200 and headers["X-Router-Replica"] == ids[2]
    fleet.replicas[1].set_faults({"hang": False})
