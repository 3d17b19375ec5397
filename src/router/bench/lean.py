"""Lean pieces for `router-bench proxy`: the floor of a uvloop + httptools pass-through, a canned
replica that costs next to nothing, and a load generator on raw connections.

- `floor_main`: the least a proxy on uvloop and httptools does: parse the request, send it on a
  pooled keep-alive connection (router.engines.upstream), relay the answer chunked as it comes. No
  routing, no limits, no metrics: what the front (router.proxy.front) costs above it is its work.
- `canned_main`: a replica that answers every completion at once with fixed bytes (a JSON body,
  or `max_tokens` SSE events and a usage event when `stream` is set), and `/health`, `/metrics`
  and `/v1/models` as a replica would, so that a router in front of it, not the replica, is what
  saturates.
- `saturate`: closed-loop load on `connections` keep-alive connections for `duration_s`; requests
  per second and latency percentiles, from the client's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import httptools
import orjson
import uvloop

from router.engines.upstream import Upstream
from router.measures import percentile

EVENT = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"emulated-llm",'
    b'"choices":[{"index":0,"delta":{"content":"tok "},"finish_reason":null}]}\n\n'
)
FINISH = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"emulated-llm",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
)
USAGE = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"emulated-llm","choices":[],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,"prompt_tokens_details":{"cached_tokens":0}}}\n\n'
)
WHOLE = orjson.dumps(
    {
        "id": "c",
        "object": "chat.completion",
        "created": 1,
        "model": "emulated-llm",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "tok"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
)

# what routers ask a replica for besides completions (smg lists its models before it routes to it)
GETS = {
    b"/health": (b"application/json", b"200 OK", b"{}"),
    b"/metrics": (b"text/plain; version=0.0.4", b"200 OK", b""),
    b"/v1/models": (
        b"application/json",
        b"200 OK",
        b'{"object":"list","data":[{"id":"emulated-llm","object":"model","owned_by":"router-bench"}]}',
    ),
}


class _Server(asyncio.Protocol):
    """A request parser that hands each whole request to `handle(self, method, path, body)`."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method, path, body = self.parser.get_method(), self.url.split(b"?")[0], b"".join(self.body)
        self.url, self.body = b"", []
        self.handle(method, path, body)

    def handle(self, method: bytes, path: bytes, body: bytes) -> None:
        raise NotImplementedError


class _Canned(_Server):
    def handle(self, method: bytes, path: bytes, body: bytes) -> None:
        if self.transport is None:
            return
        if method != b"POST":
            kind, status, reply = GETS.get(path, (b"application/json", b"404 Not Found", b'{"error":"not found"}'))
            head = b"HTTP/1.1 %b\r\nContent-Type: %b\r\nContent-Length: %d\r\n\r\n" % (status, kind, len(reply))
            self.transport.write(head + reply)
            return
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError:
            request = {}
        if request.get("stream") is True:
            n = int(request.get("max_tokens") or 1)
            events = [b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n']
            events += [EVENT] * (n - 1) + [FINISH]
            if (request.get("stream_options") or {}).get("include_usage"):
                events.append(USAGE)
            events.append(b"data: [DONE]\n\n")
            payload = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            self.transport.write(head + payload)
            return
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(WHOLE)
        self.transport.write(head + WHOLE)


class _Floor(_Server):
    def __init__(self, upstream: Upstream, base: str) -> None:
        super().__init__()
        self.upstream, self.base = upstream, base
        self.tasks: set[asyncio.Task[None]] = set()

    def handle(self, method: bytes, path: bytes, body: bytes) -> None:
        task = asyncio.get_running_loop().create_task(self.relay(path, body))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def relay(self, path: bytes, body: bytes) -> None:
        try:
            resp = await self.upstream.post(self.base + path.decode(), body, {"Content-Type": "application/json"}, 2.0)
        except OSError:
            if self.transport is not None:
                self.transport.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            return
        try:
            kind = (resp.headers.get("Content-Type") or "application/octet-stream").encode()
            if self.transport is None:
                return
            head = b"HTTP/1.1 %d OK\r\nContent-Type: %b\r\nTransfer-Encoding: chunked\r\n\r\n" % (resp.status, kind)
            self.transport.write(head)
            while chunk := await resp.readany():
                if self.transport is None:
                    return
                self.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            if self.transport is not None:
                self.transport.write(b"0\r\n\r\n")
        finally:
            resp.release()


def _serve(protocols: Callable[[], Callable[[], asyncio.Protocol]], port: int) -> None:
    """Serve on loopback `port` with the protocol factory `protocols()` makes inside the loop."""

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(protocols(), "127.0.0.1", port, reuse_address=True)
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(main())


def canned_main(port: int) -> None:
    _serve(lambda: _Canned, port)


def floor_main(port: int, upstream: str) -> None:
    _serve(lambda: functools.partial(_Floor, Upstream(), upstream), port)  # one pool for every connection


# -- the load generator ----------------------------------------------------------------------------------


class _Client(asyncio.Protocol):
    """One keep-alive connection sending `request` again as soon as each answer is whole, until `end`."""

    def __init__(self, request: bytes, end: float, latencies: list[float], done: asyncio.Future[None]) -> None:
        self.request, self.end, self.latencies, self.done = request, end, latencies, done
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.sent = 0.0
        self.errors = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._send()

    def _send(self) -> None:
        assert self.transport is not None
        self.sent = time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.errors += 1
            self._finish()

    def on_message_complete(self) -> None:
        now = time.perf_counter()
        if self.parser.get_status_code() == 200:
            self.latencies.append(now - self.sent)
        else:
            self.errors += 1
        if now < self.end:
            self._send()
        else:
            self._finish()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.done.done():
            self.errors += 1
            self.done.set_result(None)

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()


async def saturate(url: str, connections: int, duration_s: float, body: bytes) -> dict[str, Any]:
    """Closed-loop load: `connections` clients, each sending the next request when its answer is in."""
    host, port = url.removeprefix("http://").split(":")
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (host.encode(), len(body), body)
    )
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    start = time.perf_counter()
    end = start + duration_s
    clients: list[_Client] = []
    for _ in range(connections):
        done: asyncio.Future[None] = loop.create_future()
        client = _Client(request, end, latencies, done)
        await loop.create_connection(lambda c=client: c, host, int(port))  # type: ignore[misc]
        clients.append(client)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(duration_s + 30):
            await asyncio.gather(*(c.done for c in clients))
    elapsed = time.perf_counter() - start
    for c in clients:
        if c.transport is not None:
            c.transport.close()
    enough = len(latencies) >= 100  # fewer: no P99 worth the name
    return {
        "requests_per_s": len(latencies) / elapsed,
        "latency_ms_p50": percentile(latencies, 50) * 1000 if enough else None,
        "latency_ms_p99": percentile(latencies, 99) * 1000 if enough else None,
        "errors": sum(c.errors for c in clients),
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--canned":
        canned_main(int(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "--floor":
        floor_main(int(sys.argv[2]), sys.argv[3])
    else:
        print("usage: python -m router.bench.lean --canned PORT | --floor PORT UPSTREAM_URL", file=sys.stderr)
        sys.exit(2)
