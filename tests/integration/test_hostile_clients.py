"""Hostile and broken clients on raw sockets: smuggling, hop-by-hop headers, header floods, slow
clients. The router answers each with a clear error or closes the connection, forwards nothing it
should not, and keeps serving everyone else."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from router.config import load
from router.node import Node

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class Upstream:
    """A replica stand-in that records every request it parses (method, path, headers, body)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.reply_headers: dict[str, str] = {}

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((request.method, request.path_qs, dict(request.headers), await request.read()))
        body = {"choices": [{"message": {"content": "ok"}}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
        return web.json_response(body, headers=self.reply_headers)


@pytest.fixture
async def world(
    serve_app: Callable[[web.Application], Any], serve_node: Callable[[Node], Any]
) -> AsyncIterator[tuple[Upstream, str, int]]:
    """A recording upstream and the router in front of it, served as router-serve serves it
    (`runner_for`: its parser limits and slow-client time-outs), both client time-outs 1 s."""
    upstream = Upstream()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", upstream.handle)
    up_url = await serve_app(app)
    config = load(
        None,
        {},
        {
            "replicas": [f"up={up_url}"],
            "state": "none",
            "health_checks": "false",
            "client_timeout_s": "1",
            "keepalive_timeout_s": "1",
            "drain_timeout_s": "1",
            "max_header_bytes": "4096",
        },
    )
    port = await serve_node(Node(config))
    yield upstream, f"http://127.0.0.1:{port}", port


async def raw(port: int, data: bytes, read_s: float = 3.0) -> bytes:
    """Send raw bytes; everything the router sends back until it closes (or `read_s` passes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = b""
    try:
        async with asyncio.timeout(read_s):
            while chunk := await reader.read(65536):
                out += chunk
    except TimeoutError:
        pass
    writer.close()
    return out


def status(answer: bytes) -> int:
    """The status code of the first response in `answer` (0 if there is none)."""
    m = re.match(rb"HTTP/1\.[01] (\d{3}) ", answer)
    return int(m[1]) if m else 0


def request(body: bytes, *headers: str, target: str = "/v1/chat/completions") -> bytes:
    head = [f"POST {target} HTTP/1.1", "Host: router.test", "Connection: close", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def ok(url: str) -> bool:
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/chat/completions", json=CHAT) as r:
        return r.status == 200


@pytest.mark.parametrize(
    "headers",
    [
        ("Content-Length: 5", "Transfer-Encoding: chunked"),  # CL.TE
        ("Transfer-Encoding: chunked", "Content-Length: 5"),  # TE.CL
        ("Content-Length: 5", "Content-Length: 7"),
        ("Content-Length: 5, 7",),
        ("Transfer-Encoding: gzip, chunked, identity",),
        ("Content-Length: -5",),
    ],
)
async def test_ambiguous_body_lengths_are_refused_and_nothing_goes_upstream(
    world: tuple[Upstream, str, int], headers: tuple[str, ...]
) -> None:
    upstream, url, port = world
    smuggled = b"0\r\n\r\nPOST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    answer = await raw(port, request(smuggled, *headers))
    assert status(answer) == 400, answer[:80]
    assert upstream.seen == []  # neither the request nor anything hidden in it
    assert await ok(url)


async def test_a_request_hidden_in_a_body_stays_in_the_body(world: tuple[Upstream, str, int]) -> None:
    upstream, _, port = world
    hidden = "x\r\n\r\nPOST /admin/replicas HTTP/1.1\r\nHost: up\r\nContent-Length: 0\r\n\r\n"
    body = orjson.dumps({**CHAT, "messages": [{"role": "user", "content": hidden}]})
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    answer = await raw(port, request(chunked, "Transfer-Encoding: chunked"))
    assert status(answer) == 200
    assert len(upstream.seen) == 1
    method, path, headers, got = upstream.seen[0]
    assert (method, path) == ("POST", "/v1/chat/completions")
    lowered = {k.lower(): v for k, v in headers.items()}
    assert "transfer-encoding" not in lowered and lowered["content-length"] == str(len(got))
    assert orjson.loads(got)["messages"][0]["content"] == hidden  # the same text, still inside its JSON


async def test_pipelined_requests_are_each_routed_alone(world: tuple[Upstream, str, int]) -> None:
    upstream, _, port = world
    body = orjson.dumps(CHAT)
    one = request(body, f"Content-Length: {len(body)}").replace(b"Connection: close", b"Connection: keep-alive")
    answer = await raw(port, one + one + request(body, f"Content-Length: {len(body)}"))
    assert answer.count(b"HTTP/1.1 200") == 3
    assert [(m, p, b) for m, p, _, b in upstream.seen] == [("POST", "/v1/chat/completions", body)] * 3


async def test_the_upstream_is_only_ever_the_configured_replica(world: tuple[Upstream, str, int]) -> None:
    upstream, _, port = world
    body = orjson.dumps(CHAT)
    for target, host in (
        ("http://evil.invalid/v1/chat/completions", "evil.invalid"),
        ("/v1/chat/completions", "evil.invalid:80"),
    ):
        req = request(body, f"Content-Length: {len(body)}", target=target).replace(b"router.test", host.encode())
        assert status(await raw(port, req)) == 200
    assert len(upstream.seen) == 2
    for _, path, headers, _ in upstream.seen:
        assert path == "/v1/chat/completions"
        host = {k.lower(): v for k, v in headers.items()}["host"]
        assert host.startswith("127.0.0.1:")  # the replica's own address, not the client's Host
    for target in ("//evil.invalid/v1/chat/completions", "/v1/chat/completions/../../admin/replicas", "*"):
        answer = await raw(port, request(body, f"Content-Length: {len(body)}", target=target))
        assert status(answer) in (400, 404, 405), (target, answer[:60])
    assert len(upstream.seen) == 2


async def test_hop_by_hop_headers_go_neither_way(world: tuple[Upstream, str, int]) -> None:
    upstream, url, _ = world
    upstream.reply_headers = {"Connection": "X-Upstream-Hop", "X-Upstream-Hop": "internal", "X-Kept": "1"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            url + "/v1/chat/completions",
            json=CHAT,
            headers={
                "Connection": "X-Client-Hop",
                "X-Client-Hop": "secret",
                "TE": "trailers",
                "Upgrade": "h2c",
                "Proxy-Connection": "keep-alive",
                "Keep-Alive": "timeout=5",
                "Expect": "100-continue",
            },
        ) as r,
    ):
        assert r.status == 200
        assert "X-Upstream-Hop" not in r.headers and r.headers["X-Kept"] == "1"
    sent = {k.lower() for k in upstream.seen[0][2]}
    assert not sent & {"x-client-hop", "te", "upgrade", "proxy-connection", "keep-alive", "expect"}


async def test_every_connection_header_names_hop_by_hop_headers(world: tuple[Upstream, str, int]) -> None:
    upstream, _, port = world
    body = orjson.dumps(CHAT)
    headers = ("Connection: close", "Connection: X-Second, X-Forwarded-For", "X-Second: 2", "X-Forwarded-For: 6.6.6.6")
    assert status(await raw(port, request(body, f"Content-Length: {len(body)}", *headers))) == 200
    sent = {k.lower(): v for k, v in upstream.seen[0][2].items()}
    assert "x-second" not in sent
    assert sent["x-forwarded-for"] == "127.0.0.1"  # a hop-by-hop X-Forwarded-For is not chained on


async def test_header_floods_get_an_openai_431(world: tuple[Upstream, str, int]) -> None:
    upstream, url, port = world
    body = orjson.dumps(CHAT)
    many = [f"X-Header-{i}: " + "v" * 20 for i in range(200)]  # 200 small headers: about 7 KB, over 4096 bytes
    big = ["X-Big: " + "y" * 4500]  # one header over the whole block's limit
    for headers in (many, big):
        answer = await raw(port, request(body, f"Content-Length: {len(body)}", *headers))
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert status(head) == 431, head[:60]
        assert orjson.loads(payload)["error"]["code"] == "request_too_large"
    # beyond what the parser buffers for one connection (about 2 MiB): its plain 400, nothing kept
    for headers in ([f"X-H{i}: v" for i in range(2000)], ["X-Huge: " + "y" * 100_000]):
        answer = await raw(port, request(body, f"Content-Length: {len(body)}", *headers))
        assert status(answer) == 400, answer[:60]
    assert upstream.seen == [] and await ok(url)


async def test_slow_headers_are_cut_off_and_others_are_served_meanwhile(world: tuple[Upstream, str, int]) -> None:
    _, url, port = world
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    start = time.monotonic()
    closed_after = None
    for i in range(40):  # a header line every 0.1 s, never the blank line that ends them
        assert await ok(url) if i % 10 == 0 else True  # the router serves others meanwhile
        try:
            writer.write(f"X-Slow-{i}: 1\r\n".encode())
            await writer.drain()
            async with asyncio.timeout(0.1):
                if await reader.read(1024) == b"":
                    closed_after = time.monotonic() - start
                    break
        except TimeoutError:
            continue
        except ConnectionError:
            closed_after = time.monotonic() - start
            break
    writer.close()
    assert closed_after is not None and closed_after < 3.0  # client_timeout_s is 1


async def test_a_slow_body_gets_a_408_and_the_connection_closes(world: tuple[Upstream, str, int]) -> None:
    upstream, url, port = world
    head = request(b"", "Content-Length: 1000").replace(b"Connection: close", b"Connection: keep-alive")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + b'{"model": ')
    await writer.drain()
    start = time.monotonic()
    answer = b""
    answered_after = None
    async with asyncio.timeout(8):
        while chunk := await reader.read(65536):
            answer += chunk
            answered_after = answered_after or time.monotonic() - start
    writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert status(head) == 408 and answered_after is not None and answered_after > 0.8  # a 1 s pause
    assert orjson.loads(payload)["error"]["code"] == "request_timeout"
    assert upstream.seen == [] and await ok(url)


async def test_many_idle_connections_are_closed_and_cost_nothing_after(world: tuple[Upstream, str, int]) -> None:
    _, url, port = world
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    for _ in range(200):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\n")  # and then nothing
        conns.append((reader, writer))
    assert await ok(url)

    async def closed(reader: asyncio.StreamReader) -> Any:
        async with asyncio.timeout(4):
            return await reader.read(1024)

    results = await asyncio.gather(*(closed(r) for r, _ in conns), return_exceptions=True)
    assert all(r == b"" or isinstance(r, ConnectionError) for r in results)
    for _, writer in conns:
        writer.close()
    assert await ok(url)


@pytest.mark.parametrize(
    "line",
    [
        b"GET * HTTP/1.1",
        b"OPTIONS * HTTP/1.1",
        b"CONNECT example.com:443 HTTP/1.1",
        b"GET http://[::1/v1/models HTTP/1.1",
        b"GET http://exa mple.com/ HTTP/1.1",
        b"POST http://:99999/v1/chat/completions HTTP/1.1",
        b"GET //v1/models HTTP/1.1",
    ],
)
async def test_odd_request_targets_get_a_json_4xx_and_no_traceback(
    world: tuple[Upstream, str, int], line: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    upstream, url, port = world
    with caplog.at_level(logging.WARNING):
        answer = await raw(port, line + b"\r\nHost: router.test\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert 400 <= status(head) < 500, answer[:300]
    if payload:  # (llhttp refuses some before any server sees them: the front's own JSON 400)
        assert "error" in orjson.loads(payload), payload
    assert b"text/plain" not in head.lower(), head
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert upstream.seen == [] and await ok(url)
