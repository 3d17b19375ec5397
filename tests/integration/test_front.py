"""The front (router.proxy.front): which server answers what on one connection, pipelining, HTTP/1.0,
`Expect`, a slow reader's back-pressure, and the same answers with the front off.

Raw sockets here, so every byte the router sends is seen as sent."""

from __future__ import annotations

import asyncio
import re
import socket
from typing import Any

import orjson
import pytest

from router.engines.upstream import _Connection

CHAT = {"model": "emulated-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BODY = orjson.dumps(CHAT)


def post(body: bytes = BODY, *headers: str, version: str = "1.1", target: str = "/v1/chat/completions") -> bytes:
    head = [f"POST {target} HTTP/{version}", "Host: router.test", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def get(path: str, *headers: str) -> bytes:
    return ("\r\n".join([f"GET {path} HTTP/1.1", "Host: router.test", *headers]) + "\r\n\r\n").encode()


class Conn:
    """One raw client connection that reads whole responses (Content-Length, chunked, or to the close)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str, rcvbuf: int = 0) -> Conn:
        host, port = url.removeprefix("http://").split(":")
        sock = socket.socket()
        if rcvbuf:  # a small receive window, so that a client that does not read holds the router up soon
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        return cls(*await asyncio.open_connection(sock=sock))

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def response(self, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
        async with asyncio.timeout(timeout):
            head = await self.reader.readuntil(b"\r\n\r\n")
            while head.startswith(b"HTTP/1.1 100 "):  # an interim answer
                head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            status = int(lines[0].split()[1])
            headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            if "content-length" in headers:
                body = await self.reader.readexactly(int(headers["content-length"]))
            elif headers.get("transfer-encoding") == "chunked":
                body = b""
                while size := int((await self.reader.readuntil(b"\r\n")).strip(), 16):
                    body += await self.reader.readexactly(size)
                    await self.reader.readexactly(2)
                await self.reader.readexactly(2)
            else:
                body = await self.reader.read()
            return status, headers, body

    async def closed(self, timeout: float = 5.0) -> bool:
        async with asyncio.timeout(timeout):
            return await self.reader.read(1) == b""

    def close(self) -> None:
        self.writer.close()


async def test_proxied_and_other_requests_share_one_keep_alive_connection(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1)
    router, url = await start_router([fleet.replicas[0].url])
    conn = await Conn.open(url)
    conn.send(post())
    status, headers, body = await conn.response()
    assert status == 200 and orjson.loads(body)["choices"]
    assert "date" in headers and headers.get("connection") != "close"
    conn.send(get("/health"))  # not a proxied endpoint: aiohttp's, on the same connection
    status, _, body = await conn.response()
    assert status == 200 and orjson.loads(body)["routable"] == 1
    conn.send(post())  # aiohttp now owns the connection, and proxies through the same journey
    status, _, body = await conn.response()
    assert status == 200 and orjson.loads(body)["choices"]
    conn.close()
    m = router.metrics
    requests = m.requests.labels(router.fleet.replicas[0].id, router.policy.name, "prefix", "200", "emulated-llm")
    assert requests._value.get() == 2


async def test_a_connection_that_starts_elsewhere_is_aiohttps_whole(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1)
    _, url = await start_router([fleet.replicas[0].url])
    conn = await Conn.open(url)
    conn.send(get("/v1/nothing-here"))
    status, _, body = await conn.response()
    assert status == 404 and orjson.loads(body)["error"]["code"] == "not_found"
    conn.send(post(b"not json"))
    status, _, body = await conn.response()
    assert status == 400 and "not valid JSON" in orjson.loads(body)["error"]["message"]
    conn.send(post())
    assert (await conn.response())[0] == 200
    conn.close()


async def test_pipelined_requests_are_answered_in_order_and_an_other_one_closes_the_connection(  # type: ignore[no-untyped-def]
    start_fleet, start_router
) -> None:
    fleet = await start_fleet(1)
    _, url = await start_router([fleet.replicas[0].url])
    conn = await Conn.open(url)
    streamed = orjson.dumps({**CHAT, "stream": True})
    # three proxied (one streamed), then one for aiohttp, then one that is never read
    conn.send(post() + post(streamed) + post() + get("/health") + post())
    answers = [await conn.response() for _ in range(4)]
    assert [a[0] for a in answers] == [200, 200, 200, 200]
    assert answers[1][2].endswith(b"data: [DONE]\n\n")
    assert orjson.loads(answers[3][2])["status"] == "ok" and answers[3][1]["connection"] == "close"
    assert await conn.closed()  # what was pipelined behind it is for the client to send again
    conn.close()


async def test_http_1_0_gets_a_stream_that_ends_with_the_connection(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1)
    _, url = await start_router([fleet.replicas[0].url])
    conn = await Conn.open(url)
    conn.send(post(orjson.dumps({**CHAT, "stream": True}), version="1.0"))
    status, headers, body = await conn.response()
    assert status == 200 and "transfer-encoding" not in headers and headers["connection"] == "close"
    assert body.startswith(b"data: ") and body.endswith(b"data: [DONE]\n\n")
    conn.close()
    conn = await Conn.open(url)  # and a whole answer to a 1.0 client without keep-alive closes too
    conn.send(post(version="1.0"))
    status, headers, _ = await conn.response()
    assert status == 200 and headers["connection"] == "close" and await conn.closed()
    conn.close()


async def test_expect_100_continue_is_answered_before_the_body(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1)
    _, url = await start_router([fleet.replicas[0].url])
    conn = await Conn.open(url)
    head, _, body = post(BODY, "Expect: 100-continue").partition(b"\r\n\r\n")
    conn.send(head + b"\r\n\r\n")
    async with asyncio.timeout(2):
        assert await conn.reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
    conn.send(body)
    assert (await conn.response())[0] == 200
    conn.close()


async def test_malformed_requests_get_a_json_400_and_the_connection_closes(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1)
    _, url = await start_router([fleet.replicas[0].url])
    conn = await Conn.open(url)
    conn.send(post() + b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n")
    assert (await conn.response())[0] == 200  # what came before it is answered first
    status, headers, body = await conn.response()
    assert status == 400 and headers["connection"] == "close"
    assert orjson.loads(body)["error"]["message"].startswith("malformed HTTP request")
    assert await conn.closed()
    conn.close()


async def test_a_client_that_stops_reading_stops_the_replicas_stream(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1)
    router, url = await start_router([fleet.replicas[0].url], total_timeout_s=30, idle_timeout_s=30)
    conn = await Conn.open(url, rcvbuf=4096)
    conn.send(post(orjson.dumps({**CHAT, "stream": True, "max_tokens": 60_000})))
    upstream = router.upstream_client()

    def pooled() -> list[_Connection]:
        return [c for pool in upstream.pools.values() for c in pool.conns]

    # the client reads nothing: its buffers fill, then the router's, and then the router stops reading the replica
    async with asyncio.timeout(15):
        while not (pooled() and pooled()[0].paused):
            await asyncio.sleep(0.05)
    response = pooled()[0].response
    assert response is not None and response._buffered < 4 << 20  # bounded, not the whole stream
    assert fleet.replicas[0].engine.stats()["running"] == 1  # still streaming: slowed, not cut
    conn.close()


@pytest.mark.parametrize("front", [True, False])
async def test_the_same_answers_with_the_front_on_and_off(start_fleet, start_router, front: bool) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1)
    _, url = await start_router([fleet.replicas[0].url], front=front, max_body_bytes=10_000, max_header_bytes=4096)
    answers: list[Any] = []
    for request in (
        post(),
        post(orjson.dumps({**CHAT, "stream": True})),
        post(b"[1]"),
        post(b"x" * 20_000),
        post(BODY, "X-Big: " + "y" * 4100),
        post(BODY, target="/v1/chat/completions?x=1"),
        post(BODY, target="http://elsewhere/v1/chat/completions"),
    ):
        conn = await Conn.open(url)
        conn.send(request)
        status, headers, body = await conn.response()
        kind = headers.get("content-type", "").split(";")[0]
        error = orjson.loads(body)["error"] if status >= 400 else None
        error = (error["type"], error["code"]) if error else None
        answers.append((status, kind, error, bool(re.search(rb"data: \[DONE\]", body))))
        conn.close()
    assert answers == [
        (200, "application/json", None, False),
        (200, "text/event-stream", None, True),
        (400, "application/json", ("invalid_request_error", None), False),
        (413, "application/json", ("invalid_request_error", "request_too_large"), False),
        (431, "application/json", ("invalid_request_error", "request_too_large"), False),
        (200, "application/json", None, False),
        (200, "application/json", None, False),
    ]


async def test_requests_that_arrive_a_byte_at_a_time_are_whole(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1)
    _, url = await start_router([fleet.replicas[0].url])
    for request, check in (
        (post(), lambda body: orjson.loads(body)["choices"]),  # the front's, its head and body in pieces
        (get("/health"), lambda body: orjson.loads(body)["status"] == "ok"),  # aiohttp's: every piece handed over
    ):
        conn = await Conn.open(url)
        for i in range(len(request)):
            conn.send(request[i : i + 1])
            await conn.writer.drain()
            if i % 16 == 0:
                await asyncio.sleep(0.001)  # separate reads, not one coalesced buffer
        status, _, body = await conn.response()
        assert status == 200 and check(body)
        conn.close()


async def test_an_upgrade_on_a_proxied_endpoint_is_refused_and_closes(start_fleet, start_router) -> None:  # type: ignore[no-untyped-def]
    fleet = await start_fleet(1)
    _, url = await start_router([fleet.replicas[0].url])
    conn = await Conn.open(url)
    conn.send(post(BODY, "Connection: Upgrade", "Upgrade: h2c") + post())
    status, headers, body = await conn.response()
    assert (
        status == 400 and headers["connection"] == "close" and "not upgraded" in orjson.loads(body)["error"]["message"]
    )
    assert await conn.closed()  # its body was never read as a request, nor what came after it
    conn.close()
