"""Keep-alive connections a replica closes: resent on a new connection, never a failover or a jump.

The stand-in replica here does what llama-server does: it answers `Keep-Alive` and closes the
connection after each streamed response. Whether a request sent on such a connection finds it
already closed or is read and then dropped depends on timing; the stand-in takes the second case
every time, deterministically: a request that comes on a connection after its first answer is
read and the connection closed unanswered. Without the fix such requests were counted as replica
errors and failed over, and their sessions jumped (issue 16).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest

EVENTS = [
    b'data: {"id":"c-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":"hi"},"finish_reason":null}]}\n\n',
    b'data: {"id":"c-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
    b'data: {"id":"c-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
    b'"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6,"prompt_tokens_details":{"cached_tokens":4}}}\n\n',
    b"data: [DONE]\n\n",
]


class ClosingReplica:
    """A raw HTTP/1.1 server that streams a fixed answer, says `Keep-Alive`, then closes."""

    def __init__(self, close_after: bool = True) -> None:
        self.close_after = close_after
        self.requests = 0
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                self.requests += 1
                if head.startswith(b"GET"):  # health probes and metrics
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nKeep-Alive: timeout=5\r\n\r\n")
                    await writer.drain()
                    continue
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                    b"Keep-Alive: timeout=5, max=100\r\n\r\n"
                )
                for event in EVENTS:
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                if self.close_after:
                    await reader.read(1)  # the next request on this connection (or its end): dropped
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def closing_replicas() -> AsyncIterator[Callable[..., Any]]:
    started: list[ClosingReplica] = []

    async def start(n: int, **kw: Any) -> list[tuple[ClosingReplica, str]]:
        out = []
        for _ in range(n):
            r = ClosingReplica(**kw)
            out.append((r, await r.start()))
            started.append(r)
        return out

    yield start
    for r in started:
        await r.stop()


def counter(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#") and "_created" not in line
    )


async def test_requests_on_connections_the_replica_closed_are_resent_there(closing_replicas, start_router) -> None:  # type: ignore[no-untyped-def]
    replicas = await closing_replicas(2)
    router, url = await start_router([f"r{i}={u}" for i, (_, u) in enumerate(replicas)], health_checks=False)
    body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 2})
    served = []
    async with aiohttp.ClientSession() as s:
        for _ in range(200):  # back to back on the client's own keep-alive connection
            async with s.post(url + "/v1/chat/completions", data=body, headers={"X-Session-ID": "one"}) as r:
                assert r.status == 200
                data = await r.read()
            assert data.endswith(b"data: [DONE]\n\n") and b'"usage"' not in data
            served.append(r.headers["X-Router-Replica"])
        async with s.get(url + "/metrics") as r:
            metrics = await r.text()
    assert len(set(served)) == 1  # the session never jumped
    assert counter(metrics, "router_retries_total") == 0
    assert counter(metrics, "router_failovers_total") == 0
    assert counter(metrics, "router_session_jumps_total") == 0
    reconnects = counter(metrics, "router_upstream_reconnects_total")
    assert reconnects > 0  # the race was there, and was handled
    home = router.fleet.find(served[0])
    assert home is not None and home.errors == 0 and home.requests == 200
    assert sum(r.requests for r, _ in replicas) == 200  # each request reached a replica once
    assert replicas[[f"r{i}" for i in range(2)].index(served[0])][0].connections >= 200 - reconnects


async def test_a_replica_that_refuses_connections_still_fails_over(closing_replicas, start_router) -> None:  # type: ignore[no-untyped-def]
    (_, alive_url), (dead, dead_url) = await closing_replicas(2)
    await dead.stop()  # its port now refuses connections: that is the replica's fault
    router, url = await start_router([f"alive={alive_url}", f"dead={dead_url}"], health_checks=False)
    body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True})
    async with aiohttp.ClientSession() as s:
        for i in range(20):
            async with s.post(url + "/v1/chat/completions", data=body, headers={"X-Session-ID": f"s{i}"}) as r:
                assert r.status == 200 and r.headers["X-Router-Replica"] == "alive"
                await r.read()
        async with s.get(url + "/metrics") as r:
            metrics = await r.text()
    dead_state = router.fleet.find("dead")
    assert dead_state is not None and dead_state.errors > 0  # charged, not resent on a new connection
    assert counter(metrics, 'router_upstream_reconnects_total{replica="dead"}') == 0
