"""Refused as soon as it is known, on raw sockets: a request without a valid key, or with a body
larger than the router takes, is answered from its head and its connection closed, while its
client is still sending, its body not read; a body past the limit is refused the moment it passes
it; a body trickled in below the floor rate is cut; two credentials are never guessed between. On
both HTTP paths (the front, and aiohttp's with `front = false`); the router serves everyone else
meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from router.config import load
from router.node import Node

KEY = "sk-early-refusals"
OTHER = "sk-someone-else"
LIMIT = 1 << 20  # max_body_bytes here
PIECE = 64 * 1024
SENT_CAP = 256 << 20  # a sender never sends more than this (the test's own bound)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class Upstream:
    """A replica stand-in that counts what reaches it."""

    def __init__(self) -> None:
        self.seen = 0

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.seen += 1
        body = {"choices": [{"message": {"content": "ok"}}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
        return web.json_response(body)


@dataclass
class World:
    upstream: Upstream
    url: str
    port: int
    node: Node
    path: str  # front or aiohttp


@pytest.fixture(params=["front", "aiohttp"])
async def world(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    serve_app: Callable[[web.Application], Any],
    serve_node: Callable[[Node], Any],
) -> AsyncIterator[World]:
    upstream = Upstream()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", upstream.handle)
    up_url = await serve_app(app)
    keys = tmp_path / "keys.toml"
    keys.write_text(
        "".join(
            f'[[keys]]\nid = "{kid}"\ntenant = "t"\nsha256 = "{hashlib.sha256(k.encode()).hexdigest()}"\n'
            for k, kid in ((KEY, "a"), (OTHER, "b"))
        )
    )
    config = load(
        None,
        {},
        {
            "replicas": [f"up={up_url}"],
            "state": "none",
            "health_checks": "false",
            "client_keys_file": str(keys),
            "admin_token": "an-admin-token-of-some-length",
            "max_body_bytes": str(LIMIT),
            "front": "true" if request.param == "front" else "false",
        },
    )
    node = Node(config)
    port = await serve_node(node)
    yield World(upstream, f"http://127.0.0.1:{port}", port, node, request.param)


def head(*headers: str, target: str = "/v1/chat/completions") -> bytes:
    lines = [f"POST {target} HTTP/1.1", "Host: router.test", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@dataclass
class Outcome:
    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool  # the router closed the connection after its answer
    sent_before: int  # body bytes the client had sent when the answer's head came
    sent: int  # ... and in all, until the router stopped taking them
    after_s: float  # from the head sent to the answer's head


async def upload(
    port: int, first: bytes, piece: bytes, endless: bool = True, wait_s: float = 10.0, closing_s: float = 2.0
) -> Outcome:
    """Send `first` (a head, maybe a start of body), then `piece` after piece while `endless`
    (bounded by SENT_CAP and `wait_s`), reading the answer meanwhile; then watch `closing_s` for
    the connection's close (0: not watched, `closed` False: a connection kept open costs that long)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0
    answered: int | None = None

    async def send() -> None:
        nonlocal sent
        writer.write(first)
        await writer.drain()
        while endless and sent < SENT_CAP:
            writer.write(piece)
            await writer.drain()
            sent += len(piece)

    start = time.monotonic()
    sender = asyncio.create_task(send())
    try:
        async with asyncio.timeout(wait_s):
            raw_head = await reader.readuntil(b"\r\n\r\n")
            answered = sent
            after = time.monotonic() - start
            lines = raw_head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
        closed = False
        if closing_s > 0:
            with contextlib.suppress(TimeoutError):  # a connection kept open sends nothing more
                async with asyncio.timeout(closing_s):
                    closed = await reader.read(1) == b""
    finally:
        with contextlib.suppress(TimeoutError, ConnectionError, asyncio.CancelledError):
            async with asyncio.timeout(wait_s):
                await sender
        sender.cancel()
        writer.close()
    return Outcome(status, headers, body, closed, answered, sent, after)


async def ok(url: str) -> bool:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"}) as r,
    ):
        return r.status == 200


def error_code(outcome: Outcome) -> str:
    return str(orjson.loads(outcome.body)["error"]["code"])


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def test_a_gigabyte_without_a_key_is_refused_from_its_head(world: World) -> None:
    out = await upload(world.port, head("Content-Length: 1000000000"), b"x" * PIECE)
    assert out.status == 401 and error_code(out) == "invalid_api_key", out
    assert out.headers.get("connection") == "close" and out.closed
    # answered while the gigabyte was still coming: at most the socket buffers' worth read, or dropped
    assert out.sent_before < 16 * LIMIT and out.sent < 32 * LIMIT, out
    assert world.upstream.seen == 0 and await ok(world.url)
    print(f"401 after {out.after_s * 1000:.1f} ms, {out.sent_before} bytes of body sent by then")


async def test_an_endless_chunked_body_without_a_key_is_refused_from_its_head(world: World) -> None:
    out = await upload(world.port, head("Transfer-Encoding: chunked"), chunk(b"x" * PIECE))
    assert out.status == 401 and out.headers.get("connection") == "close" and out.closed, out
    assert out.sent_before < 16 * LIMIT and out.sent < 32 * LIMIT, out
    assert world.upstream.seen == 0 and await ok(world.url)
    print(f"401 after {out.after_s * 1000:.1f} ms, {out.sent_before} bytes of body sent by then")


async def test_a_length_over_the_limit_is_refused_from_its_head(world: World) -> None:
    auth = f"Authorization: Bearer {KEY}"
    out = await upload(world.port, head(auth, "Content-Length: 40000000"), b"x" * PIECE)
    assert out.status == 413 and error_code(out) == "request_too_large", out
    assert out.headers.get("connection") == "close" and out.closed
    assert out.sent_before < 16 * LIMIT and out.sent < 32 * LIMIT, out
    assert world.upstream.seen == 0 and await ok(world.url)
    # refused, and counted against the tenant whose valid key it brought, as is one with a bad body
    out = await upload(world.port, head(auth, "Content-Length: 5") + b"{nope", b"", endless=False)
    assert out.status == 400
    counted = world.node.metrics.tenant_requests
    assert counted.labels("t", "a", "413")._value.get() == 1 and counted.labels("t", "a", "400")._value.get() == 1


async def test_a_chunked_body_is_refused_when_it_passes_the_limit(world: World) -> None:
    # the client sends just past the limit, then waits: the answer must not wait for the body's end
    first = head(f"Authorization: Bearer {KEY}", "Transfer-Encoding: chunked") + chunk(b"x" * (LIMIT + 10))
    out = await upload(world.port, first, b"", endless=False)
    assert out.status == 413 and error_code(out) == "request_too_large", out
    assert out.headers.get("connection") == "close" and out.closed
    # and one that goes on sending is refused as well, having fed the router little past the limit
    out = await upload(
        world.port, head(f"Authorization: Bearer {KEY}", "Transfer-Encoding: chunked"), chunk(b"x" * PIECE)
    )
    assert out.status == 413 and out.closed and out.sent < 32 * LIMIT, out
    assert world.upstream.seen == 0 and await ok(world.url)


async def test_a_small_body_without_a_key_keeps_its_connection(world: World) -> None:
    body = orjson.dumps(CHAT)
    reader, writer = await asyncio.open_connection("127.0.0.1", world.port)
    try:
        for _ in range(2):  # the same connection twice: a well-behaved client keeps it
            writer.write(head(f"Content-Length: {len(body)}") + body)
            await writer.drain()
            async with asyncio.timeout(5):
                answer = await reader.readuntil(b"\r\n\r\n")
                assert answer.startswith(b"HTTP/1.1 401"), answer
                assert b"connection: close" not in answer.lower()
                length = next(
                    int(line.split(b":")[1])
                    for line in answer.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
    finally:
        writer.close()


async def test_a_body_trickled_below_the_floor_rate_is_cut(world: World) -> None:
    auth = f"Authorization: Bearer {KEY}"
    reader, writer = await asyncio.open_connection("127.0.0.1", world.port)
    writer.write(head(auth, "Content-Length: 100000") + b'{"model": ')
    await writer.drain()
    start = time.monotonic()
    answer = b""
    try:
        async with asyncio.timeout(30):  # client_timeout_s is 60 here: a byte each 0.2 s never pauses that long
            while not answer:
                with contextlib.suppress(ConnectionError):
                    writer.write(b" ")
                    await writer.drain()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.2):
                        answer = await reader.read(65536)
                if answer == b"" and reader.at_eof():
                    break
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"request_timeout"' in answer
    print(f"408 after {time.monotonic() - start:.1f} s")
    assert world.upstream.seen == 0 and await ok(world.url)


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ((f"Authorization: Bearer {OTHER}", f"Authorization: Bearer {KEY}"), "Authorization"),
        ((f"Authorization: Bearer {KEY}", f"Authorization: Bearer {KEY}"), "Authorization"),
        ((f"x-api-key: {KEY}", f"x-api-key: {OTHER}"), "x-api-key"),
        ((f"Authorization: Bearer {KEY}", f"x-api-key: {OTHER}"), "different keys"),
    ],
)
async def test_two_credentials_are_refused_never_guessed_between(
    world: World, headers: tuple[str, ...], why: str
) -> None:
    body = orjson.dumps(CHAT)
    out = await upload(
        world.port, head(*headers, f"Content-Length: {len(body)}") + body, b"", endless=False, closing_s=0
    )
    assert out.status == 400 and error_code(out) == "ambiguous_credentials" and why in str(orjson.loads(out.body)), out
    # on the Messages API, in Anthropic's shape
    msg = orjson.dumps({"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    out = await upload(
        world.port,
        head(*headers, f"Content-Length: {len(msg)}", target="/v1/messages") + msg,
        b"",
        endless=False,
        closing_s=0,
    )
    assert out.status == 400 and orjson.loads(out.body)["type"] == "error", out
    assert world.upstream.seen == 0
    # the same key twice in the two headers is one credential
    same = (f"Authorization: Bearer {KEY}", f"x-api-key: {KEY}", f"Content-Length: {len(body)}")
    out = await upload(world.port, head(*same) + body, b"", endless=False, closing_s=0)
    assert out.status == 200 and world.upstream.seen == 1, out


async def test_the_admin_api_refuses_an_endless_body_without_its_token_from_the_head(world: World) -> None:
    # aiohttp's side (the front hands the admin paths over): its own lingering would read it all
    out = await upload(world.port, head("Transfer-Encoding: chunked", target="/admin/replicas"), chunk(b"x" * PIECE))
    assert out.status == 401 and out.closed and out.sent < 32 * LIMIT, out
    assert orjson.loads(out.body)["error"]["code"] == "invalid_admin_token"
    two = [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer an-admin-token-of-some-length")]
    async with aiohttp.ClientSession() as http, http.get(world.url + "/admin/replicas", headers=two) as r:
        assert r.status == 401  # two Authorization headers: neither is taken


async def test_a_target_no_parser_takes_gets_a_4xx_and_leaves_no_traceback(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    # (the front answers these in JSON, tests/integration/test_hostile_clients.py; aiohttp's parser
    # in its own plain text, its traceback dropped from the log)
    for line in (b"GET * HTTP/1.1", b"POST http://:99999/v1/chat/completions HTTP/1.1"):
        with caplog.at_level(logging.WARNING):
            out = await upload(world.port, line + b"\r\nHost: x\r\nContent-Length: 0\r\n\r\n", b"", endless=False)
        assert 400 <= out.status < 500, out
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert await ok(world.url)


async def test_a_client_that_waits_for_100_continue_is_refused_instead_and_never_sends_its_body(
    world: World,
) -> None:
    for headers, status in (
        (("Expect: 100-continue", "Content-Length: 1000000"), 401),  # no key
        ((f"Authorization: Bearer {KEY}", "Expect: 100-continue", f"Content-Length: {LIMIT + 1}"), 413),
    ):
        out = await upload(world.port, head(*headers), b"", endless=False)  # the head alone: it waits
        assert out.status == status and out.headers.get("connection") == "close", out  # not `100 Continue`
        # (aiohttp keeps the connection for its lingering time, waiting for a body that never comes)
        assert out.closed or world.path == "aiohttp", out
    body = orjson.dumps(CHAT)  # a request that will be served is told to go on
    reader, writer = await asyncio.open_connection("127.0.0.1", world.port)
    try:
        writer.write(head(f"Authorization: Bearer {KEY}", "Expect: 100-continue", f"Content-Length: {len(body)}"))
        await writer.drain()
        async with asyncio.timeout(5):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100 Continue")
            writer.write(body)
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    finally:
        writer.close()
